"""Triton sliding-window attention: query `t` attends to keys `t - window + 1 .. t`.
FlashAttention-2 restricted to the window band; dk/dv per KV head, looping over its query heads.
"""

from __future__ import annotations

import torch

from nsa_eval.kernels._triton_utils import contiguous, default_scale
from nsa_eval.kernels.band import band_backward, band_forward


class SlidingWindowAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, window, scale):
        q, k, v = contiguous(q, k, v)
        o, lse = band_forward(q, k, v, scale=scale, key_stride=1, key_offset=0, window=window)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.params = (window, scale)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        window, scale = ctx.params
        dq, dk, dv = band_backward(q, k, v, o, lse, do, scale=scale, key_stride=1, key_offset=0,
                                   window=window)
        return dq, dk, dv, None, None


def sliding_window_attention(q, k, v, *, window=512, scale=None):
    """Causal attention over the last `window` keys.

    Args:
        q: queries `[B, T, Hq, Dk]`; k: keys `[B, T, Hkv, Dk]`; v: values `[B, T, Hkv, Dv]`.
        window: keys `t - window + 1 .. t` are visible to query `t`.
        scale: softmax scale, default `Dk ** -0.5`.

    Returns:
        o `[B, T, Hq, Dv]`.
    """
    scale = default_scale(scale, q.shape[-1])
    return SlidingWindowAttentionFunction.apply(q, k, v, window, scale)
