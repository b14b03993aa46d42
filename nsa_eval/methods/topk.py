"""Exact top-k ("Exact-Top" in the NSA paper, arXiv:2502.11089 section 4.2): the oracle baseline."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from nsa_eval.methods.base import AttentionMethod, Chunk, Prefill, PrefillResult


@dataclass
class TopK(AttentionMethod):
    """Per query head, the `budget - sink - local` keys with the highest `q . k` outside sink and local.

    It needs every score, so it saves no compute: it is the upper bound of what token selection can do
    at this budget. GQA: selection is per query head, so a KV head serves the union of its G heads'
    choices; the KV tokens read per KV head (`kv_read_mean`) lie between the budget and G x budget.

    Triton prefill: each row's exact k-th score (baseline_kernels/budget_topk.py), then attention over
    the keys at or above it (budget_attention.py).
    """

    name = "topk"

    def score(self, chunk: Chunk) -> Tensor:
        return chunk.logits  # [B, Hq, Tc, S]

    def triton_prefill(self, call: Prefill) -> PrefillResult | None:
        """The kernels select per query head, so not `group_shared`. A row whose threshold bracket missed
        (`topk_thresholds`' `failed`) is computed by the chunked path (`call.reference`)."""
        if self.group_shared:
            return None
        from nsa_eval.baseline_kernels import budget_attention, budget_topk

        q, k, v = call.kernel_inputs()
        cfg = call.config
        thr, cut, failed = budget_topk.topk_thresholds(q, k, sink=cfg.sink, local=cfg.local,
                                                       budget=cfg.budget)
        out, counts, kv_read = budget_attention.budget_attention(q, k, v, scale=call.scaling, sink=cfg.sink,
                                                                 local=cfg.local, thr=thr, cut=cut)
        redo = failed.flatten(0, 1).any(0).nonzero()[:, 0]  # [n] query indices some head missed
        if redo.numel():
            call.reference(redo, out, counts, kv_read)
        return out, counts, kv_read
