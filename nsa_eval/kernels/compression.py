"""Triton compressed attention: each query attends to the compressed keys whose whole block lies
at or before it (block `i` covers tokens `[i*stride, i*stride + block_len)`, visible to query `t`
when `i*stride + block_len - 1 <= t`). FlashAttention-2 over the compressed keys; a query that
sees no block gets a zero output and `lse = -inf`. The returned lse is differentiable too.
"""

from __future__ import annotations

import torch

from nsa_eval.kernels._triton_utils import contiguous, default_scale
from nsa_eval.kernels.band import band_backward, band_forward


class CompressedAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k_cmp, v_cmp, block_len, stride, scale):
        q, k_cmp, v_cmp = contiguous(q, k_cmp, v_cmp)
        o, lse = band_forward(q, k_cmp, v_cmp, scale=scale, key_stride=stride, key_offset=block_len - 1)
        ctx.save_for_backward(q, k_cmp, v_cmp, o, lse)
        ctx.params = (block_len, stride, scale)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k_cmp, v_cmp, o, lse = ctx.saved_tensors
        block_len, stride, scale = ctx.params
        if do is None:
            do = torch.zeros_like(o)
        dq, dk, dv = band_backward(q, k_cmp, v_cmp, o, lse, do, dlse, scale=scale, key_stride=stride,
                                   key_offset=block_len - 1, split_heads=True)
        return dq, dk, dv, None, None, None


def compressed_attention(q, k_cmp, v_cmp, *, block_len=32, stride=16, scale=None):
    """Attention over compressed keys.

    Args:
        q: queries `[B, T, Hq, Dk]`.
        k_cmp: compressed keys `[B, Tc, Hkv, Dk]`; block `i` covers tokens `[i*stride, i*stride+block_len)`.
        v_cmp: compressed values `[B, Tc, Hkv, Dv]`.
        scale: softmax scale, default `Dk ** -0.5`.

    Returns:
        o `[B, T, Hq, Dv]` (dtype of q) and lse `[B, T, Hq]` float32 (natural log; -inf where no
        block is visible).
    """
    scale = default_scale(scale, q.shape[-1])
    return CompressedAttentionFunction.apply(q, k_cmp, v_cmp, block_len, stride, scale)
