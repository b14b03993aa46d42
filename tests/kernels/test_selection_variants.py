"""The variants of the Triton selected attention against the PyTorch reference: both walks
(`selection.SELECTED_WALK`: "pipelined", "union"; the pipelined one's steps with packed entries or
not, `SELECTED_PACKED_STEP`), two tilings (`SELECTED_ROWS` 16 and 32 rows per
program) and both dq paths (`SELECTED_DQ`: "walk", "fused", the latter with its positions preloaded
or not, and its q/k dim in two halves or whole); outputs, the lse and gradients of q, k and v, on the
CPU through Triton's interpreter and (`-m gpu`) in bf16 on a CUDA GPU; the dk/dv kernel's inverted
index. Also: the pipelined walk compiles for sm_90 to asynchronous, double-buffered K/V copies (no
GPU needed)."""


import pytest
import torch

from nsa_eval.kernels import reference as ref
from nsa_eval.kernels import selected_by_block, selection
from nsa_eval.kernels._triton_utils import interpreting
from tests.kernels.sm90 import compile_sm90, json_from_fresh_python
from tests.kernels.test_triton_kernels import IDS, SHAPES, TOL, grads, make, rel_err

interpreted = pytest.mark.skipif(not interpreting(),
                                 reason="interpreter tests (TRITON_INTERPRET=1, CPU tensors)")

WALKS = ["pipelined", "pipelined-lists", "union"]  # -lists: SELECTED_PACKED_STEP off


@pytest.fixture
def walk(request, monkeypatch):
    """Set SELECTED_WALK, SELECTED_PACKED_STEP (off for "pipelined-lists") and SELECTED_ROWS (from an
    optional second parameter) for one test."""
    name, rows = request.param if isinstance(request.param, tuple) else (request.param, 16)
    walk_name, _, steps = name.partition("-")
    monkeypatch.setattr(selection, "SELECTED_WALK", walk_name)
    monkeypatch.setattr(selection, "SELECTED_PACKED_STEP", steps != "lists")
    monkeypatch.setattr(selection, "SELECTED_ROWS", rows)
    monkeypatch.setattr(selection, "SELECTED_BY_BLOCK_MAX_GROUP", 0)  # the walk at every group size
    return name, rows


