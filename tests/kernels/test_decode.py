"""The Triton decode (`decode.nsa_decode`) against the reference decode on long and ragged caches:
several compressed tiles per split and splits per row, importance programs a row with spill from the
previous tile, step 2's importances themselves against the reference's rule (per-tile sums, and the
stored scores where a tile does not hold whole selection blocks), the top-k with exact ties and more
forced blocks than slots, caches in any layout with unwritten slots. CPU tests run through Triton's
interpreter (`tests/kernels/test_triton_kernels.py` has the short cases); the `gpu` tests run the
benchmark's decode in bf16 and replay it from a CUDA graph."""

import os

import pytest
import torch

from nsa_eval.kernels import decode
from nsa_eval.kernels import reference as ref
from nsa_eval.kernels.decode_scoring import tile_layout
from tests.kernels.test_triton_kernels import rel_err

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
interpreter_only = pytest.mark.skipif(not INTERPRET, reason="interpreter tests (TRITON_INTERPRET=1)")
TOL = 1e-4


def _inputs(B, S, hq, hkv, dk, dv, seed=0, device="cpu", dtype=torch.float32, block_len=32, stride=16):
    """q [B, 1, Hq, Dk], caches k, v [B, S, Hkv, D] and k_cmp, v_cmp of that geometry, gates [B, 1, Hq]."""
    g = torch.Generator(device=device).manual_seed(seed)
    tc = (S - block_len) // stride + 1

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=device).to(dtype)

    q = rnd(B, 1, hq, dk)
    kv = [rnd(B, S, hkv, dk), rnd(B, S, hkv, dv), rnd(B, tc, hkv, dk), rnd(B, tc, hkv, dv)]
    gates = [torch.rand(B, 1, hq, generator=g, device=device).to(dtype) for _ in range(3)]
    return q, kv, gates


def _check(q, kv, gates, lengths, **params):
    """The decode's output and blocks against the reference decode's."""
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    o, idx = decode.nsa_decode(q, *kv, *gates, cache_seqlens=seqlens, return_block_indices=True, **params)
    o_ref, idx_ref = ref.nsa_decode(q, *kv, *gates, cache_seqlens=seqlens, return_block_indices=True,
                                    **params)
    assert torch.equal(idx, idx_ref)
    assert rel_err(o, o_ref) < TOL


@interpreter_only
@pytest.mark.parametrize("hq,hkv", [(6, 2), (16, 1)], ids=["G3", "G16"])
def test_long_cache(hq, hkv):
    """Several compressed tiles per split and several splits, importance programs with spill from the
    previous tile, selected-block programs with an empty slot (5 blocks, 4 per program), window
    programs of two tiles; ragged lengths including one before the first compressed block."""
    q, kv, gates = _inputs(3, 600, hq, hkv, 16, 32, seed=1)
    _check(q, kv, gates, [600, 333, 20], select_size=16, num_selected=5, window=40)


@interpreter_only
def test_exact_ties_go_to_the_lower_block():
    """Equal compressed keys give equal importances: the top-k must take the lower block indices,
    across importance programs."""
    q, kv, gates = _inputs(1, 640, 4, 1, 16, 16, seed=2)
    kv[2] = torch.zeros_like(kv[2])  # every compressed score 0: interior blocks tie exactly
    _check(q, kv, gates, [640], select_size=16, num_selected=6, window=16)
    kv[2][:, 20:24] = 1.0  # a few larger scores: blocks 4-6 beat the ties
    _check(q, kv, gates, [640], select_size=16, num_selected=6, window=16)


@interpreter_only
def test_more_forced_blocks_than_slots():
    """1 initial + 3 local forced blocks for 2 slots: the two lowest forced blocks; no forced block
    and one slot: the most important block."""
    q, kv, gates = _inputs(2, 300, 4, 2, 16, 16, seed=5)
    _check(q, kv, gates, [300, 150], select_size=16, num_selected=2, num_init=1, num_local=3, window=16)
    _check(q, kv, gates, [300, 150], select_size=16, num_selected=1, num_init=0, num_local=0, window=16)


