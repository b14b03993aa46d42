"""The Triton selected attention's paths against the PyTorch reference: the forward's walk (one
position a program at G = 16, up to 16 at G = 1) and the forward per key block (`selected_by_block`,
the default for small groups on long inputs), forced here with `per_block`; the backward's one kernel
per key block (dk, dv and dq by atomics; its q/k dim in two halves, as at 16-bit 128 / 128); the
inverted index and the counting index it matches. Lists with padding, repeats, future blocks and rows
with nothing usable; on the CPU through Triton's interpreter, and in bf16 on a GPU (`-m gpu`). Also:
the walk compiles for sm_90 to asynchronous, double-buffered K/V copies (no GPU needed)."""

import pytest
import torch

from nsa_eval.kernels import reference as ref
from nsa_eval.kernels import selected_by_block, selection
from nsa_eval.kernels._triton_utils import interpreting
from tests.kernels.sm90 import compile_sm90, json_from_fresh_python
from tests.kernels.test_triton_kernels import IDS, SHAPES, TOL, make, rel_err

interpreted = pytest.mark.skipif(not interpreting(),
                                 reason="interpreter tests (TRITON_INTERPRET=1, CPU tensors)")


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


def sorted_lists(idx, T, select_size):
    """idx with every list ascending and its padding last, as `select_blocks` writes them."""
    ns = -(-T // select_size)
    ordered = torch.where(idx < 0, ns, idx).sort(-1).values
    return torch.where(ordered == ns, -1, ordered).contiguous()


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


def selected_with_grads(q, k, v, idx, *, per_block, select_size=16, split_dk=None, seed=1):
    """The selected forward on one path (`per_block`) and its backward (`selected_backward`, which
    `selected_attention`'s autograd runs): o, lse and the gradients of q, k, v for a random output
    gradient."""
    q, k, v = (x.detach().contiguous() for x in (q, k, v))
    bi = selection._int32_indices(idx, q.shape[1], select_size)
    scale = q.shape[-1] ** -0.5
    o, lse = selection.selected_forward(q, k, v, bi, select_size=select_size, scale=scale,
                                        per_block=per_block)
    g = torch.Generator(device=q.device).manual_seed(seed)
    do = torch.randn(o.shape, generator=g, device=q.device).to(o.dtype)
    dq, dk, dv = selection.selected_backward(q, k, v, bi, o, lse, do, select_size=select_size, scale=scale,
                                             split_dk=split_dk)
    return o, lse, (dq, dk, dv), do


def assert_matches_reference(x, idx, *, per_block, select_size=16, split_dk=None, tol=TOL):
    """One path's output, lse (-inf and a zero output where no token is usable) and q/k/v gradients
    against the reference; returns (o, lse)."""
    q, k, v = x["q"], x["k"], x["v"]
    o, lse, grads, do = selected_with_grads(q, k, v, idx, per_block=per_block, select_size=select_size,
                                            split_dk=split_dk)
    x32 = [t.detach().float().requires_grad_() for t in (q, k, v)]
    o_ref = ref.selected_attention(*x32, idx.long(), select_size=select_size)
    assert rel_err(o, o_ref) < tol
    for name, a, b in zip("qkv", grads, torch.autograd.grad(o_ref, x32, do.float()), strict=True):
        assert rel_err(a, b) < tol, name
    return o, lse


@interpreted
@pytest.mark.parametrize("per_block", [False, True], ids=["walk", "by-block"])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_paths_match_reference(shape, per_block):
    """G = 1 (16 positions a walking program, their steps packed), 3, 4 and 16 (one position)."""
    B, T, hq, hkv, dk, dv = shape
    x = make(*shape, seed=4)
    idx = lists_with_edge_cases(B, T, hkv, 5, 16, seed=6)
    o, lse = assert_matches_reference(x, idx, per_block=per_block)
    lse_ref = reference_lse(x["q"].detach(), x["k"].detach(), idx, 16)
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
    assert torch.isinf(lse[:, 3]).all() and torch.isinf(lse[:, 5]).all()
    assert (o[:, 3] == 0).all() and (o[:, 5] == 0).all()  # no usable token: zero output
    fin = torch.isfinite(lse_ref)
    assert rel_err(lse[fin], lse_ref[fin]) < TOL


@interpreted
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[2]], ids=[IDS[1], IDS[2]])
def test_by_block_equals_walk_and_presorted_lists(shape):
    """The forward per block gives the walk's o and lse; lists sorted ascending with their padding last
    (as `select_blocks` writes them) give the same result with `presorted=True`, which skips the sort."""
    B, T, hq, hkv, dk, dv = shape
    x = make(*shape, seed=53)
    q, k, v = (x[n].detach() for n in ("q", "k", "v"))
    idx = lists_with_edge_cases(B, T, hkv, 6, 16, seed=54)
    forward = lambda lists, **kw: selection.selected_forward(  # noqa: E731
        q, k, v, lists, select_size=16, scale=dk**-0.5, **kw)
    o_walk, lse_walk = forward(idx, per_block=False)
    o, lse = forward(idx, per_block=True)
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_walk))
    assert torch.allclose(o, o_walk, atol=1e-5) and torch.allclose(lse, lse_walk, atol=1e-5)
    for per_block in (False, True):
        o2, lse2 = forward(sorted_lists(idx, T, 16), presorted=True, per_block=per_block)
        assert torch.allclose(o2, o, atol=1e-5) and torch.equal(torch.isinf(lse2), torch.isinf(lse))


