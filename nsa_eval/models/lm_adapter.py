"""The lm-eval model `nsa-eval`: one name for NSA checkpoints and for baseline methods on any causal LM.

    import nsa_eval, lm_eval                       # `import nsa_eval` registers the name
    lm_eval.simple_evaluate(model="nsa-eval", tasks=[...],
                            model_args="pretrained=smollm2-135m,attention=quest,budget=2560")
    nsa-eval lm-eval --model nsa-eval --model_args pretrained=nsa-tiny,attention=nsa --tasks ...

model_args (strings are cast; lm-eval already turns "3" into 3 and "true" into True):
- pretrained: `smollm2-135m`, `nsa-tiny`, `full-tiny`, a checkpoint directory, or a hub name (online);
- attention: `nsa` for NSA checkpoints; `full`, `sink_window`, `topk`, `quest`, `h2o` for other models;
- budget, sink, local, sparse_prefill, dense_layers: the baselines' budget (`nsa_eval.methods`);
  any other unknown key is handed to the method as a parameter (e.g. `page_size=16` for quest), or
  for `nsa` overrides the checkpoint's setting (`num_selected=4`: a smaller selection budget);
- dtype, max_length, batch_size, device: as lm-eval's `hf` model;
- truncation: `middle` (default; keep the head and tail of an over-long prompt, as official
  LongBench does) or `left` (lm-eval's default: keep the tail);
- parallelize, max_memory_per_gpu: split one large model over GPUs (`device_map="auto"`);
- static_decode: `auto` (default: on a GPU), `true` or `false`: generate_until decodes from a static cache
  (`nsa_eval.methods.StaticDecodeCache`), each step replayed from a CUDA graph on a GPU
  (`models.hf_decode_graph`); `false` keeps transformers' dynamic cache and eager steps (and turns the NSA
  model's decode graph off).

loglikelihood, loglikelihood_rolling and generate_until all run through the chosen attention.
Activated tokens per query: `lm.attention_stats()` (reset with `lm.reset_attention_stats()`), and in
`results["config"]["activated_tokens"]` of `simple_evaluate`. Under `accelerate launch` (data
parallel) each process evaluates its share and the statistics are merged over processes.
"""

from __future__ import annotations

import atexit
import logging
import sys
from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from nsa_eval.budget import BudgetConfig
from nsa_eval.errors import UsageError
from nsa_eval.models.hf_decode_graph import CACHE_FIELD, enable_decode_graphs, static_cache_for
from nsa_eval.models.loading import (
    attention_stats,
    attention_stats_paused,
    is_nsa_model,
    load_for_eval,
    reset_attention_stats,
)

log = logging.getLogger(__name__)

TRUNCATIONS = ("middle", "left")
# HFLM keyword arguments that pass through unchanged; any other unknown key is a method parameter.
HFLM_KWARGS = {
    "max_batch_size", "logits_cache", "add_bos_token", "prefix_token_id", "softmax_dtype",
    "mixed_precision_dtype", "think_end_token", "enable_thinking", "chat_template_args", "use_fast_tokenizer",
}
_TRUE, _FALSE = {"true", "1", "yes"}, {"false", "0", "no"}


def as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise UsageError(f"{name}={value!r}: expected true or false")


def as_int(name: str, value: Any, low: int = 0) -> int:
    try:
        number = int(str(value).strip()) if not isinstance(value, int) or isinstance(value, bool) else value
    except ValueError:
        raise UsageError(f"{name}={value!r}: expected an integer") from None
    if number < low:
        raise UsageError(f"{name}={value!r}: expected an integer >= {low}")
    return number


def as_number(value: Any) -> Any:
    """A method parameter from a model_args string: int, float, bool or the string itself."""
    if not isinstance(value, str):
        return value
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return as_bool("", value) if value.lower() in _TRUE | _FALSE else value


def middle_truncate(ids: list[int], max_len: int) -> list[int]:
    """Keep the first max_len // 2 and the last max_len - max_len // 2 tokens (official LongBench)."""
    if len(ids) <= max_len:
        return ids
    head = max_len // 2
    return ids[:head] + ids[len(ids) - (max_len - head):]


