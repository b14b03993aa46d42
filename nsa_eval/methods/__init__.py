"""Training-free attention methods for Llama-family Hugging Face models, at a matched, measured budget.

    from nsa_eval.methods import apply_attention, attention_stats
    apply_attention(model, "quest", budget=2560, sink=128, local=512)
    model.generate(...)
    attention_stats(model)["held"]["max"]  # <= 2560, or BudgetExceededError was raised

Methods (`METHODS`): full, sink_window, topk, quest, h2o. See docs/methods.md. Decode steps of fixed
shape, for CUDA graphs: `model.generate(..., cache=StaticDecodeCache(capacity))`.
"""

from __future__ import annotations

import dataclasses
import types
from contextlib import contextmanager
from typing import Any

from nsa_eval.errors import UsageError
from nsa_eval.methods.base import AttentionMethod, BudgetConfig
from nsa_eval.methods.controller import (
    ATTN_IMPLEMENTATION,
    MODULE_ATTRIBUTE,
    AttentionController,
    BudgetExceededError,
    nsa_eval_attention,
)
from nsa_eval.methods.full import FullAttention
from nsa_eval.methods.h2o import H2O
from nsa_eval.methods.quest import Quest
from nsa_eval.methods.sink_window import SinkWindow
from nsa_eval.methods.static_cache import StaticDecodeCache
from nsa_eval.methods.topk import TopK
from nsa_eval.registry import Registry

__all__ = [
    "METHODS",
    "AttentionMethod",
    "BudgetExceededError",
    "StaticDecodeCache",
    "apply_attention",
    "attention_stats",
    "attention_stats_paused",
    "check_model_config",
    "hf_config_from_dict",
    "reset_attention_stats",
    "validate_params",
]

METHODS: Registry[type[AttentionMethod]] = Registry("attention method")
for _cls in (FullAttention, SinkWindow, TopK, Quest, H2O):
    METHODS.register(_cls.name)(_cls)

CONTROLLER_ATTRIBUTE = "_nsa_eval_controller"


def apply_attention(
    model,
    method: str,
    budget: int = BudgetConfig.budget,
    sink: int = BudgetConfig.sink,
    local: int = BudgetConfig.local,
    sparse_prefill: bool = True,
    dense_layers: int = 0,
    **method_params: Any,
):
    """Switch a loaded Llama-family model (Llama, Qwen2/3, Mistral, SmolLM2) to an attention method.

    Full-attention models only: a config with an active sliding window is refused
    (`check_model_config`), and so is any KV cache but a plain `DynamicCache` at forward time.

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
        UsageError: unknown method or parameter, inconsistent budget settings (checked by
            `validate_params`, with the same message), or a model this layer does not support (no
            Llama-style attention modules, or an active sliding window: see `check_model_config`).
    """
    instance, config = _build(method, budget, sink, local, sparse_prefill, dense_layers, method_params)

    modules = _attention_modules(model)
    check_model_config(model.config)
    layers = {int(m.layer_idx) for m in modules}
    if dense_layers > len(layers):
        raise UsageError(f"dense_layers={dense_layers} exceeds the model's {len(layers)} layers")

    _register_interface()
    if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)

    old = getattr(model, CONTROLLER_ATTRIBUTE, None)
    if old is not None:
        for handle in old.hook_handles:
            handle.remove()
    controller = AttentionController(instance, config)
    decoder = _decoder(model)
    controller.hook_handles = [
        decoder.register_forward_pre_hook(controller.begin_forward, with_kwargs=True),
        decoder.register_forward_hook(controller.end_forward, with_kwargs=True),
    ]
    setattr(model, CONTROLLER_ATTRIBUTE, controller)
    for module in modules:
        setattr(module, MODULE_ATTRIBUTE, controller)
    return model


def validate_params(
    attention: str,
    *,
    budget: int = BudgetConfig.budget,
    sink: int = BudgetConfig.sink,
    local: int = BudgetConfig.local,
    sparse_prefill: bool = True,
    dense_layers: int = 0,
    **method_params: Any,
) -> AttentionMethod:
    """Check a method and its parameters without a model: what `apply_attention` would build.

    The same code as `apply_attention`'s own check, so a typo (`page_sise=16`), a bad value
    (`page_size=0`) or an impossible budget raises the same UsageError before any weights load. `full`
    ignores `budget`, `sink` and `local`. Checks that need the model (`dense_layers` against its layer
    count, `check_model_config`) are left to `apply_attention`.

    Returns:
        The method's parameter object (e.g. `Quest(query_chunk=512, page_size=16)`).

    Raises:
        UsageError: unknown method or parameter, a bad parameter value, or inconsistent budget settings.
    """
    return _build(attention, budget, sink, local, sparse_prefill, dense_layers, method_params)[0]


