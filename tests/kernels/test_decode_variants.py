"""Both implementations of the Triton decode (`decode.DECODE_VARIANT`: "fused", "v1") against the
reference decode. CPU tests run through Triton's interpreter; the `gpu` test compares the two
variants on an H200-sized cache, replays the fused one from a CUDA graph (its arrival counters must
reset themselves) and prints their times: `pytest -m gpu tests/kernels/test_decode_variants.py -s`."""

import os

import pytest
import torch

from nsa_eval.kernels import decode
from nsa_eval.kernels import reference as ref
from tests.kernels import test_triton_kernels as base  # module import: its tests are not collected twice

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
interpreter_only = pytest.mark.skipif(not INTERPRET, reason="interpreter tests (TRITON_INTERPRET=1)")
TOL = 1e-4


@pytest.fixture(params=["fused", "v1"])
def variant(request, monkeypatch):
    monkeypatch.setattr(decode, "DECODE_VARIANT", request.param)
    return request.param


@pytest.fixture
def v1(monkeypatch):
    monkeypatch.setattr(decode, "DECODE_VARIANT", "v1")


# the default variant (fused) runs these in test_triton_kernels.py; here the previous one
@interpreter_only
@pytest.mark.parametrize("shape", base.SHAPES[1:4], ids=base.IDS[1:4])
def test_v1_matches_reference(v1, shape):
    base.test_decode_matches_reference(shape)


@interpreter_only
def test_v1_separate_window_cache(v1):
    base.test_decode_separate_window_cache()


def _inputs(B, S, hq, hkv, dk, dv, seed=0, device="cpu", dtype=torch.float32):
    g = torch.Generator(device=device).manual_seed(seed)
    tc = (S - 32) // 16 + 1

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=device).to(dtype)

    q = rnd(B, 1, hq, dk)
    kv = [rnd(B, S, hkv, dk), rnd(B, S, hkv, dv), rnd(B, tc, hkv, dk), rnd(B, tc, hkv, dv)]
    gates = [torch.rand(B, 1, hq, generator=g, device=device).to(dtype) for _ in range(3)]
    return q, kv, gates


def _check(q, kv, gates, lengths, **params):
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    o, idx = decode.nsa_decode(q, *kv, *gates, cache_seqlens=seqlens, return_block_indices=True, **params)
    o_ref, idx_ref = ref.nsa_decode(q, *kv, *gates, cache_seqlens=seqlens, return_block_indices=True,
                                    **params)
    assert torch.equal(idx, idx_ref)
    assert base.rel_err(o, o_ref) < TOL


@interpreter_only
@pytest.mark.parametrize("hq,hkv", [(6, 2), (16, 1)], ids=["G3", "G16"])
def test_long_cache(variant, hq, hkv):
    """Several compressed tiles per split and several splits, importance chunks with spill from the
    previous chunk, selected-block programs with an empty slot (5 blocks, 2 per program), window
    programs of two tiles; ragged lengths including one before the first compressed block."""
    q, kv, gates = _inputs(3, 600, hq, hkv, 16, 32, seed=1)
    _check(q, kv, gates, [600, 333, 20], select_size=16, num_selected=5, window=40)


@interpreter_only
def test_exact_ties_go_to_the_lower_block(variant):
    """Equal compressed keys give equal importances: the top-k must take the lower block indices,
    across importance chunks (16 selection blocks each under the interpreter)."""
    _check_exact_ties()


def _check_exact_ties():
    q, kv, gates = _inputs(1, 640, 4, 1, 16, 16, seed=2)
    kv[2] = torch.zeros_like(kv[2])  # every compressed score 0: interior blocks tie exactly
    _check(q, kv, gates, [640], select_size=16, num_selected=6, window=16)
    kv[2][:, 20:24] = 1.0  # a few larger scores: blocks 4-6 beat the ties
    _check(q, kv, gates, [640], select_size=16, num_selected=6, window=16)


@interpreter_only
def test_more_forced_blocks_than_slots(variant):
    """1 initial + 3 local forced blocks for 2 slots: the two lowest forced blocks."""
    q, kv, gates = _inputs(2, 300, 4, 2, 16, 16, seed=5)
    _check(q, kv, gates, [300, 150], select_size=16, num_selected=2, num_init=1, num_local=3, window=16)