@interpreter_only
def test_lean_topk_in_step2():
    """The lean filter in the last importance program, on rows of up to 132 selection blocks: random
    importances (its compacted candidates), exact ties everywhere (more candidates than its slots: the
    arg-max passes over the whole row instead), and a row with fewer blocks than slots."""
    q, kv, gates = _inputs(3, 2100, 4, 1, 16, 16, seed=3)
    params = dict(select_size=16, num_selected=8, window=32)
    _check(q, kv, gates, [2100, 1500, 70], **params)
    kv[2] = torch.zeros_like(kv[2])  # every compressed score 0: interior blocks tie exactly
    _check(q, kv, gates, [2100, 1500, 70], **params)


GEOMETRIES = {  # (block_len, stride, select_size); 16-key tiles under the interpreter
    "paper": (32, 16, 64),  # 4 compressed blocks a selection block, one spilling block
    "fla": (64, 64, 64),  # no spill
    "select16": (32, 16, 16),  # select_size = stride: 16 blocks a tile
    "spill2": (80, 16, 32),  # two spilling blocks
    "spill-equals-tile": (272, 16, 64),  # spills into as many blocks as a tile holds
    "scores-long-blocks": (288, 16, 64),  # spills past the next tile: step 2 maps the stored scores
    "scores-ratio32": (32, 2, 64),  # 32 compressed blocks a selection block, more than a tile holds
}


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
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_importances_match_reference(geometry):
    """Step 2's importances (`decode_steps` hands them back), compared directly with the reference rule
    on every block up to each row's own, where the blocks only the forced slots would take (the
    newest, reached by the spill of a partly visible tile) count too; and the output and blocks against
    the reference decode. Ragged lengths, one before the first compressed block."""
    block_len, stride, select_size = GEOMETRIES[geometry]
    assert (tile_layout(16, block_len, stride, select_size) is None) == geometry.startswith("scores")
    S = 1400
    q, kv, gates = _inputs(3, S, 8, 2, 16, 16, seed=12, block_len=block_len, stride=stride)
    lengths = [S, 901, block_len - 3]
    params = dict(block_len=block_len, stride=stride, select_size=select_size, num_selected=4, window=32)
    _check(q, kv, gates, lengths, **params)
    _, _, imp = decode.decode_steps(q, *kv, *gates, kv[0], kv[1], torch.tensor(lengths, dtype=torch.int32),
                                    **params, num_init=1, num_local=2, scale=16 ** -0.5)
    ns = -(-S // select_size)
    want = _reference_importance(q, kv[2], lengths, block_len, stride, select_size, ns)
    own = torch.arange(ns)[None, :] <= (torch.tensor(lengths) - 1)[:, None] // select_size  # [B, ns]
    own = own.repeat_interleave(2, 0)  # rows (b, h_kv)
    torch.testing.assert_close(imp.double()[own], want[own], rtol=1e-5, atol=1e-7)


@interpreter_only
def test_head_major_caches():
    """Caches stored head-major ([B, Hkv, S, d] memory, the same [B, S, Hkv, d] view) give the
    reference's output: the kernels address every cache by its strides."""
    q, kv, gates = _inputs(2, 300, 4, 2, 16, 16, seed=4)
    kv = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in kv]
    assert kv[0].stride(2) == 300 * 16  # one head's tokens are adjacent in memory
    _check(q, kv, gates, [300, 170], select_size=16, num_selected=4, window=40)


@interpreter_only
def test_unwritten_cache_slots_are_ignored():
    """Cache slots past each sequence's length hold NaN (as a cache allocated with torch.empty may): the
    decode gives the reference's output (its loads mask them; a kernel that copied whole tiles would
    have to zero the values it does not use)."""
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
    assert rel_err(o, o_ref) < TOL


