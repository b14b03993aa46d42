"""Triton NSA decode: one new query per sequence against caches of raw and compressed keys/values.

The work is split over the blocks actually read (split-K), so the cost grows with the number of
blocks, not with the cache size. Two implementations, chosen by the module flag `DECODE_VARIANT`:

`"fused"` (default), four launches (three with `MERGE_IN_ATTN`):
1. `_decode_cmp_split_kernel`, one program per (split, sequence, KV head), all G query heads of the
   group as rows: split i walks tiles i, i + splits, ... of 64 compressed keys (pipelined loads; the
   visible tiles spread evenly over the splits whatever the query position) with an online softmax,
   and stores one partial (max, sum, p @ v). For step 2 it stores, per tile, the tile's probabilities
   (relative to the tile's max) summed onto the selection blocks they overlap, and that max
   (`DECODE_IMPORTANCE = "tiles"`), or every score ("scores", L2 evict-last). The number of
   splits fills the GPU (about `CMP_PROGRAMS_PER_SM` programs per SM, at most 32 splits), so each
   (sequence, KV head) has a few partials instead of one per 64 keys. Split 0 also zeroes the
   arrival counters of steps 2 and 3.
2. `_decode_importance_split_kernel`, one program per (`IMP_TILES_PER_PROGRAM` tiles' selection
   blocks, sequence, KV head): the compression lse from the split partials in one vector load, then
   the importances: each tile's block sums times exp(tile max - lse), plus the previous tile's
   spill into its first blocks, summed over the group's heads. With "scores", one program per
   `IMP_CHUNKS_PER_PROGRAM` chunks of selection blocks recomputes the probabilities from the stored
   scores and maps them (same overlap weights and group sum as prefill; weight spilling into the
   chunk from the compressed blocks just before it comes from a 16-wide tile). The program that
   finishes last for its (sequence, KV head) takes the top-k of the whole row, like `topk_blocks`:
   forced blocks taken at once, then the largest of int64 keys ordered like (importance, -block
   index), so ties go to the lower index: the lean filter of `topk.py` (the keys at or above a
   bound from 32 group maxima compacted and ranked), or for rows it does not take one max reduction
   per pick over the whole row (with `TOPK_IN_STEP2 = False`, `topk_blocks` does it in a launch of
   its own). With `WINDOW_STEP = 2`
   (default) the same launch has one more program per window chunk (`WIN_TILES_PER_PROGRAM` tiles
   of 64 keys): the window branch does not depend on the selection, and its loads fill the memory
   bus while the top-k runs (`WINDOW_STEP = 1` or 3 puts them in step 1 or 3 instead).
3. `_decode_attn_fused_kernel`, one program per (`SEL_PER_PROGRAM` selected-block slots, or window
   chunk with `WINDOW_STEP = 3`; sequence, KV head): a partial softmax.
4. `_decode_merge_kernel`, one program per (DVC output columns, 32 at d = 128; sequence x KV
   head): the partials of the three branches merged (one load of all partials of each branch, then
   its merge weights from one load of its (max, sum) rows, gates folded in) and the output written. With
   `MERGE_IN_ATTN` the program of step 3 that finishes last for its (sequence, KV head) does this for
   all columns instead: one launch fewer, but a serial tail (run 9: 39 us for step 3 against 16 + 8).
"Finishes last": every program stores its results, passes a CTA barrier and increments the row's
counter with an acq_rel atomic (one thread); the one that sees `programs - 1` reads the others'
results with L2 loads (`.cg`). The counters live in a per-call buffer zeroed by step 1, so the
launches replay from a CUDA graph.

`"v1"`, five launches, the first split-K version, kept for comparison: `decode_v1.py`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from nsa_eval.kernels import topk
from nsa_eval.kernels._triton_utils import (
    LOG2E,
    cdiv,
    default_scale,
    dot,
    interpreting,
    launcher,
    pow2,
    softmax_start,
)
from nsa_eval.kernels.topk import block_keys, lean_filtered_top, topk_blocks

# "fused" (four launches, see the module docstring) or "v1" (the first split-K version, five launches)
DECODE_VARIANT = "fused"
# fused: compressed-key programs per SM the splits aim at (B * Hkv * splits ~ this * SMs)
CMP_PROGRAMS_PER_SM = 2
# fused: tiles of compressed keys per split at a full cache; None derives it from CMP_PROGRAMS_PER_SM
CMP_SPLIT_TILES = None
# fused: compressed keys per tile of step 1 (16 under the interpreter)
CMP_TILE_KEYS = 64
# fused: selected-block slots per program of the attention kernel; window keys per program = 64 * this.
# 4 and 2 against 2 and 1, B=16 at 64k (CUDA graph): with the merge in step 3, 122.7 us against 126.2
# (run 8), 123.8 against 127.4 (run 9), 126.6 against 128.6 (run 10); with the merge launch, 114.6
# against 113.3 (run 9) and 114.0 against 117.1 (run 12, the defaults)
SEL_PER_PROGRAM = 4
WIN_TILES_PER_PROGRAM = 2
# fused: step 3's loop over a program's selected blocks: 0 unrolled, or a loop software-pipelined over
# this many stages (the next blocks' loads in flight during this block's math). B=16, CUDA graph (run
# 31): 74.1 us at 64k with 3 stages against 74.9 with 2 and 75.4 unrolled; 39.3 / 39.8 / 40.6 at 8k.
SEL_STAGES = 3
# fused: pipeline stages and warps of the compressed-key loop; warps of the attention kernel. Step 1
# at B=16, 64k (run 34, CUDA graph): 4 warps 71.9 us, 2 warps 75.9 (86.2 with 4 programs per SM), 8
# warps 74.2
CMP_STAGES = 3
CMP_WARPS = 4
ATTN_WARPS = 4
# fused: the launch that holds the window chunks (the window branch depends on nothing): 2, beside
# the importances and the top-k, which leave the memory bus idle (run 13, B=16 at 64k: 115.0 us against
# 121.6 in step 3); 1, beside the compressed keys; or 3, beside the selected blocks
WINDOW_STEP = 2
# fused: the last program of step 3 merges the partials (True), or a fourth launch does, one program
# per (DVC output columns, sequence x KV head) (False; the benchmark times both). Run 9, B=16 at 64k:
# step 3 alone 16 us + the merge launch 8 us, against 39 us with the merge in step 3's last program
# (a serial tail of one program per row); the whole decode 113 us against 127 (CUDA graph).
MERGE_IN_ATTN = False
# fused: chunks of selection blocks (32 blocks each on the GPU with the paper's sizes) per importance
# program of step 2: fewer programs, each with one lse merge and several chunks. Run 10, B=16 at 64k,
# as a runtime loop: 4 chunks 121.9 us against 128.6 for 1 (CUDA graph); the loop itself slowed the
# kernel (54 us against 38 in run 9), so the chunks are now unrolled. Unrolled, 2 chunks against 4:
# 111.8 against 115.0 us (run 13's sweep), 111.8 against 113.6 (run 14's).
IMP_CHUNKS_PER_PROGRAM = 2
# fused: where step 2's importances come from. "tiles": step 1 maps each tile's probabilities
# (relative to the tile's max) onto the selection blocks it overlaps, [M, BC] x [BC, JW] (`TILE_MAP`),
# and stores those sums and the max (17 + 1 values per row and tile against 64 scores); step 2 rescales
# them by exp(max - lse) and sums the group's heads, no MMA. "scores": step 1 stores every compressed
# score; step 2 turns them into probabilities and maps them (`_importance_chunk`). "tiles" falls back
# to "scores" where a tile does not hold whole selection blocks.
DECODE_IMPORTANCE = "tiles"
# fused, "tiles": how step 1's map runs. "bf16x2": the probabilities split into a bfloat16 part and
# the bfloat16 remainder, two bfloat16 MMAs against the token counts (integers up to 256, exact in
# bfloat16), ~2^-17 relative error per probability. "tf32x3": one float32 MMA in three tf32 passes.
# The map sits in each tile's chain of dependent MMAs, so its cost adds to step 1's time: 38 us at 64k
# with bf16x2 against 44 with tf32x3 and 39 for the stored scores (run 27). Taken as "tf32x3" where
# a block pair shares more than 256 tokens; under the interpreter one float32 product.
TILE_MAP = "bf16x2"
# fused, "tiles": tiles of compressed keys (JT = 16 selection blocks each with the paper's sizes) per
# importance program of step 2. B=16 at 64k (scripts/probe_decode.py, run 27; CUDA graph): 32 tiles
# 78.0 us, 16 tiles 80.3 and 79.6, 8 tiles 83.1; "scores" 104.0; the map in tf32x3 86.6.
IMP_TILES_PER_PROGRAM = 32
# fused: launch options of step 2. Compiled for sm_90 (scripts/ptxas_decode_kernels.py): 164
# registers at 4 warps, so 3 programs per SM; maxnreg=128 fits 4 (188 bytes spilled). Run 16's
# sweep, B=16 at 64k: 110.6 us at 4 warps, 115.2 with maxnreg=128, 115.5 at 2 warps, 144.4 at 8; so
# the launch is not short of programs per SM.
IMP_LAUNCH = dict(num_warps=4)
# fused: the top-k by the last importance program of each row (True), or by `topk_blocks` in a
# launch of its own (False: no serial tail in step 2). Runs 13-16, B=16 at 64k: 113.2-115.7 us
# against 110.6-115.0 (the launch alone 7-8 us).
TOPK_IN_STEP2 = True
# fused: output columns per program of the merge (step 4); None: about 2,048 partial values per program
# per branch (32 columns at d = 128 with 4 partials per branch). Run 62, 64k (CUDA graph): 32 columns
# 68.3 us at B = 16 and 220.4 at B = 64, 16 columns 68.1 / 220.4, against 71.0 / 226.1 for 64 (the rule
# before, ~4,096 values) and 77.0 / 235.7 for 128
MERGE_COLUMNS = None


@triton.jit
def _load_q(Q, i_b, i_hk, G, sq_b, sq_h, o_r, o_dk, DK: tl.constexpr, UPCAST: tl.constexpr):
    q = tl.load(Q + i_b * sq_b + (i_hk * G + o_r)[:, None] * sq_h + o_dk[None, :],
                mask=(o_r < G)[:, None] & (o_dk < DK)[None, :], other=0.0)  # [M, BDK]
    if UPCAST:
        q = q.to(tl.float32)
    return q


@triton.jit
def _query_pos(LENS, i_b):
    # position of sequence i_b's query: its cache length (int32 or int64) - 1. Read in the kernels, so
    # that the decode launches no kernel of its own for it (one node fewer in a CUDA graph)
    return tl.load(LENS + i_b).to(tl.int32) - 1


@triton.jit
def _program_rows(LENS, i_bh, HKV, BDK: tl.constexpr, BDV: tl.constexpr, M: tl.constexpr):
    # sequence i_b, KV head i_hk and query position t of program row i_bh; offsets of the group's M
    # rows and of the key and value columns
    i_b = (i_bh // HKV).to(tl.int64)
    i_hk = i_bh % HKV
    t = _query_pos(LENS, i_b)
    o_r = tl.arange(0, M)
    o_dk = tl.arange(0, BDK)
    o_dv = tl.arange(0, BDV)
    return i_b, i_hk, t, o_r, o_dk, o_dv


@triton.jit
def _partial_softmax(q, K, V, i_b, i_hk, o_k, m_k, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, o_r, o_dk, o_dv, G,
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
def _merge(m_i, l_i, acc, m, l, o):
    # two partial softmaxes (max [M], sum [M], acc [M, BDV]) -> one
    m_new = tl.maximum(m_i, m)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp2(m_i - m_safe)
    b = tl.exp2(m - m_safe)
    return m_new, l_i * a + l * b, acc * a[:, None] + o * b[:, None]


@triton.jit
def _store_partial(PM, PL, PO, part, m, l, acc, o_r, o_dv, M: tl.constexpr, BDV: tl.constexpr):
    # partial `part` of the softmax: max m [M], sum l [M], acc [M, BDV] (PM, PL: [.., M]; PO: [.., M, BDV])
    tl.store(PM + part * M + o_r, m)
    tl.store(PL + part * M + o_r, l)
    tl.store(PO + (part * M + o_r[:, None]) * BDV + o_dv[None, :], acc)


# ---------------------------------------------------------------------------------------------
# fused variant (the helpers above are shared with decode_v1.py)
# ---------------------------------------------------------------------------------------------
@triton.jit
def _decode_cmp_split_kernel(
    Q, KC, VC, LENS, SC, TI, TS, TM, PM, PL, PO, CNT_IMP, CNT_ATTN, KW, VW,
    sq_b, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, skw_b, skw_t, skw_h, svw_b, svw_t, svw_h,
    TC, HKV, G, NCMP, NSELP, NPART, SC_LEN, NTILES, S, window, scale_log2, block_len, stride, select_size,
    DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, M: tl.constexpr,
    BC: tl.constexpr, BW: tl.constexpr, WT: tl.constexpr, WIN: tl.constexpr, TILE_IMP: tl.constexpr,
    JT: tl.constexpr, JW: tl.constexpr, NSP: tl.constexpr, MAP_BF16: tl.constexpr, UPCAST: tl.constexpr,
):
    # programs 0 .. NCMP-1: compression splits, partials at PM/PL/PO[i_bh, i_s] (PM, PL:
    # [B*HKV, NPART, M]; PO: [.., M, BDV]); with WIN (WINDOW_STEP = 1), programs NCMP ..: window
    # chunks, partials NCMP + NSELP + i as in steps 2 and 3 (compiled only then: they need registers).
    # TILE_IMP (DECODE_IMPORTANCE = "tiles"): per tile, TI [B*HKV, NTILES, M, JT] / TS [.., M, NSP] the
    # probabilities (relative to the tile max TM [B*HKV, NTILES, M]) mapped onto the tile's JT selection
    # blocks / the NSP blocks after them; otherwise SC [B*HKV, M, SC_LEN] the scores.
    i_s = tl.program_id(0)
    i_bh = tl.program_id(1)
    if i_s == 0:
        # arrival counters of the importance and attention kernels (launched after this one)
        tl.store(CNT_IMP + i_bh, 0)
        tl.store(CNT_ATTN + i_bh, 0)
    i_b = (i_bh // HKV).to(tl.int64)
    i_hk = i_bh % HKV
    t = _query_pos(LENS, i_b)
    o_r = tl.arange(0, M)
    o_dk = tl.arange(0, BDK)
    o_dv = tl.arange(0, BDV)
    if WIN:
        if i_s >= NCMP:
            q = _load_q(Q, i_b, i_hk, G, sq_b, sq_h, o_r, o_dk, DK, UPCAST)
            m_i, l_i, acc = _window_partial(q, KW, VW, i_b, i_hk, t, S, window, i_s - NCMP, skw_b,
                                            skw_t, skw_h, svw_b, svw_t, svw_h, o_r, o_dk, o_dv, G, scale_log2,
                                            DK, DV, M, BDV, BW, WT, UPCAST)
            _store_partial(PM, PL, PO, i_bh * NPART + NSELP + i_s, m_i, l_i, acc, o_r, o_dv, M, BDV)
        else:
            _cmp_split(Q, KC, VC, SC, TI, TS, TM, PM, PL, PO, i_s, i_bh, i_b, i_hk, t, sq_b, sq_h, sk_b,
                       sk_t, sk_h, sv_b, sv_t, sv_h, TC, G, NCMP, NPART, SC_LEN, NTILES, scale_log2,
                       block_len, stride, select_size, o_r, o_dk, o_dv, DK, DV, M, BDV, BC, TILE_IMP, JT, JW,
                       NSP, MAP_BF16, UPCAST)
    else:
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
        q = _load_q(Q, i_b, i_hk, G, sq_b, sq_h, o_r, o_dk, DK, UPCAST)
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
            m_i, l_i, acc = _merge(m_i, l_i, acc, m, l, o)
        _store_partial(PM, PL, PO, i_bh * NPART + i_s, m_i, l_i, acc, o_r, o_dv, M, BDV)
    else:  # no visible tile: an empty partial, so that steps 2 and 4 merge all NCMP without t
        m_i, l_i, acc = softmax_start(M, BDV)
        _store_partial(PM, PL, PO, i_bh * NPART + i_s, m_i, l_i, acc, o_r, o_dv, M, BDV)


@triton.jit
def _overlap(c_lo, c_hi, s_lo, s_hi):
    return tl.maximum(tl.minimum(c_hi, s_hi) - tl.maximum(c_lo, s_lo), 0)


@triton.jit
def _decode_importance_split_kernel(
    LENS, SC, TI, TS, TM, PM, PL, IMP, BI, CNT, SCR, Q, KW, VW, PO,
    sq_b, sq_h, skw_b, skw_t, skw_h, svw_b, svw_t, svw_h,
    TC, HKV, G, NPART, CMP_TILE, SC_LEN, NTILES, NS, block_len, stride, select_size, num_selected, num_init,
    num_local, NIMP, NCMP, NSELP, S, window, scale_log2,
    M: tl.constexpr, BNS: tl.constexpr, RATIO: tl.constexpr, SPILL: tl.constexpr, NPB: tl.constexpr,
    BNS_ALL: tl.constexpr, NSEL2: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr,
    BDV: tl.constexpr, BW: tl.constexpr, WT: tl.constexpr, CPP: tl.constexpr, TILE_IMP: tl.constexpr,
    CT: tl.constexpr, JT: tl.constexpr, NSP: tl.constexpr, NSPP: tl.constexpr, TOPK: tl.constexpr,
    LEAN: tl.constexpr, CAP: tl.constexpr, UPCAST: tl.constexpr,
):
    # programs 0 .. NIMP-1: importances of CPP chunks of BNS selection blocks each (from the scores SC)
    # or, with TILE_IMP, of the JT blocks of CT tiles each (from TI, TS, TM of step 1); NIMP ..: window
    # chunks (partials NCMP + NSELP + i, as in step 3)
    # IMP [B*HKV, NS] float32; BI [B*HKV, num_selected] int32: written by the last program of the row
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1)
    if i_c >= NIMP:
        i_b, i_hk, t, o_r, o_dk, o_dv = _program_rows(LENS, i_bh, HKV, BDK, BDV, M)
        q = _load_q(Q, i_b, i_hk, G, sq_b, sq_h, o_r, o_dk, DK, UPCAST)
        m_i, l_i, acc = _window_partial(q, KW, VW, i_b, i_hk, t, S, window, i_c - NIMP, skw_b, skw_t, skw_h,
                                        svw_b, svw_t, svw_h, o_r, o_dk, o_dv, G, scale_log2, DK, DV, M, BDV,
                                        BW, WT, UPCAST)
        _store_partial(PM, PL, PO, i_bh * NPART + NCMP + NSELP + i_c - NIMP, m_i, l_i, acc, o_r, o_dv, M, BDV)
    elif TILE_IMP:
        _tile_importance(LENS, TI, TS, TM, PM, PL, IMP, i_c, i_bh, TC, HKV, NPART, CMP_TILE, NTILES, NS,
                         block_len, stride, select_size, NCMP, M, NPB, CT, JT, NSP, NSPP)
        if TOPK:
            _last_takes_topk(IMP, BI, CNT, SCR, i_bh, _query_pos(LENS, i_bh // HKV), NS, select_size,
                             num_selected, num_init, num_local, NIMP, BNS_ALL, NSEL2, LEAN, CAP)
    else:
        _importance_chunk(LENS, SC, PM, PL, IMP, BI, CNT, SCR, i_c, i_bh, TC, HKV, G, NPART, SC_LEN, NS,
                          block_len, stride, select_size, num_selected, num_init, num_local, NIMP, NCMP,
                          M, BNS, RATIO, SPILL, NPB, BNS_ALL, NSEL2, CPP, TOPK, LEAN, CAP)


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
def _tile_importance(LENS, TI, TS, TM, PM, PL, IMP, i_c, i_bh, TC, HKV, NPART, CMP_TILE, NTILES, NS,
                     block_len, stride, select_size, NCMP, M: tl.constexpr, NPB: tl.constexpr,
                     CT: tl.constexpr, JT: tl.constexpr, NSP: tl.constexpr, NSPP: tl.constexpr):
    # importances of the selection blocks of tiles i_c * CT .. + CT - 1: each tile's sums rescaled
    # from its max to the head's lse, plus the previous tile's spill into the first NSP blocks, summed
    # over the group's heads (rows of absent heads hold zeros and a -inf max)
    t = _query_pos(LENS, i_bh // HKV)
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
def _importance_chunk(LENS, SC, PM, PL, IMP, BI, CNT, SCR, i_c, i_bh, TC, HKV, G, NPART, SC_LEN, NS,
                      block_len, stride, select_size, num_selected, num_init, num_local, NIMP, NCMP,
                      M: tl.constexpr, BNS: tl.constexpr, RATIO: tl.constexpr, SPILL: tl.constexpr,
                      NPB: tl.constexpr, BNS_ALL: tl.constexpr, NSEL2: tl.constexpr, CPP: tl.constexpr,
                      TOPK: tl.constexpr, LEAN: tl.constexpr, CAP: tl.constexpr):
    BC: tl.constexpr = BNS * RATIO  # compressed blocks starting in this chunk of BNS selection blocks
    i_b = i_bh // HKV
    t = _query_pos(LENS, i_b)
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
        # loop cost 16 us at 64k in run 10); chunks past t's block read nothing (masked) and store 0
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

    if TOPK:  # the last program of this (sequence, KV head) to arrive takes the top-k of the whole row
        _last_takes_topk(IMP, BI, CNT, SCR, i_bh, t, NS, select_size, num_selected, num_init, num_local, NIMP,
                         BNS_ALL, NSEL2, LEAN, CAP)


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


@triton.jit
def _branch_weights(PM, PL, first, n, o_r, M: tl.constexpr, NPB: tl.constexpr):
    # softmax-merge weights [NPB, M] of the n partials first .. first + n - 1 (0 for absent ones), the
    # 1 / sum included. Loads .cg (L2): written by other programs of this launch, read after the
    # acquire of the arrival counter.
    o_p = tl.arange(0, NPB)
    m_p = (o_p < n)[:, None]
    offs = (first + o_p[:, None]) * M + o_r[None, :]  # [NPB, M]
    m = tl.load(PM + offs, mask=m_p, other=float("-inf"), cache_modifier=".cg")
    l = tl.load(PL + offs, mask=m_p, other=0.0, cache_modifier=".cg")
    m_max = tl.max(m, 0)  # [M]
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_safe[None, :])  # [NPB, M]
    l_sum = tl.sum(l * w, 0)  # [M]
    return w / tl.where(l_sum > 0, l_sum, 1.0)[None, :]


@triton.jit
def _branch_partials(PO, first, n, o_r, o_dc, M: tl.constexpr, BDV: tl.constexpr, NPB: tl.constexpr):
    # columns o_dc [DVC] of the n partials first .. first + n - 1 -> [NPB, M, DVC] (0 for absent ones)
    o_p = tl.arange(0, NPB)
    return tl.load(PO + ((first + o_p[:, None, None]) * M + o_r[None, :, None]) * BDV + o_dc[None, None, :],
                   mask=(o_p < n)[:, None, None], other=0.0, cache_modifier=".cg")


@triton.jit
def _window_partial(q, KW, VW, i_b, i_hk, t, S, window, i_w, skw_b, skw_t, skw_h, svw_b, svw_t, svw_h,
                    o_r, o_dk, o_dv, G, scale_log2, DK: tl.constexpr, DV: tl.constexpr, M: tl.constexpr,
                    BDV: tl.constexpr, BW: tl.constexpr, WT: tl.constexpr, UPCAST: tl.constexpr):
    # partial softmax over window chunk i_w (WT tiles of BW keys from max(t - window + 1, 0))
    m_i, l_i, acc = softmax_start(M, BDV)
    start = tl.maximum(t - window + 1, 0) + i_w * (WT * BW)
    for j in tl.static_range(WT):
        o_k = start + j * BW + tl.arange(0, BW)
        m_k = (o_k <= t) & (o_k < S)
        _, m, l, o = _partial_softmax(q, KW, VW, i_b, i_hk, o_k, m_k, skw_b, skw_t, skw_h, svw_b, svw_t,
                                      svw_h, o_r, o_dk, o_dv, G, scale_log2, DK, DV, UPCAST)
        m_i, l_i, acc = _merge(m_i, l_i, acc, m, l, o)
    return m_i, l_i, acc


@triton.jit
def _selected_slot(q, K, V, BI, i_bh, slot, i_b, i_hk, t, S, m_i, l_i, acc, sk_b, sk_t, sk_h, sv_b, sv_t,
                   sv_h, o_r, o_dk, o_dv, G, scale_log2, num_selected, DK: tl.constexpr, DV: tl.constexpr,
                   BS: tl.constexpr, UPCAST: tl.constexpr):
    # the running softmax (m_i, l_i, acc) merged with the block in selection slot `slot` (none for -1)
    blk = tl.load(BI + i_bh * num_selected + slot, mask=slot < num_selected, other=-1)
    o_k = tl.maximum(blk, 0) * BS + tl.arange(0, BS)
    m_k = (o_k <= t) & (o_k < S) & (tl.zeros([BS], tl.int32) + blk >= 0)
    _, m, l, o = _partial_softmax(q, K, V, i_b, i_hk, o_k, m_k, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, o_r, o_dk,
                                  o_dv, G, scale_log2, DK, DV, UPCAST)
    return _merge(m_i, l_i, acc, m, l, o)


@triton.jit
def _decode_attn_fused_kernel(
    Q, K, V, KW, VW, LENS, BI, PM, PL, PO, CNT, GC, GS, GW, O,
    sq_b, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, skw_b, skw_t, skw_h, svw_b, svw_t, svw_h,
    S, HKV, G, NSELP, NWP, NCMP, NPART, scale_log2, window, num_selected,
    DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, M: tl.constexpr,
    BS: tl.constexpr, SPP: tl.constexpr, BW: tl.constexpr, WT: tl.constexpr, NPB: tl.constexpr,
    DVC: tl.constexpr, MERGE: tl.constexpr, SEL_STAGES: tl.constexpr, UPCAST: tl.constexpr,
):
    # programs 0 .. NSELP-1: SPP selected-block slots each; NSELP ..: window chunks of WT * BW keys
    # (only with WINDOW_STEP = 3). Partials per i_bh: [0, NCMP) compression (step 1), then NSELP
    # selection, then NWP window.
    # BI [B*HKV, num_selected] from step 2; gates GC/GS/GW and output O contiguous [B, 1, HQ(, DV)].
    i_p = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b, i_hk, t, o_r, o_dk, o_dv = _program_rows(LENS, i_bh, HKV, BDK, BDV, M)
    q = _load_q(Q, i_b, i_hk, G, sq_b, sq_h, o_r, o_dk, DK, UPCAST)
    m_i, l_i, acc = softmax_start(M, BDV)
    if i_p < NSELP:
        if SEL_STAGES > 0:  # a loop Triton software-pipelines: the next blocks' loads in flight
            for j in tl.range(0, SPP, num_stages=SEL_STAGES):
                m_i, l_i, acc = _selected_slot(q, K, V, BI, i_bh, i_p * SPP + j, i_b, i_hk, t, S, m_i, l_i,
                                               acc, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, o_r, o_dk, o_dv, G,
                                               scale_log2, num_selected, DK, DV, BS, UPCAST)
        else:
            for j in tl.static_range(SPP):
                m_i, l_i, acc = _selected_slot(q, K, V, BI, i_bh, i_p * SPP + j, i_b, i_hk, t, S, m_i, l_i,
                                               acc, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, o_r, o_dk, o_dv, G,
                                               scale_log2, num_selected, DK, DV, BS, UPCAST)
    else:  # window chunks (WINDOW_STEP = 3; otherwise the grid has NSELP programs)
        m_i, l_i, acc = _window_partial(q, KW, VW, i_b, i_hk, t, S, window, i_p - NSELP, skw_b, skw_t, skw_h,
                                        svw_b, svw_t, svw_h, o_r, o_dk, o_dv, G, scale_log2, DK, DV, M, BDV,
                                        BW, WT, UPCAST)
    base = i_bh * NPART
    _store_partial(PM, PL, PO, base + NCMP + i_p, m_i, l_i, acc, o_r, o_dv, M, BDV)
    if MERGE:  # the last program of this (sequence, KV head) to arrive merges every partial
        tl.debug_barrier()  # all threads' stores before the release of the counter increment
        arrived = tl.atomic_add(CNT + i_bh, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(0) - 1:
            _merge_partials(PM, PL, PO, GC, GS, GW, O, i_b, i_hk, base, 0, HKV, G, NSELP, NWP, NCMP, o_r, DV,
                            M, BDV, NPB, DVC, BDV // DVC)


@triton.jit
def _decode_merge_kernel(
    PM, PL, PO, GC, GS, GW, O, HKV, G, NSELP, NWP, NCMP, NPART,
    DV: tl.constexpr, BDV: tl.constexpr, M: tl.constexpr, NPB: tl.constexpr, DVC: tl.constexpr,
):
    # MERGE_IN_ATTN = False: one program per (chunk of DVC output columns, sequence x KV head)
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1)
    _merge_partials(PM, PL, PO, GC, GS, GW, O, (i_bh // HKV).to(tl.int64), i_bh % HKV, i_bh * NPART, i_c, HKV,
                    G, NSELP, NWP, NCMP, tl.arange(0, M), DV, M, BDV, NPB, DVC, 1)


@triton.jit
def _merge_partials(PM, PL, PO, GC, GS, GW, O, i_b, i_hk, base, c0, HKV, G, NSELP, NWP, NCMP, o_r,
                    DV: tl.constexpr, M: tl.constexpr, BDV: tl.constexpr, NPB: tl.constexpr,
                    DVC: tl.constexpr, CHUNKS: tl.constexpr):
    # output columns of chunks c0 .. c0 + CHUNKS - 1 (DVC each) of one (sequence, KV head): the
    # partials of the three branches (at base: NCMP compression, then NSELP selection, then NWP
    # window; absent ones empty) merged, with the gates folded into the merge weights. No load waits
    # for another: the first chunk's partials load before the weights' reductions.
    f_slc = base + NCMP
    f_swa = f_slc + NSELP
    head = (i_b * HKV + i_hk) * G + o_r  # [M] flat (b, h) since HQ = HKV * G
    m_r = o_r < G
    o_dc = c0 * DVC + tl.arange(0, DVC)
    a_cmp = _branch_partials(PO, base, NCMP, o_r, o_dc, M, BDV, NPB)  # [NPB, M, DVC]
    a_slc = _branch_partials(PO, f_slc, NSELP, o_r, o_dc, M, BDV, NPB)
    a_swa = _branch_partials(PO, f_swa, NWP, o_r, o_dc, M, BDV, NPB)
    w_cmp = _branch_weights(PM, PL, base, NCMP, o_r, M, NPB)  # [NPB, M]
    w_cmp *= tl.load(GC + head, mask=m_r, other=0.0).to(tl.float32)[None, :]
    w_slc = _branch_weights(PM, PL, f_slc, NSELP, o_r, M, NPB)
    w_slc *= tl.load(GS + head, mask=m_r, other=0.0).to(tl.float32)[None, :]
    w_swa = _branch_weights(PM, PL, f_swa, NWP, o_r, M, NPB)
    w_swa *= tl.load(GW + head, mask=m_r, other=0.0).to(tl.float32)[None, :]
    for c in tl.static_range(CHUNKS):
        if c > 0:
            o_dc = (c0 + c) * DVC + tl.arange(0, DVC)
            a_cmp = _branch_partials(PO, base, NCMP, o_r, o_dc, M, BDV, NPB)
            a_slc = _branch_partials(PO, f_slc, NSELP, o_r, o_dc, M, BDV, NPB)
            a_swa = _branch_partials(PO, f_swa, NWP, o_r, o_dc, M, BDV, NPB)
        out = tl.sum(w_cmp[:, :, None] * a_cmp + w_slc[:, :, None] * a_slc + w_swa[:, :, None] * a_swa, 0)
        tl.store(O + head[:, None].to(tl.int64) * DV + o_dc[None, :], out.to(O.dtype.element_ty),
                 mask=m_r[:, None] & (o_dc < DV)[None, :])


def tile_layout(tile_keys: int, block_len: int, stride: int, select_size: int) -> tuple[int, int] | None:
    """(JT, NSP) of `DECODE_IMPORTANCE = "tiles"` for tiles of `tile_keys` compressed keys: the
    selection blocks a tile holds, and those past them that its last compressed blocks reach. None
    where the per-tile sums do not apply (a tile holds no whole number of selection blocks, or its
    blocks reach past the next tile): the decode then maps the stored scores."""
    ratio = select_size // stride
    if select_size % stride or tile_keys % ratio:
        return None
    jt = tile_keys // ratio
    nsp = max(0, cdiv((tile_keys - 1) * stride + block_len, select_size) - jt)
    return (jt, nsp) if nsp <= jt else None


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


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
    S = k.shape[1]
    if select_size < 16 or select_size & (select_size - 1):
        raise ValueError(f"the Triton nsa_decode needs select_size a power of two >= 16, got {select_size}")
    ratio = select_size // stride
    if select_size % stride or ratio & (ratio - 1):
        raise ValueError(f"the Triton nsa_decode needs select_size a power-of-two multiple of stride, "
                         f"got select_size={select_size}, stride={stride}")
    if DECODE_VARIANT not in ("fused", "v1"):
        raise ValueError(f"DECODE_VARIANT must be 'fused' or 'v1', got {DECODE_VARIANT!r}")
    k_swa = k if k_swa is None else k_swa
    v_swa = v if v_swa is None else v_swa
    if cache_seqlens is None:
        lens = torch.full((B,), S, dtype=torch.int32, device=q.device)
    elif cache_seqlens.dtype in (torch.int32, torch.int64):
        lens = cache_seqlens.contiguous()
    else:
        lens = cache_seqlens.to(torch.int32)
    for x in (k, v, k_cmp, v_cmp, k_swa, v_swa):
        if x.stride(-1) != 1:
            raise ValueError("nsa_decode needs caches with a contiguous last dimension")
    params = dict(block_len=block_len, stride=stride, select_size=select_size, num_selected=num_selected,
                  num_init=num_init, num_local=num_local, window=window, scale=default_scale(scale, DK))
    if DECODE_VARIANT == "fused":
        run = _decode_fused
    else:  # imported here: decode_v1 builds on this module's helpers
        from nsa_eval.kernels.decode_v1 import decode_v1 as run
    o, bi = run(q.contiguous(), k, v, k_cmp, v_cmp, g_cmp.contiguous(), g_slc.contiguous(),
                g_swa.contiguous(), k_swa, v_swa, lens, **params)  # [B, 1, Hq, Dv], [B*Hkv, n]
    if return_block_indices:
        return o, bi.view(B, 1, k.shape[2], num_selected)
    return o


def _decode_fused(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, k_swa, v_swa, lens, *, block_len, stride,
                  select_size, num_selected, num_init, num_local, window, scale):
    B, _, HQ, DK = q.shape
    S, HKV = k.shape[1], k.shape[2]
    TC, DV = k_cmp.shape[1], v.shape[3]
    G = HQ // HKV
    BH = B * HKV
    M = pow2(G)
    BDK, BDV = pow2(DK), pow2(DV)
    interp = interpreting()
    dev = q.device
    f32 = dict(device=dev, dtype=torch.float32)
    dev_index = dev.index if dev.index is not None else (0 if interp else torch.cuda.current_device())

    # splits of the compressed keys: about CMP_PROGRAMS_PER_SM programs per SM in all
    BC = 16 if interp else CMP_TILE_KEYS
    n_tiles = max(1, cdiv(TC, BC))
    if CMP_SPLIT_TILES is not None:
        n_cmp = cdiv(n_tiles, CMP_SPLIT_TILES)
    elif interp:
        n_cmp = cdiv(n_tiles, 2)
    else:
        # at most 32 splits: the final merge loads all partials of a branch at once
        sms = _num_sms(dev_index)
        n_cmp = min(n_tiles, 32, max(1, CMP_PROGRAMS_PER_SM * sms // BH))
    sc_len = n_tiles * BC
    ratio = select_size // stride
    layout = tile_layout(BC, block_len, stride, select_size)
    tile_imp = DECODE_IMPORTANCE == "tiles" and layout is not None
    jt, nsp = layout if tile_imp else (0, 0)
    # attention programs: SPP selected-block slots, or WT window tiles of BW keys
    SPP = SEL_PER_PROGRAM
    BW, WT = (16, 2) if interp else (64, WIN_TILES_PER_PROGRAM)
    n_selp = max(1, cdiv(num_selected, SPP))
    n_winp = max(1, cdiv(window, WT * BW))
    npart = n_cmp + n_selp + n_winp

    if DECODE_IMPORTANCE not in ("tiles", "scores"):
        raise ValueError(f"DECODE_IMPORTANCE must be 'tiles' or 'scores', got {DECODE_IMPORTANCE!r}")
    if TILE_MAP not in ("bf16x2", "tf32x3"):
        raise ValueError(f"TILE_MAP must be 'bf16x2' or 'tf32x3', got {TILE_MAP!r}")
    if tile_imp:
        scores = torch.empty(1, **f32)
        tile_sums = torch.empty(BH, n_tiles, M, jt, **f32)
        tile_spill = torch.empty(BH, n_tiles, M, max(nsp, 1), **f32)
        tile_max = torch.empty(BH, n_tiles, M, **f32)
    else:
        scores = torch.empty(BH, M, sc_len, **f32)
        tile_sums = tile_spill = tile_max = torch.empty(1, **f32)
    pm = torch.empty(BH, npart, M, **f32)
    pl = torch.empty(BH, npart, M, **f32)
    po = torch.empty(BH, npart, M, BDV, **f32)
    counter = torch.empty(2, BH, device=dev, dtype=torch.int32)  # zeroed by the compression kernel
    scale_log2 = scale * LOG2E

    # 1. compression branch: scores + one partial softmax per split
    if WINDOW_STEP not in (1, 2, 3):
        raise ValueError(f"WINDOW_STEP must be 1, 2 or 3, got {WINDOW_STEP!r}")
    launcher(_decode_cmp_split_kernel)[(n_cmp + (n_winp if WINDOW_STEP == 1 else 0), BH)](
        q, k_cmp, v_cmp, lens, scores, tile_sums, tile_spill, tile_max, pm, pl, po, counter[0], counter[1],
        k_swa, v_swa, q.stride(0), q.stride(2), *k_cmp.stride()[:3], *v_cmp.stride()[:3], *k_swa.stride()[:3],
        *v_swa.stride()[:3], TC, HKV, G, n_cmp, n_selp, npart, sc_len, n_tiles, S, window, scale_log2,
        block_len, stride, select_size, DK=DK, DV=DV, BDK=BDK, BDV=BDV, M=M, BC=BC, BW=BW, WT=WT,
        WIN=WINDOW_STEP == 1, TILE_IMP=tile_imp, JT=jt, JW=pow2(jt + nsp), NSP=nsp,
        MAP_BF16=TILE_MAP == "bf16x2" and min(block_len, select_size) <= 256 and not interp, UPCAST=interp,
        num_warps=CMP_WARPS, num_stages=CMP_STAGES,
    )

    # 2. selection-block importances; the last program of each row takes its top-k
    ns = cdiv(S, select_size)
    imp = torch.empty(BH, ns, **f32)
    bns = 16 if interp else max(16, 128 // ratio)
    spill = pow2(max(1, cdiv(block_len, stride) - 1))
    npb = pow2(max(n_cmp, n_selp, n_winp), 1)
    bi = torch.empty(BH, num_selected, device=dev, dtype=torch.int32)
    nsel2 = pow2(num_selected, 2)  # >= 2 for tl.topk
    bns_all = max(pow2(ns), nsel2)
    lean = topk.lean_fits(bns_all, nsel2)
    scratch = topk.lean_scratch(BH if lean else 1, dev)
    ct = pow2(IMP_TILES_PER_PROGRAM, 1)
    if tile_imp:
        n_imp = cdiv(cdiv(ns, jt), ct)
    else:
        n_imp = cdiv(ns, bns * IMP_CHUNKS_PER_PROGRAM)
    launcher(_decode_importance_split_kernel)[(n_imp + (n_winp if WINDOW_STEP == 2 else 0), BH)](
        lens, scores, tile_sums, tile_spill, tile_max, pm, pl, imp, bi, counter[0], scratch, q, k_swa, v_swa,
        po,
        q.stride(0), q.stride(2), *k_swa.stride()[:3], *v_swa.stride()[:3], TC, HKV, G, npart, BC, sc_len,
        n_tiles, ns, block_len, stride, select_size, num_selected, num_init, num_local, n_imp, n_cmp, n_selp,
        S, window, scale_log2, M=M, BNS=bns, RATIO=ratio, SPILL=spill, NPB=npb,
        BNS_ALL=bns_all, NSEL2=nsel2, DK=DK, DV=DV, BDK=BDK, BDV=BDV, BW=BW, WT=WT,
        CPP=IMP_CHUNKS_PER_PROGRAM, TILE_IMP=tile_imp, CT=ct, JT=max(jt, 1), NSP=nsp, NSPP=pow2(nsp, 1),
        TOPK=TOPK_IN_STEP2, LEAN=lean, CAP=topk.TOPK_CAP, UPCAST=interp,
        **({} if interp else IMP_LAUNCH),
    )
    if not TOPK_IN_STEP2:  # 2b. the top-k in a launch of its own, one program per row
        bi = topk_blocks(imp, T=1, num_kv_heads=HKV, select_size=select_size, num_selected=num_selected,
                         num_init=num_init, num_local=num_local, positions=(lens - 1).int())

    # 3. selected blocks and window chunks, then the merge of all partials by the last program
    o = torch.empty(B, 1, HQ, DV, device=dev, dtype=q.dtype)
    # the final merge loads [npb, M, DVC] partials per branch at once: about 2048 values per 4 warps
    warps = ATTN_WARPS if npb * M <= 256 else 8
    dvc = MERGE_COLUMNS or min(BDV, max(4, 512 * warps // (npb * M)))
    launcher(_decode_attn_fused_kernel)[(n_selp + (n_winp if WINDOW_STEP == 3 else 0), BH)](
        q, k, v, k_swa, v_swa, lens, bi, pm, pl, po, counter[1], g_cmp, g_slc, g_swa, o,
        q.stride(0), q.stride(2), *k.stride()[:3], *v.stride()[:3], *k_swa.stride()[:3], *v_swa.stride()[:3],
        S, HKV, G, n_selp, n_winp, n_cmp, npart, scale_log2, window, num_selected, DK=DK, DV=DV, BDK=BDK,
        BDV=BDV, M=M, BS=select_size, SPP=SPP, BW=BW, WT=WT, NPB=npb, DVC=dvc, MERGE=MERGE_IN_ATTN,
        SEL_STAGES=SEL_STAGES, UPCAST=interp, num_warps=warps,
    )
    if not MERGE_IN_ATTN:  # 4. the merge, one program per (chunk of output columns, row)
        launcher(_decode_merge_kernel)[(BDV // dvc, BH)](
            pm, pl, po, g_cmp, g_slc, g_swa, o, HKV, G, n_selp, n_winp, n_cmp, npart, DV=DV, BDV=BDV, M=M,
            NPB=npb, DVC=dvc, num_warps=warps,
        )
    return o, bi
