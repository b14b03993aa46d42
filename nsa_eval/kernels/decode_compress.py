"""The compression part of a decode step in two Triton launches around the compressor's MLP.

When a decode token completes a compressed block (the fused step knows which steps do from the host's
length, `NSACache.completes_block`, and captures a graph for each kind), the block's `l` inputs are read
from the ring of compression inputs, compressed, normed, rotated and written into the compressed cache
(`NSACache.compress_token`, `NSAAttention.compress`): about twenty small launches in torch.
`block_inputs` gathers the block from the ring with the intra-block position embedding added (the MLP's
input) or its mean (`"mean"`), one launch for keys and values; `write_block` applies the optional
RMSNorm of the compressed key and its RoPE and writes both into their row, one launch. The
compressor's two GEMMs stay torch's.

The arithmetic is the model's: every elementwise op rounds to the model's dtype as torch's do (a mean
sums in float32, in another order). The references are beside the kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa_eval.kernels._triton_utils import launcher, pow2, rotated_half, rounded


@triton.jit
def _gather(RING, POS_EMB, OUT, ROWS, i_b, i_h, s_b, s_t, so_b, L: tl.constexpr, BL: tl.constexpr,
            D: tl.constexpr, BD: tl.constexpr, MEAN: tl.constexpr):
    # the block of (i_b, i_h) from the ring [B, l, Hkv, D] in token order (ROWS [l]): OUT [B, Hkv, l * D]
    # with the position embedding [l, D] added, or with MEAN OUT [B, Hkv, D] the block's mean. The l rows
    # load as one tile: a loop over them waits for each row index before its load
    DT: tl.constexpr = RING.dtype.element_ty
    o_j = tl.arange(0, BL)
    m_j = o_j < L
    o_d = tl.arange(0, BD)
    m = m_j[:, None] & (o_d < D)[None, :]
    rows = tl.load(ROWS + o_j, mask=m_j, other=0)  # [BL]
    x = tl.load(RING + i_b * s_b + rows[:, None] * s_t + i_h * D + o_d[None, :], mask=m, other=0.0)
    x = x.to(tl.float32)  # [BL, BD]
    if MEAN:
        tl.store(OUT + i_b * so_b + i_h * D + o_d, rounded(tl.sum(x, 0) / L, DT), mask=o_d < D)
    else:
        emb = tl.load(POS_EMB + o_j[:, None] * D + o_d[None, :], mask=m, other=0.0).to(tl.float32)
        x = rounded(x + emb, DT)
        tl.store(OUT + i_b * so_b + (i_h * L + o_j[:, None]) * D + o_d[None, :], x, mask=m)


@triton.jit
def _block_inputs_kernel(K_RING, V_RING, K_POS, V_POS, K_OUT, V_OUT, ROWS, sk_b, sk_t, sv_b, sv_t, sko_b,
                         svo_b, L: tl.constexpr, BL: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                         BDK: tl.constexpr, BDV: tl.constexpr, MEAN: tl.constexpr):
    # grid (Hkv, B): one KV head's key and value blocks
    i_h = tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64)
    _gather(K_RING, K_POS, K_OUT, ROWS, i_b, i_h, sk_b, sk_t, sko_b, L, BL, DK, BDK, MEAN)
    _gather(V_RING, V_POS, V_OUT, ROWS, i_b, i_h, sv_b, sv_t, svo_b, L, BL, DV, BDV, MEAN)


def block_inputs(k_ring, v_ring, block_rows, k_pos_emb=None, v_pos_emb=None):
    """The compressor's inputs of the block ending at a decode token, from the rings: one launch.

    Args:
        k_ring, v_ring: `[B, l, Hkv, Dk]`, `[B, l, Hkv, Dv]` the ring of compression inputs (`NSACache`),
            rows with a contiguous `[Hkv, D]`.
        block_rows: int64 `[l]` (device) the block's rows in the ring, in token order.
        k_pos_emb, v_pos_emb: `[l, Dk]`, `[l, Dv]` the MLP compressors' position embeddings, or None for
            `"mean"`.

    Returns:
        with the embeddings: `[B, Hkv, l * Dk]`, `[B, Hkv, l * Dv]` each token's input plus its position
        embedding, flattened as `BlockCompressor` feeds fc1; without: `[B, Hkv, Dk]`, `[B, Hkv, Dv]` the
        block's means. In the rings' dtype.
    """
    B, L, HKV, DK = k_ring.shape
    DV = v_ring.shape[3]
    mean = k_pos_emb is None
    k_out = k_ring.new_empty(B, HKV, DK if mean else L * DK)
    v_out = v_ring.new_empty(B, HKV, DV if mean else L * DV)
    for x in (k_ring, v_ring):
        if x.stride(3) != 1 or x.stride(2) != x.shape[3]:
            raise ValueError("block_inputs: the rings need a contiguous [Hkv, D] per row")
    launcher(_block_inputs_kernel)[(HKV, B)](
        k_ring, v_ring, *((k_ring, v_ring) if mean else (k_pos_emb.contiguous(), v_pos_emb.contiguous())),
        k_out, v_out, block_rows, k_ring.stride(0), k_ring.stride(1), v_ring.stride(0), v_ring.stride(1),
        k_out.stride(0), v_out.stride(0), L=L, BL=pow2(L, 1), DK=DK, DV=DV, BDK=pow2(DK), BDV=pow2(DV),
        MEAN=mean, num_warps=2)
    return k_out, v_out


def block_inputs_reference(k_ring, v_ring, block_rows, k_pos_emb=None, v_pos_emb=None):
    """`block_inputs` in PyTorch (`NSACache.compress_token`'s gather, `BlockCompressor`'s first steps)."""
    out = []
    for ring, pos_emb in ((k_ring, k_pos_emb), (v_ring, v_pos_emb)):
        block = ring.index_select(1, block_rows).transpose(1, 2)  # [B, Hkv, l, D]
        out.append(block.mean(2) if pos_emb is None else (block + pos_emb).flatten(2))
    return tuple(out)


@triton.jit
def _write_block_kernel(K, V, K_CMP, V_CMP, ROW, NORM_W, COS, SIN, sk_b, sv_b, skc_b, skc_t, svc_b, svc_t,
                        eps, HKV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr,
                        BDV: tl.constexpr, NORM: tl.constexpr, ROPE: tl.constexpr):
    # grid (Hkv, B): K [B, Hkv, Dk] (normed, rotated) and V [B, Hkv, Dv] into row ROW of K_CMP, V_CMP
    i_h = tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64)
    DT: tl.constexpr = K.dtype.element_ty
    row = tl.load(ROW)
    o_d = tl.arange(0, BDK)
    m_d = o_d < DK
    o_v = tl.arange(0, BDV)
    m_v = o_v < DV
    k_row = K + i_b * sk_b + i_h * DK
    k = tl.load(k_row + o_d, mask=m_d, other=0.0).to(tl.float32)  # [BDK]
    HALF: tl.constexpr = DK // 2
    o_r = tl.where(o_d < HALF, o_d + HALF, o_d - HALF)  # k's halves swapped
    k_rot = tl.load(k_row + o_r, mask=m_d, other=0.0).to(tl.float32)
    if NORM:  # modeling_nsa.RMSNorm over Dk, the same elementwise ops on k and on its rotated copy
        r = tl.rsqrt(tl.sum(k * k, 0) / DK + eps)
        w = tl.load(NORM_W + o_d, mask=m_d, other=0.0).to(tl.float32)
        w_rot = tl.load(NORM_W + o_r, mask=m_d, other=0.0).to(tl.float32)
        k = rounded(w * rounded(k * r, DT), DT)
        k_rot = rounded(w_rot * rounded(k_rot * r, DT), DT)
    if ROPE:  # each product and the sum rounded (`apply_rope`)
        cos = tl.load(COS + o_d, mask=m_d, other=0.0).to(tl.float32)
        sin = tl.load(SIN + o_d, mask=m_d, other=0.0).to(tl.float32)
        k = rotated_half(k, k_rot, o_d < HALF, cos, sin, DT)
    tl.store(K_CMP + i_b * skc_b + row * skc_t + i_h * DK + o_d, k, mask=m_d)
    v = tl.load(V + i_b * sv_b + i_h * DV + o_v, mask=m_v, other=0.0)
    tl.store(V_CMP + i_b * svc_b + row * svc_t + i_h * DV + o_v, v, mask=m_v)


def write_block(k_blk, v_blk, k_cmp, v_cmp, row, *, norm_weight=None, eps=1e-6, cos=None, sin=None):
    """A compressed block's key (RMSNormed with `norm_weight` if given, then rotated by cos/sin if given)
    and value written into row `row` of the compressed cache: one launch.

    Args:
        k_blk, v_blk: `[B, Hkv, Dk]`, `[B, Hkv, Dv]` (any leading layout that views so: `[B, 1, Hkv, D]`)
            the compressor's outputs, in the model's dtype.
        k_cmp, v_cmp: `[B, Sc, Hkv, Dk]`, `[B, Sc, Hkv, Dv]` the compressed cache, rows with a contiguous
            `[Hkv, D]`. row: int64 `[1]` (device) the block's row (`DecodeStep.cmp_row`).
        norm_weight: `[Dk]` the compressed keys' RMSNorm scale (`compress_norm`), eps its epsilon.
        cos, sin: `[1, Dk]` the rotary tables of the block's first token, in the model's dtype, or None
            for no rotation (`"mean"` pools rotated keys).
    """
    B, HKV, DK, DV = k_cmp.shape[0], k_cmp.shape[2], k_cmp.shape[3], v_cmp.shape[3]
    k_blk, v_blk = k_blk.reshape(B, HKV, DK).contiguous(), v_blk.reshape(B, HKV, DV).contiguous()
    if (cos is None) != (sin is None) or (cos is not None and list(cos.shape) != [1, DK]):
        raise ValueError(f"write_block: cos and sin must both be [1, {DK}] or both None")
    launcher(_write_block_kernel)[(HKV, B)](
        k_blk, v_blk, k_cmp, v_cmp, row, k_blk if norm_weight is None else norm_weight,
        k_blk if cos is None else cos, k_blk if sin is None else sin, k_blk.stride(0), v_blk.stride(0),
        k_cmp.stride(0), k_cmp.stride(1), v_cmp.stride(0), v_cmp.stride(1), float(eps), HKV=HKV, DK=DK, DV=DV,
        BDK=pow2(DK), BDV=pow2(DV), NORM=norm_weight is not None, ROPE=cos is not None, num_warps=1,
        enable_fp_fusion=False)  # no fused multiply-add: torch rounds each product on its own


def write_block_reference(k_blk, v_blk, k_cmp, v_cmp, row, *, norm_weight=None, eps=1e-6, cos=None,
                          sin=None):
    """`write_block` in PyTorch (`NSAAttention.compress`'s norm and RoPE, `NSACache.compress_token`'s
    write)."""
    B, HKV, DK, DV = k_cmp.shape[0], k_cmp.shape[2], k_cmp.shape[3], v_cmp.shape[3]
    k = k_blk.reshape(B, 1, HKV, DK)
    if norm_weight is not None:
        k32 = k.float()
        k = norm_weight * (k32 * torch.rsqrt(k32.pow(2).mean(-1, keepdim=True) + eps)).to(k.dtype)
    if cos is not None:
        k1, k2 = k.chunk(2, dim=-1)
        k = k * cos[:, None, :] + torch.cat([-k2, k1], dim=-1) * sin[:, None, :]
    k_cmp.index_copy_(1, row, k.to(k_cmp.dtype))
    v_cmp.index_copy_(1, row, v_blk.reshape(B, 1, HKV, DV).to(v_cmp.dtype))
