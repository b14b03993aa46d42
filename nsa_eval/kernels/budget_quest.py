"""Quest's Triton prefill: pages ranked by their bound, kept through a per-row page bitmask, on the tile
machinery of budget_attention.py (shapes and the sink/local rule there)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from nsa_eval.kernels._triton_utils import (
    LOG2E,
    cdiv,
    group_rows,
    interpreting,
    launcher,
    pow2,
    softmax_start,
)
from nsa_eval.kernels.budget_attention import (
    INT_MAX,
    _config,
    _group_matrix,
    _grouped_scores,
    _kept_tile,
    _load_queries,
    _s,
    _store_rows,
    _tile_scores,
    _tile_values,
)

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
    BTP: tl.constexpr = max(BT, 16)
    DT: tl.constexpr = tl.float32 if UPCAST else tl.bfloat16
    i_b, i_hk, t0, o_r, r_t, m_r = group_rows(T, HQ, G, GP, BT)
    q, i_h = _load_queries(Q, i_b, i_hk, o_r, r_t, m_r, 0, sq_b, sq_h, sq_t, G, GP, D, BD, UPCAST)
    pos = S - T + r_t  # [M]
    row = (i_b * HQ + i_h) * T + r_t  # [M]
    group = _group_matrix(m_r, GP, BT, BTP, DT)
    cut = tl.load(CUT + row, mask=m_r, other=2147483647)  # INT_MAX: rows not held keep every marked page
    cut_end = (cut // PS + 1) * PS  # keys cut < j < cut_end: the cut page's candidates past the cut
    near = tl.minimum(pos - local, pos // PS * PS - 1)  # keys j > near: local, or the query's own page
    m_i, l_i, acc = softmax_start(BT * GP, BDV)
    cnt = tl.zeros([BT * GP], tl.int32)
    kvr = tl.zeros([BTP], tl.int32)
    k_base = K + i_b * sk_b + i_hk * sk_h
    v_base = V + i_b * sv_b + i_hk * sv_h
    bits_row = BITS + row.to(tl.int64) * W  # [M]
    last = S - T + tl.minimum(t0 + BT, T) - 1
    for k0 in range(0, last + 1, BN):
        if SKIP:
            keep = _quest_keep(k0, bits_row, m_r, pos, cut, cut_end, near, sink, BN, PS, ONE_WORD)
            if tl.max(tl.max(keep.to(tl.int32), 1), 0) > 0:
                s, _ = _tile_scores(q, k_base, sk_t, k0, S, D, BD, BN, True, UPCAST)
                v = _tile_values(v_base, sv_t, k0, S, DV, BDV, BN, True, UPCAST)
                m_i, l_i, acc, cnt, kvr = _kept_tile(s, keep, v, m_i, l_i, acc, cnt, kvr, group, scale_log2,
                                                     DT)
        else:  # the mask's test after the product: its [M, BN] temporaries do not live across the dot
            s, _ = _tile_scores(q, k_base, sk_t, k0, S, D, BD, BN, True, UPCAST)
            keep = _quest_keep(k0, bits_row, m_r, pos, cut, cut_end, near, sink, BN, PS, ONE_WORD)
            v = _tile_values(v_base, sv_t, k0, S, DV, BDV, BN, True, UPCAST)
            m_i, l_i, acc, cnt, kvr = _kept_tile(s, keep, v, m_i, l_i, acc, cnt, kvr, group, scale_log2, DT)
    _store_rows(O, CNT, KVR, m_i, l_i, acc, cnt, kvr, i_b, i_h, i_hk, r_t, m_r, row, t0, T, HQ, G, so_b, so_h,
                so_t, DV, BDV, BT, BTP)


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
