"""Full attention: plain causal SDPA, with the same statistics as the sparse methods."""

from __future__ import annotations

from dataclasses import dataclass

from nsa_eval.methods.base import AttentionMethod


@dataclass
class FullAttention(AttentionMethod):
    """Dense causal attention through transformers' own SDPA function (bit-identical to `sdpa`).

    Query t attends to all t + 1 visible keys; no budget applies. GQA: every query head reads its KV
    head's whole cache, so KV tokens read per KV head = t + 1.
    """

    name = "full"
    sparse = False
