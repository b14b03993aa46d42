"""Quest's Triton prefill: page bounds, the kept pages of each query, and the attention over them, on the
tile machinery of budget_attention.py (shapes and the sink/local rule there).

Quest's rule (methods/quest.py, the controller's `_select`): query `p` held to the budget keeps sink,
local and its own page, and `picks = budget - forced` candidates (the visible keys outside those) first
in (page bound descending, position ascending) order. Every key of a page carries the page's bound, so
the kept candidates are whole pages in (bound descending, page ascending) order, the last one cut to
its earliest candidates. Three steps:

1. `page_bounds`: Quest's bound `sum_d max(q_d kmin_d, q_d kmax_d) = q+ . kmax + q- . kmin` (q+ =
   max(q, 0), q- = min(q, 0)) as two tensor-core products per tile of queries x pages. The operands
   are exact in q's dtype (a clamp of q; kmin and kmax are keys), every product of two bf16 numbers is
   exact in float32, and both products accumulate in float32, as `methods.quest.page_bounds` does in
   PyTorch: the two differ only in the order of the float32 sums. (The form `q . c + |q| . r` with c,
   r the pages' centres and radii would need c and r, which are not bf16 numbers: it would round the
   operands, and so move the bounds by more than the order of a sum.) A bound within a few float32
   ulps of the cut page's may therefore rank on either side of it here and in the chunked path, as it
   already may between two chunk shapes of cuBLAS; `tests/methods/test_quest_fast.py` checks every
   kept set against a float64 evaluation of the bounds up to exactly such near ties, and exactly where
   the bounds are exact (small integers).
2. `_page_select_kernel`: per row, the cut in (bound descending, page ascending) order, each page
   weighted by its candidates, as a bitmask of the kept pages `[B, Hq, L, W]` (int32 words, W =
   cdiv(pages, 32); bit i of word w: page 32 w + i) and `cut`, the last kept position of the cut page:
   key j of a marked page is kept unless its page is the cut page (`cut // page_size`) and j > cut.
   Rows not held get every bit and cut INT_MAX.
3. `_quest_fwd_kernel`: the attention of `budget_attention.py`'s tile ranges, whose candidate tiles
   are a gather list (`_plan_kernel`, which also counts the kept keys from the masks): the key tiles
   holding a page some row of the program keeps (the union over its BT positions x G heads). Each
   tile's scores start from a bias of one small MMA of the rows' page bits against the tile's pages
   (-2^100 at the keys of pages a row does not keep whole: their probabilities are exactly 0), and each
   row's cut page joins a key at a time; programs of few candidate tiles mask each tile per row by one
   small MMA against the tile's page slots instead.

Why a union per program and not a list per row: a row's kept pages differ from its neighbours', and a
tensor-core product needs rows that share a key tile. Per row, the 1,920 chosen keys of a query cost
1,920 x 64 x 2 bytes x 2 (K and V) = 492 KB of reads for 4 x 1,920 x 64 = 0.5 MFLOP, on CUDA cores: 262k
rows at 8k read 129 GB, against 16 MB of K/V. Per 64-row tile (16 positions x 4 heads) one K/V tile
(16 KB) serves 64 rows; the price is that a tile is visited when any of them keeps a page in it. Each
row keeps 120 of p/16 pages, so where the rows' choices are independent (random data) a tile is
skipped with probability (1 - 4 x 120 / (p / 16))^64 ~ 0 at every length up to 64k: the list is then
every candidate tile, and the kernel costs a masked dense pass. Where neighbouring queries and a
group's heads choose alike (a trained model's attention), the union is a fraction of the pages and so
is the work.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from nsa_eval.kernels._triton_utils import (
    LOG2E,
    cdiv,
    dot,
    group_rows,
    interpreting,
    launcher,
    online_softmax_step,
    online_softmax_step_full,
    pow2,
    softmax_start,
)

from .budget_attention import (
    INT_MAX,
    _config,
    _dense_tile,
    _float_key,
    _grouped_scores,
    _kth_key,
    _load_queries,
    _masked_start,
    _near,
    _s,
    _store_out,
    _tile_ranges,
    _tile_scores,
    _tile_values,
    kth_key_counts,
    kth_key_launch,
)

# The selection's working set: float32 bounds of at most this many (row, page) pairs a step (128 MiB,
# about 250 queries at 64k and 32 heads: larger steps save host time, smaller ones memory)
QUEST_BOUND_ELEMS = 32 << 20
# the page bitmask of one attention launch: at most this many bytes (4,096 queries a launch at 64k); with
# the bounds about 200 MiB of extra memory a layer, against the allowance of a tenth of the
# model's prefill peak (about 3 GiB for the 1B model at 8k)
QUEST_BITS_BYTES = 64 << 20
# `_quest_fwd_kernel`'s key tile beside `BUDGET_CONFIG`'s rows (its warps and stages where the
# autotuner does not choose: float32, the interpreter, `tiles`)
QUEST_CONFIG = dict(BN=64, num_warps=4, num_stages=2)
# From this many candidate tiles a program keeps their whole pages without a mask and pays for its cut
# pages once: sm_90, the 1B shape in bf16, a tile takes 437 instructions a thread (`_page_bias`) against
# 589 (`_slot_keep`) on Triton 3.6, 418 against 491 on 3.8, and the cut pages 16 steps of about 410:
# even at 43 tiles on 3.6, 92 on 3.8
QUEST_BIAS_MIN_TILES = 64
# `_plan_kernel`: mask words a step (sm_90, 64 rows a program: 16 spill to local memory, all 128 of a
# 64k row 6,620 local loads and stores a program)
PLAN_WORDS = 8
# `_bounds_kernel`: BT positions x the group's heads, BP pages a program
BOUNDS_CONFIG = dict(rows=64, BP=64, num_warps=4, num_stages=2)


# ---------------------------------------------------------------------------------------------
# 1. Page bounds
# ---------------------------------------------------------------------------------------------
@triton.jit
def _bounds_kernel(
    Q, KMIN, KMAX, BND, sq_b, sq_h, sq_t, sm_b, sm_h, sm_p, n, Pc, t_base, HQ, G,
    D: tl.constexpr, BD: tl.constexpr, GP: tl.constexpr, BT: tl.constexpr, BP: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # Grid (cdiv(n, BT), B * Hkv, cdiv(Pc, BP)): the bounds of the queries t_base .. t_base + n of Q
    # against pages [BP i, BP (i + 1)) of KMIN/KMAX ([B, Hkv, >= Pc, D], q's dtype), into BND [B * Hq, n,
    # Pc] float32 (contiguous)
    i_b, i_hk, _, o_r, r_t, m_r = group_rows(n, HQ, G, GP, BT)
    q, i_h = _load_queries(Q, i_b, i_hk, o_r, r_t, m_r, t_base, sq_b, sq_h, sq_t, G, GP, D, BD, UPCAST)
    o_p = tl.program_id(2) * BP + tl.arange(0, BP)
    o_d = tl.arange(0, BD)
    m_p = (o_p < Pc)[:, None] & (o_d < D)[None, :]
    at = i_b * sm_b + i_hk * sm_h + o_p[:, None].to(tl.int64) * sm_p + o_d[None, :]
    kmin = tl.load(KMIN + at, mask=m_p, other=0.0)  # [BP, BD]
    kmax = tl.load(KMAX + at, mask=m_p, other=0.0)
    if UPCAST:
        kmin = kmin.to(tl.float32)
        kmax = kmax.to(tl.float32)
    zero = tl.zeros_like(q)
    bound = dot(tl.where(q > 0, q, zero), tl.trans(kmax))  # [M, BP]
    bound += dot(tl.where(q < 0, q, zero), tl.trans(kmin))
    out = ((i_b * HQ + i_h) * n + r_t).to(tl.int64) * Pc  # [M]
    tl.store(BND + out[:, None] + o_p[None, :], bound, mask=m_r[:, None] & (o_p < Pc)[None, :])


def page_bounds(q, key_min, key_max, *, t_base: int, n: int, pages: int):
    """Quest's bounds of the queries `t_base .. t_base + n` of q `[B, Hq, T, D]` against the first `pages`
    pages of key_min/key_max `[B, Hkv, >= pages, D]` (`quest_summaries`, in q's dtype) -> `[B, Hq, n,
    pages]` float32 (`methods.quest.page_bounds`' values, the float32 sums in another order)."""
    B, HQ, _, D = q.shape
    HKV = key_min.shape[1]
    G = HQ // HKV
    GP = pow2(G, 1)
    rows = 16 if interpreting() else BOUNDS_CONFIG["rows"]
    BT, BP = max(1, rows // GP), (16 if interpreting() else BOUNDS_CONFIG["BP"])
    stages = 1 if q.dtype == torch.float32 else BOUNDS_CONFIG["num_stages"]
    out = torch.empty(B, HQ, n, pages, device=q.device, dtype=torch.float32)
    grid = (cdiv(n, BT), B * HKV, cdiv(pages, BP))
    launcher(_bounds_kernel)[grid](
        q, key_min, key_max, out, *_s(q), *_s(key_min), n, pages, t_base, HQ, G,
        D=D, BD=pow2(D), GP=GP, BT=BT, BP=BP, UPCAST=interpreting(), num_warps=BOUNDS_CONFIG["num_warps"],
        num_stages=stages,
    )
    return out


# ---------------------------------------------------------------------------------------------
# 2. The kept pages of each row
# ---------------------------------------------------------------------------------------------
@triton.jit
def _page_select_kernel(BND, BITS, CUT, R, n, Pc, W, L, t_off, p0, sink, local, budget,
                        PS: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, CB: tl.constexpr,
                        WIDE: tl.constexpr):
    # `quest_page_select` in one pass over the bounds: BR rows a program of BND `[B * Hq, n, Pc]` float32
    # (`page_bounds` of n queries at positions p0 .., their pages up to the last one). Row r = (bh, t)
    # writes its page mask to BITS `[B * Hq, L, W]` row (bh, t_off + t) (words past BC // 32 untouched:
    # the caller zeroes them) and its cut to CUT `[B * Hq, L]`. The picks-th candidate in (bound
    # descending, page ascending) order: the bounds map to int32 keys ordered like the floats, and
    # `_kth_key` finds the largest key with at least `picks` candidates at or above it, each page
    # weighted by its candidates (PS, fewer where the sink's candidates begin and the last one ends).
    # int32 row arithmetic (R, and B * Hq * L rows, are far below 2**31): int64 would double the cost of
    # every per-page integer op below
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)  # [BR]
    m_r = o_r < R
    t = o_r % n
    p = p0 + t  # [BR] query positions
    o_c = tl.arange(0, BC)  # [BC] pages
    hi_c = tl.minimum(p - local, p // PS * PS - 1)  # candidates: [sink, hi_c]
    picks = budget - (p + 1 - tl.maximum(hi_c - sink + 1, 0))  # [BR]
    start = o_c * PS
    c = tl.minimum(start[None, :] + PS - 1, hi_c[:, None]) - tl.maximum(start, sink)[None, :] + 1
    c = tl.maximum(c, 0).to(tl.int32)  # [BR, BC] candidates of each page
    valid = m_r[:, None] & (o_c < Pc)[None, :] & (c > 0)
    c = tl.where(valid, c, 0)
    x = tl.load(BND + o_r[:, None].to(tl.int64) * Pc + o_c[None, :], mask=valid, other=float("-inf"))
    key = _float_key(x)
    thr = _kth_key(key, c, picks, CB, WIDE)
    # (a page without candidates has bound -inf here, below every held row's finite threshold)
    above = key > thr[:, None]
    need = picks - tl.sum(tl.where(above, c, 0), 1)  # candidates still to take at the threshold
    tied = key == thr[:, None]
    if tl.max(tl.sum(tied.to(tl.int32), 1), 0) > 1:  # some row's threshold bound is tied across pages
        ceq = tl.cumsum(tl.where(tied, c, 0), 1)  # [BR, BC] nondecreasing
        short = ceq < need[:, None]
        cut_pg = tl.sum(short.to(tl.int32), 1)  # the first page where the tied pages reach need
        before = tl.max(tl.where(short, ceq, 0), 1)
    else:  # one tied page a row, whose candidates reach need (or none): no scan
        cut_pg = tl.min(tl.where(tied, o_c[None, :], BC), 1)
        before = cut_pg * 0
    cut = tl.maximum(cut_pg * PS, sink) + need - before - 1
    keep = above | (tied & (o_c[None, :] <= cut_pg[:, None]))
    held = p + 1 > budget
    keep = tl.where(held[:, None], keep & (picks > 0)[:, None], (start[None, :] <= p[:, None]))
    cut = tl.where(held & (picks > 0), cut, 2147483647)
    lane = (o_c % 32)[None, :]
    words = tl.sum(tl.reshape(keep.to(tl.int32) << lane, [BR, BC // 32, 32]), 2)  # [BR, BC // 32]
    o_w = tl.arange(0, BC // 32)
    out = (o_r // n * L + t_off + t).to(tl.int64)  # [BR] the row in the launch's buffers
    tl.store(BITS + out[:, None] * W + o_w[None, :], words, mask=m_r[:, None] & (o_w < W)[None, :])
    tl.store(CUT + out, cut.to(tl.int32), mask=m_r)


def page_select_into(bounds, bits, cut, *, t_off: int, p0: int, sink: int, local: int, budget: int,
                     page_size: int) -> None:
    """`quest_page_select` by `_page_select_kernel`: bounds `[B, Hq, n, Pc]` float32 of the queries at
    positions `p0 ..` (contiguous) -> their rows `t_off ..` of bits `[B, Hq, L, W]` (zero past the
    words of Pc pages) and cut `[B, Hq, L]`."""
    B, HQ, n, Pc = bounds.shape
    L, W = bits.shape[2], bits.shape[3]
    BC = pow2(Pc, 32)
    BR, warps = kth_key_launch(BC)
    BR = 16 if interpreting() else BR
    R = B * HQ * n
    launcher(_page_select_kernel)[(cdiv(R, BR),)](bounds, bits, cut, R, n, Pc, W, L, t_off, p0, sink, local,
                                                  budget, PS=page_size, BR=BR, BC=BC, num_warps=warps,
                                                  **kth_key_counts(BC, page_size))


def quest_summaries(k, page_size: int):
    """Per-page per-channel min and max of unpadded keys `[B, Hkv, S, D]` -> key_min, key_max `[B, Hkv,
    P, D]` float32 (P = cdiv(S, page_size)): `Quest.prepare`'s values, without its scatter."""
    B, HKV, S, D = k.shape
    P = cdiv(S, page_size)
    kf = k.float()
    pad = P * page_size - S
    lo = kf if not pad else torch.cat([kf, kf.new_full((B, HKV, pad, D), math.inf)], 2)
    hi = kf if not pad else torch.cat([kf, kf.new_full((B, HKV, pad, D), -math.inf)], 2)
    return lo.view(B, HKV, P, page_size, D).amin(3), hi.view(B, HKV, P, page_size, D).amax(3)



# ---------------------------------------------------------------------------------------------
# 3. The attention over the kept pages
# ---------------------------------------------------------------------------------------------
@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _popcount(x):
    # set bits of each int32 (SWAR: pairs, nibbles, bytes, then the bytes summed by one multiply)
    x = x.to(tl.uint32, bitcast=True)
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return ((x * 0x01010101) >> 24).to(tl.int32)


@triton.jit
def _page_bit(words, page, o_w):
    # [R] bit `page` [R] of each row's mask words [R, BW]
    word = tl.sum(tl.where(o_w[None, :] == (page // 32)[:, None], words, 0), 1)
    return (word >> (page % 32)) & 1


@triton.jit
def _candidates_in(page, sink, near, PS: tl.constexpr):
    # [R] candidates ([sink, near]) of page [R] of each row
    return tl.maximum(tl.minimum(page * PS + PS - 1, near) - tl.maximum(page * PS, sink) + 1, 0)


@triton.jit
def _marked_candidates(words, sink, near, o_w, PS: tl.constexpr):
    # [R] candidates of the pages marked in each row's words [R, BW] (only candidate pages are marked):
    # PS a page, less what the sink's page and the last candidate's page lack
    first = tl.zeros_like(near) + sink // PS
    last = tl.maximum(near, 0) // PS
    n = PS * tl.sum(_popcount(words), 1)
    n -= _page_bit(words, first, o_w) * (PS - _candidates_in(first, sink, near, PS))
    return n - _page_bit(words, last, o_w) * (PS - _candidates_in(last, sink, near, PS)) * (last != first)


@triton.jit
def _plan_kernel(
    BITS, CUT, LIST, NLIST, CNT, KVR, T, S, HQ, G, sink, local, budget, W, LW,
    GP: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, PS: tl.constexpr, BW: tl.constexpr,
    TPW: tl.constexpr, CW: tl.constexpr, READ_BITS: tl.constexpr,
):
    # Grid (cdiv(T, BT), B * Hkv), the attention's programs; BITS [B, Hq, T, W] and CUT [B, Hq, T]
    # (`_page_select_kernel`'s), T queries the last of S keys. For each program: LIST [B * Hkv, cdiv(T,
    # BT), LW] gets the starts of its candidate tiles (`_tile_ranges`' [e2, e3)) that hold a page some row
    # of it keeps, ascending, NLIST how many (READ_BITS: pages of a power-of-two size, TPW = 32 PS / BN
    # tiles to a mask word; otherwise every candidate tile is listed). For each row, CNT [B, Hq, T]: the
    # keys it keeps (forced, then its marked pages' candidates less the cut page's past the cut); for each
    # position, KVR [B, Hkv, T]: the keys some head of the group keeps (the marked pages' union, where a
    # page that is only ever a cut page counts its longest kept prefix). The mask words go CW at a time
    # (BW of them at once spill to local memory at 64k); every quantity is a sum over words, or a bit
    # of one word, so the chunks add up.
    i_b, i_hk, t0, o_r, r_t, m_r = group_rows(T, HQ, G, GP, BT)
    i_h = i_hk * G + o_r % GP
    row = ((i_b * HQ + i_h) * T + r_t).to(tl.int64)  # [M]
    first = S - T + t0
    last = S - T + tl.minimum(t0 + BT, T) - 1
    _, e2, e3, _, _, _ = _tile_ranges(first, last, sink, local, BN, PS)
    prog = (i_b * (HQ // G) + i_hk) * tl.num_programs(0) + tl.program_id(0)
    pos = S - T + r_t  # [M]
    near = _near(pos, local, PS)
    near_t = tl.max(tl.reshape(near, [BT, GP]), 1)  # [BT] (the same for a position's heads)
    cut = tl.load(CUT + row, mask=m_r, other=2147483647)
    has_cut = cut < 2147483647
    c_pg = cut // PS  # [M] the cut page
    o_x = tl.arange(0, TPW)
    n_list = tl.full([], 0, tl.int32)  # tiles listed so far
    marked = tl.zeros_like(near)  # [M] candidates of each row's marked pages
    n_union = tl.zeros_like(near_t)  # [BT] candidates of the group's union of marked pages
    cut_kept = tl.zeros_like(near)  # [M] whether some head keeps the row's cut page whole
    for w0 in range(0, W, CW):
        o_w = w0 + tl.arange(0, CW)
        words = tl.load(BITS + row[:, None] * W + o_w[None, :], mask=m_r[:, None] & (o_w < W)[None, :],
                        other=0)  # [M, CW]
        # the gather list
        tile = o_w[:, None] * TPW + o_x[None, :]  # [CW, TPW]
        ok = (tile * BN >= e2) & (tile * BN < e3)
        if READ_BITS:
            any_row = tl.reduce(words, 0, _or)  # [CW]
            NPT: tl.constexpr = max(BN // PS, 1)  # pages a tile holds
            MASK: tl.constexpr = -1 if NPT >= 32 else (1 << NPT) - 1
            ok = ok & (((any_row[:, None] >> ((o_x * BN) // PS)[None, :]) & MASK) != 0)
        ok = tl.reshape(ok, [CW * TPW]).to(tl.int32)
        slot = n_list + tl.cumsum(ok, 0) - 1
        tl.store(LIST + prog * LW + slot, tl.reshape(tile, [CW * TPW]) * BN, mask=ok != 0)
        n_list += tl.sum(ok, 0)
        # the counts, and the union over the group: every marked page, less a page that only some heads'
        # cut falls in (counted to the longest of their kept prefixes)
        marked += _marked_candidates(words, sink, near, o_w, PS)
        in_cut_word = has_cut[:, None] & (o_w[None, :] == (c_pg // 32)[:, None])
        full = tl.where(in_cut_word, words & ~(1 << (c_pg % 32))[:, None], words)  # [M, CW] but the cut page
        union = tl.reduce(tl.reshape(words, [BT, GP, CW]), 1, _or)  # [BT, CW]
        union_full = tl.reduce(tl.reshape(full, [BT, GP, CW]), 1, _or)
        n_union += _marked_candidates(union, sink, near_t, o_w, PS)
        full_rows = tl.broadcast_to(tl.reshape(union_full, [BT, 1, CW]), [BT, GP, CW])
        cut_kept |= _page_bit(tl.reshape(full_rows, [BT * GP, CW]), c_pg, o_w)
    tl.store(NLIST + prog, n_list)
    forced = pos + 1 - tl.maximum(near - sink + 1, 0)
    held = pos + 1 > budget
    tail = tl.where(has_cut, tl.minimum(c_pg * PS + PS - 1, near) - cut, 0)  # its candidates past the cut
    tl.store(CNT + row, tl.where(held, forced + marked - tail, pos + 1), mask=m_r)
    only_cut = has_cut & m_r & (cut_kept == 0)  # [M] a cut page no head keeps whole
    prefix = cut - tl.maximum(c_pg * PS, sink) + 1  # [M] candidates the row keeps in its cut page
    lack = _candidates_in(c_pg, sink, near, PS) - prefix
    # one row per such page answers for it: the one keeping the longest prefix (the first head on ties)
    c3 = tl.reshape(tl.where(only_cut, c_pg, -1), [BT, GP])
    l3 = tl.reshape(lack, [BT, GP])
    g = tl.arange(0, GP)
    beaten = (c3[:, :, None] == c3[:, None, :]) & ((l3[:, None, :] < l3[:, :, None]) | (
        (l3[:, None, :] == l3[:, :, None]) & (g[None, None, :] < g[None, :, None])))  # [BT, GP, GP]
    answers = (c3 >= 0) & (tl.max(beaten.to(tl.int32), 2) == 0)
    n_union -= tl.sum(tl.where(answers, l3, 0), 1)
    pos_t = S - T + t0 + tl.arange(0, BT)
    forced_t = pos_t + 1 - tl.maximum(near_t - sink + 1, 0)
    o_t = t0 + tl.arange(0, BT)
    kvr = tl.where(pos_t + 1 > budget, forced_t + n_union, pos_t + 1)
    tl.store(KVR + (i_b * (HQ // G) + i_hk) * T + o_t, kvr, mask=o_t < T)


@triton.jit
def _quest_keep(k0, bits_row, m_r, pos, cut, cut_end, near, sink, BN: tl.constexpr, PS: tl.constexpr,
                ONE_WORD: tl.constexpr):
    # [M, BN] the keys of tile [k0, k0 + BN) each row keeps: visible, and sink, local or own page (j >
    # near), or in a marked page and not past the cut within the cut page (cut < j < cut_end)
    o_k = k0 + tl.arange(0, BN)
    pg = o_k // PS  # [BN]
    visible = m_r[:, None] & (o_k[None, :] <= pos[:, None])
    if ONE_WORD:  # the tile's pages, shifted to the low bits of the row's word, against constant masks
        word = tl.load(bits_row + k0 // (32 * PS), mask=m_r, other=0) >> (k0 // PS % 32)  # [M]
        bit = word[:, None] & (1 << (tl.arange(0, BN) // PS))[None, :]
    else:
        word = tl.load(bits_row[:, None] + (pg // 32)[None, :], mask=visible, other=0)  # [M, BN]
        bit = (word >> (pg % 32)[None, :]) & 1
    chosen = (bit != 0) & ((o_k[None, :] <= cut[:, None]) | (o_k[None, :] >= cut_end[:, None]))
    return visible & ((o_k < sink)[None, :] | (o_k[None, :] > near[:, None]) | chosen)


@triton.jit
def _page_slots(BN: tl.constexpr, PS: tl.constexpr, DT: tl.constexpr):
    # [16, BN] in DT: slot i (the i-th page of a tile aligned with the pages) holds BN - n at its keys n
    o_i = tl.arange(0, 16)
    o_n = tl.arange(0, BN)
    return tl.where((o_n // PS)[None, :] == o_i[:, None], BN - o_n[None, :], 0).to(DT)


@triton.jit
def _slot_keep(k0, bits_row, m_r, cut, slots, BN: tl.constexpr, PS: tl.constexpr, DT: tl.constexpr):
    # [M, BN] the keys of a candidate tile each row keeps, by one MMA: the rows' page bits [M, 16]
    # (2 BN for a marked page, 1 for the cut page) times the slots (BN - n at key n of each page) give
    # 2 BN (BN - n) >= 2 BN at a marked page's keys and BN - n at the cut page's; the cut page keeps
    # key n where n <= cut - k0, i.e. where BN - n >= BN - (cut - k0). All values exact in bf16.
    pg0 = k0 // PS
    word = tl.load(bits_row + pg0 // 32, mask=m_r, other=0) >> (pg0 % 32)  # [M] slot i: bit i
    o_i = tl.arange(0, 16)
    bit = (word[:, None] >> o_i[None, :]) & 1  # [M, 16]
    is_cut = (pg0 + o_i)[None, :] == (cut // PS)[:, None]
    a = tl.where(bit != 0, tl.where(is_cut, 1, 2 * BN), 0).to(DT)
    val = tl.dot(a, slots)  # [M, BN]
    need = tl.minimum(tl.maximum(BN - (cut - k0), 1), BN + 1)  # [M]
    return val >= need[:, None].to(tl.float32)


@triton.jit
def _page_bias(k0, bits_row, m_r, cut, pages, PS: tl.constexpr, DT: tl.constexpr):
    # [M, BN] float32 of a candidate tile aligned with its pages: 0 at the keys of the pages a row keeps
    # whole (marked, and not its cut page), -2^100 elsewhere, by one MMA of the rows' page weights [M,
    # 16] against `pages` (1 at slot i's keys): each key sums its page's weight and zeros, exactly. As the
    # scores' starting sum it leaves a kept score as it was and takes a dropped one to about -2^100, whose
    # probability is exactly 0 once the row's max is a real score (the masked tiles, with the row's own
    # key, go first)
    pg0 = k0 // PS
    word = tl.load(bits_row + pg0 // 32, mask=m_r, other=0) >> (pg0 % 32)  # [M] slot i: bit i
    o_i = tl.arange(0, 16)
    whole = (((word[:, None] >> o_i[None, :]) & 1) != 0) & ((pg0 + o_i)[None, :] != (cut // PS)[:, None])
    return dot(tl.where(whole, 0.0, -1.2676506002282294e30).to(DT), pages)  # -2^100: exact in bf16


@triton.jit
def _cut_page_keys(q, k_base, v_base, sk_t, sv_t, cut, rows, e2, e3, m_i, l_i, acc, scale_log2,
                   D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, PS: tl.constexpr):
    # The kept keys of the cut pages that `_page_bias` left out: for each of `rows` [M], the keys of its
    # cut page up to the cut that lie in the candidate tiles [e2, e3) (the masked tiles keep their own),
    # one key a step for every row at once (each row reads its own page), into the online softmax as
    # `online_softmax_step` takes them (q . k summed on the CUDA cores, p not rounded to the values'
    # dtype: the output moves within float32 rounding, the kept set not at all)
    o_d = tl.arange(0, BD)
    o_v = tl.arange(0, BDV)
    qf = q.to(tl.float32)
    c0 = cut // PS * PS  # [M] the cut page's first key
    for j in range(PS):
        key = c0 + j
        kept = rows & (key <= cut) & (key >= e2) & (key < e3)  # [M]
        k = tl.load(k_base + key[:, None].to(tl.int64) * sk_t + o_d[None, :],
                    mask=kept[:, None] & (o_d < D)[None, :], other=0.0).to(tl.float32)  # [M, BD]
        s = tl.where(kept, tl.sum(qf * k, 1), float("-inf"))  # [M]
        m_new = tl.maximum(m_i, s * scale_log2)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s * scale_log2 - m_safe)
        v = tl.load(v_base + key[:, None].to(tl.int64) * sv_t + o_v[None, :],
                    mask=kept[:, None] & (o_v < DV)[None, :], other=0.0).to(tl.float32)  # [M, BDV]
        l_i = l_i * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * v
        m_i = m_new
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["bias_min", "SIZE"])  # SIZE keys the autotuner, not a compile (16 at 32k)
def _quest_fwd_kernel(
    Q, K, V, O, BITS, CUT, LIST, NLIST,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, so_b, so_h, so_t,
    T, S, HQ, G, sink, local, W, LW, scale_log2, bias_min, SIZE,
    D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, GP: tl.constexpr,
    BT: tl.constexpr, BN: tl.constexpr, PS: tl.constexpr, ONE_WORD: tl.constexpr, SLOTS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # Grid (cdiv(T, BT), B * Hkv), as `_budget_fwd_kernel`. BITS `[B, Hq, T, W]` int32 and CUT `[B, Hq,
    # T]` int32 (contiguous): `_page_select_kernel`'s; LIST, NLIST: `_plan_kernel`'s, which counts the
    # kept keys too. ONE_WORD: a key tile's pages lie in one word of the mask (BN divides 32 * PS); SLOTS:
    # and a candidate tile's pages are aligned with it, at most 16, else the candidate tiles take
    # `_quest_keep`. With SLOTS a program of `bias_min` candidate tiles or more keeps their whole pages
    # by the scores' starting sum (`_page_bias`) and its rows' cut pages a key at a time
    # (`_cut_page_keys`); one of fewer masks each tile (`_slot_keep`). SIZE (S's bit length) only keys
    # the autotuner (`_quest_fwd`).
    DT: tl.constexpr = tl.float32 if UPCAST else tl.bfloat16
    i_b, i_hk, t0, o_r, r_t, m_r = group_rows(T, HQ, G, GP, BT)
    q, i_h = _load_queries(Q, i_b, i_hk, o_r, r_t, m_r, 0, sq_b, sq_h, sq_t, G, GP, D, BD, UPCAST)
    pos = S - T + r_t  # [M]
    row = (i_b * HQ + i_h) * T + r_t  # [M]
    cut = tl.load(CUT + row, mask=m_r, other=2147483647)  # INT_MAX: rows not held keep every marked page
    cut_end = (cut // PS + 1) * PS  # keys cut < j < cut_end: the cut page's candidates past the cut
    near = _near(pos, local, PS)  # keys j > near: local, or the query's own page
    bits_row = BITS + row.to(tl.int64) * W  # [M]
    m_i, l_i, acc = softmax_start(BT * GP, BDV)
    k_base = K + i_b * sk_b + i_hk * sk_h
    v_base = V + i_b * sv_b + i_hk * sv_h
    first = S - T + t0
    last = S - T + tl.minimum(t0 + BT, T) - 1
    e1, e2, e3, e4, e5, end = _tile_ranges(first, last, sink, local, BN, PS)
    for i in range(0, e1 + e5 - e4, BN):  # [0, e1), then [e4, e5): every row keeps them whole
        k0 = tl.where(i < e1, i, e4 + i - e1)
        m_i, l_i, acc = _dense_tile(q, k_base, v_base, sk_t, sv_t, k0, S, m_i, l_i, acc, scale_log2, D, DV,
                                    BD, BDV, BN, UPCAST)
    # the tiles that take the whole test, before the candidates: each row's own key is then in its running
    # max, so a key `_page_bias` drops gets probability exactly 0 (in a row with no score yet the dropped
    # keys would share it, and an inexact -2^100 * scale could overflow exp2)
    slots = _page_slots(BN, PS, DT)
    for i in range(0, (e2 - e1) + (e4 - e3) + (end - e5), BN):
        k0 = _masked_start(i, e1, e2, e3, e4, e5)
        s, o_k = _tile_scores(q, k_base, sk_t, k0, S, D, BD, BN, True, UPCAST)
        if SLOTS:  # a marked page's forced keys are kept anyway, so the slots' test serves here too
            keep = (o_k < sink)[None, :] | (o_k[None, :] > near[:, None])
            keep = keep | _slot_keep(k0, bits_row, m_r, cut, slots, BN, PS, DT)
            keep = keep & m_r[:, None] & (o_k[None, :] <= pos[:, None])
        else:
            keep = _quest_keep(k0, bits_row, m_r, pos, cut, cut_end, near, sink, BN, PS, ONE_WORD)
        v = _tile_values(v_base, sv_t, k0, S, DV, BDV, BN, True, UPCAST)
        m_i, l_i, acc = online_softmax_step(s, keep, v, m_i, l_i, acc, scale_log2)
    prog = (i_b * (HQ // G) + i_hk) * tl.num_programs(0) + tl.program_id(0)
    n_cand = tl.load(NLIST + prog)  # the candidate tiles holding a page some row keeps
    if SLOTS:
        by_bias = n_cand >= bias_min
    else:
        by_bias = n_cand < 0
    if by_bias:  # the pages kept whole through the scores' starting sum, then the cut pages
        pages = (slots != 0).to(DT)  # [16, BN] 1 at slot i's keys
        for i in range(0, n_cand):
            k0 = tl.load(LIST + prog * LW + i)
            bias = _page_bias(k0, bits_row, m_r, cut, pages, PS, DT)
            s, _ = _tile_scores(q, k_base, sk_t, k0, S, D, BD, BN, False, UPCAST, bias)
            v = _tile_values(v_base, sv_t, k0, S, DV, BDV, BN, False, UPCAST)
            m_i, l_i, acc = online_softmax_step_full(s, v, m_i, l_i, acc, scale_log2)
        c_pg = cut // PS
        held = m_r & (cut < 2147483647)
        marked = (tl.load(bits_row + c_pg // 32, mask=held, other=0) >> (c_pg % 32)) & 1
        m_i, l_i, acc = _cut_page_keys(q, k_base, v_base, sk_t, sv_t, cut, held & (marked != 0), e2, e3,
                                       m_i, l_i, acc, scale_log2, D, DV, BD, BDV, PS)
    else:  # each tile masked per row
        for i in range(0, n_cand):
            k0 = tl.load(LIST + prog * LW + i)
            s, _ = _tile_scores(q, k_base, sk_t, k0, S, D, BD, BN, False, UPCAST)
            if SLOTS:
                keep = _slot_keep(k0, bits_row, m_r, cut, slots, BN, PS, DT)
            else:
                keep = _quest_keep(k0, bits_row, m_r, pos, cut, cut_end, near, sink, BN, PS, ONE_WORD)
            v = _tile_values(v_base, sv_t, k0, S, DV, BDV, BN, False, UPCAST)
            m_i, l_i, acc = online_softmax_step(s, keep, v, m_i, l_i, acc, scale_log2)
    _store_out(O, m_i, l_i, acc, i_b, i_h, r_t, m_r, so_b, so_h, so_t, DV, BDV)


# The attention's warps and stages, chosen per model shape and prompt-length class by Triton's autotuner;
# its rows and key tiles stay `_quest_config`'s, which the plan's tile lists were made for.
QUEST_LAUNCHES = [(4, 2), (4, 3), (8, 2)]  # (num_warps, num_stages)
_quest_fwd = triton.autotune(
    configs=[triton.Config({}, num_warps=w, num_stages=st) for w, st in QUEST_LAUNCHES],
    key=["G", "D", "DV", "SIZE"],
)(_quest_fwd_kernel)


def _quest_config(G: int, dtype: torch.dtype, tiles: dict | None = None) -> dict:
    """`_config`'s rows with `QUEST_CONFIG`'s (or `tiles`') key tile, warps and stages (not under the
    interpreter, whose small tiles stay)."""
    cfg = _config(G, dtype)
    cfg["bias_min"] = 0 if interpreting() else QUEST_BIAS_MIN_TILES  # interpreted: the tests take it
    if not interpreting():
        cfg.update(QUEST_CONFIG if tiles is None else tiles)
        if dtype == torch.float32:
            cfg["num_stages"] = 1
    return cfg


def plan(bits, cut, *, T: int, S: int, sink: int, local: int, budget: int, page_size: int, G: int, cfg: dict,
         words_a_step: int = PLAN_WORDS):
    """`_plan_kernel` for the bits `[B, Hq, T, W]` and cut `[B, Hq, T]` of T queries whose keys are S: the
    candidate tiles of each attention program that hold a kept page, list `[B * Hkv, cdiv(T, BT), LW]`
    int32 (tile starts, ascending; past n undefined) and n `[B * Hkv, cdiv(T, BT)]` int32, and the kept
    keys' counts `[B, Hq, T]` and kv_read `[B, Hkv, T]` (int32). `words_a_step` (a power of two): the mask
    words the kernel reads a step."""
    B, HQ, _, W = bits.shape
    HKV = HQ // G
    ps, BN = page_size, cfg["BN"]
    read_bits = ps & (ps - 1) == 0 and BN <= 32 * ps
    BW = pow2(W, 1)
    TPW = 32 * ps // BN if read_bits else pow2(cdiv(cdiv(S, BN), BW), 1)
    n_prog = cdiv(T, cfg["BT"])
    lists = torch.empty(B * HKV, n_prog, BW * TPW, device=bits.device, dtype=torch.int32)
    n_list = torch.empty(B * HKV, n_prog, device=bits.device, dtype=torch.int32)
    counts = torch.empty(B, HQ, T, device=bits.device, dtype=torch.int32)
    kv_read = torch.empty(B, HKV, T, device=bits.device, dtype=torch.int32)
    launcher(_plan_kernel)[(n_prog, B * HKV)](
        bits, cut, lists, n_list, counts, kv_read, T, S, HQ, G, sink, local, budget, W, BW * TPW,
        GP=cfg["GP"], BT=cfg["BT"], BN=BN, PS=ps, BW=BW, TPW=TPW, CW=min(BW, words_a_step),
        READ_BITS=read_bits, num_warps=4,
    )
    return lists, n_list, counts, kv_read


def quest_attention(q, k, v, *, scale: float, sink: int, local: int, budget: int, page_size: int,
                    bound_elems: int | None = None, bits_bytes: int | None = None, select: str = "triton",
                    tiles: dict | None = None):
    """Quest's budgeted attention over unpadded keys: `budget_attention`'s shapes and returns (o, counts
    `[B, Hq, T]`, kv_read `[B, Hkv, T]`), with the keys of the kept pages. The queries go in launches of
    at most `bits_bytes` of page mask, each filled by selection steps of at most `bound_elems` bounds
    (`page_bounds`), the kept pages found by `_page_select_kernel` (select "triton") or by
    `quest_page_select` (select "torch", the readable reference, on `page_bounds_reference`); `tiles`
    overrides `QUEST_CONFIG`."""
    bound_elems = QUEST_BOUND_ELEMS if bound_elems is None else bound_elems
    bits_bytes = QUEST_BITS_BYTES if bits_bytes is None else bits_bytes
    B, HQ, T, D = q.shape
    HKV, S, DV = k.shape[1], k.shape[2], v.shape[3]
    G = HQ // HKV
    ps = page_size
    P = cdiv(S, ps)
    W = cdiv(P, 32)
    cfg = _quest_config(G, q.dtype, tiles)
    BN = cfg["BN"]
    one_word = (32 * ps) % BN == 0
    slots = one_word and (BN % ps == 0 or ps % BN == 0) and BN // ps <= 16
    key_min, key_max = quest_summaries(k, ps)
    if select == "triton":  # exact in q's dtype: they are keys
        key_min, key_max = key_min.to(q.dtype), key_max.to(q.dtype)
    o = torch.empty(B, HQ, T, DV, device=q.device, dtype=q.dtype)
    counts = torch.empty(B, HQ, T, device=q.device, dtype=torch.int32)
    kv_read = torch.empty(B, HKV, T, device=q.device, dtype=torch.int32)
    rows = max(cfg["BT"], bits_bytes // (B * HQ * W * 4) // cfg["BT"] * cfg["BT"])
    for l0 in range(0, T, rows):
        L = min(rows, T - l0)
        bits = torch.zeros(B, HQ, L, W, device=q.device, dtype=torch.int32)
        cut = torch.empty(B, HQ, L, device=q.device, dtype=torch.int32)
        for t0, n in quest_steps(B * HQ, T, S, ps, l0, l0 + L, bound_elems):
            if select == "torch":
                bits[:, :, t0 - l0:t0 - l0 + n], cut[:, :, t0 - l0:t0 - l0 + n] = quest_page_select(
                    q, key_min, key_max, t_base=t0, Tc=n, T=T, S=S, sink=sink, local=local, budget=budget,
                    page_size=ps, W=W)
                continue
            if S - T + t0 + n <= budget:  # no query of the step is held: every key it sees
                bits[:, :, t0 - l0:t0 - l0 + n] = -1
                cut[:, :, t0 - l0:t0 - l0 + n] = INT_MAX
                continue
            Pc = (S - T + t0 + n - 1) // ps + 1
            bounds = page_bounds(q, key_min, key_max, t_base=t0, n=n, pages=Pc)
            page_select_into(bounds, bits, cut, t_off=t0 - l0, p0=S - T + t0, sink=sink, local=local,
                             budget=budget, page_size=ps)
        Sl = S - T + l0 + L  # keys up to the launch's last query: its queries are their last L
        lists, n_list, cnt, kvr = plan(bits, cut, T=L, S=Sl, sink=sink, local=local, budget=budget,
                                       page_size=ps, G=G, cfg=cfg)
        qs, os_ = q[:, :, l0:l0 + L], o[:, :, l0:l0 + L]
        grid = (cdiv(L, cfg["BT"]), B * HKV)
        args = (qs, k, v, os_, bits, cut, lists, n_list, *_s(qs), *_s(k), *_s(v), *_s(os_), L, Sl, HQ, G,
                sink, local, W, lists.shape[-1], scale * LOG2E, cfg["bias_min"], Sl.bit_length())
        dims = dict(D=D, DV=DV, BD=pow2(D), BDV=pow2(DV), GP=cfg["GP"], BT=cfg["BT"], BN=BN, PS=ps,
                    ONE_WORD=one_word, SLOTS=slots, UPCAST=interpreting())
        if tiles is None and not interpreting() and q.dtype != torch.float32:
            _quest_fwd[grid](*args, **dims)
        else:
            launcher(_quest_fwd_kernel)[grid](*args, **dims, num_warps=cfg["num_warps"],
                                              num_stages=cfg["num_stages"])
        counts[:, :, l0:l0 + L] = cnt
        kv_read[:, :, l0:l0 + L] = kvr
    return o, counts, kv_read


# ---------------------------------------------------------------------------------------------
# Readable references (PyTorch)
# ---------------------------------------------------------------------------------------------
def _pack_bits(keep_pg, W: int):
    """`[..., Pc]` bool -> `[..., W]` int32 words (bit i of word w: page 32 w + i)."""
    Pc = keep_pg.shape[-1]
    x = torch.nn.functional.pad(keep_pg.to(torch.int32), (0, W * 32 - Pc))  # [..., W * 32]
    weights = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32, device=x.device)
    return (x.view(*x.shape[:-1], W, 32) * weights).sum(-1, dtype=torch.int32)


def quest_page_select(q, key_min, key_max, *, t_base: int, Tc: int, T: int, S: int, sink: int, local: int,
                      budget: int, page_size: int, W: int):
    """Quest's kept pages for the queries `t_base .. t_base + Tc` of q `[B, Hq, T, D]` (S keys, the last T
    being the queries; key_min/key_max `[B, Hkv, >= P, D]` float32, `quest_summaries`).

    Returns bits `[B, Hq, Tc, W]` int32 (the kept pages, above) and cut `[B, Hq, Tc]` int32 (the last kept
    position of the cut page; INT_MAX for rows not held). Order: (bound descending, page ascending),
    the stable sort of the chunked path; the bounds are `page_bounds` of the chunk's float32 queries
    against the pages up to its last query.
    """
    B, HQ, _, _ = q.shape
    ps, dev = page_size, q.device
    p = torch.arange(S - T + t_base, S - T + t_base + Tc, device=dev)  # [Tc]
    bits = torch.full((B, HQ, Tc, W), -1, device=dev, dtype=torch.int32)
    cut = torch.full((B, HQ, Tc), INT_MAX, device=dev, dtype=torch.int32)
    h0 = max(0, min(Tc, budget - (S - T + t_base)))  # the chunk's first row held to the budget
    if h0 == Tc:
        return bits, cut
    ph = p[h0:]  # [n]
    n = ph.numel()
    Pc = (S - T + t_base + Tc - 1) // ps + 1  # pages up to the last query
    # the candidates of row p are the interval [sink, min(p - local, own page start - 1)]
    hi_c = torch.minimum(ph - local, ph // ps * ps - 1)  # [n]
    picks = budget - (ph + 1 - (hi_c - sink + 1).clamp(min=0))  # [n] budget - forced
    start = torch.arange(Pc, device=dev) * ps  # [Pc]
    c = (torch.minimum(start + ps - 1, hi_c[:, None]) - start.clamp(min=sink)[None, :] + 1).clamp(min=0)
    c = c.to(torch.int32)  # [n, Pc] candidates of each page
    b = page_bounds_reference(q[:, :, t_base + h0:t_base + Tc].float(), key_min[:, :, :Pc].float(),
                              key_max[:, :, :Pc].float())
    b.masked_fill_(c == 0, -math.inf)  # [B, Hq, n, Pc]
    K = min(Pc, cdiv(max(1, int(picks.max())), ps) + 2)  # pages enough to hold picks: <= 2 partial ones
    top_v, top_i = b.topk(K, dim=-1)  # [B, Hq, n, K] descending (any order among equal bounds)
    top_c = c.expand(B, HQ, n, Pc).gather(-1, top_i)  # [B, Hq, n, K]
    cum = top_c.cumsum(-1)
    i = (cum < picks[:, None]).sum(-1, keepdim=True).clamp(max=K - 1)  # the entry where picks are reached
    thr = top_v.gather(-1, i)  # [B, Hq, n, 1] the cut page's bound
    above = top_v > thr  # every page above thr is in the list, before i
    need = picks - (top_c * above).sum(-1)  # [B, Hq, n] candidates still to take at thr, >= 1
    eq = b == thr  # [B, Hq, n, Pc]
    if int(eq.sum(-1).max()) > 1:  # ties at thr: pages in ascending order, the rows' exact rule
        ceq = torch.where(eq, c, 0).cumsum(-1, dtype=torch.int32)  # [B, Hq, n, Pc]
        cut_pg = (ceq < need[..., None]).sum(-1)  # [B, Hq, n]
        before = ceq.gather(-1, (cut_pg - 1).clamp(min=0)[..., None])[..., 0] * (cut_pg > 0)
        keep_pg = (b > thr) | (eq & (torch.arange(Pc, device=dev) <= cut_pg[..., None]))
        words = _pack_bits(keep_pg, W)
    else:  # one page at thr: the list's first i + 1 entries
        cut_pg = top_i.gather(-1, i)[..., 0]
        before = torch.zeros_like(cut_pg)
        one = torch.pow(2, top_i % 32)  # [B, Hq, n, K] int64: the page's bit in its word
        one = torch.where(one >= 1 << 31, one - (1 << 32), one).to(torch.int32)
        taken = torch.arange(K, device=dev) <= i
        words = torch.zeros(B, HQ, n, W, device=dev, dtype=torch.int32)
        words.scatter_add_(-1, top_i // 32, one * taken)
    cut_pos = (cut_pg * ps).clamp(min=sink) + (need - before) - 1  # [B, Hq, n]
    none = picks <= 0  # [n] rows that pick nothing (budget = sink + local)
    bits[:, :, h0:] = torch.where(none[:, None], 0, words)
    cut[:, :, h0:] = torch.where(none, INT_MAX, cut_pos.to(torch.int32))
    return bits, cut


def page_bounds_reference(q, key_min, key_max):
    """`methods.quest.page_bounds` bit for bit (the same two products and one float32 sum; the methods
    layer above is not imported here), holding one `[B, Hq, Tc, P]` temporary fewer: q `[B, Hq, Tc, D]`
    float32, key_min/key_max `[B, Hkv, P, D]` float32 -> `[B, Hq, Tc, P]`."""
    bounds = _grouped_scores(q.clamp(min=0), key_max)  # [B, Hq, Tc, P]
    bounds += _grouped_scores(q.clamp(max=0), key_min)
    return bounds


def quest_steps(rows: int, T: int, S: int, page_size: int, t_lo: int, t_hi: int, bound_elems: int):
    """The selection steps `(t0, n)` over the queries `t_lo .. t_hi` of T: each of at most `bound_elems`
    bounds, `rows` (B * Hq) x n queries x the pages up to its last query."""
    t0 = t_lo
    while t0 < t_hi:
        n = max(1, bound_elems // (rows * ((S - T + t0) // page_size + 1)))
        while n > 1 and rows * n * ((S - T + t0 + n - 1) // page_size + 1) > bound_elems:
            n = max(1, n * 3 // 4)
        n = min(n, t_hi - t0)
        yield t0, n
        t0 += n


def quest_keep_from_masks(bits, cut, *, t_base: int, T: int, S: int, sink: int, local: int, page_size: int):
    """The kept keys `[B, Hq, Tc, S]` bool that `_quest_fwd_kernel` applies for `quest_page_select`'s bits
    and cut of the queries `t_base .. t_base + Tc` (a PyTorch reading of the rule, for tests)."""
    Tc = bits.shape[2]
    p = torch.arange(S - T + t_base, S - T + t_base + Tc, device=bits.device)[:, None]  # [Tc, 1]
    j = torch.arange(S, device=bits.device)  # [S]
    pg = j // page_size
    word = bits.gather(-1, (pg // 32).expand(*bits.shape[:3], S))  # [B, Hq, Tc, S]
    bit = ((word >> (pg % 32)) & 1) != 0
    cut = cut[..., None].long()
    chosen = bit & ((pg != cut // page_size) | (j <= cut))
    forced = (j < sink) | (j > p - local) | (pg == p // page_size)
    return (j <= p) & (forced | chosen)
