"""Float32 `q . k` of one decode query per head against every key of a half-precision cache, without a
float32 copy of the keys: the scores a decode step ranks keys by (`Chunk.logits` of a one-query chunk on a
GPU, so the eager and the static decode step read the same scores and select the same keys).

PyTorch has no half-precision matmul that returns float32, so the reference upcasts: `key.float()` of the
whole cache (a copy twice its size, written and read again) and a float32 GEMM over it. The kernel reads
each key once per KV head (one tile of keys against the G query heads that read them), multiplies in
float32 (the product of two bf16 or fp16 values is exact there) and sums over the head dim; it writes only
the scores.

Shapes: q `[B, Hq, 1, D]`, k `[B, Hkv, W, D]` (any strides but a unit one in D: a static cache's first W
slots), `Hq = G * Hkv`, query head h reads KV head `h // G`; scores `[B, Hq, 1, W]` float32, scaled.
`decode_scores_reference` is the PyTorch version.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from nsa_eval.kernels import _validate
from nsa_eval.kernels._triton_utils import cdiv, launcher, pow2

# keys a program scores, and its warps (not yet measured on a GPU: a program reads KEYS x D keys once)
KEYS = 128
WARPS = 4


def decode_scores_reference(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """`decode_scores` in PyTorch (`Chunk.logits` off the GPU): q `[B, Hq, 1, D]`, k `[B, Hkv, W, D]` ->
    `[B, Hq, 1, W]` float32."""
    B, Hq, _, D = q.shape
    Hkv, W = k.shape[1], k.shape[2]
    qg = q.float().reshape(B, Hkv, Hq // Hkv, D)  # [B, Hkv, G, D]: k not repeated per group
    return (qg @ k.float().transpose(-1, -2)).view(B, Hq, 1, W) * scale


# W not specialised (Triton's W % 16): a width no earlier step had must not compile inside a graph capture
@triton.jit(do_not_specialize=["W"])
def _scores_kernel(
    Q, K, OUT,
    sq_b, sq_h, sk_b, sk_h, sk_w,
    W, HKV, scale,
    G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BW: tl.constexpr,
):
    # Grid (cdiv(W, BW), B * Hkv): keys w0 .. w0 + BW of one KV head against its G query heads, each
    # score a float32 sum over D of float32 products. OUT is contiguous [B, Hq, W] float32.
    i_w = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = (i_bh // HKV).to(tl.int64)
    i_kh = (i_bh % HKV).to(tl.int64)
    o_w = i_w * BW + tl.arange(0, BW)
    o_d = tl.arange(0, BD)
    m_w = o_w < W
    m_d = o_d < D
    p_k = K + i_b * sk_b + i_kh * sk_h + o_w[:, None].to(tl.int64) * sk_w + o_d[None, :]
    # [BW, BD]
    b_k = tl.load(p_k, mask=m_w[:, None] & m_d[None, :], other=0.0).to(tl.float32)
    for g in tl.static_range(G):
        i_h = i_kh * G + g
        # [BD]
        b_q = tl.load(Q + i_b * sq_b + i_h * sq_h + o_d, mask=m_d, other=0.0).to(tl.float32)
        # [BW]
        b_s = tl.sum(b_k * b_q[None, :], axis=1) * scale
        tl.store(OUT + (i_b * HKV * G + i_h) * W + o_w, b_s, mask=m_w)


def decode_scores(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """Scaled float32 `q . k` of one query per head: q `[B, Hq, 1, D]`, k `[B, Hkv, W, D]` (bf16 or fp16;
    any device Triton runs on: CUDA, or CPU tensors under Triton's interpreter) -> `[B, Hq, 1, W]`."""
    B, Hq, T, D = q.shape
    Hkv, W = k.shape[1], k.shape[2]
    if T != 1 or Hq % Hkv or k.shape[-1] != D:
        raise ValueError(f"decode_scores takes q [B, Hq, 1, D] and k [B, Hkv, W, D] (Hkv dividing Hq), got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    _validate.check_installed_triton()
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    out = torch.empty(B, Hq, W, dtype=torch.float32, device=q.device)
    launcher(_scores_kernel)[(cdiv(W, KEYS), B * Hkv)](
        q, k, out, q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), W, Hkv, scale,
        G=Hq // Hkv, D=D, BD=pow2(D), BW=KEYS, num_warps=WARPS,
    )
    return out.view(B, Hq, 1, W)
