"""The selected forward per key block (`selected_by_block`, the default for groups of up to
`selection.SELECTED_BY_BLOCK_MAX_GROUP` heads on long inputs): against the PyTorch reference and the
walk on the CPU through Triton's interpreter (lists with padding, repeats, future blocks and rows with nothing
usable; G = 1, 3, 4, 16), the inverted index's entries, and (`-m gpu`) against the walk in bf16 at
64k."""

import pytest
import torch

from nsa_eval.kernels import selected_by_block, selection
from nsa_eval.kernels._triton_utils import interpreting
from tests.kernels.test_selection_variants import (
    BY_BLOCK,
    WALK,
    assert_matches_reference,
    lists_with_edge_cases,
    reference_lse,
)
from tests.kernels.test_triton_kernels import IDS, SHAPES, TOL, make, rel_err

interpreted = pytest.mark.skipif(not interpreting(),
                                 reason="interpreter tests (TRITON_INTERPRET=1, CPU tensors)")


def use_by_block(monkeypatch, on=True):
    """The forward per key block at every group size and length (on), or the walk (off)."""
    for flag, value in (BY_BLOCK if on else WALK).items():
        monkeypatch.setattr(selection, flag, value)


@pytest.fixture
def by_block(monkeypatch):
    use_by_block(monkeypatch)


def forward(x, idx, **kw):
    return selection.selected_forward(x["q"].detach(), x["k"].detach(), x["v"].detach(), idx, select_size=16,
                                      scale=x["q"].shape[-1] ** -0.5, **kw)


@interpreted
@pytest.mark.usefixtures("by_block")
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_by_block_matches_reference(shape):
    """Output, lse (-inf and a zero output where no token is usable) and, through the unchanged
    backward, the gradients of q, k and v."""
    B, T, hq, hkv, dk, dv = shape
    x = make(*shape, seed=51)
    idx = lists_with_edge_cases(B, T, hkv, 5, 16, seed=52)
    o, lse = forward(x, idx)
    lse_ref = reference_lse(x["q"].detach(), x["k"].detach(), idx, 16)
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
    assert (o[:, 3] == 0).all() and (o[:, 5] == 0).all()
    fin = torch.isfinite(lse_ref)
    assert rel_err(lse[fin], lse_ref[fin]) < TOL
    assert_matches_reference(x["q"], x["k"], x["v"], idx)


