"""The tile bookkeeping of the budgeted prefill (kernels/budget_attention.py, budget_quest.py) under
Triton's interpreter: `_kth_key`, the search of top-k's and Quest's cuts, against its rule by a sort;
`_tile_ranges` sorts a program's key tiles into what decides them, checked here
key by key against the rule it encodes; Quest's `_plan_kernel` lists the candidate tiles holding a kept
page, checked against the same list in PyTorch, and counts the kept keys from the page masks, checked
against the masks read key by key (`quest_keep_from_masks`)."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import triton
import triton.language as tl

from nsa_eval.baseline_kernels import budget_quest as bq
from nsa_eval.baseline_kernels.budget_attention import _kth_key, _tile_ranges

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
                                reason="interpreter tests (TRITON_INTERPRET=1, CPU tensors)")


@triton.jit
def _kth_key_kernel(KEY, WEIGHT, WANT, OUT, BR: tl.constexpr, BC: tl.constexpr, CB: tl.constexpr,
                    WIDE: tl.constexpr):
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    at = o_r[:, None] * BC + tl.arange(0, BC)[None, :]
    tl.store(OUT + o_r, _kth_key(tl.load(KEY + at), tl.load(WEIGHT + at), tl.load(WANT + o_r), CB, WIDE))


def kth_key_rule(key, weight, want):
    """The largest k with at least `want` weight on keys >= k: the key of the want-th entry by key,
    descending, each counted weight times; INT_MAX for want <= 0, INT_MIN where the weights fall short."""
    if want <= 0:
        return 2**31 - 1
    taken = 0
    for k, w in sorted(zip(key, weight, strict=True), reverse=True):
        taken += w
        if w and taken >= want:
            return k
    return -(2**31)


def kth_key(key, weight, want, *, BR, CB, WIDE):
    """`_kth_key` of each row of key, weight `[R, BC]` int32 (R a multiple of BR) and want `[R]`."""
    out = torch.empty(len(want), dtype=torch.int32)
    _kth_key_kernel[(len(want) // BR,)](key, weight, want, out, BR=BR, BC=key.shape[1], CB=CB, WIDE=WIDE)
    return out


@pytest.mark.parametrize("CB,WIDE", [(0, False), (7, False), (7, True)], ids=["unit", "counted", "wide"])
def test_kth_key_is_its_rule(CB, WIDE):
    """Rows that share a program (4 a program) with keys of one sign in a narrow range (the search
    skips their shared high bits), of both signs, negative only, all equal, distinct (the search stops
    once one entry is left between its ends), ties at the answer among distinct keys, one weighted
    entry, no weight, want <= 0, want past the weights, the extreme keys; weights 0 to 16 as Quest's
    pages' where the sums count the entries in their low bits (CB), 0 or 1 where the weights count
    themselves (CB = 0)."""
    g = torch.Generator().manual_seed(5)
    BR, BC = 4, 64
    narrow = lambda base, span: base + torch.randint(0, span, (BC,), generator=g)  # noqa: E731
    distinct = lambda: torch.randperm(1 << 20, generator=g)[:BC] * 2039 - (1 << 30)  # noqa: E731
    tied = distinct()
    tied[::3] = tied[7]
    rows = [
        narrow(0x3F800000, 1 << 12), narrow(0x41000000, 1 << 20), narrow(-0x40000000, 1 << 8),
        torch.randint(-(2**31), 2**31 - 1, (BC,), generator=g), narrow(-5, 10),
        torch.full((BC,), 77), torch.full((BC,), -(2**31)), torch.full((BC,), 2**31 - 1),
        narrow(1000, 3), narrow(-2**31, 4), narrow(2**31 - 5, 4), narrow(123456, 1 << 16),
        distinct(), distinct().abs(), tied,
    ]
    top = 2 if CB == 0 else 17
    cases = []
    for key in rows:
        zeros = torch.zeros(BC, dtype=torch.int64)
        one = zeros.index_fill(0, torch.tensor([21]), 1)
        for w in (torch.randint(0, top, (BC,), generator=g), zeros, one, zeros + 1):
            total = int(w.sum())
            for want in sorted({-3, 0, 1, 2, 5, max(1, total // 3), max(1, total // 2), total, total + 1}):
                cases.append((key, w, want))
    cases += cases[: (-len(cases)) % BR]
    key = torch.stack([c[0] for c in cases]).int()
    weight = torch.stack([c[1] for c in cases]).int()
    want = torch.tensor([c[2] for c in cases], dtype=torch.int32)
    out = kth_key(key, weight, want, BR=BR, CB=CB, WIDE=WIDE)
    rule = [kth_key_rule(k.tolist(), w.tolist(), int(n)) for k, w, n in zip(key, weight, want, strict=True)]
    assert out.tolist() == rule


@triton.jit
def _ranges_kernel(FIRST, LAST, OUT, sink, local, BN: tl.constexpr, PS: tl.constexpr):
    i = tl.program_id(0)
    e1, e2, e3, e4, e5, end = _tile_ranges(tl.load(FIRST + i), tl.load(LAST + i), sink, local, BN, PS)
    for j, e in enumerate((e1, e2, e3, e4, e5, end)):
        tl.store(OUT + i * 6 + j, e)


def tile_ranges(first, last, *, sink, local, BN, PS):
    """`_tile_ranges` of each program whose positions are first[i] .. last[i] -> `[n, 6]` int32."""
    out = torch.empty(len(first), 6, dtype=torch.int32)
    as_int = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    _ranges_kernel[(len(first),)](as_int(first), as_int(last), out, sink, local, BN=BN, PS=PS)
    return out


def near(p, local, PS):
    """Keys after this one are forced for the query at p (local window; Quest's own page)."""
    return min(p - local, p // PS * PS - 1) if PS else p - local


@pytest.mark.parametrize("BN,PS", [  # the lowest Triton: no pages, and pages that do not divide a tile
    (16, 0), (16, 10), *(pytest.param(*c, marks=pytest.mark.exhaustive) for c in ((64, 0), (16, 4), (64, 16)))
])
def test_tile_ranges_hold_what_they_claim(BN, PS):
    """For every program (positions first .. last), every key of a tile in a no-mask range is visible to
    every row and forced for it (sink or past near); every key of a rule tile is a candidate of every
    row; the ranges are ordered and cover every visible key with no tile past the last position."""
    rng = torch.Generator().manual_seed(BN + PS)
    for sink, local in itertools.product((0, 3, 16, 64, 100), (1, 5, 16, 64, 200)):
        first = torch.randint(0, 700, (24,), generator=rng).tolist() + [0, 1, sink, sink + local, 2 * BN]
        first = [f for f in first if f >= 0]
        width = torch.randint(1, 20, (len(first),), generator=rng).tolist()
        last = [f + w - 1 for f, w in zip(first, width, strict=True)]
        got = tile_ranges(first, last, sink=sink, local=local, BN=BN, PS=PS).tolist()
        for f, la, (e1, e2, e3, e4, e5, end) in zip(first, last, got, strict=True):
            assert 0 <= e1 <= e2 <= e3 <= e4 <= e5 <= end and end % BN == 0 and end - BN <= la < end
            assert all(e % BN == 0 for e in (e1, e2, e3, e4, e5))
            rows = range(f, la + 1)
            for j in itertools.chain(range(0, e1), range(e4, e5)):  # kept whole by every row
                assert all(j <= p and (j < sink or j > near(p, local, PS)) for p in rows), (f, la, j)
            for j in range(e2, e3):  # candidates of every row
                assert all(sink <= j <= near(p, local, PS) for p in rows), (f, la, j)


def test_tile_lists_hold_the_union_of_kept_pages():
    """`_plan_kernel`'s lists against PyTorch: random page masks (each row marks a few pages; rows of one
    program share none of them), for pages of a power of two (read from the masks) and not (every
    candidate tile listed); the mask words read one a step, so that a program's list grows over several
    steps (the default's single step serves tests/methods/test_quest_fast.py's whole prefills)."""
    g = torch.Generator().manual_seed(7)
    B, Hq, G, T, S, sink, local = 2, 8, 4, 40, 300, 8, 16
    for ps, BN in ((4, 16), (16, 16), (32, 16), (6, 16)):
        P = -(-S // ps)
        W = -(-P // 32)
        pages = torch.rand(B, Hq, T, W * 32, generator=g) < 0.05  # [B, Hq, T, pages]
        bits = bq._pack_bits(pages, W)  # [B, Hq, T, W]
        cfg = dict(BT=4, GP=4, BN=BN)
        cut = torch.full((B, Hq, T), bq.INT_MAX, dtype=torch.int32)
        lists, n, _, _ = bq.plan(bits, cut, T=T, S=S, sink=sink, local=local, budget=0, page_size=ps, G=G,
                                 cfg=cfg, words_a_step=1)
        for b, hk, prog in itertools.product(range(B), range(Hq // G), range(T // 4)):
            t0 = prog * 4
            first = S - T + t0
            e2 = -(-sink // BN) * BN
            e3 = max(e2, (near(first, local, ps) + 1) // BN * BN)
            union = pages[b, hk * G:(hk + 1) * G, t0:t0 + 4].flatten(0, 1).any(0)  # [pages]
            if ps & (ps - 1) == 0:
                want = [k0 for k0 in range(e2, e3, BN) if union[k0 // ps:(k0 + BN - 1) // ps + 1].any()]
            else:
                want = list(range(e2, e3, BN))
            row = b * (Hq // G) + hk
            assert lists[row, prog, :n[row, prog]].tolist() == want


@pytest.mark.parametrize("words", [1, bq.PLAN_WORDS])
@pytest.mark.parametrize("ps", [4, 16, 6])
def test_plan_counts_the_keys_the_masks_keep(ps, words):
    """Page masks as `_page_select_kernel` writes them (candidate pages only, one of them the cut page, cut
    inside its candidates), drawn at random so that a group's heads often share their cut page with
    other prefixes, or cut a page another head keeps whole; plus rows not held (every bit, INT_MAX) and
    rows with nothing marked. `_plan_kernel`'s counts and kv_read against the masks read key by key, the
    mask words one a step and at the default."""
    g = torch.Generator().manual_seed(ps)
    B, Hq, G, T, S, sink, local, budget = 1, 8, 4, 48, 200, 5, 9, 40
    P = -(-S // ps)
    W = -(-P // 32)
    pages = torch.zeros(B, Hq, T, W * 32, dtype=torch.bool)
    cut = torch.full((B, Hq, T), bq.INT_MAX, dtype=torch.int32)
    j = torch.arange(S)
    for t in range(T):
        p = S - T + t
        if p + 1 <= budget:
            pages[:, :, t] = True  # not held: every bit
            continue
        near = min(p - local, p // ps * ps - 1)
        is_cand = ((j >= sink) & (j <= near)).long()
        cand = torch.zeros(W * 32, dtype=torch.long).index_add_(0, j // ps, is_cand)  # candidates a page
        usable = (cand > 0).nonzero()[:, 0]
        shared = usable[torch.randint(len(usable), (1,), generator=g)]  # a page heads often cut together
        for h in range(Hq):
            if torch.rand(1, generator=g) < 0.1:
                continue  # nothing marked
            chosen = usable[torch.rand(len(usable), generator=g) < 0.3]
            other = usable[torch.randint(len(usable), (1,), generator=g)]
            c_pg = shared if torch.rand(1, generator=g) < 0.5 else other
            pages[0, h, t, chosen] = True
            pages[0, h, t, c_pg] = True
            first = max(int(c_pg) * ps, sink)
            last = min(int(c_pg) * ps + ps - 1, near)
            cut[0, h, t] = first + int(torch.randint(last - first + 1, (1,), generator=g))
    bits = bq._pack_bits(pages, W)
    cfg = dict(BT=4, GP=4, BN=16)
    _, _, counts, kv_read = bq.plan(bits, cut, T=T, S=S, sink=sink, local=local, budget=budget, page_size=ps,
                                    G=G, cfg=cfg, words_a_step=words)
    keep = bq.quest_keep_from_masks(bits, cut, t_base=0, T=T, S=S, sink=sink, local=local, page_size=ps)
    assert torch.equal(counts, keep.sum(-1, dtype=torch.int32))
    assert torch.equal(kv_read, keep.view(B, Hq // G, G, T, S).any(2).sum(-1, dtype=torch.int32))
