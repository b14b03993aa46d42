"""Training-free attention methods for Llama-family Hugging Face models, at a matched, measured budget.

    from nsa_eval.methods import apply_attention, attention_stats
    apply_attention(model, "quest", budget=2560, sink=128, local=512)
    model.generate(...)
    attention_stats(model)["held"]["max"]  # <= 2560, or BudgetExceededError was raised

Methods (`METHODS`): full, sink_window, topk, quest, h2o. See docs/methods.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from nsa_eval.errors import UsageError
from nsa_eval.methods.base import (
    ATTN_IMPLEMENTATION,
    MODULE_ATTRIBUTE,
    AttentionController,
    AttentionMethod,
    BudgetConfig,
    BudgetExceededError,
    nsa_eval_attention,
)
from nsa_eval.methods.full import FullAttention
from nsa_eval.methods.h2o import H2O
from nsa_eval.methods.quest import Quest
from nsa_eval.methods.sink_window import SinkWindow
from nsa_eval.methods.topk import TopK
from nsa_eval.registry import Registry

__all__ = [
    "METHODS",
    "AttentionMethod",
    "BudgetExceededError",
    "apply_attention",
    "attention_stats",
    "reset_attention_stats",
]

METHODS: Registry[type[AttentionMethod]] = Registry("attention method")
for _cls in (FullAttention, SinkWindow, TopK, Quest, H2O):
    METHODS.register(_cls.name)(_cls)

CONTROLLER_ATTRIBUTE = "_nsa_eval_controller"


def apply_attention(
    model,
    method: str,
    budget: int = 2560,
    sink: int = 128,
    local: int = 512,
    sparse_prefill: bool = True,
    dense_layers: int = 0,
    **method_params: Any,
):
    """Switch a loaded Llama-family model (Llama, Qwen2/3, Mistral, SmolLM2) to an attention method.

    Weights are untouched; calling it again with another method replaces the previous one (and resets
    the statistics). `full` is transformers' SDPA with statistics.

    Args:
        model: a transformers causal LM whose attention modules call the attention interface.
        method: one of `METHODS` (full, sink_window, topk, quest, h2o).
        budget: keys each query may attend to, sink and local included (2,560 = 128 + 512 + 1,920).
        sink: leading keys always kept.
        local: most recent keys always kept, the query itself included.
        sparse_prefill: hold every query to the budget (True), or only decode steps, i.e. forward calls
            with one query per sequence (False: the reference H2O and Quest behaviour).
        dense_layers: the first `dense_layers` layers attend densely (Quest's code keeps 2).
        **method_params: the method's own fields, e.g. `page_size=16` for quest, `query_chunk=1024`.

    Returns:
        The model, for chaining.

    Raises:
        UsageError: unknown method or parameter, or inconsistent budget settings.
    """
    method_cls = METHODS.get(method)
    config = _budget_config(budget, sink, local, sparse_prefill, dense_layers)
    valid = sorted(f.name for f in dataclasses.fields(method_cls))
    unknown = sorted(set(method_params) - set(valid))
    if unknown:
        raise UsageError(
            f"unknown parameter(s) {', '.join(map(repr, unknown))} for attention method {method!r}; "
            f"expected some of: {', '.join(valid)}"
        )
    instance = method_cls(**method_params)
    instance.check(config)

    modules = _attention_modules(model)
    layers = {int(m.layer_idx) for m in modules}
    if dense_layers > len(layers):
        raise UsageError(f"dense_layers={dense_layers} exceeds the model's {len(layers)} layers")

    _register_interface()
    if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)

    old = getattr(model, CONTROLLER_ATTRIBUTE, None)
    if old is not None and old.hook_handle is not None:
        old.hook_handle.remove()
    controller = AttentionController(instance, config)
    controller.hook_handle = _decoder(model).register_forward_pre_hook(
        controller.begin_forward, with_kwargs=True
    )
    setattr(model, CONTROLLER_ATTRIBUTE, controller)
    for module in modules:
        setattr(module, MODULE_ATTRIBUTE, controller)
    return model


def attention_stats(model) -> dict[str, Any]:
    """Keys attended per query since the last `apply_attention`/`reset_attention_stats`.

    Returns:
        A JSON-able dict: `method`, `params`, `budget`, `sink`, `local`, `sparse_prefill`,
        `dense_layers`; over all (query, query head) pairs of all layers `queries`, `mean`, `max`
        (keys attended, sink and local included) and `kv_read_mean` (KV tokens read per (query, KV
        head): the union over the group's heads); the same over queries held to the budget in `held`,
        per layer in `layers` (a list of dicts with `layer`), and per phase in `phases`
        (`prefill`: calls with more than one query per sequence, `decode`: one).

    Raises:
        BudgetExceededError: a query held to the budget attended to more keys (also raised during the
            forward pass that did it).
    """
    controller = _controller(model)
    summary = controller.stats.summary()
    cfg = controller.config
    if controller.method.sparse and summary["held"]["max"] > cfg.budget:
        raise BudgetExceededError(f"a query attended to {summary['held']['max']} keys > budget {cfg.budget}")
    return {
        "method": controller.method.name,
        "params": controller.method.params(),
        **dataclasses.asdict(cfg),
        **summary,
    }


def reset_attention_stats(model) -> None:
    """Start counting afresh (the method and budget stay)."""
    controller = _controller(model)
    controller.stats = type(controller.stats)()


# ----------------------------------------------------------------------------------------------------------


def _budget_config(budget, sink, local, sparse_prefill, dense_layers) -> BudgetConfig:
    for name, value, low in (("budget", budget, 1), ("sink", sink, 0), ("local", local, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise UsageError(f"{name} must be an integer >= {low}, got {value!r}")
    if isinstance(dense_layers, bool) or not isinstance(dense_layers, int) or dense_layers < 0:
        raise UsageError(f"dense_layers must be an integer >= 0, got {dense_layers!r}")
    if not isinstance(sparse_prefill, bool):
        raise UsageError(f"sparse_prefill must be True or False, got {sparse_prefill!r}")
    if budget < sink + local:
        raise UsageError(
            f"budget ({budget}) must be at least sink + local ({sink} + {local} = {sink + local}): "
            "the budget counts the sink and local keys"
        )
    return BudgetConfig(budget, sink, local, sparse_prefill, dense_layers)


def _attention_modules(model) -> list:
    modules = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "num_key_value_groups")]
    if not modules or not hasattr(model, "config"):
        raise UsageError(
            f"{type(model).__name__} has no Llama-style attention modules (with layer_idx and "
            "num_key_value_groups); nsa_eval.methods supports Llama-family transformers models"
        )
    return modules


def _decoder(model):
    """The module whose forward receives the cache: the base model under a *ForCausalLM."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    return decoder if decoder is not None else model


def _controller(model) -> AttentionController:
    controller = getattr(model, CONTROLLER_ATTRIBUTE, None)
    if controller is None:
        raise UsageError("no attention method applied to this model; call apply_attention(model, ...) first")
    return controller


_registered = False


def _register_interface() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, nsa_eval_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)  # bool [B, 1, T, S], None if plain causal
    _registered = True