def lists_with_edge_cases(B, T, hkv, n, select_size, seed):
    """Random block lists [B, T, Hkv, n]: padding anywhere, blocks after the query, a repeat within a
    list, unsorted order; plus rows with no usable block (only padding, only future blocks)."""
    g = torch.Generator().manual_seed(seed)
    ns = -(-T // select_size)
    idx = torch.randint(-2, ns, (B, T, hkv, n), generator=g, dtype=torch.int32)
    idx[..., -1] = idx[..., 0]  # a repeat
    idx[:, 3] = -1  # padding only
    idx[:, 5, :, 0] = ns - 1  # a block after the query, the rest padding
    idx[:, 5, :, 1:] = -7
    return idx


def reference_lse(q, k, block_indices, select_size):
    """[B, T, Hq] float64 lse of the selected attention (-inf where no token is usable)."""
    B, T, hq, dk = q.shape
    hkv = k.shape[2]
    key_block = torch.arange(T) // select_size  # [S]
    chosen = (block_indices.long()[..., None] == key_block).any(3)  # [B, T, Hkv, S]
    causal = torch.arange(T)[None, :] <= torch.arange(T)[:, None]  # [T, S]
    mask = chosen.repeat_interleave(hq // hkv, 2) & causal[None, :, None, :]  # [B, T, Hq, S]
    s = torch.einsum("bthd,bshd->bths", q.double(), k.double().repeat_interleave(hq // hkv, 2)) * dk**-0.5
    return torch.where(mask, s, float("-inf")).logsumexp(-1)


def assert_matches_reference(q, k, v, idx, select_size=16):
    """The Triton selected attention's output and q/k/v gradients match the PyTorch reference."""
    o = selection.selected_attention(q, k, v, idx, select_size=select_size)
    o_ref = ref.selected_attention(q, k, v, idx, select_size=select_size)
    assert rel_err(o, o_ref) < TOL
    for a, b in zip(grads([o], (q, k, v)), grads([o_ref], (q, k, v)), strict=True):
        assert rel_err(a, b) < TOL


@interpreted
@pytest.mark.parametrize("walk", WALKS, indirect=True)
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[3]], ids=[IDS[1], IDS[3]])  # G = 3 (4 positions), 16
def test_walk_matches_reference(walk, shape):
    B, T, hq, hkv, dk, dv = shape
    x = make(*shape, seed=4)
    q, k, v = x["q"], x["k"], x["v"]
    idx = lists_with_edge_cases(B, T, hkv, 5, 16, seed=6)
    o, lse = selection.selected_forward(q.detach(), k.detach(), v.detach(), idx, select_size=16,
                                        scale=dk**-0.5)
    lse_ref = reference_lse(q.detach(), k.detach(), idx, 16)
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
    assert torch.isinf(lse[:, 3]).all() and torch.isinf(lse[:, 5]).all()
    assert (o[:, 3] == 0).all() and (o[:, 5] == 0).all()  # no usable token: zero output
    fin = torch.isfinite(lse_ref)
    assert rel_err(lse[fin], lse_ref[fin]) < TOL
    assert_matches_reference(q, k, v, idx)


@interpreted
@pytest.mark.parametrize("walk", [(w, 32) for w in WALKS], ids=[f"{w}-rows32" for w in WALKS], indirect=True)
@pytest.mark.parametrize("shape", [SHAPES[2], SHAPES[3]], ids=[IDS[2], IDS[3]])
def test_two_positions_per_program(walk, shape):
    """32 rows per program: G = 16 takes 2 positions (a block chosen by both is read once, with a
    row mask), G = 4 takes 8."""
    B, T, hq, hkv, dk, dv = shape
    x = make(*shape, seed=9)
    q, k, v = x["q"], x["k"], x["v"]
    idx = lists_with_edge_cases(B, T, hkv, 4, 16, seed=10)
    idx[:, 1::2, :, 1] = idx[:, 0::2, :, 1]  # neighbours share a block
    assert_matches_reference(q, k, v, idx)


@interpreted
@pytest.mark.parametrize("walk", [("pipelined", 32), ("pipelined", 64)], ids=["rows32", "rows64"],
                         indirect=True)
def test_packed_steps_up_to_32_positions(walk):
    """G = 1 at 32 rows packs a bit per position beside the block index (32 positions); at 64 rows the
    64 bits would not fit int64 beside it, so the walk takes the step's lists instead."""
    shape = SHAPES[0]  # G = 1
    assert selection.packed_steps(walk[1]) == (walk[1] <= 32)
    x = make(*shape, seed=11)
    idx = lists_with_edge_cases(shape[0], shape[1], shape[3], 5, 16, seed=12)
    assert_matches_reference(x["q"], x["k"], x["v"], idx)


@interpreted
@pytest.mark.parametrize("preload", [True, False], ids=["preloaded", "per-step"])
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[3]], ids=[IDS[1], IDS[3]])
def test_fused_dq_matches_reference(monkeypatch, shape, preload):
    """SELECTED_DQ = "fused": dq from the dk/dv kernel's atomics, no dq walk; each work item's
    positions loaded once before its loop or at every step (SELECTED_DKV_PRELOAD)."""
    monkeypatch.setattr(selection, "SELECTED_DQ", "fused")
    monkeypatch.setattr(selection, "SELECTED_DKV_PRELOAD", preload)
    B, T, hq, hkv, dk, dv = shape
    x = make(*shape, seed=13)
    q, k, v = x["q"], x["k"], x["v"]
    idx = lists_with_edge_cases(B, T, hkv, 5, 16, seed=14)
    assert_matches_reference(q, k, v, idx)


