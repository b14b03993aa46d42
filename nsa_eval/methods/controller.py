"""The controller: one per model, it applies a method at a budget inside transformers' attention.

- budget accounting: every query attends to at most `budget` keys, counting the `sink` leading keys
  and the `local` most recent keys (the query itself included): the paper's 2,560 = 128 + 512 + 1,920.
  A query with at most `budget` visible keys attends to all of them.
- masking: the method picks `budget - sink - local` keys (fewer if it forces more) from the keys between
  the sink and the local window; attention is a softmax over the kept keys only.
- positions: a key's position is its rank among the non-padding keys of its sequence, read off the
  model's 4D mask, so left and right padding marked in the attention mask count from the first real
  token (positions the mask does not mark as padding are ordinary tokens, and are counted).
- caches: a plain `DynamicCache` of full-attention layers (`check_cache`), whose keys are the
  sequence so far with the new ones last; or the methods' `StaticDecodeCache` (static_cache.py), whose
  prompt runs on a `DynamicCache` and is copied in by the post-forward hook, and whose decode steps run
  `static_decode.py`'s fixed-shape step (a CUDA graph can replay it).
- chunking over queries: scores are materialised for at most `query_chunk` queries at a time
  (`[B, Hq, Tc, S]`), never `T x T`. A held, unpadded prefill is offered to the method first
  (`AttentionMethod.fast_prefill`): a method with kernels (nsa_eval/baseline_kernels/) takes it on a
  GPU, and the chunked path is then its reference (`_reference_rows`) for any queries it leaves.
- state: per-layer method state (H2O's accumulated attention mass) lives on the KV cache object
  (`cache.nsa_eval_state[layer_idx]`), so it follows `generate()` and is fresh for every new cache.
- statistics: keys attended per query, per layer and phase (prefill/decode), always on (stats.py), and
  `BudgetExceededError` as soon as a query held to the budget attends to more.

The attention function `nsa_eval_attention` is registered with transformers' `AttentionInterface` as
`nsa_eval`; each attention module carries a `_nsa_eval` pointer to the `AttentionController` that
`apply_attention` built. Shapes: query `[B, Hq, T, D]`, key/value `[B, Hkv, S, D]`, output
`[B, T, Hq, D]`; `Hq = G * Hkv` and query head `h` reads KV head `h // G`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from nsa_eval.errors import UsageError
from nsa_eval.methods.base import (
    AttentionMethod,
    BudgetConfig,
    Chunk,
    Prefill,
    group_sum,
    grouped_apply,
    keep_counts,
    masked_softmax,
)
from nsa_eval.methods.static_cache import StaticCounts, StaticDecodeCache
from nsa_eval.methods.static_decode import fold_counts, static_attend
from nsa_eval.methods.stats import AttentionStats, Tally

ATTN_IMPLEMENTATION = "nsa_eval"
STATE_ATTRIBUTE = "nsa_eval_state"  # on a transformers Cache: {layer_idx: LayerState}
MODULE_ATTRIBUTE = "_nsa_eval"  # on each attention module: its AttentionController


class BudgetExceededError(RuntimeError):
    """A query held to the budget attended to more keys than the budget allows."""


@dataclass
class LayerState:
    """What a stateful method carries between forward calls for one layer.

    Attributes:
        method: the method instance that wrote it (a state from another method is not reused).
        length: number of keys the state covers.
        tensors: the method's tensors, keys on the last dimension, e.g. H2O's accumulated mass
            `[B, Hq, length]` float32. Each chunk gets views cut to its keys, updated in place.
    """

    method: AttentionMethod | None = None
    length: int = 0
    tensors: dict[str, Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class DecodePlan:
    """What `_select` and `_top_keys` would read off the device for an unpadded decode query at position
    `S - 1`, from shapes and the budget alone (`AttentionController._decode_plan`).

    Attributes:
        S: keys (the query's position + 1).
        held: the query sees more keys than its limit (`_over_budget`).
        low: forced keys are the sink `[0, sink)` and `[low, S)` (local window and the method's own).
        k: keys `_top_keys` takes (`picks` clamped to `[0, S]`; every row the same), from the candidates
            `[sink, low)`.
        empty: no candidate is chosen (k == 0 or no candidates, or a method that does not select).
    """

    S: int
    held: bool
    low: int
    k: int
    empty: bool


class AttentionController:
    """The method applied to one model: budget, statistics and the per-forward layer states."""

    def __init__(self, method: AttentionMethod, config: BudgetConfig):
        self.method = method
        self.config = config
        self.stats = AttentionStats()
        self.states: dict[int, LayerState] = {}  # replaced at each forward by the pre-hook
        self.hook_handles: list = []  # the decoder's pre- and post-forward hooks (`apply_attention`)
        # decode steps' tallies whose budget check waits for `check_budget`: id -> (layer, tally)
        self._unchecked: dict[int, tuple[int, Tally]] = {}
        self.static: StaticDecodeCache | None = None  # the static cache of the decode step in flight
        self._filling: tuple | None = None  # a prompt in flight: (static, dynamic cache, 2D mask, heads)
        self._static_counts: list[StaticCounts] = []  # static caches' steps not yet in `stats`

    # ---- forward hooks on the decoder stack: find (or make) the cache, point at its state
    def begin_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        from transformers import DynamicCache

        name = "past_key_values" if "past_key_values" in kwargs else "cache"
        cache = kwargs.get(name)
        self.static = self._filling = None
        if isinstance(cache, StaticDecodeCache):
            return self._begin_static(module, cache, name, args, kwargs)
        if cache is not None:
            check_cache(cache, self.method.name)
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = getattr(module.config, "use_cache", False)
        if cache is None and use_cache:
            # The model would create this cache itself; creating it here lets the state ride on it.
            cache = DynamicCache(config=module.config)
            kwargs[name] = cache
        if cache is None:
            self.states = {}
        else:
            if not hasattr(cache, STATE_ATTRIBUTE):
                setattr(cache, STATE_ATTRIBUTE, {})
            self.states = getattr(cache, STATE_ATTRIBUTE)
        return args, kwargs

    def _begin_static(self, module, cache: StaticDecodeCache, name: str, args: tuple, kwargs: dict):
        """A forward on a static cache: its prompt runs on a fresh `DynamicCache` (copied in by
        `end_forward`); a decode step gets the rows' positions and a stand-in 4D mask (transformers then
        builds none: the attention reads the lengths off the cache)."""
        from transformers import DynamicCache

        if cache.controller is not None and cache.controller is not self:
            raise UsageError("this StaticDecodeCache was filled under another apply_attention call; start a "
                             "new cache for a new method")
        x = kwargs.get("input_ids", args[0] if args else None)
        x = kwargs.get("inputs_embeds") if x is None else x
        if not cache.filled:
            dynamic = DynamicCache(config=module.config)
            kwargs[name] = dynamic
            self.states = {}
            setattr(dynamic, STATE_ATTRIBUTE, self.states)
            mask = kwargs.get("attention_mask")
            self._filling = (cache, dynamic, mask, module.config.num_attention_heads)
            return args, kwargs
        if x.shape[1] != 1 or x.shape[0] != cache.batch_size:
            raise UsageError(f"a filled StaticDecodeCache takes one token for each of its {cache.batch_size} "
                             f"rows per step, got input of shape {tuple(x.shape[:2])}")
        cache.plan_step()
        kwargs["position_ids"] = cache.lens[:, None]  # [B, 1] slot = position (the cache holds no padding)
        kwargs["attention_mask"] = cache.step_mask
        self.static, self.states = cache, {}
        return args, kwargs

    def end_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict, output):
        """After the decoder stack: a prompt's dynamic cache copied into its static cache (which the output
        then carries), or a static decode step's lengths advanced (on the device, inside a captured step
        too)."""
        if self._filling is not None:
            cache, dynamic, mask, heads = self._filling
            self._filling = None
            cache.fill(dynamic, mask, self, self.states, heads)
            self.states = {}
            self.track_static(cache)
            for field_name in ("cache", "past_key_values"):
                if getattr(output, field_name, None) is dynamic:
                    output[field_name] = cache
        elif self.static is not None:
            cache, self.static = self.static, None
            cache.lens.add_(1)
            if not (cache.lens.is_cuda and torch.cuda.is_current_stream_capturing()):
                cache.step_done()  # a replayed step's host half is its caller's (hf_decode_graph.py)
        return output

    def track_static(self, cache: StaticDecodeCache) -> None:
        """Count the decode steps of a newly filled static cache (earlier caches' steps folded first)."""
        self.fold_static()
        self._static_counts.append(cache.counts)

    def fold_static(self) -> None:
        """Put every static cache's decode steps so far into `stats` (device additions, no wait)."""
        for counts in self._static_counts:
            for layer, tally in fold_counts(counts, self.stats, self.method, self.config):
                self._unchecked[id(tally)] = (layer, tally)
        self._static_counts = [c for c in self._static_counts if c.alive]

    # ---- the attention function body
    def attend(
        self,
        module: torch.nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        scaling: float | None,
        **kwargs: Any,
    ) -> Tensor:
        """query `[B, Hq, T, D]`, key/value `[B, Hkv, S, D]`, mask `[B|1, 1, T, S]` or None.

        Returns the attention output `[B, T, Hq, Dv]`.
        """
        B, Hq, T, D = query.shape
        Hkv, S = key.shape[1], key.shape[2]
        if Hq % Hkv:
            raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
        layer = int(module.layer_idx)
        scaling = D**-0.5 if scaling is None else scaling
        if self.static is not None:  # a decode step from a static cache: its own fixed-shape path
            return static_attend(self, layer, query, key, value, scaling, self.static)
        phase = "decode" if T == 1 else "prefill"
        method, cfg = self.method, self.config
        held = method.sparse and layer >= cfg.dense_layers and (cfg.sparse_prefill or phase == "decode")
        stateful = method.stateful and method.sparse and layer >= cfg.dense_layers
        if attention_mask is None and not held and not stateful:  # `full`'s every call, on an unpadded batch
            return self._dense_unpadded(module, query, key, value, scaling, kwargs, layer, phase)

        allowed = _allowed_keys(attention_mask, B, T, S)  # [B, T, S] bool or None
        kpos, qpos = _positions(allowed, B, T, S, query.device)  # [B, S], [B, T]
        state = self._layer_state(layer, B, Hq, S, T, query.device) if stateful else None
        tally = self.stats.tally(layer, phase, held)
        if (held or stateful) and allowed is None and T > 1:
            reference = functools.partial(self._reference_rows, query, key, value, scaling, kpos, qpos, state)
            call = Prefill(query, key, value, scaling, cfg, state.tensors if stateful else None, reference,
                           held)
            fast = method.fast_prefill(call)
            if fast is not None:
                out, activated, kv_read = fast  # [B, Hq, T, Dv], [B, Hq, T], [B, Hkv, T]
                self._record_counts(tally, activated, kv_read, Hq, qpos, held, layer)
                if state is not None:
                    state.length = S
                return out.transpose(1, 2).contiguous()  # [B, T, Hq, Dv]

        if not held and not stateful:
            return self._dense(
                module, query, key, value, attention_mask, scaling, kwargs, allowed, qpos, tally
            )
        if T == 1 and held and allowed is None:
            plan = self._decode_plan(S)
            if plan is not None:
                return self._decode(query, key, value, scaling, plan, state, tally, layer)

        out = query.new_empty(B, Hq, T, value.shape[-1])  # [B, Hq, T, Dv]
        num_positions = S if allowed is None else None  # unpadded: the positions are 0 .. S - 1
        prepared = method.prepare(key, kpos, num_positions) if held and method.selects else None
        chunk_len = self._chunk_len(B, Hq, T, S)
        # keys by position alone on an unpadded batch: each chunk reads only its sink and local keys
        by_position = allowed is None and not method.selects and not stateful
        for t0 in range(0, T, chunk_len):
            t1 = min(T, t0 + chunk_len)
            if by_position:
                keep, o = self._sink_and_local(query[:, :, t0:t1], key, value, S - T + t0, scaling)
                out[:, :, t0:t1] = o
                self._record(tally, keep.expand(B, 1, -1, -1), Hq, Hkv, qpos[:, t0:t1], held, layer)
                continue
            Sc = S - T + t1  # keys after the chunk's last query are invisible to all of it
            kp = kpos[:, :Sc]  # [B, Sc]
            visible = (kp[:, None, :] <= qpos[:, t0:t1, None]) & (kp >= 0)[:, None, :]  # [B, Tc, Sc]
            if allowed is not None:
                visible &= allowed[:, t0:t1, :Sc]
            q, k, v = query[:, :, t0:t1], key[:, :, :Sc], value[:, :, :Sc]  # [B, H, Tc|Sc, D]
            chunk = Chunk(q, k, scaling, qpos[:, t0:t1], kp, visible, prepared)
            if stateful:
                tensors = {name: t[..., :Sc] for name, t in state.tensors.items()}  # views: updates land
                keep, probs = self._select_stateful(chunk, tensors, held, allowed is None)  # [B, Hq, Tc, Sc]
                o = grouped_apply(probs, v.float())  # [B, Hq, Tc, Dv]
            else:
                keep = self._select(chunk, allowed is None)  # [B, 1|Hq, Tc, Sc]
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scaling, enable_gqa=True)
            out[:, :, t0:t1] = o.nan_to_num(0.0)  # a padding query (nothing visible) gets zeros
            self._record(tally, keep, Hq, Hkv, qpos[:, t0:t1], held, layer)
        if state is not None:
            state.length = S
        return out.transpose(1, 2).contiguous()  # [B, T, Hq, Dv]

    # ---- pieces
    def _dense_unpadded(self, module, query, key, value, scaling, kwargs, layer: int, phase: str) -> Tensor:
        """`_dense` on an unpadded batch (no mask): query t of T sees the `S - T + t + 1` keys up to it, so
        the counts are host integers and the call adds nothing to plain SDPA on the device."""
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        kwargs = {k: v for k, v in kwargs.items() if k in ("dropout", "is_causal")}
        out, _ = sdpa_attention_forward(module, query, key, value, None, scaling=scaling, **kwargs)
        B, Hq, T, _ = query.shape
        Hkv, S = key.shape[1], key.shape[2]
        keys = T * (S - T) + T * (T + 1) // 2  # summed over the T queries
        tally = self.stats.tally(layer, phase, False)
        tally.add_host(B * Hq * T, B * Hq * keys, S, B * Hkv * T, B * Hkv * keys)
        return out

    def _dense(self, module, query, key, value, mask, scaling, kwargs, allowed, qpos, tally) -> Tensor:
        """Plain SDPA (transformers' own function: `full` is bit-identical to `sdpa`); stats from the mask."""
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        kwargs = {k: v for k, v in kwargs.items() if k in ("dropout", "is_causal")}
        out, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=scaling, **kwargs)
        B, Hq, T, _ = query.shape
        Hkv = key.shape[1]
        if allowed is None:
            count = qpos + 1  # [B, T]
        else:
            count = allowed.sum(-1)  # [B, T]
        tally.add(
            count[:, None].expand(B, Hq, T),  # [B, Hq, T]
            count[:, None].expand(B, Hkv, T),  # [B, Hkv, T]
            qpos >= 0,
        )
        return out

    def _reference_rows(self, query, key, value, scaling, kpos, qpos, state, rows, out, counts,
                        kv_read) -> None:
        """The chunked path for the queries `rows` `[n]` (ascending indices into T) of a held prefill of an
        unpadded batch, written into out `[B, Hq, T, Dv]`, counts `[B, Hq, T]` and kv_read `[B, Hkv, T]`:
        `_select` and SDPA, or a stateful method's `_select_stateful` on its `state`, whose rows must then
        be its leading queries (`Prefill.reference`: what a method's kernels leave to the reference)."""
        B, Hq, T, _ = query.shape
        Hkv, S = key.shape[1], key.shape[2]
        prepared = self.method.prepare(key, kpos) if self.method.selects else None
        step = self._chunk_len(B, Hq, rows.numel(), S)
        for i in range(0, rows.numel(), step):
            t = rows[i:i + step]  # [n]
            Sc = S - T + int(t[-1]) + 1  # keys up to the last of these queries
            kp, qp = kpos[:, :Sc], qpos[:, t]  # [B, Sc], [B, n]
            chunk = Chunk(query[:, :, t], key[:, :, :Sc], scaling, qp, kp, kp[:, None, :] <= qp[:, :, None],
                          prepared)
            if state is None:
                keep = self._select(chunk)  # [B, 1|Hq, n, Sc]
                out[:, :, t] = F.scaled_dot_product_attention(chunk.query, chunk.key, value[:, :, :Sc],
                                                              attn_mask=keep, scale=scaling, enable_gqa=True)
            else:
                tensors = {name: x[..., :Sc] for name, x in state.tensors.items()}  # views: updates land
                keep, probs = self._select_stateful(chunk, tensors, True, True)  # [B, Hq, n, Sc]
                out[:, :, t] = grouped_apply(probs, value[:, :, :Sc].float())
            activated, read = keep_counts(keep, Hkv)
            counts[:, :, t] = activated.to(counts.dtype)
            kv_read[:, :, t] = read.to(kv_read.dtype)

    def _chunk_len(self, B: int, Hq: int, T: int, S: int) -> int:
        return max(1, min(T, self.method.query_chunk))

    def _forced(self, chunk: Chunk) -> Tensor:
        """`[B, Tc, S]` bool: sink, local window and the method's own forced keys (all within `visible`)."""
        cfg = self.config
        kpos, qpos = chunk.kpos[:, None, :], chunk.qpos[:, :, None]  # [B, 1, S], [B, Tc, 1]
        forced = (kpos < cfg.sink) | (kpos > qpos - cfg.local)  # [B, Tc, S]
        extra = self.method.forced(chunk) if self.method.selects else None
        if extra is not None:
            forced |= extra
        return forced & chunk.visible

    def _limit(self) -> int:
        """Keys a query may attend to: more visible keys than this, and it is held to the budget."""
        cfg = self.config
        return cfg.budget if self.method.selects else min(cfg.budget, cfg.sink + cfg.local)

    def _over_budget(self, chunk: Chunk) -> Tensor:
        """`[B, Tc]` bool: queries that see more keys than they may attend to."""
        return chunk.visible.sum(-1, dtype=torch.int32) > self._limit()  # [B, Tc]

    def _select(self, chunk: Chunk, unpadded: bool = False) -> Tensor:
        """Keys to attend, `[B, 1, Tc, Sc]` when shared by all heads, else `[B, Hq, Tc, Sc]` bool:
        all visible keys, or sink + local (+ forced) + the method's best. `unpadded`: the chunk's queries
        are the last of `Sc` unpadded keys (no mask), so whether one is over the budget is known on the
        host (the last sees all `Sc` keys)."""
        visible = chunk.visible[:, None]  # [B, 1, Tc, Sc]
        over = self._over_budget(chunk)[:, None, :, None]  # [B, 1, Tc, 1]
        if unpadded and chunk.key.shape[2] <= self._limit():
            return visible
        if not unpadded and not over.any():  # waits for the device: a padded batch only
            return visible
        forced = self._forced(chunk)[:, None]  # [B, 1, Tc, Sc]
        if not self.method.selects:
            return torch.where(over, forced, visible)  # [B, 1, Tc, Sc]
        picks = self.config.budget - forced.sum(-1, dtype=torch.int32)  # [B, 1, Tc]
        candidates = visible & ~forced  # [B, 1, Tc, Sc]
        score = self.method.score(chunk)  # [B, Hq, Tc, Sc]
        if self.method.group_shared:
            score = group_sum(masked_softmax(score, visible), chunk.key.shape[1])  # [B, Hkv, Tc, Sc]
        best = _top_keys(score, candidates, picks, self.method.stable_ties)  # [B, Hq|Hkv, Tc, Sc]
        if self.method.group_shared:
            best = best.repeat_interleave(chunk.query.shape[1] // chunk.key.shape[1], dim=1)  # [B, Hq, ...]
        return torch.where(over, forced | best, visible)  # [B, Hq, Tc, Sc]

    def _sink_and_local(self, q: Tensor, key: Tensor, value: Tensor, first: int, scaling: float):
        """Sink + local attention of queries at positions `first ..` over unpadded keys (no mask, so a
        key's index is its position), reading only the keys some query of the chunk keeps.

        q `[B, Hq, Tc, D]`, key/value `[B, Hkv, S, D]` -> keep `[1, 1, Tc, n]` bool over the n key columns
        read, and o `[B, Hq, Tc, Dv]`. The same keys and output as `_select` over all S keys: a query
        over the limit keeps the sink and the keys after `t - local`, all within the columns; one under
        it sees at most `limit` keys, all of them sink or local columns too (it sits at t < limit).
        """
        cfg, Tc = self.config, q.shape[2]
        last = first + Tc - 1
        lo = max(0, first - cfg.local + 1)  # the first query's oldest local key
        if lo <= cfg.sink:
            columns = torch.arange(0, last + 1, device=q.device)  # [n]
        else:
            columns = torch.cat([torch.arange(0, cfg.sink, device=q.device),
                                 torch.arange(lo, last + 1, device=q.device)])  # [n]
        t = torch.arange(first, last + 1, device=q.device)  # [Tc] query positions
        k = key[:, :, columns]  # [B, Hkv, n, D]
        chunk = Chunk(q, k, scaling, t[None], columns[None], columns[None, None, :] <= t[None, :, None])
        # the masked path's rule on these columns, without its host-side check for a query over budget
        keep = torch.where(self._over_budget(chunk)[:, None, :, None], self._forced(chunk)[:, None],
                           chunk.visible[:, None])  # [1, 1, Tc, n]
        o = F.scaled_dot_product_attention(q, k, value[:, :, columns], attn_mask=keep, scale=scaling,
                                           enable_gqa=True)  # [B, Hq, Tc, Dv]
        return keep, o

    def _decode_plan(self, S: int) -> DecodePlan | None:
        """The keys of an unpadded query at position `S - 1` (it sees all S keys), on the host: None where
        the method's forced keys are not known there (`AttentionMethod.forced_start`)."""
        cfg, method, p = self.config, self.method, S - 1
        start = method.forced_start(p) if method.selects else p + 1
        if start is None:
            return None
        held = S > self._limit()
        low = max(0, min(p - cfg.local + 1, start))  # forced: [0, sink) and [low, S)
        forced = S if low <= cfg.sink else cfg.sink + S - low
        picks = cfg.budget - forced  # `_select`'s picks, the same for every row
        # `_top_keys`' k: picks clamped to [0, S]. A held query's candidates [sink, low) number S - forced
        # > picks, so `_top_keys` neither widens its column slice nor sorts (every row takes k).
        k = max(0, min(picks, S))
        empty = k == 0 or low <= cfg.sink or not method.selects  # `_top_keys` chooses nothing
        return DecodePlan(S, held, low, k, empty)

    def _decode(self, query: Tensor, key: Tensor, value: Tensor, scaling: float, plan: DecodePlan,
                state: LayerState | None, tally: Tally, layer: int) -> Tensor:
        """A held decode step of an unpadded batch (T == 1, no mask): the chunked path's keys, output,
        state and counts, with every size and column range from `plan` (host integers), so it never
        waits for the device. Returns `[B, 1, Hq, Dv]`.

        The budget check of its counts waits until the next call that reads the device anyway, or the
        statistics are read (`check_budget`)."""
        B, Hq, _, _ = query.shape
        Hkv, S = key.shape[1], key.shape[2]
        cfg, method, dev = self.config, self.method, query.device
        if not method.selects:  # sink_window: the sink and local keys, all kept (`_sink_and_local`)
            if S - cfg.local > cfg.sink:
                n = cfg.sink + cfg.local
                k = torch.cat([key[:, :, :cfg.sink], key[:, :, S - cfg.local:]], dim=2)  # [B, Hkv, n, D]
                v = torch.cat([value[:, :, :cfg.sink], value[:, :, S - cfg.local:]], dim=2)
            else:  # every key is a sink or local key
                n, k, v = S, key, value
            keep = torch.ones(1, 1, 1, n, dtype=torch.bool, device=dev)  # [1, 1, 1, n]
            o = F.scaled_dot_product_attention(query, k, v, attn_mask=keep, scale=scaling, enable_gqa=True)
            tally.add_host(B * Hq, B * Hq * n, n, B * Hkv, B * Hkv * n)
            return o.transpose(1, 2).contiguous()  # [B, 1, Hq, Dv]
        kpos = torch.arange(S, device=dev).expand(B, S)  # [B, S]
        qpos = kpos[:, S - 1:]  # [B, 1]
        visible = torch.ones((), dtype=torch.bool, device=dev).expand(B, 1, S)  # [B, 1, S]
        if method.stateful:
            chunk = Chunk(query, key, scaling, qpos, kpos, visible)
            keep, probs = self._decode_stateful(chunk, state.tensors, plan)  # [B, Hq, 1, S] each
            o = grouped_apply(probs, value.float())  # [B, Hq, 1, Dv]
            state.length = S
        else:
            if plan.held:
                prepared = method.prepare(key, kpos, S)
                chunk = Chunk(query, key, scaling, qpos, kpos, visible, prepared)
                score = method.score(chunk)  # [B, Hq, 1, S]
                if method.group_shared:
                    score = group_sum(masked_softmax(score, None), Hkv)  # [B, Hkv, 1, S]
                keep = self._decode_keep(score, plan, Hq)  # [B, Hq, 1, S]
            else:
                keep = torch.ones(B, 1, 1, S, dtype=torch.bool, device=dev)  # all visible keys
            o = F.scaled_dot_product_attention(query, key, value, attn_mask=keep, scale=scaling,
                                               enable_gqa=True)
        activated, kv_read = keep_counts(keep, Hkv)  # [B, 1|Hq, 1], [B, Hkv, 1]
        tally.add_unpadded(activated.expand(B, Hq, 1), kv_read)
        self._unchecked[id(tally)] = (layer, tally)
        return o.nan_to_num(0.0).to(query.dtype).transpose(1, 2).contiguous()  # [B, 1, Hq, Dv]

    def _decode_keep(self, score: Tensor, plan: DecodePlan, Hq: int) -> Tensor:
        """`_select`'s keys for a held decode query: score `[B, Hq|Hkv, 1|, S]` -> keep `[B, Hq, 1|, S]`:
        the sink, the keys from `plan.low` on, and the best `plan.k` candidates `[sink, low)` (`_top_keys`
        on that slice: no `masked_fill`, all are candidates; topk unsorted as every row takes k)."""
        cfg = self.config
        chosen = torch.zeros(score.shape, dtype=torch.bool, device=score.device)
        if not plan.empty:
            masked = score[..., cfg.sink:plan.low].float().contiguous()  # [..., n] all candidates, n > k
            if self.method.stable_ties:
                top = masked.sort(dim=-1, descending=True, stable=True).indices[..., :plan.k]  # [..., k]
            else:
                top = masked.topk(plan.k, dim=-1, sorted=False).indices  # [..., k]
            chosen.scatter_(-1, top + cfg.sink, True)  # every rank is within picks (picks == k)
        if chosen.shape[1] != Hq:  # one selection per KV head: each of its G query heads keeps it
            B, Hkv = chosen.shape[:2]
            chosen = chosen[:, :, None].expand(B, Hkv, Hq // Hkv, *chosen.shape[2:]).reshape(
                B, Hq, *chosen.shape[2:])
        # forced | best: the forced keys are the sink and [low, S); best lies among the candidates
        chosen[..., :cfg.sink] = True
        chosen[..., plan.low:] = True
        return chosen

    def _decode_stateful(self, chunk: Chunk, tensors: dict[str, Tensor], plan: DecodePlan
                         ) -> tuple[Tensor, Tensor]:
        """`_select_stateful` for a held decode query of an unpadded batch (`_decode`): keep and probs
        `[B, Hq, 1, S]`; updates the state `tensors` in place."""
        logits = chunk.logits  # [B, Hq, 1, S]
        B, Hq, _, S = logits.shape
        method = self.method
        if not plan.held:  # attends densely
            keep = torch.ones(B, Hq, 1, S, dtype=torch.bool, device=logits.device)
            probs = masked_softmax(logits, None)  # [B, Hq, 1, S]
            method.update_state(tensors, probs, keep)
            return keep, probs
        score = method.state_score(tensors)  # [B, Hq, S]
        if method.group_shared:
            score = group_sum(score[:, :, None], chunk.key.shape[1])[:, :, 0]  # [B, Hkv, S]
        row = self._decode_keep(score, plan, Hq)  # [B, Hq, S]
        p = masked_softmax(logits[:, :, 0], row)  # [B, Hq, S]
        method.update_state(tensors, p[:, :, None], row[:, :, None])
        return row[:, :, None], p[:, :, None]

    def _select_stateful(self, chunk: Chunk, tensors: dict[str, Tensor], held: bool,
                         unpadded: bool = False) -> tuple[Tensor, Tensor]:
        """Select query by query, each from the state left by the queries before it (H2O).

        Returns keep and probs (float32), both `[B, Hq, Tc, Sc]`; updates the state `tensors` in place.
        `unpadded`: as in `_select` (the query at position p sees p + 1 keys: counted on the host).
        """
        logits = chunk.logits  # [B, Hq, Tc, Sc]
        B, Hq, Tc, Sc = logits.shape
        method = self.method
        visible = chunk.visible[:, None]  # [B, 1, Tc, Sc]
        over = self._over_budget(chunk) & held  # [B, Tc]
        # Leading queries that attend densely in every sequence need no selection: one batched step.
        if unpadded:  # the chunk's queries sit at positions Sc - Tc .. Sc - 1
            n_dense = min(Tc, max(0, self.config.budget - (Sc - Tc))) if held else Tc
        else:  # waits for the device
            n_dense = int(over.any(0).int().argmax()) if over.any() else Tc
        keep = visible.expand(B, Hq, Tc, Sc).clone()  # [B, Hq, Tc, Sc]
        probs = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)  # [B, Hq, Tc, Sc]
        if n_dense:  # the rows after them get their softmax in the loop below
            probs[:, :, :n_dense] = masked_softmax(logits[:, :, :n_dense], keep[:, :, :n_dense])
            method.update_state(tensors, probs[:, :, :n_dense], keep[:, :, :n_dense])
        if n_dense == Tc:
            return keep, probs
        forced = self._forced(chunk)[:, None]  # [B, 1, Tc, Sc]
        picks = self.config.budget - forced.sum(-1, dtype=torch.int32)  # [B, 1, Tc]
        candidates = visible & ~forced  # [B, 1, Tc, Sc]
        G = Hq // chunk.key.shape[1]
        for t in range(n_dense, Tc):
            score = method.state_score(tensors)  # [B, Hq, Sc]
            if method.group_shared:
                score = group_sum(score[:, :, None], chunk.key.shape[1])[:, :, 0]  # [B, Hkv, Sc]
            best = _top_keys(score, candidates[:, :, t], picks[:, :, t])  # [B, Hq|Hkv, Sc]
            if method.group_shared:
                best = best.repeat_interleave(G, dim=1)  # [B, Hq, Sc]
            row = torch.where(over[:, None, t, None], forced[:, :, t] | best, visible[:, :, t])  # [B, Hq, Sc]
            keep[:, :, t] = row
            probs[:, :, t] = p = masked_softmax(logits[:, :, t].contiguous(), row)  # [B, Hq, Sc]
            method.update_state(tensors, p[:, :, None], row[:, :, None])
        return keep, probs

    def _record(
        self, tally: Tally, keep: Tensor, Hq: int, Hkv: int, qpos: Tensor, held: bool, layer: int
    ) -> None:
        """Count keys per query (`keep` `[B, 1|Hq, Tc, Sc]`); fail if a held query is over budget."""
        activated, kv_read = keep_counts(keep, Hkv)
        self._record_counts(tally, activated, kv_read, Hq, qpos, held, layer)

    def _record_counts(
        self, tally: Tally, activated: Tensor, kv_read: Tensor, Hq: int, qpos: Tensor, held: bool, layer: int
    ) -> None:
        """`_record` from the counts: activated `[B, 1|Hq, Tc]`, kv_read `[B, Hkv, Tc]` (int), qpos
        `[B, Tc]`."""
        B, Tc = qpos.shape
        real = qpos >= 0  # [B, Tc]
        top = activated.masked_fill(~real[:, None], 0).amax() if activated.numel() else activated.sum()
        if held and self.method.selects:  # sink and local alone stay within the budget by construction
            self.check_budget()  # the decode steps' counts since the last check
            worst = int(top)  # waits for the device: only where a selection could overrun
            if worst > self.config.budget:
                raise BudgetExceededError(
                    f"layer {layer}: a query attended to {worst} keys, over the budget of "
                    f"{self.config.budget} (method {self.method.name})"
                )
        tally.add(activated.expand(B, Hq, Tc), kv_read, real, top=top)

    def check_budget(self) -> None:
        """BudgetExceededError if a decode step held to the budget attended to more keys since the last
        check. `_decode` leaves its counts' check to here (a read of the device): called by the next
        held call of a selecting method that reads the device anyway, and by `attention_stats`."""
        if not self._unchecked:
            return
        pending, self._unchecked = list(self._unchecked.values()), {}
        tops = torch.stack([tally.top for _, tally in pending]).tolist()  # one wait for the device
        for (layer, _), worst in zip(pending, tops, strict=True):
            if worst > self.config.budget:
                raise BudgetExceededError(
                    f"layer {layer}: a query attended to {worst} keys, over the budget of "
                    f"{self.config.budget} (method {self.method.name})"
                )

    def _layer_state(self, layer: int, B: int, Hq: int, S: int, T: int, device) -> LayerState:
        """The layer's state, grown to cover `S` keys; a fresh one when the cache holds no past."""
        state = self.states.get(layer)
        past = S - T
        if state is None or past == 0:
            state = LayerState(method=self.method)
            self.states[layer] = state
        if state.method is not self.method or state.length != past:
            raise RuntimeError(
                f"{self.method.name}: layer {layer} has no state for the {past} cached keys (it covers "
                f"{state.length}, written by {getattr(state.method, 'name', None)!r}); pass one cache "
                "through every call of a sequence (generate() does), and do not switch methods mid-sequence"
            )
        self.method.grow_state(state.tensors, B, Hq, S, device)
        return state


