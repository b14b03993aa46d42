"""Activated tokens per query: keys attended, per layer and phase, counted from the masks each query used.

The controller adds each chunk's counts to the `Tally` of its (layer, phase) as it attends; `summary()`
is what `methods.attention_stats(model)` returns: over all (query, query head) pairs, the mean and max
keys attended (sink and local included) and the KV tokens read per (query, KV head), the union over
the KV head's query group; the same over the queries held to the budget, per layer and per phase.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass
class Tally:
    """Running totals for one (layer, phase): query-head pairs, keys attended, KV tokens read.

    The totals stay on the device of the counts until read: reading one waits for the GPU, and a
    wait per layer and step would hold a decode step to the host's pace."""

    held: bool  # True when these queries were held to the budget
    totals: Tensor | None = None  # int64 [5]: queries, activated sum, activated max, KV queries, KV read sum

    def add(self, activated: Tensor, kv_read: Tensor, real: Tensor) -> None:
        """activated `[B, Hq, Tc]`, kv_read `[B, Hkv, Tc]` int; only real queries (`real` `[B, Tc]`) count."""
        real_a = real[:, None].expand_as(activated)
        real_r = real[:, None].expand_as(kv_read)
        activated, kv_read = activated.long(), kv_read.long()
        top = activated.masked_fill(~real_a, 0).amax() if activated.numel() else activated.new_zeros(())
        step = torch.stack([real_a.sum(), (activated * real_a).sum(), top,
                            real_r.sum(), (kv_read * real_r).sum()])
        if self.totals is None:
            self.totals = step
        else:
            self.totals = torch.cat([self.totals[:2] + step[:2], torch.maximum(self.totals[2:3], step[2:3]),
                                     self.totals[3:] + step[3:]])

    def counts(self) -> list[int]:
        """[queries, activated sum, activated max, KV queries, KV read sum]: one wait for the device."""
        return [0] * 5 if self.totals is None else self.totals.tolist()


def _summary(tallies: list[Tally]) -> dict[str, Any]:
    counts = [t.counts() for t in tallies]
    queries = sum(c[0] for c in counts)
    kv_queries = sum(c[3] for c in counts)
    return {
        "queries": queries,
        "mean": sum(c[1] for c in counts) / queries if queries else 0.0,
        "max": max((c[2] for c in counts), default=0),
        "kv_read_mean": sum(c[4] for c in counts) / kv_queries if kv_queries else 0.0,
    }


class AttentionStats:
    """Keys attended per query, per layer and phase; always on (a few reductions per layer call)."""

    def __init__(self) -> None:
        self.tallies: dict[tuple[int, str], Tally] = {}

    def tally(self, layer: int, phase: str, held: bool) -> Tally:
        key = (layer, phase)
        if key not in self.tallies:
            self.tallies[key] = Tally(held=held)
        self.tallies[key].held = self.tallies[key].held and held
        return self.tallies[key]

    def summary(self) -> dict[str, Any]:
        """Per layer, per phase and overall: queries (query-head pairs), mean and max keys attended,
        and mean KV tokens read per (query, KV head), the union over the KV head's query group."""
        layers = sorted({layer for layer, _ in self.tallies})
        phases = sorted({phase for _, phase in self.tallies})
        held = [t for t in self.tallies.values() if t.held]
        return {
            **_summary(list(self.tallies.values())),
            "held": _summary(held),
            "layers": [
                {"layer": layer, **_summary([t for (lay, _), t in self.tallies.items() if lay == layer])}
                for layer in layers
            ],
            "phases": {p: _summary([t for (_, ph), t in self.tallies.items() if ph == p]) for p in phases},
        }
