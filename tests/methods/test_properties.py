"""Properties of each method's selection, on raw tensors through the real attention path."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nsa_eval.methods.quest import page_bounds, page_summaries
from tests.methods.conftest import SPARSE_METHODS, random_qkv, run_attend


@settings(max_examples=40, deadline=None)
@given(
    method=st.sampled_from(SPARSE_METHODS),
    T=st.integers(1, 80),
    sink=st.integers(0, 8),
    local=st.integers(4, 16),
    extra=st.integers(0, 24),
    seed=st.integers(0, 10_000),
)
def test_budget_sink_and_local(method, T, sink, local, extra, seed):
    """No query over budget; every visible sink and local key kept; nothing in the future; budget filled."""
    budget = sink + local + extra
    q, k, v = random_qkv(T=T, seed=seed)
    params = {"page_size": 4, "query_chunk": 7} if method == "quest" else {"query_chunk": 7}
    out, keep = run_attend(method, q, k, v, budget=budget, sink=sink, local=local, **params)
    assert out.shape == (2, T, 4, 8) and torch.isfinite(out).all()
    t = torch.arange(T)[:, None]  # query position
    s = torch.arange(T)[None, :]  # key position
    causal = s <= t
    assert not (keep & ~causal).any()
    counts = keep.sum(-1)  # [B, Hq, T]
    limit = sink + local if method == "sink_window" else budget
    assert torch.equal(counts, torch.minimum(t[:, 0] + 1, torch.tensor(limit)).expand_as(counts))
    windows = causal & ((s < sink) | (s > t - local))
    assert keep[..., windows].all()


def test_topk_equals_brute_force():
    budget, sink, local = 24, 4, 8
    q, k, v = random_qkv(T=70, seed=1)
    _, keep = run_attend("topk", q, k, v, budget=budget, sink=sink, local=local, query_chunk=16)
    k_rep = k.repeat_interleave(2, dim=1)  # [B, Hq, T, D]
    logits = q @ k_rep.transpose(-1, -2)  # [B, Hq, T, T]
    for b in range(2):
        for h in range(4):
            for t in range(70):
                if t + 1 <= budget:
                    expected = set(range(t + 1))
                else:
                    middle = [s for s in range(sink, t - local + 1)]
                    best = sorted(middle, key=lambda s: -logits[b, h, t, s].item())[: budget - sink - local]
                    expected = set(range(sink)) | set(range(t - local + 1, t + 1)) | set(best)
                assert set(keep[b, h, t].nonzero().flatten().tolist()) == expected


@settings(max_examples=30, deadline=None)
@given(S=st.integers(1, 70), page=st.integers(1, 16), D=st.integers(1, 12), seed=st.integers(0, 10_000))
def test_quest_bound_is_an_upper_bound(S, page, D, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, 5, D, generator=g) * 3
    k = torch.randn(1, 1, S, D, generator=g) * 3
    pages = torch.arange(S)[None] // page  # [1, S]
    num_pages = int(pages.max()) + 1
    kmin, kmax = page_summaries(k, pages, num_pages)
    bound = page_bounds(q, kmin, kmax)  # [1, 2, 5, P]
    scores = q @ k.transpose(-1, -2)  # [1, 2, 5, S]
    for p in range(num_pages):
        true_max = scores[..., pages[0] == p].amax(-1)
        assert (bound[..., p] >= true_max - 1e-4).all()
        if page == 1:  # a one-key page: the bound is exact
            torch.testing.assert_close(bound[..., p], true_max, rtol=1e-4, atol=1e-4)


def test_quest_picks_whole_pages_by_bound():
    budget, sink, local, page = 40, 8, 8, 4
    q, k, v = random_qkv(B=1, T=96, seed=2)
    _, keep = run_attend("quest", q, k, v, budget=budget, sink=sink, local=local, page_size=page)
    pages = torch.arange(96) // page
    kmin, kmax = page_summaries(k, pages[None], 24)
    bound = page_bounds(q, kmin, kmax)  # [1, Hq, T, P]
    for h in range(4):
        for t in range(budget, 96):
            middle = torch.zeros(96, dtype=torch.bool)
            middle[sink : t - local + 1] = True
            chosen = keep[0, h, t] & middle
            chosen_pages = set(pages[chosen].tolist())
            partial = [p for p in chosen_pages if not chosen[(pages == p) & middle].all()]
            assert len(partial) <= 1  # whole pages, except the one cut to fill the budget
            others = set(pages[middle].tolist()) - chosen_pages
            if others:
                worst_in = min(bound[0, h, t, p] for p in chosen_pages)
                assert worst_in >= max(bound[0, h, t, p] for p in others)


def test_h2o_never_looks_ahead():
    """A query's choice depends only on earlier queries: appending tokens changes nothing before them."""
    q, k, v = random_qkv(T=90, seed=3)
    out_long, keep_long = run_attend("h2o", q, k, v, budget=24, sink=2, local=6, query_chunk=32)
    out_short, keep_short = run_attend(
        "h2o", q[:, :, :60], k[:, :, :60], v[:, :, :60], budget=24, sink=2, local=6, query_chunk=32
    )
    assert torch.equal(keep_long[:, :, :60, :60], keep_short)
    torch.testing.assert_close(out_long[:, :60], out_short)


def _h2o_reference(logits: torch.Tensor, budget: int, sink: int, local: int) -> torch.Tensor:
    """H2O for one head, written plainly: logits `[T, T]` -> keep `[T, T]`."""
    T = logits.shape[0]
    mass = torch.zeros(T)
    keep = torch.zeros(T, T, dtype=torch.bool)
    for t in range(T):
        if t + 1 <= budget:
            keep[t, : t + 1] = True
        else:
            keep[t, :sink] = True
            keep[t, t - local + 1 : t + 1] = True
            middle = list(range(sink, t - local + 1))
            best = sorted(middle, key=lambda s: -mass[s].item())[: budget - sink - local]
            keep[t, best] = True
        probs = torch.softmax(logits[t].masked_fill(~keep[t], float("-inf")), -1)
        mass += probs
        if t + 1 > budget:
            mass[: t + 1] *= keep[t, : t + 1]  # evicted keys lose their mass for good
    return keep


def test_h2o_matches_plain_reference():
    budget, sink, local = 20, 2, 6
    q, k, v = random_qkv(T=64, seed=4)
    _, keep = run_attend("h2o", q, k, v, budget=budget, sink=sink, local=local, query_chunk=20)
    logits = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) * 8**-0.5  # [B, Hq, T, T]
    for b in range(2):
        for h in range(4):
            assert torch.equal(keep[b, h], _h2o_reference(logits[b, h], budget, sink, local))


@pytest.mark.parametrize("method", SPARSE_METHODS)
def test_chunking_does_not_change_results(method):
    q, k, v = random_qkv(T=50, seed=5)
    out_a, keep_a = run_attend(method, q, k, v, budget=20, sink=2, local=6, query_chunk=50)
    out_b, keep_b = run_attend(method, q, k, v, budget=20, sink=2, local=6, query_chunk=3)
    assert torch.equal(keep_a, keep_b)
    torch.testing.assert_close(out_a, out_b)
