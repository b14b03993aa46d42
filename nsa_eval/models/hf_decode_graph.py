"""Decode steps of a transformers model under an attention method, replayed from CUDA graphs.

A `StaticDecodeCache` (nsa_eval/methods/static_cache.py) keeps every buffer at a fixed address and the
rows' lengths on the device, and the methods' decode step over it (static_decode.py) has fixed shapes, so
one step is the same launches at every position up to the cache's `width`. `enable_decode_graphs(model)`
wraps the model's forward: a decode step from a filled static cache on a GPU runs eagerly once per width
(the first token, then every `width_step` tokens), is captured as a CUDA graph over the cache
(`DecodeGraph`, as the NSA model's), and every later step replays it: embedding, layers and output
head in one launch instead of several hundred from Python. A batch prompt into an empty static cache
runs a group of rows at a time (`PREFILL_TOKENS` tokens), each group's cache moved into the batch's.
Everything else (other prompts and caches, the CPU, autograd, a model over several devices) runs the
model's own forward, and a failed capture warns and leaves later steps eager.

The generation loop stays outside the graph: `generate(..., cache=StaticDecodeCache(n))` samples, applies
its logits processors and checks stop strings on the host as usual (the lm-eval adapter does this).
"""

from __future__ import annotations

import functools
import warnings

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from nsa_eval.methods import StaticDecodeCache
from nsa_eval.models.decode_graph import DecodeGraph

GRAPHS_ATTRIBUTE = "_nsa_eval_decode_graphs"  # on the model: its DecodeGraphs
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
# A batch prompt into a static cache runs this many tokens at a time (one row from here up), as the NSA
# model prefills its own (`modeling_nsa.PREFILL_TOKENS`): 16 rows of 64k at once would hold their MLP
# intermediates and their dynamic cache beside the static one.
PREFILL_TOKENS = 65536
# the forward's inputs with a row per sequence, split with the rows of a group
BATCH_INPUTS = ("attention_mask", "position_ids", "token_type_ids")