def check_cache(cache: Any, method: str) -> None:
    """UsageError unless `cache` is a plain transformers `DynamicCache` of full-attention layers.

    The controller reads a layer call's keys as the whole sequence so far, the T new keys last
    (`_positions`, `_layer_state`, the chunks' key ranges). A preallocated cache (`StaticCache`,
    anything `is_compileable`, `generate(..., cache_implementation="static")`) hands attention every
    slot, written or not; a sliding-window layer drops old keys. Either would give silently wrong
    positions, sinks and budgets, so both are refused before the forward does any work.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    problem = None
    if type(cache) is not DynamicCache:
        problem = f"a {type(cache).__name__}"
    elif getattr(cache, "is_compileable", False):
        problem = f"a compileable (preallocated) {type(cache).__name__}"
    else:
        layers = [type(layer) for layer in getattr(cache, "layers", [])]
        replicate = getattr(cache, "layer_class_to_replicate", None)
        if replicate is not None:
            layers.append(replicate)
        other = sorted({cls.__name__ for cls in layers if cls is not DynamicLayer})
        if other:
            problem = f"a {type(cache).__name__} with {', '.join(other)} layers"
    if problem is not None:
        raise UsageError(
            f"attention method {method!r} got {problem} as its KV cache; a dynamic cache is expected: "
            "transformers' DynamicCache of full-attention layers (generate()'s default), whose keys are "
            "the sequence so far with the new ones last (no cache_implementation='static', no "
            "preallocated, sliding-window or quantized cache)"
        )

# ----------------------------------------------------------------------------------------------------------
# Small tensor helpers
# ----------------------------------------------------------------------------------------------------------


def _allowed_keys(mask: Tensor | None, B: int, T: int, S: int) -> Tensor | None:
    """The model's 4D mask `[B|1, 1|H, T, S]` (bool True = attend, or additive float) as `[B, T, S]` bool."""
    if mask is None:
        return None
    if mask.dim() != 4:
        raise ValueError(f"expected a 4D attention mask [B, 1, T, S], got shape {tuple(mask.shape)}")
    mask = mask[:, 0, -T:, -S:]  # [B|1, T, S]
    allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    return allowed.expand(B, T, S)


