"""Triton selected-block attention (NSA's selection branch over the blocks `importance.select_blocks`
chose, with the group-centric tiling of the paper's kernel).

Forward, `selected_forward`: one program per (tile of query positions, KV head) holds all G query
heads of the group for `BT` positions (`SELECTED_ROWS` rows per program, `G'` = G rounded up to a
power of two). It numbers the distinct usable blocks of its `BT` lists up front (a block chosen by
several positions, or repeated in one list, is read once) and walks them with no branch, so the next
block's K/V load (a TMA copy on Hopper) runs during the current MMAs; a per-row mask says which rows
chose the block, a token-level mask keeps it causal. Small groups on long inputs run the forward per
key block instead (`selected_by_block`, `by_block`). `selected_forward_gated` also writes NSA's gated
sum of the three branches from the forward's last launch.

Backward, `selected_backward`: per key block through an inverted index (a counting sort of the
selections by block, `inverted_index`): a program takes up to `CHUNK` of the positions that selected
one block, gathers `BQ` positions x the group's heads into one MMA, adds its partial dk/dv once with
a float32 atomic, and each row's dq share with float32 atomics (work items split long lists, e.g. the
forced block 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa_eval.kernels._triton_utils import (
    LOG2E,
    cdiv,
    contiguous,
    default_scale,
    dk_tiles,
    dot,
    group_rows,
    interpreting,
    kv_sources,
    launcher,
    load_kv,
    load_rows,
    load_tail,
    online_softmax_step,
    pow2,
    row_delta,
    softmax_start,
    split_zeros,
    tma_descriptor,
    tma_load_pair,
    tma_ok,
    wide_rows,
)
from nsa_eval.kernels.selected_by_block import (
    block_kv,
    inverted_index,
    item_range,
    selected_forward_by_block,
    store_forward,
)

# rows (positions x G') a walking program holds: BT = max(1, SELECTED_ROWS // G') positions, one at
# G = 16, whose 16 heads fill an MMA's rows
SELECTED_ROWS = 16
# Launch of the forward at one position a program (G >= 16): one warp, 2 stages; the selected op at
# 64k (G = 16, TMA copies) took 13.47 ms against 14.70 at 3 stages and 14.03 at 2 warps.
SELECTED_FWD_CONFIG = dict(num_warps=1, num_stages=2)
# At several positions a program (G = 4: up to 4n distinct blocks to walk): 2 warps and 2 stages, the
# G = 4 forward at 64k 22.51 ms against 23.70 at 3 stages and 24.07 at 4 warps; with TMA copies 3
# stages, the op 11.46 ms against 11.89 at 2 (1 warp 12.81, 4 warps 12.14).
SELECTED_FWD_CONFIG_MULTI = dict(num_warps=2, num_stages=2)
SELECTED_FWD_CONFIG_MULTI_TMA = dict(num_warps=2, num_stages=3)
# q/k dims past 128 (the paper's 192) run the one-position forward over at least this many warps: one
# warp holds 16 rows of q in two tiles and the scores; the op at 64k and 192 / 128 took 20.27 ms at 2
# warps against 27.10 at 1.
SELECTED_FWD_WIDE_WARPS = 2
# Launch of the dk/dv kernel (num_warps: 8 for head dims >= 128, else 4) and its rows (positions x G')
# per MMA: 3 stages took the selected op's forward+backward at 64k to 54.0 ms from 55.1 at 2; float32
# inputs keep 2 (`selected_dkv_launch`).
SELECTED_DKV_CONFIG = dict(num_stages=3)
SELECTED_DKV_ROWS = 64
# The launches at 16-bit q/k and v dims {(dk, dv): launch} (`selected_dkv_launch`; elsewhere the one
# above). Over 64 rows, 8 warps compute the scores and dp twice: Triton lays a dot whose result feeds
# another dot out as warpsPerCTA = [8, 1], 128 rows of warps, so both warpgroups hold the same 64
# rows. 128 rows fill both. At 128 / 128 the q/k dim in two column halves of 64 (`split_dk`, as
# `dk_tiles` splits the paper's 192) keeps dq's and dk's products from spilling (compiled for sm_90,
# ptxas: 60 / 32 bytes stored / loaded at 2 stages, against 120 / 88 for 64 rows); 3 stages need
# 264,192 bytes of shared memory, more than the H200 has. The selected op's forward+backward at 64k:
# 44.4-44.5 ms against 45.3-46.5, the NSA's 107.5 against 109.2-109.8, G = 4 36.75 against 38.75
# (128 rows without the split 54.65, the split alone 44.8-45.1). At the paper's 192 / 128 (already
# in two column tiles) 2 stages need 271,360 bytes; at 1 stage the op took 77.3 ms against 80.7.
SELECTED_DKV_WIDE = {(128, 128): dict(rows=128, split_dk=True, num_stages=2),
                     (192, 128): dict(rows=128, num_stages=1)}
# Groups of up to this many query heads run the forward per key block (`selected_by_block`: each
# block's K/V read once for every position that chose it, partials merged per position) instead of
# the walk, once the keys have at least SELECTED_BY_BLOCK_MIN_ROWS rows (B x T x Hkv). G = 4, the
# selected op: 64k 6.65 ms against the walk's 11.38, 32k 3.38 against 5.27, 8k 0.83-0.86 against 1.03
# (below that the walk's K/V stay in L2); G = 8 at 64k 12.51 against 12.35, G = 16 19.53 against
# 13.86, where the walk's K/V reads already serve 16 rows each.
SELECTED_BY_BLOCK_MAX_GROUP = 4
SELECTED_BY_BLOCK_MIN_ROWS = 8192 * 4


@triton.jit
def _selected_rows(Q, sq_b, sq_t, sq_h, T, HQ, G, DK: tl.constexpr, BDK: tl.constexpr, BDK2: tl.constexpr,
                   GP: tl.constexpr, BT: tl.constexpr, UPCAST: tl.constexpr):
    # the program's M = BT * GP rows (BT positions x the group's heads, padded to GP): batch, KV head,
    # first position, position [M] and mask [M] of each row, flat (b, t, h) [M], q [M, BDK] and the
    # tail of a split head dim q2 [M, BDK2] (`dk_tiles`; q itself without one)
    i_b, i_hk, t0, o_r, r_t, m_r = group_rows(T, HQ, G, GP, BT)
    r_h = i_hk * G + o_r % GP
    row = (i_b * T + r_t.to(tl.int64)) * HQ + r_h  # [M] flat (b, t, h)
    q, q2 = load_rows(Q + i_b * sq_b + r_h * sq_h + r_t.to(tl.int64) * sq_t, m_r, DK, BDK, BDK2, UPCAST)
    return i_b, i_hk, t0, r_t, m_r, row, q, q2



@triton.jit
def _softmax_block(q, q2, k, k2, v, valid, scale_log2, m_i, l_i, acc, BDK2: tl.constexpr):
    # online softmax over one block: running max m_i [M], sum l_i [M] and acc [M, BDV] (log2 units)
    s = dot(q, tl.trans(k))  # [M, BS]
    if BDK2 > 0:
        s += dot(q2, tl.trans(k2))
    return online_softmax_step(s, valid, v, m_i, l_i, acc, scale_log2)


@triton.jit
def _key_tail(k_base, o_k, sk_t, T, k, BDK: tl.constexpr, BDK2: tl.constexpr, UPCAST: tl.constexpr):
    # the tail [BS, BDK2] of a split head dim of the keys at positions o_k [BS] (k itself without one)
    k2 = k
    if BDK2 > 0:
        k2 = load_tail(k_base + o_k.to(tl.int64) * sk_t, o_k < T, True, BDK, BDK2, UPCAST, False)
    return k2



@triton.jit
def _selected_fwd_kernel(
    Q, K, V, BI, O, LSE, OC, OW, GC, GS, GW, OUT,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
    T, HQ, G, NSEL, scale_log2,
    DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDK2: tl.constexpr, BDV: tl.constexpr,
    GP: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, NP: tl.constexpr, UPCAST: tl.constexpr,
    TMA: tl.constexpr, GATE_SUM: tl.constexpr, STORE_O: tl.constexpr, PACKED: tl.constexpr,
):
    # O, LSE of BT positions x the group's G heads (O contiguous [B, T, HQ, DV]; BI contiguous
    # [B, T, HKV, NSEL]). The distinct usable blocks of the BT lists are numbered 0 .. n_blk-1 up front;
    # iteration i reads block i, with no branch, so the next block's loads can run ahead of this
    # block's MMAs. TMA: K and V are tensor descriptors over [B, T, HKV, D] with blocks
    # [1, BS, 1, BDK / BDV] (`tma_descriptor`): each block is one bulk copy, rows past T read as 0.
    # PACKED (BT > 1): each list entry carries a bit per position whose list holds its block, so one
    # reduction per step gives the block and the rows that chose it. GATE_SUM: also
    # OUT = GC * OC + GS * O + GW * OW (`store_forward`); STORE_O: O is written.
    M: tl.constexpr = BT * GP
    N: tl.constexpr = BT * NP
    i_b, i_hk, t0, r_t, m_r, row, q, q2 = _selected_rows(Q, sq_b, sq_t, sq_h, T, HQ, G, DK, BDK, BDK2, GP, BT,
                                                         UPCAST)
    HKV = HQ // G
    o_dk = tl.arange(0, BDK)
    o_dv = tl.arange(0, BDV)

    # block lists of the BT positions; an entry is usable if it is a block starting at or before
    # its position, and kept if no earlier entry (row-major over [BT, NP]) holds the same block
    o_p = tl.arange(0, BT)
    o_s = tl.arange(0, NP)
    t_p = t0 + o_p  # [BT]
    bi_base = BI + ((i_b * T + t0) * HKV + i_hk) * NSEL
    idx = tl.load(bi_base + o_p[:, None] * (HKV * NSEL) + o_s[None, :],
                  mask=(t_p < T)[:, None] & (o_s < NSEL)[None, :], other=-1)  # [BT, NP]
    idx = tl.where((idx >= 0) & (idx <= t_p[:, None] // BS), idx, -1)
    first = idx >= 0  # [BT, NP]
    chosen_by = tl.zeros([BT, NP], dtype=tl.int64)  # PACKED: bit pp set if position pp's list holds it
    for pp in tl.static_range(BT):
        list_pp = tl.sum(tl.where(o_p[:, None] == pp, idx, 0), 0)  # [NP] the list of position pp
        before = (o_p[:, None, None] > pp) | (
            (o_p[:, None, None] == pp) & (o_s[None, None, :] < o_s[None, :, None]))  # [BT, NP, NP]
        same = idx[:, :, None] == list_pp[None, None, :]  # [BT, NP, NP]
        first = first & (tl.max((same & before).to(tl.int32), 2) == 0)
        if PACKED:
            chosen_by = chosen_by | (tl.max(same.to(tl.int64), 2) << pp)
    keep = tl.reshape(first.to(tl.int32), [N])  # [N]
    blocks = tl.reshape(idx, [N])  # [N]
    if PACKED:  # block index above BT bits of positions
        blocks = tl.reshape((idx.to(tl.int64) << BT) | chosen_by, [N])
    slot = tl.where(keep > 0, tl.cumsum(keep, 0) - 1, -1)  # [N] walk order of each kept entry
    n_blk = tl.sum(keep, 0)

    k_base, v_base = kv_sources(K, V, i_b, i_hk, sk_b, sk_h, sv_b, sv_h, TMA)
    o_n = tl.arange(0, BS)
    m_i, l_i, acc = softmax_start(M, BDV)

    for i in range(0, n_blk):
        entry = tl.sum(tl.where(slot == i, blocks, 0), 0)  # block i, from registers
        blk = (entry >> BT).to(tl.int32) if PACKED else entry
        o_k = blk * BS + o_n  # [BS] token positions
        valid = (o_k[None, :] <= r_t[:, None]) & m_r[:, None]  # [M, BS]
        if PACKED:  # only the rows whose position chose blk
            valid = valid & (((entry >> (r_t - t0).to(tl.int64)) & 1) != 0)[:, None]
        if TMA:
            k, v = tma_load_pair(k_base, v_base, i_b, blk * BS, i_hk, BS, BDK, BDV)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            k2 = k
        else:
            # k [BS, BDK], v [BS, BDV]
            k, v = load_kv(k_base, v_base, o_k, o_k < T, sk_t, sv_t, o_dk, o_dv, DK, DV, UPCAST)
            k2 = _key_tail(k_base, o_k, sk_t, T, k, BDK, BDK2, UPCAST)
        m_i, l_i, acc = _softmax_block(q, q2, k, k2, v, valid, scale_log2, m_i, l_i, acc, BDK2)

    store_forward(O, LSE, OC, OW, GC, GS, GW, OUT, row, m_r, o_dv, m_i, l_i, acc, DV, GATE_SUM, STORE_O)


def _tiling(G: int):
    GP = pow2(G, 1)
    return GP, max(1, SELECTED_ROWS // GP)


def _selected_walk(q, k, v, bi, o, lse, *, select_size, scale, gated_sum=None, store_o=True, tma=None):
    # gated_sum: (o_cmp, o_swa, g_cmp, g_slc, g_swa, out) for `store_forward`'s GATE_SUM; tma: None or
    # True, TMA copies where `tma_ok`; False, per-thread loads
    B, T, HQ, DK = q.shape
    HKV, DV = k.shape[2], v.shape[3]
    G = HQ // HKV
    GP, BT = _tiling(G)
    nsel = bi.shape[-1]
    BDK, BDK2 = dk_tiles(DK)
    tma = tma is not False and not BDK2 and tma_ok(k, v)
    kv = (tma_descriptor(k, select_size, BDK), tma_descriptor(v, select_size, pow2(DV))) if tma else (k, v)
    launcher(_selected_fwd_kernel)[(cdiv(T, BT), B * HKV)](
        q, *kv, bi, o, lse, *(gated_sum if gated_sum is not None else (o,) * 6),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), T, HQ, G, nsel, scale * LOG2E,
        DK=DK, DV=DV, BDK=BDK, BDK2=BDK2, BDV=pow2(DV), GP=GP, BT=BT, BS=select_size, NP=pow2(nsel, 1),
        UPCAST=interpreting(), TMA=tma, GATE_SUM=gated_sum is not None, STORE_O=store_o,
        PACKED=BT > 1,  # BT <= SELECTED_ROWS = 16 positions: a bit each beside a block index fits int64
        **selected_fwd_launch(BT, DK, tma),
    )


def selected_fwd_launch(positions: int, dk: int, tma: bool = False) -> dict:
    """num_warps and num_stages of the selected forward: `SELECTED_FWD_CONFIG` for one position per
    program (G >= 16), `SELECTED_FWD_CONFIG_MULTI` (`..._TMA` with TMA copies) for several; with one
    position, q/k dims past 128 take at least `SELECTED_FWD_WIDE_WARPS`."""
    multi = SELECTED_FWD_CONFIG_MULTI_TMA if tma else SELECTED_FWD_CONFIG_MULTI
    config = dict(SELECTED_FWD_CONFIG if positions == 1 else multi)
    if dk > 128 and positions == 1:
        config["num_warps"] = max(config["num_warps"], SELECTED_FWD_WIDE_WARPS)
    return config


# ---------------------------------------------------------------------------------------------
# dk/dv (and dq) through an inverted index: per key block, the query positions that selected it
# ---------------------------------------------------------------------------------------------
@triton.jit
def _selected_dkv_kernel(
    Q, K, V, DO, LSE, DELTA, GATE, ITEM_SEG, ITEM_CHUNK, SEG_START, POS, DK32, DV32, DQ32,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
    T, HQ, G, NS, NSEG, scale, scale_log2, CHUNK,
    DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDK2: tl.constexpr, BDV: tl.constexpr,
    GP: tl.constexpr, BQ: tl.constexpr, BS: tl.constexpr, UPCAST: tl.constexpr, GATED: tl.constexpr,
    PRELOAD: tl.constexpr,
):
    # One program per work item: up to CHUNK query positions (x G heads) of one (b, kv head, block)
    # segment (`inverted_index`), gathered BQ positions at a time into M = BQ * GP rows of one
    # MMA. Partial dk/dv go to the float32 DK32/DV32 [B, T, HKV, D] by atomics (one add per item, not
    # per query). Each query's dq share from this block, ds @ k, goes to the float32 DQ32 [B, T, HQ, DK]
    # by atomics too: ds is at hand, where a walk of every query's blocks would read them all again.
    # GATED: the output's gradient is GATE [B, T, HQ] (per row) times DO, and DELTA rowsum(o * DO):
    # the gates scale p. PRELOAD (= CHUNK, a power of two): the item's positions are loaded once before
    # the loop and each step's rows gathered from registers, so that no load in the loop depends on
    # another (a position load there makes Triton's pipeliner wait for every copy in flight).
    M: tl.constexpr = BQ * GP
    i_item = tl.program_id(0)
    seg = tl.load(ITEM_SEG + i_item)
    if seg < NSEG:
        HKV = HQ // G
        blk, i_b, i_hk, start, end = item_range(ITEM_CHUNK, SEG_START, seg, i_item, HQ, G, NS, CHUNK)
        # o_k [BS] token positions of the block, k [BS, BDK], k2 [BS, BDK2], v [BS, BDV]
        o_k, m_k, k, k2, v = block_kv(K, V, i_b, i_hk, blk, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, T, DK, DV,
                                      BDK, BDK2, BDV, BS, UPCAST)
        o_dk = tl.arange(0, BDK)
        o_dv = tl.arange(0, BDV)
        o_r = tl.arange(0, M)
        r_g = o_r % GP
        r_h = i_hk * G + r_g  # [M] query head of each row
        dk, dk2 = split_zeros(BS, BDK, BDK2)
        dv = tl.zeros([BS, BDV], tl.float32)
        o_c = tl.arange(0, PRELOAD)
        item_pos = tl.load(POS + start + o_c, mask=start + o_c < end, other=0)  # [PRELOAD]
        for i0 in range(start, end, BQ):
            e = i0 + o_r // GP  # [M] entry of each row in the sorted list
            m_r = (e < end) & (r_g < G)
            r_t = tl.gather(item_pos, tl.minimum(e - start, PRELOAD - 1), 0)
            r_t = tl.where(m_r, r_t, 0)  # [M] query position of each row
            row = (i_b * T + r_t.to(tl.int64)) * HQ + r_h  # [M] flat (b, t, h)
            q, q2 = load_rows(Q + i_b * sq_b + r_h * sq_h + r_t.to(tl.int64) * sq_t, m_r, DK, BDK, BDK2,
                              UPCAST)  # [M, BDK], [M, BDK2]
            do = tl.load(DO + row[:, None] * DV + o_dv[None, :], mask=m_r[:, None] & (o_dv < DV)[None, :],
                         other=0.0)  # [M, BDV]
            if UPCAST:
                do = do.to(tl.float32)
            lse = tl.load(LSE + row, mask=m_r, other=0.0)
            lse = tl.where(lse == float("-inf"), 0.0, lse) * 1.4426950408889634
            delta = tl.load(DELTA + row, mask=m_r, other=0.0)
            s = tl.dot(q, tl.trans(k))  # [M, BS]
            if BDK2 > 0:
                s += tl.dot(q2, tl.trans(k2))
            valid = (o_k[None, :] <= r_t[:, None]) & m_r[:, None]
            pr = tl.where(valid, tl.exp2(s * scale_log2 - lse[:, None]), 0.0)  # [M, BS]
            if GATED:
                pr = pr * tl.load(GATE + row, mask=m_r, other=0.0).to(tl.float32)[:, None]
            dp = tl.dot(do, tl.trans(v))  # [M, BS]
            ds = pr * (dp - delta[:, None])
            dv += tl.dot(tl.trans(pr.to(do.dtype)), do)  # [BS, BDV]
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q)  # [BS, BDK]
            if BDK2 > 0:
                dk2 += tl.dot(tl.trans(ds.to(q2.dtype)), q2)  # [BS, BDK2]
            dq = tl.dot(ds.to(k.dtype), k)  # [M, BDK]
            tl.atomic_add(DQ32 + row[:, None] * DK + o_dk[None, :], dq * scale,
                          mask=m_r[:, None] & (o_dk < DK)[None, :], sem="relaxed")
            if BDK2 > 0:
                o_dk2 = BDK + tl.arange(0, BDK2)
                dq2 = tl.dot(ds.to(k2.dtype), k2)  # [M, BDK2]
                tl.atomic_add(DQ32 + row[:, None] * DK + o_dk2[None, :], dq2 * scale, mask=m_r[:, None],
                              sem="relaxed")
        kv_row = (i_b * T + o_k.to(tl.int64)) * HKV + i_hk  # [BS]
        tl.atomic_add(DK32 + kv_row[:, None] * DK + o_dk[None, :], dk * scale,
                      mask=m_k[:, None] & (o_dk < DK)[None, :], sem="relaxed")
        if BDK2 > 0:
            o_dk2 = BDK + tl.arange(0, BDK2)
            tl.atomic_add(DK32 + kv_row[:, None] * DK + o_dk2[None, :], dk2 * scale, mask=m_k[:, None],
                          sem="relaxed")
        tl.atomic_add(DV32 + kv_row[:, None] * DV + o_dv[None, :], dv,
                      mask=m_k[:, None] & (o_dv < DV)[None, :], sem="relaxed")


def by_block(G: int, kv_rows: int) -> bool:
    """Whether the forward of a group of G query heads over `kv_rows` = B x T x Hkv key rows runs per
    key block (`selected_by_block`) instead of the position-major walk (`SELECTED_BY_BLOCK_MAX_GROUP`,
    `SELECTED_BY_BLOCK_MIN_ROWS`)."""
    return G <= SELECTED_BY_BLOCK_MAX_GROUP and kv_rows >= SELECTED_BY_BLOCK_MIN_ROWS


def _forward(q, k, v, bi, o, lse, *, select_size, scale, presorted, gated_sum=None, store_o=True,
             before_sum=None, per_block=None, tma=None):
    # before_sum: called before the first launch that reads gated_sum's outputs
    B, T, HKV = k.shape[:3]
    if by_block(q.shape[2] // HKV, B * T * HKV) if per_block is None else per_block:
        selected_forward_by_block(q, k, v, bi, o, lse, select_size=select_size, scale=scale,
                                  presorted=presorted, gated_sum=gated_sum, store_o=store_o,
                                  before_merge=before_sum)
    else:
        if before_sum is not None:
            before_sum()
        _selected_walk(q, k, v, bi, o, lse, select_size=select_size, scale=scale, gated_sum=gated_sum,
                       store_o=store_o, tma=tma)


def selected_forward(q, k, v, bi, *, select_size, scale, presorted=False, per_block=None, tma=None):
    """o [B,T,Hq,Dv], lse [B,T,Hq] of the selection branch (inputs contiguous, bi int32; `presorted`:
    every list ascending, as `select_blocks` writes them). `per_block` (None: `by_block` decides) and
    `tma` (None: TMA copies where `tma_ok`; False: per-thread loads) choose the path, for tests that
    cover one the inputs at hand would not take."""
    B, T, HQ, _ = q.shape
    o = torch.empty(B, T, HQ, v.shape[3], device=q.device, dtype=q.dtype)
    lse = torch.empty(B, T, HQ, device=q.device, dtype=torch.float32)
    _forward(q, k, v, bi, o, lse, select_size=select_size, scale=scale, presorted=presorted,
             per_block=per_block, tma=tma)
    return o, lse


def selected_forward_gated(q, k, v, bi, o_cmp, o_swa, g_cmp, g_slc, g_swa, *, select_size, scale,
                           keep_o=True, presorted=False, before_sum=None, per_block=None):
    """The selection branch's forward that also writes NSA's output,
    `g_cmp * o_cmp + g_slc * o_slc + g_swa * o_swa`, from its epilogue (no pass of its own over the
    three outputs). Inputs contiguous, bi int32; o_cmp, o_swa `[B, T, Hq, Dv]`, gates `[B, T, Hq]`.
    Returns (o `[B, T, Hq, Dv]`, o_slc or None without `keep_o`, lse_slc `[B, T, Hq]` float32).
    `before_sum`: called before the first launch that reads o_cmp, o_swa or the gates (the walk's, or
    the merge after the forward per key block), e.g. to wait for the stream that writes o_swa.
    `per_block`: as in `selected_forward`."""
    B, T, HQ, _ = q.shape
    o = torch.empty(B, T, HQ, v.shape[3], device=q.device, dtype=q.dtype)
    o_slc = torch.empty_like(o) if keep_o else o  # without keep_o the kernel writes only o
    lse = torch.empty(B, T, HQ, device=q.device, dtype=torch.float32)
    _forward(q, k, v, bi, o_slc, lse, select_size=select_size, scale=scale, presorted=presorted,
             gated_sum=(o_cmp, o_swa, g_cmp, g_slc, g_swa, o), store_o=keep_o, before_sum=before_sum,
             per_block=per_block)
    return o, (o_slc if keep_o else None), lse


def selected_backward(q, k, v, bi, o, lse, do, *, select_size, scale, delta=None, dq_float32=False,
                      gate=None, presorted=False, dq_into=None, split_dk=None):
    """dq, dk, dv of the selected forward, all from one kernel per key block (inverted index).
    `delta`: float32 `[B, T, Hq]` rowsum(o * do) where the caller has it. `dq_float32`: dq as its
    float32 accumulator (no cast), for a caller that adds more to it. `gate` (contiguous
    `[B, T, Hq]`): the output's gradient is `gate[..., None] * do`, applied inside the kernel; `delta`
    stays rowsum(o * do). `presorted`: every list of bi is ascending, -1 padded at the end (as
    `select_blocks` writes them). `dq_into`: a contiguous float32 tensor of q's shape (another
    branch's dq) that this dq is added to and that is returned as dq (instead of a zeroed
    accumulator). `split_dk` (None: the launch's, `selected_dkv_launch`): the q/k dim in two halves."""
    B, T, HQ, DK = q.shape
    HKV, DV = k.shape[2], v.shape[3]
    G = HQ // HKV
    do = do.contiguous()
    if delta is None:
        delta = row_delta(o, do)
    if dq_into is not None and (dq_into.shape != q.shape or dq_into.dtype != torch.float32
                                or not dq_into.is_contiguous()):
        raise ValueError(f"selected_backward: dq_into must be a contiguous float32 tensor of shape "
                         f"{tuple(q.shape)}")
    dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32) if dq_into is None else dq_into
    dk32 = torch.zeros(k.shape, device=k.device, dtype=torch.float32)
    dv32 = torch.zeros(v.shape, device=v.device, dtype=torch.float32)
    dq_dtype = torch.float32 if dq_float32 or dq_into is not None else q.dtype
    if B * T * HKV * bi.shape[-1] == 0:
        return dq.to(dq_dtype), dk32.to(k.dtype), dv32.to(v.dtype)
    GP = pow2(G, 1)
    launch = selected_dkv_launch(q.dtype, DK, DV)
    rows = launch.pop("rows")  # not a launch option; the interpreter takes 16 whatever the default
    BQ = max(1, (16 if interpreting() else rows) // GP)  # positions per MMA
    chunk = BQ * (4 if interpreting() else 64)  # positions per work item
    # PRELOAD = chunk sizes a tl.arange: a power of two, as BQ (rows and GP are) times 4 or 64 is
    assert chunk & (chunk - 1) == 0, f"positions per work item must be a power of two, got {chunk}"
    pos, seg_start, item_seg, item_chunk = inverted_index(bi, select_size=select_size, chunk=chunk,
                                                          presorted=presorted)
    ns = cdiv(T, select_size)
    split = launch.pop("split_dk")
    BDK, BDK2 = dkv_column_tiles(DK, split if split_dk is None else split_dk)
    launcher(_selected_dkv_kernel)[(item_seg.numel(),)](
        q, k, v, do, lse, delta, gate if gate is not None else delta, item_seg, item_chunk, seg_start, pos,
        dk32, dv32, dq,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), T, HQ, G, ns, B * HKV * ns, scale, scale * LOG2E, chunk,
        DK=DK, DV=DV, BDK=BDK, BDK2=BDK2, BDV=pow2(DV), GP=GP, BQ=BQ, BS=select_size, UPCAST=interpreting(),
        GATED=gate is not None, PRELOAD=chunk, **launch,
    )
    return dq.to(dq_dtype), dk32.to(k.dtype), dv32.to(v.dtype)


