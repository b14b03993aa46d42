"""Banded FlashAttention-2 in Triton (forward, dq, dk/dv): the compression and sliding-window
branches (`compression.py`, `window.py`) are both this kernel with different key geometry.

Key index `i` stands for the token `i * key_stride + key_offset` (its last token); query `t` sees it
when that token is `<= t` and, with a window `w`, `> t - w`:
- compression: `key_stride = d`, `key_offset = l - 1` (block `i` covers tokens `[i*d, i*d + l)`);
- sliding window: `key_stride = 1`, `key_offset = 0`, window `w`.

The three kernels share this geometry's tile arithmetic (`_key_range`, `_key_interior`,
`_query_interior`), their tile loads and their launch configurations (`BAND_CONFIGS`, `_band_config`),
so they stay in one file, the longest of the package: apart, each half would import the other's
internals.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa_eval.kernels._triton_utils import (
    LOG2E,
    cdiv,
    dk_tiles,
    dot,
    interpreting,
    kv_sources,
    launcher,
    load_kv,
    load_rows,
    load_tail,
    online_softmax_step,
    online_softmax_step_full,
    pow2,
    row_delta,
    softmax_result,
    softmax_start,
    split_zeros,
    store_tail,
    tma_descriptor,
    tma_load_pair,
    tma_ok,
    wide_rows,
)

# The kernels (per branch, "cmp" and "swa": forward, dq, dk/dv) whose loops over tiles run in three
# ranges, as in FlashAttention's Triton tutorial: the tiles at the window's start and on the diagonal
# build the causal/window/bounds mask, the interior tiles between them (every query sees every key, all
# in range) skip it; the others run one masked loop. The tiles stay in ascending order either way, so
# the results are the same. At 64k the split took the compression forward from 13.46 to 11.50 ms and
# its forward+backward from 60.07 to 54.81, the window forward from 5.21 to 4.82. The window's
# backward splits only with Triton 3.8 and later: compiled by 3.6 its split forward+backward took
# 17.8 ms against 14.4-15.0 masked, by 3.8 12.8-13.0 against 13.3-13.4.
TRITON_38 = tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 8)
BAND_SPLIT_MASK = {"cmp": ("fwd", "dq", "dkv"), "swa": ("fwd", "dq", "dkv") if TRITON_38 else ("fwd",)}


def _branch(window) -> str:
    return "cmp" if window is None else "swa"


@triton.jit
def load_in_range(ptrs, col_mask, PADDED: tl.constexpr):
    # a tile whose rows are all in range: only padded head dims (PADDED: BD > D) need the mask
    if PADDED:
        x = tl.load(ptrs, mask=col_mask, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _key_range(t0, T, TK, key_stride, key_offset, window, HAS_WINDOW: tl.constexpr, BM: tl.constexpr,
               BN: tl.constexpr):
    # Key tiles [lo, hi) that queries [t0, t0 + BM) may see: up to the last query's (or T - 1's)
    # last visible key, from the first query's window start rounded down to a tile start
    t_last = tl.minimum(t0 + BM - 1, T - 1)
    hi = tl.minimum(tl.maximum(t_last - key_offset, 0) // key_stride + 1, TK)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(t0 - window + 1, 0) // BN * BN
    return lo, hi


@triton.jit
def _key_interior(t0, T, TK, lo, hi, key_stride, key_offset, window, HAS_WINDOW: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr):
    # Key tiles [mid_lo, mid_hi) (steps of BN from lo, inside [lo, hi)) where every query of
    # [t0, t0 + BM) sees every key: all queries < T, all keys < TK, each key position <= t0 (the
    # first query) and, with a window, > t0 + BM - 1 - window (the last query's window).
    n_seen = tl.maximum(t0 - key_offset + key_stride, 0) // key_stride  # keys at positions <= t0
    n_seen = tl.where(t0 + BM <= T, tl.minimum(n_seen, TK), 0)
    mid_lo = lo
    if HAS_WINDOW:
        # first key whose position is > t0 + BM - 1 - window, rounded up to a tile start
        first = tl.maximum(t0 + BM - 1 - window - key_offset + key_stride, 0) // key_stride
        mid_lo = tl.minimum(tl.maximum((first + BN - 1) // BN * BN, lo), hi)
    mid_hi = tl.maximum(tl.minimum(n_seen // BN * BN, hi), mid_lo)
    return mid_lo, mid_hi


@triton.jit
def _query_interior(k0, T, TK, lo, hi, key_stride, key_offset, window, HAS_WINDOW: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr):
    # Query tiles [mid_lo, mid_hi) (steps of BM from lo, inside [lo, hi)) that see every key of
    # [k0, k0 + BN): all keys < TK, all queries < T, each query >= the last key's position and, with a
    # window, < the first key's position + window.
    last_pos = (k0 + BN - 1) * key_stride + key_offset
    mid_lo = tl.minimum(tl.maximum((last_pos + BM - 1) // BM * BM, lo), hi)
    end = T
    if HAS_WINDOW:
        end = tl.minimum(end, k0 * key_stride + key_offset + window)
    end = tl.where(k0 + BN <= TK, end, 0)
    mid_hi = tl.maximum(tl.minimum(end // BM * BM, hi), mid_lo)
    return mid_lo, mid_hi


@triton.jit
def _band_fwd_tile(q, q2, k_base, v_base, start, o_t, m_i, l_i, acc, sk_t, sv_t, TK, scale_log2, key_stride,
                   key_offset, window, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, DK: tl.constexpr,
                   DV: tl.constexpr, BDK: tl.constexpr, BDK2: tl.constexpr, BDV: tl.constexpr,
                   BN: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr = False, i_b=0, i_hk=0):
    # one key tile [start, start + BN) of the forward for queries o_t [BM]; q [BM, BDK] (q2 [BM, BDK2]:
    # the tail of a split head dim, if BDK2 > 0). TMA: k_base / v_base are tensor descriptors over
    # [B, TK, HKV, D] (blocks [1, BN, 1, BDK / BDV]) and i_b, i_hk the tile's batch and KV head
    o_k = start + tl.arange(0, BN)  # [BN] key indices
    m_k = o_k < TK
    if TMA:
        k, v = tma_load_pair(k_base, v_base, i_b, start, i_hk, BN, BDK, BDV)
        k = tl.trans(k)  # [BDK, BN]
    else:
        o_dk = tl.arange(0, BDK)
        o_dv = tl.arange(0, BDV)
        k_ptrs = k_base + o_k[None, :].to(tl.int64) * sk_t + o_dk[:, None]  # [BDK, BN]
        v_ptrs = v_base + o_k[:, None].to(tl.int64) * sv_t + o_dv[None, :]  # [BN, BDV]
        if MASKED:
            k = tl.load(k_ptrs, mask=m_k[None, :] & (o_dk < DK)[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=m_k[:, None] & (o_dv < DV)[None, :], other=0.0)
        else:
            k = load_in_range(k_ptrs, (o_dk < DK)[:, None], BDK > DK)
            v = load_in_range(v_ptrs, (o_dv < DV)[None, :], BDV > DV)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = dot(q, k)  # [BM, BN]
    if BDK2 > 0:
        s += dot(q2, load_tail(k_base + o_k.to(tl.int64) * sk_t, o_k < TK, MASKED, BDK, BDK2, UPCAST,
                                     True))
    if MASKED:
        k_pos = o_k * key_stride + key_offset
        valid = (k_pos[None, :] <= o_t[:, None]) & m_k[None, :]
        if HAS_WINDOW:
            valid = valid & (k_pos[None, :] > o_t[:, None] - window)
        m_i, l_i, acc = online_softmax_step(s, valid, v, m_i, l_i, acc, scale_log2)
    else:
        m_i, l_i, acc = online_softmax_step_full(s, v, m_i, l_i, acc, scale_log2)
    return m_i, l_i, acc


@triton.jit
def _query_tile_and_head(longest_first):
    """(query tile, batch x head) of a forward or dq program. longest_first: the grid is (heads, query
    tiles) and runs the last query tiles, which see the most keys, first (without a window), so the
    GPU is not left waiting on a few long programs at the end; else (query tiles, heads)."""
    if longest_first:
        i_bh = tl.program_id(0)
        i_m = tl.num_programs(1) - 1 - tl.program_id(1)
    else:
        i_m = tl.program_id(0)
        i_bh = tl.program_id(1)
    return i_m, i_bh


@triton.jit
def _band_fwd_kernel(
    Q, K, V, O, LSE,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, so_b, so_t, so_h,
    T, TK, HQ, G, scale_log2, key_stride, key_offset, window, longest_first,
    HAS_WINDOW: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDK2: tl.constexpr,
    BDV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, UPCAST: tl.constexpr,
    SPLIT_MASK: tl.constexpr, TMA: tl.constexpr = False,
):
    # TMA: K and V are tensor descriptors (`tma_descriptor`)
    i_m, i_bh = _query_tile_and_head(longest_first)
    i_b = (i_bh // HQ).to(tl.int64)
    i_h = i_bh % HQ
    i_hk = i_h // G
    t0 = i_m * BM
    o_t = t0 + tl.arange(0, BM)  # [BM] query positions
    o_dv = tl.arange(0, BDV)
    m_t = o_t < T
    q, q2 = load_rows(Q + i_b * sq_b + i_h * sq_h + o_t.to(tl.int64) * sq_t, m_t, DK, BDK, BDK2, UPCAST)
    k_base, v_base = kv_sources(K, V, i_b, i_hk, sk_b, sk_h, sv_b, sv_h, TMA)
    lo, hi = _key_range(t0, T, TK, key_stride, key_offset, window, HAS_WINDOW, BM, BN)

    m_i, l_i, acc = softmax_start(BM, BDV)
    if SPLIT_MASK:
        mid_lo, mid_hi = _key_interior(t0, T, TK, lo, hi, key_stride, key_offset, window, HAS_WINDOW, BM, BN)
        if HAS_WINDOW:  # tiles at the window's start
            for start in range(lo, mid_lo, BN):
                m_i, l_i, acc = _band_fwd_tile(q, q2, k_base, v_base, start, o_t, m_i, l_i, acc, sk_t, sv_t,
                                               TK, scale_log2, key_stride, key_offset, window, True,
                                               HAS_WINDOW, DK, DV, BDK, BDK2, BDV, BN, UPCAST, TMA,
                                               i_b, i_hk)
        for start in range(mid_lo, mid_hi, BN):  # interior: no mask
            m_i, l_i, acc = _band_fwd_tile(q, q2, k_base, v_base, start, o_t, m_i, l_i, acc, sk_t, sv_t,
                                           TK, scale_log2, key_stride, key_offset, window, False, HAS_WINDOW,
                                           DK, DV, BDK, BDK2, BDV, BN, UPCAST, TMA, i_b, i_hk)
        for start in range(mid_hi, hi, BN):  # the diagonal (and the keys past TK)
            m_i, l_i, acc = _band_fwd_tile(q, q2, k_base, v_base, start, o_t, m_i, l_i, acc, sk_t, sv_t,
                                           TK, scale_log2, key_stride, key_offset, window, True, HAS_WINDOW,
                                           DK, DV, BDK, BDK2, BDV, BN, UPCAST, TMA, i_b, i_hk)
    else:
        for start in range(lo, hi, BN):
            m_i, l_i, acc = _band_fwd_tile(q, q2, k_base, v_base, start, o_t, m_i, l_i, acc, sk_t, sv_t,
                                           TK, scale_log2, key_stride, key_offset, window, True, HAS_WINDOW,
                                           DK, DV, BDK, BDK2, BDV, BN, UPCAST, TMA, i_b, i_hk)
    o, lse = softmax_result(m_i, l_i, acc)
    tl.store(O + i_b * so_b + i_h * so_h + o_t[:, None].to(tl.int64) * so_t + o_dv[None, :],
             o.to(O.dtype.element_ty), mask=m_t[:, None] & (o_dv < DV)[None, :])
    tl.store(LSE + (i_b * T + o_t) * HQ + i_h, lse, mask=m_t)


@triton.jit
def _band_dq_tile(q, q2, do, lse, delta, dq, dq2, k_base, v_base, start, o_t, sk_t, sv_t, TK, scale_log2,
                  key_stride, key_offset, window, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr,
                  DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDK2: tl.constexpr,
                  BDV: tl.constexpr, BN: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr = False,
                  i_b=0, i_hk=0):
    # one key tile [start, start + BN) of dq [BM, BDK] (and dq2 [BM, BDK2], the tail of a split head
    # dim, with q2) for queries o_t [BM]; TMA: as `_band_fwd_tile`
    o_k = start + tl.arange(0, BN)
    o_dk = tl.arange(0, BDK)
    o_dv = tl.arange(0, BDV)
    m_k = o_k < TK
    if TMA:
        k, v = tma_load_pair(k_base, v_base, i_b, start, i_hk, BN, BDK, BDV)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
    elif MASKED:
        k, v = load_kv(k_base, v_base, o_k, m_k, sk_t, sv_t, o_dk, o_dv, DK, DV, UPCAST)  # [BN, BDK/BDV]
    else:
        k = load_in_range(k_base + o_k[:, None].to(tl.int64) * sk_t + o_dk[None, :], (o_dk < DK)[None, :],
                          BDK > DK)  # [BN, BDK]
        v = load_in_range(v_base + o_k[:, None].to(tl.int64) * sv_t + o_dv[None, :], (o_dv < DV)[None, :],
                          BDV > DV)  # [BN, BDV]
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k))  # [BM, BN]
    k2 = k  # the tail [BN, BDK2] (unused without one)
    if BDK2 > 0:
        k2 = load_tail(k_base + o_k.to(tl.int64) * sk_t, o_k < TK, MASKED, BDK, BDK2, UPCAST, False)
        s += tl.dot(q2, tl.trans(k2))
    p = tl.exp2(s * scale_log2 - lse[:, None])
    if MASKED:
        k_pos = o_k * key_stride + key_offset
        valid = (k_pos[None, :] <= o_t[:, None]) & m_k[None, :]
        if HAS_WINDOW:
            valid = valid & (k_pos[None, :] > o_t[:, None] - window)
        p = tl.where(valid, p, 0.0)
    dp = tl.dot(do, tl.trans(v))  # [BM, BN]
    ds = p * (dp - delta[:, None])
    dq += tl.dot(ds.to(k.dtype), k)
    if BDK2 > 0:
        dq2 += tl.dot(ds.to(k2.dtype), k2)
    return dq, dq2


@triton.jit
def _band_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, GATE, DQ, ADD,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
    T, TK, HQ, G, scale, scale_log2, key_stride, key_offset, window, longest_first,
    HAS_WINDOW: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDK2: tl.constexpr,
    BDV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, UPCAST: tl.constexpr,
    SPLIT_MASK: tl.constexpr, GATED: tl.constexpr, TMA: tl.constexpr, HAS_ADD: tl.constexpr,
):
    # TMA: K and V are tensor descriptors (`tma_descriptor`).
    # DO and DQ are contiguous [B, T, HQ, DV] / [B, T, HQ, DK]. GATED: this branch's output gradient
    # is GATE [B, T, HQ] (per row) times DO, and DELTA is rowsum(o * DO): ds = g * p * (dp - delta)
    # for every key, so dq is the ungated one times g. HAS_ADD: ADD (contiguous like DQ, any float dtype:
    # the other branches' dq) is added in float32 before DQ's one rounding
    i_m, i_bh = _query_tile_and_head(longest_first)
    i_b = (i_bh // HQ).to(tl.int64)
    i_h = i_bh % HQ
    i_hk = i_h // G
    t0 = i_m * BM
    o_t = t0 + tl.arange(0, BM)
    o_dk = tl.arange(0, BDK)
    o_dv = tl.arange(0, BDV)
    m_t = o_t < T
    row = (i_b * T + o_t.to(tl.int64)) * HQ + i_h  # [BM] flat (b, t, h)
    q, q2 = load_rows(Q + i_b * sq_b + i_h * sq_h + o_t.to(tl.int64) * sq_t, m_t, DK, BDK, BDK2, UPCAST)
    do = tl.load(DO + row[:, None] * DV + o_dv[None, :], mask=m_t[:, None] & (o_dv < DV)[None, :],
                 other=0.0)  # [BM, BDV]
    lse = tl.load(LSE + row, mask=m_t, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse) * 1.4426950408889634
    delta = tl.load(DELTA + row, mask=m_t, other=0.0)
    if UPCAST:
        do = do.to(tl.float32)
    k_base, v_base = kv_sources(K, V, i_b, i_hk, sk_b, sk_h, sv_b, sv_h, TMA)
    lo, hi = _key_range(t0, T, TK, key_stride, key_offset, window, HAS_WINDOW, BM, BN)
    dq, dq2 = split_zeros(BM, BDK, BDK2)
    if SPLIT_MASK:
        mid_lo, mid_hi = _key_interior(t0, T, TK, lo, hi, key_stride, key_offset, window, HAS_WINDOW, BM, BN)
        if HAS_WINDOW:  # tiles at the window's start
            for start in range(lo, mid_lo, BN):
                dq, dq2 = _band_dq_tile(q, q2, do, lse, delta, dq, dq2, k_base, v_base, start, o_t, sk_t,
                                        sv_t, TK, scale_log2, key_stride, key_offset, window, True,
                                        HAS_WINDOW, DK, DV, BDK, BDK2, BDV, BN, UPCAST, TMA, i_b, i_hk)
        for start in range(mid_lo, mid_hi, BN):  # interior: no mask
            dq, dq2 = _band_dq_tile(q, q2, do, lse, delta, dq, dq2, k_base, v_base, start, o_t, sk_t,
                                    sv_t, TK, scale_log2, key_stride, key_offset, window, False,
                                    HAS_WINDOW, DK, DV, BDK, BDK2, BDV, BN, UPCAST, TMA, i_b, i_hk)
        for start in range(mid_hi, hi, BN):  # the diagonal (and the keys past TK)
            dq, dq2 = _band_dq_tile(q, q2, do, lse, delta, dq, dq2, k_base, v_base, start, o_t, sk_t,
                                    sv_t, TK, scale_log2, key_stride, key_offset, window, True,
                                    HAS_WINDOW, DK, DV, BDK, BDK2, BDV, BN, UPCAST, TMA, i_b, i_hk)
    else:
        for start in range(lo, hi, BN):
            dq, dq2 = _band_dq_tile(q, q2, do, lse, delta, dq, dq2, k_base, v_base, start, o_t, sk_t,
                                    sv_t, TK, scale_log2, key_stride, key_offset, window, True,
                                    HAS_WINDOW, DK, DV, BDK, BDK2, BDV, BN, UPCAST, TMA, i_b, i_hk)
    if GATED:
        g = tl.load(GATE + row, mask=m_t, other=0.0).to(tl.float32)
        dq = dq * g[:, None]
        if BDK2 > 0:
            dq2 = dq2 * g[:, None]
    dq = dq * scale
    m_dq = m_t[:, None] & (o_dk < DK)[None, :]
    if BDK2 > 0:
        dq2 = dq2 * scale
    if HAS_ADD:
        dq, dq2 = _add_rows(ADD, row, o_dk, m_dq, m_t, dq, dq2, DK, BDK, BDK2)
    tl.store(DQ + row[:, None] * DK + o_dk[None, :], dq.to(DQ.dtype.element_ty), mask=m_dq)
    if BDK2 > 0:
        store_tail(DQ + row * DK, dq2, m_t, BDK, BDK2)


@triton.jit
def _add_rows(X, row, o_dk, m_dq, m_t, dq, dq2, DK: tl.constexpr, BDK: tl.constexpr, BDK2: tl.constexpr):
    # dq [BM, BDK] (and the tail dq2 [BM, BDK2]) plus the rows `row` of X [.., DK], in float32
    dq += tl.load(X + row[:, None] * DK + o_dk[None, :], mask=m_dq, other=0.0).to(tl.float32)
    if BDK2 > 0:
        dq2 += load_tail(X + row * DK, m_t, True, BDK, BDK2, False, False).to(tl.float32)
    return dq, dq2


@triton.jit
def _band_dkv_tile(k, k2, v, k_pos, m_k, dk, dk2, dv, Q, DO, LSE, DELTA, GATE, i_b, i_h, start, sq_b, sq_t,
                   sq_h, T, HQ, scale_log2, window, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr,
                   DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDK2: tl.constexpr,
                   BDV: tl.constexpr, BM: tl.constexpr, UPCAST: tl.constexpr, GATED: tl.constexpr,
                   TMA: tl.constexpr = False):
    # one query tile [start, start + BM) of query head i_h for the key tile k [BN, BDK], v [BN, BDV]
    # (key positions k_pos [BN], in range m_k): dk [BN, BDK], dv [BN, BDV]; with a split head dim,
    # its tail k2 and dk2 [BN, BDK2]. GATED: the rows' gates scale p (dv = (g p)^T do and
    # ds = g p (dp - delta), delta = rowsum(o * do)), as a gradient g * do would. TMA: Q and DO are
    # tensor descriptors over [B, T, HQ, D] with blocks [1, BM, 1, BDK / BDV]
    o_t = start + tl.arange(0, BM)
    o_dk = tl.arange(0, BDK)
    o_dv = tl.arange(0, BDV)
    row = (i_b * T + o_t.to(tl.int64)) * HQ + i_h  # [BM]
    if TMA:
        q, do = tma_load_pair(Q, DO, i_b, start, i_h, BM, BDK, BDV)
    else:
        q_rows = Q + i_b * sq_b + i_h * sq_h + o_t.to(tl.int64) * sq_t  # [BM]
        q_ptrs = q_rows[:, None] + o_dk[None, :]  # [BM, BDK]
        do_ptrs = DO + row[:, None] * DV + o_dv[None, :]  # [BM, BDV]
    if MASKED:
        m_t = o_t < T
        if not TMA:
            q = tl.load(q_ptrs, mask=m_t[:, None] & (o_dk < DK)[None, :], other=0.0)
            do = tl.load(do_ptrs, mask=m_t[:, None] & (o_dv < DV)[None, :], other=0.0)
        lse = tl.load(LSE + row, mask=m_t, other=0.0)
        lse = tl.where(lse == float("-inf"), 0.0, lse) * 1.4426950408889634
        delta = tl.load(DELTA + row, mask=m_t, other=0.0)
        if GATED:
            g = tl.load(GATE + row, mask=m_t, other=0.0).to(tl.float32)
    else:  # every query < T and sees a key of this tile: lse is finite
        if not TMA:
            q = load_in_range(q_ptrs, (o_dk < DK)[None, :], BDK > DK)
            do = load_in_range(do_ptrs, (o_dv < DV)[None, :], BDV > DV)
        lse = tl.load(LSE + row) * 1.4426950408889634
        delta = tl.load(DELTA + row)
        if GATED:
            g = tl.load(GATE + row).to(tl.float32)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    s_t = tl.dot(k, tl.trans(q))  # [BN, BM]
    q2 = q  # the tail [BM, BDK2] (unused without one)
    if BDK2 > 0:
        q2 = load_tail(q_rows, o_t < T, MASKED, BDK, BDK2, UPCAST, False)
        s_t += tl.dot(k2, tl.trans(q2))
    p_t = tl.exp2(s_t * scale_log2 - lse[None, :])  # [BN, BM]
    if MASKED:
        valid = (k_pos[:, None] <= o_t[None, :]) & m_t[None, :] & m_k[:, None]
        if HAS_WINDOW:
            valid = valid & (k_pos[:, None] > o_t[None, :] - window)
        p_t = tl.where(valid, p_t, 0.0)
    if GATED:
        p_t = p_t * g[None, :]
    dv += tl.dot(p_t.to(do.dtype), do)
    dp_t = tl.dot(v, tl.trans(do))  # [BN, BM]
    ds_t = p_t * (dp_t - delta[None, :])
    dk += tl.dot(ds_t.to(q.dtype), q)
    if BDK2 > 0:
        dk2 += tl.dot(ds_t.to(q2.dtype), q2)
    return dk, dk2, dv


@triton.jit
def _band_bwd_dkv_kernel(
    Q, K, V, DO, LSE, DELTA, GATE, DK_OUT, DV_OUT,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
    T, TK, HQ, G, SPLIT, scale, scale_log2, key_stride, key_offset, window, longest_first,
    HAS_WINDOW: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDK2: tl.constexpr,
    BDV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, UPCAST: tl.constexpr,
    SPLIT_MASK: tl.constexpr, GATED: tl.constexpr, TMA: tl.constexpr = False,
):
    # One program per (key tile, kv head, head split); it loops over G // SPLIT query heads.
    # TMA: Q and DO are tensor descriptors (`_band_dkv_tile`).
    # DK_OUT / DV_OUT are contiguous [B, TK, HKV * SPLIT, D].
    if longest_first:  # grid (heads, key tiles): the first key tiles, which see the most queries, first
        i_bh = tl.program_id(0)
        i_n = tl.program_id(1)
    else:
        i_n = tl.program_id(0)
        i_bh = tl.program_id(1)
    HKV = HQ // G
    NH = HKV * SPLIT
    i_b = (i_bh // NH).to(tl.int64)
    i_hs = i_bh % NH  # (kv head, split) index
    i_hk = i_hs // SPLIT
    heads = G // SPLIT
    h_first = i_hk * G + (i_hs % SPLIT) * heads
    k0 = i_n * BN
    o_k = k0 + tl.arange(0, BN)
    o_dk = tl.arange(0, BDK)
    o_dv = tl.arange(0, BDV)
    m_k = o_k < TK
    k, k2 = load_rows(K + i_b * sk_b + i_hk * sk_h + o_k.to(tl.int64) * sk_t, m_k, DK, BDK, BDK2, UPCAST)
    v = tl.load(V + i_b * sv_b + i_hk * sv_h + o_k[:, None].to(tl.int64) * sv_t + o_dv[None, :],
                mask=m_k[:, None] & (o_dv < DV)[None, :], other=0.0)  # [BN, BDV]
    if UPCAST:
        v = v.to(tl.float32)
    k_pos = o_k * key_stride + key_offset
    lo = tl.minimum(k0 * key_stride + key_offset, T) // BM * BM
    hi = T
    if HAS_WINDOW:
        hi = tl.minimum((k0 + BN - 1) * key_stride + key_offset + window, T)
    dk, dk2 = split_zeros(BN, BDK, BDK2)
    dv = tl.zeros([BN, BDV], tl.float32)
    mid_lo, mid_hi = _query_interior(k0, T, TK, lo, hi, key_stride, key_offset, window, HAS_WINDOW, BM,
                                     BN)
    for j in range(0, heads):
        i_h = h_first + j
        if SPLIT_MASK:
            for start in range(lo, mid_lo, BM):  # the diagonal
                dk, dk2, dv = _band_dkv_tile(k, k2, v, k_pos, m_k, dk, dk2, dv, Q, DO, LSE, DELTA, GATE, i_b,
                                             i_h, start, sq_b, sq_t, sq_h, T, HQ, scale_log2, window, True,
                                             HAS_WINDOW, DK, DV, BDK, BDK2, BDV, BM, UPCAST, GATED, TMA)
            for start in range(mid_lo, mid_hi, BM):  # interior: no mask
                dk, dk2, dv = _band_dkv_tile(k, k2, v, k_pos, m_k, dk, dk2, dv, Q, DO, LSE, DELTA, GATE, i_b,
                                             i_h, start, sq_b, sq_t, sq_h, T, HQ, scale_log2, window, False,
                                             HAS_WINDOW, DK, DV, BDK, BDK2, BDV, BM, UPCAST, GATED, TMA)
            for start in range(mid_hi, hi, BM):  # the window's end and the queries past T
                dk, dk2, dv = _band_dkv_tile(k, k2, v, k_pos, m_k, dk, dk2, dv, Q, DO, LSE, DELTA, GATE, i_b,
                                             i_h, start, sq_b, sq_t, sq_h, T, HQ, scale_log2, window, True,
                                             HAS_WINDOW, DK, DV, BDK, BDK2, BDV, BM, UPCAST, GATED, TMA)
        else:
            for start in range(lo, hi, BM):
                dk, dk2, dv = _band_dkv_tile(k, k2, v, k_pos, m_k, dk, dk2, dv, Q, DO, LSE, DELTA, GATE, i_b,
                                             i_h, start, sq_b, sq_t, sq_h, T, HQ, scale_log2, window, True,
                                             HAS_WINDOW, DK, DV, BDK, BDK2, BDV, BM, UPCAST, GATED, TMA)
    out_row = (i_b * TK + o_k.to(tl.int64)) * NH + i_hs  # [BN]
    tl.store(DK_OUT + out_row[:, None] * DK + o_dk[None, :], (dk * scale).to(DK_OUT.dtype.element_ty),
             mask=m_k[:, None] & (o_dk < DK)[None, :])
    if BDK2 > 0:
        store_tail(DK_OUT + out_row * DK, dk2 * scale, m_k, BDK, BDK2)
    tl.store(DV_OUT + out_row[:, None] * DV + o_dv[None, :], dv.to(DV_OUT.dtype.element_ty),
             mask=m_k[:, None] & (o_dv < DV)[None, :])


def _strides(x):
    return x.stride(0), x.stride(1), x.stride(2)


# Launch configurations of the banded kernels, per branch ("cmp": compression, "swa": window) and
# kernel, as measured at 64k (d = 128, bf16):
BAND_CONFIGS = {
    # the compression forward in 128 x 64 tiles over 8 warps: 10.74 ms against 11.40 in 64 x 64 over 4;
    # with TMA copies 64 x 64 over 4 warps: 0.258 ms at 8k against 0.330 (the same at 64k);
    # dk/dv in 64 x 64 tiles over 4 warps: the forward+backward 53.2 ms against 54.8 in 64 x 128 over 8
    "cmp": dict(fwd=dict(BM=128, BN=64, num_warps=8, num_stages=3),
                fwd_tma=dict(BM=64, BN=64, num_warps=4, num_stages=3),
                dq=dict(BM=64, BN=64, num_warps=4, num_stages=2),
                dkv=dict(BM=64, BN=64, num_warps=4, num_stages=2)),
    # the window forward in 64 x 64 tiles over 4 warps: 4.20 ms against 4.82 in 128 x 64 over 8
    "swa": dict(fwd=dict(BM=64, BN=64, num_warps=4, num_stages=3),
                dq=dict(BM=64, BN=64, num_warps=4, num_stages=2),
                dkv=dict(BM=64, BN=64, num_warps=4, num_stages=2)),
}


# The kernels (per branch, as BAND_SPLIT_MASK) that read their streamed tiles through Hopper's tensor
# memory accelerator, one bulk copy per tile from a tensor descriptor (`tma_descriptor`), instead of
# per-thread loads (where `tma_ok`: Hopper or later, aligned rows): the key and value tiles of the
# forward and dq, the query and do tiles of dk/dv. The forwards at 64k: compression 9.60 ms against
# 10.60 with loads, window 3.45 against 3.97; the whole NSA's forward+backward 123.56 ms with these
# parts against 125.82 with every part (the compression's dq too) and 129.84-130.62 with none.
BAND_TMA = {"cmp": ("fwd", "dkv"), "swa": ("fwd", "dq", "dkv")}


def _tma(window, part: str, tma: bool | None = None) -> bool:
    """Whether a kernel copies its tiles with TMA (before `tma_ok` and the head dim have their say):
    `BAND_TMA`'s parts for None, every part for True, none for False."""
    return part in BAND_TMA[_branch(window)] if tma is None else tma