class DecodeGraphs:
    """The forward `enable_decode_graphs` installs: graphs for decode steps from a static cache.

    Attributes:
        model: the transformers causal LM (under `apply_attention`).
        forward: its own forward.
        enabled: False after a capture failed (steps then run eagerly), or to profile eager steps.
        captures: graphs captured so far (one per cache and width).
    """

    def __init__(self, model, forward, prefill_tokens: int = PREFILL_TOKENS):
        self.model = model
        self.forward = forward
        self.prefill_tokens = prefill_tokens
        self.enabled = True
        self.captures = 0

    def __call__(self, *args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(cache, StaticDecodeCache) and not cache.filled and self._groups(ids, args, kwargs):
            return self._prefill_in_groups(ids, cache, kwargs)
        if not (isinstance(cache, StaticDecodeCache) and cache.filled and isinstance(ids, torch.Tensor)
                and ids.dim() == 2 and ids.shape == (cache.batch_size, 1) and self.ready(ids)):
            return self.forward(*args, **kwargs)
        cache.plan_step()
        if cache.decode_graph is not None and cache.graph_key == (cache.version, cache.width):
            (logits,) = cache.decode_graph(ids)  # [B, 1, V]; the replay advances the lengths on the device
            cache.step_done()
            # the graph's output buffer is rewritten by the next replay
            return CausalLMOutputWithPast(logits=logits.clone(), **{CACHE_FIELD: cache})
        out = self._step(ids, cache)  # eagerly: its answer stands, and the kernels it needs are loaded
        self._capture(ids, cache)
        return out

    def _groups(self, ids, args: tuple, kwargs: dict) -> bool:
        """Whether a prompt into an empty static cache runs a group of rows at a time: more than
        `prefill_tokens` tokens in all, outside autograd, no per-layer outputs asked for."""
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or len(args) > 1 or torch.is_grad_enabled():
            return False
        if kwargs.get("output_hidden_states") or kwargs.get("output_attentions"):
            return False
        return ids.shape[0] > max(1, self.prefill_tokens // ids.shape[1])

    def _prefill_in_groups(self, ids: torch.Tensor, cache: StaticDecodeCache, kwargs: dict):
        """A batch prompt `ids` `[B, T]` through the model `prefill_tokens // T` rows at a time (at least
        one), each group into a static cache of its own moved into `cache` (`take_rows`): the layers'
        intermediates and the prompt's dynamic cache are a group's, not the batch's. -> the model's
        output with logits `[B, n, V]` and `cache`."""
        B, T = ids.shape
        rows_at_once = max(1, self.prefill_tokens // T)
        capacity = max(cache.capacity, T + 1)
        logits = []
        for b0 in range(0, B, rows_at_once):
            rows = slice(b0, b0 + rows_at_once)
            part = StaticDecodeCache(capacity, cache.width_step)
            sub = {name: (value[rows] if name in BATCH_INPUTS and isinstance(value, torch.Tensor) else value)
                   for name, value in kwargs.items()}
            sub.update(input_ids=ids[rows], **{CACHE_FIELD: part})
            sub.pop("past_key_values" if CACHE_FIELD == "cache" else "cache", None)
            logits.append(self.forward(**sub).logits)
            cache.take_rows(part, b0, B)
        return CausalLMOutputWithPast(logits=torch.cat(logits), **{CACHE_FIELD: cache})

    def ready(self, ids: torch.Tensor) -> bool:
        """Whether a decode step may run from a graph: on one GPU, outside autograd and autocast."""
        devices = set(getattr(self.model, "hf_device_map", {}).values())
        return (self.enabled and ids.is_cuda and not torch.is_grad_enabled()
                and not torch.is_autocast_enabled("cuda") and len(devices) <= 1)

    def _step(self, ids: torch.Tensor, cache: StaticDecodeCache):
        """One decode step through the model's forward (the controller's hooks give it the positions and
        advance the cache): logits `[B, 1, V]`."""
        return self.forward(input_ids=ids, use_cache=True, logits_to_keep=1, **{CACHE_FIELD: cache})

    def _capture(self, ids: torch.Tensor, cache: StaticDecodeCache) -> None:
        cache.plan_step()  # the next step's width: the one the graph serves
        key = (cache.version, cache.width)
        cache.decode_graph = cache.graph_key = None  # the old graph's memory goes before the new one's
        try:
            cache.decode_graph = DecodeGraph(lambda x: (self._step(x, cache).logits,), ids)
            cache.graph_key = key
            self.captures += 1
        except RuntimeError as error:  # this step's answer stands; later steps run eagerly
            warnings.warn(f"decode steps run eagerly: capturing one as a CUDA graph failed ({error})",
                          stacklevel=3)
            cache.decode_graph, self.enabled = None, False


def enable_decode_graphs(model, prefill_tokens: int = PREFILL_TOKENS) -> DecodeGraphs:
    """Wrap `model.forward` (a transformers causal LM under `apply_attention`) so that decode steps from a
    `StaticDecodeCache` on a GPU replay CUDA graphs, and a batch prompt into one runs about
    `prefill_tokens` tokens at a time; a second call keeps the first wrapper. Returns it."""
    runner = getattr(model, GRAPHS_ATTRIBUTE, None)
    if runner is not None:
        return runner
    runner = DecodeGraphs(model, model.forward, prefill_tokens)
    # transformers reads the forward's signature (e.g. for `logits_to_keep`): keep the model's
    model.forward = functools.wraps(runner.forward)(lambda *args, **kwargs: runner(*args, **kwargs))
    setattr(model, GRAPHS_ATTRIBUTE, runner)
    return runner


def disable_decode_graphs(model) -> None:
    """Undo `enable_decode_graphs`: the model's own forward again."""
    if getattr(model, GRAPHS_ATTRIBUTE, None) is not None:
        del model.forward
        delattr(model, GRAPHS_ATTRIBUTE)


def static_cache_for(model, capacity: int) -> StaticDecodeCache | None:
    """A `StaticDecodeCache` for `capacity` tokens per row where `model` decodes from one (an attention method
    applied and `enable_decode_graphs` called), else None (the model's own cache then serves)."""
    from nsa_eval.methods import CONTROLLER_ATTRIBUTE

    if getattr(model, GRAPHS_ATTRIBUTE, None) is None or getattr(model, CONTROLLER_ATTRIBUTE, None) is None:
        return None
    return StaticDecodeCache(capacity)
