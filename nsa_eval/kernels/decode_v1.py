"""The first Triton NSA decode (`decode.DECODE_VARIANT = "v1"`), kept for comparison with the fused one.

Five launches: compressed chunks of 64 keys, one program each, storing their scores and a partial
softmax (`_decode_cmp_kernel`); importances per chunk of 16 selection blocks, the lse merged serially
from every chunk partial (`_decode_importance_kernel`); `topk_blocks`; one program per selected block
or 64-key window chunk (`_decode_attn_kernel`); a serial merge per (sequence, KV head)
(`_decode_combine_kernel`). Same contract as `decode.nsa_decode`, which validates the inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa_eval.kernels._triton_utils import (
    LOG2E,
    cdiv,
    interpreting,
    launcher,
    overlap_weights,
    pow2,
    softmax_start,
)
from nsa_eval.kernels.decode import (
    _load_q,
    _merge,
    _n_visible,
    _partial_softmax,
    _program_rows,
    _query_pos,
    _store_partial,
)
from nsa_eval.kernels.topk import topk_blocks


@triton.jit
def _decode_cmp_kernel(
    Q, KC, VC, LENS, SC, PM, PL, PO,
    sq_b, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
    TC, HKV, G, NCH, SC_LEN, scale_log2, block_len, stride,
    DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, M: tl.constexpr,
    BC: tl.constexpr, UPCAST: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = (i_bh // HKV).to(tl.int64)
    i_hk = i_bh % HKV
    t = _query_pos(LENS, i_b)
    n_vis = _n_visible(t, TC, block_len, stride)
    if i_c * BC < n_vis:
        o_r = tl.arange(0, M)
        o_dk = tl.arange(0, BDK)
        o_dv = tl.arange(0, BDV)
        o_k = i_c * BC + tl.arange(0, BC)
        m_k = o_k < n_vis
        q = _load_q(Q, i_b, i_hk, G, sq_b, sq_h, o_r, o_dk, DK, UPCAST)
        s, m, l, acc = _partial_softmax(q, KC, VC, i_b, i_hk, o_k, m_k, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
                                        o_r, o_dk, o_dv, G, scale_log2, DK, DV, UPCAST)
        tl.store(SC + (i_bh * M + o_r[:, None]).to(tl.int64) * SC_LEN + o_k[None, :], s)
        part = i_bh * NCH + i_c
        _store_partial(PM, PL, PO, part, m, l, acc, o_r, o_dv, M, BDV)


@triton.jit
def _decode_importance_kernel(
    LENS, SC, PM, PL, IMP, TC, HKV, G, NCH, SC_LEN, NS, block_len, stride, select_size,
    M: tl.constexpr, BNS: tl.constexpr, RATIO: tl.constexpr, BC1: tl.constexpr,
):
    BC: tl.constexpr = BNS * RATIO  # compressed blocks per chunk of BNS selection blocks
    i_bh = tl.program_id(1)
    i_b = i_bh // HKV
    t = _query_pos(LENS, i_b)
    n_vis = _n_visible(t, TC, block_len, stride)
    o_r = tl.arange(0, M)
    m_r = o_r < G
    # lse of every head from the chunk partials
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    for c in range(0, tl.cdiv(n_vis, BC1)):
        part = i_bh * NCH + c
        m = tl.load(PM + part * M + o_r)
        l = tl.load(PL + part * M + o_r)
        m_new = tl.maximum(m_i, m)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp2(m_i - m_safe) + l * tl.exp2(m - m_safe)
        m_i = m_new
    lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), 0.0)  # [M] log2 units

    o_c = tl.arange(0, BC)
    o_j = tl.arange(0, BNS)
    w_main, w_spill = overlap_weights(stride, block_len, select_size, BC, BNS)  # [BC, BNS] each
    j0 = tl.program_id(0) * BNS  # this program's chunk of selection blocks
    if j0 <= t // select_size:
        # main: this chunk's compressed blocks; spill: the previous chunk's, reaching into this one
        o_k = j0 * RATIO + o_c  # [BC]
        vis = (o_k < n_vis)[None, :] & m_r[:, None]  # [M, BC]
        s = tl.load(SC + (i_bh * M + o_r[:, None]).to(tl.int64) * SC_LEN + o_k[None, :], mask=vis,
                    other=float("-inf"))
        p = tl.where(vis, tl.exp2(s - lse[:, None]), 0.0)  # [M, BC]
        imp = tl.sum(tl.dot(p, w_main, input_precision="tf32x3"), 0)  # [BNS] summed over the group
        o_k = o_k - BC
        vis = (o_k < n_vis)[None, :] & (o_k >= 0)[None, :] & m_r[:, None]
        s = tl.load(SC + (i_bh * M + o_r[:, None]).to(tl.int64) * SC_LEN + o_k[None, :], mask=vis,
                    other=float("-inf"))
        p = tl.where(vis, tl.exp2(s - lse[:, None]), 0.0)
        imp += tl.sum(tl.dot(p, w_spill, input_precision="tf32x3"), 0)
        cols = j0 + o_j
        tl.store(IMP + i_bh.to(tl.int64) * NS + cols, imp, mask=cols < NS)


@triton.jit
def _decode_attn_kernel(
    Q, K, V, KW, VW, LENS, BI, PM, PL, PO,
    sq_b, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, skw_b, skw_t, skw_h, svw_b, svw_t, svw_h,
    S, HKV, G, NSEL, NPART, scale_log2, window,
    DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, M: tl.constexpr,
    BS: tl.constexpr, BW: tl.constexpr, UPCAST: tl.constexpr,
):
    # programs 0 .. NSEL-1: selected block slots; NSEL ..: window chunks of BW keys
    i_p = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b, i_hk, t, o_r, o_dk, o_dv = _program_rows(LENS, i_bh, HKV, BDK, BDV, M)
    part = i_bh * NPART + i_p
    q = _load_q(Q, i_b, i_hk, G, sq_b, sq_h, o_r, o_dk, DK, UPCAST)
    if i_p < NSEL:
        blk = tl.load(BI + i_bh * NSEL + i_p)
        o_k = tl.maximum(blk, 0) * BS + tl.arange(0, BS)
        m_k = (o_k <= t) & (o_k >= 0) & (o_k < S) & (tl.zeros([BS], tl.int32) + blk >= 0)
        _, m, l, acc = _partial_softmax(q, K, V, i_b, i_hk, o_k, m_k, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
                                        o_r, o_dk, o_dv, G, scale_log2, DK, DV, UPCAST)
    else:
        start = tl.maximum(t - window + 1, 0)
        o_k = start + (i_p - NSEL) * BW + tl.arange(0, BW)
        m_k = (o_k <= t) & (o_k < S)
        _, m, l, acc = _partial_softmax(q, KW, VW, i_b, i_hk, o_k, m_k, skw_b, skw_t, skw_h, svw_b, svw_t,
                                        svw_h, o_r, o_dk, o_dv, G, scale_log2, DK, DV, UPCAST)
    _store_partial(PM, PL, PO, part, m, l, acc, o_r, o_dv, M, BDV)


@triton.jit
def _combine(PM, PL, PO, first, count, o_r, o_dv, M: tl.constexpr, BDV: tl.constexpr):
    m_i, l_i, acc = softmax_start(M, BDV)
    for c in range(0, count):
        part = first + c
        m = tl.load(PM + part * M + o_r)
        l = tl.load(PL + part * M + o_r)
        o = tl.load(PO + (part * M + o_r[:, None]) * BDV + o_dv[None, :])
        m_i, l_i, acc = _merge(m_i, l_i, acc, m, l, o)
    return acc / tl.where(l_i > 0, l_i, 1.0)[:, None]


@triton.jit
def _decode_combine_kernel(
    LENS, CPM, CPL, CPO, APM, APL, APO, GC, GS, GW, O,
    TC, HKV, G, NCH, NSEL, NPART, block_len, stride,
    DV: tl.constexpr, BDV: tl.constexpr, M: tl.constexpr, BC1: tl.constexpr,
):
    # gates GC/GS/GW and output O are contiguous [B, 1, HQ(, DV)]
    i_bh = tl.program_id(0)
    i_b = i_bh // HKV
    i_hk = i_bh % HKV
    t = _query_pos(LENS, i_b)
    n_vis = _n_visible(t, TC, block_len, stride)
    o_r = tl.arange(0, M)
    o_dv = tl.arange(0, BDV)
    o_cmp = _combine(CPM, CPL, CPO, i_bh * NCH, tl.cdiv(n_vis, BC1), o_r, o_dv, M, BDV)
    o_slc = _combine(APM, APL, APO, i_bh * NPART, NSEL, o_r, o_dv, M, BDV)
    o_swa = _combine(APM, APL, APO, i_bh * NPART + NSEL, NPART - NSEL, o_r, o_dv, M, BDV)
    head = (i_b * HKV + i_hk) * G + o_r  # [M] flat (b, h) since HQ = HKV * G
    m_r = o_r < G
    gc = tl.load(GC + head, mask=m_r, other=0.0).to(tl.float32)
    gs = tl.load(GS + head, mask=m_r, other=0.0).to(tl.float32)
    gw = tl.load(GW + head, mask=m_r, other=0.0).to(tl.float32)
    o = gc[:, None] * o_cmp + gs[:, None] * o_slc + gw[:, None] * o_swa
    tl.store(O + head[:, None].to(tl.int64) * DV + o_dv[None, :], o.to(O.dtype.element_ty),
             mask=m_r[:, None] & (o_dv < DV)[None, :])


def decode_v1(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, k_swa, v_swa, lens, *, block_len, stride,
               select_size, num_selected, num_init, num_local, window, scale):
    B, _, HQ, DK = q.shape
    S, HKV = k.shape[1], k.shape[2]
    TC, DV = k_cmp.shape[1], v.shape[3]
    G = HQ // HKV
    ratio = select_size // stride
    dev = q.device
    M = pow2(G)
    BDK, BDV = pow2(DK), pow2(DV)
    upcast = interpreting()
    f32 = dict(device=dev, dtype=torch.float32)


    # 1. compression branch: scores + partial softmax per chunk of compressed keys
    BC1 = 16 if interpreting() else 64
    nch = max(1, cdiv(TC, BC1))
    sc_len = nch * BC1
    scores = torch.empty(B * HKV, M, sc_len, **f32)
    cpm = torch.empty(B * HKV, nch, M, **f32)
    cpl = torch.empty(B * HKV, nch, M, **f32)
    cpo = torch.empty(B * HKV, nch, M, BDV, **f32)
    if TC > 0:
        launcher(_decode_cmp_kernel)[(nch, B * HKV)](
            q, k_cmp, v_cmp, lens, scores, cpm, cpl, cpo, q.stride(0), q.stride(2),
            k_cmp.stride(0), k_cmp.stride(1), k_cmp.stride(2), v_cmp.stride(0), v_cmp.stride(1),
            v_cmp.stride(2), TC, HKV, G, nch, sc_len, scale * LOG2E, block_len, stride,
            DK=DK, DV=DV, BDK=BDK, BDV=BDV, M=M, BC=BC1, UPCAST=upcast, num_warps=4,
        )

    # 2. block importances and top-k
    ns = cdiv(S, select_size)
    imp = torch.empty(B * HKV, ns, **f32)
    bns = 16
    launcher(_decode_importance_kernel)[(cdiv(ns, bns), B * HKV)](
        lens, scores, cpm, cpl, imp, TC, HKV, G, nch, sc_len, ns, block_len, stride, select_size,
        M=M, BNS=bns, RATIO=ratio, BC1=BC1, num_warps=4,
    )
    bi = topk_blocks(imp, T=1, num_kv_heads=HKV, select_size=select_size, num_selected=num_selected,
                     num_init=num_init, num_local=num_local, positions=(lens - 1).int())  # [B*HKV, n]

    # 3. selected blocks and window chunks: partial softmax each
    BW = 16 if interpreting() else 64
    nw = cdiv(window, BW)
    npart = num_selected + nw
    apm = torch.empty(B * HKV, npart, M, **f32)
    apl = torch.empty(B * HKV, npart, M, **f32)
    apo = torch.empty(B * HKV, npart, M, BDV, **f32)
    launcher(_decode_attn_kernel)[(npart, B * HKV)](
        q, k, v, k_swa, v_swa, lens, bi, apm, apl, apo, q.stride(0), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        k_swa.stride(0), k_swa.stride(1), k_swa.stride(2), v_swa.stride(0), v_swa.stride(1), v_swa.stride(2),
        S, HKV, G, num_selected, npart, scale * LOG2E, window,
        DK=DK, DV=DV, BDK=BDK, BDV=BDV, M=M, BS=select_size, BW=BW, UPCAST=upcast, num_warps=4,
    )

    # 4. merge partials, gate, write
    o = torch.empty(B, 1, HQ, DV, device=dev, dtype=q.dtype)
    launcher(_decode_combine_kernel)[(B * HKV,)](
        lens, cpm, cpl, cpo, apm, apl, apo, g_cmp, g_slc, g_swa, o,
        TC, HKV, G, nch, num_selected, npart, block_len, stride, DV=DV, BDV=BDV, M=M, BC1=BC1, num_warps=4,
    )
    return o, bi