@interpreter_only
@pytest.mark.parametrize("source", ["tiles", "scores"])
@pytest.mark.parametrize("block_len,stride,select_size", [
    (32, 16, 64), (64, 64, 64), (32, 16, 16), (80, 16, 32)], ids=["paper", "fla", "select16", "spill2"])
def test_importance_sources(monkeypatch, source, block_len, stride, select_size):
    """Step 2's importances from step 1's per-tile block sums ("tiles": 16-key tiles under the
    interpreter, 2 tiles per program) or from the stored scores, at the paper's ratio (4 tiles' worth
    of blocks, one spilling block), fla's layout (no spill), select_size = stride (16 blocks a tile)
    and 80-token blocks over 32-token selection blocks (two spilling blocks); ragged lengths, one
    before the first compressed block."""
    monkeypatch.setattr(decode, "DECODE_VARIANT", "fused")
    monkeypatch.setattr(decode, "DECODE_IMPORTANCE", source)
    monkeypatch.setattr(decode, "IMP_TILES_PER_PROGRAM", 2)
    S = 1500
    q, kv, gates = _geometry_inputs(S, block_len, stride, seed=9)
    params = dict(block_len=block_len, stride=stride, select_size=select_size, num_selected=5, window=32)
    _check(q, kv, gates, [S, 777, block_len - 3], **params)


def _geometry_inputs(S, block_len, stride, seed):
    """3 sequences of S tokens, 8/2 heads, d = 16, and the compressed caches of that geometry."""
    g = torch.Generator().manual_seed(seed)
    tc = (S - block_len) // stride + 1
    q = torch.randn(3, 1, 8, 16, generator=g)
    kv = [torch.randn(3, n, 2, 16, generator=g) for n in (S, S, tc, tc)]
    return q, kv, [torch.rand(3, 1, 8, generator=g) for _ in range(3)]