def _positions(allowed: Tensor | None, B: int, T: int, S: int, device) -> tuple[Tensor, Tensor]:
    """Key positions `[B, S]` and query positions `[B, T]`: rank among real keys, -1 for padding.

    The queries are the last T keys (transformers appends them to the cache before attention).
    """
    if allowed is None:
        kpos = torch.arange(S, device=device).expand(B, S)  # [B, S]
    else:
        real = allowed.any(1)  # [B, S]: a real key is seen by some query (at least by itself)
        kpos = torch.where(real, real.long().cumsum(-1) - 1, -1)  # [B, S]
    qpos = kpos[:, S - T :]  # [B, T]
    return kpos, qpos


def _top_keys(score: Tensor, candidates: Tensor, picks: Tensor, stable: bool = False) -> Tensor:
    """Bool mask of the `picks` best-scoring candidates per row.

    Args:
        score: `[..., S]` float, higher is better.
        candidates: `[..., S]` bool, the keys allowed to compete (broadcast against score).
        picks: `[...]` int, how many to take per row (broadcast; fewer if fewer candidates).
        stable: among equal scores prefer earlier keys (a full stable sort; `topk`'s order is unspecified).
    """
    S = score.shape[-1]
    k = int(picks.clamp(0, S).max()) if picks.numel() else 0
    chosen = torch.zeros(score.shape, dtype=torch.bool, device=score.device)
    if k == 0:
        return chosen
    # Only the columns where some row has a candidate compete (drops sink, local and future keys).
    columns = candidates.reshape(-1, candidates.shape[-1]).any(0).nonzero()  # [n, 1]
    if columns.numel() == 0:
        return chosen
    first, last = int(columns[0]), int(columns[-1]) + 1
    if last - first < k:  # keep the slice wide enough for topk (k <= S)
        first = max(0, last - k)
        last = max(last, first + k)
    masked = score[..., first:last].float().masked_fill(~candidates[..., first:last], -math.inf)
    if stable:
        top = masked.sort(dim=-1, descending=True, stable=True).indices[..., :k]  # [..., k]
    else:  # ranks matter only where rows take different numbers of keys
        top = masked.topk(k, dim=-1, sorted=bool((picks != k).any())).indices  # [..., k]
    top = top + first  # [..., k] column indices into S
    rank_ok = torch.arange(k, device=score.device) < picks[..., None]  # [..., k]
    chosen.scatter_(-1, top, rank_ok.expand_as(top))
    return chosen & candidates


def nsa_eval_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """The function registered with transformers' AttentionInterface: dispatch to the module's controller.

    Args:
        query: `[B, Hq, T, D]`; key, value: `[B, Hkv, S, D]` (the whole cache, the T new keys last).
        attention_mask: `[B|1, 1, T, S]` bool (True = attend) or None for plain causal.

    Returns:
        (`[B, T, Hq, Dv]`, None): no attention weights are returned.
    """
    controller = getattr(module, MODULE_ATTRIBUTE, None)
    if controller is None:
        raise RuntimeError(
            f"attention implementation {ATTN_IMPLEMENTATION!r} needs "
            "nsa_eval.methods.apply_attention(model, ...)"
        )
    if dropout:
        raise ValueError("nsa_eval attention methods are for inference: dropout must be 0 (model.eval())")
    return controller.attend(module, query, key, value, attention_mask, scaling, **kwargs), None
