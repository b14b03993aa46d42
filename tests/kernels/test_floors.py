"""The benchmark's memory-floor kernels (`nsa_eval.kernels.floors`) against their PyTorch references,
on the CPU through Triton's interpreter (on a GPU machine: on the GPU)."""

import pytest
import torch

from nsa_eval.kernels import floors
from nsa_eval.kernels import reference as ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("tma", [False, True], ids=["loads", "tma"])
def test_gather_blocks_sum_matches_reference(tma):
    g = torch.Generator().manual_seed(3)
    B, T, hq, hkv, d, dv, select_size = 2, 150, 4, 2, 16, 32, 16
    q = torch.randn(B, T, hq, d, generator=g)
    k = torch.randn(B, T, hkv, d, generator=g)
    v = torch.randn(B, T, hkv, dv, generator=g)
    k_cmp = torch.randn(B, (T - 16) // 8 + 1, hkv, d, generator=g)
    bi = ref.select_blocks(q, k_cmp, block_len=16, stride=8, select_size=select_size, num_selected=4)
    bi[0, 100, 1, 1] = 8  # a listed block after its position (100 // 16 = 6) is not read
    k, v, bi = (x.to(DEVICE) for x in (k, v, bi))
    got = floors.gather_blocks_sum(k, v, bi, select_size=select_size, tma=tma)
    want = floors.gather_blocks_sum_reference(k, v, bi, select_size=select_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3)
    # the reference reads what it should: position 0 of batch 0 sums exactly its first block's tokens
    # that exist (block 0, tokens 0..15)
    first = k[0, :select_size, 0].sum() + v[0, :select_size, 0].sum()
    torch.testing.assert_close(want[0, 0, 0], first.float(), rtol=1e-5, atol=1e-4)


def test_stream_sum_matches_reference():
    x = torch.randn(3, 1000, 7, device=DEVICE).to(torch.bfloat16)
    torch.testing.assert_close(floors.stream_sum(x, block=1024), floors.stream_sum_reference(x, block=1024),
                               rtol=1e-5, atol=1e-3)


@pytest.mark.gpu
def test_gather_blocks_sum_at_scale_on_gpu():
    """bf16, the benchmark's shape at 8k, lists from the Triton select_blocks."""
    from nsa_eval.kernels.importance import select_blocks

    g = torch.Generator(device="cuda").manual_seed(0)
    T, hq, hkv, d = 8192, 64, 4, 128
    r = lambda *s: torch.randn(*s, generator=g, device="cuda").to(torch.bfloat16)  # noqa: E731
    q, k, v, k_cmp = r(1, T, hq, d), r(1, T, hkv, d), r(1, T, hkv, d), r(1, (T - 32) // 16 + 1, hkv, d)
    bi = select_blocks(q, k_cmp)
    want = floors.gather_blocks_sum_reference(k, v, bi)
    for tma in (False, True):
        torch.testing.assert_close(floors.gather_blocks_sum(k, v, bi, tma=tma), want, rtol=1e-4, atol=0.05)
