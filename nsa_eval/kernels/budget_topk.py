"""The exact top-k threshold of the `topk` baseline's Triton prefill (see budget_attention.py for the
shapes and the keep rule `s > thr or (s == thr and j <= cut)`).

`topk_thresholds` finds each row's `thr` and `cut` in three steps:
1. a bracket `[lo, hi]` per row from a strided sample of the candidates' scores (`sample_brackets`,
   PyTorch);
2. `_collect_kernel`, which computes every candidate's score with the same tile product as the
   attention (`budget_attention._tile_scores`: same tiles, same `dot`, bit-identical scores), counts
   those above `hi` and writes those within the bracket, with their positions, to a per-row buffer of
   `cap` slots;
3. `_select_kernel`, an exact select over that buffer (a bisection over the scores' bits; ties to the
   lower position, as a stable sort: `select_in_buffer_reference`).
A row whose bracket misses (fewer than `picks` above `lo`, more above `hi`, or more than `cap` inside)
is reported `failed`; the caller computes those queries with the reference path.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from nsa_eval.kernels._triton_utils import cdiv, group_rows, interpreting, launcher, pow2
from nsa_eval.kernels.budget_attention import (
    INT_MAX,
    _config,
    _grouped_scores,
    _load_queries,
    _s,
    _tile_scores,
)


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
        s, o_k = _tile_scores(q, k_base, sk_t, k0, S, D, BD, BN, True, UPCAST)
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
    cut = tl.max(tl.where(tied & (rank == ties[:, None]), p, -1), 1)
    cut = tl.where(ties == tl.sum(tied.to(tl.int32), 1), 2147483647, cut)  # every tie kept: no cut
    tl.store(THR + o_r, tl.max(tl.where(tied, x, float("-inf")), 1), mask=m_r)
    tl.store(CUT + o_r, cut, mask=m_r)


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
    thr = ordered.gather(-1, j)[..., 0]
    cut = buf_p[..., :width].gather(-1, perm.gather(-1, j))[..., 0]
    last_tie = (ordered.gather(-1, (j + 1).clamp(max=width - 1))[..., 0] != thr) | (j[..., 0] + 1 >= n_in)
    return thr, torch.where(last_tie, INT_MAX, cut)  # every tie kept: no cut


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