@interpreted
def test_by_block_in_chunks_of_positions_is_the_same():
    """The forward per block with room for the partials of 16 positions at a time (10 chunks a sequence,
    the last short, over 2 sequences) writes the o, lse and gated sum of one pass: each chunk's lists are
    those of its positions (the causal mask, the blocks past a position dropped). To float32 rounding: on
    the GPU each row of an MMA sums alone and the two agree bit for bit, but the interpreter's numpy
    products may round a row by how many rows share its product (a chunk groups positions differently),
    which on some CPUs' BLAS moves the results by an ulp or two."""
    B, T, hq, hkv, dk, dv = 2, 150, 8, 2, 16, 16
    x = make(B, T, hq, hkv, dk, dv, seed=61)
    q, k, v = (x[n].detach() for n in ("q", "k", "v"))
    idx = sorted_lists(lists_with_edge_cases(B, T, hkv, 5, 16, seed=62), T, 16)
    g = torch.Generator().manual_seed(63)
    branches = [torch.randn(B, T, hq, dv, generator=g) for _ in range(2)]  # o_cmp, o_swa
    gates = [torch.rand(B, T, hq, generator=g) for _ in range(3)]
    runs = []
    for chunk_bytes in (2**40, 1):
        o, out = torch.empty(B, T, hq, dv), torch.empty(B, T, hq, dv)
        lse = torch.empty(B, T, hq)
        selected_by_block.selected_forward_by_block(
            q, k, v, idx, o, lse, select_size=16, scale=dk**-0.5, presorted=True,
            gated_sum=(*branches, *gates, out), chunk_bytes=chunk_bytes)
        runs.append((o, lse, out))
    for whole, chunked in zip(*runs, strict=True):
        assert torch.equal(torch.isinf(chunked), torch.isinf(whole))  # the same rows without blocks
        torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=2e-6)
    assert torch.isinf(runs[0][1]).any() and torch.isfinite(runs[0][1]).any()  # rows with and without blocks


