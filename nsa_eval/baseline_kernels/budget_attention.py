"""Budgeted causal attention for the training-free baselines' prefill, in Triton: the shared attention.

Shapes (the controller's, transformers' attention interface): q `[B, Hq, T, D]`, k and v
`[B, Hkv, S, Dv|D]` with `Hq = G * Hkv` (query head `h` reads KV head `h // G`); the T queries are the
last T of the S keys, so query `t` sits at position `p = S - T + t` and sees keys `0 .. p` (no
padding: a key's index is its position). Query `p` keeps

- the sink keys `< sink` and the local keys `> p - local` (itself included), and
- `topk`: the `picks = budget - sink - local` other visible keys (candidates) with the largest
  `q . k`, where `p + 1 > budget`; every visible key otherwise;
- `sink_window`: nothing more (a query with `p < sink + local` sees only sink and local keys).

`topk` keeps its picks by a per-row threshold: key `j` is kept when `s > thr` or `s == thr and j <=
cut` (`s` the float32 score of the kernels' own tile product), so that exactly `picks` candidates
pass, ties at the threshold to the lower position; `budget_topk.topk_thresholds` finds `thr` and `cut`
(cut INT_MAX where every key tied at `thr` is kept). Quest's pages are `budget_quest.py`'s, on the same
tile machinery.

`_budget_fwd_kernel` is a flash-attention forward (online softmax) over the kept keys that also
counts them: per (query, query head), and per (query, KV head) the union over the group (the
controller's `kv_read`). A program holds `BT` query positions x the G heads of one KV head's group
(`group_rows`), so a key tile is read once for the whole group, and sorts its key tiles by what decides
them (`_tile_ranges`): tiles every row keeps whole (the sink's, and the local windows' interior) take
no mask at all; tiles of candidates only take the rule alone (`topk`: one compare a score against a
per-row threshold); the few tiles where a window begins or the diagonal lies take the whole test.
`sink_window` never visits a candidate tile. The counts are two small MMAs of 0/1 matrices a tile
(exact), not reductions across the rows of the group. Why the split: a tile's softmax alone is about 10
instructions a score; compiled for sm_90 at the 1B shape, a tile costs 323 instructions a thread
without a mask, 540 with the threshold and the counts, and about 850 with the whole test, where the
kernel it replaces spent 1,000-1,200 on every tile.

The tile helpers here (`_tile_scores`, `_load_queries`, `_tile_ranges`, `_store_out`) serve the top-k
collect pass and Quest's kernel too, so the scores are bit-identical wherever they are computed.
`budget_attention_reference` and `reference_keep` below are the readable PyTorch versions
(`tests/methods/test_fast_prefill.py` compares them, and the controller's own path, with the kernels
under Triton's interpreter).
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
    softmax_result,
    softmax_start,
)

INT_MAX = 2**31 - 1

# Launch configuration shared by the collect pass and the attention: the scores must be bit-identical
# between the two, so both take the same tiles (rows of BT positions x GP heads, BN keys) and warps.
# 64 rows x 64 keys over 4 warps (one warpgroup's MMA rows), as the window forward of band.py.
BUDGET_CONFIG = dict(rows=64, BN=64, num_warps=4, num_stages=2)


def _config(G: int, dtype: torch.dtype) -> dict:
    """(BT, GP, BN, num_warps, num_stages) of both launches for a group of G query heads."""
    GP = pow2(G, 1)
    rows, BN = (16, 16) if interpreting() else (BUDGET_CONFIG["rows"], BUDGET_CONFIG["BN"])
    BT = max(1, rows // GP)
    stages = 1 if dtype == torch.float32 else BUDGET_CONFIG["num_stages"]  # float32's tf32x3 tiles are large
    return dict(BT=BT, GP=GP, BN=BN, num_warps=BUDGET_CONFIG["num_warps"], num_stages=stages)


# ---------------------------------------------------------------------------------------------
# Tile helpers
# ---------------------------------------------------------------------------------------------
@triton.jit
def _tile_scores(q, k_base, sk_t, k0, S, D: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
                 MASKED: tl.constexpr, UPCAST: tl.constexpr, bias=None):
    # raw q . k of the key tile [k0, k0 + BN): s [M, BN] float32, positions [BN]. MASKED: keys past S
    # read as 0 (a tile that may cross S). bias: [M, BN] float32, the product's starting sum (0 leaves
    # a score as without it). The one score product of every kernel here, so that the collect pass and
    # the attention agree bit for bit
    o_k = k0 + tl.arange(0, BN)
    o_d = tl.arange(0, BD)
    ptrs = k_base + o_k[:, None].to(tl.int64) * sk_t + o_d[None, :]
    if MASKED:
        k = tl.load(ptrs, mask=(o_k < S)[:, None] & (o_d < D)[None, :], other=0.0)  # [BN, BD]
    elif BD != D:
        k = tl.load(ptrs, mask=(o_d < D)[None, :], other=0.0)
    else:
        k = tl.load(ptrs)
    if UPCAST:
        k = k.to(tl.float32)
    return dot(q, tl.trans(k), bias), o_k


@triton.jit
def _tile_values(v_base, sv_t, k0, S, DV: tl.constexpr, BDV: tl.constexpr, BN: tl.constexpr,
                 MASKED: tl.constexpr, UPCAST: tl.constexpr):
    # v [BN, BDV] of the key tile [k0, k0 + BN) (MASKED: keys past S read as 0)
    o_k = k0 + tl.arange(0, BN)
    o_dv = tl.arange(0, BDV)
    ptrs = v_base + o_k[:, None].to(tl.int64) * sv_t + o_dv[None, :]
    if MASKED:
        v = tl.load(ptrs, mask=(o_k < S)[:, None] & (o_dv < DV)[None, :], other=0.0)
    elif BDV != DV:
        v = tl.load(ptrs, mask=(o_dv < DV)[None, :], other=0.0)
    else:
        v = tl.load(ptrs)
    if UPCAST:
        v = v.to(tl.float32)
    return v


@triton.jit
def _load_queries(Q, i_b, i_hk, o_r, r_t, m_r, t_base, sq_b, sq_h, sq_t, G, GP: tl.constexpr,
                  D: tl.constexpr, BD: tl.constexpr, UPCAST: tl.constexpr):
    # the program's query rows [M, BD] (row r: position t_base + r_t, head i_hk * G + r % GP) and heads [M]
    i_h = i_hk * G + o_r % GP
    o_d = tl.arange(0, BD)
    ptrs = Q + i_b * sq_b + i_h.to(tl.int64) * sq_h + (t_base + r_t).to(tl.int64) * sq_t
    q = tl.load(ptrs[:, None] + o_d[None, :], mask=m_r[:, None] & (o_d < D)[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    return q, i_h


@triton.jit
def _near(pos, local, PS: tl.constexpr):
    # keys j > near are forced for the query at pos: its local window and, for Quest (PS > 0: pages of
    # PS keys), the rest of its own page
    near = pos - local
    if PS > 0:
        near = tl.minimum(near, pos // PS * PS - 1)
    return near


@triton.jit
def _tile_ranges(first, last, sink, local, BN: tl.constexpr, PS: tl.constexpr):
    # The key tiles [0, end) of a program whose positions are first .. last, in consecutive ranges
    # (tile starts, multiples of BN): [0, e1) sink keys every row sees; [e1, e2) the sink's partial
    # tile; [e2, e3) candidates of every row (keys in [sink, near(first)]: the rule alone decides);
    # [e3, e4) where the rows' forced windows begin; [e4, e5) keys in every row's window and visible to
    # every row; [e5, end) the diagonal. [0, e1) and [e4, e5) need no mask, [e2, e3) the rule's alone.
    end = (last // BN + 1) * BN
    e1 = tl.minimum(sink, first + 1) // BN * BN
    e2 = tl.minimum((sink + BN - 1) // BN * BN, end)
    e3 = tl.minimum(tl.maximum(tl.maximum(_near(first, local, PS) + 1, 0) // BN * BN, e2), end)
    e4 = tl.minimum(tl.maximum((tl.maximum(_near(last, local, PS) + 1, 0) + BN - 1) // BN * BN, e3), end)
    e5 = tl.minimum(tl.maximum((first + 1) // BN * BN, e4), end)
    return e1, e2, e3, e4, e5, end


@triton.jit
def _masked_start(i, e1, e2, e3, e4, e5):
    # the i-th key of the masked ranges [e1, e2), [e3, e4), [e5, ..) laid end to end: its tile start
    n1 = e2 - e1
    n2 = e4 - e3
    return tl.where(i < n1, e1 + i, tl.where(i < n1 + n2, e3 + i - n1, e5 + i - n1 - n2))


@triton.jit
def _group_matrix(m_r, GP: tl.constexpr, BT: tl.constexpr, BTP: tl.constexpr, DT: tl.constexpr):
    # [BTP, M] in DT: row t holds 1 at the (usable) rows of position t (BTP = BT padded to an MMA's 16)
    o_r = tl.arange(0, BT * GP)
    o_t = tl.arange(0, BTP)
    return (((o_r // GP)[None, :] == o_t[:, None]) & m_r[None, :]).to(DT)


@triton.jit
def _count_kept(keep, group, cnt, kvr, DT: tl.constexpr):
    # the counts of a tile's kept keys (keep [M, BN]), by two small MMAs of 0/1 matrices (exact): per
    # row, and per position the keys some head of its group keeps (group: `_group_matrix`)
    kb = keep.to(DT)
    kvr += tl.sum((tl.dot(group, kb) > 0).to(tl.int32), 1)  # [BTP]
    cnt += tl.max(tl.dot(kb, tl.full([kb.shape[1], 16], 1.0, DT)), 1).to(tl.int32)  # [M]
    return cnt, kvr


@triton.jit
def _dense_tile(q, k_base, v_base, sk_t, sv_t, k0, S, m_i, l_i, acc, scale_log2, D: tl.constexpr,
                DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BN: tl.constexpr,
                UPCAST: tl.constexpr):
    # a key tile every row keeps whole (visible to all, inside S): no mask
    s, _ = _tile_scores(q, k_base, sk_t, k0, S, D, BD, BN, False, UPCAST)
    v = _tile_values(v_base, sv_t, k0, S, DV, BDV, BN, False, UPCAST)
    return online_softmax_step_full(s, v, m_i, l_i, acc, scale_log2)


@triton.jit
def _kept_tile(s, keep, v, m_i, l_i, acc, cnt, kvr, group, scale_log2, DT: tl.constexpr):
    # the kept keys of a tile (scores s, keep [M, BN], values v) join the online softmax and the counts
    m_i, l_i, acc = online_softmax_step(s, keep, v, m_i, l_i, acc, scale_log2)
    cnt, kvr = _count_kept(keep, group, cnt, kvr, DT)
    return m_i, l_i, acc, cnt, kvr


@triton.jit
def _next_up(x):
    # the least float32 above x (x not NaN or +inf)
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(x > 0, bits + 1, tl.where(x < 0, bits - 1, 1)).to(tl.float32, bitcast=True)


@triton.jit
def _cut_span(cut):
    # the least and the greatest cut among a program's rows that drop some key tied at their threshold
    # (0 <= cut < INT_MAX); (INT_MAX, -1) where none does
    inside = (cut >= 0) & (cut < 2147483647)
    return tl.min(tl.where(inside, cut, 2147483647), 0), tl.max(tl.where(inside, cut, -1), 0)


@triton.jit
def _float_key(x):
    # int32 keys ordered like the float32 values x, -0 as +0 (the keep rule's compares hold them equal):
    # a negative float's magnitude bits flipped
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _key_float(key):
    # the float32 of an ordered int32 key: `_float_key` undone (the same flip of a negative's bits)
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _split_reach(reach, CB: tl.constexpr):
    # a packed row sum -> (the weight, the entries): CB low bits count the entries (CB = 0: unit weights)
    if CB > 0:
        return reach >> CB, reach & ((1 << CB) - 1)
    else:
        return reach, reach


@triton.jit
def _kth_key(key, weight, want, CB: tl.constexpr, WIDE: tl.constexpr):
    # per row of key [BR, BC] int32: the largest k with sum(weight where key >= k) >= want [BR], the
    # want-th largest key with each entry counted weight times (0: not at all). A binary search over the
    # key's bits, the sign first, by compares and row sums alone: the same code under the interpreter and
    # on the GPU (no histogram lowering to trust). A row whose weights never reach want gets INT_MIN, one
    # with want <= 0 INT_MAX.
    # Two shortcuts: the answer lies between the row's least and greatest weighted keys, so the bits
    # those share are the answer's and the search starts below them (about 23 steps instead of 32 for
    # Quest's bounds on random inputs); and each step's row sum also counts the entries left between
    # the search's ends, so the search stops once every row of the program has one left, which is the
    # answer (about log2(BC) + 3 steps where the keys are distinct), and the ties go on to the last bit.
    # The sums carry the count in their CB low bits (CB = 0: weights 0 or 1 count themselves; WIDE:
    # int64 sums, where BC entries of the largest weight overflow 31 - CB bits).
    has = weight > 0
    if CB > 0:
        if WIDE:
            packed = tl.where(has, (weight.to(tl.int64) << CB) | 1, 0)
        else:
            packed = tl.where(has, (weight << CB) | 1, 0)
    else:
        packed = weight
    lo = tl.min(tl.where(has, key, 2147483647), 1)  # [BR]
    hi = tl.max(tl.where(has, key, -2147483648), 1)
    total, n_lo = _split_reach(tl.sum(packed, 1), CB)  # n_lo: entries at or above the search's low end
    n_hi = n_lo * 0  # entries at or above its high end (the least step it turned down)
    searched = (want > 0) & (total >= want)
    apart = tl.where(searched, lo ^ hi, 0)  # [BR] the bits where a searched row's ends differ
    mixed = tl.min(apart, 0) < 0  # some row's keys take both signs
    widest = tl.where(mixed, -1, tl.max(apart, 0))  # its highest set bit: the program's first step
    if mixed:
        reach, n = _split_reach(tl.sum(tl.where(key >= 0, packed, 0), 1), CB)
        up = reach >= want
        thr = tl.where(up, 0, -2147483648)
        n_lo = tl.where(up, n, n_lo)
        n_hi = tl.where(up, n_hi, n)
    else:
        thr = lo & -2147483648
    going = tl.max((searched & (n_lo - n_hi > 1)).to(tl.int32), 0) > 0
    for i in tl.static_range(31):
        bit = 1 << (30 - i)
        if going:
            if (widest >> (30 - i)) != 0:  # (once true, true for every lower bit)
                step = thr | bit
                reach, n = _split_reach(tl.sum(tl.where(key >= step[:, None], packed, 0), 1), CB)
                up = reach >= want
                thr = tl.where(up, step, thr)
                n_lo = tl.where(up, n, n_lo)
                n_hi = tl.where(up, n_hi, n)
                going = tl.max((searched & (n_lo - n_hi > 1)).to(tl.int32), 0) > 0
            else:
                thr = thr | (lo & bit)
    # the one entry between the ends, the least key at or above thr (thr itself after the last bit)
    thr = tl.min(tl.where(has & (key >= thr[:, None]), key, 2147483647), 1)
    return tl.where(want > 0, tl.where(searched, thr, -2147483648), 2147483647)


def kth_key_launch(BC: int) -> tuple[int, int]:
    """(rows a program, warps) of a kernel running `_kth_key` on rows of BC entries: 1,024 entries a warp
    (32 a thread), and a row inside one warp up to 1,024 entries, so the bisection's 32 row sums take
    no barrier. In the sm_90 code Quest's page select at 8k (512 pages) takes 3,156 instructions a row
    so, against 5,092 with 8 rows over 4 warps; top-k's select on 256 entries 984, against 2,146."""
    return max(1, 1024 // BC), max(1, BC // 1024)


def kth_key_counts(BC: int, max_weight: int) -> dict:
    """`_kth_key`'s constexprs for rows of BC entries weighing up to max_weight: CB, the low bits of its
    sums that count the entries (0 where the weights are 0 or 1 and count themselves), and WIDE, int64
    sums where BC entries of the largest weight would overflow the bits above them."""
    if max_weight <= 1:
        return dict(CB=0, WIDE=False)
    CB = BC.bit_length()
    return dict(CB=CB, WIDE=BC * ((max_weight << CB) + 1) >= 2**31)


@triton.jit
def _store_out(O, m_i, l_i, acc, i_b, i_h, r_t, m_r, so_b, so_h, so_t, DV: tl.constexpr, BDV: tl.constexpr):
    # a program's rows' attention output (0 for a row that kept nothing)
    o, _ = softmax_result(m_i, l_i, acc)
    o_dv = tl.arange(0, BDV)
    o_ptrs = O + i_b * so_b + i_h.to(tl.int64) * so_h + r_t.to(tl.int64) * so_t
    tl.store(o_ptrs[:, None] + o_dv[None, :], o.to(O.dtype.element_ty),
             mask=m_r[:, None] & (o_dv < DV)[None, :])


@triton.jit
def _store_rows(O, CNT, KVR, m_i, l_i, acc, cnt, kvr, i_b, i_h, i_hk, r_t, m_r, row, t0, T, HQ, G, so_b, so_h,
                so_t, DV: tl.constexpr, BDV: tl.constexpr, BT: tl.constexpr, BTP: tl.constexpr):
    # a program's outputs: its rows' attention, kept-key counts, and its positions' KV-head unions (kvr
    # [BTP], the first BT used)
    _store_out(O, m_i, l_i, acc, i_b, i_h, r_t, m_r, so_b, so_h, so_t, DV, BDV)
    tl.store(CNT + row, cnt, mask=m_r)
    o_p = tl.arange(0, BTP)
    HKV = HQ // G
    tl.store(KVR + (i_b * HKV + i_hk) * T + t0 + o_p, kvr, mask=(o_p < BT) & (t0 + o_p < T))


# ---------------------------------------------------------------------------------------------
# The attention of sink_window and topk
# ---------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["SIZE"])  # SIZE keys the autotuner, not a compile (16 at 32k)
def _budget_fwd_kernel(
    Q, K, V, O, THR, CUT, CNT, KVR,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, so_b, so_h, so_t,
    T, S, HQ, G, sink, local, scale_log2, SIZE,
    D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, GP: tl.constexpr,
    BT: tl.constexpr, BN: tl.constexpr, SELECTS: tl.constexpr, UPCAST: tl.constexpr,
):
    # Grid (cdiv(T, BT), B * Hkv). O is q's layout; THR (float32), CUT (int32) and CNT (int32) are
    # contiguous [B, Hq, T], KVR (int32) [B, Hkv, T]. SELECTS False (sink_window): no THR/CUT, and no
    # candidate tile is visited. SIZE (S's bit length) only keys the autotuner (`_sink_window_fwd`).
    BTP: tl.constexpr = max(BT, 16)
    DT: tl.constexpr = tl.float32 if UPCAST else tl.bfloat16
    i_b, i_hk, t0, o_r, r_t, m_r = group_rows(T, HQ, G, GP, BT)
    q, i_h = _load_queries(Q, i_b, i_hk, o_r, r_t, m_r, 0, sq_b, sq_h, sq_t, G, GP, D, BD, UPCAST)
    pos = S - T + r_t  # [M]
    near = _near(pos, local, 0)  # [M]
    row = (i_b * HQ + i_h) * T + r_t  # [M]
    group = _group_matrix(m_r, GP, BT, BTP, DT)
    m_i, l_i, acc = softmax_start(BT * GP, BDV)
    k_base = K + i_b * sk_b + i_hk * sk_h
    v_base = V + i_b * sv_b + i_hk * sv_h
    first = S - T + t0
    last = S - T + tl.minimum(t0 + BT, T) - 1
    e1, e2, e3, e4, e5, end = _tile_ranges(first, last, sink, local, BN, 0)
    # every row keeps the dense tiles whole: counted once, here
    cnt = tl.zeros([BT * GP], tl.int32) + (e1 + e5 - e4)
    kvr = tl.zeros([BTP], tl.int32) + (e1 + e5 - e4)
    for i in range(0, e1 + e5 - e4, BN):  # [0, e1), then [e4, e5)
        k0 = tl.where(i < e1, i, e4 + i - e1)
        m_i, l_i, acc = _dense_tile(q, k_base, v_base, sk_t, sv_t, k0, S, m_i, l_i, acc, scale_log2, D, DV,
                                    BD, BDV, BN, UPCAST)
    thr = tl.zeros([BT * GP], tl.float32)
    cut = tl.zeros([BT * GP], tl.int32)
    if SELECTS:
        thr = tl.load(THR + row, mask=m_r, other=float("inf"))  # padding rows keep nothing
        cut = tl.load(CUT + row, mask=m_r, other=-1)
        up = _next_up(thr)
        c_lo, c_hi = _cut_span(cut)
        if c_lo <= c_hi:  # a row drops some key tied at its threshold: the whole test
            for k0 in range(e2, e3, BN):  # candidates of every row: the threshold alone decides
                s, o_k = _tile_scores(q, k_base, sk_t, k0, S, D, BD, BN, False, UPCAST)
                v = _tile_values(v_base, sv_t, k0, S, DV, BDV, BN, False, UPCAST)
                keep = (s > thr[:, None]) | ((s == thr[:, None]) & (o_k[None, :] <= cut[:, None]))
                m_i, l_i, acc, cnt, kvr = _kept_tile(s, keep, v, m_i, l_i, acc, cnt, kvr, group, scale_log2,
                                                     DT)
        else:  # each row keeps all its ties at thr (s >= thr) or none (s >= the next float up)
            for k0 in range(e2, e3, BN):
                s, o_k = _tile_scores(q, k_base, sk_t, k0, S, D, BD, BN, False, UPCAST)
                v = _tile_values(v_base, sv_t, k0, S, DV, BDV, BN, False, UPCAST)
                keep = s >= tl.where(cut >= k0 + BN - 1, thr, up)[:, None]
                m_i, l_i, acc, cnt, kvr = _kept_tile(s, keep, v, m_i, l_i, acc, cnt, kvr, group, scale_log2,
                                                     DT)
    for i in range(0, (e2 - e1) + (e4 - e3) + (end - e5), BN):  # the tiles that take the whole test
        k0 = _masked_start(i, e1, e2, e3, e4, e5)
        s, o_k = _tile_scores(q, k_base, sk_t, k0, S, D, BD, BN, True, UPCAST)
        keep = (o_k < sink)[None, :] | (o_k[None, :] > near[:, None])
        if SELECTS:
            keep = keep | (s > thr[:, None]) | ((s == thr[:, None]) & (o_k[None, :] <= cut[:, None]))
        keep = keep & m_r[:, None] & (o_k[None, :] <= pos[:, None])
        v = _tile_values(v_base, sv_t, k0, S, DV, BDV, BN, True, UPCAST)
        m_i, l_i, acc, cnt, kvr = _kept_tile(s, keep, v, m_i, l_i, acc, cnt, kvr, group, scale_log2, DT)
    _store_rows(O, CNT, KVR, m_i, l_i, acc, cnt, kvr, i_b, i_h, i_hk, r_t, m_r, row, t0, T, HQ, G, so_b, so_h,
                so_t, DV, BDV, BT, BTP)


# sink_window's launches, chosen per model shape and prompt-length class (S's bit length) by Triton's
# autotuner (`_sink_window_fwd`): (BN, num_warps, num_stages), each warp holding 16 rows (16 / GP
# positions). topk keeps BUDGET_CONFIG: its collect pass must score with the attention's tiles.
SINK_WINDOW_CONFIGS = [(64, 4, 2), (64, 4, 3), (64, 8, 1), (32, 4, 2)]


def _sixteen_rows_a_warp(configs, named_args, **kwargs):
    # the configs whose BT positions x GP heads are 16 rows a warp
    return [c for c in configs if c.kwargs["BT"] * kwargs["GP"] == 16 * c.num_warps]


_sink_window_fwd = triton.autotune(
    configs=[triton.Config(dict(BT=bt, BN=bn), num_warps=w, num_stages=st)
             for bn, w, st in SINK_WINDOW_CONFIGS for bt in (1, 2, 4, 8, 16, 32, 64, 128)],
    key=["G", "D", "DV", "SIZE"],
    prune_configs_by=dict(early_config_prune=_sixteen_rows_a_warp),
)(_budget_fwd_kernel)


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------
def budget_attention(q, k, v, *, scale: float, sink: int, local: int, thr=None, cut=None):
    """Sink + local (+ the threshold rule) attention over unpadded keys.

    Args:
        q: `[B, Hq, T, D]`; k: `[B, Hkv, S, D]`; v: `[B, Hkv, S, Dv]` (last dims contiguous, S >= T).
        scale: the softmax scale.
        thr, cut: `[B, Hq, T]` float32 / int32, `topk_thresholds`'s rule (None: `sink_window`).

    Returns:
        o `[B, Hq, T, Dv]` (q's dtype; 0 for a row that keeps nothing), counts `[B, Hq, T]` int32 (keys
        kept per query and head) and kv_read `[B, Hkv, T]` int32 (keys kept by some head of the group).
    """
    B, HQ, T, D = q.shape
    HKV, S, DV = k.shape[1], k.shape[2], v.shape[3]
    G = HQ // HKV
    cfg = _config(G, q.dtype)
    o = torch.empty(B, HQ, T, DV, device=q.device, dtype=q.dtype)
    counts = torch.empty(B, HQ, T, device=q.device, dtype=torch.int32)
    kv_read = torch.empty(B, HKV, T, device=q.device, dtype=torch.int32)
    selects = thr is not None
    args = (*_s(q), *_s(k), *_s(v), *_s(o), T, S, HQ, G, sink, local, scale * LOG2E, S.bit_length())
    dims = dict(D=D, DV=DV, BD=pow2(D), BDV=pow2(DV), GP=cfg["GP"], UPCAST=interpreting())
    if not selects and not interpreting() and q.dtype != torch.float32:
        grid = lambda meta: (cdiv(T, meta["BT"]), B * HKV)  # noqa: E731
        _sink_window_fwd[grid](q, k, v, o, o, counts, counts, kv_read, *args, SELECTS=False, **dims)
        return o, counts, kv_read
    if selects:
        thr, cut = thr.float().contiguous(), cut.int().contiguous()
    launcher(_budget_fwd_kernel)[(cdiv(T, cfg["BT"]), B * HKV)](
        q, k, v, o, thr if selects else o, cut if selects else counts, counts, kv_read, *args,
        BT=cfg["BT"], BN=cfg["BN"], SELECTS=selects, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **dims,
    )
    return o, counts, kv_read


def _grouped_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q `[B, Hq, T, D]`, k `[B, Hkv, S, D]` -> `q . k` `[B, Hq, T, S]`, k not repeated per group (the
    references' product; the methods layer above has its own, which kernels may not import)."""
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    return (q.reshape(B, Hkv, (Hq // Hkv) * T, D) @ k.transpose(-1, -2)).view(B, Hq, T, S)


def _s(x):
    return x.stride(0), x.stride(1), x.stride(2)


# ---------------------------------------------------------------------------------------------
# Readable references (PyTorch, float32 scores; `[B, Hq, T, S]` at once: small inputs only)
# ---------------------------------------------------------------------------------------------
def reference_keep(q, k, *, sink: int, local: int, budget: int | None):
    """The kept keys `[B, Hq, T, S]` bool of sink + local (budget None) or exact top-k at `budget`.

    Ties at the last pick go to the lower position (a stable sort). Scores are float32 `q . k`.
    """
    B, HQ, T, _ = q.shape
    S = k.shape[2]
    p = torch.arange(S - T, S, device=q.device)[:, None]  # [T, 1]
    j = torch.arange(S, device=q.device)[None, :]  # [1, S]
    visible = j <= p
    forced = visible & ((j < sink) | (j > p - local))
    if budget is None:
        return forced.expand(B, HQ, T, S)
    candidates = visible & ~forced
    s = _grouped_scores(q.float(), k.float()).masked_fill(~candidates, -math.inf)  # [B, Hq, T, S]
    order = s.sort(dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(S, device=q.device).expand_as(order))
    chosen = candidates & (rank < budget - sink - local)
    held = (p + 1 > budget)  # [T, 1]
    return torch.where(held, forced | chosen, visible)


def budget_attention_reference(q, k, v, keep, *, scale: float):
    """o `[B, Hq, T, Dv]` float32 of attention over `keep` `[B, Hq, T, S]`, counts `[B, Hq, T]` and
    kv_read `[B, Hkv, T]` (int32) as `budget_attention` returns them."""
    B, HQ, T, _ = q.shape
    HKV, S = k.shape[1], k.shape[2]
    s = (_grouped_scores(q.float(), k.float()) * scale).masked_fill(~keep, -math.inf)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    o = (p.reshape(B, HKV, -1, S) @ v.float()).view(B, HQ, T, -1)
    counts = keep.sum(-1, dtype=torch.int32)
    kv_read = keep.view(B, HKV, HQ // HKV, T, S).any(2).sum(-1, dtype=torch.int32)
    return o, counts, kv_read