@interpreted
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2]], ids=[IDS[0], IDS[2]])
def test_fused_dq_with_head_dim_in_halves_matches_reference(monkeypatch, shape):
    """The dk/dv kernel with its q/k dim in two column halves (`split_dk`, which SELECTED_DKV_WIDE
    takes at 16-bit dims of 128): dq and dk in two products each."""
    assert selection.dkv_column_tiles(shape[4], True) == (shape[4] // 2, shape[4] // 2)  # the split taken
    launch = selection.selected_dkv_launch
    monkeypatch.setattr(selection, "selected_dkv_launch", lambda *args: launch(*args) | dict(split_dk=True))
    monkeypatch.setattr(selection, "SELECTED_DQ", "fused")
    B, T, hq, hkv, dk, dv = shape
    x = make(*shape, seed=15)
    idx = lists_with_edge_cases(B, T, hkv, 5, 16, seed=16)
    assert_matches_reference(x["q"], x["k"], x["v"], idx)


def test_inverted_index_groups_positions_by_block():
    """inverted_index against a plain count: each (b, kv head, block) segment lists, in ascending
    order, exactly the positions whose list holds the block (usable: not padding, not after the
    position; once, even if repeated); presorted lists give the same index."""
    B, T, hkv, n, size = 2, 150, 2, 5, 16
    idx = lists_with_edge_cases(B, T, hkv, n, size, seed=31)
    ns = -(-T // size)
    pos, seg_start, item_seg, item_chunk = selection.inverted_index(idx, select_size=size, chunk=8)
    assert seg_start.numel() == B * hkv * ns + 1
    for b in range(B):
        for h in range(hkv):
            for blk in range(ns):
                seg = (b * hkv + h) * ns + blk
                got = pos[seg_start[seg]:seg_start[seg + 1]].tolist()
                want = [t for t in range(blk * size, T) if blk in idx[b, t, h].tolist()]
                assert got == want, (b, h, blk)
    used = item_seg < seg_start.numel() - 1
    counts = (seg_start[1:] - seg_start[:-1]).long()
    assert torch.equal(torch.bincount(item_seg[used].long(), minlength=counts.numel()), (counts + 7) // 8)
    ordered = torch.where(idx < 0, ns, idx).sort(-1).values  # ascending, padding last
    again = selection.inverted_index(torch.where(ordered == ns, -1, ordered), select_size=size, chunk=8,
                                     presorted=True)
    assert all(torch.equal(a, b) for a, b in zip(again, (pos, seg_start, item_seg, item_chunk), strict=True))


@interpreted
@pytest.mark.parametrize("flag", ["SELECTED_WALK", "SELECTED_DQ"])
def test_unknown_variant_is_rejected(monkeypatch, flag):
    monkeypatch.setattr(selection, flag, "nope")
    monkeypatch.setattr(selection, "SELECTED_BY_BLOCK_MAX_GROUP", 0)  # the walk checks SELECTED_WALK
    x = make(1, 32, 2, 1, 16, 16)
    idx = torch.zeros(1, 32, 1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=flag):
        o = selection.selected_attention(x["q"], x["k"], x["v"], idx, select_size=16)
        o.sum().backward()


def compile_for_h200(kernel, *, backward, config, G=16, d=128, select_size=64, n=16):
    """TTGIR of a selected kernel compiled ahead of time for sm_90 at the benchmark's shape (no GPU
    needed: Triton's NVIDIA backend and its bundled ptxas), with the integer arguments specialised
    as a launch at that shape would (all divisible by 16). Runs in the calling process, which must
    not have run the interpreter (it leaves triton.language patched): see `compiled_in_subprocess`."""
    GP, BT = selection.pow2(G, 1), max(1, selection.SELECTED_ROWS // G)
    consts = dict(DK=d, DV=d, BDK=d, BDK2=0, BDV=d, GP=GP, BT=BT, BS=select_size, NP=n, BACKWARD=backward,
                  UPCAST=False, GATED=False)
    if kernel is selection._selected_pipelined_kernel:  # as `_launch_selected` sets it
        consts["PACKED"] = selection.packed_steps(BT)
    types = ["*bf16", "*bf16", "*bf16", "*i32", "*bf16", "*fp32", "*bf16", "*fp32", "*bf16", "*bf16"]
    types += ["*bf16"] * 6  # the gated sum's operands (OC, OW, GC, GS, GW, OUT)
    types += ["i32"] * 13 + ["fp32", "fp32"]
    divisible = range(29)  # pointers, strides, T, HQ, G, NSEL
    return compile_sm90(kernel, types, consts, config, divisible).asm["ttgir"]


def compiled_in_subprocess():
    """{name: TTGIR} of the pipelined forward at 3 stages, at G = 16 and G = 4 (the defaults run 2:
    measured faster in runs 5 and 10), the dq walk and the union forward, compiled by
    `compile_for_h200` in a fresh Python without TRITON_INTERPRET."""
    code = """
import json
from nsa_eval.kernels import selection as s
from tests.kernels.test_selection_variants import compile_for_h200 as c
print(json.dumps(dict(
    fwd=c(s._selected_pipelined_kernel, backward=False, config=dict(s.SELECTED_FWD_CONFIG, num_stages=3)),
    fwd_g4=c(s._selected_pipelined_kernel, backward=False,
             config=dict(s.SELECTED_FWD_CONFIG_MULTI, num_stages=3), G=4),
    dq=c(s._selected_pipelined_kernel, backward=True, config=s.SELECTED_DQ_CONFIG),
    union=c(s._selected_kernel, backward=False, config=s.SELECTED_FWD_CONFIG))))
"""
    return json_from_fresh_python(code, timeout=600)


def test_pipelined_walk_prefetches_on_h200():
    """Compiled for the H200 (G = 16, d = 128, blocks of 64, n = 16): the pipelined walk's K/V loads
    become asynchronous copies into multi-buffered shared memory (the next block is in flight during
    the current MMAs); the union walk's, inside an `if`, stay plain loads."""
    ttgir = compiled_in_subprocess()  # skips without Triton's NVIDIA backend
    for name in ("fwd", "dq", "fwd_g4"):  # fwd_g4: the forward at G = 4 (4 positions a program)
        assert ttgir[name].count("ttg.async_copy_global_to_local") >= 2, name  # K and V
        assert "memdesc<2x64x128xbf16" in ttgir[name], name  # two buffers per operand: 3 stages
    assert "async_copy_global_to_local" not in ttgir["union"]


WALK = dict(SELECTED_BY_BLOCK_MAX_GROUP=0)  # the forward's walk at every group size
BY_BLOCK = dict(SELECTED_BY_BLOCK_MAX_GROUP=16, SELECTED_BY_BLOCK_MIN_ROWS=0)  # per key block, always
GPU_VARIANTS = {
    "union": dict(WALK, SELECTED_WALK="union"),
    "pipelined": dict(WALK, SELECTED_WALK="pipelined"),
    "pipelined-lists": dict(WALK, SELECTED_WALK="pipelined", SELECTED_PACKED_STEP=False),
    "pipelined-rows32": dict(WALK, SELECTED_WALK="pipelined", SELECTED_ROWS=32),
    "by-block": BY_BLOCK,
    "by-block-float32-partials": dict(BY_BLOCK, BY_BLOCK_PARTIALS="float32"),
    "fused-dq": dict(SELECTED_DQ="fused"),
    "fused-dq-rows32": dict(SELECTED_DQ="fused", SELECTED_DKV_WIDE=None, SELECTED_DKV_ROWS=32),
    "fused-dq-rows64": dict(SELECTED_DQ="fused", SELECTED_DKV_WIDE=None),
    "fused-dq-per-step-positions": dict(SELECTED_DQ="fused", SELECTED_DKV_PRELOAD=False),
}


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(GPU_VARIANTS), ids=list(GPU_VARIANTS))
@pytest.mark.parametrize("hq,hkv", [(64, 4), (12, 4)], ids=["G16", "G3"])
def test_variant_on_gpu_bf16(monkeypatch, variant, hq, hkv):
    """Each variant in bf16 at T = 4096, d = 128 against the float32 reference (outputs, dq, dk, dv)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    for flag, value in GPU_VARIANTS[variant].items():
        monkeypatch.setattr(selected_by_block if flag.startswith("BY_BLOCK") else selection, flag, value)
    B, T, d, n = 1, 4096, 128, 16
    g = torch.Generator(device="cuda").manual_seed(21)
    x32 = {name: torch.randn(B, T, h, d, generator=g, device="cuda")
           for name, h in (("q", hq), ("k", hkv), ("v", hkv))}
    x = {name: t.bfloat16().requires_grad_() for name, t in x32.items()}
    x32 = {name: t.requires_grad_() for name, t in x32.items()}
    idx = lists_with_edge_cases(B, T, hkv, n, 64, seed=22).cuda()
    o = selection.selected_attention(x["q"], x["k"], x["v"], idx)
    o_ref = ref.selected_attention(x32["q"], x32["k"], x32["v"], idx, select_size=64)
    assert rel_err(o, o_ref) < 2e-2
    do = torch.randn(o_ref.shape, generator=g, device="cuda")
    got = torch.autograd.grad(o, [x[name] for name in "qkv"], do.bfloat16())
    want = torch.autograd.grad(o_ref, [x32[name] for name in "qkv"], do)
    for name, a, b in zip("qkv", got, want, strict=True):
        assert rel_err(a, b) < 3e-2, name
