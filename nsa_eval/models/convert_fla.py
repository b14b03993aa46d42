"""flash-linear-attention NSA checkpoints (config model_type "nsa") -> `NSAForCausalLM`.

fla's NSA (fla-org/flash-linear-attention `fla/models/nsa`, `fla/layers/nsa.py`) is this model with
- `compression="mean"`: parameter-free mean pooling of rotated keys/values over non-overlapping
  blocks, so l = d = l' = fla's `block_size`;
- `shared_kv=True`: one k_proj / v_proj feeds all three branches;
- `g_proj`: Linear(hidden, 3 * num_heads), reshaped (head, 3) and passed through a sigmoid;
- forced blocks: the first block, the query's own block and the one before it (num_init=1,
  num_local=2); `window_size=0` means no window branch (`window=0` here).

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


def fla_intermediate_size(hidden_size: int, hidden_ratio: int | None, intermediate_size: int | None) -> int:
    """fla's GatedMLP width: 2/3 * hidden * ratio rounded up to a multiple of 256, unless given."""
    if intermediate_size is not None:
        return int(intermediate_size)
    width = int(hidden_size * (hidden_ratio or 4) * 2 / 3)
    return 256 * ((width + 255) // 256)


def nsa_config_from_fla(fla: dict):
    """An `NSAConfig` for fla's config.json `fla`; UsageError on a feature this model lacks."""
    from nsa_eval.models.configuration_nsa import NSAConfig

    if fla.get("model_type") != FLA_MODEL_TYPE:
        raise UsageError(f"not an fla NSA config: model_type is {fla.get('model_type')!r}, expected 'nsa'")
    if fla.get("attnres_block_size") is not None:
        raise UsageError("fla config: attnres_block_size (attention residuals) is not supported by nsa_eval")
    if fla.get("hidden_act", "swish") not in ("swish", "silu"):
        raise UsageError(f"fla config: hidden_act {fla['hidden_act']!r} is not supported; expected swish")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_heads", "vocab_size") if k not in fla]
    if missing:
        raise UsageError(f"fla config is missing {', '.join(missing)}")
    num_heads = fla["num_heads"]
    block_size = fla.get("block_size", 64)
    return NSAConfig(
        vocab_size=fla["vocab_size"],
        hidden_size=fla["hidden_size"],
        intermediate_size=fla_intermediate_size(fla["hidden_size"], fla.get("hidden_ratio", 4),
                                                fla.get("intermediate_size")),
        num_hidden_layers=fla["num_hidden_layers"],
        num_attention_heads=num_heads,
        num_key_value_heads=fla.get("num_kv_heads") or num_heads,
        head_dim=fla.get("head_dim", 32),
        hidden_act="silu",
        max_position_embeddings=fla.get("max_position_embeddings", 2048),
        rope_theta=fla.get("rope_theta", 10000.0),
        rms_norm_eps=fla.get("norm_eps", 1e-6),
        attention_bias=bool(fla.get("qkv_bias", False)),
        compression="mean",
        block_len=block_size,
        stride=block_size,
        select_size=block_size,
        num_selected=int(fla.get("block_counts", 16)),
        num_init=1,
        num_local=2,
        window=int(fla.get("window_size") or 0),
        shared_kv=True,
        gate_hidden_size=None,
        tie_word_embeddings=fla.get("tie_word_embeddings", False),
        bos_token_id=fla.get("bos_token_id"),
        eos_token_id=fla.get("eos_token_id"),
        pad_token_id=fla.get("pad_token_id"),
    )


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
    # elementwise_affine=False: fla's norms have no weight, i.e. a weight of ones
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


def load_fla_model(directory: str | Path, *, dtype=None):
    """Build an `NSAForCausalLM` from an fla NSA checkpoint directory, in memory."""
    from nsa_eval.models.modeling_nsa import NSAForCausalLM

    directory = Path(directory)
    config = nsa_config_from_fla(json.loads((directory / "config.json").read_text()))
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
