"""The interface every attention method implements: a dataclass of its own parameters and its scoring rule.

A method is a small dataclass (`full.py`, `sink_window.py`, `topk.py`, `quest.py`, `h2o.py`) that
subclasses `AttentionMethod` and writes only how keys are ranked, as kvpress's ScorerPress subclasses
write only `score()`:

- `score(chunk)`: higher = keep; the controller keeps the best `budget - sink - local` keys outside
  the sink and local windows (`topk`: `q . k`; `quest`: its page bound);
- `forced(chunk)`: keys always kept besides sink and local, counted in the budget (Quest's own page);
- `prepare(key, kpos, num_positions)`: per-layer-call precomputation over all keys (Quest's page
  summaries);
- `forced_start(position)`: where `forced()` starts for an unpadded query, as a host int, so that a
  decode step needs no read of the device (controller.py's `_decode_plan`);
- a stateful method (`stateful = True`, H2O) is selected query by query from a state the earlier
  queries left: `grow_state`, `state_score`, `update_state` (`static_update`: the same for a decode query
  that attended only at a list of slots);
- `static_state`, `static_append`, `static_prepared`: the method's decode state in the fixed buffers of a
  `StaticDecodeCache` (Quest's page bounds, H2O's mass), for the fixed-shape step of static_decode.py;
- `triton_prefill(call)`: the method's own kernels (nsa_eval/baseline_kernels/) for a held prefill
  of an unpadded batch, giving the chunked path's keys, output and counts; the controller takes them
  on CUDA tensors (`fast_prefill`). A new method with a kernel is its file and its kernel.

Everything else (budget, masking, positions, chunking, the per-forward state, the attention function)
is the controller's (controller.py); the activated-token counts are stats.py's. `BudgetConfig`
(nsa_eval/budget.py) holds the budget settings shared by every method. Shapes follow transformers'
attention interface: query `[B, Hq, T, D]`, key/value `[B, Hkv, S, D]`; `Hq = G * Hkv` and query head
`h` reads KV head `h // G`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from nsa_eval.budget import BudgetConfig
from nsa_eval.errors import UsageError

# what a fast prefill returns: output [B, Hq, T, Dv], keys attended [B, Hq, T] and KV tokens read
# per (query, KV head) [B, Hkv, T] (int)
PrefillResult = tuple[Tensor, Tensor, Tensor]


@dataclass
class Chunk:
    """One chunk of queries against the keys it can see (those up to its last query) in one layer call.

    Attributes:
        query: `[B, Hq, Tc, D]`, the chunk's queries (model dtype).
        key: `[B, Hkv, Sc, D]`, the keys up to the chunk's last query (model dtype).
        scaling: the softmax scale.
        qpos: `[B, Tc]` int64, each query's position in its sequence (-1 for a padding query).
        kpos: `[B, Sc]` int64, each key's position in its sequence (-1 for a padding key).
        visible: `[B, Tc, Sc]` bool, keys the query may see at all (causal, not padding, model mask).
        prepared: what the method's `prepare()` returned for this layer call (over all S keys).
    """

    query: Tensor
    key: Tensor
    scaling: float
    qpos: Tensor
    kpos: Tensor
    visible: Tensor
    prepared: Any = None

    @functools.cached_property
    def logits(self) -> Tensor:
        """`[B, Hq, Tc, Sc]` float32, scaled `q . k` before any mask (computed on first use). A decode query
        (Tc = 1) of a half-precision model on a GPU takes baseline_kernels/decode_scores.py, which reads the
        keys as they are instead of a float32 copy of them all (every decode path, eager or static, does)."""
        if self.query.shape[2] == 1 and half_on_gpu(self.query, self.key):
            from nsa_eval.baseline_kernels.decode_scores import decode_scores

            return decode_scores(self.query, self.key, self.scaling)
        return grouped_scores(self.query.float(), self.key.float()) * self.scaling


def half_on_gpu(query: Tensor, key: Tensor) -> bool:
    """Query and keys are CUDA tensors of one 16-bit float dtype, outside autograd: what the decode score
    kernel takes (a float32 model's scores need no upcast, and stay a float32 GEMM)."""
    return (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and key.dtype == query.dtype
            and not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad)))


@dataclass
class Prefill:
    """One layer call that a method's kernels may take: a prefill of an unpadded batch (no mask, so a
    key's index is its position), the T queries the last T of the S keys, held to the budget or (a
    stateful method's, `held` False) dense while its state gathers.

    Attributes:
        query: `[B, Hq, T, D]`; key, value: `[B, Hkv, S, D]`, `[B, Hkv, S, Dv]` (model dtype).
        scaling: the softmax scale.
        config: the budget settings.
        state: the layer's state tensors (a stateful method's, e.g. H2O's mass `[B, Hq, S]`, updated in
            place), or None.
        reference: `reference(rows, out, counts, kv_read)`: the controller's chunked path for the queries
            `rows` `[n]` (ascending indices into T), written into out `[B, Hq, T, Dv]`, counts `[B, Hq, T]`
            and kv_read `[B, Hkv, T]`; a stateful method's rows are its leading queries (each updates
            the state the next one reads).
        held: the queries are held to the budget (False: a stateful method's dense prefill, e.g. H2O's
            `sparse_prefill: false`, where only the state is the method's).
    """

    query: Tensor
    key: Tensor
    value: Tensor
    scaling: float
    config: BudgetConfig
    state: dict[str, Tensor] | None = None
    reference: Callable[[Tensor, Tensor, Tensor, Tensor], None] | None = None
    held: bool = True

    def kernel_inputs(self) -> tuple[Tensor, Tensor, Tensor]:
        """query, key and value with unit stride in the head dim, as the kernels read them, after the
        installed Triton's version is checked."""
        from nsa_eval.kernels import _validate

        _validate.check_installed_triton()
        return tuple(x if x.stride(-1) == 1 else x.contiguous() for x in (self.query, self.key, self.value))


