"""Every Triton NSA kernel against the PyTorch reference, on the CPU through Triton's interpreter
(tests/kernels/conftest.py sets TRITON_INTERPRET=1). Outputs and gradients are compared by relative
RMS error; block indices as sets, with ties judged by the reference's importance scores."""

import os

import pytest
import torch

from nsa_eval.kernels import reference as ref
from nsa_eval.kernels.compression import compressed_attention
from nsa_eval.kernels.decode import nsa_decode
from nsa_eval.kernels.importance import select_blocks
from nsa_eval.kernels.selection import selected_attention
from nsa_eval.kernels.window import sliding_window_attention

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
                                reason="interpreter tests (TRITON_INTERPRET=1, CPU tensors)")

TOL = 1e-4  # fp32 everywhere under the interpreter


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def make(B, T, hq, hkv, dk, dv, *, block_len=32, stride=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    tc = max(0, (T - block_len) // stride + 1)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_()

    return dict(q=rnd(B, T, hq, dk), k=rnd(B, T, hkv, dk), v=rnd(B, T, hkv, dv),
                k_cmp=rnd(B, tc, hkv, dk), v_cmp=rnd(B, tc, hkv, dv))


def grads(out, inputs, seed=1):
    g = torch.Generator().manual_seed(seed)
    loss = sum((o.float() * torch.randn(o.shape, generator=g)).sum() for o in out)
    return torch.autograd.grad(loss, inputs)


SHAPES = [  # (B, T, Hq, Hkv, Dk, Dv): G = 1, 3, 4, 16; Dk != Dv
    (1, 80, 2, 2, 32, 16),
    (1, 72, 3, 1, 16, 32),
    (2, 64, 8, 2, 32, 16),
    (1, 80, 16, 1, 16, 16),
]
IDS = [f"B{b}-T{t}-Hq{hq}-Hkv{hkv}-Dk{dk}-Dv{dv}" for b, t, hq, hkv, dk, dv in SHAPES]
# every shape on the newest Triton; on the lowest G = 3 (padded heads) and 4 (the 1B model's) only
EVERY_SHAPE = [pytest.param(s, id=i, marks=[pytest.mark.exhaustive] if s[2] // s[3] in (1, 16) else [])
               for s, i in zip(SHAPES, IDS, strict=True)]


@pytest.mark.parametrize("shape", EVERY_SHAPE)
def test_compressed_attention(shape):
    x = make(*shape)
    ins = (x["q"], x["k_cmp"], x["v_cmp"])
    o, lse = compressed_attention(*ins)
    o_ref, lse_ref = ref.compressed_attention(*ins)
    assert rel_err(o, o_ref) < TOL
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))  # queries before the first block
    assert torch.isinf(lse[:, :31]).all() and (o[:, :31] == 0).all()
    finite = torch.isfinite(lse_ref)
    assert rel_err(lse[finite], lse_ref[finite]) < TOL
    # gradients through o and lse
    safe = lambda o, lse: (o, torch.where(finite, lse, 0.0))  # noqa: E731
    for a, b in zip(grads(safe(o, lse), ins), grads(safe(o_ref, lse_ref), ins), strict=True):
        assert rel_err(a, b) < TOL


@pytest.mark.parametrize("shape", SHAPES[1:3], ids=IDS[1:3])
def test_sliding_window_attention(shape):
    x = make(*shape)
    ins = (x["q"], x["k"], x["v"])
    o = sliding_window_attention(*ins, window=24)
    o_ref = ref.sliding_window_attention(*ins, window=24)
    assert rel_err(o, o_ref) < TOL
    for a, b in zip(grads([o], ins), grads([o_ref], ins), strict=True):
        assert rel_err(a, b) < TOL


def assert_same_selection(idx, idx_ref, q, k_cmp, params):
    """Equal as sets, except where the reference ranks two blocks with (near-)equal importance."""
    assert idx.shape == idx_ref.shape and idx.dtype == torch.int32
    sorted_ok = torch.where(idx < 0, 1 << 30, idx)
    ascending = (sorted_ok[..., 1:] > sorted_ok[..., :-1]) | (idx[..., 1:] < 0)
    assert ascending.all() and (sorted_ok[..., 1:] >= sorted_ok[..., :-1]).all()  # -1 only at the end
    if torch.equal(idx, idx_ref):
        return
    # recompute the reference importances for the rows that differ and compare the chosen scores
    B, T, _, _ = q.shape
    p_cmp = ref._compressed_chunk(q.float(), torch.arange(T).expand(B, -1), k_cmp.float(),
                                  k_cmp.float()[..., :1], params["block_len"], params["stride"],
                                  q.shape[-1] ** -0.5)[2]
    ns = -(-T // params["select_size"])
    w = ref._overlap_weights(k_cmp.shape[1], ns, params["block_len"], params["stride"],
                             params["select_size"], "cpu")
    imp = p_cmp.sum(3) @ w  # [B, T, Hkv, Ns]
    for b, t, h in (idx != idx_ref).any(-1).nonzero().tolist():
        a = set(idx[b, t, h].tolist()) - {-1}
        r = set(idx_ref[b, t, h].tolist()) - {-1}
        assert len(a) == len(r)
        sa = sorted(imp[b, t, h, list(a - r)].tolist())
        sr = sorted(imp[b, t, h, list(r - a)].tolist())
        assert sa == pytest.approx(sr, rel=1e-4, abs=1e-6), (b, t, h)


@pytest.mark.parametrize(
    "shape,params",
    [
        (SHAPES[0], dict(block_len=32, stride=16, select_size=16, num_selected=4)),
        (SHAPES[1], dict(block_len=32, stride=16, select_size=32, num_selected=2, num_local=1)),
        (SHAPES[2], dict(block_len=16, stride=16, select_size=16, num_selected=3)),  # fla layout
        (SHAPES[3], dict(block_len=32, stride=16, select_size=16, num_selected=4, num_init=2)),
    ],
    ids=IDS,
)
def test_select_blocks(shape, params):
    x = make(*shape, block_len=params["block_len"], stride=params["stride"])
    q, k_cmp = x["q"].detach(), x["k_cmp"].detach()
    idx = select_blocks(q, k_cmp, **params)
    idx_ref = ref.select_blocks(q, k_cmp, **params)
    full = dict(block_len=32, stride=16, select_size=64) | params
    assert_same_selection(idx, idx_ref, q, k_cmp, full)
    # reusing the compression lse gives the same blocks
    _, lse = compressed_attention(q, k_cmp, x["v_cmp"].detach(), block_len=params["block_len"],
                                  stride=params["stride"])
    assert torch.equal(select_blocks(q, k_cmp, lse=lse, **params), idx)


@pytest.mark.parametrize("shape", EVERY_SHAPE)
def test_selected_attention(shape):
    x = make(*shape)
    q, k, v = x["q"], x["k"], x["v"]
    B, T, _, hkv, _, _ = (*shape[:2], *shape[2:])
    # random block lists with padding and a repeated entry; blocks after t must be masked
    g = torch.Generator().manual_seed(3)
    ns = -(-T // 16)
    idx = torch.randint(-1, ns, (B, T, hkv, 5), generator=g, dtype=torch.int32)
    idx[..., 4] = idx[..., 3]
    o = selected_attention(q, k, v, idx, select_size=16)
    o_ref = ref.selected_attention(q, k, v, idx, select_size=16)
    assert rel_err(o, o_ref) < TOL
    for a, b in zip(grads([o], (q, k, v)), grads([o_ref], (q, k, v)), strict=True):
        assert rel_err(a, b) < TOL


def test_selected_attention_int64_indices_outside_int32():
    """int64 entries past int32's range are future blocks and those below it padding, as in the
    reference: a plain cast would wrap 2**40 onto block 0 and -2**40 onto block 0 too."""
    x = make(1, 48, 2, 1, 16, 16)
    q, k, v = x["q"], x["k"], x["v"]
    idx = torch.tensor([1, 2**40, -(2**40), 2**33 + 1], dtype=torch.int64).expand(1, 48, 1, 4)
    o = selected_attention(q, k, v, idx, select_size=16)
    o_ref = ref.selected_attention(q, k, v, idx, select_size=16)
    assert rel_err(o, o_ref) < TOL
    assert rel_err(o, selected_attention(q, k, v, idx[..., :1], select_size=16)) < TOL


def test_bf16_inputs_upcast_under_interpreter():
    x = make(1, 64, 4, 1, 32, 32, dtype=torch.bfloat16)
    ins = (x["q"], x["k"], x["v"])
    o = sliding_window_attention(*ins, window=20)
    assert o.dtype == torch.bfloat16
    assert rel_err(o, ref.sliding_window_attention(*ins, window=20)) < 1e-2


@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[2], SHAPES[3]], ids=[IDS[1], IDS[2], IDS[3]])
def test_decode_matches_reference(shape):
    B, S, hq, hkv, dk, dv = shape
    x = make(*shape)
    kv = {n: x[n].detach() for n in ("k", "v", "k_cmp", "v_cmp")}
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, 1, hq, dk, generator=g)
    gates = [torch.rand(B, 1, hq, generator=g) for _ in range(3)]
    params = dict(select_size=16, num_selected=3, window=24)
    for lengths in ([S] * B, [S - 17 - 5 * b for b in range(B)], [20] * B):
        seqlens = torch.tensor(lengths, dtype=torch.int32)
        o, idx = nsa_decode(q, kv["k"], kv["v"], kv["k_cmp"], kv["v_cmp"], *gates, cache_seqlens=seqlens,
                            return_block_indices=True, **params)
        o_ref, idx_ref = ref.nsa_decode(q, kv["k"], kv["v"], kv["k_cmp"], kv["v_cmp"], *gates,
                                        cache_seqlens=seqlens, return_block_indices=True, **params)
        assert torch.equal(idx, idx_ref)
        assert rel_err(o, o_ref) < TOL


