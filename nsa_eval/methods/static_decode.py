"""One layer's decode step over a static cache (static_cache.py): the keys, output, state and counts of the
controller's `_decode`, with every shape fixed by the cache's width and every length read on the device.

Row b's query sits at position `p = lens[b]` and sees the `S = p + 1` slots before and at it (slot = position:
the cache holds no padding). Everything `_decode_plan` worked out on the host is worked out here per row
as device tensors of fixed shape, so the step is the same launches at every position and a CUDA graph can
replay it (nsa_eval/models/hf_decode_graph.py):

- dense (`full`, and `dense_layers`): attention over the slots below `S`; on CUDA in bf16/fp16 through
  FlashAttention's varlen kernel with the lengths on the device (`flash_decode`), which reads only the
  written keys; elsewhere SDPA with the slots masked;
- `sink_window`: the `sink + local` slots gathered by index (`sink_and_local_decode`), as `_decode` cuts them;
- selecting methods (`select_step`): sink `[0, sink)` and `[low, S)` forced (`low` from `forced_start`, on
  tensors), and the best `budget - forced` candidates of `[sink, low)`: the method's scores over the `width`
  slots (topk's `Chunk.logits`: on a GPU in half precision baseline_kernels/decode_scores.py, which reads the
  keys without a float32 copy of the cache), the candidates elsewhere masked, a top-k of the largest number
  any row may take, then each row's own count by rank (a stable sort for `stable_ties`, Quest); then the
  attention over the kept slots alone (`gathered_attend`): per row and selection head (query head, or KV
  head under `group_shared`) a list of `n = min(width, budget)` slots, the sink, the picks and `[low, S)`
  (a row under the budget: slots `0 .. n - 1`, those below S valid), its keys and values gathered
  `[B, R, n, D]` and attended with the list's mask. H2O's logits, softmax and `probs @ v` are float32 over
  the gathered keys only, and its mass, in its fixed buffer, is updated at the listed slots
  (`H2O.static_update`). `masked_attend`, the same attention as a mask over all `width` slots, is the
  reference (tests/methods/test_static_gather.py).

Counts: a selecting layer adds its keys attended and KV tokens read (from its lists: the valid entries, and
per KV head the union of its query heads' lists) to the cache's `StaticCounts.totals` on the device. Dense
and `sink_window` layers count nothing per step: their keys are a function of the lengths, which the host
knows (`fold_counts` adds them, as `_decode` adds `sink_window`'s).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from nsa_eval.methods.base import (
    Chunk,
    group_sum,
    grouped_apply,
    grouped_scores,
    keep_counts,
    masked_softmax,
)
from nsa_eval.methods.static_cache import StaticCounts, StaticDecodeCache


def static_attend(controller, layer: int, query: Tensor, key: Tensor, value: Tensor, scaling: float,
                  cache: StaticDecodeCache) -> Tensor:
    """query `[B, Hq, 1, D]`, key/value `[B, Hkv, W, D]` (the cache's first W slots, this step's token written
    at `lens`) -> output `[B, 1, Hq, Dv]`."""
    method, cfg = controller.method, controller.config
    B, Hkv, D = query.shape[0], key.shape[1], key.shape[-1]
    S = cache.lens + 1  # [B] keys each row's query sees, its own included
    if not method.sparse or layer < cfg.dense_layers:
        return dense_decode(query, key, value, S, scaling, cache)
    if not method.selects:
        return sink_and_local_decode(query, key, value, S, scaling, cfg.sink, cfg.local)

    state = cache.state[layer]
    if state:
        slot = cache.lens.view(B, 1, 1, 1)
        method.static_append(state, key.gather(2, slot.expand(B, Hkv, 1, D)), cache.lens)
    step = select_step(method, cfg, query, key, scaling, S, state)
    out, activated, kv_read = gathered_attend(method, cfg, step, query, key, value, scaling)
    totals = cache.counts.totals[layer]  # [3]: keys attended, KV tokens read, most keys one query attended
    totals[:2] += torch.stack([activated.sum(dtype=torch.int64), kv_read.sum(dtype=torch.int64)])
    totals[2:].copy_(torch.maximum(totals[2:], activated.amax().long()))
    return out.nan_to_num(0.0).to(query.dtype).transpose(1, 2).contiguous()  # [B, 1, Hq, Dv]


@dataclass
class StepSelection:
    """A selecting layer's choice for one decode step, in shapes fixed by the width W: per row b and
    selection head r (a query head, or a KV head under `group_shared`: R of them).

    Attributes:
        S: `[B]` keys row b's query sees (slots `0 .. S - 1`).
        low: `[B]` the forced keys are the sink `[0, sink)` and `[low, S)`.
        picks: `[B]` candidates `[sink, low)` a held row takes: `budget - forced`.
        held: `[B]` bool, the row sees more than `budget` keys (else it keeps every visible one).
        top: `[B, R, k]` int64, candidate slots best first (k = `budget - sink - local`, at most W; 0 when
            the method picks none).
        ok: `[B, R, k]` bool, within the row's picks and a candidate (a top-k over fewer candidates than k
            fills with others).
        chunk: what the method scored (`Chunk.logits` over all W slots: the masked reference's).
        tensors: a stateful method's state cut to W slots (views: updates land in the buffers), else None.
    """

    S: Tensor
    low: Tensor
    picks: Tensor
    held: Tensor
    top: Tensor
    ok: Tensor
    chunk: Chunk
    tensors: dict[str, Tensor] | None


def select_step(method, cfg, query: Tensor, key: Tensor, scaling: float, S: Tensor,
                state: dict[str, Tensor]) -> StepSelection:
    """`_decode_plan` and `_decode_keep` on device tensors: the forced range, picks and the method's best
    candidates of each row. query `[B, Hq, 1, D]`, key `[B, Hkv, W, D]`, S `[B]`, state: the layer's
    static state (`AttentionMethod.static_state`)."""
    B, W, Hkv = query.shape[0], key.shape[2], key.shape[1]
    slots = torch.arange(W, device=query.device)  # [W] slot = position
    visible = slots < S[:, None]  # [B, W]
    p = S - 1  # [B]
    low = torch.minimum(p - cfg.local + 1, method.forced_start(p)).clamp(min=0)  # [B] forced: [low, S)
    candidates = (slots >= cfg.sink) & (slots < low[:, None])  # [B, W]
    picks = cfg.budget - torch.where(low <= cfg.sink, S, cfg.sink + S - low)  # [B] `_decode_plan`'s picks
    chunk = Chunk(query, key, scaling, p[:, None], slots.expand(B, W), visible[:, None],
                  method.static_prepared(state, W))
    tensors = None
    if method.stateful:
        tensors = {name: t[..., :W] for name, t in state.items()}  # views: updates land in the buffers
        score = method.state_score(tensors)  # [B, Hq, W]
        if method.group_shared:
            score = group_sum(score[:, :, None], Hkv)[:, :, 0]  # [B, Hkv, W]
    else:
        score = method.score(chunk)  # [B, Hq, 1, W]
        if method.group_shared:
            score = group_sum(masked_softmax(score, visible[:, None, None]), Hkv)  # [B, Hkv, 1, W]
        score = score[:, :, 0]  # [B, R, W]
    top, ok = top_candidates(score, candidates, picks, max(0, cfg.selected), method.stable_ties)
    return StepSelection(S, low, picks, S > cfg.budget, top, ok, chunk, tensors)


def top_candidates(score: Tensor, candidates: Tensor, picks: Tensor, most: int, stable: bool
                   ) -> tuple[Tensor, Tensor]:
    """Per row the `picks[b]` best-scoring candidates, as `_top_keys` takes them, in fixed shapes.

    Args:
        score: `[B, R, W]` float, higher is better.
        candidates: `[B, W]` bool.
        picks: `[B]` int, keys to take per row (fewer if fewer candidates).
        most: the largest `picks` can be (`budget - sink - local`): the top-k's fixed k.
        stable: among equal scores prefer earlier slots (a full stable sort, as Quest's `_top_keys`).

    Returns:
        top `[B, R, k]` int64 slots, best first, and ok `[B, R, k]` bool: rank below `picks[b]` and a
        candidate; k = min(most, W).
    """
    B, R, W = score.shape
    k = min(most, W)
    if k == 0:
        return score.new_zeros(B, R, 0, dtype=torch.long), score.new_zeros(B, R, 0, dtype=torch.bool)
    masked = score.float().masked_fill(~candidates[:, None], -torch.inf)  # [B, R, W]
    if stable:
        top = masked.sort(dim=-1, descending=True, stable=True).indices[..., :k]  # [B, R, k]
    else:
        top = masked.topk(k, dim=-1).indices  # [B, R, k], best first
    rank_ok = torch.arange(k, device=score.device) < picks[:, None, None]  # [B, 1, k]
    return top, rank_ok & candidates[:, None].expand(B, R, W).gather(-1, top)


def kept_slots(step: StepSelection, sink: int, n: int) -> tuple[Tensor, Tensor]:
    """Each (row, selection head)'s kept slots as a list of fixed length `n = min(W, budget)`.

    A held row lists the sink `[0, sink)`, its picks best first, then `[low, S)`: `sink + picks + (S - low)`
    = `budget` entries (`picks` is `budget - forced`), all valid but picks that are not `ok`. A row that
    is not held lists slots `0 .. n - 1`, valid below S (S <= budget and S <= W, so none is left out).
    Both are one layout: a row that is not held picks none and its `[low, S)` starts at the sink.

    Returns:
        index `[B, R, n]` int64, every entry a slot below W (distinct among the valid ones), and valid
        `[B, R, n]` bool.
    """
    B, R, k = step.top.shape
    W = step.chunk.key.shape[2]
    i = torch.arange(n, device=step.S.device)  # [n] list position
    taken = torch.where(step.held, step.picks.clamp(0, k), 0)[:, None]  # [B, 1] picks listed
    low = torch.where(step.held, step.low.clamp(min=sink), sink)[:, None]  # [B, 1] the range after them
    slot = torch.where(i < sink, i, low + i - sink - taken)  # [B, n] sink and [low, S)
    index = slot.clamp(max=W - 1)[:, None].expand(B, R, n)  # [B, R, n]
    valid = (slot < step.S[:, None])[:, None].expand(B, R, n)  # [B, R, n]
    if k:
        rank = (i - sink).clamp(0, k - 1).expand(B, R, n)  # [B, R, n] the pick a position lists
        picked = ((i >= sink) & (i < sink + taken))[:, None]  # [B, 1, n]
        index = torch.where(picked, step.top.gather(-1, rank), index)
        valid = torch.where(picked, step.ok.gather(-1, rank), valid)
    return index, valid


def gathered_attend(method, cfg, step: StepSelection, query: Tensor, key: Tensor, value: Tensor,
                    scaling: float) -> tuple[Tensor, Tensor, Tensor]:
    """The step's attention over its kept slots only (`kept_slots`), gathered from the cache: the keys and
    values `[B, R, n, D]`, n <= budget, then SDPA with the list's mask (a stateful method: float32 logits,
    softmax and `probs @ v` on the gathered keys, its state updated at them, `static_update`).

    Returns:
        out `[B, Hq, 1, Dv]`, keys attended per query head `[B, Hq]` and KV tokens read per KV head
        `[B, Hkv]` (the union over its query heads), int32.
    """
    B, Hq = query.shape[:2]
    Hkv, W = key.shape[1], key.shape[2]
    index, valid = kept_slots(step, cfg.sink, min(W, cfg.budget))  # [B, R, n]
    k, v = gather_slots(key, index), gather_slots(value, index)  # [B, R, n, D], [B, R, n, Dv]
    kept = per_query_head(valid, Hq)  # [B, Hq, n]
    if method.stateful:
        logits = grouped_scores(query.float(), k.float()) * scaling  # [B, Hq, 1, n]
        probs = masked_softmax(logits, kept[:, :, None])  # [B, Hq, 1, n]
        method.static_update(step.tensors, probs[:, :, 0], per_query_head(index, Hq), kept)
        out = grouped_apply(probs, v.float())  # [B, Hq, 1, Dv]
    else:
        out = grouped_sdpa(query, k, v, kept[:, :, None], scaling)  # [B, Hq, 1, Dv]
    activated = kept.sum(-1, dtype=torch.int32)  # [B, Hq]: the valid entries are distinct slots
    if index.shape[1] == Hkv:  # one list per KV head
        return out, activated, valid.sum(-1, dtype=torch.int32)
    # the union of a KV head's G lists: mark their slots (invalid entries on a spare slot W) and count
    marks = torch.zeros(B, Hkv, W + 1, dtype=torch.bool, device=query.device)
    marks.scatter_(-1, index.masked_fill(~valid, W).view(B, Hkv, -1), True)
    return out, activated, marks[..., :W].sum(-1, dtype=torch.int32)


def masked_attend(method, cfg, step: StepSelection, query: Tensor, key: Tensor, value: Tensor,
                  scaling: float) -> tuple[Tensor, Tensor, Tensor]:
    """`gathered_attend`'s reference: attention over the whole width with the kept slots as a mask
    (`kept_mask`). Same returns."""
    Hq, Hkv = query.shape[1], key.shape[1]
    keep = per_query_head(kept_mask(step, cfg.sink), Hq)[:, :, None]  # [B, Hq, 1, W]
    if method.stateful:
        probs = masked_softmax(step.chunk.logits, keep)  # [B, Hq, 1, W]
        method.update_state(step.tensors, probs, keep)
        out = grouped_apply(probs, value.float())  # [B, Hq, 1, Dv]
    else:
        out = grouped_sdpa(query, key, value, keep, scaling)  # [B, Hq, 1, Dv]
    activated, kv_read = keep_counts(keep, Hkv)  # [B, Hq, 1], [B, Hkv, 1]
    return out, activated[..., 0], kv_read[..., 0]


def kept_mask(step: StepSelection, sink: int) -> Tensor:
    """`kept_slots`' reference, as `_decode_keep` writes it: `[B, R, W]` bool, the forced slots and the ok
    picks where a row is held (`forced | best`), else every visible slot."""
    B, R, _ = step.top.shape
    W = step.chunk.key.shape[2]
    slots = torch.arange(W, device=step.S.device)  # [W]
    visible = slots < step.S[:, None]  # [B, W]
    forced = ((slots < sink) | (slots >= step.low[:, None])) & visible  # [B, W]
    best = torch.zeros(B, R, W, dtype=torch.bool, device=slots.device).scatter_(-1, step.top, step.ok)
    return torch.where(step.held[:, None, None], forced[:, None] | best, visible[:, None])  # [B, R, W]


def gather_slots(x: Tensor, index: Tensor) -> Tensor:
    """x `[B, Hkv, W, D]`, index `[B, R, n]` (R a multiple of Hkv: list r reads KV head `r // (R / Hkv)`)
    -> `[B, R, n, D]`."""
    B, Hkv = x.shape[:2]
    R = index.shape[1]
    rows = torch.arange(B, device=x.device)[:, None, None]  # [B, 1, 1]
    heads = (torch.arange(R, device=x.device) // (R // Hkv))[None, :, None]  # [1, R, 1]
    # whole rows of D by advanced indexing (a `gather` indexes every element: 5x slower on a CPU)
    return x[rows, heads, index]  # [B, R, n, D]


def per_query_head(x: Tensor, Hq: int) -> Tensor:
    """`[B, R, ...]` per selection head -> `[B, Hq, ...]`: each KV head's list for its G query heads."""
    return x if x.shape[1] == Hq else x.repeat_interleave(Hq // x.shape[1], dim=1)


def dense_decode(query: Tensor, key: Tensor, value: Tensor, S: Tensor, scaling: float,
                 cache: StaticDecodeCache) -> Tensor:
    """Each row's query over its first `S[b]` slots: query `[B, Hq, 1, D]`, key/value `[B, Hkv, W, D]` ->
    `[B, 1, Hq, Dv]`. FlashAttention reads only the written slots where it runs (`flash_decode`); SDPA with
    the rest masked is the reference and the fallback."""
    if cache.flash is not False and flash_ready(query, key):
        try:
            out = flash_decode(query, key, value, S, scaling)
            cache.flash = True
            return out
        except (RuntimeError, TypeError):  # a PyTorch without the kernel or its `seqused_k`
            if cache.flash:  # it ran at an earlier step: this is a real error
                raise
            cache.flash = False
    mask = (torch.arange(key.shape[2], device=key.device) < S[:, None])[:, None, None]  # [B, 1, 1, W]
    return grouped_sdpa(query, key, value, mask, scaling).transpose(1, 2).contiguous()  # [B, 1, Hq, Dv]


def grouped_sdpa(query: Tensor, key: Tensor, value: Tensor, keep: Tensor, scaling: float) -> Tensor:
    """Masked attention of one query per head: query `[B, Hq, 1, D]`, key/value `[B, Hkv, W, D]`, keep
    `[B, 1|Hq, 1, W]` bool -> `[B, Hq, 1, Dv]`. Each KV head's G query heads go in as G queries of that
    head, so SDPA reads each key once and needs no GQA support (PyTorch's masked GQA path copies the keys
    and values per query head)."""
    B, Hq, _, D = query.shape
    Hkv, W = key.shape[1], key.shape[2]
    mask = keep.expand(B, Hq, 1, W).reshape(B, Hkv, Hq // Hkv, W)  # [B, Hkv, G, W]
    out = F.scaled_dot_product_attention(query.reshape(B, Hkv, Hq // Hkv, D), key, value, attn_mask=mask,
                                         scale=scaling)  # [B, Hkv, G, Dv]
    return out.reshape(B, Hq, 1, value.shape[-1])


def flash_ready(query: Tensor, key: Tensor) -> bool:
    """Whether FlashAttention takes these tensors: CUDA, half precision, a head dim it compiles for."""
    return (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] % 8 == 0
            and query.shape[-1] <= 256 and key.stride(-1) == 1 and torch.backends.cuda.flash_sdp_enabled())


def flash_decode(query: Tensor, key: Tensor, value: Tensor, S: Tensor, scaling: float) -> Tensor:
    """`dense_decode` through FlashAttention's varlen forward, each (row, KV head) one sequence of its G query
    heads against that head's slots, `seqused_k` its length on the device (FlashAttention splits a long one
    over blocks for decoding, and never reads past it). key/value are views of `[B, Hkv, C, D]` buffers."""
    B, Hq, _, D = query.shape
    Hkv, W, C = key.shape[1], key.shape[2], key.stride(1) // key.stride(2)
    n = B * Hkv
    device = query.device
    if key.stride(2) != D or value.stride(2) != value.shape[-1] or value.stride(1) != C * value.shape[-1]:
        raise RuntimeError("flash_decode reads keys and values as [B, Hkv, C, D] buffers")
    k = key.as_strided((n * C, 1, D), (D, D, 1))  # [B * Hkv * C, 1, D]
    v = value.as_strided((n * C, 1, value.shape[-1]), (value.shape[-1],) * 2 + (1,))
    q = query.reshape(n, Hq // Hkv, D)  # [B * Hkv, G, D]: one query token per sequence
    cu_q = torch.arange(n + 1, dtype=torch.int32, device=device)
    cu_k = cu_q * C
    used = S.to(torch.int32).repeat_interleave(Hkv)  # [B * Hkv]
    out = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, 1, W, 0.0, False, False, scale=scaling,
                                                  seqused_k=used)[0]  # [B * Hkv, G, Dv]
    return out.view(B, 1, Hq, value.shape[-1])


def sink_and_local_decode(query: Tensor, key: Tensor, value: Tensor, S: Tensor, scaling: float, sink: int,
                          local: int) -> Tensor:
    """`_decode`'s sink_window step: each row's sink slots and its `local` most recent, `sink + local` slots
    gathered (all of the first `S` while the window has not left the sink). -> `[B, 1, Hq, Dv]`."""
    B, Hkv, W, D = key.shape
    n = sink + local
    i = torch.arange(n, device=key.device)  # [n]
    apart = S > sink + local  # [B]: the local window has left the sink
    index = torch.where(apart[:, None] & (i >= sink), S[:, None] - n + i, i).clamp(max=W - 1)  # [B, n]
    mask = apart[:, None] | (i < S[:, None])  # [B, n]
    k = key.gather(2, index[:, None, :, None].expand(B, Hkv, n, D))  # [B, Hkv, n, D]
    v = value.gather(2, index[:, None, :, None].expand(B, Hkv, n, value.shape[-1]))
    out = grouped_sdpa(query, k, v, mask[:, None, None], scaling)  # [B, Hq, 1, Dv]
    return out.transpose(1, 2).contiguous()


def fold_counts(counts: StaticCounts, stats, method, config) -> list:
    """Add the steps of `counts` since the last fold to `stats` (an `AttentionStats`) and start afresh.

    A selecting layer's totals come from the device; a dense layer's query at step t of a row holding r
    keys after its prompt attends `r + t` keys, a `sink_window` layer's `min(r + t, sink + local)`.
    Returns the (layer, tally) pairs whose totals came from the device (for the budget check).
    """
    first, last = counts.folded, counts.steps
    if last == first:
        return []
    B, steps = len(counts.rows), last - first
    checked = []
    for layer in range(len(counts.totals)):
        held = method.sparse and layer >= config.dense_layers
        tally = stats.tally(layer, "decode", held)
        queries, kv_queries = B * counts.heads * steps, B * counts.kv_heads * steps
        if held and method.selects:
            tally.add_device_totals(counts.totals[layer], queries, kv_queries)
            checked.append((layer, tally))
            continue
        cap = config.sink + config.local if held else None
        keys = sum(_keys_summed(r, first, last, cap) for r in counts.rows)
        top = max(r + last for r in counts.rows)
        tally.add_host(queries, counts.heads * keys, top if cap is None else min(top, cap), kv_queries,
                       counts.kv_heads * keys)
    counts.totals.zero_()
    counts.folded = last
    return checked


def _keys_summed(r: int, first: int, last: int, cap: int | None) -> int:
    """The sum over steps t = first + 1 .. last of min(r + t, cap) (cap None: no cap)."""
    upto = last if cap is None else min(last, max(first, cap - r))  # steps before the cap binds
    below = (upto - first) * r + (upto * (upto + 1) - first * (first + 1)) // 2
    return below + (last - upto) * (cap or 0)
