"""Property tests of NSA block selection (reference): the invariants hold for any valid geometry.

For random block geometries, GQA shapes and sequence lengths: the forced blocks are always there,
no block starts after the query, min(n, available) distinct blocks, ascending, -1 only at the end,
and the choice equals a brute-force top-n of the group-summed, overlap-weighted importance.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nsa_eval import kernels

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@st.composite
def selection_cases(draw):
    stride = draw(st.sampled_from([1, 2, 4]))
    block_len = stride * draw(st.integers(1, 4))
    select_size = stride * draw(st.integers(1, 4))
    num_init = draw(st.integers(0, 2))
    num_local = draw(st.integers(0, 3))
    num_selected = max(1, num_init + num_local + draw(st.integers(0, 4)))
    Hkv = draw(st.integers(1, 2))
    G = draw(st.sampled_from([1, 2, 3, 4]))
    T = draw(st.integers(1, 80))
    extra_cmp = draw(st.integers(0, 2))
    seed = draw(st.integers(0, 2**16))
    return dict(block_len=block_len, stride=stride, select_size=select_size, num_selected=num_selected,
                num_init=num_init, num_local=num_local), (Hkv, G, T, extra_cmp, seed)


def make_qk(Hkv, G, T, extra_cmp, seed, block_len, stride, B=2, D=8):
    gen = torch.Generator().manual_seed(seed)
    Tc = max(0, (T - block_len) // stride + 1) + extra_cmp
    q = torch.randn(B, T, Hkv * G, D, generator=gen) * 2
    k_cmp = torch.randn(B, Tc, Hkv, D, generator=gen)
    return q, k_cmp


def brute_importance(q, k_cmp, block_len, stride, select_size):
    """Group-summed importance [B, T, Hkv, Ns] in float64, from token-level overlap counts."""
    B, T, Hq, D = q.shape
    Tc, Hkv = k_cmp.shape[1], k_cmp.shape[2]
    G = Hq // Hkv
    num_blocks = -(-T // select_size)
    scores = torch.einsum("bthd,bshd->bhts", q.double(), k_cmp.double().repeat_interleave(G, 2)) * D**-0.5
    t = torch.arange(T)
    visible = (torch.arange(Tc) * stride + block_len - 1)[None, :] <= t[:, None]  # [T, Tc]
    p = torch.where(visible, scores, float("-inf")).softmax(-1).nan_to_num(0.0)  # [B, Hq, T, Tc]
    weight = torch.zeros(Tc, num_blocks, dtype=torch.float64)  # shared tokens / stride
    for i in range(Tc):
        for s in range(i * stride, i * stride + block_len):
            if s // select_size < num_blocks:
                weight[i, s // select_size] += 1 / stride
    return (p.reshape(B, Hkv, G, T, Tc).sum(2) @ weight).permute(0, 2, 1, 3)  # [B, T, Hkv, Ns]


def check_row(row, t, importance, select_size, num_selected, num_init, num_local):
    """All invariants for one query t and KV head; ``row`` a list of ints, importance [Ns]."""
    valid = [j for j in row if j >= 0]
    assert row == valid + [-1] * (len(row) - len(valid)), f"-1 padding not only at the end: {row}"
    assert valid == sorted(set(valid)), f"not ascending and distinct: {row}"
    current = t // select_size
    assert all(j <= current for j in valid), f"block after t={t}: {row}"
    assert len(valid) == min(num_selected, current + 1), f"t={t}: {row}"
    forced = {j for j in range(current + 1) if j < num_init or j > current - num_local}
    assert forced <= set(valid), f"t={t}: forced {sorted(forced)} missing in {row}"
    # The rest is a top-n by importance: every unchosen available block scores at most the lowest
    # chosen one (up to float32 rounding), ties broken towards the lower index.
    free_chosen = [j for j in valid if j not in forced]
    unchosen = [j for j in range(current + 1) if j not in valid]
    if free_chosen and unchosen:
        worst = min(importance[j] for j in free_chosen)
        best_left = max(importance[j] for j in unchosen)
        assert best_left <= worst + 1e-5 * max(1.0, abs(worst)), f"t={t}: {row} skips a better block"


@settings(max_examples=60, deadline=None)
@given(selection_cases())
def test_selection_invariants(case):
    params, (Hkv, G, T, extra_cmp, seed) = case
    q, k_cmp = make_qk(Hkv, G, T, extra_cmp, seed, params["block_len"], params["stride"])
    idx = kernels.select_blocks(q, k_cmp, impl="reference", **params)
    assert idx.dtype == torch.int32 and idx.shape == (q.shape[0], T, Hkv, params["num_selected"])
    importance = brute_importance(q, k_cmp, params["block_len"], params["stride"], params["select_size"])
    rows, scores = idx.tolist(), importance.tolist()
    for b in range(q.shape[0]):
        for t in range(T):
            for h in range(Hkv):
                check_row(rows[b][t][h], t, scores[b][t][h], params["select_size"], params["num_selected"],
                          params["num_init"], params["num_local"])


def assert_same_choice(idx_a, idx_b, importance):
    """Equal selections, except where float rounding flips a near-tie (equal importance sums)."""
    for b, t, h in (idx_a != idx_b).any(-1).nonzero().tolist():
        picked_a = [importance[b, t, h, j].item() for j in idx_a[b, t, h].tolist() if j >= 0]
        picked_b = [importance[b, t, h, j].item() for j in idx_b[b, t, h].tolist() if j >= 0]
        assert sorted(picked_a) == pytest.approx(sorted(picked_b), rel=1e-5), (b, t, h)


@settings(max_examples=25, deadline=None)
@given(selection_cases())
def test_group_shares_blocks_by_summed_importance(case):
    """A group of G identical heads selects like its single head; reordering heads changes nothing."""
    params, (Hkv, G, T, extra_cmp, seed) = case
    q, k_cmp = make_qk(Hkv, G, T, extra_cmp, seed, params["block_len"], params["stride"])
    single = q[:, :, ::G]  # one head per group: [B, T, Hkv, D]
    repeated = single.repeat_interleave(G, dim=2)  # [B, T, Hkv * G, D] G identical heads per group
    idx_single = kernels.select_blocks(single, k_cmp, impl="reference", **params)
    idx_repeated = kernels.select_blocks(repeated, k_cmp, impl="reference", **params)
    importance = brute_importance(single, k_cmp, params["block_len"], params["stride"], params["select_size"])
    assert_same_choice(idx_single, idx_repeated, importance)

    order = torch.arange(q.shape[2]).view(Hkv, G).flip(1).reshape(-1)  # reverse heads within each group
    idx = kernels.select_blocks(q, k_cmp, impl="reference", **params)
    idx_flipped = kernels.select_blocks(q[:, :, order], k_cmp, impl="reference", **params)
    importance = brute_importance(q, k_cmp, params["block_len"], params["stride"], params["select_size"])
    assert_same_choice(idx, idx_flipped, importance)


def test_exact_ties_go_to_the_lower_block():
    """Zero compressed keys make every visible block equally important: lower indices win."""
    T, select_size = 200, 16  # fla layout: l = d = l' = 16; 13 selection blocks at the end
    q = torch.randn(1, T, 4, 8)
    k_cmp = torch.zeros(1, T // 16, 2, 8)
    idx = kernels.select_blocks(q, k_cmp, block_len=16, stride=16, select_size=select_size, num_selected=5,
                                num_init=1, num_local=2, impl="reference")
    # t = 199: current block 12; forced 0, 11, 12; the two free slots go to blocks 1 and 2.
    assert idx[0, 199].tolist() == [[0, 1, 2, 11, 12]] * 2
    # t = 40: blocks 0..2 available, fewer than 5: all of them, then padding.
    assert idx[0, 40, 0].tolist() == [0, 1, 2, -1, -1]


def test_paper_geometry_weights_one_two_two_two_one():
    """With l=32, d=16, l'=64, only compressed block 4j+3 (weight 1 on block j) is hot: block j wins."""
    T, D = 1024, 4
    Tc = (T - 32) // 16 + 1
    k_cmp = torch.zeros(1, Tc, 1, D)
    k_cmp[0, 4 * 5 + 3, 0, 0] = 50.0  # compressed block 23 covers tokens 368..399: blocks 5 (16) and 6 (16)
    q = torch.zeros(1, T, 1, D)
    q[..., 0] = 1.0
    idx = kernels.select_blocks(q, k_cmp, num_selected=4, scale=1.0, impl="reference")
    # t = 1023: forced 0, 14, 15; the free slot is a tie between blocks 5 and 6 (16 tokens each),
    # the lower index wins. Under Eq. 9's shifted range block 6 alone would collect it (4*6-4..4*6).
    assert idx[0, 1023, 0].tolist() == [0, 5, 14, 15]
    k_cmp[0, 4 * 5 + 2, 0, 0] = 50.0  # block 22 covers 352..383: all in block 5 -> 5 leads clearly
    idx = kernels.select_blocks(q, k_cmp, num_selected=4, scale=1.0, impl="reference")
    assert idx[0, 1023, 0].tolist() == [0, 5, 14, 15]
    k_cmp[0, 4 * 5 + 2, 0, 0] = 0.0
    k_cmp[0, 4 * 6 + 1, 0, 0] = 50.0  # block 25 covers 400..431: in block 6 -> 6 leads
    idx = kernels.select_blocks(q, k_cmp, num_selected=4, scale=1.0, impl="reference")
    assert idx[0, 1023, 0].tolist() == [0, 6, 14, 15]
