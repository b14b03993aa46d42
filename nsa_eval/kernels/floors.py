"""Memory floors for the kernel benchmark: Triton kernels that make an NSA kernel's loads without its
math, so that a benchmark can say how far a kernel is from its memory bound.

- `gather_blocks_sum`: the loads of the selected-attention forward. For each (batch, position, KV
  head) it reads the keys and values of every usable listed block (index >= 0, starting at or before
  the position), like the forward at one position per program (the G = 16 default), and returns their
  sum. With G = 16 every block read by the forward feeds 16 query heads, so if this takes as long as
  the forward, the forward is bound by these reads (from L2: one KV head's keys and values fit there).
  Since the forward copies its blocks with TMA (`selection.SELECTED_TMA`, run 66) it takes less than
  this kernel (13.4 against 14.3 ms at 64k, run 71): the time is then that of the same reads by
  per-thread loads, no longer a floor.
- `stream_sum`: reads a tensor once, to measure the bandwidth of memory (HBM) on the device.

Each has a PyTorch reference beside it (`gather_blocks_sum_reference`, `stream_sum_reference`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa_eval.kernels._triton_utils import (
    cdiv,
    interpreting,
    kv_sources,
    launcher,
    load_kv,
    pow2,
    tma_descriptor,
    tma_load_pair,
    tma_ok,
)


@triton.jit
def _gather_blocks_sum_kernel(
    K, V, BI, OUT, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, T, HKV, NSEL,
    DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, BS: tl.constexpr,
    NP: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr,
):
    # TMA: K and V are tensor descriptors with blocks [1, BS, 1, BDK / BDV], as the forward's
    t = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = (i_bh // HKV).to(tl.int64)
    i_hk = i_bh % HKV
    row = (i_b * T + t) * HKV + i_hk
    o_s = tl.arange(0, NP)
    idx = tl.load(BI + row * NSEL + o_s, mask=o_s < NSEL, other=-1)  # [NP]
    usable = (idx >= 0) & (idx <= t // BS)
    slot = tl.where(usable, tl.cumsum(usable.to(tl.int32), 0) - 1, -1)  # walk order, as the forward
    k_base, v_base = kv_sources(K, V, i_b, i_hk, sk_b, sk_h, sv_b, sv_h, TMA)
    o_n = tl.arange(0, BS)
    o_dk = tl.arange(0, BDK)
    o_dv = tl.arange(0, BDV)
    acc_k = tl.zeros([BS, BDK], tl.float32)  # elementwise sums: no reduction inside the loop
    acc_v = tl.zeros([BS, BDV], tl.float32)
    for i in range(0, tl.sum(usable.to(tl.int32), 0)):
        blk = tl.sum(tl.where(slot == i, idx, 0), 0)
        if TMA:
            k, v = tma_load_pair(k_base, v_base, i_b, blk * BS, i_hk, BS, BDK, BDV)
        else:
            o_k = blk * BS + o_n
            k, v = load_kv(k_base, v_base, o_k, o_k < T, sk_t, sv_t, o_dk, o_dv, DK, DV, UPCAST)
        acc_k += k.to(tl.float32)
        acc_v += v.to(tl.float32)
    tl.store(OUT + row, tl.sum(tl.sum(acc_k, 1), 0) + tl.sum(tl.sum(acc_v, 1), 0))


def gather_blocks_sum(k, v, block_indices, *, select_size=64, num_stages=2, tma=False):
    """Sum of the keys and values that the selected-attention forward reads.

    Args:
        k: `[B, T, Hkv, Dk]`, v: `[B, T, Hkv, Dv]` (any float dtype, last dim contiguous).
        block_indices: int32 `[B, T, Hkv, n]` as from `select_blocks` (no repeats within a list).
        select_size: tokens per selection block.
        tma: read each block with one TMA copy (where `tma_ok`) instead of per-thread loads. Run 71
            at 64k: 20.2 ms with TMA against 14.3 with the loads, while the forward with TMA copies
            takes 13.4; so the loads (the default) give the lower time, and neither bounds the
            forward from below any more.

    Returns:
        float32 `[B, T, Hkv]`: for each position, the sum of every element of `k` and `v` over the
        tokens of its usable blocks (index >= 0 and `index * select_size <= t`).
    """
    B, T, HKV, DK = k.shape
    DV = v.shape[3]
    nsel = block_indices.shape[-1]
    bi = block_indices.contiguous()
    out = torch.empty(B, T, HKV, device=k.device, dtype=torch.float32)
    tma = tma and tma_ok(k, v)
    kv = (k, v)
    if tma:
        kv = tma_descriptor(k, select_size, pow2(DK)), tma_descriptor(v, select_size, pow2(DV))
    launcher(_gather_blocks_sum_kernel)[(T, B * HKV)](
        *kv, bi, out, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        T, HKV, nsel, DK=DK, DV=DV, BDK=pow2(DK), BDV=pow2(DV), BS=select_size, NP=pow2(nsel, 1),
        UPCAST=interpreting(), TMA=tma, num_warps=4, num_stages=num_stages,
    )
    return out


def gather_blocks_sum_reference(k, v, block_indices, *, select_size=64):
    """PyTorch version of `gather_blocks_sum` (same arguments and result)."""
    B, T, HKV, _ = k.shape
    n_blocks = -(-T // select_size)
    t = torch.arange(T, device=k.device)
    # per (block, KV head): sum of its keys and values
    kv = k.float().sum(-1) + v.float().sum(-1)  # [B, T, Hkv]
    pad = n_blocks * select_size - T
    kv = torch.nn.functional.pad(kv, (0, 0, 0, pad)).view(B, n_blocks, select_size, HKV).sum(2)  # [B,Ns,Hkv]
    idx = block_indices.long()
    usable = (idx >= 0) & (idx <= (t // select_size)[None, :, None, None])  # [B, T, Hkv, n]
    per_block = kv.transpose(1, 2)  # [B, Hkv, Ns]
    gathered = torch.gather(per_block[:, None].expand(B, T, HKV, n_blocks), 3, idx.clamp(min=0))
    return torch.where(usable, gathered, 0.0).sum(-1)  # [B, T, Hkv]


@triton.jit
def _stream_sum_kernel(X, OUT, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < N, other=0.0, eviction_policy="evict_first")
    tl.store(OUT + tl.program_id(0), tl.sum(x.to(tl.float32), 0))


def stream_sum(x, *, block=8192):
    """Read `x` (any shape, contiguous) once: float32 `[ceil(numel / block)]`, the sums of its
    consecutive chunks of `block` elements."""
    flat = x.contiguous().view(-1)
    n = flat.numel()
    out = torch.empty(cdiv(n, block), device=x.device, dtype=torch.float32)
    launcher(_stream_sum_kernel)[(out.numel(),)](flat, out, n, BLOCK=block, num_warps=8)
    return out


def stream_sum_reference(x, *, block=8192):
    """PyTorch version of `stream_sum`."""
    flat = x.contiguous().view(-1).float()
    pad = (-flat.numel()) % block
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, block).sum(1)