def _split_mask(window, part: str, split_mask: bool | None = None) -> bool:
    """Whether a kernel splits its loops (`BAND_SPLIT_MASK` for None)."""
    return part in BAND_SPLIT_MASK[_branch(window)] if split_mask is None else split_mask


def _launch(tiles: int, heads: int, longest_first: bool = True) -> tuple[tuple[int, int], int]:
    """(grid, longest_first) of a banded launch. Longest first: heads fastest and the longest tiles
    first (the last query tiles of the forward and dq, the first key tiles of dk/dv do up to 64x the
    work of the shortest in the compression's causal band), so that no long program launched last
    keeps its SM busy after the others are done. That grid puts the tiles on CUDA's grid y, which
    holds at most 65,535 tiles (4M tokens in 64-token tiles, 2M keys in the 32-key dk/dv tiles of
    q/k dims past 128): beyond that, and with `longest_first` False, index order."""
    longest_first = longest_first and tiles <= 65535
    return ((heads, tiles) if longest_first else (tiles, heads)), int(longest_first)


def _band_config(window, part, dtype=torch.bfloat16, dk=128, dv=128, tma=False):
    configs = BAND_CONFIGS[_branch(window)]
    cfg = dict(configs.get(f"{part}_tma", configs[part]) if tma else configs[part])
    if interpreting():
        cfg.update(BM=16, BN=16)
    elif wide_rows(dtype, dk, dv):
        # wide tiles beyond 64 x 64 can overflow shared memory (float32's dk/dv in 64 x 128 needs 262 KB
        # of the H200's 227 KB), and so can the forward at 3 stages (float32's three tf32 passes, `dot`:
        # 295 KB); tests/kernels/test_h200_resources.py compiles every default
        if cfg["BM"] * cfg["BN"] > 64 * 64:
            cfg.update(BM=64, BN=64, num_warps=4)
        if part == "fwd":
            cfg["num_stages"] = min(cfg["num_stages"], 2)
    if dk > 128 and part == "dkv":
        # dk/dv past 128 q/k dims holds three float32 accumulators of a key tile (dk in two parts when
        # split, `dk_tiles`) and spills (1,260 bytes at 192 / 128): 32-key tiles. At 192 / 128 and 64k
        # the forward+backward of the compression took 90.49 ms against 100.22 (8 warps 94.69), the
        # window's 28.63 against 31.56; the NSA's at 256 / 256 334.93 ms against 380.25
        cfg["BN"] = min(cfg["BN"], 32)
    # The paper's 192: 32-key dq tiles, and 2 forward stages (at 3 the window's forward needs 147,456
    # bytes, one program per SM). At 64k the compression's forward+backward took 90.56 ms against
    # 92.32, the window's 26.35 against 28.33, the window forward 4.75 against 6.57. At 256 they made
    # the NSA slower (349.47 ms forward+backward against 334.93), so 256 keeps the launches above.
    if 128 < dk <= 192 and part == "dq":
        cfg["BN"] = min(cfg["BN"], 32)
    if 128 < dk <= 192 and part == "fwd":
        cfg["num_stages"] = min(cfg["num_stages"], 2)
    return cfg


