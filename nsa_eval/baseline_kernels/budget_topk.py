"""The exact top-k threshold of the `topk` baseline's Triton prefill (see budget_attention.py for the
shapes and the keep rule `s > thr or (s == thr and j <= cut)`).

`topk_thresholds` finds each row's `thr` and `cut` in four steps:
1. a bracket `[lo, hi]` per row from a strided sample of the candidates' scores (`sample_brackets`:
   `_sample_kernel` scores the sample columns, `_select_kernel` picks two of its order statistics);
2. `_count_kernel`, which computes every candidate's score with the same tile product as the attention
   (`budget_attention._tile_scores`: same tiles, same `dot`, bit-identical scores), counts those above
   `hi` and histograms those within the bracket over `NB` equal ranges of score (`bin_params`; a bin is
   a float32 floor of the score's offset, non-decreasing in the score, so tied scores share a bin);
   `narrow` then takes the bin holding the pick;
3. `_collect_kernel`, the same scores again, which counts those above that bin and writes those within
   it, with their positions, to a per-row buffer of `cap` slots in key order (each tile's slots by one
   MMA of its 0/1 matrix against a triangle of ones); the bin within the bracket is an interval of
   scores, whose ends `pick_bin_ends` finds once a row, so a score takes two compares and no bin;
4. `_select_kernel`, an exact select over that buffer: a binary search over the scores' bits, by
   per-row counts (ties to the lower position, as a stable sort: `select_in_buffer_reference`).
A row whose bracket misses (fewer than `picks` above `lo`, more above `hi`) or whose bin holds more than
`cap` keys is reported `failed`; the caller computes those queries with the reference path.

Where the time goes, per query row (H100, the 1B shape, before step 2 existed): the collect pass scored
every candidate and wrote the whole bracket's keys, about `2 z C sqrt(f (1 - f) / n)` of them for C
candidates, `f = picks / C` and a sample of n (about 2,100 at 32k), as scattered 8-byte entries, and the
select read them back: both memory-bound on the bracket's size (3.7 / 69 ms and 8.7 / 65 ms at 8k / 32k,
with the sample's two selects). The count pass adds one more scoring of every candidate (no writes but
`NB + 1` counts a row) so that the collect pass writes, and the select reads, one bin's keys: about
1/16 of the bracket where the scores' density is even over it. The bins are equal ranges of score, not
of the scores' ordered int32 keys: those split a bracket by magnitude, so one straddling zero or open at
one end (a pick near the middle or the bottom of its row's scores) put most of its keys in the pick's
bin, which overflowed the cap and sent the row to the reference path.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from nsa_eval.kernels._triton_utils import cdiv, dot, group_rows, interpreting, launcher, pow2

from .budget_attention import (
    INT_MAX,
    _config,
    _float_key,
    _grouped_scores,
    _key_float,
    _kth_key,
    _load_queries,
    _s,
    _tile_ranges,
    _tile_scores,
    kth_key_launch,
)

# The collect pass's buffer (8 bytes a slot), or the sample's scores (4 bytes a column), takes at most this
# many bytes a chunk of queries (about 1,000 queries at 64k and 32 heads: larger chunks save host time,
# smaller ones memory)
TOPK_BUFFER_BYTES = 256 << 20

# The count pass's bins a bracket: two int64 words of 8-bit counts a row (`_count_tile`)
NB = 16


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------
@triton.jit
def _sample_kernel(
    Q, K, OUT, sq_b, sq_h, sq_t, sk_b, sk_h, sk_t,
    TC, t_base, T, S, HQ, G, sink, local, stride, NS,
    D: tl.constexpr, BD: tl.constexpr, GP: tl.constexpr, BT: tl.constexpr, BNS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # Grid (cdiv(TC, BT), B * Hkv) over the queries t_base .. t_base + TC of T: the scores of each row
    # against the sample columns sink + i * stride (i < NS) into OUT [B * Hq, TC, NS] float32. A row's
    # usable columns (<= p - local) are a prefix of them; the columns past every row's prefix are not
    # written.
    i_b, i_hk, t0, o_r, r_t, m_r = group_rows(TC, HQ, G, GP, BT)
    q, i_h = _load_queries(Q, i_b, i_hk, o_r, r_t, m_r, t_base, sq_b, sq_h, sq_t, G, GP, D, BD, UPCAST)
    pos = S - T + t_base + r_t  # [M]
    row = ((i_b * HQ + i_h) * TC + r_t).to(tl.int64)  # [M]
    k_base = K + i_b * sk_b + i_hk * sk_h
    last = S - T + t_base + tl.minimum(t0 + BT, TC) - 1
    n_cols = tl.minimum(NS, tl.maximum(last - local - sink, -1) // stride + 1)  # columns some row uses
    o_d = tl.arange(0, BD)
    for c0 in range(0, n_cols, BNS):
        o_c = c0 + tl.arange(0, BNS)
        cols = sink + o_c * stride
        k = tl.load(k_base + cols[:, None].to(tl.int64) * sk_t + o_d[None, :],
                    mask=(o_c < n_cols)[:, None] & (o_d < D)[None, :], other=0.0)  # [BNS, BD]
        if UPCAST:
            k = k.to(tl.float32)
        s = dot(q, tl.trans(k))  # [M, BNS]
        s = tl.where(cols[None, :] <= pos[:, None] - local, s, float("-inf"))
        tl.store(OUT + row[:, None] * NS + o_c[None, :], s, mask=m_r[:, None] & (o_c < n_cols)[None, :])


@triton.jit
def _bracket_rows(Q, LO, HI, sq_b, sq_h, sq_t, TC, t_base, T, S, HQ, G, D: tl.constexpr, BD: tl.constexpr,
                  GP: tl.constexpr, BT: tl.constexpr, UPCAST: tl.constexpr):
    # a count or collect program's rows (`group_rows`), their queries, positions, row indices into the
    # [B, Hq, TC] row arrays and brackets (lo = +inf for a padding row: it counts nothing)
    i_b, i_hk, t0, o_r, r_t, m_r = group_rows(TC, HQ, G, GP, BT)
    q, i_h = _load_queries(Q, i_b, i_hk, o_r, r_t, m_r, t_base, sq_b, sq_h, sq_t, G, GP, D, BD, UPCAST)
    pos = S - T + t_base + r_t  # [M]
    row = ((i_b * HQ + i_h) * TC + r_t).to(tl.int64)  # [M]
    lo = tl.load(LO + row, mask=m_r, other=float("inf"))
    hi = tl.load(HI + row, mask=m_r, other=float("inf"))
    return i_b, i_hk, t0, r_t, m_r, q, pos, row, lo, hi


@triton.jit
def _bracket_tile(q, k_base, sk_t, k0, S, pos, lo, hi, n_above, sink, local, D: tl.constexpr,
                  BD: tl.constexpr, BN: tl.constexpr, MASKED: tl.constexpr, UPCAST: tl.constexpr):
    # one key tile's scores s [M, BN] and positions, the candidates above hi added to n_above [M], and
    # which lie within [lo, hi] (the count and collect passes' shared start). MASKED: the tile may hold
    # keys that are not some row's candidates.
    s, o_k = _tile_scores(q, k_base, sk_t, k0, S, D, BD, BN, MASKED, UPCAST)
    above = s > hi[:, None]
    inside = (s >= lo[:, None]) & (s <= hi[:, None])
    if MASKED:
        cand = (o_k >= sink)[None, :] & (o_k[None, :] <= pos[:, None] - local)
        above = above & cand
        inside = inside & cand
    return s, o_k, n_above + tl.sum(above.to(tl.int32), 1), inside


@triton.jit
def _bin(s, base, inv_w, NB: tl.constexpr):
    # the count pass's bin of each score s [M, BN] (float32): floor((s - base) * inv_w) clamped to
    # [0, NB), per row base, inv_w [M]; `bin_of` is the same in PyTorch, bit for bit (a subtraction, a
    # product and a floor, each exact IEEE float32), and non-decreasing in s, so tied scores share a bin
    b = tl.floor((s - base[:, None]) * inv_w[:, None])
    return tl.minimum(tl.maximum(b, 0.0), NB - 1).to(tl.int32)


@triton.jit
def _count_tile(q, k_base, sk_t, k0, S, pos, lo, hi, base, inv_w, n_above, hist, sink, local,
                D: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr, MASKED: tl.constexpr,
                UPCAST: tl.constexpr):
    # one key tile of the count pass: the candidates above hi are counted, and those within [lo, hi] added
    # to the row's histogram hist [M, NB] by their bin (`_bin`). MASKED as `_bracket_tile`.
    s, _, n_above, inside = _bracket_tile(q, k_base, sk_t, k0, S, pos, lo, hi, n_above, sink, local, D, BD,
                                          BN, MASKED, UPCAST)
    b = _bin(s, base, inv_w, NB)  # [M, BN]
    # each bin an 8-bit field of one of two int64 words (a tile adds at most BN < 256 to a bin): two row
    # sums a tile instead of NB compares a score
    one = inside.to(tl.int64) << ((b & 7) * 8).to(tl.int64)
    low = tl.sum(tl.where(b < 8, one, 0), 1)  # [M] bins 0..7
    high = tl.sum(tl.where(b < 8, 0, one), 1)  # [M] bins 8..15
    o_b = tl.arange(0, NB)
    word = tl.where(o_b[None, :] < 8, low[:, None], high[:, None])  # [M, NB]
    hist += ((word >> ((o_b & 7) * 8).to(tl.int64)[None, :]) & 255).to(tl.int32)
    return n_above, hist


@triton.jit
def _count_kernel(
    Q, K, LO, HI, BASE, INV_W, N_ABOVE, HIST,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t,
    TC, t_base, T, S, HQ, G, sink, local,
    D: tl.constexpr, BD: tl.constexpr, GP: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
    NB: tl.constexpr, UPCAST: tl.constexpr,
):
    # Grid (cdiv(TC, BT), B * Hkv) over the queries t_base .. t_base + TC of T, the collect pass's tiles
    # (in another order: counts do not depend on it). Per row: N_ABOVE, the candidates scoring above HI,
    # and HIST [B, Hq, TC, NB], those within [LO, HI] by bin (`_bin`, with the row's BASE and INV_W).
    # Row arrays [B, Hq, TC], contiguous. A row whose LO is +inf counts nothing.
    tl.static_assert(NB <= 16)  # two int64 words of 8-bit fields
    tl.static_assert(BN < 256)
    i_b, i_hk, t0, r_t, m_r, q, pos, row, lo, hi = _bracket_rows(
        Q, LO, HI, sq_b, sq_h, sq_t, TC, t_base, T, S, HQ, G, D, BD, GP, BT, UPCAST)
    base = tl.load(BASE + row, mask=m_r, other=0.0)
    inv_w = tl.load(INV_W + row, mask=m_r, other=0.0)
    n_above = tl.zeros([BT * GP], tl.int32)
    hist = tl.zeros([BT * GP, NB], tl.int32)
    k_base = K + i_b * sk_b + i_hk * sk_h
    first = S - T + t_base + t0
    last = S - T + t_base + tl.minimum(t0 + BT, TC) - 1  # the program's last position
    e1, e2, e3, _, _, _ = _tile_ranges(first, last, sink, local, BN, 0)
    for k0 in range(e2, e3, BN):  # candidates of every row
        n_above, hist = _count_tile(q, k_base, sk_t, k0, S, pos, lo, hi, base, inv_w, n_above, hist, sink,
                                    local, D, BD, BN, NB, False, UPCAST)
    ends = tl.maximum(tl.maximum(last - local, -1) // BN + 1, 0) * BN  # the tiles up to the last candidate
    n1 = e2 - e1
    for i in range(0, n1 + tl.maximum(ends - e3, 0), BN):  # the sink's partial tile; where candidates end
        k0 = tl.where(i < n1, e1 + i, e3 + i - n1)
        n_above, hist = _count_tile(q, k_base, sk_t, k0, S, pos, lo, hi, base, inv_w, n_above, hist, sink,
                                    local, D, BD, BN, NB, True, UPCAST)
    tl.store(N_ABOVE + row, n_above, mask=m_r)
    o_b = tl.arange(0, NB)
    tl.store(HIST + row[:, None] * NB + o_b[None, :], hist, mask=m_r[:, None])


@triton.jit
def _least_in_bin(base, inv_w, want, NB: tl.constexpr):
    # [M, W] float32: the least float32 s whose bin (`_bin`, row m's base and inv_w [M]) is at least
    # want [M, W] (1..NB-1), +inf where none is (inv_w 0: one bin). A binary search over the ordered
    # keys of -inf .. +inf (int64 ends: their span overflows int32), which holds because a bin never
    # falls as the score rises: bin(-inf) is 0 and, for inv_w > 0, bin(+inf) is NB - 1.
    reaches = inv_w > 0
    inv_w = tl.where(reaches, inv_w, 1.0)  # no inf * 0 in the search of a row that takes no result
    lo_key = _float_key(tl.full(want.shape, float("-inf"), tl.float32)).to(tl.int64)
    hi_key = _float_key(tl.full(want.shape, float("inf"), tl.float32)).to(tl.int64)
    for _ in range(32):  # the span of the keys, under 2**32
        mid = lo_key + (hi_key - lo_key) // 2
        up = _bin(_key_float(mid.to(tl.int32)), base, inv_w, NB) >= want
        lo_key = tl.where(up, lo_key, mid)
        hi_key = tl.where(up, mid, hi_key)
    return tl.where(reaches[:, None], _key_float(hi_key.to(tl.int32)), float("inf"))


@triton.jit
def _pick_bin_ends_kernel(LO, HI, BASE, INV_W, PICK, A, C, R, BR: tl.constexpr, NB: tl.constexpr):
    # BR of the R rows a program: `pick_bin_ends`. The pick bin's first score and the next bin's, both
    # searched at once ([BR, 2])
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    m_r = o_r < R
    lo = tl.load(LO + o_r, mask=m_r, other=float("inf"))
    hi = tl.load(HI + o_r, mask=m_r, other=float("inf"))
    base = tl.load(BASE + o_r, mask=m_r, other=0.0)
    inv_w = tl.load(INV_W + o_r, mask=m_r, other=0.0)
    pick = tl.load(PICK + o_r, mask=m_r, other=-1)
    first = _least_in_bin(base, inv_w, tl.join(tl.maximum(pick, 1), tl.minimum(pick + 1, NB - 1)), NB)
    e_pick, e_next = tl.split(first)
    e_pick = tl.where(pick >= 1, e_pick, float("-inf"))  # bin 0 starts below every score
    e_next = tl.where(pick + 1 <= NB - 1, e_next, float("inf"))  # no bin above the last
    hi_key = _float_key(hi)
    after_hi = _key_float(tl.where(hi < float("inf"), hi_key + 1, hi_key))  # the float after hi (or +inf)
    a = tl.maximum(lo, e_pick)
    c = tl.minimum(tl.maximum(lo, e_next), after_hi)
    collected = pick >= 0
    tl.store(A + o_r, tl.where(collected, a, float("inf")), mask=m_r)
    tl.store(C + o_r, tl.where(collected, c, float("inf")), mask=m_r)


@triton.jit
def _collect_tile(q, k_base, sk_t, k0, S, pos, a, c, buf_row, n_above, n_in, upper, CAP, sink, local,
                  D: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, DT: tl.constexpr, MASKED: tl.constexpr,
                  UPCAST: tl.constexpr):
    # one key tile of the collect pass: the candidates scoring at least c [M] are counted, those in [a, c)
    # (the row's pick bin, `pick_bin_ends`) written at the row's next slots (buf_row [M]: each row's
    # first) in key order, as one int64 each: the score's bits above the key's position. MASKED as
    # `_bracket_tile`.
    s, o_k = _tile_scores(q, k_base, sk_t, k0, S, D, BD, BN, MASKED, UPCAST)
    above = s >= c[:, None]
    inside = (s >= a[:, None]) & ~above
    if MASKED:
        cand = (o_k >= sink)[None, :] & (o_k[None, :] <= pos[:, None] - local)
        above = above & cand
        inside = inside & cand
    n_above += tl.sum(above.to(tl.int32), 1)
    before = tl.dot(tl.where(inside, 1.0, 0.0).to(DT), upper).to(tl.int32)  # [M, BN] inside, before each
    slot = n_in[:, None] + before
    write = inside & (slot < CAP)
    packed = (s.to(tl.int32, bitcast=True).to(tl.int64) << 32) | o_k[None, :].to(tl.int64)
    tl.store(buf_row[:, None] + slot, packed, mask=write)
    n_in += tl.sum(inside.to(tl.int32), 1)
    return n_above, n_in


@triton.jit
def _collect_kernel(
    Q, K, A, C, N_ABOVE, N_IN, BUF,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t,
    TC, t_base, T, S, HQ, G, sink, local, CAP,
    D: tl.constexpr, BD: tl.constexpr, GP: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # Grid (cdiv(TC, BT), B * Hkv) over the queries t_base .. t_base + TC of T. Per row: N_ABOVE, the
    # candidates scoring at least C, and N_IN, those in [A, C) (the pick bin: `pick_bin_ends`), the
    # first CAP of them (in key order) written to BUF (int64: score bits << 32 | position). Row arrays
    # are [B, Hq, TC] and BUF [B, Hq, TC, CAP], contiguous. A row whose A and C are +inf (a row not held
    # to the budget, or not collected) counts nothing.
    DT: tl.constexpr = tl.float32 if UPCAST else tl.bfloat16
    i_b, i_hk, t0, r_t, m_r, q, pos, row, a, c = _bracket_rows(
        Q, A, C, sq_b, sq_h, sq_t, TC, t_base, T, S, HQ, G, D, BD, GP, BT, UPCAST)
    buf_row = BUF + row * CAP  # [M]
    o_n = tl.arange(0, BN)
    upper = (o_n[:, None] < o_n[None, :]).to(DT)  # [BN, BN]: key n' comes before key n
    n_above = tl.zeros([BT * GP], tl.int32)
    n_in = tl.zeros([BT * GP], tl.int32)
    k_base = K + i_b * sk_b + i_hk * sk_h
    first = S - T + t_base + t0
    last = S - T + t_base + tl.minimum(t0 + BT, TC) - 1  # the program's last position
    e1, e2, e3, _, _, _ = _tile_ranges(first, last, sink, local, BN, 0)
    # the tiles in key order, so that the buffer's slots are (ties go to the lower position): the sink's
    # partial tile, the candidates of every row, then the tiles up to the last candidate
    for k0 in range(e1, e2, BN):
        n_above, n_in = _collect_tile(q, k_base, sk_t, k0, S, pos, a, c, buf_row, n_above, n_in, upper,
                                      CAP, sink, local, D, BD, BN, DT, True,
                                      UPCAST)
    for k0 in range(e2, e3, BN):
        n_above, n_in = _collect_tile(q, k_base, sk_t, k0, S, pos, a, c, buf_row, n_above, n_in, upper,
                                      CAP, sink, local, D, BD, BN, DT, False,
                                      UPCAST)
    ends = tl.maximum(tl.maximum(last - local, -1) // BN + 1, 0) * BN
    for k0 in range(e3, ends, BN):
        n_above, n_in = _collect_tile(q, k_base, sk_t, k0, S, pos, a, c, buf_row, n_above, n_in, upper,
                                      CAP, sink, local, D, BD, BN, DT, True,
                                      UPCAST)
    tl.store(N_ABOVE + row, n_above, mask=m_r)
    tl.store(N_IN + row, n_in, mask=m_r)


@triton.jit
def _select_kernel(BUF, N_IN, NEED, THR, CUT, R, CAP, BR: tl.constexpr, BC: tl.constexpr, POS: tl.constexpr):
    # BR rows of a buffer [R, CAP] a program (a row's first N_IN slots written): the NEED-th entry
    # (1-based, NEED in 1..N_IN) in (score descending, slot ascending) order: THR its score and, with
    # POS, CUT its position, or INT_MAX where every entry tied at THR is taken. BUF holds float32 scores,
    # or with POS int64 entries `score bits << 32 | position` (`_collect_kernel`'s). Scores map to
    # int32 keys ordered like the floats, and `_kth_key` finds the NEED-th largest.
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)  # [BR] (int32: int64 doubles the integer ops)
    m_r = o_r < R
    n = tl.minimum(tl.load(N_IN + o_r, mask=m_r, other=0), CAP)
    want = tl.load(NEED + o_r, mask=m_r, other=1)
    o_c = tl.arange(0, BC)
    m = m_r[:, None] & (o_c[None, :] < n[:, None])  # [BR, BC]
    at = o_r[:, None].to(tl.int64) * CAP + o_c[None, :]
    if POS:
        entry = tl.load(BUF + at, mask=m, other=0)
        x = tl.where(m, (entry >> 32).to(tl.int32).to(tl.float32, bitcast=True), float("-inf"))
    else:
        x = tl.load(BUF + at, mask=m, other=float("-inf"))
    key = _float_key(x)
    thr = _kth_key(key, m.to(tl.int32), want, 0, False)  # unit weights: the sums count the entries
    want -= tl.sum((m & (key > thr[:, None])).to(tl.int32), 1)  # entries to take at the threshold
    tied = m & (key == thr[:, None])
    tl.store(THR + o_r, tl.max(tl.where(tied, x, float("-inf")), 1), mask=m_r)
    if POS:
        n_tied = tl.sum(tied.to(tl.int32), 1)
        if tl.max(n_tied, 0) > 1:  # some row's threshold score is tied: the want-th tie in slot order
            rank = tl.cumsum(tied.to(tl.int32), 1)
            p = (entry & 0xFFFFFFFF).to(tl.int32)
            cut = tl.max(tl.where(tied & (rank == want[:, None]), p, -1), 1)
        else:  # one tie a row, which is taken (the line below): no scan, no position
            cut = n_tied * 0 - 1
        cut = tl.where(want == n_tied, 2147483647, cut)  # every tie kept: no cut
        tl.store(CUT + o_r, cut, mask=m_r)


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------
def select_in_buffer(buf, n_in, need, *, positions: bool):
    """The `need`-th of each row's entries, in (score descending, slot ascending) order.

    buf `[..., cap]`: float32 scores, or with `positions` `collect`'s int64 entries (score bits above
    the position, slots in key order); n_in and need `[...]` int (1 <= need <= n_in <= cap where used;
    other rows get garbage) -> thr `[...]` float32 and cut `[...]` int32 (the need-th entry's position,
    INT_MAX where every entry tied at thr is taken; None without `positions`).
    `select_in_buffer_reference` is the same by a stable sort.
    """
    cap = buf.shape[-1]
    rows = buf.numel() // cap
    thr = torch.empty(buf.shape[:-1], device=buf.device, dtype=torch.float32)
    cut = torch.empty(buf.shape[:-1], device=buf.device, dtype=torch.int32) if positions else None
    if rows:
        BC = pow2(cap)
        BR, warps = kth_key_launch(BC)
        BR = max(1, 256 // BC) if interpreting() else BR
        launcher(_select_kernel)[(cdiv(rows, BR),)](
            buf, n_in.int().contiguous(), need.clamp(1, cap).int().contiguous(), thr,
            cut if positions else thr, rows, cap, BR=BR, BC=BC, POS=positions, num_warps=warps)
    return thr, cut


def bin_params(lo, hi, low=None, high=None, nb: int = NB):
    """The count pass's bins of each bracket: `nb` equal ranges of score from lo to hi.

    lo, hi `[...]` float32; low, high `[...]` float32 (optional): finite stand-ins for an infinite lo or
    hi (the sample's lowest and highest scores), scores past them falling in the end bins. Returns
    base, inv_w `[...]` float32: a score s is in bin `bin_of(s, base, inv_w)` = floor((s - base) * inv_w)
    clamped to [0, nb). A row with no finite end, or none below the other, has inv_w 0 (one bin).
    """
    a = lo if low is None else torch.where(lo.isfinite(), lo, low)
    b = hi if high is None else torch.where(hi.isfinite(), hi, high)
    a, b = a.float(), b.float()
    w = (b - a) / nb
    usable = a.isfinite() & w.isfinite() & (w > 0)
    base = torch.where(usable, a, torch.zeros_like(a))
    inv_w = torch.where(usable, 1 / torch.where(usable, w, torch.ones_like(w)), torch.zeros_like(w))
    return base, inv_w


def bin_of(s, base, inv_w, nb: int = NB):
    """`_bin` in PyTorch: s float32 `[..., S]`, base and inv_w `[...]` -> int64 bins `[..., S]`."""
    return torch.floor((s.float() - base[..., None]) * inv_w[..., None]).clamp(0, nb - 1).long()


def count(q, k, lo, hi, base, inv_w, *, t_base: int, sink: int, local: int):
    """The count pass over the queries `t_base .. t_base + Tc` of q `[B, Hq, T, D]` (k `[B, Hkv, S, D]`).

    lo, hi: `[B, Hq, Tc]` float32 brackets on the raw score (lo = +inf: the row counts nothing); base,
    inv_w `[B, Hq, Tc]` their bins (`bin_params`). Returns n_above `[B, Hq, Tc]` int32 (candidates above
    hi) and hist `[B, Hq, Tc, NB]` int32 (those within [lo, hi] by bin). `count_reference` is the same in
    PyTorch.
    """
    n_above = torch.empty(lo.shape, device=q.device, dtype=torch.int32)
    hist = torch.empty(*lo.shape, NB, device=q.device, dtype=torch.int32)
    _bracket_pass(_count_kernel, q, k, (lo, hi, base, inv_w), (n_above, hist), t_base=t_base, sink=sink,
                  local=local, NB=NB)
    return n_above, hist


def narrow(n_above, hist, picks: int):
    """The bin of each row's bracket that holds its pick, for the collect pass.

    n_above `[...]` and hist `[..., NB]` int (`count`'s). need = picks - n_above; a row whose bracket
    holds its pick (1 <= need <= hist's sum) gets the bin holding the need-th largest: pick `[...]` int32
    (-1 for the other rows) and its entries, in_bin `[...]` int64 (0 for the other rows). The collect pass
    over that bin then counts the bins above it in its own n_above.
    """
    need = (picks - n_above).long()[..., None]
    # entries in bin b or above [..., NB]: a product with a triangle of ones, exact in float64 (counts are
    # far below 2**53), where a reversed cumsum over 16 bins runs a slow scan kernel on the GPU
    at_or_above = (hist.double() @ _at_or_above(hist.shape[-1], hist.device)).long()
    holds = (need >= 1) & (need <= at_or_above[..., :1])
    b = ((at_or_above >= need).sum(-1, keepdim=True) - 1).clamp(min=0)  # the last bin still reaching need
    pick = torch.where(holds, b, -1)[..., 0].int()
    return pick, torch.where(holds, hist.long().gather(-1, b), 0)[..., 0]


@functools.cache
def _at_or_above(nb: int, device: torch.device) -> torch.Tensor:
    """`[nb, nb]` float64: entry (b', b) is 1 where b' >= b, so `hist @ it` sums the bins from b up."""
    return torch.ones(nb, nb, dtype=torch.float64, device=device).tril()


def collect(q, k, lo, hi, base, inv_w, pick, *, t_base: int, sink: int, local: int, cap: int):
    """The collect pass over the queries `t_base .. t_base + Tc` of q `[B, Hq, T, D]` (k `[B, Hkv, S, D]`).

    lo, hi: `[B, Hq, Tc]` float32 brackets on the raw score `q . k` (lo = +inf: the row counts nothing);
    base, inv_w their bins (`bin_params`) and pick `[B, Hq, Tc]` int the bin to collect (`narrow`).
    Returns n_above, n_in `[B, Hq, Tc]` int32 (candidates above hi or in a bin above pick; within [lo,
    hi] in bin pick) and buf `[B, Hq, Tc, cap]` int64: the first `cap` of those in the bin, in key order,
    each its score's float32 bits above its position (`unpack` splits them; slots past n_in are
    undefined).
    """
    n_above = torch.empty(lo.shape, device=q.device, dtype=torch.int32)
    n_in = torch.empty_like(n_above)
    buf = torch.empty(*lo.shape, cap, device=q.device, dtype=torch.int64)
    a, c = pick_bin_ends(lo, hi, base, inv_w, pick)
    _bracket_pass(_collect_kernel, q, k, (a, c), (n_above, n_in, buf), t_base=t_base, sink=sink, local=local,
                  scalars=(cap,))
    return n_above, n_in, buf


def pick_bin_ends(lo, hi, base, inv_w, pick):
    """Each row's pick bin within its bracket as an interval of scores, for the collect pass.

    lo, hi, base, inv_w `[...]` float32 (a bracket and its bins, `bin_params`), pick `[...]` int (-1: the
    row is not collected). Returns a, c `[...]` float32: `lo <= s <= hi` and `bin_of(s) == pick` exactly
    where `a <= s < c`; `s > hi`, or `s >= lo` and `bin_of(s) > pick`, exactly where `s >= c` (each end
    found by a binary search over the float32 values, which holds since a bin never falls as the score
    rises); a = c = +inf for a row not collected.
    """
    a = torch.empty(lo.shape, device=lo.device, dtype=torch.float32)
    c = torch.empty_like(a)
    rows = a.numel()
    if rows:
        BR = 1024 if interpreting() else 128
        launcher(_pick_bin_ends_kernel)[(cdiv(rows, BR),)](
            lo.float().contiguous(), hi.float().contiguous(), base.float().contiguous(),
            inv_w.float().contiguous(), pick.int().contiguous(), a, c, rows, BR=BR, NB=NB, num_warps=4)
    return a, c


def _bracket_pass(kernel, q, k, rows, outputs, *, t_base: int, sink: int, local: int, scalars=(), **consts):
    """Launch the count or collect kernel over the queries `t_base .. t_base + Tc` of q `[B, Hq, T, D]` (k
    `[B, Hkv, S, D]`): its row arrays `rows` `[B, Hq, Tc]` (floats as float32; others as they are) and
    `outputs` first, then the shapes and `scalars`, on the attention's tiles; `consts`: the kernel's own
    constexprs."""
    B, HQ, T, D = q.shape
    HKV, S = k.shape[1], k.shape[2]
    Tc = rows[0].shape[2]
    G = HQ // HKV
    cfg = _config(G, q.dtype)
    rows = [(x.float() if x.is_floating_point() else x).contiguous() for x in rows]
    launcher(kernel)[(cdiv(Tc, cfg["BT"]), B * HKV)](
        q, k, *rows, *outputs, *_s(q), *_s(k), Tc, t_base, T, S, HQ, G, sink, local, *scalars,
        D=D, BD=pow2(D), GP=cfg["GP"], BT=cfg["BT"], BN=cfg["BN"], UPCAST=interpreting(), **consts,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def unpack(buf):
    """`collect`'s int64 entries -> scores (float32) and positions (int32), same shape."""
    return (buf >> 32).to(torch.int32).view(torch.float32), (buf & 0xFFFFFFFF).to(torch.int32)


def sample_scores(q, k, *, t_base: int, Tc: int, sink: int, local: int, stride: int, n: int):
    """`_sample_kernel`: the scores `[B, Hq, Tc, n]` float32 of the queries `t_base .. t_base + Tc` against
    the keys `sink + i * stride` (i < n); a row's usable columns (<= p - local) are a prefix, the rest
    undefined."""
    B, HQ, T, D = q.shape
    HKV, S = k.shape[1], k.shape[2]
    G = HQ // HKV
    cfg = _config(G, q.dtype)
    out = torch.empty(B, HQ, Tc, n, device=q.device, dtype=torch.float32)
    launcher(_sample_kernel)[(cdiv(Tc, cfg["BT"]), B * HKV)](
        q, k, out, *_s(q), *_s(k), Tc, t_base, T, S, HQ, G, sink, local, stride, n,
        D=D, BD=pow2(D), GP=cfg["GP"], BT=cfg["BT"], BNS=cfg["BN"], UPCAST=interpreting(),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


def sample_brackets(q, k, *, t_base: int, Tc: int, sink: int, local: int, budget: int,
                    sample: int = 1024, z: float = 4.0):
    """`[lo, hi]` around each row's `picks`-th largest candidate score, from a strided sample.

    q `[B, Hq, T, D]`, k `[B, Hkv, S, D]`; the rows are queries `t_base .. t_base + Tc`. At most `sample`
    candidate columns (every `stride`-th key from `sink`) are scored; a row whose sample holds `n` of its
    `C` candidates expects its pick at rank `r = picks * n / C` of them, and the bracket spans the
    sample's ranks `r -/+ (z * sqrt(r (1 - picks / C)) + 2)` (binomial spread, and rounding). Returns
    lo, hi `[B, Hq, Tc]` float32 (-inf / +inf where a rank falls off the sample), low, high `[B, Hq, Tc]`
    float32 (the sample ranks nearest those of lo and hi that it holds: finite stand-ins for the bins of
    an open bracket, `bin_params`) and the stride.
    """
    B, HQ, T, _ = q.shape
    S = k.shape[2]
    picks = budget - sink - local
    first, last = S - T + t_base, S - T + t_base + Tc - 1
    widest = max(1, last - local - sink + 1)
    stride = max(1, cdiv(widest, sample))
    lo = torch.full((B, HQ, Tc), -math.inf, device=q.device)
    hi = torch.full((B, HQ, Tc), math.inf, device=q.device)
    if last + 1 <= budget:  # no row is held
        return lo, hi, lo, hi, stride
    n_cols = cdiv(widest, stride)
    scores = sample_scores(q, k, t_base=t_base, Tc=Tc, sink=sink, local=local, stride=stride, n=n_cols)
    pos = torch.arange(first, last + 1, device=q.device)  # [Tc]
    n = ((pos - local - sink).clamp(min=-1) // stride + 1).clamp(max=n_cols)  # [Tc] usable columns
    C = (pos - local - sink + 1).clamp(min=1).double()  # [Tc]
    rank = picks * n.double() / C
    margin = z * (rank * (1 - picks / C).clamp(min=0)).sqrt() + 2
    r_hi = (rank - margin).floor().long()  # 1-based ranks; < 1: hi = +inf
    r_lo = (rank + margin).ceil().long()  # > n: lo = -inf
    rows = n.expand(B, HQ, Tc)
    over = pos + 1 > budget
    # ranks off the sample clamped to its ends: the sample's highest and lowest scores stand in for the
    # open ends in the bins
    top, _ = select_in_buffer(scores, rows, r_hi.clamp(min=1).expand(B, HQ, Tc), positions=False)
    bottom, _ = select_in_buffer(scores, rows, torch.minimum(r_lo, n).clamp(min=1).expand(B, HQ, Tc),
                                 positions=False)
    high = torch.where(over, top, hi)
    low = torch.where(over, bottom, lo)
    hi = torch.where((r_hi >= 1) & over, top, hi)
    lo = torch.where((r_lo <= n) & over, bottom, lo)
    return lo, hi, low, high, stride


def topk_thresholds(q, k, *, sink: int, local: int, budget: int, sample: int = 1024, z: float = 4.0,
                    cap: int | None = None, chunk: int | None = None, brackets=None):
    """Per-row thresholds of exact top-k: `budget_attention`'s `thr`, `cut` and the rows that failed.

    q `[B, Hq, T, D]`, k `[B, Hkv, S, D]` -> thr `[B, Hq, T]` float32, cut `[B, Hq, T]` int32 and failed
    `[B, Hq, T]` bool. A row held to the budget (`p + 1 > budget`) keeps, beyond sink and local, exactly
    the `budget - sink - local` candidates first in (score descending, position ascending) order; a row
    not held keeps every key (thr -inf). A failed row's bracket missed, or the bin of its pick held more
    than `cap` keys: its thr/cut are meaningless and the caller computes it otherwise. The queries go in
    chunks (`chunk`, by default as many as keep the collect buffers and the sample's scores within
    `TOPK_BUFFER_BYTES`); `cap` slots a row (default 4x the expected keys of one of the count pass's bins,
    at least 64); `brackets(t_base, Tc) -> (lo, hi, low, high)` replaces `sample_brackets` (tests force
    failures with it; low, high as `bin_params` takes them).
    """
    B, HQ, T, D = q.shape
    S = k.shape[2]
    picks = budget - sink - local
    thr = torch.full((B, HQ, T), -math.inf, device=q.device)
    cut = torch.full((B, HQ, T), INT_MAX, device=q.device, dtype=torch.int32)
    failed = torch.zeros(B, HQ, T, device=q.device, dtype=torch.bool)
    first_over = max(0, budget - (S - T))  # the first query held to the budget
    if first_over >= T:
        return thr, cut, failed
    if cap is None:
        stride = max(1, cdiv(max(1, S - local - sink), sample))
        width = 2 * (z * math.sqrt(picks / stride) + 3) * stride  # expected keys within a bracket
        # a bin holds width / NB of them where the scores spread evenly over the bracket; up to 4x that
        # where they crowd towards one end of it
        cap = max(64, cdiv(int(4 * width / NB), 64) * 64)
    if chunk is None:
        chunk = max(1, TOPK_BUFFER_BYTES // (B * HQ * max(8 * cap, 4 * (sample + NB))))
    # the count and collect passes' row tiles are the attention's (same queries in the same rows of the
    # product): a product's rounding may depend on where a row sits in its tile
    BT = _config(HQ // k.shape[1], q.dtype)["BT"]
    chunk = cdiv(chunk, BT) * BT
    for t0 in range(first_over // BT * BT, T, chunk):
        Tc = min(chunk, T - t0)
        if brackets is None:
            lo, hi, low, high, _ = sample_brackets(q, k, t_base=t0, Tc=Tc, sink=sink, local=local,
                                                   budget=budget, sample=sample, z=z)
        else:
            lo, hi, low, high = brackets(t0, Tc)
        held = torch.arange(S - T + t0, S - T + t0 + Tc, device=q.device) + 1 > budget  # [Tc]
        lo, hi = torch.where(held, lo, math.inf), torch.where(held, hi, math.inf)
        base, inv_w = bin_params(lo, hi, low, high)
        n_above, hist = count(q, k, lo, hi, base, inv_w, t_base=t0, sink=sink, local=local)
        none = n_above == picks  # every pick lies above hi: thr is hi, nothing to collect
        pick, in_bin = narrow(n_above, hist, picks)  # -1 where the bracket missed, or none
        lo2 = torch.where(pick >= 0, lo, math.inf)  # the rows to collect
        n_above, n_in, buf = collect(q, k, lo2, hi, base, inv_w, pick, t_base=t0, sink=sink, local=local,
                                     cap=cap)
        need = picks - n_above  # [B, Hq, Tc] picks still to take from within the bin
        ok = none | ((in_bin > 0) & (need >= 1) & (need <= n_in) & (n_in <= cap))
        t_thr, t_cut = select_in_buffer(buf, n_in, need, positions=True)
        thr[:, :, t0:t0 + Tc] = torch.where(held, torch.where(none, hi, t_thr), -math.inf)
        cut[:, :, t0:t0 + Tc] = torch.where(held, torch.where(none, -1, t_cut), INT_MAX)
        failed[:, :, t0:t0 + Tc] = held & ~ok
    return thr, cut, failed


# ---------------------------------------------------------------------------------------------
# Readable references (PyTorch)
# ---------------------------------------------------------------------------------------------
def select_in_buffer_reference(buf, n_in, need, *, positions: bool):
    """`select_in_buffer` by a stable sort (the buffer's slots are in key order, so ties go to the lower
    position)."""
    buf_s, buf_p = unpack(buf) if positions else (buf, None)
    width = max(1, int(n_in.clamp(max=buf_s.shape[-1]).max()))
    slots = torch.arange(width, device=buf_s.device)
    vals = buf_s[..., :width].masked_fill(slots >= n_in[..., None], -math.inf)
    ordered, perm = vals.sort(dim=-1, descending=True, stable=True)
    j = (need - 1).clamp(0, width - 1).long()[..., None]
    thr = ordered.gather(-1, j)[..., 0]
    if buf_p is None:
        return thr, None
    cut = buf_p[..., :width].gather(-1, perm.gather(-1, j))[..., 0]
    last_tie = (ordered.gather(-1, (j + 1).clamp(max=width - 1))[..., 0] != thr) | (j[..., 0] + 1 >= n_in)
    return thr, torch.where(last_tie, INT_MAX, cut)  # every tie kept: no cut


def count_reference(q, k, lo, hi, base, inv_w, *, t_base: int, sink: int, local: int):
    """`count` in PyTorch: float32 scores by the grouped product over every candidate of the queries
    `t_base .. t_base + Tc`, counted above hi and binned within [lo, hi] (`bin_of`)."""
    B, HQ, T, _ = q.shape
    S = k.shape[2]
    Tc = lo.shape[2]
    s = _grouped_scores(q[:, :, t_base:t_base + Tc].float(), k.float())  # [B, Hq, Tc, S]
    p = torch.arange(S - T + t_base, S - T + t_base + Tc, device=q.device)[:, None]  # [Tc, 1]
    j = torch.arange(S, device=q.device)
    cand = (j >= sink) & (j <= p - local)  # [Tc, S]
    b = bin_of(s, base.float(), inv_w.float())  # [B, Hq, Tc, S]
    lo, hi = lo.float()[..., None], hi.float()[..., None]
    n_above = (cand & (s > hi)).sum(-1, dtype=torch.int32)
    inside = cand & (s >= lo) & (s <= hi)
    hist = torch.zeros(B, HQ, Tc, NB, dtype=torch.int32, device=q.device)
    return n_above, hist.scatter_add_(-1, b, inside.int())