def test_decode_separate_window_cache():
    B, S, hq, hkv, dk, dv = 1, 64, 4, 1, 16, 16
    x = make(B, S, hq, hkv, dk, dv, seed=7)
    y = make(B, S, hq, hkv, dk, dv, seed=8)
    q = torch.randn(B, 1, hq, dk)
    gates = [torch.rand(B, 1, hq) for _ in range(3)]
    args = [x[n].detach() for n in ("k", "v", "k_cmp", "v_cmp")]
    kw = dict(k_swa=y["k"].detach(), v_swa=y["v"].detach(), select_size=16, num_selected=2, window=16)
    o = nsa_decode(q, *args, *gates, **kw)
    assert rel_err(o, ref.nsa_decode(q, *args, *gates, **kw)) < TOL


@pytest.mark.parametrize("window_kv, gate_in_branches", [  # the lowest Triton: the first and the last
    pytest.param("shared", False, id="shared"),
    pytest.param("own", False, id="own", marks=pytest.mark.exhaustive),
    pytest.param("shared", True, id="gates-in-branches", marks=pytest.mark.exhaustive),
    pytest.param("own", True, id="gates-in-branches-own"),
])
def test_nsa_attention_triton_composition(window_kv, gate_in_branches):
    """nsa_attention(impl="triton"): the three branches, the reused compression lse and the gated sum,
    against the reference, outputs and gradients (gates included), with the window sharing the
    selection's keys/values or having its own; the gates applied as copies g_x * do or inside each
    branch's kernels (`gate_in_branches`); the three branches' dq summed by the window's, the selected
    and the compression's kernels in turn."""
    assert_nsa_attention_matches_reference(16, 16, seed=11, own_window=window_kv == "own",
                                           gate_in_branches=gate_in_branches)


