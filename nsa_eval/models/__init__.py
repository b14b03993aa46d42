"""NSA models and checkpoints, and the lm-eval adapter that evaluates NSA and baseline models alike.

- `NSAConfig`, `NSAForCausalLM` (`configuration_nsa.py`, `modeling_nsa.py`): the NSA model as a
  Hugging Face model (model_type `nsa_eval`). Importing `modeling_nsa` registers it with
  `AutoConfig`, `AutoModel` and `AutoModelForCausalLM`.
- `load_pretrained(pretrained, *, dtype, device)` (`loading.py`): short names (`smollm2-135m`,
  `nsa-tiny`, `full-tiny`), local directories, hub names when online.
- `convert_fla_checkpoint` (`convert_fla.py`): flash-linear-attention NSA checkpoints -> this model.
- `lm_adapter.py`: the lm-eval model `nsa-eval` (registered lazily on `import nsa_eval`).

Names are imported on first use, so `import nsa_eval.models` stays cheap (no torch).
"""

from __future__ import annotations

import importlib

_LAZY = {
    "NSAConfig": "nsa_eval.models.configuration_nsa",
    "NSAForCausalLM": "nsa_eval.models.modeling_nsa",
    "NSAModel": "nsa_eval.models.modeling_nsa",
    "NSACache": "nsa_eval.models.cache_nsa",
    "activated_tokens": "nsa_eval.models.modeling_nsa",
    "load_pretrained": "nsa_eval.models.loading",
    "load_for_eval": "nsa_eval.models.loading",
    "resolve_checkpoint": "nsa_eval.models.loading",
    "attention_stats": "nsa_eval.models.loading",
    "KNOWN_CHECKPOINTS": "nsa_eval.models.loading",
    "convert_fla_checkpoint": "nsa_eval.models.convert_fla",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
