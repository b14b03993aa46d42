"""H2O (Zhang et al., 2023, arXiv:2306.14048): heavy hitters by accumulated attention mass, held causally."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from nsa_eval.methods.base import AttentionMethod, Prefill, PrefillResult

GROWTH = 1024  # keys the mass buffer makes room for at once (decode: one copy per GROWTH steps)


@dataclass
class H2O(AttentionMethod):
    """Heavy-hitter oracle: keep the keys that earlier queries attended to most, plus sink and local.

    Each query head keeps a running mass per key: the sum of the attention probabilities that the
    queries *before* the current one actually used (never a later query's). Query t keeps sink, local
    and the `budget - sink - local` candidates with the largest mass; then its own probabilities are
    added, and the candidates it did not keep are evicted: their mass drops to zero for good, as in
    H2O's causal mask simulation (`local_heavy_hitter_mask`) and its KV eviction (`H2OKVCache_LayerWise`),
    so an evicted key never comes back. Queries that see at most `budget` keys attend densely and add
    their whole rows. The mass is `[B, Hq, S]` float32 on the cache (`LayerState.tensors["mass"]`) and
    grows by one key per decode step (a view onto a buffer with room for `GROWTH` more keys).
    Selection is sequential over queries (one step per query past the budget), the costliest method at
    prefill. On CUDA an unpadded prompt's dense queries (all of them with `sparse_prefill: false`) take
    attention with its log-sum-exp and one pass for the mass (`nsa_eval/baseline_kernels/h2o_dense.py`),
    and its queries past the budget the O(budget)-per-query walk of `nsa_eval/baseline_kernels/h2o_prefill.py`
    (docs/methods.md).

    GQA: mass and selection are per query head, as in H2O's code (after `repeat_kv`), so a KV head
    serves the union of its G heads' heavy hitters.
    """

    name = "h2o"
    stateful = True

    def grow_state(self, tensors: dict[str, Tensor], B: int, Hq: int, S: int, device) -> None:
        mass = tensors.get("mass")
        if mass is None:  # exactly S keys, contiguous (the prefill walk writes it in place)
            tensors["mass"] = torch.zeros(B, Hq, S, device=device)
            return
        if mass.shape[:2] != (B, Hq):
            raise RuntimeError(f"h2o state is for batch {tuple(mass.shape[:2])}, got {(B, Hq)}")
        old = mass.shape[-1]
        if S == old:
            return
        # A decode step adds one key: the mass is a view onto a buffer with room for GROWTH more keys,
        # copied once per GROWTH steps rather than at every step. Slots past the view are never written
        # (every update goes through a view of at most S keys), so the new keys start at zero.
        buffer = mass if mass._base is None else mass._base  # [B, Hq, capacity]
        if buffer.shape[-1] < S:
            buffer = torch.zeros(B, Hq, S + GROWTH, device=mass.device)
            buffer[..., :old] = mass
        tensors["mass"] = buffer[..., :S]  # [B, Hq, S]

    def static_state(self, key: Tensor, lens: Tensor, capacity: int,
                     prefill: dict[str, Tensor] | None) -> dict[str, Tensor]:
        """The mass `[B, Hq, capacity]` of a static cache: the prompt's (or a smaller buffer's), then 0."""
        mass = prefill["mass"]  # [B, Hq, n]
        grown = mass.new_zeros(*mass.shape[:2], capacity)
        grown[..., : mass.shape[-1]] = mass
        return {"mass": grown}

    def state_score(self, tensors: dict[str, Tensor]) -> Tensor:
        return tensors["mass"]  # [B, Hq, S]

    def update_state(self, tensors: dict[str, Tensor], probs: Tensor, keep: Tensor) -> None:
        # probs, keep: [B, Hq, n, S] for n consecutive queries; n > 1 only for dense ones (no eviction).
        # tensors["mass"] may be a view onto the cached state: update it in place.
        mass = tensors["mass"]  # [B, Hq, S]
        mass += probs.sum(2)
        if keep.shape[2] == 1:
            # Evict what the query did not keep. Keys it could not see yet have no mass to lose; a
            # padding query (keeps nothing) evicts nothing.
            row = keep[:, :, 0]  # [B, Hq, S]
            mass.mul_(row | ~row.any(-1, keepdim=True))

    def static_update(self, tensors: dict[str, Tensor], probs: Tensor, index: Tensor, kept: Tensor) -> None:
        """`update_state` at the kept slots alone: their mass plus their probs, every other slot evicted (a
        query that keeps nothing evicts nothing)."""
        mass = tensors["mass"]  # [B, Hq, S], a view onto the static buffer
        grown = (mass.gather(-1, index) + probs).masked_fill(~kept, 0.0)  # [B, Hq, n]
        mass.mul_(~kept.any(-1, keepdim=True))
        # an add, not a copy: the lists' invalid entries may repeat a slot, and add zero there
        mass.scatter_add_(-1, index, grown)

    def triton_prefill(self, call: Prefill) -> PrefillResult | None:
        """An unpadded prompt with no cached keys before it, per-head selection: the queries that see at
        most `budget` keys (every query where the prefill is not held, `sparse_prefill: false`) attend
        densely and leave their mass (`h2o_dense.dense_prefill`: attention with its log-sum-exp, then
        the mass without P @ V), the rest take one Triton walk (`h2o_sparse_prefill`); the same output,
        mass and counts as the chunked path (up to rounding, and the walk's tie rule)."""
        B, Hq, T, _ = call.query.shape
        Hkv, S = call.key.shape[1], call.key.shape[2]
        cfg = call.config
        if self.group_shared or S != T:
            return None
        from nsa_eval.baseline_kernels.h2o_dense import dense_prefill
        from nsa_eval.baseline_kernels.h2o_prefill import h2o_sparse_prefill, kv_read_from_evictions

        n = min(T, cfg.budget) if call.held else T  # the dense queries
        q, k, v = call.query, call.key, call.value
        dense_out, dense_mass = dense_prefill(q[:, :, :n], k[:, :, :n], v[:, :, :n], call.scaling)
        mass = call.state["mass"]  # [B, Hq, T], updated in place
        mass[..., :n] = dense_mass
        seen = torch.arange(1, T + 1, device=q.device, dtype=torch.int32).clamp(max=n)  # [T]
        counts = seen.expand(B, Hq, T).contiguous()  # a dense query sees its position + 1 keys
        kv_read = seen.expand(B, Hkv, T).contiguous()
        if n == T:
            return dense_out, counts, kv_read
        out = q.new_empty(B, Hq, T, v.shape[-1])  # [B, Hq, T, Dv]
        out[:, :, :n] = dense_out
        del dense_out  # not held through the walk (peak memory)
        evictions = h2o_sparse_prefill(q, k, v, mass, out, call.scaling, cfg.sink, cfg.local, n)
        kv_read[:, :, n:] = kv_read_from_evictions(evictions, Hq // Hkv, cfg.sink, cfg.local, n)
        return out, counts, kv_read