@register_model("nsa-eval")
class NSAEvalLM(HFLM):
    """An HFLM that builds its model with `load_for_eval` and runs it under the chosen attention."""

    def __init__(
        self,
        pretrained: str,
        attention: str = "full",
        budget: int = BudgetConfig.budget,
        sink: int = BudgetConfig.sink,
        local: int = BudgetConfig.local,
        sparse_prefill: bool = True,
        dense_layers: int = 0,
        dtype: str = "auto",
        truncation: str = "middle",
        device: str | None = None,
        batch_size: int | str = 1,
        max_length: int | None = None,
        parallelize: bool = False,
        max_memory_per_gpu: str | None = None,
        trust_remote_code: bool = False,
        static_decode: bool | str = "auto",
        **kwargs,
    ):
        if not isinstance(pretrained, str):
            raise UsageError("pretrained= must be a checkpoint name or directory (a string)")
        truncation = str(truncation).lower()
        if truncation not in TRUNCATIONS:
            raise UsageError(f"truncation={truncation!r}: expected one of {', '.join(TRUNCATIONS)}")
        hf_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in HFLM_KWARGS}
        method_params = {k: as_number(v) for k, v in kwargs.items()}
        budget, sink, local = as_int("budget", budget, 1), as_int("sink", sink), as_int("local", local, 1)
        sparse_prefill = as_bool("sparse_prefill", sparse_prefill)
        parallelize = as_bool("parallelize", parallelize)
        static_decode = None if str(static_decode).strip().lower() == "auto" else as_bool("static_decode",
                                                                                          static_decode)
        dense_layers = as_int("dense_layers", dense_layers)
        max_length = None if max_length in (None, "", "None") else as_int("max_length", max_length, 1)
        batch_size = batch_size if str(batch_size).startswith("auto") else as_int("batch_size", batch_size, 1)

        accelerator = _data_parallel_accelerator()
        if accelerator is not None:
            device = str(accelerator.device)
        elif device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device_map, load_kwargs = None, {}
        if parallelize:  # one model over all visible GPUs, as HFLM's parallelize=True
            device_map = "auto"
            if max_memory_per_gpu is not None:
                load_kwargs["max_memory"] = {i: max_memory_per_gpu for i in range(torch.cuda.device_count())}
        model, tokenizer = load_for_eval(
            pretrained, attention=str(attention), budget=budget, sink=sink, local=local,
            sparse_prefill=sparse_prefill, dense_layers=dense_layers, dtype=dtype, device=device,
            device_map=device_map, method_params=method_params, trust_remote_code=trust_remote_code,
            **load_kwargs,
        )
        super().__init__(pretrained=model, tokenizer=tokenizer, backend="causal", truncation=False,
                         max_length=max_length, batch_size=batch_size, device=device, **hf_kwargs)
        self.pretrained = pretrained  # a name again, for get_model_info and the results' config
        self.attention, self.truncation_mode = str(attention), truncation
        self._merged_stats: dict | None = None
        self._row_lengths: list[int] | None = None  # real lengths of the next right-padded batch
        if accelerator is not None:  # HFLM sets up data parallelism only for models it loads itself
            self.accelerator = accelerator
            self._rank, self._world_size = accelerator.process_index, accelerator.num_processes
            self._device = accelerator.device
        if is_nsa_model(self.model):  # compile the GPU decode for every length now, not mid-generation
            if static_decode is False:
                self.model.model.decode_cuda_graph = False
            batch_sizes = {1} | ({batch_size} if isinstance(batch_size, int) else set())
            self.model.warm_up_decode(batch_sizes=tuple(sorted(batch_sizes)), max_length=self.max_length)
        elif not parallelize and (static_decode or static_decode is None and self.device.type == "cuda"):
            enable_decode_graphs(self.model)

    # --- activated tokens ---

    def attention_stats(self) -> dict:
        """Activated tokens per query since the last reset (merged over processes after an evaluation)."""
        if self._merged_stats is not None:
            return self._merged_stats
        return attention_stats(self.model)

    def reset_attention_stats(self) -> None:
        self._merged_stats = None
        reset_attention_stats(self.model)

    def get_model_info(self) -> dict:
        """What simple_evaluate puts in results["config"]: no hub lookups, plus the attention used."""
        return {
            "model_num_parameters": sum(p.numel() for p in self._model.parameters()),
            "model_dtype": str(self._model.dtype),
            "pretrained": self.pretrained,
            "attention": self.attention,
            "truncation": self.truncation_mode,
            "data_parallel_processes": self.world_size,
            "activated_tokens": self.attention_stats(),
        }

    def gather_object(self, obj, dst=0):
        """Also gather the statistics: every rank reaches this call at the same points of evaluate()."""
        gathered = super().gather_object(obj, dst)
        if self.world_size > 1:
            stats = super().gather_object(attention_stats(self.model), dst)
            if self.rank == dst:
                self._merged_stats = merge_stats(stats)
        return gathered

    def _detect_batch_size(self, requests=None, pos: int = 0):
        """HFLM's probe (`batch_size=auto`) runs dummy batches through the model: not counted."""
        with attention_stats_paused(self.model):
            return super()._detect_batch_size(requests, pos)

    # --- forward passes ---

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """HFLM's, with each batch's real row lengths handed to `_model_call`.

        HFLM right-pads a batch (`pad_and_concat`) and calls the model without an attention mask;
        the padding does not change the real positions' logits (causal attention), but the model
        would count the padding queries in the activated-token statistics. Recording the lengths
        of the rows `pad_and_concat` receives lets `_model_call` pass a right-padding mask.
        """
        import lm_eval.models.huggingface as hf_module

        original = hf_module.pad_and_concat

        def pad_and_concat(max_length, tensors, padding_side="right"):
            if padding_side == "right":  # the causal batch of the next _model_call
                self._row_lengths = [int(t.shape[-1]) for t in tensors]
            return original(max_length, tensors, padding_side)

        hf_module.pad_and_concat = pad_and_concat
        try:
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        finally:
            hf_module.pad_and_concat = original
            self._row_lengths = None

    def _padding_mask(self, inps: torch.Tensor) -> torch.Tensor | None:
        """`[B, T]` mask of the real tokens of a right-padded batch from `_loglikelihood_tokens`, or None."""
        lengths, self._row_lengths = self._row_lengths, None
        B, T = inps.shape
        if lengths is None or len(lengths) != B or max(lengths) != T or min(lengths) == T:
            return None
        lengths = torch.tensor(lengths, device=inps.device)
        return (torch.arange(T, device=inps.device)[None, :] < lengths[:, None]).long()  # [B, T]

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        """inps `[B, T]` -> logits `[B, T, V]`; an NSA model skips building a cache it will not use.

        A right-padded loglikelihood batch gets its padding mask, so the padding positions are not
        counted as queries (their logits are discarded; the real positions' are unchanged).
        """
        mask = self._padding_mask(inps) if attn_mask is None and labels is None else None
        if not is_nsa_model(self.model):
            if mask is None:
                return super()._model_call(inps, attn_mask, labels)
            with (torch.no_grad(),
                  torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                                 enabled=self.mixed_precision_dtype is not None)):
                return self.model(inps, attention_mask=mask).logits
        with torch.no_grad():
            return self.model(inps, attention_mask=mask, use_cache=False).logits

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs):
        """HFLM's generation: from a static cache of `max_length` tokens where static decoding is on (HFLM's
        sampling and stop strings run on the host between the steps); NSA takes no padding, so a left-padded
        batch is generated row by row and padded back together."""
        cache = static_cache_for(self.model, max_length)
        if cache is not None:
            generation_kwargs[CACHE_FIELD] = cache
        mask = generation_kwargs.get("attention_mask")
        if not is_nsa_model(self.model) or mask is None or bool(mask.all()):
            return super()._model_generate(context, max_length, stop, **generation_kwargs)
        new_tokens = max_length - context.shape[1]
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eot_token_id
        rows = []
        for row, row_mask in zip(context, mask, strict=True):
            ids = row[row_mask.bool()][None]  # [1, T_row]
            kwargs = dict(generation_kwargs, attention_mask=torch.ones_like(ids))
            out = super()._model_generate(ids, ids.shape[1] + new_tokens, stop, **kwargs)
            rows.append(out[0, ids.shape[1]:])  # the generated tokens only
        width = max(r.numel() for r in rows)
        generated = torch.full((len(rows), width), pad, dtype=context.dtype, device=context.device)
        for i, r in enumerate(rows):
            generated[i, : r.numel()] = r
        return torch.cat([context, generated], dim=1)  # [B, T + new], as HFLM expects

    # --- truncation ---

    def tok_batch_encode(self, strings, padding_side="left", left_truncate_len=None, truncation=False):
        """Encode a batch, left-padded; with truncation=middle an over-long prompt loses its middle."""
        if self.truncation_mode != "middle" or not left_truncate_len:
            return super().tok_batch_encode(strings, padding_side, left_truncate_len, truncation)
        ids, mask = super().tok_batch_encode(strings, padding_side, None, truncation)
        full = [r[m.bool()].tolist() for r, m in zip(ids, mask, strict=True)]
        rows = [middle_truncate(r, left_truncate_len) for r in full]
        if any(len(r) < len(f) for r, f in zip(rows, full, strict=True)):
            log.warning("middle truncation: prompts kept to %d tokens (head and tail)", left_truncate_len)
        return _pad(rows, self.tokenizer.pad_token_id or 0, padding_side)

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """With truncation=middle, a context too long for max_length loses its middle, not its head."""
        context_enc, continuation_enc = super()._encode_pair(context, continuation)
        if self.truncation_mode == "middle":
            room = self.max_length + 1 - len(continuation_enc)  # the model sees (ctx + cont)[:-1]
            if 0 < room < len(context_enc):
                context_enc = middle_truncate(context_enc, room)
        return context_enc, continuation_enc