def selected_dkv_launch(dtype, dk: int, dv: int) -> dict:
    """rows (`SELECTED_DKV_ROWS`), num_warps and num_stages of the dk/dv kernel: SELECTED_DKV_CONFIG
    over 8 warps for head dims >= 128 (else 4). Wide rows (`wide_rows`: float32, or 16-bit dims past
    the paper's 192 + 128) run at most 2 stages: in float32 at d = 128 a third buffer overflows the
    H200's shared memory (2 stages already take 230,144 of its 232,448 bytes). Past 192 + 128 they
    also take 32 rows: at 256 + 256 in bf16, 64 rows need 263,168 bytes at 3 stages and 262,912 at 2,
    32 rows 147,840 at 2 (192 + 128: 214,272 at the defaults padded to 256, 156,928 split).
    `split_dk`: the q/k dim in two column halves. At the 16-bit dims in `SELECTED_DKV_WIDE`, its launch
    replaces what it names of `SELECTED_DKV_ROWS` and `SELECTED_DKV_CONFIG`."""
    config = dict(rows=SELECTED_DKV_ROWS, num_warps=8 if max(dk, dv) >= 128 else 4, split_dk=False)
    config |= SELECTED_DKV_CONFIG
    wide = wide_rows(dtype, dk, dv)
    if (dk, dv) in SELECTED_DKV_WIDE and not wide:
        config |= SELECTED_DKV_WIDE[dk, dv]
    if wide:
        config["num_stages"] = min(config.get("num_stages", 2), 2)
    if pow2(dk) + pow2(dv) > 384:
        config["rows"] = min(config["rows"], 32)
    return config


