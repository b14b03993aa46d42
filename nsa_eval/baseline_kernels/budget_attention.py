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
pass, ties at the threshold to the lower position; `budget_topk.topk_thresholds` finds `thr` and `cut`.
Quest's pages are `budget_quest.py`'s, on the same tile machinery.

`_budget_fwd_kernel` is a flash-attention forward (online softmax) over the kept keys that also
counts them: per (query, query head), and per (query, KV head) the union over the group (the
controller's `kv_read`). For `sink_window` it visits only the sink tiles and the local tiles.

A program holds `BT` query positions x the G heads of one KV head's group (`group_rows`), so a key
tile is read once for the whole group. The tile helpers here (`_tile_scores`, `_load_queries`,
`_kept_tile`, `_store_rows`) serve the top-k collect pass and Quest's kernel too, so the scores are
bit-identical wherever they are computed. `budget_attention_reference` and `reference_keep` below
are the readable PyTorch versions (`tests/methods/test_fast_prefill.py` compares them, and the
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