def _window_ring(full: torch.Tensor, lengths: list[int], rows: int, window: int) -> torch.Tensor:
    """The window cache `full` [B, S, H, D] as a ring of `rows` rows (position p in row p % rows) holding
    each sequence's last `window` positions; every other row NaN, so that a read of one shows."""
    ring = torch.full((full.shape[0], rows, *full.shape[2:]), float("nan"), dtype=full.dtype)
    for b, n in enumerate(lengths):
        p = torch.arange(max(0, n - window), n)
        ring[b, p % rows] = full[b, p]
    return ring


@interpreter_only
@pytest.mark.parametrize("rows", [40, 53], ids=["ring=window", "ring>window"])
def test_window_ring_equals_the_whole_window_cache(rows):
    """Window keys/values of their own (the paper's layout) kept as a ring of the last `rows` positions
    give the output and blocks of the same keys laid out over the whole cache, in the Triton decode (bit
    for bit) and in the reference, and the two agree; ragged lengths, one shorter than the ring."""
    q, kv, gates = _inputs(3, 300, 8, 2, 16, 16, seed=6)
    g = torch.Generator().manual_seed(7)
    k_swa, v_swa = (torch.randn(x.shape, generator=g) for x in kv[:2])
    lengths = [300, 171, 29]
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    params = dict(select_size=16, num_selected=4, window=40, cache_seqlens=seqlens, return_block_indices=True)
    ring = dict(k_swa=_window_ring(k_swa, lengths, rows, 40), v_swa=_window_ring(v_swa, lengths, rows, 40))
    o, idx = decode.nsa_decode(q, *kv, *gates, **ring, **params)
    o_whole, idx_whole = decode.nsa_decode(q, *kv, *gates, k_swa=k_swa, v_swa=v_swa, **params)
    assert torch.equal(o, o_whole) and torch.equal(idx, idx_whole)
    clean = {name: x.nan_to_num(0.0) for name, x in ring.items()}  # the reference gathers whole rows
    o_ref, idx_ref = ref.nsa_decode(q, *kv, *gates, **clean, **params)
    o_ref_whole, _ = ref.nsa_decode(q, *kv, *gates, k_swa=k_swa, v_swa=v_swa, **params)
    assert torch.equal(o_ref, o_ref_whole)
    assert torch.equal(idx, idx_ref)
    assert rel_err(o, o_ref) < TOL


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
def test_gpu_matches_reference_and_graph_replay(T):
    """bf16 at the benchmark shape (batch 16, 64/4 heads, d = 128, ragged lengths) against the float32
    reference decode of two rows; identical outputs over 50 CUDA graph replays (the arrival counter
    must reset itself); prints the times."""
    import triton

    q, kv, gates, seqlens = _gpu_inputs(T)
    B = q.shape[0]
    fn = lambda: decode.nsa_decode(q, *kv, *gates, cache_seqlens=seqlens)  # noqa: E731
    o = fn()
    rows = [0, B - 1]
    o_ref = ref.nsa_decode(q[rows], *[x[rows] for x in kv], *[g[rows] for g in gates],
                           cache_seqlens=seqlens[rows])
    assert rel_err(o[rows], o_ref) < 2e-2
    graph, o_g = _graph(fn)
    print(f"\ndecode T={T} B={B}: {triton.testing.do_bench(fn) * 1e3:.1f} us plain, "
          f"{triton.testing.do_bench(graph.replay) * 1e3:.1f} us CUDA graph")
    first = None
    for _ in range(50):
        graph.replay()
        torch.cuda.synchronize()
        first = o_g.clone() if first is None else first
        assert torch.equal(o_g, first)  # a missed or stale partial would change some rows
    assert torch.equal(first, o)


@pytest.mark.gpu
def test_gpu_int64_cache_seqlens():
    """int64 cache lengths give the int32 ones' output and blocks at 8k (where the kernels read them)."""
    q, kv, gates, seqlens = _gpu_inputs(8192)
    o, idx = decode.nsa_decode(q, *kv, *gates, cache_seqlens=seqlens, return_block_indices=True)
    o64, idx64 = decode.nsa_decode(q, *kv, *gates, cache_seqlens=seqlens.long(), return_block_indices=True)
    assert torch.equal(idx64, idx) and torch.equal(o64, o)
