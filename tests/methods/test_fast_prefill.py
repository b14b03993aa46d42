"""The Triton prefill of sink_window and topk (kernels/budget_attention.py, budget_topk.py) against the
readable references and the controller's chunked path: the same kept keys (ties at the cut to the lower
position), outputs and statistics. On the CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1,
set by conftest.py before triton is imported); the `gpu` tests run them at scale on CUDA."""

from __future__ import annotations

import math

import pytest
import torch

from nsa_eval.baseline_kernels import budget_attention as ba
from nsa_eval.baseline_kernels import budget_topk as bt
from nsa_eval.methods import METHODS
from nsa_eval.methods.base import AttentionMethod, BudgetConfig, Prefill, grouped_scores
from nsa_eval.methods.controller import AttentionController
from tests.methods.budget_inputs import (
    against_full_attention,
    cuda_ms,
    fast_and_chunked,
    interpreter_only,
    qkv,
)
from tests.methods.conftest import fake_module, layer_call, prefill_by

CASES = [  # (B, Hq, Hkv, T, S, D, dtype, sink, local, budget)
    (1, 4, 4, 96, 96, 16, torch.float32, 4, 8, 40),  # G = 1
    (2, 8, 2, 56, 72, 32, torch.bfloat16, 4, 8, 36),  # G = 4, 16 cached keys before the queries
    (1, 3, 1, 70, 70, 16, torch.float32, 0, 5, 30),  # G = 3 (padded to 4 rows), no sink
    (1, 4, 2, 64, 64, 16, torch.bfloat16, 16, 16, 50),  # sink and local whole tiles
]
IDS = [f"B{c[0]}-Hq{c[1]}-Hkv{c[2]}-T{c[3]}-S{c[4]}-{str(c[6])[6:]}-{c[7]}+{c[8]}of{c[9]}" for c in CASES]


def tol(dtype):
    return dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)