def band_forward(q, k, v, *, scale, key_stride, key_offset, window=None, tma=None, split_mask=None,
                 longest_first=True):
    """Banded attention forward. q [B,T,Hq,Dk], k [B,Tk,Hkv,Dk], v [B,Tk,Hkv,Dv] (last dim
    contiguous) -> o [B,T,Hq,Dv] (q.dtype), lse [B,T,Hq] float32 (natural log, -inf if empty).
    `tma`, `split_mask` (None: the defaults, `BAND_TMA` and `BAND_SPLIT_MASK`) and `longest_first`
    choose how the kernels read and order their tiles, not what they compute (up to float32
    rounding): tests and the benchmark pass them to cover or time a path."""
    B, T, HQ, DK = q.shape
    TK, HKV, DV = k.shape[1], k.shape[2], v.shape[3]
    o = torch.empty(B, T, HQ, DV, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, T, HQ, device=q.device, dtype=torch.float32)
    BDK, BDK2 = dk_tiles(DK)
    tma = _tma(window, "fwd", tma) and not BDK2 and tma_ok(k, v)
    cfg = _band_config(window, "fwd", q.dtype, DK, DV, tma=tma)
    BM = cfg["BM"]
    grid, longest_first = _launch(cdiv(T, BM), B * HQ, longest_first)
    kv = (tma_descriptor(k, cfg["BN"], BDK), tma_descriptor(v, cfg["BN"], pow2(DV))) if tma else (k, v)
    launcher(_band_fwd_kernel)[grid](
        q, *kv, o, lse, *_strides(q), *_strides(k), *_strides(v), *_strides(o),
        T, TK, HQ, HQ // HKV, scale * LOG2E, key_stride, key_offset, window or 0, longest_first,
        HAS_WINDOW=window is not None, DK=DK, DV=DV, BDK=BDK, BDK2=BDK2, BDV=pow2(DV),
        UPCAST=interpreting(), SPLIT_MASK=_split_mask(window, "fwd", split_mask), TMA=tma, **cfg,
    )
    return o, lse


