"""StreamingLLM (Xiao et al., 2023, arXiv:2309.17453): attention sinks plus a sliding window."""

from __future__ import annotations

from dataclasses import dataclass

from nsa_eval.methods.base import AttentionMethod, Prefill, PrefillResult


@dataclass
class SinkWindow(AttentionMethod):
    """Each query attends to the first `sink` keys and the last `local` keys (itself included), nothing else.

    The lowest rung of the ladder: it spends only `sink + local` of the budget (640 of 2,560 by default),
    so it shows what the methods' chosen keys add. GQA: the pattern depends on positions only, so every
    head of a group reads the same `sink + local` KV tokens.

    Triton prefill: baseline_kernels/budget_attention.py over the sink and local tiles only.
    """

    name = "sink_window"
    selects = False

    def triton_prefill(self, call: Prefill) -> PrefillResult | None:
        if self.group_shared:  # keeps the chunked path, as it does for every method
            return None
        from nsa_eval.baseline_kernels.budget_attention import budget_attention

        q, k, v = call.kernel_inputs()
        return budget_attention(q, k, v, scale=call.scaling, sink=call.config.sink, local=call.config.local)