@interpreter_only
@pytest.mark.parametrize("method", ["sink_window", "topk"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_kernel_matches_the_reference(case, method):
    B, Hq, Hkv, T, S, D, dtype, sink, local, budget = case
    q, k, v = qkv(B, Hq, Hkv, T, S, D, dtype)
    scale = D**-0.5
    thr = cut = None
    if method == "topk":
        thr, cut, failed = bt.topk_thresholds(q, k, sink=sink, local=local, budget=budget)
        assert not failed.any()  # the default bracket holds every row of these small inputs
    o, counts, kv_read = ba.budget_attention(q, k, v, scale=scale, sink=sink, local=local, thr=thr, cut=cut)
    keep = ba.reference_keep(q, k, sink=sink, local=local, budget=budget if method == "topk" else None)
    o_ref, counts_ref, kv_ref = ba.budget_attention_reference(q, k, v, keep, scale=scale)
    assert torch.equal(counts, counts_ref)
    assert torch.equal(kv_read, kv_ref)  # the union over the group: sensitive to which keys each head kept
    torch.testing.assert_close(o.float(), o_ref, **tol(dtype))
    p = torch.arange(S - T, S)
    limit = budget if method == "topk" else sink + local
    assert torch.equal(counts[0, 0], torch.minimum(p + 1, torch.tensor(limit)).int())  # exactly the budget


def controller(method, budget, sink, local, **params):
    return AttentionController(METHODS.get(method)(**params), BudgetConfig(budget, sink, local))


def reference_attend(method, q, k, v, budget, sink, local):
    """The chunked path: out, keep, tally counts."""
    out, keep, ctrl = layer_call(method, q, k, v, None, budget, sink, local, query_chunk=32)
    return out, keep, ctrl.stats.tally(0, "prefill", True).counts()


def fast_attend(method, q, k, v, budget, sink, local):
    """The method's Triton prefill through the controller, on any device (the controller takes it on CUDA
    tensors only): out, tally counts."""
    ctrl = controller(method, budget, sink, local, query_chunk=32)
    prefill_by(ctrl.method, kernels=True)
    out = ctrl.attend(fake_module(groups=q.shape[1] // k.shape[1]), q, k, v, None, None)
    return out, ctrl.stats.tally(0, "prefill", True).counts()


@pytest.mark.exhaustive
@interpreter_only
@pytest.mark.parametrize("method", ["sink_window", "topk"])
@pytest.mark.parametrize("case", CASES[1:3], ids=IDS[1:3])
def test_controller_fast_prefill_matches_its_chunked_path(case, method):
    B, Hq, Hkv, T, S, D, dtype, sink, local, budget = case
    q, k, v = qkv(B, Hq, Hkv, T, S, D, dtype, seed=1)
    out, keep, counts = reference_attend(method, q, k, v, budget, sink, local)
    fast, fast_counts = fast_attend(method, q, k, v, budget, sink, local)
    assert fast_counts == counts  # queries, keys attended (sum, max), KV tokens read
    torch.testing.assert_close(fast.float(), out.float(), **tol(dtype))
    if method == "topk":  # the kernel's rule, applied to the controller's own scores, keeps its keys
        thr, cut, _ = bt.topk_thresholds(q, k, sink=sink, local=local, budget=budget)
        s = grouped_scores(q.float(), k.float())  # [B, Hq, T, S]
        j = torch.arange(S)
        p = torch.arange(S - T, S)[:, None]
        forced = (j <= p) & ((j < sink) | (j > p - local))
        rule = forced | ((j <= p) & ((s > thr[..., None]) | ((s == thr[..., None]) & (j <= cut[..., None]))))
        rule = torch.where(p + 1 > budget, rule, j <= p)
        # they differ only at the threshold, where the two products round differently (the key at the
        # cut itself, or a near-tied pair): at most two keys a row, each within float32 rounding of thr
        differ = rule != keep
        near = (s - thr[..., None]).abs() <= 1e-5 * thr.abs()[..., None].clamp_min(1)
        assert near[differ].all() and differ.sum(-1).max() <= 2


@interpreter_only
def test_ties_at_the_cut_go_to_the_lower_position():
    """Keys 30..39 repeat keys 20..29 (values differ): equal scores, bit for bit, in every product. Where
    the cut falls among them, the lower positions are kept, as the reference's stable sort does."""
    q, k, v = qkv(1, 4, 2, 64, 64, 16, torch.float32, seed=2)
    k[:, :, 30:40] = k[:, :, 20:30]
    q[:, :, :, :] = q[:, :, :1, :]  # one query vector: every row ranks the keys alike
    sink, local, budget = 4, 8, 24
    thr, cut, failed = bt.topk_thresholds(q, k, sink=sink, local=local, budget=budget)
    assert not failed.any()
    o, counts, kv_read = ba.budget_attention(q, k, v, scale=0.25, sink=sink, local=local, thr=thr, cut=cut)
    keep = ba.reference_keep(q, k, sink=sink, local=local, budget=budget)
    o_ref, counts_ref, kv_ref = ba.budget_attention_reference(q, k, v, keep, scale=0.25)
    held = torch.arange(64) + 1 > budget
    tied = (cut[0, 0, held] < 1 << 30) & (cut[0, 0, held] >= 20)  # rows whose cut falls on a repeated key
    assert tied.any()
    assert torch.equal(counts, counts_ref) and torch.equal(kv_read, kv_ref)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.exhaustive
@interpreter_only
def test_rows_whose_bracket_misses_take_the_reference_path(monkeypatch):
    """A bracket above every score leaves all picks outside it: every held row fails, and the controller
    computes them with its chunked path (same output and counts)."""
    q, k, v = qkv(1, 8, 2, 80, 100, 32, torch.float32, seed=3)
    sink, local, budget = 4, 8, 36

    def nowhere(q, k, *, t_base, Tc, **_):
        inf = torch.full((q.shape[0], q.shape[1], Tc), math.inf)
        return inf, inf, inf, inf, 1

    monkeypatch.setattr(bt, "sample_brackets", nowhere)
    thr, cut, failed = bt.topk_thresholds(q, k, sink=sink, local=local, budget=budget)
    held = torch.arange(20, 100) + 1 > budget
    assert failed[..., held].all() and not failed[..., ~held].any()
    out, _, counts = reference_attend("topk", q, k, v, budget, sink, local)
    fast, fast_counts = fast_attend("topk", q, k, v, budget, sink, local)
    assert fast_counts == counts
    torch.testing.assert_close(fast, out, atol=1e-5, rtol=1e-5)


@interpreter_only
@pytest.mark.exhaustive
def test_a_small_cap_fails_rows_it_cannot_hold():
    q, k, _ = qkv(1, 4, 4, 96, 96, 16, torch.float32)
    thr, cut, failed = bt.topk_thresholds(q, k, sink=4, local=8, budget=40, sample=8, cap=4)
    assert failed.any()  # a stride-10 sample brackets more than 4 keys a row
    keep = ba.reference_keep(q, k, sink=4, local=8, budget=40)
    _, counts, _ = ba.budget_attention(q, k, q.new_zeros(1, 4, 96, 16), scale=0.25, sink=4, local=8,
                                       thr=thr, cut=cut)
    assert torch.equal(counts[~failed], keep.sum(-1, dtype=torch.int32)[~failed])


def integer_qk(B, Hq, Hkv, T, S, D, values=3, seed=5):
    """q `[B, Hq, T, D]` and k `[B, Hkv, S, D]` float32 of small integers (|x| < values): every product
    is exact, so the kernels' scores equal the references' bit for bit, and many tie."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(1 - values, values, (B, Hq, T, D), generator=g).float()
    k = torch.randint(1 - values, values, (B, Hkv, S, D), generator=g).float()
    return q, k


def kept_candidates(q, k, thr, cut, *, sink, local):
    """The candidates `[B, Hq, T, S]` bool that the keep rule `s > thr or (s == thr and j <= cut)` takes,
    on float32 scores by the grouped product (exact for `integer_qk`'s inputs)."""
    S, T = k.shape[2], q.shape[2]
    s = ba._grouped_scores(q.float(), k.float())
    j = torch.arange(S)
    p = torch.arange(S - T, S)[:, None]
    cand = (j >= sink) & (j <= p - local)
    return cand & ((s > thr[..., None]) | ((s == thr[..., None]) & (j <= cut[..., None]))), cand


@interpreter_only
def test_ties_across_the_sinks_partial_tile_go_to_the_lower_position():
    """Small integer scores tie often. With a sink of 4 keys (the interpreter's key tiles are 16 wide) the
    sink's partial tile holds candidates 4..15, which the collect pass must file before the later keys, so
    that the ties at a row's cut go to the lower positions, as the reference's stable sort."""
    B, Hq, Hkv, T, S, D, sink, local, budget = 1, 4, 2, 64, 64, 16, 4, 8, 28
    q, k = integer_qk(B, Hq, Hkv, T, S, D, values=2, seed=7)
    thr, cut, failed = bt.topk_thresholds(q, k, sink=sink, local=local, budget=budget)
    assert not failed.any()
    rule, cand = kept_candidates(q, k, thr, cut, sink=sink, local=local)
    keep = ba.reference_keep(q, k, sink=sink, local=local, budget=budget)
    held = torch.arange(S - T, S) + 1 > budget
    assert torch.equal(rule[..., held, :], (keep & cand)[..., held, :])
    assert ((cut[..., held] >= 16) & (cut[..., held] < bt.INT_MAX)).any()  # cuts past the sink's tile


@interpreter_only
def test_the_count_pass_matches_its_reference():
    """`count` against `count_reference` on exact integer scores, with brackets of every kind by row: not
    held (lo = +inf), open below (-inf) or above (+inf), both ends negative, straddling zero, both
    positive; the ends are candidates' own scores, so ties sit on the bracket's (and bin 0's) edges."""
    B, Hq, Hkv, T, S, D, sink, local = 1, 8, 2, 60, 90, 16, 4, 8
    q, k = integer_qk(B, Hq, Hkv, T, S, D)
    t_base, Tc = 12, 40
    s = ba._grouped_scores(q, k)[:, :, t_base:t_base + Tc]  # [B, Hq, Tc, S]
    g = torch.Generator().manual_seed(6)
    pick = lambda x: x[torch.randint(len(x), (1,), generator=g)].item()  # noqa: E731
    lo = torch.full((B, Hq, Tc), math.inf)
    hi = torch.full((B, Hq, Tc), math.inf)
    kinds = set()
    for h in range(Hq):
        for t in range(Tc):
            p = S - (T - t_base - t)
            row = s[0, h, t, sink:max(sink, p - local + 1)]
            kind = (h + t) % 6
            if len(row) < 4 or kind == 0:  # not held
                continue
            neg, pos = row[row < 0], row[row > 0]
            if kind == 1:
                lo[0, h, t], hi[0, h, t] = -math.inf, pick(row)
            elif kind == 2 and len(neg) >= 2:
                lo[0, h, t], hi[0, h, t] = sorted((pick(neg), pick(neg)))
            elif kind == 3 and len(neg) and len(pos):
                lo[0, h, t], hi[0, h, t] = pick(neg), pick(pos)
            elif kind == 4 and len(pos) >= 2:
                lo[0, h, t], hi[0, h, t] = sorted((pick(pos), pick(pos)))
            elif kind == 5:
                lo[0, h, t], hi[0, h, t] = pick(row), math.inf
            else:
                continue
            kinds.add(kind)
    assert kinds == {1, 2, 3, 4, 5}
    # finite stand-ins for the open ends: the row's lowest and highest candidates but one, so that
    # scores past them fall in the end bins
    cands = [[s[0, h, t, sink:max(sink + 1, S - (T - t_base - t) - local + 1)] for t in range(Tc)]
             for h in range(Hq)]
    low = torch.tensor([[c.kthvalue(min(2, len(c))).values.item() for c in row] for row in cands])[None]
    high = -torch.tensor([[(-c).kthvalue(min(2, len(c))).values.item() for c in row] for row in cands])[None]
    base, inv_w = bt.bin_params(lo, hi, low, high)
    n_above, hist = bt.count(q, k, lo, hi, base, inv_w, t_base=t_base, sink=sink, local=local)
    n_ref, hist_ref = bt.count_reference(q, k, lo, hi, base, inv_w, t_base=t_base, sink=sink, local=local)
    assert torch.equal(n_above, n_ref) and torch.equal(hist, hist_ref)
    assert (hist[lo == math.inf] == 0).all() and (hist[lo < math.inf].sum(-1) > 0).all()
    assert ((hist > 0).sum(-1) >= 3).any()  # brackets spread over several bins
    # the bins split each bracket (open ends at their stand-ins) into NB equal ranges: bin NB - 1 starts
    # at 15/16 of the way, within float32 rounding, and the bins rise with the score
    held = lo < math.inf
    a, b = torch.where(lo.isfinite(), lo, low), torch.where(hi.isfinite(), hi, high)
    wide = held & (b > a)
    edge = a + (b - a) * (bt.NB - 1) / bt.NB
    at = (edge[wide] - base[wide]) * inv_w[wide]
    torch.testing.assert_close(at, torch.full_like(at, bt.NB - 1.0))
    scores = torch.linspace(-20, 20, 401).expand(*lo.shape, 401)
    assert (bt.bin_of(scores, base, inv_w).diff(dim=-1) >= 0).all()


def check_pick_bin_ends(device: str = "cpu"):
    """Brackets of every kind (finite, open at either end, one bin, ends at zero) and every pick from -1 to
    NB - 1: `pick_bin_ends`' [a, c) holds exactly the bracket's scores in the pick bin (`bin_of`, the
    kernel's bin bit for bit), and c starts exactly the scores it counts above. Checked at a and c and the
    floats just below them (so each is the least such score), the bracket's ends and their neighbours, and
    random scores over and around the bracket."""
    g = torch.Generator().manual_seed(8)
    R = 64
    lo = torch.randn(R, generator=g) * 4
    hi = lo + torch.rand(R, generator=g) * 8
    low, high = lo - 1, hi + 1
    lo[::7], hi[1::7] = -math.inf, math.inf  # open ends (bins at the stand-ins)
    hi[2::9] = lo[2::9]  # a bracket of one score: a single bin
    lo[3], hi[3] = 0.0, 1.0
    lo[4], hi[4] = -1.0, -0.0
    base, inv_w = bt.bin_params(lo, hi, low, high)
    pick = torch.arange(R) % (bt.NB + 1) - 1  # -1 (not collected) to NB - 1
    lo, hi, base, inv_w, pick = (x.to(device) for x in (lo, hi, base, inv_w, pick.int()))
    a, c = bt.pick_bin_ends(lo, hi, base, inv_w, pick)
    assert torch.equal(a[pick < 0], torch.full_like(a[pick < 0], math.inf))
    assert torch.equal(c[pick < 0], torch.full_like(c[pick < 0], math.inf))
    below = lambda x: torch.nextafter(x, torch.full_like(x, -math.inf))  # noqa: E731
    above = lambda x: torch.nextafter(x, torch.full_like(x, math.inf))  # noqa: E731
    random = lo.nan_to_num(-8, -8, -8)[:, None] + torch.rand(R, 200, generator=g).to(device) * 20 - 2
    scores = torch.cat([torch.stack([a, below(a), c, below(c), lo, above(lo), hi, above(hi), below(hi)], 1),
                        random], 1).nan_to_num(0.0, 1e30, -1e30)  # [R, S], finite
    bins = bt.bin_of(scores, base, inv_w)
    inside = (scores >= lo[:, None]) & (scores <= hi[:, None])
    held = pick[:, None] >= 0
    in_bin = held & inside & (bins == pick[:, None])
    over = held & ((scores > hi[:, None]) | ((scores >= lo[:, None]) & (bins > pick[:, None])))
    assert torch.equal((scores >= a[:, None]) & (scores < c[:, None]), in_bin)
    assert torch.equal(scores >= c[:, None], over)
    assert in_bin[:, 0].sum() > R // 2 and over[:, 2].sum() > R // 2  # a and c are mostly scores of their own


@interpreter_only
def test_the_pick_bins_ends_hold_exactly_its_scores():
    check_pick_bin_ends()


@pytest.mark.gpu
def test_gpu_pick_bins_ends_hold_exactly_its_scores():
    check_pick_bin_ends("cuda")


@pytest.mark.exhaustive
@interpreter_only
def test_no_row_fails_on_gaussian_scores():
    """Zero-centred scores put the picks of the rows from the budget to about twice it near their median,
    where a bracket straddles zero. The thresholds then hold every row and keep the reference's keys
    (the bins of the scores' int32 keys failed rows of these). Gaussian inputs rounded to eighths,
    so that every score is exact in float32 whatever the order of its sum: the kernels' numpy products
    and the reference's torch ones then agree on the keys at the threshold on any CPU."""
    g = torch.Generator().manual_seed(0)
    T, sink, local, budget = 384, 16, 32, 112
    eighths = lambda *shape: (torch.randn(*shape, generator=g) * 8).round().clamp(-32, 32) / 8  # noqa: E731
    q, k = eighths(1, 4, T, 16), eighths(1, 2, T, 16)
    thr, cut, failed = bt.topk_thresholds(q, k, sink=sink, local=local, budget=budget, sample=32)
    assert not failed.any()
    rule, cand = kept_candidates(q, k, thr, cut, sink=sink, local=local)
    keep = ba.reference_keep(q, k, sink=sink, local=local, budget=budget)
    held = torch.arange(T) + 1 > budget
    assert torch.equal(rule[..., held, :], (keep & cand)[..., held, :])


def test_bins_of_a_bracket_straddling_zero_are_even():
    """Gaussian scores whose pick lies near their median: the bracket straddles zero, and each bin holds
    about a sixteenth of its keys (bins of the scores' int32 keys put nearly all of them in two)."""
    g = torch.Generator().manual_seed(0)
    s = torch.randn(1, 1, 1, 100_000, generator=g)
    lo, hi = torch.tensor([[[-0.5]]]), torch.tensor([[[0.5]]])
    base, inv_w = bt.bin_params(lo, hi)
    inside = (s >= lo[..., None]) & (s <= hi[..., None])
    hist = torch.zeros(1, 1, 1, bt.NB, dtype=torch.long).scatter_add_(-1, bt.bin_of(s, base, inv_w),
                                                                     inside.long())
    share = hist.float() / inside.sum()
    assert share.max() < 2.0 / bt.NB and share.min() > 0.5 / bt.NB


@interpreter_only
@pytest.mark.exhaustive
def test_a_bin_over_the_cap_fails_its_row_and_the_others_stay_exact():
    """Tied integer scores and a cap of 3: the rows whose pick lies in a bin of more than 3 entries are
    reported failed, exactly those (by `count_reference` and `narrow`), and every other row keeps the
    reference's keys (ties to the lower position)."""
    B, Hq, Hkv, T, S, D, sink, local, budget, cap = 1, 4, 2, 64, 64, 16, 4, 8, 28, 3
    q, k = integer_qk(B, Hq, Hkv, T, S, D, values=2, seed=7)
    seen = {}

    def brackets(t0, Tc):
        seen[t0] = bt.sample_brackets(q, k, t_base=t0, Tc=Tc, sink=sink, local=local, budget=budget)[:4]
        return seen[t0]

    thr, cut, failed = bt.topk_thresholds(q, k, sink=sink, local=local, budget=budget, cap=cap,
                                          brackets=brackets)
    picks = budget - sink - local
    expected = torch.zeros_like(failed)
    for t0, (lo, hi, low, high) in seen.items():
        Tc = lo.shape[2]
        held = torch.arange(S - T + t0, S - T + t0 + Tc) + 1 > budget
        lo, hi = torch.where(held, lo, math.inf), torch.where(held, hi, math.inf)
        base, inv_w = bt.bin_params(lo, hi, low, high)
        n_above, hist = bt.count_reference(q, k, lo, hi, base, inv_w, t_base=t0, sink=sink, local=local)
        _, in_bin = bt.narrow(n_above, hist, picks)
        fits = (n_above == picks) | ((in_bin >= 1) & (in_bin <= cap))
        expected[:, :, t0:t0 + Tc] = held & ~fits
    assert torch.equal(failed, expected)
    held = torch.arange(S - T, S) + 1 > budget
    assert failed.any() and (held & ~failed).any()
    keep = ba.reference_keep(q, k, sink=sink, local=local, budget=budget)
    rule, cand = kept_candidates(q, k, thr, cut, sink=sink, local=local)
    ok = held & ~failed  # [B, Hq, T]
    assert torch.equal(rule[ok], (keep & cand)[ok])


def test_the_chunked_path_is_kept_where_the_kernels_do_not_apply():
    """The controller offers a method its fast prefill only for a held prefill of an unpadded batch; on
    CPU tensors and with group_shared the methods decline it, and full attention has no kernels."""
    q, k, v = qkv(1, 4, 2, 8, 8, 16, torch.float32)
    call = Prefill(q, k, v, 0.25, BudgetConfig(6, 1, 2))
    base = AttentionMethod.triton_prefill
    with_kernels = {name for name in METHODS if METHODS.get(name).triton_prefill is not base}
    assert with_kernels == {"sink_window", "topk", "quest", "h2o"}
    for name in with_kernels:
        assert METHODS.get(name)().fast_prefill(call) is None  # CPU tensors
        assert METHODS.get(name)(group_shared=True).triton_prefill(call) is None  # on any device
    offered = []
    method = METHODS.get("topk")()
    method.fast_prefill = lambda call: offered.append(call.query.shape[2])  # notes the offer, declines it
    causal = torch.ones(1, 1, 8, 8, dtype=torch.bool).tril()
    for config, query, mask in ((BudgetConfig(6, 1, 2), q, None),  # offered
                                (BudgetConfig(6, 1, 2), q, causal),  # a mask (a padded batch)
                                (BudgetConfig(6, 1, 2), q[:, :, -1:], None),  # a decode step
                                (BudgetConfig(6, 1, 2, sparse_prefill=False), q, None)):  # not held
        AttentionController(method, config).attend(fake_module(groups=2), query, k, v, mask, None)
    assert offered == [8]


# ---------------------------------------------------------------------------------------------
# GPU, at scale (Llama-3.2-1B's attention: 32 query heads, 8 KV heads, head dim 64, bf16)
# ---------------------------------------------------------------------------------------------
def gpu_layer(T, method, budget=2560, sink=128, local=512, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, 32, T, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(1, 8, T, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(1, 8, T, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    return q, k, v, controller(method, budget, sink, local)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["sink_window", "topk"])
def test_gpu_fast_prefill_matches_the_chunked_path_at_8k(method):
    q, k, v, ctrl = gpu_layer(8192, method)
    fast_and_chunked(ctrl, controller(method, 2560, 128, 512), fake_module(groups=4), q, k, v)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [8192, 32768])
def test_gpu_topk_brackets_hold_where_picks_lie_near_the_median(T):
    """Gaussian scores put the picks of the rows from 2,560 to about 2 x 1,920 + 640 near their median,
    where a bracket straddles zero: its bins must still split it evenly enough to fit the cap."""
    q, k, _, _ = gpu_layer(T, "topk")
    thr, cut, failed = bt.topk_thresholds(q, k, sink=128, local=512, budget=2560)
    print(f"topk T={T}: failed rows {int(failed.sum())} of {failed.numel()}")
    assert failed.float().mean() < 1e-3


@pytest.mark.gpu
def test_gpu_topk_brackets_hold_and_memory_stays_low_at_64k():
    T = 65536
    q, k, v, ctrl = gpu_layer(T, "topk")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    thr, cut, failed = bt.topk_thresholds(q, k, sink=128, local=512, budget=2560)
    o, counts, _ = ba.budget_attention(q, k, v, scale=0.125, sink=128, local=512, thr=thr, cut=cut)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    print(f"64k topk: failed rows {int(failed.sum())} of {failed.numel()}, "
          f"extra peak {extra / 2**30:.2f} GiB")
    assert failed.float().mean() < 1e-3
    assert extra < 2 * 2**30  # the chunked path holds [Hq, 512, S] float32 scores: 4 GiB at 64k
    held = torch.arange(T, device="cuda") + 1 > 2560
    assert (counts[..., held][~failed[..., held]] == 2560).all()


@pytest.mark.gpu
@pytest.mark.parametrize("T", [8192, 32768, 65536])
@pytest.mark.parametrize("method", ["sink_window", "topk"])
def test_gpu_timing_against_full_attention(method, T):
    """Prints one layer call through the fast prefill (thresholds, attention, counts: the controller's
    `attend`) beside SDPA's causal attention on the same tensors, time and peak memory; for topk also its
    parts. No assertion: the targets (issue 57: topk 2x, sink_window 1x; peak 1.1x) are read off these
    lines and the harness."""
    q, k, v, ctrl = gpu_layer(T, method)
    module = fake_module(groups=4)
    against_full_attention(method, lambda: ctrl.attend(module, q, k, v, None, None), q, k, v)
    if method == "topk":
        th = cuda_ms(lambda: bt.topk_thresholds(q, k, sink=128, local=512, budget=2560))
        thr, cut, failed = bt.topk_thresholds(q, k, sink=128, local=512, budget=2560)
        at = cuda_ms(lambda: ba.budget_attention(q, k, v, scale=0.125, sink=128, local=512, thr=thr, cut=cut))
        print(f"topk T={T}: thresholds {th:.2f} ms + attention {at:.2f} ms; failed rows {int(failed.sum())} "
              f"of {failed.numel()}")


def check_buffer_select(positions: bool, rows: int, cap: int, device: str = "cpu", distinct: bool = False):
    """Random buffers of `rows` x `cap` with repeated scores (ties), negative and positive, and `need` from 1
    to n_in: `select_in_buffer` against its stable sort; the entries as `collect` packs them (score bits
    above the position), or scores alone (the sample's). `distinct`: every score distinct (no program
    has a tie at its threshold, the kernel's path without a scan)."""
    g = torch.Generator().manual_seed(4)
    buf_s = torch.randint(-6, 6, (rows, cap), generator=g).float() * 0.75
    buf_s[::3] = torch.randn(len(range(0, rows, 3)), cap, generator=g)
    buf_s[1, :6] = torch.tensor([-0.0, 0.0, -math.inf, 1e-45, -1e-45, 0.0])  # signed zeros, -inf, denormals
    buf_s[2, :8] = torch.tensor([0.0, -0.0, 0.0, -0.0, 1.0, -0.0, 2.0, 0.0])
    if distinct:
        buf_s = torch.randperm(rows * cap, generator=g).view(rows, cap).float() - rows * cap / 2
    buf_p = torch.arange(cap, dtype=torch.int32).expand(rows, cap) * 3 + 5
    n_in = torch.randint(1, cap + 1, (rows,), generator=g)
    n_in[1] = n_in[2] = cap
    need = (torch.rand(rows, generator=g) * n_in).long() + 1
    need[2] = 4  # among the zeros of both signs, equal to the keep rule: ties in slot order
    buf = (buf_s.view(torch.int32).long() << 32) | buf_p.long() if positions else buf_s
    buf, n_in, need = buf.to(device), n_in.to(device), need.to(device)
    thr, cut = bt.select_in_buffer(buf, n_in, need, positions=positions)
    thr_ref, cut_ref = bt.select_in_buffer_reference(buf, n_in, need, positions=positions)
    assert torch.equal(thr, thr_ref)
    if positions:
        assert torch.equal(cut, cut_ref)
        if not distinct:
            assert (cut == bt.INT_MAX).any() and (cut < bt.INT_MAX).any()  # both kinds of rows occur


@interpreter_only
@pytest.mark.parametrize("positions", [True, False])
@pytest.mark.parametrize("distinct", [False, True], ids=["ties", "distinct"])
def test_the_buffer_select_is_a_stable_sort(positions, distinct):
    check_buffer_select(positions, rows=24, cap=32, distinct=distinct)


@pytest.mark.gpu
@pytest.mark.parametrize(("rows", "cap"), [(24, 32), (3000, 1024), (40, 4096)])
@pytest.mark.parametrize("positions", [True, False])
@pytest.mark.parametrize("distinct", [False, True], ids=["ties", "distinct"])
def test_gpu_buffer_select_is_a_stable_sort(positions, rows, cap, distinct):
    """The same compiled: many rows a program at small caps, one at the largest."""
    check_buffer_select(positions, rows, cap, device="cuda", distinct=distinct)