def band_backward(q, k, v, o, lse, do, dlse=None, *, scale, key_stride, key_offset, window=None,
                  split_heads=False, delta=None, gate=None, tma=None, split_mask=None, longest_first=True):
    """Gradients of `band_forward`: (dq, dk, dv). `split_heads` runs one dk/dv program per query
    head and sums the group afterwards (many keys seen by long query ranges: compression). `delta`:
    float32 `[B, T, Hq]` rowsum(o * do) where the caller has it (then `dlse` must be None). `gate`
    (contiguous `[B, T, Hq]`, with `dlse` None): the output's gradient is `gate[..., None] * do`,
    applied inside the kernels (no scaled copy of do); `delta` stays rowsum(o * do). `tma`,
    `split_mask`, `longest_first`: as in `band_forward`."""
    do = do.contiguous()
    if gate is not None and dlse is not None:
        raise ValueError("band_backward: gate and dlse cannot be combined")
    if delta is None:
        delta = row_delta(o.contiguous(), do, dlse)
    band = dict(scale=scale, key_stride=key_stride, key_offset=key_offset, window=window, gate=gate, tma=tma,
                split_mask=split_mask, longest_first=longest_first)
    dq = band_backward_dq(q, k, v, lse, do, delta, **band)
    dk, dv = band_backward_dkv(q, k, v, lse, do, delta, split_heads=split_heads, **band)
    return dq, dk, dv


