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
    wait per layer and step would hold a decode step to the host's pace. Counts the host knows already
    (an unpadded decode step's query count; all of sink_window's) go to host integers instead, so
    they cost no work on the device (`add_unpadded`, `add_host`)."""

    held: bool  # True when these queries were held to the budget
    sums: Tensor | None = None  # int64 [4]: queries, keys attended, KV queries, KV tokens read
    top: Tensor | None = None  # int64 []: the most keys one query attended to
    host_sums: list[int] | None = None  # the same four totals, counted on the host
    host_top: int = 0

    def add(self, activated: Tensor, kv_read: Tensor, real: Tensor, top: Tensor | None = None) -> None:
        """activated `[B, Hq, Tc]`, kv_read `[B, Hkv, Tc]` int; only real queries (`real` `[B, Tc]`) count.
        `top`: their largest activated count, where the caller has it already."""
        real_a = real[:, None].expand_as(activated)
        real_r = real[:, None].expand_as(kv_read)
        activated, kv_read = activated.long(), kv_read.long()
        if top is None:
            top = activated.masked_fill(~real_a, 0).amax() if activated.numel() else activated.new_zeros(())
        sums = torch.stack([real_a.sum(), (activated * real_a).sum(), real_r.sum(), (kv_read * real_r).sum()])
        if self.sums is None:
            self.sums, self.top = sums, top.long().clone()
        else:
            self.sums += sums
            torch.maximum(self.top, top.long(), out=self.top)

    def add_unpadded(self, activated: Tensor, kv_read: Tensor) -> None:
        """`add` for queries that are all real (an unpadded batch): activated `[B, Hq, Tc]`, kv_read
        `[B, Hkv, Tc]` int; the query counts are the shapes' (host integers)."""
        top = activated.amax() if activated.numel() else activated.new_zeros(())
        totals = torch.stack([activated.sum(dtype=torch.int64), kv_read.sum(dtype=torch.int64)])
        if self.sums is None:
            self.sums = torch.zeros(4, dtype=torch.int64, device=activated.device)
            self.top = top.long()
        else:
            torch.maximum(self.top, top.long(), out=self.top)
        self.sums[1::2] += totals
        self.add_host(activated.numel(), 0, 0, kv_read.numel(), 0)

    def add_device_totals(self, totals: Tensor, queries: int, kv_queries: int) -> None:
        """Totals a static cache's decode steps summed on the device (static_decode.py): `totals` int64 `[3]`
        (keys attended, KV tokens read, the most keys one query attended) over `queries` query-head pairs
        and `kv_queries` (query, KV head) pairs."""
        if self.sums is None:
            self.sums = torch.zeros(4, dtype=torch.int64, device=totals.device)
            self.top = totals[2].clone()
        else:
            torch.maximum(self.top, totals[2], out=self.top)
        self.sums[1::2] += totals[:2]
        self.add_host(queries, 0, 0, kv_queries, 0)

    def add_host(self, queries: int, activated: int, top: int, kv_queries: int, kv_read: int) -> None:
        """Totals the host knows: query-head pairs, keys they attended (sum and max), (query, KV head)
        pairs and KV tokens they read."""
        if self.host_sums is None:
            self.host_sums = [0, 0, 0, 0]
        for i, value in enumerate((queries, activated, kv_queries, kv_read)):
            self.host_sums[i] += value
        self.host_top = max(self.host_top, top)

    def counts(self) -> list[int]:
        """[queries, activated sum, activated max, KV queries, KV read sum]: one wait for the device."""
        if self.sums is None and self.host_sums is None:
            return [0] * 5
        totals = self.sums.tolist() if self.sums is not None else [0] * 4
        top = int(self.top) if self.top is not None else 0
        if self.host_sums is not None:
            totals = [a + b for a, b in zip(totals, self.host_sums, strict=True)]
            top = max(top, self.host_top)
        queries, activated, kv_queries, kv_read = totals
        return [queries, activated, top, kv_queries, kv_read]


def _summary(counts: list[list[int]]) -> dict[str, Any]:
    """Totals of `Tally.counts()` lists -> queries, mean and max keys attended, mean KV tokens read."""
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
        counts = {key: t.counts() for key, t in self.tallies.items()}  # one read of each tally
        layers = sorted({layer for layer, _ in counts})
        phases = sorted({phase for _, phase in counts})
        return {
            **_summary(list(counts.values())),
            "held": _summary([c for key, c in counts.items() if self.tallies[key].held]),
            "layers": [
                {"layer": layer, **_summary([c for (lay, _), c in counts.items() if lay == layer])}
                for layer in layers
            ],
            "phases": {p: _summary([c for (_, ph), c in counts.items() if ph == p]) for p in phases},
        }