def check_model_config(config) -> None:
    """UsageError when a model's config turns on a sliding (or chunked) attention window.

    The methods count positions, sinks and budgets over the whole sequence and expect every key to
    stay in the cache; a sliding window hides old keys from the mask and transformers' sliding cache
    layers drop them, so sinks and statistics would be silently wrong and H2O's state would break.
    Full-attention configs of the same families pass: Mistral with `sliding_window: null`, Qwen2/3
    with `use_sliding_window: false` (their default). Reads the config only (no weights): a
    transformers config, or the dict of a checkpoint's config.json.
    """
    if isinstance(config, dict):
        config = hf_config_from_dict(config)
    problem = _sliding_window(config)
    if problem is not None:
        name = getattr(config, "model_type", None) or type(config).__name__
        raise UsageError(
            f"{name} config has an active sliding attention window ({problem}); nsa_eval.methods supports "
            "full-attention models only (every key stays visible and cached). Run the model without "
            "apply_attention for its own windowed attention, or load it with the window off "
            "(sliding_window=None / use_sliding_window=False) if its contexts never exceed the window"
        )


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
    controller.fold_static()  # static caches' decode steps since the last read
    controller.check_budget()  # decode steps leave their budget check to a read of the statistics
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
    controller.fold_static()  # into the statistics being dropped
    controller.stats = type(controller.stats)()


@contextmanager
def attention_stats_paused(model):
    """Forward passes inside the block leave the statistics as they were (saved, then restored); a
    model without a method applied counts nothing, so there is nothing to pause."""
    controller = getattr(model, CONTROLLER_ATTRIBUTE, None)
    if controller is None:
        yield
        return
    controller.fold_static()  # the steps before the block count
    saved = controller.stats
    controller.stats = type(saved)()
    try:
        yield
    finally:
        controller.fold_static()  # the steps inside it do not
        controller.stats = saved


# ----------------------------------------------------------------------------------------------------------


def _build(
    method: str, budget, sink, local, sparse_prefill, dense_layers, method_params: dict[str, Any]
) -> tuple[AttentionMethod, BudgetConfig]:
    """The method's parameter object and budget settings, checked (shared by `apply_attention` and
    `validate_params`, so both raise the same UsageError)."""
    method_cls = METHODS.get(method)
    config = _budget_config(budget, sink, local, sparse_prefill, dense_layers, budgeted=method_cls.sparse)
    valid = sorted(f.name for f in dataclasses.fields(method_cls))
    unknown = sorted(set(method_params) - set(valid))
    if unknown:
        raise UsageError(
            f"unknown parameter(s) {', '.join(map(repr, unknown))} for attention method {method!r}; "
            f"expected some of: {', '.join(valid)}"
        )
    instance = method_cls(**method_params)
    instance.check(config)
    return instance, config


def _budget_config(budget, sink, local, sparse_prefill, dense_layers, budgeted: bool = True) -> BudgetConfig:
    """Checked budget settings; with `budgeted=False` (full attention) budget, sink and local are unused
    and not checked."""
    for name, value, low in (("budget", budget, 1), ("sink", sink, 0), ("local", local, 1)):
        if budgeted and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            raise UsageError(f"{name} must be an integer >= {low}, got {value!r}")
    if isinstance(dense_layers, bool) or not isinstance(dense_layers, int) or dense_layers < 0:
        raise UsageError(f"dense_layers must be an integer >= 0, got {dense_layers!r}")
    if not isinstance(sparse_prefill, bool):
        raise UsageError(f"sparse_prefill must be True or False, got {sparse_prefill!r}")
    if budgeted and budget < sink + local:
        raise UsageError(
            f"budget ({budget}) must be at least sink + local ({sink} + {local} = {sink + local}): "
            "the budget counts the sink and local keys"
        )
    return BudgetConfig(budget, sink, local, sparse_prefill, dense_layers)


def hf_config_from_dict(config: dict):
    """A config.json's dict as its transformers config class (which fills in `layer_types`), or as
    plain attributes when transformers does not know its model_type."""
    fields = {k: v for k, v in config.items() if k not in ("model_type", "transformers_version")}
    try:
        from transformers import AutoConfig

        return AutoConfig.for_model(config.get("model_type"), **fields)
    except (ValueError, KeyError, TypeError):
        return types.SimpleNamespace(**config)


def _sliding_window(config) -> str | None:
    """What turns on a sliding or chunked attention window in this config, or None for full attention.

    `layer_types` decide where the model reads them (Qwen2/3, which also carry `use_sliding_window`);
    a model that reads `sliding_window` directly (Mistral) is windowed whenever it is set.
    """
    get_text_config = getattr(config, "get_text_config", None)
    cfg = get_text_config(decoder=True) if callable(get_text_config) else config
    window = getattr(cfg, "sliding_window", None)
    if getattr(cfg, "use_sliding_window", None) is False:
        window = None
    chunk = getattr(cfg, "attention_chunk_size", None)
    layer_types = list(getattr(cfg, "layer_types", None) or [])
    windowed = [i for i, kind in enumerate(layer_types) if "sliding" in kind or "chunked" in kind]
    if windowed:
        kinds = sorted({layer_types[i] for i in windowed})
        return f"layer_types {', '.join(kinds)} at layers {windowed}" + (
            f", sliding_window={window}" if window is not None else ""
        )
    decided_by_layer_types = bool(layer_types) and hasattr(cfg, "use_sliding_window")
    if window is not None and not decided_by_layer_types:
        return f"sliding_window={window}"
    if chunk is not None and not layer_types:
        return f"attention_chunk_size={chunk}"
    return None


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
