"""Exact top-k ("Exact-Top" in the NSA paper, arXiv:2502.11089 section 4.2): the oracle baseline."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from nsa_eval.methods.base import AttentionMethod, Chunk


@dataclass
class TopK(AttentionMethod):
    """Per query head, the `budget - sink - local` keys with the highest `q . k` outside sink and local.

    It needs every score, so it saves no compute: it is the upper bound of what token selection can do
    at this budget. GQA: selection is per query head, so a KV head serves the union of its G heads'
    choices; the KV tokens read per KV head (`kv_read_mean`) lie between the budget and G x budget.
    """

    name = "topk"
    fast_prefill = "topk"

    def score(self, chunk: Chunk) -> Tensor:
        return chunk.logits  # [B, Hq, Tc, S]
