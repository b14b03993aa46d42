"""The Triton importance kernel (`importance.block_importance`, Eq. 8-10) against the reference's rule
on the CPU through Triton's interpreter: every geometry the kernel takes, from fla's (each compressed
block inside its selection block) to compressed blocks that reach 16 selection blocks ahead; the
chunks every row sees whole (no visibility mask) and the lane-ordered map of the paper's sizes; and
the launch it takes per group size and dtype."""

import pytest
import torch

from nsa_eval.kernels import importance
from nsa_eval.kernels import reference as ref
from nsa_eval.kernels._triton_utils import interpreting
from nsa_eval.kernels.topk import topk_blocks
from tests.kernels.test_triton_kernels import assert_same_selection

interpreted = pytest.mark.skipif(not interpreting(),
                                 reason="interpreter tests (TRITON_INTERPRET=1, CPU tensors)")

GEOMETRIES = {  # (block_len, stride, select_size): K, the farthest selection block ahead reached
    "paper": (32, 16, 64),  # K = 1, 4 compressed blocks a selection block (the lane-ordered map)
    "fla": (64, 64, 64),  # K = 0
    "l64-d16-s32": (64, 16, 32),  # K = 2
    "l96-d16-s32": (96, 16, 32),  # K = 3
    "l272-d16-s16": (272, 16, 16),  # K = 16, the most the kernel takes: a whole chunk ahead
}
GROUPS = {"G1": (2, 2), "G3": (3, 1), "G4": (4, 1), "G16": (16, 1)}  # (Hq, Hkv)