def dkv_column_tiles(dk: int, split: bool) -> tuple[int, int]:
    """`(BDK, BDK2)` of the dk/dv kernel: `dk_tiles`, or with `split` (`selected_dkv_launch`'s
    `split_dk`) a power-of-two dim >= 32 in two halves, so that dq's and dk's products take two MMAs
    of half the registers each."""
    head, tail = dk_tiles(dk)
    if split and tail == 0 and head == dk >= 32:
        return dk // 2, dk // 2
    return head, tail


def _int32_indices(block_indices: torch.Tensor, T: int, select_size: int) -> torch.Tensor:
    """`block_indices` as contiguous int32, meaning the same: a cast alone would wrap int64 entries past
    int32's range onto real blocks, so entries past the last block (all future) are clamped to it first,
    and negative ones (padding) to -1."""
    if block_indices.dtype == torch.int64:
        block_indices = block_indices.clamp(-1, -(-T // select_size))
    return block_indices.to(torch.int32).contiguous()


class SelectedAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, block_indices, select_size, scale):
        q, k, v = contiguous(q, k, v)
        bi = _int32_indices(block_indices, q.shape[1], select_size)
        o, lse = selected_forward(q, k, v, bi, select_size=select_size, scale=scale)
        ctx.save_for_backward(q, k, v, bi, o, lse)
        ctx.params = (select_size, scale)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, bi, o, lse = ctx.saved_tensors
        select_size, scale = ctx.params
        dq, dk, dv = selected_backward(q, k, v, bi, o, lse, do, select_size=select_size, scale=scale)
        return dq, dk, dv, None, None, None


def selected_attention(q, k, v, block_indices, *, select_size=64, scale=None):
    """Attention over the tokens of the selected blocks, token-level causal.

    Args:
        q: queries `[B, T, Hq, Dk]`; k, v: `[B, T, Hkv, Dk]`, `[B, T, Hkv, Dv]`.
        block_indices: integer `[B, T, Hkv, n]`; negative entries are padding, repeats count once.
        select_size: selection block length (a power of two >= 16 for this kernel).

    Returns:
        o `[B, T, Hq, Dv]`.
    """
    if select_size < 16 or select_size & (select_size - 1):
        raise ValueError(
            f"the Triton selected_attention needs select_size a power of two >= 16, got {select_size}"
        )
    scale = default_scale(scale, q.shape[-1])
    return SelectedAttentionFunction.apply(q, k, v, block_indices, select_size, scale)