def _band_consts(window, dk: int, dv: int) -> dict:
    """The constexprs both backward kernels take from the branch and the head dims."""
    bdk, bdk2 = dk_tiles(dk)
    return dict(HAS_WINDOW=window is not None, DK=dk, DV=dv, BDK=bdk, BDK2=bdk2, BDV=pow2(dv),
                UPCAST=interpreting())


def band_backward_dq(q, k, v, lse, do, delta, *, scale, key_stride, key_offset, window=None, gate=None,
                     add=None, dtype=None, tma=None, split_mask=None, longest_first=True):
    """dq `[B, T, Hq, Dk]` of `band_forward` (as `band_backward`; do contiguous, delta float32
    `[B, T, Hq]`), plus `add` (contiguous, of dq's shape, any float dtype: the other branches' dq),
    summed in float32 and rounded once to `dtype` (default q's). `tma`, `split_mask`,
    `longest_first`: as in `band_forward`."""
    B, T, HQ, DK = q.shape
    TK, HKV, DV = k.shape[1], k.shape[2], v.shape[3]
    if add is not None and (add.shape != q.shape or not add.is_contiguous()):
        raise ValueError(f"band_backward_dq: add must be a contiguous tensor of shape {tuple(q.shape)}")
    dq = torch.empty(B, T, HQ, DK, device=q.device, dtype=dtype or q.dtype)
    BDK, BDK2 = dk_tiles(DK)
    cfg = _band_config(window, "dq", q.dtype, DK, DV)
    grid, longest_first = _launch(cdiv(T, cfg["BM"]), B * HQ, longest_first)
    tma = _tma(window, "dq", tma) and not BDK2 and tma_ok(k, v)
    kv = (tma_descriptor(k, cfg["BN"], BDK), tma_descriptor(v, cfg["BN"], pow2(DV))) if tma else (k, v)
    launcher(_band_bwd_dq_kernel)[grid](
        q, *kv, do, lse, delta, delta if gate is None else gate, dq, dq if add is None else add, *_strides(q),
        *_strides(k),
        *_strides(v),
        T, TK, HQ, HQ // HKV, scale, scale * LOG2E, key_stride, key_offset, window or 0, longest_first,
        **cfg, **_band_consts(window, DK, DV), SPLIT_MASK=_split_mask(window, "dq", split_mask),
        GATED=gate is not None,
        TMA=tma, HAS_ADD=add is not None,
    )
    return dq