def shifts(block_len, stride, select_size):
    """K by brute force: the largest k with a token of some compressed block in selection block k."""
    ratio = select_size // stride
    return max((r * stride + block_len - 1) // select_size for r in range(ratio))


def inputs(T, hq, hkv, geometry, seed, d=16):
    """q [1, T, Hq, d], k_cmp [1, Tc, Hkv, d] and the compression's lse [1, T, Hq] (reference)."""
    block_len, stride, _ = geometry
    g = torch.Generator().manual_seed(seed)
    tc = (T - block_len) // stride + 1
    q = torch.randn(1, T, hq, d, generator=g)
    k_cmp = torch.randn(1, tc, hkv, d, generator=g)
    lse = ref.compressed_attention(q, k_cmp, torch.zeros(1, tc, hkv, 1), block_len=block_len,
                                   stride=stride)[1].contiguous()
    return q, k_cmp, lse


def reference_importances(q, k_cmp, block_len, stride, select_size):
    """[B * T * Hkv, Ns] (rows (b, t, h)): the compression's probabilities summed over each group's
    heads, mapped onto selection blocks by shared tokens / stride (the reference's rule)."""
    B, T = q.shape[:2]
    p = ref._compressed_chunk(q.float(), torch.arange(T).expand(B, -1), k_cmp.float(), k_cmp.float()[..., :1],
                              block_len, stride, q.shape[-1] ** -0.5)[2]  # [B, T, Hkv, G, Tc]
    ns = -(-T // select_size)
    w = ref._overlap_weights(k_cmp.shape[1], ns, block_len, stride, select_size, "cpu")  # [Tc, Ns]
    return (p.sum(3) @ w).reshape(-1, ns)


def own_blocks(T, hkv, select_size):
    """[T * Hkv, Ns] bool: the blocks up to each row's own, the entries the kernel writes."""
    ns = -(-T // select_size)
    return (torch.arange(ns)[None, :] <= (torch.arange(T) // select_size)[:, None]).repeat_interleave(hkv, 0)


def kernel_importances(q, k_cmp, lse, geometry):
    block_len, stride, select_size = geometry
    return importance.block_importance(q, k_cmp, lse, block_len=block_len, stride=stride,
                                      select_size=select_size, scale=q.shape[-1] ** -0.5)


# Every group at the paper's geometry and every geometry at some group, each group and K once more
# (not the whole cross product: interpreter time).
PAIRS = [("paper", "G1"), ("paper", "G3"), ("paper", "G4"), ("paper", "G16"), ("fla", "G1"), ("fla", "G4"),
         ("l64-d16-s32", "G3"), ("l96-d16-s32", "G16"), ("l272-d16-s16", "G1")]


@interpreted
@pytest.mark.parametrize("geometry,group", PAIRS)
def test_importances_match_reference(geometry, group):
    """Importances equal to the rule's up to float32 rounding, and the blocks chosen from them equal
    to the reference's selection up to ties."""
    block_len, stride, select_size = GEOMETRIES[geometry]
    (hq, hkv), T = GROUPS[group], 400
    q, k_cmp, lse = inputs(T, hq, hkv, GEOMETRIES[geometry], seed=7)
    imp = kernel_importances(q, k_cmp, lse, GEOMETRIES[geometry])
    own = own_blocks(T, hkv, select_size)
    want = reference_importances(q, k_cmp, block_len, stride, select_size)
    torch.testing.assert_close(imp[own], want[own], rtol=1e-5, atol=1e-6)

    params = dict(num_selected=2, num_init=0, num_local=1)  # blocks 0 .. own - 1 compete for one slot
    idx = topk_blocks(imp.masked_fill(~own, 0.0), T=T, num_kv_heads=hkv, select_size=select_size,
                      **params).view(1, T, hkv, -1)
    idx_ref = ref.select_blocks(q, k_cmp, block_len=block_len, stride=stride, select_size=select_size,
                                **params)
    assert_same_selection(idx, idx_ref, q, k_cmp, dict(block_len=block_len, stride=stride,
                                                       select_size=select_size))


@interpreted
@pytest.mark.parametrize("geometry,group", [("paper", "G3"), ("paper", "G16"), ("fla", "G1")])
def test_unmasked_chunks_match_reference(geometry, group):
    """T long enough that programs see whole chunks without the visibility mask (64 compressed blocks
    a chunk at the paper's sizes), through the lane-ordered map there; G = 3 has padding heads
    (G' = 4), which the unmasked chunks drop through lse = +inf."""
    block_len, stride, select_size = GEOMETRIES[geometry]
    hq, hkv = GROUPS[group]
    T = 1300 if geometry == "paper" else 1100
    q, k_cmp, lse = inputs(T, hq, hkv, GEOMETRIES[geometry], seed=11)
    own = own_blocks(T, hkv, select_size)
    imp = kernel_importances(q, k_cmp, lse, GEOMETRIES[geometry])[own]
    torch.testing.assert_close(imp, reference_importances(q, k_cmp, block_len, stride, select_size)[own],
                               rtol=1e-5, atol=1e-6)
    assert imp.abs().sum() > 0


@interpreted
@pytest.mark.parametrize("geometry,group", [("paper", "G4"), ("fla", "G3")])
def test_selection_in_chunks_of_queries_is_the_same(geometry, group):
    """select_blocks with room for the importances of 16 queries at a time (18 chunks a sequence, the last
    a partial one, over 2 sequences) chooses the blocks it chooses in one pass, to the index; and the
    importances of a chunk starting at 192 are the rows 192.. of the whole pass's, bit for bit."""
    block_len, stride, select_size = GEOMETRIES[geometry]
    hq, hkv = GROUPS[group]
    T = 280
    parts = [inputs(T, hq, hkv, GEOMETRIES[geometry], seed=s) for s in (3, 4)]
    q, k_cmp, lse = (torch.cat(x) for x in zip(*parts, strict=True))  # 2 sequences
    params = dict(block_len=block_len, stride=stride, select_size=select_size, num_selected=3, num_init=1,
                  num_local=1)
    whole = importance.select_blocks(q, k_cmp, lse=lse, **params)
    chunked = importance.select_blocks(q, k_cmp, lse=lse, **params, chunk_bytes=1)
    assert torch.equal(chunked, whole)
    ns = -(-T // select_size)
    imp = kernel_importances(q[:1], k_cmp[:1], lse[:1], GEOMETRIES[geometry]).view(T, hkv, ns)
    part = importance.block_importance(q[:1, 192:256], k_cmp[:1], lse[:1, 192:256], block_len=block_len,
                                       stride=stride, select_size=select_size, scale=q.shape[-1] ** -0.5,
                                       first=192, num_blocks=ns).view(64, hkv, ns)
    own = own_blocks(T, hkv, select_size).view(T, hkv, ns)[192:256]
    assert torch.equal(part[own], imp[192:256][own])


def test_shift_count():
    """block_importance's closed form of K against brute force, over strides, ratios and lengths up to
    the largest the kernel takes (block_len - stride <= 16 * select_size, so K <= 16)."""
    for stride in (8, 16, 64):
        for ratio in (1, 2, 4, 8):
            select_size = stride * ratio
            for block_len in range(stride, stride + 16 * select_size + 1, stride):
                k = (select_size - stride + block_len - 1) // select_size  # as in block_importance
                assert k == shifts(block_len, stride, select_size) <= importance.CHUNK_BLOCKS
    assert {name: shifts(*g) for name, g in GEOMETRIES.items()} == {
        "paper": 1, "fla": 0, "l64-d16-s32": 2, "l96-d16-s32": 3, "l272-d16-s16": 16}


def test_launch_by_group():
    """`LAUNCH_BY_GROUP` sets the warps and stages where it was measured (G' = 4, 16-bit q/k dims up
    to 128) and nowhere else: not at G' = 16, not for float32 or the paper's 192; wide rows and small
    groups hold at most 128 rows."""
    launch, default = importance.importance_launch, importance.IMPORTANCE_LAUNCH
    assert launch(4, torch.bfloat16, 128) == dict(rows=128, num_warps=4, num_stages=2)
    assert launch(16, torch.bfloat16, 128) == default
    for dtype, dk in ((torch.float32, 128), (torch.bfloat16, 192), (torch.bfloat16, 256)):
        assert launch(4, dtype, dk)["num_warps"] == default["num_warps"]
        assert launch(4, dtype, dk)["rows"] == 128
    assert launch(16, torch.float32, 128) == dict(default, rows=128, num_stages=2)
