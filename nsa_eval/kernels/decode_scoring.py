"""The Triton decode's block selection, steps 1-2 of `decode.nsa_decode`: the compressed keys' partial
softmax, the selection blocks' importances and the top-k of one new query per sequence; and the
partial-softmax helpers that step 3 (`decode.py`) shares.

1. `decode_cmp_kernel`, one program per (split, sequence, KV head), all G query heads of the group as
   rows: split i walks tiles i, i + splits, ... of 64 compressed keys (pipelined loads; the visible
   tiles spread evenly over the splits whatever the query position) with an online softmax, and
   stores one partial (max, sum, p @ v). For step 2 it stores, per tile, the tile's probabilities
   (relative to the tile's max) summed onto the selection blocks they overlap, and that max: 17 + 1
   values per row and tile against 64 scores. Where a tile does not hold whole selection blocks
   (`tile_layout`), it stores every score instead (L2 evict-last).
2. `decode_importance_kernel`, one program per `IMP_TILES_PER_PROGRAM` tiles' selection blocks (or
   `IMP_CHUNKS_PER_PROGRAM` chunks of blocks from the stored scores), sequence and KV head: the
   compression lse from the split partials in one vector load, then the importances (each tile's block
   sums times exp(tile max - lse), plus the previous tile's spill into its first blocks, summed over
   the group's heads). The program that finishes last for its (sequence, KV head) takes the top-k of
   the whole row as `topk.topk_blocks` does: forced blocks first, ties to the lower index, through the
   lean filter or the arg-max passes. The same launch holds the window's chunks (`WIN_TILES_PER_PROGRAM`
   tiles of 64 keys): the window depends on no selection, and its loads fill the memory bus while the
   top-k runs.

"Finishes last": every program stores its results, passes a CTA barrier and increments the row's
counter with an acq_rel atomic (one thread); the one that sees `programs - 1` reads the others'
results with L2 loads (`.cg`). The counter lives in a per-call buffer zeroed by step 1, so the
launches replay from a CUDA graph.
"""

from __future__ import annotations

import triton
import triton.language as tl

from nsa_eval.kernels._triton_utils import cdiv, dot, softmax_start
from nsa_eval.kernels.topk import block_keys, lean_filtered_top


@triton.jit
def load_q(Q, i_b, i_hk, G, sq_b, sq_h, o_r, o_dk, DK: tl.constexpr, UPCAST: tl.constexpr):
    q = tl.load(Q + i_b * sq_b + (i_hk * G + o_r)[:, None] * sq_h + o_dk[None, :],
                mask=(o_r < G)[:, None] & (o_dk < DK)[None, :], other=0.0)  # [M, BDK]
    if UPCAST:
        q = q.to(tl.float32)
    return q


@triton.jit
def query_pos(LENS, i_b):
    # position of sequence i_b's query: its cache length (int32 or int64) - 1. Read in the kernels, so
    # that the decode launches no kernel of its own for it (one node fewer in a CUDA graph)
    return tl.load(LENS + i_b).to(tl.int32) - 1