def band_backward_dkv(q, k, v, lse, do, delta, *, scale, key_stride, key_offset, window=None, gate=None,
                      split_heads=False, tma=None, split_mask=None, longest_first=True):
    """(dk, dv) of `band_forward` (as `band_backward`; do contiguous, delta float32 `[B, T, Hq]`)."""
    B, T, HQ, DK = q.shape
    TK, HKV, DV = k.shape[1], k.shape[2], v.shape[3]
    G = HQ // HKV
    BDK, BDK2 = dk_tiles(DK)
    split = G if split_heads else 1
    buf_dtype = torch.float32 if split > 1 else k.dtype
    dk = torch.empty(B, TK, HKV * split, DK, device=q.device, dtype=buf_dtype)
    dv = torch.empty(B, TK, HKV * split, DV, device=q.device, dtype=buf_dtype)
    cfg = _band_config(window, "dkv", q.dtype, DK, DV)
    grid, longest_first = _launch(cdiv(TK, cfg["BN"]), B * HKV * split, longest_first)
    tma = _tma(window, "dkv", tma) and not BDK2 and tma_ok(q, do)
    q_src, do_src = q, do
    if tma:
        q_src, do_src = tma_descriptor(q, cfg["BM"], BDK), tma_descriptor(do, cfg["BM"], pow2(DV))
    launcher(_band_bwd_dkv_kernel)[grid](
        q_src, k, v, do_src, lse, delta, delta if gate is None else gate, dk, dv, *_strides(q), *_strides(k),
        *_strides(v),
        T, TK, HQ, G, split, scale, scale * LOG2E, key_stride, key_offset, window or 0,
        longest_first, **cfg, **_band_consts(window, DK, DV),
        SPLIT_MASK=_split_mask(window, "dkv", split_mask), GATED=gate is not None, TMA=tma,
    )
    if split > 1:
        dk = dk.view(B, TK, HKV, split, DK).sum(3).to(k.dtype)  # [B, TK, HKV, DK]
        dv = dv.view(B, TK, HKV, split, DV).sum(3).to(v.dtype)  # [B, TK, HKV, DV]
    return dk, dv
