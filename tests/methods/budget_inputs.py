"""Inputs, markers and measures shared by the Triton prefill tests (test_fast_prefill.py,
test_quest_fast.py, test_h2o_fast.py); the interpreter itself is switched on by conftest.py."""

from __future__ import annotations

import os

import pytest
import torch

from tests.methods.conftest import prefill_by

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
interpreter_only = pytest.mark.skipif(not INTERPRET,
                                      reason="interpreter tests (TRITON_INTERPRET=1, CPU tensors)")


def qkv(B, Hq, Hkv, T, S, D, dtype, seed=0):
    """Random q `[B, Hq, T, D]`, k and v `[B, Hkv, S, D]` (q and k scaled up for sharper scores)."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, Hq, T, D, generator=g) * 2).to(dtype)
    k = (torch.randn(B, Hkv, S, D, generator=g) * 2).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    return q, k, v


def cuda_ms(fn, n: int = 3) -> float:
    """Mean GPU milliseconds of `fn()` over `n` calls after one warm-up call (CUDA events)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS error of `a` against `b` (float64)."""
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def fast_and_chunked(fast_ctrl, chunked_ctrl, module, q, k, v):
    """One layer call through the fast prefill (`fast_ctrl`: CUDA, unpadded) and through the chunked path
    (`chunked_ctrl`, its method's fast prefill turned off), held to the same budget: asserts the
    same queries and keys attended (sum and max: exactly the budget), KV tokens read within 1e-4 (near
    ties round either way between the kernel's products and PyTorch's) and outputs within 1% relative
    RMS. Returns both tallies' counts."""
    fast = fast_ctrl.attend(module, q, k, v, None, None)
    fast_counts = fast_ctrl.stats.tally(0, "prefill", True).counts()
    prefill_by(chunked_ctrl.method, kernels=False)
    out = chunked_ctrl.attend(module, q, k, v, None, None)
    counts = chunked_ctrl.stats.tally(0, "prefill", True).counts()
    assert fast_counts[:3] == counts[:3]
    assert abs(fast_counts[4] - counts[4]) <= 1e-4 * counts[4]
    err = rel_rms(fast, out)
    assert err < 1e-2, err
    return fast_counts, counts


def peak_bytes(fn) -> int:
    """The most GPU memory allocated while `fn()` runs (what was allocated before it included)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def against_full_attention(label: str, fn, q, k, v, n: int = 3) -> tuple[float, float]:
    """Times `fn()` (one layer's prefill over q `[B, Hq, T, D]`, k, v `[B, Hkv, T, D]`) and SDPA's causal
    attention on the same tensors in the same run, and their peak memory (inputs included); prints one
    line and returns (time ratio, peak ratio) to full attention."""
    import torch.nn.functional as F

    def full():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    full_ms, ms = cuda_ms(full, n), cuda_ms(fn, n)
    full_peak, peak = peak_bytes(full), peak_bytes(fn)
    print(f"{label} T={q.shape[2]}: {ms:.2f} ms, full attention {full_ms:.2f} ms ({ms / full_ms:.2f}x); peak "
          f"{peak / 2**20:.0f} MiB, full {full_peak / 2**20:.0f} MiB ({peak / full_peak:.2f}x)")
    return ms / full_ms, peak / full_peak
