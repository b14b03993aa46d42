"""StreamingLLM (Xiao et al., 2023, arXiv:2309.17453): attention sinks plus a sliding window."""

from __future__ import annotations

from dataclasses import dataclass

from nsa_eval.methods.base import AttentionMethod


@dataclass
class SinkWindow(AttentionMethod):
    """Each query attends to the first `sink` keys and the last `local` keys (itself included), nothing else.

    The lowest rung of the ladder: it spends only `sink + local` of the budget (640 of 2,560 by default),
    so it shows what the methods' chosen keys add. GQA: the pattern depends on positions only, so every
    head of a group reads the same `sink + local` KV tokens.
    """

    name = "sink_window"
    fast_prefill = "sink_window"
    selects = False