def assert_nsa_attention_matches_reference(dk, dv, *, seed, own_window=False, gate_in_branches=False):
    """nsa_attention(impl="triton") against the reference at B = 1, T = 72, 4 / 2 heads, with gates:
    the blocks, the output and every gradient (of the window's own keys/values too, if it has them)."""
    from nsa_eval import kernels

    B, T, hq, hkv = 1, 72, 4, 2
    x = make(B, T, hq, hkv, dk, dv, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    gates = [torch.rand(B, T, hq, generator=g).requires_grad_() for _ in range(3)]
    ins = (x["q"], x["k"], x["v"], x["k_cmp"], x["v_cmp"], *gates)
    params = dict(select_size=16, num_selected=3, window=20, gate_in_branches=gate_in_branches)
    if own_window:
        y = make(B, T, hq, hkv, dk, dv, seed=seed + 2)
        params.update(k_swa=y["k"], v_swa=y["v"])
    o, idx = kernels.nsa_attention(*ins, impl="triton", return_block_indices=True, **params)
    o_ref, idx_ref = kernels.nsa_attention(*ins, impl="reference", return_block_indices=True, **params)
    assert torch.equal(idx, idx_ref)
    assert rel_err(o, o_ref) < TOL
    wrt = ins + ((params["k_swa"], params["v_swa"]) if own_window else ())
    for a, b in zip(grads([o], wrt), grads([o_ref], wrt), strict=True):
        assert rel_err(a, b) < TOL


def test_dk_tiles():
    """Head dims that are the sum of two powers of two >= 16 split; the others pad."""
    from nsa_eval.kernels._triton_utils import dk_tiles

    split = [(128, 64), (64, 32), (128, 32), (32, 16), (64, 16)]
    assert [dk_tiles(d) for d in (192, 96, 160, 48, 80)] == split
    padded = [(128, 0), (256, 0), (16, 0), (32, 0), (128, 0), (256, 0)]
    assert [dk_tiles(d) for d in (128, 256, 16, 24, 112, 200)] == padded


@pytest.mark.parametrize("dk, gate_in_branches", [  # the lowest Triton: one split, one padded
    pytest.param(48, False, id="split", marks=pytest.mark.exhaustive),
    pytest.param(48, True, id="split-gates-in-branches-own-window"),
    pytest.param(24, False, id="padded"),
])
def test_head_dims_in_two_tiles_or_padded(dk, gate_in_branches):
    """Dk = 48 = 32 + 16 (as the paper's 192 = 128 + 64): every prefill kernel runs its score products
    and dq / dk in two column tiles (`_triton_utils.dk_tiles`); Dk = 24 pads to 32 (its columns past
    24 masked). nsa_attention(impl="triton") against the reference: blocks, output and gradients (the
    banded forwards, dq and dk/dv of both branches, the importances, the selected walk and its dk/dv
    and dq; the gates as copies g_x * do or in the branches' kernels, the window on its own keys)."""
    from nsa_eval.kernels._triton_utils import dk_tiles

    assert dk_tiles(dk) == ((32, 16) if dk == 48 else (32, 0))
    assert_nsa_attention_matches_reference(dk, 16, seed=21, own_window=gate_in_branches,
                                           gate_in_branches=gate_in_branches)


@pytest.mark.exhaustive
@pytest.mark.parametrize("per_block, hq", [(False, 4), (True, 8)], ids=["walk-G2", "by-block-G4"])
def test_gated_sum_in_selected_forward(per_block, hq):
    """NSA's output written by the selected forward's last launch (the walk's epilogue, or the merge
    of the forward per key block) equals the separate gate pass's, with gradients (o_slc kept for the
    backward, whose gradients match the reference) and without (o_slc not stored). On an input this
    short the walk writes it by default too (`prefill.writes_gated_sum`)."""
    from nsa_eval import kernels
    from nsa_eval.kernels import prefill

    B, T, hkv, d = 1, 72, 2, 16
    assert prefill.writes_gated_sum(hq // hkv, B * T * hkv, per_block)
    x = make(B, T, hq, hkv, d, d, seed=41)
    g = torch.Generator().manual_seed(42)
    gates = [torch.rand(B, T, hq, generator=g).requires_grad_() for _ in range(3)]
    ins = (x["q"], x["k"], x["v"], x["k_cmp"], x["v_cmp"], *gates)
    params = dict(select_size=16, num_selected=3, window=20)
    out = {}
    for in_selected in (False, True, None):
        run = lambda choice=in_selected: prefill.nsa_attention(  # noqa: E731
            *ins, **params, selected_per_block=per_block, gated_sum_in_selected=choice)
        with torch.no_grad():
            o_nograd = run()
        o = run()
        out[in_selected] = (o_nograd, o, grads([o], ins))
    for in_selected in (True, None):
        assert torch.allclose(out[in_selected][0], out[False][0], atol=1e-6)
        assert torch.allclose(out[in_selected][1], out[False][1], atol=1e-6)
        assert torch.allclose(out[in_selected][0], out[in_selected][1])
    o_ref = kernels.nsa_attention(*ins, **params, impl="reference")
    assert rel_err(out[True][1], o_ref) < TOL
    for a, b in zip(out[True][2], grads([o_ref], ins), strict=True):
        assert rel_err(a, b) < TOL


@pytest.mark.parametrize("dk", [16, 48], ids=["dim-16", "split-dim-48"])
def test_band_dq_adds_other_branches(dk):
    """band_backward_dq's `add`: the dq of the band plus another tensor (the other branches' dq, any
    float dtype, float32 output too), equal to the sum of the band's own dq and it; a tensor of
    another shape is a ValueError."""
    from nsa_eval.kernels import _triton_utils as tu
    from nsa_eval.kernels.band import band_backward_dq, band_forward

    x = make(1, 72, 4, 2, dk, 16)
    q, k, v = (x[n].detach() for n in ("q", "k", "v"))
    band = dict(scale=dk ** -0.5, key_stride=1, key_offset=0, window=20)
    o, lse = band_forward(q, k, v, **band)
    g = torch.Generator().manual_seed(4)
    do = torch.randn(o.shape, generator=g)
    delta = tu.row_delta(o, do)
    alone = band_backward_dq(q, k, v, lse, do, delta, **band)
    a = torch.randn(q.shape, generator=g)
    assert torch.allclose(band_backward_dq(q, k, v, lse, do, delta, **band, add=a), alone + a, atol=1e-5)
    wide = band_backward_dq(q, k, v, lse, do, delta, **band, add=a.double(), dtype=torch.float64)
    assert wide.dtype == torch.float64 and torch.allclose(wide.float(), alone + a, atol=1e-5)
    with pytest.raises(ValueError, match="add must be a contiguous tensor"):
        band_backward_dq(q, k, v, lse, do, delta, **band, add=a[:, :10].contiguous())


def test_gate_backward_deltas():
    """The gate backward's deltas equal each branch's rowsum(o_x * do_x) (rowsum(o_x * do) without the
    copies do_x, when the branches' kernels apply the gates themselves)."""
    from nsa_eval.kernels import _triton_utils as tu
    from nsa_eval.kernels import gates

    g = torch.Generator().manual_seed(3)
    o = [torch.randn(2, 9, 3, 20, generator=g) for _ in range(3)]
    gate_values = [torch.rand(2, 9, 3, generator=g) for _ in range(3)]
    do = torch.randn(2, 9, 3, 20, generator=g)
    d_o, d_g, delta = gates.gate_backward(*o, *gate_values, do)
    for i in range(3):
        assert torch.allclose(d_o[i], gate_values[i][..., None] * do, atol=1e-6)
        assert torch.allclose(d_g[i], (o[i] * do).sum(-1), atol=1e-5)
        assert torch.allclose(delta[i], tu.row_delta(o[i], d_o[i]), atol=1e-5)
    none, d_g2, delta2 = gates.gate_backward(*o, *gate_values, do, scaled_do=False)
    assert none == [None] * 3
    for i in range(3):
        assert torch.equal(d_g2[i], d_g[i])
        assert torch.allclose(delta2[i], tu.row_delta(o[i], do), atol=1e-5)


def reference_topk(imp, r, hkv, bs, n, t=None, num_init=1, num_local=2):
    """The blocks of row r of `topk_blocks`' input by the rule (at position t, by default the row's),
    ascending, -1 padded."""
    cur = (r // hkv if t is None else t) // bs
    score = imp[r, : cur + 1].clone()
    score[:num_init] = float("inf")
    if num_local > 0:
        score[max(0, cur - num_local + 1):] = float("inf")
    order = sorted(range(cur + 1), key=lambda j: (-score[j].item(), j))[:n]  # ties: lower index
    return sorted(order) + [-1] * (n - len(order))


@pytest.mark.parametrize("n,num_init,num_local", [(16, 1, 2), (5, 1, 2), (8, 0, 0), (8, 3, 1)])
def test_topk_lean_filter(n, num_init, num_local):
    """The lean filter (`topk.lean_filtered_top`) on rows of up to 200 blocks: random importances (the
    compacted path, in 32 slots or in 64), many exact ties and -0.0 (ties to the lower index, whichever
    path), equal importances everywhere (more candidates than TOPK_CAP: the arg-max passes), and the
    short rows at the start (all blocks kept)."""
    from nsa_eval.kernels import topk

    g = torch.Generator().manual_seed(5)
    T, rows, ns, bs = 400, 48, 200, 2
    assert topk.lean_fits(256, 16)  # 200 blocks pad to 256: the filter's rows
    pos = torch.cat([torch.arange(0, 40, 5), torch.randint(40, T, (rows - 8,), generator=g)]).int()
    imp = torch.rand(rows, ns, generator=g)
    imp[1::5] = torch.randint(0, 8, imp[1::5].shape, generator=g).float() / 8  # many ties, zeros
    imp[2::7, 3::5] = -0.0
    imp[3::9] = 0.5  # every block ties
    out = topk.topk_blocks(imp, T=T, num_kv_heads=1, select_size=bs, num_selected=n, num_init=num_init,
                           num_local=num_local, positions=pos)
    for r in range(rows):
        want = reference_topk(imp, r, 1, bs, n, t=pos[r].item(), num_init=num_init, num_local=num_local)
        assert out[r].tolist() == want, r


@pytest.mark.parametrize("ns", [1024, 2000])
def test_topk_lean_wide_rows(ns):
    """The lean filter on rows of 1,024 blocks (its 32-bit lane masks) and of 2,000 (64-bit masks), a
    mask's top bit set: the same blocks as the rule at every path (few candidates in 32 slots, more in
    64, too many for the slots, exact ties at the bound)."""
    from nsa_eval.kernels import topk

    g = torch.Generator().manual_seed(9)
    bs, rows = 2, 24
    T = ns * bs
    pos = torch.cat([torch.tensor([T - 1, T - 2, 33 * bs, 45 * bs, 60 * bs]),
                     torch.randint(40 * bs, T, (rows - 5,), generator=g)])
    imp = torch.rand(rows, ns, generator=g)
    imp[1] = torch.randint(0, 3, (ns,), generator=g).float()  # ties everywhere, past 64 candidates
    imp[4::5, ::37] = imp[4::5, ::37].max()  # ties at the top
    imp[0, ns - 5] = 10.0  # block 128 * (R - 1) + 4 * lane + 3 at T - 1: its lane mask's top bit
    got = topk.topk_blocks(imp, T=T, num_kv_heads=1, select_size=bs, num_selected=16, num_init=1, num_local=2,
                           positions=pos.int())
    for r in range(rows):
        assert got[r].tolist() == reference_topk(imp, r, 1, bs, 16, t=pos[r].item()), r


@pytest.mark.parametrize("n", [5, 1])
def test_topk_blocks_ties_and_forced(n):
    """Rows of 20 blocks, below the lean filter's 128, take the arg-max passes: forced blocks, no
    block after t, largest importances with ties (many equal values, zeros and -0.0) going to the
    lower index, ascending output, -1 padding; 5 blocks or 1."""
    from nsa_eval.kernels import topk

    g = torch.Generator().manual_seed(21)
    T, hkv, ns, bs = 40, 2, 20, 2
    assert not topk.lean_fits(32, 8)
    imp = torch.randint(0, 4, (T * hkv, ns), generator=g).float() / 4  # many ties, zeros included
    imp[::3] = torch.rand(imp[::3].shape, generator=g)
    imp[1::4, 3::5] = -0.0  # ties with +0.0
    out = topk.topk_blocks(imp, T=T, num_kv_heads=hkv, select_size=bs, num_selected=n, num_init=1,
                           num_local=2)
    for r in range(T * hkv):
        assert out[r].tolist() == reference_topk(imp, r, hkv, bs, n), r