@triton.jit
def program_rows(LENS, i_bh, HKV, BDK: tl.constexpr, BDV: tl.constexpr, M: tl.constexpr):
    # sequence i_b, KV head i_hk and query position t of program row i_bh; offsets of the group's M
    # rows and of the key and value columns
    i_b = (i_bh // HKV).to(tl.int64)
    i_hk = i_bh % HKV
    t = query_pos(LENS, i_b)
    o_r = tl.arange(0, M)
    o_dk = tl.arange(0, BDK)
    o_dv = tl.arange(0, BDV)
    return i_b, i_hk, t, o_r, o_dk, o_dv


@triton.jit
def partial_softmax(q, K, V, i_b, i_hk, o_k, m_k, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, o_r, o_dk, o_dv, G,
                     scale_log2, DK: tl.constexpr, DV: tl.constexpr, UPCAST: tl.constexpr):
    # scores and partial softmax of the M rows (G used) over the BN cache positions o_k (m_k: usable) of
    # (i_b, KV head i_hk); returns s [M, BN], m [M], l [M], acc [M, BDV]
    k_ptrs = K + i_b * sk_b + i_hk * sk_h + o_k[:, None].to(tl.int64) * sk_t + o_dk[None, :]
    v_ptrs = V + i_b * sv_b + i_hk * sv_h + o_k[:, None].to(tl.int64) * sv_t + o_dv[None, :]
    valid = m_k[None, :] & (o_r < G)[:, None]
    k = tl.load(k_ptrs, mask=m_k[:, None] & (o_dk < DK)[None, :], other=0.0)  # [BN, BDK]
    v = tl.load(v_ptrs, mask=m_k[:, None] & (o_dv < DV)[None, :], other=0.0)  # [BN, BDV]
    s, m, l, acc, _ = _tile_softmax(q, k, v, valid, scale_log2, UPCAST)
    return s, m, l, acc


@triton.jit
def _tile_softmax(q, k, v, valid, scale_log2, UPCAST: tl.constexpr):
    # q [M, BDK], k [BN, BDK], v [BN, BDV] -> s [M, BN], m [M], l [M], acc [M, BDV], p [M, BN] (exp2(s - m))
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = dot(q, tl.trans(k)) * scale_log2  # [M, BN]
    s = tl.where(valid, s, float("-inf"))
    m = tl.max(s, 1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    p = tl.exp2(s - m_safe[:, None])
    return s, m, tl.sum(p, 1), dot(p.to(v.dtype), v), p


@triton.jit
def _n_visible(t, TC, block_len, stride):
    # compressed blocks that end at or before position t
    return tl.minimum(tl.where(t >= block_len - 1, (t - block_len + 1) // stride + 1, 0), TC)


@triton.jit
def merge_softmax(m_i, l_i, acc, m, l, o):
    # two partial softmaxes (max [M], sum [M], acc [M, BDV]) -> one
    m_new = tl.maximum(m_i, m)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp2(m_i - m_safe)
    b = tl.exp2(m - m_safe)
    return m_new, l_i * a + l * b, acc * a[:, None] + o * b[:, None]


@triton.jit
def store_partial(PM, PL, PO, part, m, l, acc, o_r, o_dv, M: tl.constexpr, BDV: tl.constexpr):
    # partial `part` of the softmax: max m [M], sum l [M], acc [M, BDV] (PM, PL: [.., M]; PO: [.., M, BDV])
    tl.store(PM + part * M + o_r, m)
    tl.store(PL + part * M + o_r, l)
    tl.store(PO + (part * M + o_r[:, None]) * BDV + o_dv[None, :], acc)


@triton.jit
def _window_partial(q, KW, VW, i_b, i_hk, t, SW, window, i_w, skw_b, skw_t, skw_h, svw_b, svw_t, svw_h,
                    o_r, o_dk, o_dv, G, scale_log2, DK: tl.constexpr, DV: tl.constexpr, M: tl.constexpr,
                    BDV: tl.constexpr, BW: tl.constexpr, WT: tl.constexpr, UPCAST: tl.constexpr):
    # partial softmax over window chunk i_w (WT tiles of BW keys from max(t - window + 1, 0)); the window
    # cache KW/VW has SW rows and holds position p in row p % SW (a ring of SW >= window rows, or the
    # whole cache, SW = S > t)
    m_i, l_i, acc = softmax_start(M, BDV)
    start = tl.maximum(t - window + 1, 0) + i_w * (WT * BW)
    for j in tl.static_range(WT):
        o_k = start + j * BW + tl.arange(0, BW)
        m_k = o_k <= t
        _, m, l, o = partial_softmax(q, KW, VW, i_b, i_hk, o_k % SW, m_k, skw_b, skw_t, skw_h, svw_b, svw_t,
                                     svw_h, o_r, o_dk, o_dv, G, scale_log2, DK, DV, UPCAST)
        m_i, l_i, acc = merge_softmax(m_i, l_i, acc, m, l, o)
    return m_i, l_i, acc


# ---------------------------------------------------------------------------------------------
# step 1: the compressed keys
# ---------------------------------------------------------------------------------------------
@triton.jit
def decode_cmp_kernel(
    Q, KC, VC, LENS, SC, TI, TS, TM, PM, PL, PO, CNT,
    sq_b, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
    TC, HKV, G, NCMP, NPART, SC_LEN, NTILES, scale_log2, block_len, stride, select_size,
    DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, M: tl.constexpr,
    BC: tl.constexpr, TILE_IMP: tl.constexpr, JT: tl.constexpr, JW: tl.constexpr, NSP: tl.constexpr,
    MAP_BF16: tl.constexpr, UPCAST: tl.constexpr,
):
    # Step 1, one program per (compression split, sequence x KV head): partials at PM/PL/PO[i_bh, i_s]
    # (PM, PL: [B*HKV, NPART, M]; PO: [.., M, BDV]). TILE_IMP (`tile_layout`): per tile, TI
    # [B*HKV, NTILES, M, JT] / TS [.., M, NSP] the probabilities (relative to the tile max TM
    # [B*HKV, NTILES, M]) mapped onto the tile's JT selection blocks / the NSP blocks after them;
    # otherwise SC [B*HKV, M, SC_LEN] the scores.
    i_s = tl.program_id(0)
    i_bh = tl.program_id(1)
    if i_s == 0:
        tl.store(CNT + i_bh, 0)  # the arrival counter of step 2 (launched after this one)
    i_b, i_hk, t, o_r, o_dk, o_dv = program_rows(LENS, i_bh, HKV, BDK, BDV, M)
    _cmp_split(Q, KC, VC, SC, TI, TS, TM, PM, PL, PO, i_s, i_bh, i_b, i_hk, t, sq_b, sq_h, sk_b, sk_t,
               sk_h, sv_b, sv_t, sv_h, TC, G, NCMP, NPART, SC_LEN, NTILES, scale_log2, block_len, stride,
               select_size, o_r, o_dk, o_dv, DK, DV, M, BDV, BC, TILE_IMP, JT, JW, NSP, MAP_BF16, UPCAST)


@triton.jit
def _cmp_split(Q, KC, VC, SC, TI, TS, TM, PM, PL, PO, i_s, i_bh, i_b, i_hk, t, sq_b, sq_h, sk_b, sk_t,
               sk_h, sv_b, sv_t, sv_h, TC, G, NCMP, NPART, SC_LEN, NTILES, scale_log2, block_len, stride,
               select_size, o_r, o_dk, o_dv, DK: tl.constexpr, DV: tl.constexpr, M: tl.constexpr,
               BDV: tl.constexpr, BC: tl.constexpr, TILE_IMP: tl.constexpr, JT: tl.constexpr,
               JW: tl.constexpr, NSP: tl.constexpr, MAP_BF16: tl.constexpr, UPCAST: tl.constexpr):
    # compression split i_s of row i_bh: tiles i_s, i_s + NCMP, ... of BC compressed keys (the visible
    # tiles spread evenly over the splits at any t), one partial softmax (empty where the split has no
    # visible tile); per tile its scores (SC) or, with TILE_IMP, its selection-block sums (TI, TS) and
    # max (TM)
    n_vis = _n_visible(t, TC, block_len, stride)
    n_vis_tiles = tl.cdiv(n_vis, BC)
    if i_s < n_vis_tiles:
        q = load_q(Q, i_b, i_hk, G, sq_b, sq_h, o_r, o_dk, DK, UPCAST)
        k_base = KC + i_b * sk_b + i_hk * sk_h
        v_base = VC + i_b * sv_b + i_hk * sv_h
        sc_rows = SC + (i_bh * M + o_r[:, None]).to(tl.int64) * SC_LEN  # [M, 1]
        if TILE_IMP:
            # tokens shared by compressed block c of a tile and selection block j counted from the
            # tile's first one (JT per tile, then the NSP the tile's last blocks reach)
            o_c = tl.arange(0, BC)[:, None] * stride
            o_w = tl.arange(0, JW)
            s_lo = o_w[None, :] * select_size
            w = _overlap(o_c, o_c + block_len, s_lo, s_lo + select_size).to(tl.float32)  # [BC, JW]
            if MAP_BF16:
                w = w.to(tl.bfloat16)
            own = (o_w < JT)[None, :]
            spill = ((o_w >= JT) & (o_w < JT + NSP))[None, :]
        m_i, l_i, acc = softmax_start(M, BDV)
        for tile in range(i_s, n_vis_tiles, NCMP):
            o_k = tile * BC + tl.arange(0, BC)  # [BC] compressed block indices
            m_k = o_k < n_vis
            k_ptrs = k_base + o_k[:, None].to(tl.int64) * sk_t + o_dk[None, :]
            v_ptrs = v_base + o_k[:, None].to(tl.int64) * sv_t + o_dv[None, :]
            valid = m_k[None, :] & (o_r < G)[:, None]
            # read once: evict first from L2, so that the scores (read by step 2) stay there
            k = tl.load(k_ptrs, mask=m_k[:, None] & (o_dk < DK)[None, :], other=0.0,
                        eviction_policy="evict_first")  # [BC, BDK]
            v = tl.load(v_ptrs, mask=m_k[:, None] & (o_dv < DV)[None, :], other=0.0,
                        eviction_policy="evict_first")  # [BC, BDV]
            s, m, l, o, p = _tile_softmax(q, k, v, valid, scale_log2, UPCAST)
            if TILE_IMP:  # [M, JW] probabilities times shared tokens over stride
                if MAP_BF16:
                    p_hi = p.to(tl.bfloat16)
                    u = dot(p_hi, w) + dot((p - p_hi.to(tl.float32)).to(tl.bfloat16), w)
                else:
                    u = tl.dot(p, w, input_precision="tf32x3")
                u = u / stride
                rows = ((i_bh * NTILES + tile) * M + o_r).to(tl.int64)  # [M]
                tl.store(TI + rows[:, None] * JT + o_w[None, :], u, mask=own)
                tl.store(TS + rows[:, None] * NSP + (o_w - JT)[None, :], u, mask=spill)
                tl.store(TM + rows, m)
            else:
                tl.store(sc_rows + o_k[None, :], s, eviction_policy="evict_last")
            m_i, l_i, acc = merge_softmax(m_i, l_i, acc, m, l, o)
        store_partial(PM, PL, PO, i_bh * NPART + i_s, m_i, l_i, acc, o_r, o_dv, M, BDV)
    else:  # no visible tile: an empty partial, so that steps 2 and 4 merge all NCMP without t
        m_i, l_i, acc = softmax_start(M, BDV)
        store_partial(PM, PL, PO, i_bh * NPART + i_s, m_i, l_i, acc, o_r, o_dv, M, BDV)


@triton.jit
def _overlap(c_lo, c_hi, s_lo, s_hi):
    return tl.maximum(tl.minimum(c_hi, s_hi) - tl.maximum(c_lo, s_lo), 0)


# ---------------------------------------------------------------------------------------------
# step 2: importances, the top-k, the window
# ---------------------------------------------------------------------------------------------
@triton.jit
def decode_importance_kernel(
    LENS, SC, TI, TS, TM, PM, PL, IMP, BI, CNT, SCR, Q, KW, VW, PO,
    sq_b, sq_h, skw_b, skw_t, skw_h, svw_b, svw_t, svw_h,
    TC, HKV, G, NPART, CMP_TILE, SC_LEN, NTILES, NS, block_len, stride, select_size, num_selected, num_init,
    num_local, NIMP, NCMP, NSELP, SW, window, scale_log2,
    M: tl.constexpr, BNS: tl.constexpr, RATIO: tl.constexpr, SPILL: tl.constexpr, NPB: tl.constexpr,
    BNS_ALL: tl.constexpr, NSEL2: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr,
    BDV: tl.constexpr, BW: tl.constexpr, WT: tl.constexpr, CPP: tl.constexpr, TILE_IMP: tl.constexpr,
    CT: tl.constexpr, JT: tl.constexpr, NSP: tl.constexpr, NSPP: tl.constexpr, LEAN: tl.constexpr,
    CAP: tl.constexpr, UPCAST: tl.constexpr,
):
    # Step 2, programs 0 .. NIMP-1 of a sequence x KV head: importances of CPP chunks of BNS selection
    # blocks each (from the scores SC) or, with TILE_IMP, of the JT blocks of CT tiles each (from TI, TS,
    # TM of step 1), and the top-k by the last of them to finish; NIMP ..: window chunks (partials
    # NCMP + NSELP + i, after step 3's) over the SW-row window cache KW/VW (`_window_partial`). IMP
    # [B*HKV, NS] float32; BI [B*HKV, num_selected] int32.
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1)
    if i_c >= NIMP:
        i_b, i_hk, t, o_r, o_dk, o_dv = program_rows(LENS, i_bh, HKV, BDK, BDV, M)
        q = load_q(Q, i_b, i_hk, G, sq_b, sq_h, o_r, o_dk, DK, UPCAST)
        m_i, l_i, acc = _window_partial(q, KW, VW, i_b, i_hk, t, SW, window, i_c - NIMP, skw_b, skw_t, skw_h,
                                        svw_b, svw_t, svw_h, o_r, o_dk, o_dv, G, scale_log2, DK, DV, M, BDV,
                                        BW, WT, UPCAST)
        store_partial(PM, PL, PO, i_bh * NPART + NCMP + NSELP + i_c - NIMP, m_i, l_i, acc, o_r, o_dv, M, BDV)
    else:
        if TILE_IMP:
            _importance_from_tiles(LENS, TI, TS, TM, PM, PL, IMP, i_c, i_bh, TC, HKV, NPART, CMP_TILE, NTILES,
                                   NS, block_len, stride, select_size, NCMP, M, NPB, CT, JT, NSP, NSPP)
        else:
            _importance_from_scores(LENS, SC, PM, PL, IMP, i_c, i_bh, TC, HKV, G, NPART, SC_LEN, NS,
                                    block_len, stride, select_size, NCMP, M, BNS, RATIO, SPILL, NPB, CPP)
        # the last program of this (sequence, KV head) to arrive takes the top-k of the whole row
        _last_takes_topk(IMP, BI, CNT, SCR, i_bh, query_pos(LENS, i_bh // HKV), NS, select_size,
                         num_selected, num_init, num_local, NIMP, BNS_ALL, NSEL2, LEAN, CAP)


@triton.jit
def _row_lse(PM, PL, i_bh, NPART, NCMP, o_r, M: tl.constexpr, NPB: tl.constexpr):
    # lse [M] (log2 units; 0 for a row with no visible key) of every head of row i_bh from the NCMP
    # split partials of step 1, one vector load
    o_p = tl.arange(0, NPB)
    offs = (i_bh * NPART + o_p[:, None]) * M + o_r[None, :]  # [NPB, M]
    m = tl.load(PM + offs, mask=(o_p < NCMP)[:, None], other=float("-inf"))
    l = tl.load(PL + offs, mask=(o_p < NCMP)[:, None], other=0.0)
    m_max = tl.max(m, 0)  # [M]
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_sum = tl.sum(l * tl.exp2(m - m_safe[None, :]), 0)  # [M]
    return tl.where(l_sum > 0, m_safe + tl.log2(tl.where(l_sum > 0, l_sum, 1.0)), 0.0)


@triton.jit
def _importance_from_tiles(LENS, TI, TS, TM, PM, PL, IMP, i_c, i_bh, TC, HKV, NPART, CMP_TILE, NTILES, NS,
                           block_len, stride, select_size, NCMP, M: tl.constexpr, NPB: tl.constexpr,
                           CT: tl.constexpr, JT: tl.constexpr, NSP: tl.constexpr, NSPP: tl.constexpr):
    # importances of the selection blocks of tiles i_c * CT .. + CT - 1: each tile's sums rescaled
    # from its max to the head's lse, plus the previous tile's spill into the first NSP blocks, summed
    # over the group's heads (rows of absent heads hold zeros and a -inf max)
    t = query_pos(LENS, i_bh // HKV)
    o_t = i_c * CT + tl.arange(0, CT)  # [CT] tiles
    if i_c * CT * JT <= t // select_size:
        # every load first, the lse's reductions after: the loads' latencies overlap
        n_tiles = tl.cdiv(_n_visible(t, TC, block_len, stride), CMP_TILE)  # tiles step 1 wrote
        o_r = tl.arange(0, M)
        rows = (i_bh * NTILES + o_t[:, None]).to(tl.int64) * M + o_r[None, :]  # [CT, M]
        o_j = tl.arange(0, JT)
        has = (o_t < n_tiles)[:, None]
        tile_max = tl.load(TM + rows, mask=has, other=float("-inf"))  # [CT, M]
        u = tl.load(TI + rows[:, :, None] * JT + o_j[None, None, :], mask=has[:, :, None], other=0.0)
        if NSP > 0:
            o_e = tl.arange(0, NSPP)
            prev = rows - M  # the previous tile
            has_prev = ((o_t >= 1) & (o_t <= n_tiles))[:, None]
            prev_max = tl.load(TM + prev, mask=has_prev, other=float("-inf"))
            u_prev = tl.load(TS + prev[:, :, None] * NSP + o_e[None, None, :],  # [CT, M, NSPP]
                             mask=has_prev[:, :, None] & (o_e < NSP)[None, None, :], other=0.0)
        lse = _row_lse(PM, PL, i_bh, NPART, NCMP, o_r, M, NPB)
        imp = tl.sum(u * tl.exp2(tile_max - lse[None, :])[:, :, None], 1)  # [CT, JT]
        if NSP > 0:
            spill = tl.sum(u_prev * tl.exp2(prev_max - lse[None, :])[:, :, None], 1)  # [CT, NSPP]
            imp += tl.sum(tl.where(o_j[None, :, None] == o_e[None, None, :], spill[:, None, :], 0.0), 2)
        cols = tl.reshape(o_t[:, None] * JT + o_j[None, :], [CT * JT])
        tl.store(IMP + i_bh.to(tl.int64) * NS + cols, tl.reshape(imp, [CT * JT]), mask=cols < NS)


@triton.jit
def _importance_from_scores(LENS, SC, PM, PL, IMP, i_c, i_bh, TC, HKV, G, NPART, SC_LEN, NS, block_len,
                            stride, select_size, NCMP, M: tl.constexpr, BNS: tl.constexpr,
                            RATIO: tl.constexpr, SPILL: tl.constexpr, NPB: tl.constexpr, CPP: tl.constexpr):
    # importances of the program's CPP chunks of BNS selection blocks from step 1's stored scores: the
    # probabilities recomputed and mapped onto the blocks as in prefill (the weight spilling into a chunk
    # from the compressed blocks just before it comes from a SPILL-wide tile), summed over the group
    BC: tl.constexpr = BNS * RATIO  # compressed blocks starting in this chunk of BNS selection blocks
    i_b = i_bh // HKV
    t = query_pos(LENS, i_b)
    j_first = i_c * (BNS * CPP)  # this program's first selection block
    if j_first <= t // select_size:
        n_vis = _n_visible(t, TC, block_len, stride)
        o_r = tl.arange(0, M)
        m_r = o_r < G
        lse = _row_lse(PM, PL, i_bh, NPART, NCMP, o_r, M, NPB)  # [M]

        # token overlap of compressed blocks with the chunk's selection blocks, in units of stride,
        # positions relative to the chunk start j0 * select_size (= j0 * RATIO * stride)
        o_j = tl.arange(0, BNS)
        s_lo = o_j[None, :] * select_size
        o_c = tl.arange(0, BC)
        c_lo = o_c[:, None] * stride
        w_main = _overlap(c_lo, c_lo + block_len, s_lo, s_lo + select_size).to(tl.float32) / stride
        # w_main [BC, BNS]; w_spill [SPILL, BNS] for the SPILL compressed blocks before the chunk
        o_e = tl.arange(0, SPILL)
        e_lo = (o_e[:, None] - SPILL) * stride
        w_spill = _overlap(e_lo, e_lo + block_len, s_lo, s_lo + select_size).to(tl.float32) / stride

        sc_rows = SC + (i_bh * M + o_r[:, None]).to(tl.int64) * SC_LEN  # [M, 1]
        # the program's CPP chunks, unrolled so that their loads can all be issued early (a runtime
        # loop took step 2 from 38 to 54 us at 64k); chunks past t's block read nothing and store 0
        for cc in tl.static_range(CPP):
            j0 = j_first + cc * BNS
            o_k = j0 * RATIO + o_c  # [BC]
            vis = (o_k < n_vis)[None, :] & m_r[:, None]  # [M, BC]
            s = tl.load(sc_rows + o_k[None, :], mask=vis, other=float("-inf"), eviction_policy="evict_first")
            p = tl.where(vis, tl.exp2(s - lse[:, None]), 0.0)  # [M, BC]
            imp = tl.sum(tl.dot(p, w_main, input_precision="tf32x3"), 0)  # [BNS] summed over the group
            o_k = j0 * RATIO - SPILL + o_e  # [SPILL] the compressed blocks just before the chunk
            vis = ((o_k < n_vis) & (o_k >= 0))[None, :] & m_r[:, None]
            s = tl.load(sc_rows + o_k[None, :], mask=vis, other=float("-inf"))
            p = tl.where(vis, tl.exp2(s - lse[:, None]), 0.0)  # [M, SPILL]
            imp += tl.sum(tl.dot(p, w_spill, input_precision="tf32x3"), 0)
            cols = j0 + o_j
            tl.store(IMP + i_bh.to(tl.int64) * NS + cols, imp, mask=cols < NS)


@triton.jit
def _last_takes_topk(IMP, BI, CNT, SCR, i_bh, t, NS, select_size, num_selected, num_init, num_local, NIMP,
                     BNS_ALL: tl.constexpr, NSEL2: tl.constexpr, LEAN: tl.constexpr, CAP: tl.constexpr):
    # LEAN (`topk.lean_fits`): the lean filter first (SCR [B*HKV, 2 * CAP] int32), as `topk_blocks`
    # does; the arg-max passes over the whole row where it does not take the row
    tl.debug_barrier()  # all threads' stores before the release of the counter increment
    arrived = tl.atomic_add(CNT + i_bh, 1, sem="acq_rel", scope="gpu")
    if arrived == NIMP - 1:
        o_n = tl.arange(0, NSEL2)
        bi_row = BI + i_bh.to(tl.int64) * num_selected
        done = 0
        if LEAN:  # through L2 (.cg) after the acquire: other programs of this launch wrote the row
            done = lean_filtered_top(IMP, BI, SCR, i_bh.to(tl.int64), t // select_size, num_selected,
                                     num_init, num_local, NS, BNS_ALL, NSEL2, CAP, ".cg")
        if done == 0:
            chosen = _topk_row(IMP + i_bh.to(tl.int64) * NS, t, NS, select_size, num_selected, num_init,
                               num_local, BNS_ALL)  # [BNS_ALL]
            o_a = tl.arange(0, BNS_ALL)
            rank = tl.cumsum(chosen, 0) - 1  # [BNS_ALL] output slot of each chosen block
            tl.store(bi_row + o_n, tl.full([NSEL2], -1, tl.int32),
                     mask=(o_n >= tl.sum(chosen, 0)) & (o_n < num_selected))
            tl.store(bi_row + rank, o_a, mask=chosen > 0)


@triton.jit
def _topk_row(IMP_ROW, t, NS, select_size, num_selected, num_init, num_local, BNS: tl.constexpr):
    # the blocks of one (sequence, KV head) as `topk_blocks`: forced blocks first, blocks after t
    # excluded, then the largest importances, ties to the lower index -> chosen [BNS] (0/1).
    # IMP_ROW was written by other programs of this launch: .cg loads (L2), after the acquire.
    o_j = tl.arange(0, BNS)
    cur = t // select_size  # block holding t
    imp = tl.load(IMP_ROW + o_j, mask=o_j < NS, other=0.0, cache_modifier=".cg")
    # int64 keys ordered like (importance, -index), forced blocks +inf, blocks after t -1: one max
    # reduction per pick
    key = block_keys(imp, o_j, cur, num_init, num_local, BNS)  # [BNS]
    forced = ((o_j < num_init) | (o_j > cur - num_local)) & (o_j <= cur)
    n_forced = tl.sum(forced.to(tl.int32), 0)
    if n_forced <= num_selected:  # take the forced blocks at once, pick the rest
        chosen = forced.to(tl.int32)
        key = tl.where(forced, -1, key)
        picks = num_selected - n_forced
    else:  # more forced blocks than slots: the lowest-index ones, as +inf ties
        chosen = tl.zeros([BNS], tl.int32)
        picks = num_selected + 0 * n_forced
    for _ in range(picks):
        best = tl.max(key, 0)
        first = BNS - 1 - (best & 0xFFFFFFFF).to(tl.int32)  # the index in the low 32 bits
        hit = (o_j == first) & (best >= 0)
        chosen = tl.where(hit, 1, chosen)
        key = tl.where(hit, -1, key)
    return chosen


def tile_layout(tile_keys: int, block_len: int, stride: int, select_size: int) -> tuple[int, int] | None:
    """(JT, NSP) of step 2's importances from per-tile sums, for tiles of `tile_keys` compressed keys: the
    selection blocks a tile holds, and those past them that its last compressed blocks reach. None
    where the per-tile sums do not apply (a tile holds no whole number of selection blocks, or its
    blocks reach past the next tile): the decode then maps the stored scores."""
    ratio = select_size // stride
    if select_size % stride or tile_keys % ratio:
        return None
    jt = tile_keys // ratio
    nsp = max(0, cdiv((tile_keys - 1) * stride + block_len, select_size) - jt)
    return (jt, nsp) if nsp <= jt else None