@interpreted
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2]], ids=[IDS[0], IDS[2]])
def test_backward_with_head_dim_in_halves_matches_reference(shape):
    """The dk/dv kernel with its q/k dim in two column halves (`split_dk`, which SELECTED_DKV_WIDE
    takes at 16-bit dims of 128): dq and dk in two products each."""
    assert selection.dkv_column_tiles(shape[4], True) == (shape[4] // 2, shape[4] // 2)  # the split taken
    B, T, hq, hkv, dk, dv = shape
    x = make(*shape, seed=15)
    idx = lists_with_edge_cases(B, T, hkv, 5, 16, seed=16)
    assert_matches_reference(x, idx, per_block=False, split_dk=True)


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
    again = selection.inverted_index(sorted_lists(idx, T, size), select_size=size, chunk=8, presorted=True)
    assert all(torch.equal(a, b) for a, b in zip(again, (pos, seg_start, item_seg, item_chunk), strict=True))


@interpreted
@pytest.mark.parametrize(("size", "block", "spread"),
                         [(16, 1024, 8), (64, 1024, 8), (16, 64, 8), (16, 64, 1)],
                         ids=["size16", "size64", "block64", "spread1"])
def test_block_entries_hold_the_inverted_index(size, block, spread):
    """The counting index of the forward per block (`block_entries`; `block` entries a program,
    `spread` counters a segment) against the sorted one (`inverted_index`) on lists with padding,
    repeats and future blocks: the same segment bounds, the same positions within each segment (in any
    order), entries that point at their segment's block, and the same work items, each (segment,
    chunk) once, below `n_items`."""
    B, T, hkv, n = 2, 150, 2, 5
    lists = sorted_lists(lists_with_edge_cases(B, T, hkv, n, size, seed=56), T, size)
    ns = -(-T // size)
    entry, seg_start, item_seg, item_chunk, n_items = selected_by_block.block_entries(
        lists, select_size=size, chunk=8, block=block, spread=spread)
    want_pos, want_start, want_seg, want_chunk = selected_by_block.inverted_index(
        lists, select_size=size, chunk=8, presorted=True)
    assert torch.equal(seg_start, want_start)
    used = int(seg_start[-1])
    entry = entry.long()[:used]
    seg_of = torch.repeat_interleave(torch.arange(B * hkv * ns), (seg_start[1:] - seg_start[:-1]).long())
    assert torch.equal(lists.flatten()[entry].long(), seg_of % ns)  # the segment's block
    assert torch.equal(entry // (T * hkv * n) * hkv + entry // n % hkv, seg_of // ns)  # its (b, kv head)
    pos = entry // (hkv * n) % T
    for s in range(B * hkv * ns):
        lo, hi = int(seg_start[s]), int(seg_start[s + 1])
        assert torch.equal(pos[lo:hi].sort().values, want_pos[lo:hi].long())
    items = sorted(zip(item_seg[:int(n_items)].tolist(), item_chunk[:int(n_items)].tolist(), strict=True))
    nseg = B * hkv * ns
    want = sorted((s, c) for s, c in zip(want_seg.tolist(), want_chunk.tolist(), strict=True) if s < nseg)
    assert items == want and len(set(items)) == len(items)


def compile_forward(*, G, config, d=128, select_size=64, n=16):
    """TTGIR of the selected forward compiled ahead of time for sm_90 at the benchmark's shape, with
    per-thread loads (TMA copies need Triton's descriptors; `test_tma.py` compiles that path) and the
    integer arguments specialised as a launch at that shape would (all divisible by 16). Runs in the
    calling process, which must not have run the interpreter (it leaves triton.language patched)."""
    GP, BT = selection._tiling(G)
    consts = dict(DK=d, DV=d, BDK=d, BDK2=0, BDV=d, GP=GP, BT=BT, BS=select_size, NP=n, UPCAST=False,
                  TMA=False, GATE_SUM=False, STORE_O=True, PACKED=BT > 1)
    types = ["*bf16", "*bf16", "*bf16", "*i32", "*bf16", "*fp32"] + ["*bf16"] * 6
    types += ["i32"] * 13 + ["fp32"]
    divisible = range(25)  # pointers, strides, T, HQ, G, NSEL
    return compile_sm90(selection._selected_fwd_kernel, types, consts, config, divisible).asm["ttgir"]


def test_walk_prefetches_on_h200():
    """Compiled for the H200 (d = 128, blocks of 64, n = 16) at 3 stages, at G = 16 (one position a
    program) and G = 4 (four): the walk's K/V loads become asynchronous copies into multi-buffered
    shared memory, the next block in flight during the current MMAs."""
    code = """
import json
from nsa_eval.kernels import selection as s
from tests.kernels.test_selection import compile_forward as c
print(json.dumps(dict(g16=c(G=16, config=dict(s.SELECTED_FWD_CONFIG, num_stages=3)),
                      g4=c(G=4, config=dict(s.SELECTED_FWD_CONFIG_MULTI, num_stages=3)))))
"""
    ttgir = json_from_fresh_python(code, timeout=600)  # skips without Triton's NVIDIA backend
    for name, text in ttgir.items():
        assert text.count("ttg.async_copy_global_to_local") >= 2, name  # K and V
        assert "memdesc<2x64x128xbf16" in text, name  # two buffers per operand: 3 stages


@pytest.mark.gpu
@pytest.mark.parametrize("per_block", [False, True], ids=["walk", "by-block"])
@pytest.mark.parametrize("hq,hkv", [(64, 4), (12, 4)], ids=["G16", "G3"])
def test_paths_on_gpu_bf16(per_block, hq, hkv):
    """Each forward path and the backward in bf16 at T = 4096, d = 128 against the float32 reference
    (outputs, dq, dk, dv)."""
    B, T, d, n = 1, 4096, 128, 16
    g = torch.Generator(device="cuda").manual_seed(21)
    x = {name: torch.randn(B, T, h, d, generator=g, device="cuda").bfloat16()
         for name, h in (("q", hq), ("k", hkv), ("v", hkv))}
    idx = lists_with_edge_cases(B, T, hkv, n, 64, seed=22).cuda()
    assert_matches_reference(x, idx, per_block=per_block, select_size=64, tol=3e-2)


@pytest.mark.gpu
def test_by_block_matches_walk_at_64k():
    """bf16 at T = 65536, 16/4 heads, d = 128, the selection of the benchmark's inputs: the forward
    per block (the default there) against the walk."""
    from nsa_eval.bench.kernels import _inputs
    from nsa_eval.kernels.compression import compressed_attention
    from nsa_eval.kernels.importance import select_blocks

    x = _inputs(1, 65536, 16, 4, 128, grad=False)
    with torch.no_grad():
        _, lse_cmp = compressed_attention(x["q"], x["k_cmp"], x["v_cmp"])
        idx = select_blocks(x["q"], x["k_cmp"], lse=lse_cmp)
        assert selection.by_block(4, 65536 * 4)
        forward = lambda per_block: selection.selected_forward(  # noqa: E731
            x["q"], x["k"], x["v"], idx, select_size=64, scale=128**-0.5, presorted=True, per_block=per_block)
        o_walk, lse_walk = forward(False)
        o, lse = forward(None)
    assert rel_err(o, o_walk) < 1e-2
    assert (lse - lse_walk).abs().max().item() < 1e-4
