"""The selected branch's forward per key block (block-major), for small GQA groups.

The position-major walk (`selection.py`) gives each program a few positions and reads every block
they chose: at G = 4 a 4-position program reads ~50 blocks of 64 keys and values (32 KB each in
bf16) for 16 query rows (4 KB), and each MMA has 16 rows. Here the loop turns inside out, as the
backward's dk/dv kernel already does: one program per (batch, KV head, key block, chunk of the
positions that chose it) loads that block's K/V once and gathers the queries of its positions, `BQ`
positions x the group's heads per MMA. Each (position, block) pair leaves a partial result, its
output normalised over the block's keys and their log2-sum-exp, and a merge pass combines the <= n
partials of every position, as split-K decoding does, then writes o and lse (and, with `gated_sum`,
NSA's gated output).

The partials are stored in q's dtype: one more rounding of each partial (outputs within 7.8e-3 of the
walk's, against 3.9e-3 with float32 partials, the lse the same) for a quarter less time (G = 4, the
op at 64k 6.65 ms against 8.32).

Bytes per (position, block) pair: the group's q rows in, G partial rows out and back; with G = 16
that is ~8 KB, where the walk's K/V reads are shared by 16 rows, so large groups keep the walk, as do
short inputs, whose K/V stay in L2 (`selection.SELECTED_BY_BLOCK_MAX_GROUP`, `..._MIN_ROWS`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa_eval.kernels._triton_utils import (
    LOG2E,
    cdiv,
    dk_tiles,
    dot,
    interpreting,
    launcher,
    load_rows,
    online_softmax_step,
    pow2,
    softmax_result,
    softmax_start,
)

# rows (positions x G') per MMA of the block-major forward, and MMA steps per work item. G = 4 at 64k,
# the op: 8.33 ms at 64 rows against 9.18 at 32 and 15.80 at 128 (8 warps 11.01, 4 stages 12.23); the
# G = 4 NSA forward at 16 / 32 / 64 steps 1.105-1.113 / 1.098 / 1.148 ms at 8k, 11.34 / 11.22 / 11.16
# at 64k.
BY_BLOCK_ROWS = 64
BY_BLOCK_CHUNK_STEPS = 32
BY_BLOCK_CONFIG = dict(num_warps=4, num_stages=3)
# the partials are n x Hq x Dv values a position, 32x what the position's keys and values take with
# the paper's 16 blocks and G = 4 (2 GiB for one 32k sequence of Llama-3.2-1B's shape): past this many
# bytes a sequence goes a chunk of positions at a time (3,840 positions there), each chunk filling the
# GPU still, its blocks' keys and values read once more per chunk
PARTIALS_CHUNK_BYTES = 256 * 2**20
MERGE_CONFIG = dict(num_warps=4, num_stages=1)


def inverted_index(bi, *, select_size, chunk, presorted=False):
    """Counting sort of the selections by key block, without a host sync.

    bi: int32 `[B, T, Hkv, n]`. Returns `(pos, seg_start, item_seg, item_chunk)`: `pos` int32, the
    query positions grouped by segment `(b * Hkv + h) * Ns + block` (ascending within one);
    `seg_start` `[NSEG + 1]` where each segment starts in `pos`; one work item per `chunk` entries of
    a segment: `item_seg` (NSEG for unused items) and `item_chunk`, both `[n_items]` (an upper bound).
    Padding, repeats within one list and blocks starting after the query are dropped. `presorted`:
    each list is already ascending (`select_blocks`' output, or any list sorted with its -1 padding
    first), so repeats are neighbours without a sort. The backward's dk/dv kernel reads the positions
    in ascending order within a block; the forward per block takes `block_entries`, which needs no sort.
    """
    B, T, HKV, n = bi.shape
    ns = cdiv(T, select_size)
    nseg = B * HKV * ns
    dev = bi.device
    srt = (bi if presorted else bi.sort(dim=-1).values).long()  # [B, T, HKV, n]
    dup = torch.zeros_like(srt, dtype=torch.bool)
    dup[..., 1:] = srt[..., 1:] == srt[..., :-1]
    t = torch.arange(T, device=dev).view(1, T, 1, 1)
    valid = (srt >= 0) & (srt < ns) & (srt * select_size <= t) & ~dup
    bh = torch.arange(B, device=dev).view(B, 1, 1, 1) * HKV + torch.arange(HKV, device=dev).view(1, 1, HKV, 1)
    key = torch.where(valid, bh * ns + srt, nseg).flatten()  # [B*T*HKV*n]
    # int32 keys: half the radix passes of int64
    key, perm = torch.sort(key.to(torch.int32) if nseg < 2**31 - 1 else key, stable=True)
    pos = (perm // (HKV * n) % T).to(torch.int32)  # [E] query position of each sorted entry
    seg_start = torch.searchsorted(key, torch.arange(nseg + 1, device=dev, dtype=key.dtype))
    counts = seg_start[1:] - seg_start[:-1]  # [NSEG]
    n_chunks = (counts + chunk - 1) // chunk
    chunk_end = torch.cumsum(n_chunks, 0)  # [NSEG]
    n_items = cdiv(key.numel(), chunk) + nseg  # >= sum(n_chunks), known without a sync
    items = torch.arange(n_items, device=dev)
    item_seg = torch.searchsorted(chunk_end, items, right=True)  # [n_items]
    first = (chunk_end - n_chunks)[item_seg.clamp_max(nseg - 1)]
    return pos, seg_start.to(torch.int32), item_seg.to(torch.int32), (items - first).to(torch.int32)


INDEX_BLOCK = 1024  # list entries per program of the counting index
# counters per segment: program p counts in counter p % INDEX_SPREAD, so that a block every position
# chose (block 0) is not one address for all the atomics
INDEX_SPREAD = 8


@triton.jit
def _scan_counts(COUNTS, SEG_START, SUB_START, ITEM_FIRST, N_ITEMS, NSEG, CHUNK, SPREAD: tl.constexpr,
                 BLOCK: tl.constexpr):
    # the exclusive sums of COUNTS [NSEG, SPREAD] (read from L2: other programs' atomics wrote them):
    # SEG_START [NSEG + 1], where each segment starts among the entries, SUB_START [NSEG, SPREAD] where
    # each of its counters does; ITEM_FIRST [NSEG], its first work item (one per CHUNK entries);
    # N_ITEMS [1], their number
    done = tl.sum(tl.zeros([BLOCK], tl.int32), 0)  # entries and items of the segments before o
    items = done
    tl.store(SEG_START, done)
    o_c = tl.arange(0, SPREAD)
    for i0 in range(0, NSEG, BLOCK):
        o = i0 + tl.arange(0, BLOCK)
        sub = o[:, None] * SPREAD + o_c[None, :]
        c = tl.load(COUNTS + sub, mask=(o < NSEG)[:, None], other=0, cache_modifier=".cg")  # [BLOCK, SPREAD]
        total = tl.sum(c, 1)
        n_items = (total + CHUNK - 1) // CHUNK
        ends = done + tl.cumsum(total, 0)
        tl.store(SEG_START + o + 1, ends, mask=o < NSEG)
        tl.store(SUB_START + sub, (ends - total)[:, None] + tl.cumsum(c, 1) - c, mask=(o < NSEG)[:, None])
        tl.store(ITEM_FIRST + o, items + tl.cumsum(n_items, 0) - n_items, mask=o < NSEG)
        done += tl.sum(total, 0)
        items += tl.sum(n_items, 0)
    tl.store(N_ITEMS, items)


@triton.jit
def _count_kernel(BI, SEG, RANK, COUNTS, ARRIVED, SEG_START, SUB_START, ITEM_FIRST, N_ITEMS, E, T, T0, HKV,
                  NSEL, NS, NSEG, CHUNK, BS: tl.constexpr, SPREAD: tl.constexpr, BLOCK: tl.constexpr,
                  SCAN_BLOCK: tl.constexpr):
    # each entry e of the sorted lists BI [B, T, HKV, NSEL] (flat; list t of position T0 + t): its
    # segment SEG[e] = (b * HKV + h)
    # * NS + block, -1 if unusable (padding, a repeat of the entry before it, a block starting after
    # the position), and RANK[e] its place among the entries its program counts in its segment's
    # counter COUNTS[seg, pid % SPREAD] (one atomic each). The program that finishes last (ARRIVED, a
    # zeroed counter, as the decode's steps count theirs) scans the counts (`_scan_counts`).
    pid = tl.program_id(0)
    e = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = e < E
    slot = e % NSEL
    blk = tl.load(BI + e, mask=m, other=-1)
    prev = tl.load(BI + e - 1, mask=m & (slot > 0), other=-1)
    t = T0 + e // (HKV * NSEL) % T  # the list's position
    usable = m & (blk >= 0) & (blk < NS) & (blk * BS <= t) & (blk != prev)
    seg = tl.where(usable, (e // (T * HKV * NSEL) * HKV + e // NSEL % HKV) * NS + blk, -1)
    counter = tl.maximum(seg, 0) * SPREAD + pid % SPREAD
    rank = tl.atomic_add(COUNTS + counter, 1, mask=usable, sem="relaxed")
    tl.store(SEG + e, seg.to(tl.int32), mask=m)
    tl.store(RANK + e, rank, mask=usable)
    tl.debug_barrier()  # every thread's atomics before the release of the arrival
    if tl.atomic_add(ARRIVED, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        _scan_counts(COUNTS, SEG_START, SUB_START, ITEM_FIRST, N_ITEMS, NSEG, CHUNK, SPREAD, SCAN_BLOCK)


@triton.jit
def _scatter_kernel(SEG, RANK, SEG_START, SUB_START, ITEM_FIRST, ENTRY, ITEM_SEG, ITEM_CHUNK, E, CHUNK,
                    SPREAD: tl.constexpr, BLOCK: tl.constexpr):
    # each usable entry e to ENTRY[at], at = where its counter starts + its rank there; the entries at
    # 0, CHUNK, 2 CHUNK ... of their segment open its work items
    pid = tl.program_id(0)
    e = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    seg = tl.load(SEG + e, mask=e < E, other=-1)
    use = seg >= 0
    seg_c = tl.maximum(seg, 0)
    at = tl.load(SUB_START + seg_c * SPREAD + pid % SPREAD, mask=use, other=0) + tl.load(RANK + e, mask=use,
                                                                                           other=0)
    tl.store(ENTRY + at, e.to(ENTRY.dtype.element_ty), mask=use)
    rank = at - tl.load(SEG_START + seg_c, mask=use, other=0)  # within the segment
    opens = use & (rank % CHUNK == 0)
    item = tl.load(ITEM_FIRST + seg_c, mask=opens, other=0) + rank // CHUNK
    tl.store(ITEM_SEG + item, seg, mask=opens)
    tl.store(ITEM_CHUNK + item, rank // CHUNK, mask=opens)


def block_entries(bi, *, select_size, chunk, block=INDEX_BLOCK, spread=INDEX_SPREAD, first=0):
    """The usable entries of sorted lists grouped by key block, for the forward per block, in two
    launches and without a host sync (`inverted_index` holds the same groups in ~30 torch ops).

    bi: int32 `[B, T, Hkv, n]`, every list ascending (its -1 padding first or last). Returns `(entry,
    seg_start, item_seg, item_chunk, n_items)`: `entry` `[B*T*Hkv*n]`, the flat index `((b * T + t) *
    Hkv + h) * n + slot` of each usable entry, grouped by segment `(b * Hkv + h) * Ns + block` in no
    particular order within one; `seg_start` `[NSEG + 1]` where each segment starts in `entry`; one
    work item per `chunk` entries of a segment: `item_seg` and `item_chunk` `[n_items_max]`, valid
    below `n_items` (int32 `[1]`, on the device). Padding, repeats and blocks past the position are
    dropped, as in `inverted_index`. `block`: list entries per program; `spread` (a power of two):
    counters per segment. `first`: the position of list t is `first + t`."""
    B, T, HKV, n = bi.shape
    ns = cdiv(first + T, select_size)
    nseg, E = B * HKV * ns, bi.numel()
    max_items = cdiv(E, chunk) + nseg  # >= the items, known without a sync
    dev = bi.device
    # two allocations for the index's ten buffers: at 8k the host's time for 20 allocations and 10
    # launches was most of a short forward's
    counts, arrived = _int32_parts(torch.zeros, dev, nseg * spread, 1)
    wide = E >= 2**31  # entry indices past int32
    sizes = (E, E, nseg + 1, nseg * spread, nseg, 1, max_items, max_items) + ((0,) if wide else (E,))
    seg, rank, seg_start, sub_start, item_first, n_items, item_seg, item_chunk, entry = _int32_parts(
        torch.empty, dev, *sizes)
    if wide:
        entry = torch.empty(E, device=dev, dtype=torch.int64)
    grid = (cdiv(E, block),)
    launcher(_count_kernel)[grid](
        bi, seg, rank, counts, arrived, seg_start, sub_start, item_first, n_items, E, T, first, HKV, n, ns,
        nseg, chunk, BS=select_size, SPREAD=spread, BLOCK=block, SCAN_BLOCK=512 if nseg > 128 else 128)
    launcher(_scatter_kernel)[grid](seg, rank, seg_start, sub_start, item_first, entry, item_seg, item_chunk,
                                    E, chunk, SPREAD=spread, BLOCK=block)
    return entry, seg_start, item_seg, item_chunk, n_items


def _int32_parts(alloc, device, *sizes):
    """Int32 tensors of the given sizes, views into one allocation (`torch.empty` or `torch.zeros`),
    each starting on 128 bytes, as a tensor of its own would (Triton specialises aligned pointers)."""
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + -(-size // 32) * 32)
    buf = alloc(starts[-1], device=device, dtype=torch.int32)
    return [buf[a:a + size] for a, size in zip(starts, sizes, strict=False)]


@triton.jit
def store_forward(O, LSE, OC, OW, GC, GS, GW, OUT, row, m_r, o_dv, m_i, l_i, acc, DV: tl.constexpr,
                  GATE_SUM: tl.constexpr, STORE_O: tl.constexpr):
    # o = acc / l_i (0 for rows with no usable token; to O if STORE_O) and lse (natural log, -inf for
    # those rows). GATE_SUM: also NSA's output OUT = GC * OC + GS * o + GW * OW for the rows (gates
    # [B, T, HQ], the other branches' outputs OC, OW [B, T, HQ, DV], all contiguous), with o rounded
    # to O's dtype first and the sum in `gates.gate_forward`'s order, as that kernel computes it
    o, lse_out = softmax_result(m_i, l_i, acc)  # [M, BDV], [M]
    offs = row[:, None] * DV + o_dv[None, :]
    mask = m_r[:, None] & (o_dv < DV)[None, :]
    o = o.to(O.dtype.element_ty)
    if STORE_O:
        tl.store(O + offs, o, mask=mask)
    tl.store(LSE + row, lse_out, mask=m_r)
    if GATE_SUM:
        gc = tl.load(GC + row, mask=m_r, other=0.0).to(tl.float32)
        gs = tl.load(GS + row, mask=m_r, other=0.0).to(tl.float32)
        gw = tl.load(GW + row, mask=m_r, other=0.0).to(tl.float32)
        out = gc[:, None] * tl.load(OC + offs, mask=mask, other=0.0).to(tl.float32)
        out += gs[:, None] * o.to(tl.float32)
        out += gw[:, None] * tl.load(OW + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + offs, out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def item_range(ITEM_CHUNK, SEG_START, seg, i_item, HQ, G, NS, CHUNK):
    # what work item i_item of segment seg (`inverted_index` or `block_entries`, seg < NSEG) covers:
    # the block, batch and KV head, and its entries [start, end) of the sorted lists
    HKV = HQ // G
    blk = seg % NS
    i_bh = seg // NS
    start = tl.load(SEG_START + seg) + tl.load(ITEM_CHUNK + i_item) * CHUNK
    end = tl.minimum(start + CHUNK, tl.load(SEG_START + seg + 1))
    return blk, (i_bh // HKV).to(tl.int64), i_bh % HKV, start, end


@triton.jit
def block_kv(K, V, i_b, i_hk, blk, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, T, DK: tl.constexpr,
             DV: tl.constexpr, BDK: tl.constexpr, BDK2: tl.constexpr, BDV: tl.constexpr, BS: tl.constexpr,
             UPCAST: tl.constexpr):
    # one key block's token positions o_k [BS] (m_k: inside T), keys k [BS, BDK] (k2 [BS, BDK2], the
    # tail of a split head dim) and values v [BS, BDV]
    o_k = blk * BS + tl.arange(0, BS)
    m_k = o_k < T
    o_dv = tl.arange(0, BDV)
    k, k2 = load_rows(K + i_b * sk_b + i_hk * sk_h + o_k.to(tl.int64) * sk_t, m_k, DK, BDK, BDK2, UPCAST)
    v = tl.load(V + i_b * sv_b + i_hk * sv_h + o_k[:, None].to(tl.int64) * sv_t + o_dv[None, :],
                mask=m_k[:, None] & (o_dv < DV)[None, :], other=0.0)
    if UPCAST:
        v = v.to(tl.float32)
    return o_k, m_k, k, k2, v


@triton.jit
def _by_block_kernel(
    Q, K, V, ITEM_SEG, ITEM_CHUNK, N_ITEMS, SEG_START, ENTRY, PO, PLSE,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
    T, T0, TK, HQ, G, NS, NSEG, NSEL, scale_log2, CHUNK,
    DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDK2: tl.constexpr, BDV: tl.constexpr,
    GP: tl.constexpr, BQ: tl.constexpr, BS: tl.constexpr, UPCAST: tl.constexpr, PRELOAD: tl.constexpr,
):
    # One program per work item of `block_entries` (the first N_ITEMS[0]; the rest return) or
    # `inverted_index`: up to CHUNK (= PRELOAD, a power of two) entries of one (b, kv head, block)
    # segment, BQ of them x the G heads per MMA (M = BQ * GP rows). Each entry e (flat index ENTRY[e]
    # into the [B, T, HKV, NSEL] lists) leaves G partial rows: PO [E_all * G, DV] (o over this block's
    # keys) and PLSE [E_all * G] (their log2-sum-exp, scaled). The T lists (and rows of Q) are those of
    # positions T0 .. T0 + T - 1; K and V hold TK tokens.
    M: tl.constexpr = BQ * GP
    i_item = tl.program_id(0)
    seg = tl.load(ITEM_SEG + i_item, mask=i_item < tl.load(N_ITEMS), other=NSEG)
    if seg < NSEG:
        HKV = HQ // G
        blk, i_b, i_hk, start, end = item_range(ITEM_CHUNK, SEG_START, seg, i_item, HQ, G, NS, CHUNK)
        # o_k [BS] token positions of the block, k [BS, BDK], k2 [BS, BDK2], v [BS, BDV]
        o_k, _, k, k2, v = block_kv(K, V, i_b, i_hk, blk, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, TK, DK, DV,
                                    BDK, BDK2, BDV, BS, UPCAST)
        o_dv = tl.arange(0, BDV)
        o_r = tl.arange(0, M)
        r_g = o_r % GP
        r_h = i_hk * G + r_g  # [M] query head of each row
        o_c = tl.arange(0, PRELOAD)
        item_entry = tl.load(ENTRY + start + o_c, mask=start + o_c < end, other=0)  # [PRELOAD]
        for i0 in range(start, end, BQ):
            e = i0 + o_r // GP  # [M] sorted entry of each row
            m_r = (e < end) & (r_g < G)
            ent = tl.gather(item_entry, tl.minimum(e - start, PRELOAD - 1), 0)
            ent = tl.where(m_r, ent, 0).to(tl.int64)  # [M] flat (b, t, kv head, slot)
            r_t = (ent // (HKV * NSEL)) % T  # [M] query row, at position T0 + r_t
            q, q2 = load_rows(Q + i_b * sq_b + r_h * sq_h + r_t * sq_t, m_r, DK, BDK, BDK2,
                              UPCAST)  # [M, BDK], [M, BDK2]
            s = dot(q, tl.trans(k))  # [M, BS]
            if BDK2 > 0:
                s += dot(q2, tl.trans(k2))
            valid = (o_k[None, :] <= T0 + r_t[:, None]) & m_r[:, None]
            m_i, l_i, acc = softmax_start(M, BDV)
            m_i, l_i, acc = online_softmax_step(s, valid, v, m_i, l_i, acc, scale_log2)
            # every entry's block starts at or before its position: l_i > 0 on the rows stored
            l_safe = tl.where(m_r, l_i, 1.0)
            out = (ent * G + r_g).to(tl.int64)  # [M] partial row
            tl.store(PO + out[:, None] * DV + o_dv[None, :], (acc / l_safe[:, None]).to(PO.dtype.element_ty),
                     mask=m_r[:, None] & (o_dv < DV)[None, :])
            tl.store(PLSE + out, m_i + tl.log2(l_safe), mask=m_r)


@triton.jit
def _merge_kernel(
    BI, PO, PLSE, O, LSE, OC, OW, GC, GS, GW, OUT, T, T0, HQ, G, NSEL,
    DV: tl.constexpr, BDV: tl.constexpr, GP: tl.constexpr, NP: tl.constexpr, BS: tl.constexpr,
    GATE_SUM: tl.constexpr, STORE_O: tl.constexpr,
):
    # One program per (position, b * kv head): the partials [NSEL, G, DV] of its list's usable entries
    # (sorted lists BI [B, T, HKV, NSEL]: an entry is usable if it is a block starting at or before
    # the position and not a repeat of the entry before it), one contiguous read, merged per head as
    # a softmax over the blocks' log2-sum-exps. Row t is position T0 + t.
    t = tl.program_id(0)
    i_bh = tl.program_id(1)
    HKV = HQ // G
    i_b = (i_bh // HKV).to(tl.int64)
    i_hk = i_bh % HKV
    lists = ((i_b * T + t) * HKV + i_hk) * NSEL  # first entry of the position's list
    o_s = tl.arange(0, NP)
    o_g = tl.arange(0, GP)
    o_dv = tl.arange(0, BDV)
    blk = tl.load(BI + lists + o_s, mask=o_s < NSEL, other=-1)  # [NP]
    prev = tl.load(BI + lists + o_s - 1, mask=(o_s > 0) & (o_s < NSEL), other=-1)
    usable = (blk >= 0) & (blk * BS <= T0 + t) & (blk != prev)  # [NP]
    part = (lists + o_s)[:, None] * G + o_g[None, :]  # [NP, GP] partial rows
    m_part = usable[:, None] & (o_g < G)[None, :]
    pl = tl.load(PLSE + part, mask=m_part, other=float("-inf"))  # [NP, GP]
    m_i = tl.max(pl, 0)  # [GP]
    w = tl.exp2(pl - tl.where(m_i == float("-inf"), 0.0, m_i)[None, :])  # [NP, GP]
    po = tl.load(PO + part[:, :, None] * DV + o_dv[None, None, :],
                 mask=m_part[:, :, None] & (o_dv < DV)[None, None, :], other=0.0).to(tl.float32)
    acc = tl.sum(w[:, :, None] * po, 0)  # [GP, BDV]
    row = (i_b * T + t) * HQ + i_hk * G + o_g  # [GP] flat (b, t, h)
    store_forward(O, LSE, OC, OW, GC, GS, GW, OUT, row, o_g < G, o_dv, m_i, tl.sum(w, 0), acc, DV, GATE_SUM,
                  STORE_O)


def selected_forward_by_block(q, k, v, bi, o, lse, *, select_size, scale, presorted=False, gated_sum=None,
                              store_o=True, before_merge=None, chunk_bytes=None):
    """The selected branch's forward per key block: writes o `[B, T, Hq, Dv]` (if `store_o`) and lse
    `[B, T, Hq]` float32 (natural log), as `selection._selected_walk` does.

    q `[B, T, Hq, Dk]`, k `[B, T, Hkv, Dk]`, v `[B, T, Hkv, Dv]` contiguous; bi int32 `[B, T, Hkv, n]`
    contiguous (`presorted`: every list ascending, as `select_blocks` writes them). `gated_sum`:
    `(o_cmp, o_swa, g_cmp, g_slc, g_swa, out)`, NSA's gated output written to `out` by the merge.
    `before_merge`: called once the first partials' launches are queued, before the first merge (the
    prefill joins the window's stream there, so that the window runs beside the block-major kernel).
    Transient memory: the partials, n x Hq x Dv values of q's dtype per position (and the index): past
    `chunk_bytes` of them (default `PARTIALS_CHUNK_BYTES`) each sequence goes a chunk of positions at a
    time (the same result)."""
    B, T, HQ, _ = q.shape
    HKV, DV = k.shape[2], v.shape[3]
    nsel = bi.shape[-1]
    if not presorted:
        bi = bi.sort(dim=-1).values.contiguous()  # partials are numbered by slot of the sorted lists
    per_position = HKV * nsel * (HQ // HKV) * (DV * q.element_size() + 4) + HKV * nsel * 16  # + the index
    rest = list(gated_sum) if gated_sum is not None else []
    chunk_bytes = PARTIALS_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    if B * T * per_position <= chunk_bytes:
        _by_block_part(q, k, v, bi, o, lse, rest, 0, select_size, scale, store_o, before_merge)
        return
    span = max(16, chunk_bytes // per_position // 16 * 16)  # positions a chunk, starts aligned as T's
    for b in range(B):
        for lo in range(0, T, span):
            rows = (slice(b, b + 1), slice(lo, lo + span))  # contiguous slices of contiguous tensors
            _by_block_part(q[rows], k[b : b + 1], v[b : b + 1], bi[rows], o[rows], lse[rows],
                           [x[rows] for x in rest], lo, select_size, scale, store_o, before_merge)
            before_merge = None  # the streams have joined


def _by_block_part(q, k, v, bi, o, lse, gated_sum, first, select_size, scale, store_o, before_merge):
    # `selected_forward_by_block` for the lists bi [B, T, Hkv, n] (and rows of q, o, lse, the gated sum's
    # tensors) of positions first .. first + T - 1 over the keys k, v [B, TK, Hkv, D]
    B, T, HQ, DK = q.shape
    TK, HKV, DV = k.shape[1], k.shape[2], v.shape[3]
    G = HQ // HKV
    nsel = bi.shape[-1]
    GP = pow2(G, 1)
    rows = 16 if interpreting() else BY_BLOCK_ROWS
    BQ = max(1, rows // GP)  # positions per MMA
    chunk = BQ * (2 if interpreting() else BY_BLOCK_CHUNK_STEPS)  # positions per work item
    assert chunk & (chunk - 1) == 0, f"positions per work item must be a power of two, got {chunk}"
    po = torch.empty(B * T * HKV * nsel * G, DV, device=q.device, dtype=q.dtype)
    plse = torch.empty(B * T * HKV * nsel * G, device=q.device, dtype=torch.float32)
    if B * T * HKV * nsel:
        entry, seg_start, item_seg, item_chunk, n_items = block_entries(bi, select_size=select_size,
                                                                        chunk=chunk, first=first)
        ns = cdiv(first + T, select_size)
        BDK, BDK2 = dk_tiles(DK)
        launcher(_by_block_kernel)[(item_seg.numel(),)](
            q, k, v, item_seg, item_chunk, n_items, seg_start, entry, po, plse,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), T, first, TK, HQ, G, ns, B * HKV * ns, nsel, scale * LOG2E,
            chunk, DK=DK, DV=DV, BDK=BDK, BDK2=BDK2, BDV=pow2(DV), GP=GP, BQ=BQ, BS=select_size,
            UPCAST=interpreting(), PRELOAD=chunk, **BY_BLOCK_CONFIG,
        )
    if before_merge is not None:
        before_merge()
    dummy = o
    launcher(_merge_kernel)[(T, B * HKV)](
        bi, po, plse, o, lse, *(gated_sum if gated_sum else (dummy,) * 6), T, first, HQ, G, nsel,
        DV=DV, BDV=pow2(DV), GP=GP, NP=pow2(nsel, 1), BS=select_size, GATE_SUM=bool(gated_sum),
        STORE_O=store_o, **MERGE_CONFIG,
    )