@dataclass
class AttentionMethod:
    """Base of every method: one dataclass per method, its fields are the method's own parameters.

    Subclasses set `name`, and override `score()` (higher = keep; the base picks the best keys
    outside sink and local), optionally `forced()` (extra keys always kept, counted in the budget) and
    `prepare()` (per-layer-call precomputation). A stateful method (`stateful = True`, H2O) is
    selected query by query with `state_score()`/`update_state()` instead. A method with kernels
    overrides `triton_prefill()`.

    Fields shared by all methods:
        query_chunk: queries per chunk; the chunk's scores are `[B, Hq, query_chunk, S]` float32.
        group_shared: one selection per KV head instead of per query head: the G heads of a GQA group
            rank keys by the sum of their probabilities (each head's scores softmax-normalised over the
            keys it may see; H2O's accumulated attention summed), as NSA's group shares its blocks. A
            KV head then reads `budget` keys per query instead of up to G x budget.
    """

    name: ClassVar[str] = ""
    sparse: ClassVar[bool] = True  # False only for full attention: no budget applies
    selects: ClassVar[bool] = True  # False for sink_window: sink and local only
    stateful: ClassVar[bool] = False
    stable_ties: ClassVar[bool] = False  # break score ties by position (a stable sort) instead of topk

    query_chunk: int = 512
    group_shared: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.query_chunk, int) or self.query_chunk < 1:
            raise UsageError(f"query_chunk must be a positive integer, got {self.query_chunk!r}")
        if not isinstance(self.group_shared, bool):
            raise UsageError(f"group_shared must be true or false, got {self.group_shared!r}")

    def params(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def prepare(self, key: Tensor, kpos: Tensor, num_positions: int | None = None) -> Any:
        """Per-layer-call precomputation from key `[B, Hkv, S, D]` and kpos `[B, S]` (e.g. page summaries).
        `num_positions`: `kpos.max() + 1` where the host knows it (an unpadded batch: S), else None."""
        return None

    def score(self, chunk: Chunk) -> Tensor:
        """`[B, Hq, Tc, S]` float: which keys to keep first (only keys outside sink and local compete).
        A logit on the softmax's scale (`chunk.logits` or comparable): `group_shared` normalises it per
        head with a softmax before summing over the group."""
        raise NotImplementedError

    def forced(self, chunk: Chunk) -> Tensor | None:
        """`[B, Tc, S]` bool: keys kept besides sink and local, counted in the budget; None for none."""
        return None

    def forced_start(self, position: int) -> int | None:
        """For an unpadded query at `position` (every key before it visible): `forced()` keeps exactly the
        keys at positions `forced_start(position) .. position` (`position + 1`: none). None when `forced()`
        is not of that form (then a decode step reads its keys off the device)."""
        return position + 1 if type(self).forced is AttentionMethod.forced else None

    def check(self, config: BudgetConfig) -> None:
        """Raise UsageError if this method cannot work with these budget settings."""

    # ---- a method with its own kernels: the prefill without the chunked path
    def fast_prefill(self, call: Prefill) -> PrefillResult | None:
        """What the controller asks first for a held (or stateful) prefill of an unpadded batch:
        `triton_prefill` on CUDA tensors (the kernels compile for the GPU), None elsewhere (the chunked
        path then runs)."""
        return self.triton_prefill(call) if call.query.is_cuda else None

    def triton_prefill(self, call: Prefill) -> PrefillResult | None:
        """The method's Triton prefill (nsa_eval/baseline_kernels/) on any device Triton runs on (CUDA; CPU
        tensors under Triton's interpreter): the chunked path's keys, and its output and counts
        (`PrefillResult`) to rounding; None where the kernels do not take this call. Default: no kernels."""
        return None

    # ---- decode steps from a static cache (static_cache.py, static_decode.py): fixed shapes
    def static_state(self, key: Tensor, lens: Tensor, capacity: int,
                     prefill: dict[str, Tensor] | None) -> dict[str, Tensor]:
        """The layer's decode state in buffers for `capacity` tokens per row, from the keys
        `[B, Hkv, capacity, D]` (row b's first `lens[b]` `[B]` slots written, slot = position) and the state
        so far (`prefill`: a stateful method's tensors `[B, H, n]`, n <= capacity, or the state this returned
        for a smaller capacity; None when there is none). Default: no state."""
        return {}

    def static_append(self, state: dict[str, Tensor], key: Tensor, slot: Tensor) -> None:
        """Fold a decode token's key `[B, Hkv, 1, D]`, written at `slot` `[B]`, into `state`, in place."""

    def static_prepared(self, state: dict[str, Tensor], width: int) -> Any:
        """What `score()` reads as `Chunk.prepared` for a decode query over the first `width` slots of a
        static cache (`prepare()`'s value, from the state alone). Default: None."""
        return None

    # ---- stateful methods only (H2O): selection query by query from a state the earlier queries left
    def grow_state(self, tensors: dict[str, Tensor], B: int, Hq: int, S: int, device) -> None:
        """Extend the state tensors to cover `S` keys (new keys start empty)."""
        raise NotImplementedError

    def state_score(self, tensors: dict[str, Tensor]) -> Tensor:
        """`[B, Hq, S]` float: score of every key for the next query, from the state alone."""
        raise NotImplementedError

    def update_state(self, tensors: dict[str, Tensor], probs: Tensor, keep: Tensor) -> None:
        """Fold queries' attention probs `[B, Hq, n, S]` and kept keys `[B, Hq, n, S]` into the state."""
        raise NotImplementedError

    def static_update(self, tensors: dict[str, Tensor], probs: Tensor, index: Tensor, kept: Tensor) -> None:
        """`update_state` for one decode query that attended only at the slots `index` `[B, Hq, n]` (int64,
        distinct where `kept` `[B, Hq, n]` bool), with probs `[B, Hq, n]` there (static_decode.py's gathered
        step). Default: both scattered over the state's S slots, then `update_state`."""
        B, Hq, _ = index.shape
        S = next(iter(tensors.values())).shape[-1]
        full = probs.new_zeros(B, Hq, S).scatter_add_(-1, index, probs.masked_fill(~kept, 0.0))  # [B, Hq, S]
        keep = torch.zeros(B, Hq, S + 1, dtype=torch.bool, device=index.device)  # a spare slot for the rest
        keep.scatter_(-1, index.masked_fill(~kept, S), True)
        self.update_state(tensors, full[:, :, None], keep[:, :, None, :S])


def grouped_scores(q: Tensor, k: Tensor) -> Tensor:
    """q `[B, Hq, Tc, D]`, k `[B, Hkv, S, D]` -> `q . k` `[B, Hq, Tc, S]` without repeating k per group."""
    B, Hq, Tc, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    qg = q.reshape(B, Hkv, (Hq // Hkv) * Tc, D)  # [B, Hkv, G*Tc, D]
    return (qg @ k.transpose(-1, -2)).view(B, Hq, Tc, S)  # [B, Hq, Tc, S]


def keep_counts(keep: Tensor, Hkv: int) -> tuple[Tensor, Tensor]:
    """keep `[B, 1|Hq, Tc, Sc]` bool -> keys kept per query `[B, 1|Hq, Tc]` and per (query, KV head), the
    union over the KV head's query heads, `[B, Hkv, Tc]` (int32)."""
    B, H, Tc, Sc = keep.shape
    activated = keep.sum(-1, dtype=torch.int32)  # [B, 1|Hq, Tc]
    if H == 1:  # shared by every head
        return activated, activated.expand(B, Hkv, Tc)
    return activated, keep.view(B, Hkv, H // Hkv, Tc, Sc).any(2).sum(-1, dtype=torch.int32)


def grouped_apply(p: Tensor, v: Tensor) -> Tensor:
    """p `[B, Hq, Tc, S]`, v `[B, Hkv, S, Dv]` -> `p @ v` `[B, Hq, Tc, Dv]`."""
    B, Hq, Tc, S = p.shape
    Hkv, Dv = v.shape[1], v.shape[-1]
    pg = p.reshape(B, Hkv, (Hq // Hkv) * Tc, S)  # [B, Hkv, G*Tc, S]
    return (pg @ v).view(B, Hq, Tc, Dv)  # [B, Hq, Tc, Dv]


def masked_softmax(logits: Tensor, keep: Tensor | None) -> Tensor:
    """Softmax over kept keys (float32; None: all of them); a row with nothing kept (a padding query) is
    all zeros.

    Written out rather than `torch.softmax`: on a busy CPU, softmax's thread pool made each of H2O's
    small per-query calls cost milliseconds; these element-wise ops stay on one thread when small.
    """
    x = logits.float() if keep is None else logits.float().masked_fill(~keep, -math.inf)
    top = x.amax(-1, keepdim=True)
    e = (x - top.masked_fill(top == -math.inf, 0.0)).exp()  # [..., S]
    return (e / e.sum(-1, keepdim=True)).nan_to_num(0.0)


def group_sum(score: Tensor, Hkv: int) -> Tensor:
    """`[B, Hq, Tc, S]` -> `[B, Hkv, Tc, S]`: summed over each KV head's group of query heads."""
    B, Hq, Tc, S = score.shape
    return score.view(B, Hkv, Hq // Hkv, Tc, S).sum(2)