def _pad(rows: list[list[int]], pad_id: int, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        span = slice(width - len(r), width) if side == "left" else slice(0, len(r))
        ids[i, span] = torch.tensor(r, dtype=torch.long)
        mask[i, span] = 1
    return ids, mask


def _data_parallel_accelerator():
    """An Accelerator when launched with `accelerate launch --num_processes N>1`, else None."""
    import os
    from datetime import timedelta

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    from accelerate import Accelerator, InitProcessGroupKwargs

    # cpu=True on GPU-less hosts: without it accelerate ignores the launcher's processes (one process)
    accelerator = Accelerator(cpu=not torch.cuda.is_available(),
                              kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(weeks=52))])
    if accelerator.num_processes <= 1:
        return None
    atexit.unregister(_destroy_process_group_at_exit)  # once, however many models a process loads
    atexit.register(_destroy_process_group_at_exit)
    return accelerator


def _destroy_process_group_at_exit() -> None:
    """On a clean exit, the default process group destroyed while the interpreter still runs. Left to
    the interpreter's teardown, gloo's worker threads can free tensors after the GIL is gone and the
    process aborts ("terminate called without an active exception", SIGABRT: pytorch/pytorch#190489;
    seen here in tests/models/test_data_parallel.py). After an unhandled exception it is left alone:
    destroying it while other processes still communicate can hang."""
    if getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def merge_stats(parts: list[dict]) -> dict:
    """Merge activated-token statistics of several processes: sums of queries, weighted means, max of max."""
    parts = [p for p in parts if p]
    if not parts:
        return {}
    queries = sum(p.get("queries", 0) for p in parts)
    merged = dict(parts[0])
    merged["queries"] = queries
    for key in ("mean", "kv_read_mean"):
        if key in merged:
            merged[key] = sum(p[key] * p["queries"] for p in parts) / queries if queries else 0.0
    if "max" in merged:
        merged["max"] = max(p["max"] for p in parts)
    if "mean_per_branch" in merged:
        merged["mean_per_branch"] = {
            b: sum(p["mean_per_branch"][b] * p["queries"] for p in parts) / queries if queries else 0.0
            for b in merged["mean_per_branch"]
        }
    if "held" in merged:
        merged["held"] = merge_stats([p["held"] for p in parts])
    if "phases" in merged:
        names = sorted({name for p in parts for name in p.get("phases", {})})
        merged["phases"] = {n: merge_stats([p["phases"][n] for p in parts if n in p.get("phases", {})])
                            for n in names}
    if "layers" in merged:
        by_layer: dict[Any, list[dict]] = {}
        for p in parts:
            for layer in p.get("layers", []):
                by_layer.setdefault(layer.get("layer"), []).append(layer)
        merged["layers"] = [merge_stats(group) for _, group in sorted(by_layer.items())]
    merged["processes"] = sum(p.get("processes", 1) for p in parts)
    return merged
