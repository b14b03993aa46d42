"""Triton NSA decode: one new query per sequence against caches of raw and compressed keys/values.

The work is split over the blocks actually read (split-K), so the cost grows with the number of
blocks, not with the cache size:
1. `_decode_cmp_kernel`, one program per (chunk of compressed keys, sequence, KV head), all G query
   heads of the group as rows: scores (kept for step 2) and a partial softmax (max, sum, p @ v).
   Chunks past the query's last visible compressed block exit at once.
2. `_decode_importance_kernel`, one program per (chunk of selection blocks, sequence, KV head): the
   compression lse from the partials, then the chunk's selection-block importances from the stored
   scores (same overlap weights and group sum as prefill; weight spilling from the previous chunk's
   compressed blocks is recomputed from its scores), then `topk_blocks` picks the blocks (forced
   ones, ties to the lower index).
3. `_decode_attn_kernel`, one program per (selected block or window chunk, sequence, KV head):
   partial softmax over that block.
4. `_decode_combine_kernel` merges the partials of each branch and applies the gates.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa_eval.kernels._triton_utils import LOG2E, default_scale, interpreting, pow2, topk_blocks


@triton.jit
def _load_q(Q, i_b, i_hk, G, sq_b, sq_h, o_r, o_dk, DK: tl.constexpr, UPCAST: tl.constexpr):
    q = tl.load(Q + i_b * sq_b + (i_hk * G + o_r)[:, None] * sq_h + o_dk[None, :],
                mask=(o_r < G)[:, None] & (o_dk < DK)[None, :], other=0.0)  # [M, BDK]
    if UPCAST:
        q = q.to(tl.float32)
    return q


@triton.jit
def _partial_softmax(q, k_ptrs, v_ptrs, m_k, valid, scale_log2, o_dk, o_dv, DK: tl.constexpr,
                     DV: tl.constexpr, UPCAST: tl.constexpr):
    # scores and partial softmax of the M rows over BN keys; returns s [M, BN], m [M], l [M], acc [M, BDV]
    k = tl.load(k_ptrs, mask=m_k[:, None] & (o_dk < DK)[None, :], other=0.0)  # [BN, BDK]
    v = tl.load(v_ptrs, mask=m_k[:, None] & (o_dv < DV)[None, :], other=0.0)  # [BN, BDV]
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k)) * scale_log2  # [M, BN]
    s = tl.where(valid, s, float("-inf"))
    m = tl.max(s, 1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    p = tl.exp2(s - m_safe[:, None])
    return s, m, tl.sum(p, 1), tl.dot(p.to(v.dtype), v)


@triton.jit
def _decode_cmp_kernel(
    Q, KC, VC, POS, SC, PM, PL, PO,
    sq_b, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
    TC, HKV, G, NCH, SC_LEN, scale_log2, block_len, stride,
    DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, M: tl.constexpr,
    BC: tl.constexpr, UPCAST: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = (i_bh // HKV).to(tl.int64)
    i_hk = i_bh % HKV
    t = tl.load(POS + i_b)
    n_vis = tl.minimum(tl.where(t >= block_len - 1, (t - block_len + 1) // stride + 1, 0), TC)
    if i_c * BC < n_vis:
        o_r = tl.arange(0, M)
        o_dk = tl.arange(0, BDK)
        o_dv = tl.arange(0, BDV)
        o_k = i_c * BC + tl.arange(0, BC)
        m_k = o_k < n_vis
        q = _load_q(Q, i_b, i_hk, G, sq_b, sq_h, o_r, o_dk, DK, UPCAST)
        k_ptrs = KC + i_b * sk_b + i_hk * sk_h + o_k[:, None].to(tl.int64) * sk_t + o_dk[None, :]
        v_ptrs = VC + i_b * sv_b + i_hk * sv_h + o_k[:, None].to(tl.int64) * sv_t + o_dv[None, :]
        valid = m_k[None, :] & (o_r < G)[:, None]
        s, m, l, acc = _partial_softmax(q, k_ptrs, v_ptrs, m_k, valid, scale_log2, o_dk, o_dv, DK, DV, UPCAST)
        tl.store(SC + (i_bh * M + o_r[:, None]).to(tl.int64) * SC_LEN + o_k[None, :], s)
        part = i_bh * NCH + i_c
        tl.store(PM + part * M + o_r, m)
        tl.store(PL + part * M + o_r, l)
        tl.store(PO + (part * M + o_r[:, None]) * BDV + o_dv[None, :], acc)


@triton.jit
def _merge(m_i, l_i, acc, m, l, o):
    m_new = tl.maximum(m_i, m)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp2(m_i - m_safe)
    b = tl.exp2(m - m_safe)
    return m_new, l_i * a + l * b, acc * a[:, None] + o * b[:, None]


@triton.jit
def _decode_importance_kernel(
    POS, SC, PM, PL, IMP, TC, HKV, G, NCH, SC_LEN, NS, block_len, stride, select_size,
    M: tl.constexpr, BNS: tl.constexpr, RATIO: tl.constexpr, BC1: tl.constexpr,
):
    BC: tl.constexpr = BNS * RATIO  # compressed blocks per chunk of BNS selection blocks
    i_bh = tl.program_id(1)
    i_b = i_bh // HKV
    t = tl.load(POS + i_b)
    n_vis = tl.minimum(tl.where(t >= block_len - 1, (t - block_len + 1) // stride + 1, 0), TC)
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
    c_lo = o_c[:, None] * stride
    c_hi = c_lo + block_len
    s_lo = o_j[None, :] * select_size
    w_main = tl.maximum(tl.minimum(c_hi, s_lo + select_size) - tl.maximum(c_lo, s_lo), 0)
    s_lo2 = s_lo + BNS * select_size
    w_spill = tl.maximum(tl.minimum(c_hi, s_lo2 + select_size) - tl.maximum(c_lo, s_lo2), 0)
    w_main = w_main.to(tl.float32) / stride  # [BC, BNS]
    w_spill = w_spill.to(tl.float32) / stride  # [BC, BNS]
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
    Q, K, V, KW, VW, POS, BI, PM, PL, PO,
    sq_b, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, skw_b, skw_t, skw_h, svw_b, svw_t, svw_h,
    S, HKV, G, NSEL, NPART, scale_log2, window,
    DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, M: tl.constexpr,
    BS: tl.constexpr, BW: tl.constexpr, UPCAST: tl.constexpr,
):
    # programs 0 .. NSEL-1: selected block slots; NSEL ..: window chunks of BW keys
    i_p = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = (i_bh // HKV).to(tl.int64)
    i_hk = i_bh % HKV
    t = tl.load(POS + i_b)
    o_r = tl.arange(0, M)
    o_dk = tl.arange(0, BDK)
    o_dv = tl.arange(0, BDV)
    part = i_bh * NPART + i_p
    q = _load_q(Q, i_b, i_hk, G, sq_b, sq_h, o_r, o_dk, DK, UPCAST)
    if i_p < NSEL:
        blk = tl.load(BI + i_bh * NSEL + i_p)
        o_k = tl.maximum(blk, 0) * BS + tl.arange(0, BS)
        m_k = (o_k <= t) & (o_k >= 0) & (o_k < S) & (tl.zeros([BS], tl.int32) + blk >= 0)
        k_ptrs = K + i_b * sk_b + i_hk * sk_h + o_k[:, None].to(tl.int64) * sk_t + o_dk[None, :]
        v_ptrs = V + i_b * sv_b + i_hk * sv_h + o_k[:, None].to(tl.int64) * sv_t + o_dv[None, :]
        valid = m_k[None, :] & (o_r < G)[:, None]
        _, m, l, acc = _partial_softmax(q, k_ptrs, v_ptrs, m_k, valid, scale_log2, o_dk, o_dv, DK, DV, UPCAST)
    else:
        start = tl.maximum(t - window + 1, 0)
        o_k = start + (i_p - NSEL) * BW + tl.arange(0, BW)
        m_k = (o_k <= t) & (o_k < S)
        k_ptrs = KW + i_b * skw_b + i_hk * skw_h + o_k[:, None].to(tl.int64) * skw_t + o_dk[None, :]
        v_ptrs = VW + i_b * svw_b + i_hk * svw_h + o_k[:, None].to(tl.int64) * svw_t + o_dv[None, :]
        valid = m_k[None, :] & (o_r < G)[:, None]
        _, m, l, acc = _partial_softmax(q, k_ptrs, v_ptrs, m_k, valid, scale_log2, o_dk, o_dv, DK, DV, UPCAST)
    tl.store(PM + part * M + o_r, m)
    tl.store(PL + part * M + o_r, l)
    tl.store(PO + (part * M + o_r[:, None]) * BDV + o_dv[None, :], acc)


@triton.jit
def _combine(PM, PL, PO, first, count, o_r, o_dv, M: tl.constexpr, BDV: tl.constexpr):
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, BDV], tl.float32)
    for c in range(0, count):
        part = first + c
        m = tl.load(PM + part * M + o_r)
        l = tl.load(PL + part * M + o_r)
        o = tl.load(PO + (part * M + o_r[:, None]) * BDV + o_dv[None, :])
        m_new = tl.maximum(m_i, m)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp2(m_i - m_safe)
        b = tl.exp2(m - m_safe)
        l_i = l_i * a + l * b
        acc = acc * a[:, None] + o * b[:, None]
        m_i = m_new
    return acc / tl.where(l_i > 0, l_i, 1.0)[:, None]


@triton.jit
def _decode_combine_kernel(
    POS, CPM, CPL, CPO, APM, APL, APO, GC, GS, GW, O,
    TC, HKV, G, NCH, NSEL, NPART, block_len, stride,
    DV: tl.constexpr, BDV: tl.constexpr, M: tl.constexpr, BC1: tl.constexpr,
):
    # gates GC/GS/GW and output O are contiguous [B, 1, HQ(, DV)]
    i_bh = tl.program_id(0)
    i_b = i_bh // HKV
    i_hk = i_bh % HKV
    t = tl.load(POS + i_b)
    n_vis = tl.minimum(tl.where(t >= block_len - 1, (t - block_len + 1) // stride + 1, 0), TC)
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


def nsa_decode(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, *, cache_seqlens=None, k_swa=None, v_swa=None,
               block_len=32, stride=16, select_size=64, num_selected=16, num_init=1, num_local=2,
               window=512, scale=None, return_block_indices=False):
    """NSA for one new query per sequence (same result as the last row of prefill).

    Args:
        q: new queries `[B, 1, Hq, Dk]`.
        k, v: caches of the selection branch `[B, S, Hkv, Dk]`, `[B, S, Hkv, Dv]` (new token included).
        k_cmp, v_cmp: compressed caches `[B, Sc, Hkv, Dk]`, `[B, Sc, Hkv, Dv]`.
        g_cmp, g_slc, g_swa: gates `[B, 1, Hq]`.
        cache_seqlens: int `[B]` valid tokens incl. the new one (default S); the query sits at
            `cache_seqlens - 1`.
        k_swa, v_swa: window caches, default k, v (same layout as k, v).

    Returns:
        o `[B, 1, Hq, Dv]`; with `return_block_indices` also int32 `[B, 1, Hkv, num_selected]`.
    """
    B, _, HQ, DK = q.shape
    S, HKV = k.shape[1], k.shape[2]
    TC, DV = k_cmp.shape[1], v.shape[3]
    G = HQ // HKV
    scale = default_scale(scale, DK)
    if select_size < 16 or select_size & (select_size - 1):
        raise ValueError(f"the Triton nsa_decode needs select_size a power of two >= 16, got {select_size}")
    ratio = select_size // stride
    if select_size % stride or ratio & (ratio - 1):
        raise ValueError(f"the Triton nsa_decode needs select_size a power-of-two multiple of stride, "
                         f"got select_size={select_size}, stride={stride}")
    k_swa = k if k_swa is None else k_swa
    v_swa = v if v_swa is None else v_swa
    dev = q.device
    if cache_seqlens is None:
        pos = torch.full((B,), S - 1, dtype=torch.int32, device=dev)
    else:
        pos = (cache_seqlens.to(torch.int32) - 1).contiguous()
    for x in (k, v, k_cmp, v_cmp, k_swa, v_swa):
        if x.stride(-1) != 1:
            raise ValueError("nsa_decode needs caches with a contiguous last dimension")
    q = q.contiguous()
    M = pow2(G)
    BDK, BDV = pow2(DK), pow2(DV)
    upcast = interpreting()
    f32 = dict(device=dev, dtype=torch.float32)

    # 1. compression branch: scores + partial softmax per chunk of compressed keys
    BC1 = 16 if interpreting() else 64
    nch = max(1, triton.cdiv(TC, BC1))
    sc_len = nch * BC1
    scores = torch.empty(B * HKV, M, sc_len, **f32)
    cpm = torch.empty(B * HKV, nch, M, **f32)
    cpl = torch.empty(B * HKV, nch, M, **f32)
    cpo = torch.empty(B * HKV, nch, M, BDV, **f32)
    if TC > 0:
        _decode_cmp_kernel[(nch, B * HKV)](
            q, k_cmp, v_cmp, pos, scores, cpm, cpl, cpo, q.stride(0), q.stride(2),
            k_cmp.stride(0), k_cmp.stride(1), k_cmp.stride(2), v_cmp.stride(0), v_cmp.stride(1),
            v_cmp.stride(2), TC, HKV, G, nch, sc_len, scale * LOG2E, block_len, stride,
            DK=DK, DV=DV, BDK=BDK, BDV=BDV, M=M, BC=BC1, UPCAST=upcast, num_warps=4,
        )

    # 2. block importances and top-k
    ns = triton.cdiv(S, select_size)
    imp = torch.empty(B * HKV, ns, **f32)
    bns = 16
    _decode_importance_kernel[(triton.cdiv(ns, bns), B * HKV)](
        pos, scores, cpm, cpl, imp, TC, HKV, G, nch, sc_len, ns, block_len, stride, select_size,
        M=M, BNS=bns, RATIO=ratio, BC1=BC1, num_warps=4,
    )
    bi = topk_blocks(imp, T=1, num_kv_heads=HKV, select_size=select_size, num_selected=num_selected,
                     num_init=num_init, num_local=num_local, positions=pos)  # [B*HKV, n]

    # 3. selected blocks and window chunks: partial softmax each
    BW = 16 if interpreting() else 64
    nw = triton.cdiv(window, BW)
    npart = num_selected + nw
    apm = torch.empty(B * HKV, npart, M, **f32)
    apl = torch.empty(B * HKV, npart, M, **f32)
    apo = torch.empty(B * HKV, npart, M, BDV, **f32)
    _decode_attn_kernel[(npart, B * HKV)](
        q, k, v, k_swa, v_swa, pos, bi, apm, apl, apo, q.stride(0), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        k_swa.stride(0), k_swa.stride(1), k_swa.stride(2), v_swa.stride(0), v_swa.stride(1), v_swa.stride(2),
        S, HKV, G, num_selected, npart, scale * LOG2E, window,
        DK=DK, DV=DV, BDK=BDK, BDV=BDV, M=M, BS=select_size, BW=BW, UPCAST=upcast, num_warps=4,
    )

    # 4. merge partials, gate, write
    o = torch.empty(B, 1, HQ, DV, device=dev, dtype=q.dtype)
    _decode_combine_kernel[(B * HKV,)](
        pos, cpm, cpl, cpo, apm, apl, apo, g_cmp.contiguous(), g_slc.contiguous(), g_swa.contiguous(), o,
        TC, HKV, G, nch, num_selected, npart, block_len, stride, DV=DV, BDV=BDV, M=M, BC1=BC1, num_warps=4,
    )
    if return_block_indices:
        return o, bi.view(B, 1, HKV, num_selected)
    return o
