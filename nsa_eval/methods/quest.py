"""Quest (Tang et al., 2024, arXiv:2406.10774): query-aware page selection by an upper bound on q . k."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from nsa_eval.errors import UsageError
from nsa_eval.methods.base import AttentionMethod, BudgetConfig, Chunk, Prefill, PrefillResult, grouped_scores


def page_bounds(query: Tensor, key_min: Tensor, key_max: Tensor) -> Tensor:
    """Quest's upper bound on `q . k` over a page: sum over channels of max(q_d * min_d, q_d * max_d).

    Args:
        query: `[B, Hq, Tc, D]` float.
        key_min, key_max: `[B, Hkv, P, D]` float, per-page per-channel minimum and maximum of the keys.

    Returns:
        `[B, Hq, Tc, P]` float (unscaled): >= `q . k` for every key of the page.
    """
    # max(q*mn, q*mx) is q*mx where q >= 0 and q*mn where q < 0: two matmuls, no [.., P, D] product.
    upper = grouped_scores(query.clamp(min=0), key_max)  # [B, Hq, Tc, P]
    return upper + grouped_scores(query.clamp(max=0), key_min)  # [B, Hq, Tc, P]


def page_summaries(key: Tensor, page: Tensor, num_pages: int) -> tuple[Tensor, Tensor]:
    """Per-page per-channel min and max of the keys.

    Args:
        key: `[B, Hkv, S, D]` float.
        page: `[B, S]` int64 page of each key (its position // page_size), -1 for padding keys.
        num_pages: P.

    Returns:
        key_min, key_max: `[B, Hkv, P, D]`; an empty page has min +inf and max -inf.
    """
    B, Hkv, S, D = key.shape
    index = page.clamp(min=0).where(page >= 0, num_pages)  # [B, S]; padding goes to a spare page
    index = index[:, None, :, None].expand(B, Hkv, S, D)  # [B, Hkv, S, D]
    shape = (B, Hkv, num_pages + 1, D)
    key_min = key.new_full(shape, torch.inf).scatter_reduce(2, index, key, "amin")  # [B, Hkv, P+1, D]
    key_max = key.new_full(shape, -torch.inf).scatter_reduce(2, index, key, "amax")  # [B, Hkv, P+1, D]
    return key_min[:, :, :num_pages], key_max[:, :, :num_pages]


@dataclass
class Quest(AttentionMethod):
    """Pages of `page_size` tokens, ranked per query head by `page_bounds`; the best fill the budget.

    Pages are aligned to sequence positions (page j holds positions 16j..16j+15). Every key of a page
    carries its page's bound, so the top `budget - sink - local` keys outside sink and local are whole
    pages in bound order; the last page is cut to fill the budget to the token, keeping its
    earliest tokens (ties are broken by position). The page holding the
    query is always kept (it lies in the local window whenever `local >= page_size`). Quest's own code
    also keeps the first two layers dense: pass `dense_layers=2` for that. GQA: selection is per query
    head, as in Quest's reference code (keys repeated per head), so a KV head serves the union of its
    G heads' pages.

    Triton prefill: baseline_kernels/budget_quest.py (the pages chosen per query, then attention over
    them on budget_attention.py's tiles).
    """

    name = "quest"
    stable_ties = True

    page_size: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise UsageError(f"quest page_size must be a positive integer, got {self.page_size!r}")

    def check(self, config: BudgetConfig) -> None:
        if config.local < self.page_size and config.selected < self.page_size:
            raise UsageError(
                f"quest keeps the query's page ({self.page_size} tokens): it needs local >= page_size or "
                f"budget - sink - local >= page_size, got local={config.local}, "
                f"budget - sink - local={config.selected}"
            )

    def prepare(self, key: Tensor, kpos: Tensor,
                num_positions: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
        page = torch.where(kpos >= 0, kpos // self.page_size, -1)  # [B, S]
        if num_positions is None:
            num_pages = int(page.max()) + 1  # waits for the device: a padded batch only
        else:
            num_pages = (num_positions - 1) // self.page_size + 1
        key_min, key_max = page_summaries(key.float(), page, num_pages)  # [B, Hkv, P, D] each
        return page, key_min, key_max

    def score(self, chunk: Chunk) -> Tensor:
        page, key_min, key_max = chunk.prepared
        bounds = page_bounds(chunk.query.float(), key_min, key_max)  # [B, Hq, Tc, P]
        B, Hq, Tc, _ = bounds.shape
        page = page[:, : chunk.kpos.shape[-1]].clamp(min=0)  # [B, Sc]
        index = page[:, None, None, :].expand(B, Hq, Tc, page.shape[-1])  # [B, Hq, Tc, Sc]
        bounds = bounds.gather(-1, index)  # [B, Hq, Tc, Sc]
        # a group's softmax needs the logits' scale; alone, only the order counts (kept bit for bit)
        return bounds * chunk.scaling if self.group_shared else bounds

    def static_state(self, key: Tensor, lens: Tensor, capacity: int,
                     prefill: dict[str, Tensor] | None) -> dict[str, Tensor]:
        """The page summaries of a static cache, `key_min`/`key_max` `[B, Hkv, pages, D]` float32 over
        `capacity` slots, from its keys (exact: a min or max does not depend on the order); pages without a
        key hold zeros, never read."""
        B, _, C, _ = key.shape
        slots = torch.arange(C, device=key.device)  # [C]
        page = torch.where(slots < lens[:, None], slots // self.page_size, -1)  # [B, C]
        key_min, key_max = page_summaries(key.float(), page, -(-C // self.page_size))
        return {"key_min": key_min.nan_to_num(0.0, 0.0, 0.0), "key_max": key_max.nan_to_num(0.0, 0.0, 0.0)}

    def static_append(self, state: dict[str, Tensor], key: Tensor, slot: Tensor) -> None:
        B, Hkv, _, D = key.shape
        index = (slot // self.page_size).view(B, 1, 1, 1).expand(B, Hkv, 1, D)
        first = (slot % self.page_size == 0).view(B, 1, 1, 1)  # the page's first key: its old row is stale
        k = key.float()  # [B, Hkv, 1, D]
        for name, pick in (("key_min", torch.minimum), ("key_max", torch.maximum)):
            summary = state[name]  # [B, Hkv, pages, D]
            summary.scatter_(2, index, torch.where(first, k, pick(summary.gather(2, index), k)))

    def static_prepared(self, state: dict[str, Tensor], width: int) -> tuple[Tensor, Tensor, Tensor]:
        key_min, key_max = state["key_min"], state["key_max"]  # [B, Hkv, pages, D]
        pages = -(-width // self.page_size)
        page = (torch.arange(width, device=key_min.device) // self.page_size).expand(key_min.shape[0], width)
        return page, key_min[:, :, :pages], key_max[:, :, :pages]

    def forced_start(self, position: int) -> int:
        return position - position % self.page_size  # the query's own page

    def forced(self, chunk: Chunk) -> Tensor:
        same_page = chunk.kpos[:, None, :] // self.page_size == chunk.qpos[:, :, None] // self.page_size
        return same_page & chunk.visible  # [B, Tc, Sc]

    def triton_prefill(self, call: Prefill) -> PrefillResult | None:
        """The kernels select per query head, so not `group_shared`; every row is decided (no fallback)."""
        if self.group_shared:
            return None
        from nsa_eval.baseline_kernels.budget_quest import quest_attention

        q, k, v = call.kernel_inputs()
        cfg = call.config
        return quest_attention(q, k, v, scale=call.scaling, sink=cfg.sink, local=cfg.local, budget=cfg.budget,
                               page_size=self.page_size)
