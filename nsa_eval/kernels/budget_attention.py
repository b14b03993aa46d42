"""Budgeted causal attention for the training-free baselines' prefill (`sink_window`, `topk`, `quest`), in
Triton. Quest's page selection and kernel have their own section below (`quest_attention`).

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
pass, ties at the threshold to the lower position. The threshold comes from `topk_thresholds`:
1. a bracket `[lo, hi]` per row from a strided sample of the candidates' scores (PyTorch);
2. `_collect_kernel`, which computes every candidate's score with the same tile product as the
   attention (same tiles, same `dot`: bit-identical scores), counts those above `hi` and writes those
   within the bracket, with their positions, to a per-row buffer of `cap` slots;
3. `_select_kernel`, an exact select over that buffer (a bisection over the scores' bits; ties to the
   lower position, as a stable sort: `select_in_buffer_reference`).
A row whose bracket misses (fewer than `picks` above `lo`, more above `hi`, or more than `cap` inside)
is reported `failed`; the caller computes those queries with the reference path.

`_budget_fwd_kernel` is then a flash-attention forward (online softmax) over the kept keys that also
counts them: per (query, query head), and per (query, KV head) the union over the group (the
controller's `kv_read`). For `sink_window` it visits only the sink tiles and the local tiles.

A program holds `BT` query positions x the G heads of one KV head's group (`group_rows`), so a key
tile is read once for the whole group. `budget_attention_reference` and `topk_thresholds_reference`
below are the readable PyTorch versions (`tests/methods/test_fast_prefill.py` compares them, and the
controller's own path, with the kernels under Triton's interpreter).
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
    pow2,
    softmax_result,
    softmax_start,
)

INT_MAX = 2**31 - 1

# Launch configuration shared by the collect pass and the attention: the scores must be bit-identical
# between the two, so both take the same tiles (rows of BT positions x GP heads, BN keys) and warps.
# 64 rows x 64 keys over 4 warps, as the window forward of band.py; not yet measured for these kernels.
BUDGET_CONFIG = dict(rows=64, BN=64, num_warps=4, num_stages=2)


def _config(G: int, dtype: torch.dtype) -> dict:
    """(BT, GP, BN, num_warps, num_stages) of both launches for a group of G query heads."""
    GP = pow2(G, 1)
    rows, BN = (16, 16) if interpreting() else (BUDGET_CONFIG["rows"], BUDGET_CONFIG["BN"])
    BT = max(1, rows // GP)
    stages = 1 if dtype == torch.float32 else BUDGET_CONFIG["num_stages"]  # float32's tf32x3 tiles are large
    return dict(BT=BT, GP=GP, BN=BN, num_warps=BUDGET_CONFIG["num_warps"], num_stages=stages)


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------
@triton.jit
def _tile_scores(q, k_base, sk_t, k0, S, D: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
                 UPCAST: tl.constexpr):
    # raw q . k of the key tile [k0, k0 + BN) (keys past S read as 0): s [M, BN] float32, positions [BN].
    # The one score product of both kernels, so that the collect pass and the attention agree bit for bit
    o_k = k0 + tl.arange(0, BN)
    o_d = tl.arange(0, BD)
    k = tl.load(k_base + o_k[:, None].to(tl.int64) * sk_t + o_d[None, :],
                mask=(o_k < S)[:, None] & (o_d < D)[None, :], other=0.0)  # [BN, BD]
    if UPCAST:
        k = k.to(tl.float32)
    return dot(q, tl.trans(k)), o_k


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
def _collect_kernel(
    Q, K, LO, HI, N_ABOVE, N_IN, BUF_S, BUF_P,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t,
    TC, t_base, T, S, HQ, G, sink, local, budget, CAP,
    D: tl.constexpr, BD: tl.constexpr, GP: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # Grid (cdiv(TC, BT), B * Hkv) over the queries t_base .. t_base + TC of T. Per row of a query held
    # to the budget: N_ABOVE, the candidates scoring above HI, and N_IN, those within [LO, HI], the
    # first CAP of them (in key order) written to BUF_S (score) and BUF_P (position). Row arrays are
    # [B, Hq, TC] and the buffers [B, Hq, TC, CAP], contiguous.
    i_b, i_hk, t0, o_r, r_t, m_r = group_rows(TC, HQ, G, GP, BT)
    q, i_h = _load_queries(Q, i_b, i_hk, o_r, r_t, m_r, t_base, sq_b, sq_h, sq_t, G, GP, D, BD, UPCAST)
    pos = S - T + t_base + r_t  # [M]
    row = (i_b * HQ + i_h) * TC + r_t  # [M]
    over = m_r & (pos + 1 > budget)
    lo = tl.load(LO + row, mask=over, other=0.0)
    hi = tl.load(HI + row, mask=over, other=0.0)
    n_above = tl.zeros([BT * GP], tl.int32)
    n_in = tl.zeros([BT * GP], tl.int32)
    k_base = K + i_b * sk_b + i_hk * sk_h
    last = S - T + t_base + tl.minimum(t0 + BT, TC) - 1  # the program's last position
    for k0 in range(sink // BN * BN, last - local + 1, BN):  # the tiles holding candidates
        s, o_k = _tile_scores(q, k_base, sk_t, k0, S, D, BD, BN, UPCAST)
        cand = over[:, None] & (o_k >= sink)[None, :] & (o_k[None, :] <= pos[:, None] - local)
        n_above += tl.sum((cand & (s > hi[:, None])).to(tl.int32), 1)
        inside = (cand & (s >= lo[:, None]) & (s <= hi[:, None])).to(tl.int32)
        slot = n_in[:, None] + tl.cumsum(inside, 1) - 1  # [M, BN]: key order within the row
        keep = (inside != 0) & (slot < CAP)
        at = row[:, None].to(tl.int64) * CAP + slot
        tl.store(BUF_S + at, s, mask=keep)
        tl.store(BUF_P + at, (o_k[None, :] + 0 * slot).to(tl.int32), mask=keep)
        n_in += tl.sum(inside, 1)
    tl.store(N_ABOVE + row, n_above, mask=m_r)
    tl.store(N_IN + row, n_in, mask=m_r)


@triton.jit
def _select_kernel(BUF_S, BUF_P, N_IN, NEED, THR, CUT, R, CAP, BR: tl.constexpr, BC: tl.constexpr):
    # BR rows of the collect buffers ([R, CAP], the first N_IN slots written) a program: the NEED-th
    # entry (1-based, NEED in 1..N_IN) in (score descending, slot ascending) order, as its score THR and
    # position CUT. Scores are mapped to int64 keys ordered like the floats, and a bisection over the
    # keys finds the largest k with at least NEED entries >= k: 33 counts of the rows, held in registers
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)  # [BR]
    m_r = o_r < R
    n = tl.load(N_IN + o_r, mask=m_r, other=0)
    need = tl.load(NEED + o_r, mask=m_r, other=1)
    o_c = tl.arange(0, BC)
    m = m_r[:, None] & (o_c[None, :] < n[:, None]) & (o_c < CAP)[None, :]  # [BR, BC]
    at = o_r[:, None] * CAP + o_c[None, :]
    x = tl.load(BUF_S + at, mask=m, other=float("-inf"))
    bits = x.to(tl.int32, bitcast=True).to(tl.int64)
    key = tl.where(bits < 0, -2147483648 - bits, bits)  # negative floats: larger magnitude, lower key
    key = tl.where(m, key, -4294967296)  # empty slots below every score
    lo = tl.full([BR], -2147483649, tl.int64)
    hi = tl.full([BR], 2147483647, tl.int64)
    for _ in range(33):
        mid = lo + (hi - lo + 1) // 2
        enough = tl.sum((key >= mid[:, None]).to(tl.int32), 1) >= need
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
    tied = m & (key == lo[:, None])
    ties = need - tl.sum((key > lo[:, None]).to(tl.int32), 1)  # entries at the threshold still to take
    rank = tl.cumsum(tied.to(tl.int32), 1)
    p = tl.load(BUF_P + at, mask=m, other=-1)
    tl.store(THR + o_r, tl.max(tl.where(tied, x, float("-inf")), 1), mask=m_r)
    tl.store(CUT + o_r, tl.max(tl.where(tied & (rank == ties[:, None]), p, -1), 1), mask=m_r)


def select_in_buffer(buf_s, buf_p, n_in, need):
    """The `need`-th of each row's collected candidates, in (score descending, position ascending) order.

    buf_s `[..., cap]` float32, buf_p `[..., cap]` int32 (`collect`'s, slots in key order), n_in and need
    `[...]` int (1 <= need <= n_in <= cap where used; other rows get garbage) -> thr `[...]` float32, cut
    `[...]` int32. `select_in_buffer_reference` is the same by a stable sort.
    """
    cap = buf_s.shape[-1]
    rows = buf_s.numel() // cap
    thr = torch.empty(buf_s.shape[:-1], device=buf_s.device, dtype=torch.float32)
    cut = torch.empty(buf_s.shape[:-1], device=buf_s.device, dtype=torch.int32)
    if rows:
        need = need.clamp(1, cap).int().contiguous()
        BC = pow2(cap)
        BR = 64 if interpreting() else max(1, 4096 // BC)  # ~4,096 slots a program, in registers
        launcher(_select_kernel)[(cdiv(rows, BR),)](buf_s, buf_p, n_in.int().contiguous(), need, thr, cut,
                                                    rows, cap, BR=BR, BC=BC, num_warps=4)
    return thr, cut


def select_in_buffer_reference(buf_s, buf_p, n_in, need):
    """`select_in_buffer` by a stable sort (the buffer's slots are in key order, so ties go to the lower
    position)."""
    width = max(1, int(n_in.clamp(max=buf_s.shape[-1]).max()))
    slots = torch.arange(width, device=buf_s.device)
    vals = buf_s[..., :width].masked_fill(slots >= n_in[..., None], -math.inf)
    ordered, perm = vals.sort(dim=-1, descending=True, stable=True)
    j = (need - 1).clamp(0, width - 1).long()[..., None]
    return ordered.gather(-1, j)[..., 0], buf_p[..., :width].gather(-1, perm.gather(-1, j))[..., 0]


@triton.jit
def _budget_step(q, k_base, v_base, sk_t, sv_t, k0, S, pos, m_r, thr, cut, sink, local, m_i, l_i, acc,
                 cnt, kvr, scale_log2, D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr,
                 BDV: tl.constexpr, BT: tl.constexpr, GP: tl.constexpr, BN: tl.constexpr,
                 SELECTS: tl.constexpr, UPCAST: tl.constexpr):
    # one key tile of the budgeted attention: the kept keys of each row join its online softmax and counts
    s, o_k = _tile_scores(q, k_base, sk_t, k0, S, D, BD, BN, UPCAST)
    visible = m_r[:, None] & (o_k[None, :] <= pos[:, None]) & (o_k < S)[None, :]
    keep = visible & ((o_k < sink)[None, :] | (o_k[None, :] > pos[:, None] - local))
    if SELECTS:
        chosen = (s > thr[:, None]) | ((s == thr[:, None]) & (o_k[None, :] <= cut[:, None]))
        keep = keep | (visible & chosen)
    return _kept_tile(s, v_base, sv_t, k0, S, keep, m_i, l_i, acc, cnt, kvr, scale_log2, DV, BDV, BT, GP, BN,
                      UPCAST)


@triton.jit
def _store_rows(O, CNT, KVR, m_i, l_i, acc, cnt, kvr, i_b, i_h, i_hk, r_t, m_r, row, t0, T, HQ, G, so_b, so_h,
                so_t, DV: tl.constexpr, BDV: tl.constexpr, BT: tl.constexpr):
    # a program's outputs: its rows' attention, kept-key counts, and its positions' KV-head unions
    o, _ = softmax_result(m_i, l_i, acc)
    o_dv = tl.arange(0, BDV)
    o_ptrs = O + i_b * so_b + i_h.to(tl.int64) * so_h + r_t.to(tl.int64) * so_t
    tl.store(o_ptrs[:, None] + o_dv[None, :], o.to(O.dtype.element_ty),
             mask=m_r[:, None] & (o_dv < DV)[None, :])
    tl.store(CNT + row, cnt, mask=m_r)
    o_t = t0 + tl.arange(0, BT)
    HKV = HQ // G
    tl.store(KVR + (i_b * HKV + i_hk) * T + o_t, kvr, mask=o_t < T)


@triton.jit
def _budget_fwd_kernel(
    Q, K, V, O, THR, CUT, CNT, KVR,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, so_b, so_h, so_t,
    T, S, HQ, G, sink, local, scale_log2,
    D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, GP: tl.constexpr,
    BT: tl.constexpr, BN: tl.constexpr, SELECTS: tl.constexpr, UPCAST: tl.constexpr,
):
    # Grid (cdiv(T, BT), B * Hkv). O is q's layout; THR (float32), CUT (int32) and CNT (int32) are
    # contiguous [B, Hq, T], KVR (int32) [B, Hkv, T]. SELECTS False (sink_window): no THR/CUT, and only
    # the sink tiles and the tiles of the program's local windows are visited.
    i_b, i_hk, t0, o_r, r_t, m_r = group_rows(T, HQ, G, GP, BT)
    q, i_h = _load_queries(Q, i_b, i_hk, o_r, r_t, m_r, 0, sq_b, sq_h, sq_t, G, GP, D, BD, UPCAST)
    pos = S - T + r_t  # [M]
    row = (i_b * HQ + i_h) * T + r_t  # [M]
    thr = tl.zeros([BT * GP], tl.float32)
    cut = tl.zeros([BT * GP], tl.int32)
    if SELECTS:
        thr = tl.load(THR + row, mask=m_r, other=float("inf"))
        cut = tl.load(CUT + row, mask=m_r, other=-1)
    m_i, l_i, acc = softmax_start(BT * GP, BDV)
    cnt = tl.zeros([BT * GP], tl.int32)
    kvr = tl.zeros([BT], tl.int32)
    k_base = K + i_b * sk_b + i_hk * sk_h
    v_base = V + i_b * sv_b + i_hk * sv_h
    first = S - T + t0
    last = S - T + tl.minimum(t0 + BT, T) - 1
    if SELECTS:
        for k0 in range(0, last + 1, BN):
            m_i, l_i, acc, cnt, kvr = _budget_step(q, k_base, v_base, sk_t, sv_t, k0, S, pos, m_r, thr, cut,
                                                   sink, local, m_i, l_i, acc, cnt, kvr, scale_log2, D, DV,
                                                   BD, BDV, BT, GP, BN, SELECTS, UPCAST)
    else:
        sink_end = tl.minimum(sink, last + 1)
        for k0 in range(0, sink_end, BN):  # the sink tiles
            m_i, l_i, acc, cnt, kvr = _budget_step(q, k_base, v_base, sk_t, sv_t, k0, S, pos, m_r, thr, cut,
                                                   sink, local, m_i, l_i, acc, cnt, kvr, scale_log2, D, DV,
                                                   BD, BDV, BT, GP, BN, SELECTS, UPCAST)
        start = tl.maximum(tl.maximum(first - local + 1, 0) // BN * BN, (sink_end + BN - 1) // BN * BN)
        for k0 in range(start, last + 1, BN):  # the local tiles not visited above
            m_i, l_i, acc, cnt, kvr = _budget_step(q, k_base, v_base, sk_t, sv_t, k0, S, pos, m_r, thr, cut,
                                                   sink, local, m_i, l_i, acc, cnt, kvr, scale_log2, D, DV,
                                                   BD, BDV, BT, GP, BN, SELECTS, UPCAST)
    _store_rows(O, CNT, KVR, m_i, l_i, acc, cnt, kvr, i_b, i_h, i_hk, r_t, m_r, row, t0, T, HQ, G, so_b, so_h,
                so_t, DV, BDV, BT)


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
    if selects:
        thr, cut = thr.float().contiguous(), cut.int().contiguous()
    grid = (cdiv(T, cfg["BT"]), B * HKV)
    launcher(_budget_fwd_kernel)[grid](
        q, k, v, o, thr if selects else o, cut if selects else counts, counts, kv_read,
        *_s(q), *_s(k), *_s(v), *_s(o), T, S, HQ, G, sink, local, scale * LOG2E,
        D=D, DV=DV, BD=pow2(D), BDV=pow2(DV), GP=cfg["GP"], BT=cfg["BT"], BN=cfg["BN"], SELECTS=selects,
        UPCAST=interpreting(), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
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


def collect(q, k, lo, hi, *, t_base: int, sink: int, local: int, budget: int, cap: int):
    """The collect pass over the queries `t_base .. t_base + Tc` of q `[B, Hq, T, D]` (k `[B, Hkv, S, D]`).

    lo, hi: `[B, Hq, Tc]` float32 brackets on the raw score `q . k`. Returns n_above, n_in `[B, Hq, Tc]`
    int32 (candidates above hi; within [lo, hi]) and buf_s `[B, Hq, Tc, cap]` float32, buf_p (int32): the
    first `cap` of those within, in key order (slots past n_in are undefined). Rows not held to the
    budget (`p + 1 <= budget`) count nothing.
    """
    B, HQ, T, D = q.shape
    HKV, S = k.shape[1], k.shape[2]
    Tc = lo.shape[2]
    G = HQ // HKV
    cfg = _config(G, q.dtype)
    n_above = torch.empty(B, HQ, Tc, device=q.device, dtype=torch.int32)
    n_in = torch.empty_like(n_above)
    buf_s = torch.empty(B, HQ, Tc, cap, device=q.device, dtype=torch.float32)
    buf_p = torch.empty(B, HQ, Tc, cap, device=q.device, dtype=torch.int32)
    grid = (cdiv(Tc, cfg["BT"]), B * HKV)
    launcher(_collect_kernel)[grid](
        q, k, lo.float().contiguous(), hi.float().contiguous(), n_above, n_in, buf_s, buf_p,
        *_s(q), *_s(k), Tc, t_base, T, S, HQ, G, sink, local, budget, cap,
        D=D, BD=pow2(D), GP=cfg["GP"], BT=cfg["BT"], BN=cfg["BN"], UPCAST=interpreting(),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return n_above, n_in, buf_s, buf_p


def sample_brackets(q, k, *, t_base: int, Tc: int, sink: int, local: int, budget: int,
                    sample: int = 2048, z: float = 4.0):
    """`[lo, hi]` around each row's `picks`-th largest candidate score, from a strided sample.

    q `[B, Hq, T, D]`, k `[B, Hkv, S, D]`; the rows are queries `t_base .. t_base + Tc`. At most `sample`
    candidate columns (every `stride`-th key from `sink`) are scored in float32; a row whose sample holds
    `n` of its `C` candidates expects its pick at rank `r = picks * n / C` of them, and the bracket spans
    the sample's ranks `r -/+ (z * sqrt(r (1 - picks / C)) + 2)` (binomial spread, and rounding). Returns
    lo, hi `[B, Hq, Tc]` float32 (-inf / +inf where a rank falls off the sample) and the stride.
    """
    B, HQ, T, _ = q.shape
    S = k.shape[2]
    picks = budget - sink - local
    pos = torch.arange(S - T + t_base, S - T + t_base + Tc, device=q.device)  # [Tc]
    widest = max(1, int(pos[-1]) - local - sink + 1)
    stride = max(1, cdiv(widest, sample))
    cols = torch.arange(sink, sink + widest, stride, device=q.device)  # [n]
    lo = torch.full((B, HQ, Tc), -math.inf, device=q.device)
    hi = torch.full((B, HQ, Tc), math.inf, device=q.device)
    over = pos + 1 > budget  # [Tc]
    if not bool(over.any()):
        return lo, hi, stride
    scores = _grouped_scores(q[:, :, t_base:t_base + Tc].float(), k[:, :, cols].float())  # [B, Hq, Tc, n]
    valid = cols[None, :] <= (pos - local)[:, None]  # [Tc, n]
    scores = scores.masked_fill(~valid, -math.inf)
    n = valid.sum(-1).double()  # [Tc]
    C = (pos - local - sink + 1).clamp(min=1).double()  # [Tc]
    rank = picks * n / C
    margin = z * (rank * (1 - picks / C).clamp(min=0)).sqrt() + 2
    r_hi = (rank - margin).floor().long()  # 1-based ranks; < 1: hi = +inf
    r_lo = (rank + margin).ceil().long()  # > n: lo = -inf
    deepest = int(r_lo.clamp(max=cols.numel()).max())
    top = scores.topk(max(deepest, 1), dim=-1).values  # [B, Hq, Tc, deepest] descending
    take = lambda r: top.gather(-1, (r - 1).clamp(0, top.shape[-1] - 1)[None, None, :, None]
                                .expand(B, HQ, Tc, 1))[..., 0]  # noqa: E731
    hi = torch.where((r_hi >= 1) & over, take(r_hi), hi)
    lo = torch.where((r_lo <= n.long()) & over, take(r_lo), lo)
    return lo, hi, stride


def topk_thresholds(q, k, *, sink: int, local: int, budget: int, sample: int = 2048, z: float = 4.0,
                    cap: int | None = None, chunk: int | None = None, brackets=None):
    """Per-row thresholds of exact top-k: `budget_attention`'s `thr`, `cut` and the rows that failed.

    q `[B, Hq, T, D]`, k `[B, Hkv, S, D]` -> thr `[B, Hq, T]` float32, cut `[B, Hq, T]` int32 and failed
    `[B, Hq, T]` bool. A row held to the budget (`p + 1 > budget`) keeps, beyond sink and local, exactly
    the `budget - sink - local` candidates first in (score descending, position ascending) order; a row
    not held keeps every key (thr -inf). A failed row's bracket missed: its thr/cut are meaningless and
    the caller computes it otherwise. The queries go in chunks (`chunk`, by default as many as keep the
    collect buffers near 512 MiB); `cap` slots a row (default from the expected bracket width);
    `brackets(t_base, Tc) -> (lo, hi)` replaces `sample_brackets` (tests force failures with it).
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
        cap = pow2(int(1.5 * width), 64)
    if chunk is None:
        chunk = max(1, (512 << 20) // (B * HQ * cap * 8))
    # the collect pass's row tiles are the attention's (same queries in the same rows of the product):
    # a product's rounding may depend on where a row sits in its tile
    BT = _config(HQ // k.shape[1], q.dtype)["BT"]
    chunk = cdiv(chunk, BT) * BT
    for t0 in range(first_over // BT * BT, T, chunk):
        Tc = min(chunk, T - t0)
        if brackets is None:
            lo, hi, _ = sample_brackets(q, k, t_base=t0, Tc=Tc, sink=sink, local=local, budget=budget,
                                        sample=sample, z=z)
        else:
            lo, hi = brackets(t0, Tc)
        n_above, n_in, buf_s, buf_p = collect(q, k, lo, hi, t_base=t0, sink=sink, local=local,
                                              budget=budget, cap=cap)
        need = picks - n_above  # [B, Hq, Tc] picks still to take from within the bracket
        ok = (need >= 0) & (need <= n_in) & (n_in <= cap)
        t_thr, t_cut = select_in_buffer(buf_s, buf_p, n_in, need)
        none = need == 0  # every pick lies above hi
        held = torch.arange(S - T + t0, S - T + t0 + Tc, device=q.device) + 1 > budget  # [Tc]
        thr[:, :, t0:t0 + Tc] = torch.where(held, torch.where(none, hi, t_thr), -math.inf)
        cut[:, :, t0:t0 + Tc] = torch.where(held, torch.where(none, -1, t_cut), INT_MAX)
        failed[:, :, t0:t0 + Tc] = held & ~ok
    return thr, cut, failed


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


# ---------------------------------------------------------------------------------------------
# Quest: pages ranked by their bound, kept through a per-row page bitmask
# ---------------------------------------------------------------------------------------------
# Quest's rule (methods/quest.py, the controller's `_select`): query `p` held to the budget keeps sink,
# local and its own page, and `picks = budget - forced` candidates (the visible keys outside those)
# first in (page bound descending, position ascending) order. Every key of a page carries the page's
# bound, so the kept candidates are whole pages in (bound descending, page ascending) order, the last
# one cut to its earliest candidates. `quest_page_select` finds them per row from the bounds in
# PyTorch (`page_bounds`, the chunked path's own function, float32) and hands the attention a bitmask
# of the kept pages `[B, Hq, Tc, W]` (int32 words, W = cdiv(pages, 32); bit i of word w: page
# 32 w + i) and `cut`, the last kept position of the cut page: key j of a marked page is kept unless
# its page is the cut page (`cut // page_size`) and j > cut. Rows not held get every bit and cut
# INT_MAX. The bounds are computed once, so the selection and the kernel's keep test cannot disagree.

# PyTorch's working set of the selection: float32 bounds of at most this many (row, page) pairs a step
# (256 MiB; a few temporaries of the same shape, bool and int32, come and go beside them)
QUEST_BOUND_ELEMS = 64 << 20
# the page bitmask of one attention launch: at most this many bytes (longer prompts take several
# launches over consecutive query ranges)
QUEST_BITS_BYTES = 256 << 20
# `_quest_fwd_kernel`'s launch beside `BUDGET_CONFIG` (rows as there): compiled for sm_90 at G = 4,
# d = 64, bf16, 4 warps over 64 x 64 tiles need 255 registers and spill 260 bytes (the sink + local test
# alone takes 252); 8 warps spill 36 bytes, 64 x 32 tiles none (243 registers). Not yet measured on a
# GPU: `test_gpu_quest_timing_against_full_attention` times the three.
QUEST_CONFIG = dict(BN=64, num_warps=8, num_stages=2)


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
def _kept_tile(s, v_base, sv_t, k0, S, keep, m_i, l_i, acc, cnt, kvr, scale_log2, DV: tl.constexpr,
               BDV: tl.constexpr, BT: tl.constexpr, GP: tl.constexpr, BN: tl.constexpr, UPCAST: tl.constexpr):
    # the key tile [k0, k0 + BN) (scores s [M, BN]) joins the online softmax and the counts of the rows
    # that keep its keys
    o_k = k0 + tl.arange(0, BN)
    o_dv = tl.arange(0, BDV)
    v = tl.load(v_base + o_k[:, None].to(tl.int64) * sv_t + o_dv[None, :],
                mask=(o_k < S)[:, None] & (o_dv < DV)[None, :], other=0.0)  # [BN, BDV]
    if UPCAST:
        v = v.to(tl.float32)
    m_i, l_i, acc = online_softmax_step(s, keep, v, m_i, l_i, acc, scale_log2)
    k32 = keep.to(tl.int32)
    cnt += tl.sum(k32, 1)
    kvr += tl.sum(tl.max(tl.reshape(k32, [BT, GP, BN]), 1), 1)  # the union over the group's heads
    return m_i, l_i, acc, cnt, kvr


@triton.jit
def _quest_fwd_kernel(
    Q, K, V, O, BITS, CUT, CNT, KVR,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, so_b, so_h, so_t,
    T, S, HQ, G, sink, local, W, scale_log2,
    D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, GP: tl.constexpr,
    BT: tl.constexpr, BN: tl.constexpr, PS: tl.constexpr, ONE_WORD: tl.constexpr, SKIP: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # Grid (cdiv(T, BT), B * Hkv), as `_budget_fwd_kernel`. BITS `[B, Hq, T, W]` int32 and CUT `[B, Hq,
    # T]` int32 (contiguous): `quest_page_select`'s. ONE_WORD: a key tile's pages lie in one word of
    # the mask (BN divides 32 * PS), read once a row. SKIP: a tile no row keeps is not multiplied.
    i_b, i_hk, t0, o_r, r_t, m_r = group_rows(T, HQ, G, GP, BT)
    q, i_h = _load_queries(Q, i_b, i_hk, o_r, r_t, m_r, 0, sq_b, sq_h, sq_t, G, GP, D, BD, UPCAST)
    pos = S - T + r_t  # [M]
    row = (i_b * HQ + i_h) * T + r_t  # [M]
    cut = tl.load(CUT + row, mask=m_r, other=2147483647)  # INT_MAX: rows not held keep every marked page
    cut_end = (cut // PS + 1) * PS  # keys cut < j < cut_end: the cut page's candidates past the cut
    near = tl.minimum(pos - local, pos // PS * PS - 1)  # keys j > near: local, or the query's own page
    m_i, l_i, acc = softmax_start(BT * GP, BDV)
    cnt = tl.zeros([BT * GP], tl.int32)
    kvr = tl.zeros([BT], tl.int32)
    k_base = K + i_b * sk_b + i_hk * sk_h
    v_base = V + i_b * sv_b + i_hk * sv_h
    bits_row = BITS + row.to(tl.int64) * W  # [M]
    last = S - T + tl.minimum(t0 + BT, T) - 1
    for k0 in range(0, last + 1, BN):
        if SKIP:
            keep = _quest_keep(k0, bits_row, m_r, pos, cut, cut_end, near, sink, BN, PS, ONE_WORD)
            if tl.max(tl.max(keep.to(tl.int32), 1), 0) > 0:
                s, _ = _tile_scores(q, k_base, sk_t, k0, S, D, BD, BN, UPCAST)
                m_i, l_i, acc, cnt, kvr = _kept_tile(s, v_base, sv_t, k0, S, keep, m_i, l_i, acc, cnt, kvr,
                                                     scale_log2, DV, BDV, BT, GP, BN, UPCAST)
        else:  # the mask's test after the product: its [M, BN] temporaries do not live across the dot
            s, _ = _tile_scores(q, k_base, sk_t, k0, S, D, BD, BN, UPCAST)
            keep = _quest_keep(k0, bits_row, m_r, pos, cut, cut_end, near, sink, BN, PS, ONE_WORD)
            m_i, l_i, acc, cnt, kvr = _kept_tile(s, v_base, sv_t, k0, S, keep, m_i, l_i, acc, cnt, kvr,
                                                 scale_log2, DV, BDV, BT, GP, BN, UPCAST)
    _store_rows(O, CNT, KVR, m_i, l_i, acc, cnt, kvr, i_b, i_h, i_hk, r_t, m_r, row, t0, T, HQ, G, so_b, so_h,
                so_t, DV, BDV, BT)


@triton.jit
def _page_select_kernel(BND, BITS, CUT, R, n, Pc, W, L, t_off, p0, sink, local, budget,
                        PS: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    # `quest_page_select` in one pass over the bounds: BR rows a program of BND `[B * Hq, n, Pc]` float32
    # (`page_bounds` of n queries at positions p0 .., their pages up to the last one). Row r = (bh, t)
    # writes its page mask to BITS `[B * Hq, L, W]` row (bh, t_off + t) (words past BC // 32 untouched:
    # the caller zeroes them) and its cut to CUT `[B * Hq, L]`. The picks-th candidate in (bound
    # descending, page ascending) order: a bisection over the bounds' bits (uint32 keys ordered like the
    # floats, 32 steps from the top bit) for the largest key with at least `picks` candidates at or above
    # it, each page weighted by its candidates.
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)  # [BR]
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
    x = tl.load(BND + o_r[:, None] * Pc + o_c[None, :], mask=valid, other=float("-inf")) + 0.0  # -0 -> +0
    bits = x.to(tl.int32, bitcast=True)
    # uint32 keys ordered like the floats: negative floats' magnitude bits flipped, then the sign bit
    key = (bits ^ ((bits >> 31) & 0x7FFFFFFF) ^ -2147483648).to(tl.uint32, bitcast=True)
    thr = tl.zeros([BR], tl.uint32)
    for i in range(32):  # the largest key with at least `picks` candidates at or above it, bit by bit
        trial = thr | (tl.full([BR], 1, tl.uint32) << (31 - i))
        enough = tl.sum(tl.where(key >= trial[:, None], c, 0), 1) >= picks
        thr = tl.where(enough, trial, thr)
    above = valid & (key > thr[:, None])
    need = picks - tl.sum(tl.where(above, c, 0), 1)  # candidates still to take at the threshold
    tied = valid & (key == thr[:, None])
    ceq = tl.cumsum(tl.where(tied, c, 0), 1)  # [BR, BC] nondecreasing
    short = ceq < need[:, None]
    cut_pg = tl.sum(short.to(tl.int32), 1)  # the first page where the tied pages reach need
    before = tl.max(tl.where(short, ceq, 0), 1)
    cut = tl.maximum(cut_pg * PS, sink) + need - before - 1
    keep = above | (tied & (o_c[None, :] <= cut_pg[:, None]))
    held = p + 1 > budget
    keep = tl.where(held[:, None], keep & (picks > 0)[:, None], (start[None, :] <= p[:, None]))
    cut = tl.where(held & (picks > 0), cut, 2147483647)
    lane = (o_c % 32)[None, :]
    words = tl.sum(tl.reshape(keep.to(tl.int32) << lane, [BR, BC // 32, 32]), 2)  # [BR, BC // 32]
    o_w = tl.arange(0, BC // 32)
    out = o_r // n * L + t_off + t  # [BR] the row in the launch's buffers
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
    BR = 16 if interpreting() else max(1, 4096 // BC)
    R = B * HQ * n
    launcher(_page_select_kernel)[(cdiv(R, BR),)](bounds, bits, cut, R, n, Pc, W, L, t_off, p0, sink, local,
                                                  budget, PS=page_size, BR=BR, BC=BC,
                                                  num_warps=4 if BC <= 4096 else 8)


def _quest_config(G: int, dtype: torch.dtype, tiles: dict | None = None) -> dict:
    """`_config`'s rows with `QUEST_CONFIG`'s (or `tiles`') key tile, warps and stages (not under the
    interpreter, whose small tiles stay)."""
    cfg = _config(G, dtype)
    if not interpreting():
        cfg.update(QUEST_CONFIG if tiles is None else tiles)
        if dtype == torch.float32:
            cfg["num_stages"] = 1
    return cfg


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
    b = _page_bounds(q[:, :, t_base + h0:t_base + Tc].float(), key_min[:, :, :Pc], key_max[:, :, :Pc])
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


def _page_bounds(q, key_min, key_max):
    """`methods.quest.page_bounds` bit for bit (the same two products and one float32 sum; the methods
    layer above is not imported here), holding one `[B, Hq, Tc, P]` temporary fewer."""
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


def quest_attention(q, k, v, *, scale: float, sink: int, local: int, budget: int, page_size: int,
                    bound_elems: int | None = None, bits_bytes: int | None = None, skip: bool = False,
                    select: str = "triton", tiles: dict | None = None):
    """Quest's budgeted attention over unpadded keys: `budget_attention`'s shapes and returns (o, counts
    `[B, Hq, T]`, kv_read `[B, Hkv, T]`), with the keys of `quest_page_select`'s pages. The queries go in
    launches of at most `bits_bytes` of page mask, each filled by selection steps of at most
    `bound_elems` bounds (`page_bounds`, PyTorch), the kept pages found by `_page_select_kernel` (select
    "triton") or `quest_page_select` (select "torch", the readable reference); `skip`: the kernel
    multiplies only key tiles some row of its program keeps; `tiles` overrides `QUEST_CONFIG`."""
    bound_elems = QUEST_BOUND_ELEMS if bound_elems is None else bound_elems
    bits_bytes = QUEST_BITS_BYTES if bits_bytes is None else bits_bytes
    B, HQ, T, D = q.shape
    HKV, S, DV = k.shape[1], k.shape[2], v.shape[3]
    G = HQ // HKV
    ps = page_size
    P = cdiv(S, ps)
    W = cdiv(P, 32)
    cfg = _quest_config(G, q.dtype, tiles)
    key_min, key_max = quest_summaries(k, ps)
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
            bounds = _page_bounds(q[:, :, t0:t0 + n].float(), key_min[:, :, :Pc], key_max[:, :, :Pc])
            page_select_into(bounds, bits, cut, t_off=t0 - l0, p0=S - T + t0, sink=sink, local=local,
                             budget=budget, page_size=ps)
        Sl = S - T + l0 + L  # keys up to the launch's last query: its queries are their last L
        cnt = torch.empty(B, HQ, L, device=q.device, dtype=torch.int32)
        kvr = torch.empty(B, HKV, L, device=q.device, dtype=torch.int32)
        qs, os_ = q[:, :, l0:l0 + L], o[:, :, l0:l0 + L]
        grid = (cdiv(L, cfg["BT"]), B * HKV)
        launcher(_quest_fwd_kernel)[grid](
            qs, k, v, os_, bits, cut, cnt, kvr,
            *_s(qs), *_s(k), *_s(v), *_s(os_), L, Sl, HQ, G, sink, local, W, scale * LOG2E,
            D=D, DV=DV, BD=pow2(D), BDV=pow2(DV), GP=cfg["GP"], BT=cfg["BT"], BN=cfg["BN"], PS=ps,
            ONE_WORD=(32 * ps) % cfg["BN"] == 0, SKIP=skip, UPCAST=interpreting(),
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
        counts[:, :, l0:l0 + L] = cnt
        kv_read[:, :, l0:l0 + L] = kvr
    return o, counts, kv_read


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
