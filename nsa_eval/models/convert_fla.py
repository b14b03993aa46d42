"""flash-linear-attention NSA checkpoints (config model_type "nsa") -> `NSAForCausalLM`.

fla's NSA (fla-org/flash-linear-attention `fla/models/nsa`, `fla/layers/nsa.py`) is this model with
- `compression="mean"`: parameter-free mean pooling of rotated keys/values over non-overlapping
  blocks, so l = d = l' = fla's `block_size`;
- `shared_kv=True`: one k_proj / v_proj feeds all three branches;
- `g_proj`: Linear(hidden, 3 * num_heads), reshaped (head, 3) and passed through a sigmoid;
- forced blocks: the first block, the query's own block and the one before it (num_init=1,
  num_local=2); `window_size=0` means no window branch (`window=0` here; fla still has the third
  gate in `g_proj` and ignores it, this model multiplies that branch by 0).

A field missing from config.json takes fla's NSAConfig default (`FLA_DEFAULTS`: `num_kv_heads=4`,
`window_size=512`, `head_dim=32`, ...), so the model is the one fla builds from the same file; only
`hidden_size`, `num_hidden_layers`, `num_heads` and `vocab_size` must be given. A value fla cannot run
or this model cannot take (num_heads not a multiple of num_kv_heads, a block_size or block_counts that
is not a power of two, a null window_size, a non-integer size, ...) raises one-line `UsageError`
naming config.json, the field, its value and what was expected.

Only one parameter is renamed (`model.embeddings` -> `model.embed_tokens`); every other name is the
same. `convert_fla_state_dict` asserts that keys and shapes match exactly, as nanoGPT's
`from_pretrained` does.

    python -m nsa_eval.models.convert_fla FLA_DIR OUT_DIR
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from nsa_eval.errors import UsageError

FLA_MODEL_TYPE = "nsa"
RENAMES = {"model.embeddings.weight": "model.embed_tokens.weight"}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
)


# fla's NSAConfig defaults for every field the conversion reads (fla/models/nsa/configuration_nsa.py, the
# same from the model's first commit 7229f4ae through 0.6.0): a config.json without a field builds, in
# fla, the model these give, so the conversion must use them too.
FLA_DEFAULTS = {
    "num_kv_heads": 4,
    "head_dim": 32,
    "qkv_bias": False,
    "block_size": 64,
    "block_counts": 16,
    "window_size": 512,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "hidden_ratio": 4,
    "intermediate_size": None,
    "hidden_act": "swish",
    "norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": None,
}
# fla defaults these too (2048, 24, 64, 32000), but a config.json without them is refused: the weights'
# shapes would fail to match anyway, and a guessed model is no help.
FLA_REQUIRED = ("hidden_size", "num_hidden_layers", "num_heads", "vocab_size")
NUM_FORCED_BLOCKS = 3  # fla always selects the first, the previous and the query's own block


def fla_intermediate_size(hidden_size: int, hidden_ratio: int | None, intermediate_size: int | None) -> int:
    """fla's GatedMLP width: 2/3 * hidden * ratio rounded up to a multiple of 256, unless given."""
    if intermediate_size is not None:
        return int(intermediate_size)
    width = int(hidden_size * (4 if hidden_ratio is None else hidden_ratio) * 2 / 3)
    return 256 * ((width + 255) // 256)


class _FlaFields:
    """Typed reads of an fla config.json: fla's default where a field is missing, UsageError where a
    value is unusable, naming `source`, the field, its value and what was expected."""

    def __init__(self, fla: dict, source: str):
        self.fla, self.source = fla, source

    def fail(self, field: str, value, expected: str):
        raise UsageError(f"{self.source}: {field} is {value!r}, expected {expected}")

    def get(self, field: str):
        return self.fla.get(field, FLA_DEFAULTS.get(field))

    def integer(self, field: str, minimum: int = 1, *, allow_none: bool = False, expected: str | None = None):
        value = self.get(field)
        if value is None and allow_none:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            self.fail(field, value, expected or f"an integer >= {minimum}")
        return value

    def power_of_two(self, field: str, minimum: int, why: str) -> int:
        value = self.integer(field, minimum, expected=f"a power of two >= {minimum} ({why})")
        if value & (value - 1):
            self.fail(field, value, f"a power of two >= {minimum} ({why})")
        return value

    def number(self, field: str, *, allow_none: bool = False):
        value = self.get(field)
        if value is None and allow_none:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            self.fail(field, value, "a number > 0")
        return float(value)

    def flag(self, field: str) -> bool:
        value = self.get(field)
        if not isinstance(value, bool):
            self.fail(field, value, "true or false")
        return value


def nsa_config_from_fla(fla: dict, source: str | Path = "fla config"):
    """An `NSAConfig` for fla's config.json `fla`, read from `source` (named in errors).

    A missing field takes fla's NSAConfig default (`FLA_DEFAULTS`), so the model is the one fla builds
    from the same file. UsageError on a value fla cannot run or this model lacks.
    """
    from nsa_eval.models.configuration_nsa import NSAConfig

    source = str(source)
    if not isinstance(fla, dict):
        raise UsageError(f"{source}: expected a JSON object, got {type(fla).__name__}")
    if fla.get("model_type") != FLA_MODEL_TYPE:
        raise UsageError(f"{source}: model_type is {fla.get('model_type')!r}, expected 'nsa' "
                         "(an fla NSA config)")
    if fla.get("attnres_block_size") is not None:
        raise UsageError(f"{source}: attnres_block_size is {fla['attnres_block_size']!r}, expected null "
                         "(attention residuals are not supported by nsa_eval)")
    if fla.get("hidden_act", FLA_DEFAULTS["hidden_act"]) not in ("swish", "silu"):
        raise UsageError(f"{source}: hidden_act is {fla['hidden_act']!r}, expected 'swish'")
    for field in FLA_REQUIRED:
        if field not in fla:
            raise UsageError(f"{source}: {field} is missing, expected an integer >= 1 (no default guessed)")
    f = _FlaFields(fla, source)
    hidden_size, num_heads = f.integer("hidden_size"), f.integer("num_heads")
    # fla's layer: num_kv_heads None means one KV head per query head (fla/layers/nsa.py)
    num_kv_heads = f.integer("num_kv_heads", allow_none=True, expected="an integer >= 1 or null")
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if num_heads % num_kv_heads:
        f.fail("num_kv_heads", num_kv_heads, f"a divisor of num_heads ({num_heads})")
    # fla has no null head_dim (its q_proj is num_heads * head_dim); RoPE rotates halves, so even
    head_dim = f.integer("head_dim", 2, expected="an even integer >= 2")
    if head_dim % 2:
        f.fail("head_dim", head_dim, "an even integer >= 2 (RoPE rotates half of it)")
    # fla's Triton kernels take power-of-two blocks only (tl.arange), and select
    # next_power_of_2(block_counts) blocks (parallel_nsa_topk's S) where its naive reference selects
    # block_counts: other counts are ambiguous, so refused
    block_size = f.power_of_two("block_size", 1, "fla's kernels take no other")
    block_counts = f.power_of_two(
        "block_counts", 4, "fla's kernels select next_power_of_2(block_counts) blocks, its naive "
        f"reference block_counts; {NUM_FORCED_BLOCKS} blocks are always selected")
    hidden_ratio = f.number("hidden_ratio", allow_none=True)
    intermediate_size = f.integer("intermediate_size", allow_none=True, expected="an integer >= 1 or null")
    # only sizes fla's RoPE cache (null: no minimum); here a length the model reports
    max_positions = f.integer("max_position_embeddings", allow_none=True, expected="an integer >= 1 or null")
    fields = dict(
        vocab_size=f.integer("vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=fla_intermediate_size(hidden_size, hidden_ratio, intermediate_size),
        num_hidden_layers=f.integer("num_hidden_layers"),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=FLA_DEFAULTS["max_position_embeddings"] if max_positions is None
        else max_positions,
        rope_theta=f.number("rope_theta"),
        rms_norm_eps=f.number("norm_eps"),
        attention_bias=f.flag("qkv_bias"),
        compression="mean",
        block_len=block_size,
        stride=block_size,
        select_size=block_size,
        num_selected=block_counts,
        num_init=1,
        num_local=2,
        # fla's parallel_nsa runs the window branch when window_size > 0 (and fails on null)
        window=f.integer("window_size", 0, expected="an integer >= 0 (0: no sliding-window branch)"),
        shared_kv=True,
        gate_hidden_size=None,
        tie_word_embeddings=f.flag("tie_word_embeddings"),
        bos_token_id=f.get("bos_token_id"),
        eos_token_id=f.get("eos_token_id"),
        pad_token_id=f.get("pad_token_id"),
    )
    try:
        return NSAConfig(**fields)
    except ValueError as err:  # NSAConfig.validate_nsa: a combination the checks above let through
        raise UsageError(f"{source}: {err}") from err


def convert_fla_state_dict(fla_state: dict, model) -> dict:
    """fla parameter names -> `model`'s; asserts the same keys and the same shape for each.

    Args:
        fla_state: fla's state dict (tensors by name).
        model: an `NSAForCausalLM` built from `nsa_config_from_fla`.

    Returns:
        A state dict `model.load_state_dict(..., strict=True)` accepts.
    """
    target = model.state_dict()
    converted = {RENAMES.get(name, name): tensor for name, tensor in fla_state.items()}
    if model.config.tie_word_embeddings:
        converted.setdefault("lm_head.weight", converted.get("model.embed_tokens.weight"))
    # fla's NSA norms always have a weight (it ignores elementwise_affine); one absent from the file is
    # what fla's from_pretrained initialises it to: ones
    for name, tensor in target.items():
        if name.endswith("norm.weight") and name not in converted:
            converted[name] = tensor.new_ones(tensor.shape)
    missing = sorted(set(target) - set(converted))
    unexpected = sorted(set(converted) - set(target))
    if missing or unexpected:
        raise UsageError(f"fla checkpoint does not match: missing {missing[:8]}, unexpected {unexpected[:8]}")
    for name, tensor in converted.items():
        if tuple(tensor.shape) != tuple(target[name].shape):
            raise UsageError(f"fla checkpoint: {name} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(target[name].shape)}")
    return converted


def read_fla_state_dict(directory: Path) -> dict:
    """Every tensor of an fla checkpoint directory (safetensors, sharded or not, or pytorch_model.bin)."""
    import torch
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if files:
        state = {}
        for file in files:
            state.update(load_file(str(file)))
        return state
    bins = sorted(directory.glob("pytorch_model*.bin"))
    if bins:
        state = {}
        for file in bins:
            state.update(torch.load(file, map_location="cpu", weights_only=True))
        return state
    raise UsageError(f"{directory}: no *.safetensors or pytorch_model*.bin weights")


def read_fla_config(directory: Path) -> dict:
    """`directory`/config.json as a dict; UsageError when it is absent or not JSON."""
    path = directory / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"{directory}: no config.json; expected an fla NSA checkpoint directory") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UsageError(f"{path}: not readable as JSON ({err})") from err


def load_fla_model(directory: str | Path, *, dtype=None):
    """Build an `NSAForCausalLM` from an fla NSA checkpoint directory, in memory."""
    from nsa_eval.models.modeling_nsa import NSAForCausalLM

    directory = Path(directory)
    config = nsa_config_from_fla(read_fla_config(directory), directory / "config.json")
    model = NSAForCausalLM(config)
    model.load_state_dict(convert_fla_state_dict(read_fla_state_dict(directory), model), strict=True)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def convert_fla_checkpoint(src: str | Path, out: str | Path) -> Path:
    """Convert the fla checkpoint in `src` and save it (safetensors, config, tokenizer) to `out`."""
    src, out = Path(src), Path(out)
    if not (src / "config.json").is_file():
        raise UsageError(f"{src}: no config.json; expected an fla NSA checkpoint directory")
    model = load_fla_model(src)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m nsa_eval.models.convert_fla FLA_DIR OUT_DIR", file=sys.stderr)
        return 2
    try:
        print(convert_fla_checkpoint(*argv))
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