def _reference_importance(q, k_cmp, lengths, block_len, stride, select_size, ns):
    """[B * Hkv, ns] float64: softmax over the visible compressed keys, mapped onto selection blocks by
    shared tokens / stride, summed over each group's heads (the reference's rule, directly)."""
    B, _, hq, d = q.shape
    tc, hkv = k_cmp.shape[1], k_cmp.shape[2]
    w = ref._overlap_weights(tc, ns, block_len, stride, select_size, "cpu").double()  # [Tc, ns]
    rows = []
    for b in range(B):
        visible = torch.arange(tc) * stride + block_len - 1 <= lengths[b] - 1
        s = torch.einsum("hd,chd->hc", q[b, 0].double(), k_cmp[b].double().repeat_interleave(hq // hkv, 1))
        p = torch.softmax((s * d ** -0.5).masked_fill(~visible, float("-inf")), -1).nan_to_num()
        rows.append((p @ w).view(hkv, hq // hkv, ns).sum(1))
    return torch.cat(rows)


@interpreter_only
@pytest.mark.parametrize("block_len,stride,select_size", [
    (32, 16, 64), (64, 64, 64), (80, 16, 32), (272, 16, 64), (273, 16, 64)],
    ids=["paper", "fla", "spill2", "spill-equals-tile", "falls-back"])
def test_tile_importances_match_reference(monkeypatch, block_len, stride, select_size):
    """The importances step 2 hands to the top-k (`TOPK_IN_STEP2 = False` exposes them), compared
    directly with the reference rule on every block up to each row's own: where the blocks that only
    the forced slots would take (the newest, reached by the spill of a partly visible tile) count too.
    272-token blocks spill into as many blocks as a 16-key tile holds; 273 need more, so the scores
    path runs instead."""
    monkeypatch.setattr(decode, "DECODE_VARIANT", "fused")
    monkeypatch.setattr(decode, "TOPK_IN_STEP2", False)
    monkeypatch.setattr(decode, "IMP_TILES_PER_PROGRAM", 2)
    layout = decode.tile_layout(16, block_len, stride, select_size)  # 16-key tiles under the interpreter
    assert (layout is None) == (block_len == 273)
    captured, topk_blocks = {}, decode.topk_blocks

    def spy(imp, **kwargs):
        captured["imp"] = imp.clone()
        return topk_blocks(imp, **kwargs)

    monkeypatch.setattr(decode, "topk_blocks", spy)
    S = 1400
    q, kv, gates = _geometry_inputs(S, block_len, stride, seed=12)
    lengths = [S, 901, block_len + 40]
    _check(q, kv, gates, lengths, block_len=block_len, stride=stride, select_size=select_size, num_selected=4,
           window=32)
    ns = -(-S // select_size)
    want = _reference_importance(q, kv[2], lengths, block_len, stride, select_size, ns)
    own = torch.arange(ns)[None, :] <= (torch.tensor(lengths) - 1)[:, None] // select_size  # [B, ns]
    own = own.repeat_interleave(2, 0)  # rows (b, h_kv)
    torch.testing.assert_close(captured["imp"].double()[own], want[own], rtol=1e-5, atol=1e-7)


@interpreter_only
def test_fused_knobs(monkeypatch):
    """One tile per split (many partials) and one split for everything; window chunks in step 1 or 3;
    the merge in a fourth launch."""
    monkeypatch.setattr(decode, "DECODE_VARIANT", "fused")
    q, kv, gates = _inputs(2, 400, 8, 2, 16, 16, seed=3)
    for tiles, window_step, merge_in_attn in ((1, 2, True), (64, 2, True), (2, 3, True), (2, 2, False),
                                              (2, 3, False), (2, 1, False), (1, 1, True)):
        monkeypatch.setattr(decode, "CMP_SPLIT_TILES", tiles)
        monkeypatch.setattr(decode, "WINDOW_STEP", window_step)
        monkeypatch.setattr(decode, "MERGE_IN_ATTN", merge_in_attn)
        _check(q, kv, gates, [400, 211], select_size=32, num_selected=4, window=48)


@interpreter_only
@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_importance_chunks_per_program(monkeypatch, chunks):
    """Several chunks of selection blocks per importance program (38 blocks: 3 chunks of 16 under the
    interpreter), with ragged lengths whose last chunk ends early or holds no block at all."""
    monkeypatch.setattr(decode, "DECODE_VARIANT", "fused")
    monkeypatch.setattr(decode, "IMP_CHUNKS_PER_PROGRAM", chunks)
    q, kv, gates = _inputs(3, 600, 8, 2, 16, 16, seed=6)
    _check(q, kv, gates, [600, 260, 40], select_size=16, num_selected=5, window=40)


@interpreter_only
def test_topk_in_its_own_launch(monkeypatch):
    """TOPK_IN_STEP2 = False: `topk_blocks` after step 2 gives the reference's blocks and output, exact
    ties across importance chunks included."""
    monkeypatch.setattr(decode, "DECODE_VARIANT", "fused")
    monkeypatch.setattr(decode, "TOPK_IN_STEP2", False)
    q, kv, gates = _inputs(3, 600, 8, 2, 16, 16, seed=6)
    _check(q, kv, gates, [600, 260, 40], select_size=16, num_selected=5, window=40)
    _check_exact_ties()


@interpreter_only
def test_lean_topk_in_step2(monkeypatch):
    """The lean filter in the last importance program, on rows of up to 132 selection blocks: random
    importances (its compacted candidates), exact ties everywhere (more candidates than TOPK_CAP: the
    passes over the whole row instead), and a row with fewer blocks than slots."""
    from nsa_eval.kernels import topk

    monkeypatch.setattr(decode, "DECODE_VARIANT", "fused")
    assert topk.lean_fits(256, 8) and not topk.lean_fits(64, 8)
    q, kv, gates = _inputs(3, 2100, 4, 1, 16, 16, seed=3)
    params = dict(select_size=16, num_selected=8, window=32)
    _check(q, kv, gates, [2100, 1500, 70], **params)
    kv[2] = torch.zeros_like(kv[2])  # every compressed score 0: interior blocks tie exactly
    _check(q, kv, gates, [2100, 1500, 70], **params)


def _graph(fn):
    """fn captured in a CUDA graph (compiled first, outside the capture) -> (graph, its output)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def _gpu_inputs(T, B=16, hq=64, hkv=4, d=128):
    q, kv, gates = _inputs(B, T, hq, hkv, d, d, seed=4, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.tensor([T - 97 * b for b in range(B)], device="cuda", dtype=torch.int32)
    return q, kv, gates, seqlens


@pytest.mark.gpu
@pytest.mark.parametrize("T", [8192, 65536])
def test_gpu_fused_vs_v1_and_graph_replay(monkeypatch, T):
    """bf16 at the benchmark shape (batch 16, 64/4 heads, d = 128, ragged lengths): both variants
    against the float32 reference decode of two rows, the same blocks in both (up to near-ties),
    identical outputs over 50 CUDA graph replays of the fused decode; prints both times."""
    import triton

    q, kv, gates, seqlens = _gpu_inputs(T)
    B = q.shape[0]
    out = {}
    for name in ("fused", "v1"):
        monkeypatch.setattr(decode, "DECODE_VARIANT", name)
        fn = lambda: decode.nsa_decode(q, *kv, *gates, cache_seqlens=seqlens, return_block_indices=True)  # noqa: E731
        out[name] = fn()
        graph, _ = _graph(fn)
        print(f"\ndecode T={T} B={B} {name}: {triton.testing.do_bench(fn) * 1e3:.1f} us plain, "
              f"{triton.testing.do_bench(graph.replay) * 1e3:.1f} us CUDA graph")
    (o_f, idx_f), (o_1, idx_1) = out["fused"], out["v1"]
    assert (idx_f != idx_1).any(-1).float().mean() <= 0.1  # only (near-)ties may differ
    assert base.rel_err(o_f, o_1) < 1e-2
    rows = [0, B - 1]
    o_ref = ref.nsa_decode(q[rows], *[x[rows] for x in kv], *[g[rows] for g in gates],
                           cache_seqlens=seqlens[rows])
    assert base.rel_err(o_f[rows], o_ref) < 2e-2

    monkeypatch.setattr(decode, "DECODE_VARIANT", "fused")
    graph, o_g = _graph(lambda: decode.nsa_decode(q, *kv, *gates, cache_seqlens=seqlens))
    first = None
    for _ in range(50):
        graph.replay()
        torch.cuda.synchronize()
        first = o_g.clone() if first is None else first
        assert torch.equal(o_g, first)  # a missed or stale partial would change some rows
    assert torch.equal(first, o_f)


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", [dict(), dict(TOPK_IN_STEP2=False), dict(DECODE_VARIANT="v1")],
                         ids=["fused", "topk-launch", "v1"])
def test_gpu_int64_cache_seqlens(monkeypatch, knobs):
    """int64 cache lengths give the int32 ones' output and blocks at 8k (where `topk_blocks` filters),
    in each path that reads them: the kernels themselves, and the top-k's own launch."""
    q, kv, gates, seqlens = _gpu_inputs(8192)
    monkeypatch.setattr(decode, "DECODE_VARIANT", "fused")
    for name, value in knobs.items():
        monkeypatch.setattr(decode, name, value)
    o, idx = decode.nsa_decode(q, *kv, *gates, cache_seqlens=seqlens, return_block_indices=True)
    o64, idx64 = decode.nsa_decode(q, *kv, *gates, cache_seqlens=seqlens.long(), return_block_indices=True)
    assert torch.equal(idx64, idx) and torch.equal(o64, o)


SWEEP = [  # knob settings of the fused decode timed by the sweep (the first one is the default)
    dict(),
    dict(CMP_PROGRAMS_PER_SM=1),
    dict(CMP_PROGRAMS_PER_SM=3),
    dict(CMP_STAGES=4),
    dict(CMP_STAGES=2),
    dict(CMP_WARPS=2, CMP_PROGRAMS_PER_SM=4),
    dict(CMP_WARPS=8),
    dict(CMP_TILE_KEYS=128, CMP_STAGES=2),
    dict(CMP_TILE_KEYS=32),
    dict(SEL_PER_PROGRAM=2, WIN_TILES_PER_PROGRAM=1),
    dict(SEL_PER_PROGRAM=8, WIN_TILES_PER_PROGRAM=4),
    dict(SEL_STAGES=0),
    dict(SEL_STAGES=2),
    dict(ATTN_WARPS=8),
    dict(WINDOW_STEP=3),
    dict(WINDOW_STEP=1),
    dict(MERGE_IN_ATTN=True),
    dict(MERGE_COLUMNS=64),  # the merge's columns per program before run 62
    dict(IMP_CHUNKS_PER_PROGRAM=1),
    dict(IMP_CHUNKS_PER_PROGRAM=4),
    dict(IMP_CHUNKS_PER_PROGRAM=8),
    dict(TOPK_IN_STEP2=False),
    dict(IMP_LAUNCH=dict(num_warps=4, maxnreg=128)),
    dict(IMP_LAUNCH=dict(num_warps=8)),
    dict(IMP_LAUNCH=dict(num_warps=2)),
    dict(DECODE_IMPORTANCE="scores"),
    dict(TILE_MAP="tf32x3"),
    dict(IMP_TILES_PER_PROGRAM=4),
    dict(IMP_TILES_PER_PROGRAM=16),
    dict(IMP_TILES_PER_PROGRAM=64),
    dict(WINDOW_STEP=1, IMP_TILES_PER_PROGRAM=16),
]


@pytest.mark.gpu
def test_gpu_fused_config_sweep(monkeypatch):
    """CUDA-graph times of the fused decode at 64k, batch 16, over its launch knobs (printed; the
    outputs must not depend on them)."""
    import triton

    q, kv, gates, seqlens = _gpu_inputs(65536)
    monkeypatch.setattr(decode, "DECODE_VARIANT", "fused")
    want = decode.nsa_decode(q, *kv, *gates, cache_seqlens=seqlens)
    owner = lambda name: decode  # noqa: E731
    defaults = {name: getattr(owner(name), name) for knobs in SWEEP for name in knobs}
    print()
    for knobs in SWEEP:
        for name, value in {**defaults, **knobs}.items():
            monkeypatch.setattr(owner(name), name, value)
        graph, o = _graph(lambda: decode.nsa_decode(q, *kv, *gates, cache_seqlens=seqlens))
        us = triton.testing.do_bench(graph.replay) * 1e3
        print(f"fused decode {knobs or 'defaults'}: {us:.1f} us (CUDA graph)")
        graph.replay()
        # the knobs change the float32 summation order (tile sizes, splits) before a bf16 output; run 11
        # measured 1.01e-3 for 32-key tiles. A missing or stale partial gives errors near 1e-1.
        assert base.rel_err(o, want) < 5e-3


@interpreter_only
def test_head_major_caches(variant):
    """Caches stored head-major ([B, Hkv, S, d] memory, the same [B, S, Hkv, d] view; the benchmark
    times this layout) give the reference's output: the kernels address every cache by its strides."""
    q, kv, gates = _inputs(2, 300, 4, 2, 16, 16, seed=4)
    kv = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in kv]
    assert kv[0].stride(2) == 300 * 16  # one head's tokens are adjacent in memory
    _check(q, kv, gates, [300, 170], select_size=16, num_selected=4, window=40)


@interpreter_only
def test_unwritten_cache_slots_are_ignored(variant):
    """Cache slots past each sequence's length hold NaN (as a cache allocated with torch.empty may): the
    decode gives the reference's output (its loads mask them; a kernel that copied whole tiles, as the
    TMA path tried in run 68 did, must zero the values it does not use)."""
    q, kv, gates = _inputs(2, 300, 8, 2, 16, 16, seed=5)
    lengths = [300, 170]
    tc = (170 - 32) // 16 + 1
    for x in kv[:2]:
        x[1, 170:] = float("nan")
    for x in kv[2:]:
        x[1, tc:] = float("nan")
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    params = dict(select_size=32, num_selected=4, window=48)
    o, idx = decode.nsa_decode(q, *kv, *gates, cache_seqlens=seqlens, return_block_indices=True, **params)
    clean = [x.nan_to_num(0.0) for x in kv]
    o_ref, idx_ref = ref.nsa_decode(q, *clean, *gates, cache_seqlens=seqlens, return_block_indices=True,
                                    **params)
    assert torch.equal(idx, idx_ref)
    assert base.rel_err(o, o_ref) < TOL