@interpreted
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[2]], ids=[IDS[1], IDS[2]])
def test_by_block_equals_walk_and_presorted_lists(monkeypatch, shape):
    """The same o and lse as the walk; lists sorted ascending with their padding last (as
    `select_blocks` writes them) give the same result with `presorted=True`, which skips the sort."""
    B, T, hq, hkv, dk, dv = shape
    x = make(*shape, seed=53)
    idx = lists_with_edge_cases(B, T, hkv, 6, 16, seed=54)
    use_by_block(monkeypatch, False)
    o_walk, lse_walk = forward(x, idx)
    use_by_block(monkeypatch)
    o, lse = forward(x, idx)
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_walk))
    assert torch.allclose(o, o_walk, atol=1e-5) and torch.allclose(lse, lse_walk, atol=1e-5)
    ns = -(-T // 16)
    ordered = torch.where(idx < 0, ns, idx).sort(-1).values
    presorted = torch.where(ordered == ns, -1, ordered).contiguous()
    o2, lse2 = forward(x, presorted, presorted=True)
    assert torch.allclose(o2, o, atol=1e-6) and torch.equal(torch.isinf(lse2), torch.isinf(lse))


def test_inverted_index_entries_point_into_the_lists():
    """`entries=True`: each sorted entry's flat index into the (sorted) lists holds the block of its
    segment at its position, and the positions are the ones `pos` gives."""
    B, T, hkv, n, size = 2, 150, 2, 5, 16
    idx = lists_with_edge_cases(B, T, hkv, n, size, seed=55)
    ns = -(-T // size)
    pos, seg_start, _, _, entry = selected_by_block.inverted_index(idx, select_size=size, chunk=8,
                                                                   entries=True)
    srt = idx.sort(-1).values.flatten()
    seg_of = torch.repeat_interleave(torch.arange(B * hkv * ns), (seg_start[1:] - seg_start[:-1]).long())
    used = int(seg_start[-1])  # entries past the last segment are the dropped ones
    entry = entry.long()[:used]
    assert torch.equal(srt[entry].long(), seg_of % ns)  # the segment's block
    assert torch.equal(entry // (hkv * n) % T, pos[:used].long())
    assert torch.equal(entry // (T * hkv * n) * hkv + entry // n % hkv, seg_of // ns)  # its (b, kv head)


@interpreted
@pytest.mark.parametrize(("size", "block", "spread"),
                         [(16, 1024, 8), (64, 1024, 8), (16, 64, 8), (16, 64, 1)],
                         ids=["size16", "size64", "block64", "spread1"])
def test_block_entries_hold_the_inverted_index(monkeypatch, size, block, spread):
    """The counting index (`block_entries`; `block` entries a program, `spread` counters a segment)
    against the sorted one (`inverted_index`) on lists with padding, repeats and future blocks: the same
    segment bounds, the same entries within each segment (in any order), and the same work items, each
    (segment, chunk) once, below `n_items`."""
    monkeypatch.setattr(selected_by_block, "INDEX_BLOCK", block)
    monkeypatch.setattr(selected_by_block, "INDEX_SPREAD", spread)
    B, T, hkv, n = 2, 150, 2, 5
    idx = lists_with_edge_cases(B, T, hkv, n, size, seed=56)
    ns = -(-T // size)
    ordered = torch.where(idx < 0, ns, idx).sort(-1).values
    lists = torch.where(ordered == ns, -1, ordered).contiguous()
    entry, seg_start, item_seg, item_chunk, n_items = selected_by_block.block_entries(lists, select_size=size,
                                                                                     chunk=8)
    _, want_start, want_seg, want_chunk, want_entry = selected_by_block.inverted_index(
        lists, select_size=size, chunk=8, presorted=True, entries=True)
    assert torch.equal(seg_start, want_start)
    for s in range(B * hkv * ns):
        lo, hi = int(seg_start[s]), int(seg_start[s + 1])
        assert torch.equal(entry[lo:hi].sort().values, want_entry[lo:hi].sort().values)
    used = int(n_items)
    items = sorted(zip(item_seg[:used].tolist(), item_chunk[:used].tolist(), strict=True))
    nseg = B * hkv * ns
    want = sorted((s, c) for s, c in zip(want_seg.tolist(), want_chunk.tolist(), strict=True) if s < nseg)
    assert items == want and len(set(items)) == len(items)


@interpreted
@pytest.mark.usefixtures("by_block")
def test_by_block_same_output_with_either_index(monkeypatch):
    """The forward per block gives bit-identical o and lse with the counting index and the sorted one:
    each row's result does not depend on which positions share its work item."""
    B, T, hq, hkv, dk, dv = SHAPES[1]
    x = make(*SHAPES[1], seed=57)
    idx = lists_with_edge_cases(B, T, hkv, 6, 16, seed=58)
    assert_indexes_agree(monkeypatch, lambda: forward(x, idx))


def assert_indexes_agree(monkeypatch, run):
    """run() (o, lse) with the counting index and with the sorted one: bit-identical."""
    results = []
    for index in ("count", "sort"):
        monkeypatch.setattr(selected_by_block, "BY_BLOCK_INDEX", index)
        results.append(run())
    (o_count, lse_count), (o_sort, lse_sort) = results
    assert torch.equal(o_count, o_sort) and torch.equal(lse_count, lse_sort)


def benchmark_selection():
    """The benchmark's inputs at T = 65536, 16/4 heads, d = 128 (bf16), and their block lists; skips
    without a CUDA GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from nsa_eval.bench.kernels import _inputs
    from nsa_eval.kernels.compression import compressed_attention
    from nsa_eval.kernels.importance import select_blocks

    x = _inputs(1, 65536, 16, 4, 128, grad=False)
    with torch.no_grad():
        _, lse_cmp = compressed_attention(x["q"], x["k_cmp"], x["v_cmp"])
        return x, select_blocks(x["q"], x["k_cmp"], lse=lse_cmp)


def forward_64k(x, idx):
    with torch.no_grad():
        return selection.selected_forward(x["q"], x["k"], x["v"], idx, select_size=64, scale=128**-0.5,
                                          presorted=True)


@pytest.mark.gpu
@pytest.mark.parametrize("partials", ["float32", "input"])
def test_by_block_matches_walk_at_64k(monkeypatch, partials):
    """bf16 at T = 65536, 16/4 heads, d = 128, the selection of the benchmark's inputs: the forward
    per block (bf16 partials, the default, or float32) against the walk."""
    x, idx = benchmark_selection()
    use_by_block(monkeypatch, False)
    o_walk, lse_walk = forward_64k(x, idx)
    use_by_block(monkeypatch)
    monkeypatch.setattr(selected_by_block, "BY_BLOCK_PARTIALS", partials)
    o, lse = forward_64k(x, idx)
    assert rel_err(o, o_walk) < 1e-2
    assert (lse - lse_walk).abs().max().item() < 1e-4


@interpreted
@pytest.mark.usefixtures("by_block")
@pytest.mark.parametrize(("flag", "value"), [("BY_BLOCK_PARTIALS", "float16"), ("BY_BLOCK_INDEX", "radix")])
def test_unknown_knob_values_are_rejected(monkeypatch, flag, value):
    monkeypatch.setattr(selected_by_block, flag, value)
    x = make(1, 32, 2, 1, 16, 16)
    with pytest.raises(ValueError, match=flag):
        forward(x, torch.zeros(1, 32, 1, 2, dtype=torch.int32))


@pytest.mark.gpu
def test_by_block_indexes_agree_at_64k(monkeypatch):
    """bf16 at T = 65536, 16/4 heads, the benchmark's selection: the counting index (atomic ranks, any
    order within a block) and the sorted one give bit-identical o and lse."""
    x, idx = benchmark_selection()
    use_by_block(monkeypatch)
    assert_indexes_agree(monkeypatch, lambda: forward_64k(x, idx))
