"""Top-k of selection-block importances in Triton: the blocks each query (prefill, `select_blocks`)
or each decoded sequence (`decode.py`, in its importance launch) attends to. Forced blocks first
(the first `num_init`, the `num_local` most recent), then the largest importances, ties to the lower
block index, written ascending and `-1` padded, exactly as the reference's stable sort.

A row of up to 2,048 blocks goes through the lean filter (`lean_filtered_top`): a bound from 32 group
maxima leaves ~16 candidates of 1,024 blocks on random inputs, which are compacted and ranked in ~1,200
instructions a row; rows it does not take (short rows, more forced blocks than slots, too many
candidates, rows past 2,048 blocks) take one arg-max pass per pick over the whole row. The decode's
importance launch takes the same two paths on its rows (`decode._last_takes_topk`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa_eval.kernels._triton_utils import interpreting, launcher, pow2

# Candidates a row's compaction slots hold (the lean filter): ~16 of 1,024 blocks pass its bound on
# random inputs; a row with more takes the arg-max passes over the whole row instead.
TOPK_CAP = 64
# Warps of a `topk_blocks` program (one row each): warps along one row would reduce every arg-max pass
# across warps through shared memory; one warp a row took the top-k alone at 64k from 2.88 to 2.12 ms.
TOPK_WARPS = 1
# Registers the lean filter's launch may take: its own path needs ~62 and runs unspilled at 80, while
# the whole kernel (with the arg-max fallback) would take 168 and leave 12 one-warp programs an SM
# instead of 25 (compiled for sm_90): the top-k alone at 64k 0.424 ms against 0.567 uncapped.
TOPK_LEAN_MAXNREG = 80


@triton.jit
def block_keys(imp, o_j, cur, num_init, num_local, BNS: tl.constexpr):
    """int64 keys ordered like (importance, -block index), so that a larger key wins and ties go to
    the lower index: forced blocks (the first num_init, the num_local up to cur) as importance +inf,
    blocks after cur -1. imp float32 >= 0 `[.., BNS]`; o_j (block indices) and cur broadcast to it."""
    forced = (o_j < num_init) | (o_j > cur - num_local)
    imp = tl.where(forced, float("inf"), imp + 0.0)  # + 0.0: -0.0 -> +0.0
    bits = imp.to(tl.int32, bitcast=True)  # >= 0 for non-negative floats, ordered like them
    key = (bits.to(tl.int64) << 32) + (BNS - 1 - o_j).to(tl.int64)
    return tl.where(o_j <= cur, key, -1)


@triton.jit
def _argmax_chosen(imp, forced, o_j, num_selected, BNS: tl.constexpr):
    """imp float32 [BR, BNS] (forced blocks +inf, blocks after the row's own -inf), forced [BR, BNS]
    (the forced blocks at or before it) -> chosen int32 [BR, BNS] (0/1): the forced blocks at once
    (unless there are more than slots: then the lowest-index ones, as +inf ties), then one arg-max per
    remaining slot, ties to the lowest index."""
    n_forced = tl.sum(forced.to(tl.int32), 1)  # [BR]
    few = (n_forced <= num_selected)[:, None]
    chosen = (few & forced).to(tl.int32)
    imp = tl.where(few & forced, float("-inf"), imp)
    picks = tl.where(n_forced <= num_selected, num_selected - n_forced, num_selected)  # [BR]
    for i in range(tl.max(picks, 0)):
        # a max, then the lowest index holding it: faster than one (value, index) reduction (the
        # top-k alone at 64k took 2.38 ms with tl.max(return_indices=True) against 2.12)
        best = tl.max(imp, 1)  # [BR]
        first = tl.min(tl.where(imp == best[:, None], o_j[None, :], BNS), 1)  # lowest index among ties
        take = (o_j[None, :] == first[:, None]) & ((best > float("-inf")) & (i < picks))[:, None]
        chosen = tl.where(take, 1, chosen)
        imp = tl.where(take, float("-inf"), imp)
    return chosen


@triton.jit
def lean_filtered_top(IMP, OUT, SCR, row, cur, num_selected, num_init, num_local, NS, BNS: tl.constexpr,
                      NSEL: tl.constexpr, CAP: tl.constexpr, CACHE: tl.constexpr):
    """One row's blocks through a candidate filter -> done (the row is written to OUT). It reads only
    the pickable blocks (after the initial ones, before the local ones); the picks-th largest of the
    maxima of 32 groups of the row bounds the picks-th largest importance from below (picks groups hold
    a value at least that large), so every block the row keeps is a candidate. ~16 candidates on
    random inputs are compacted through a bit mask per lane (`_compact_candidates`) into the row's
    2 x CAP int32 slots of SCR, where they are ranked (`_rank_and_store`). Not done
    (nothing written; the caller takes the full pass) for rows of at most num_selected blocks, with
    more forced blocks than slots, or with more than CAP candidates. One warp; BNS <= 2048. CACHE: the
    loads' cache modifier (".cg" where other programs of the launch wrote IMP)."""
    R: tl.constexpr = BNS // 128  # runs of 4 blocks a lane holds (Triton's layout of a row, one warp)
    n_init = tl.minimum(num_init, cur + 1)
    # the first forced local block after the initial ones (a negative num_local forces none, as 0)
    lo_local = tl.maximum(num_init, cur - tl.maximum(num_local, 0) + 1)
    picks = num_selected - n_init - tl.maximum(cur - lo_local + 1, 0)
    done = (tl.minimum(cur + 1, NS) > num_selected) & (picks >= 1)
    if done:
        o_j = tl.arange(0, BNS)
        # whole runs of 4 (vector loads) where the row's length allows, then the pickable blocks only:
        # forced ones are placed, not picked
        hi = tl.minimum((lo_local + 3) // 4 * 4, NS)
        x = tl.load(IMP + row * NS + o_j, mask=(o_j >= num_init // 4 * 4) & (o_j < hi), other=float("-inf"),
                    cache_modifier=CACHE)
        x = tl.where((o_j >= num_init) & (o_j < lo_local), x, float("-inf"))
        runs = tl.reshape(x, [R, 32, 4])  # [run, lane, 4 adjacent blocks]: a lane's blocks, no shuffles
        group_max = tl.max(tl.max(runs, 2), 0)  # [32]
        top = tl.topk(group_max, NSEL)  # [NSEL] largest first (picks <= num_selected <= NSEL)
        tau = tl.max(tl.where(tl.arange(0, NSEL) == picks - 1, top, float("-inf")), 0)  # picks-th largest
        # picks groups hold a value >= tau, so the picks largest importances are all at least tau; with
        # fewer groups (tau = -inf) every pickable block is a candidate (the floor keeps -inf out)
        tau = tl.maximum(tau, -3.4028234663852886e38)
        base = SCR + row * (2 * CAP)
        n_cand = _compact_candidates(IMP + row * NS, base, runs >= tau, R, CAP, CACHE)
        done = n_cand <= CAP
        if done:
            out_row = OUT + row * num_selected
            if n_cand <= 32:
                _rank_and_store(base, out_row, n_cand, picks, n_init, BNS, CAP, 32)
            else:
                _rank_and_store(base, out_row, n_cand, picks, n_init, BNS, CAP, CAP)
            # the initial blocks first, the local ones last
            o_s = tl.arange(0, NSEL)
            forced = tl.where(o_s < n_init, o_s, lo_local + o_s - n_init - picks)
            local = (o_s >= n_init + picks) & (o_s < num_selected)
            tl.store(out_row + o_s, forced, mask=(o_s < n_init) | local)
    return done


@triton.jit
def _compact_candidates(IMP_ROW, base, candidate, R: tl.constexpr, CAP: tl.constexpr, CACHE: tl.constexpr):
    """candidate bool [R, 32, 4] (run, lane, block of the run; block 128 * run + 4 * lane + i) -> their
    count; where it is at most CAP, each lane stores its own candidates, lowest block first, at its
    offset among the warp's: block indices at base[0:CAP], their value bits at base[CAP:2 * CAP]."""
    MASK_DTYPE: tl.constexpr = tl.int32 if R <= 8 else tl.int64
    position = tl.arange(0, R)[:, None, None] * 4 + tl.arange(0, 4)[None, None, :]  # [R, 1, 4]
    bit = tl.full([1], 1, MASK_DTYPE) << position.to(MASK_DTYPE)
    lane_bits = tl.sum(tl.sum(tl.where(candidate, bit, 0), 2), 0)  # [32] MASK_DTYPE: a lane's candidates
    lane_count = _popcount(lane_bits)  # [32] int32
    n_cand = tl.sum(lane_count, 0)
    if n_cand <= CAP:
        slot = tl.cumsum(lane_count, 0) - lane_count  # [32] int32: a lane's next slot
        lane = tl.arange(0, 32)
        for _ in range(tl.max(lane_count, 0)):
            lowest = lane_bits & (0 - lane_bits)  # the lowest candidate bit left (0 when none)
            # its position, from the exponent of the float the power of two converts to exactly
            bit_pos = ((lowest.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
            blk = (bit_pos // 4) * 128 + lane * 4 + bit_pos % 4
            left = lane_bits != 0
            value = tl.load(IMP_ROW + blk, mask=left, other=0.0, cache_modifier=CACHE) + 0.0  # -0.0 -> +0.0
            tl.store(base + slot, blk, mask=left)
            tl.store(base + CAP + slot, value.to(tl.int32, bitcast=True), mask=left)
            slot += 1
            lane_bits = lane_bits & (lane_bits - 1)
        tl.debug_barrier()  # the compacted candidates, stored by other lanes, before they are read
    return n_cand


@triton.jit
def _popcount(v):
    # the set bits of each element of an int32 or int64 tensor -> int32 (SWAR: bit counts of pairs,
    # nibbles, bytes, then the bytes summed by one multiply)
    if v.dtype == tl.int64:
        u = v.to(tl.uint64, bitcast=True)
        u = u - ((u >> 1) & 0x5555555555555555)
        u = (u & 0x3333333333333333) + ((u >> 2) & 0x3333333333333333)
        u = (u + (u >> 4)) & 0x0F0F0F0F0F0F0F0F
        return ((u * 0x0101010101010101) >> 56).to(tl.int32)
    else:
        u = v.to(tl.uint32, bitcast=True)
        u = u - ((u >> 1) & 0x55555555)
        u = (u & 0x33333333) + ((u >> 2) & 0x33333333)
        u = (u + (u >> 4)) & 0x0F0F0F0F
        return ((u * 0x01010101) >> 24).to(tl.int32)


@triton.jit
def _rank_and_store(base, out_row, n_cand, picks, n_init, BNS: tl.constexpr, CAP: tl.constexpr,
                    SLOTS: tl.constexpr):
    # the picks largest of the n_cand <= SLOTS compacted candidates (indices at base, value bits at base
    # + CAP), each stored at out_row + n_init + its place among the picks by block index
    o_c = tl.arange(0, SLOTS)
    m_c = o_c < n_cand
    blk = tl.load(base + o_c, mask=m_c, other=BNS)
    bits = tl.load(base + CAP + o_c, mask=m_c, other=0)  # >= 0: non-negative floats, ordered like them
    key = tl.where(m_c, (bits.to(tl.int64) << 32) + (BNS - 1 - blk).to(tl.int64), -1)
    rank = tl.sum((key[None, :] > key[:, None]).to(tl.int32), 1)  # keys are distinct (the index)
    pick = tl.where((rank < picks) & m_c, blk, BNS)
    place = tl.sum((pick[None, :] < pick[:, None]).to(tl.int32), 1)
    tl.store(out_row + n_init + place, blk, mask=pick < BNS)


@triton.jit
def _topk_blocks_kernel(
    IMP, POS, OUT, SCR, N_ROWS, NS, T, HKV, select_size, num_selected, num_init, num_local,
    HAS_POS: tl.constexpr, BR: tl.constexpr, BNS: tl.constexpr, NSEL: tl.constexpr, LEAN: tl.constexpr,
    CAP: tl.constexpr,
):
    # IMP [N_ROWS, NS] float32 (rows ordered (b, t, h_kv)); OUT [N_ROWS, num_selected] int32.
    # Picks forced blocks, then the largest importances (ties: lower block index), writes the
    # chosen indices ascending, -1 after them. LEAN (BR = 1): the lean filter first, its scratch SCR
    # [N_ROWS, 2, CAP] int32; the arg-max passes for the rows it does not take.
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)  # [BR]
    m_r = rows < N_ROWS
    if HAS_POS:
        t = tl.load(POS + rows // HKV, mask=m_r, other=0)
    else:
        t = ((rows // HKV) % T).to(tl.int32)
    cur = t // select_size  # block holding t
    done = 0
    if LEAN:
        done = lean_filtered_top(IMP, OUT, SCR, tl.sum(rows, 0), tl.sum(cur, 0), num_selected, num_init,
                                 num_local, NS, BNS, NSEL, CAP, "")
    if done == 0:
        _top_of_rows(IMP, OUT, rows, m_r, cur, NS, num_selected, num_init, num_local, BR, BNS, NSEL)


@triton.jit
def _top_of_rows(IMP, OUT, rows, m_r, cur, NS, num_selected, num_init, num_local, BR: tl.constexpr,
                 BNS: tl.constexpr, NSEL: tl.constexpr):
    # the rows [BR] by one arg-max pass per pick over their whole rows of IMP
    o_j = tl.arange(0, BNS)  # [BNS]
    imp = tl.load(IMP + rows[:, None] * NS + o_j[None, :], mask=m_r[:, None] & (o_j < NS)[None, :],
                  other=0.0)  # [BR, BNS]
    o_s = tl.arange(0, NSEL)
    forced = (o_j[None, :] < num_init) | (o_j[None, :] > (cur - num_local)[:, None])
    imp = tl.where(forced, float("inf"), imp)
    imp = tl.where(o_j[None, :] > cur[:, None], float("-inf"), imp)
    forced = forced & (o_j[None, :] <= cur[:, None])
    chosen = _argmax_chosen(imp, forced, o_j, num_selected, BNS)
    rank = tl.cumsum(chosen, 1) - 1  # [BR, BNS] output slot of each chosen block
    count = tl.sum(chosen, 1)  # [BR]
    tl.store(OUT + rows[:, None] * num_selected + o_s[None, :], tl.full([BR, NSEL], -1, tl.int32),
             mask=m_r[:, None] & (o_s >= count[:, None]) & (o_s < num_selected)[None, :])
    tl.store(OUT + rows[:, None] * num_selected + rank, o_j[None, :] + tl.zeros([BR, BNS], tl.int32),
             mask=m_r[:, None] & (chosen > 0))


def lean_fits(bns: int, nsel: int) -> bool:
    """Whether the lean filter (`lean_filtered_top`) takes rows padded to bns blocks picking nsel (both
    powers of two): its 32 group maxima of 4-block runs must hold nsel candidates at least, and a
    lane's bit mask holds at most 64 of a row's blocks."""
    return nsel <= 32 and 128 <= bns <= 2048


def lean_scratch(rows: int, device) -> torch.Tensor:
    """The lean filter's compaction slots of `rows` rows: 2 x CAP int32 a row (block indices, then
    their value bits)."""
    return torch.empty(rows, 2 * TOPK_CAP, device=device, dtype=torch.int32)


def topk_blocks(imp, *, T, num_kv_heads, select_size, num_selected, num_init, num_local, positions=None):
    """imp [N_ROWS, NS] float32 (rows (b, t, h_kv)), importances >= 0 (sums of probabilities: the lean
    filter orders their bit patterns) -> int32 [N_ROWS, num_selected], ascending, -1 padded.
    `positions` (int32 [N_ROWS // num_kv_heads]) overrides t = row's sequence position."""
    n_rows, ns = imp.shape
    out = torch.empty(n_rows, num_selected, device=imp.device, dtype=torch.int32)
    if n_rows == 0:
        return out
    NSEL = pow2(num_selected, 2)  # >= 2 for tl.topk
    BNS = max(pow2(ns), NSEL)
    # decode-sized calls (<= 128 rows) spread a row over 4 warps: too few programs to fill the GPU
    warps = 4 if n_rows <= 128 and not interpreting() else TOPK_WARPS
    lean = lean_fits(BNS, NSEL)
    launch = dict(num_warps=warps)
    if lean and not interpreting():
        launch["maxnreg"] = TOPK_LEAN_MAXNREG
    scratch = lean_scratch(n_rows, imp.device) if lean else out
    launcher(_topk_blocks_kernel)[(n_rows,)](
        imp, positions if positions is not None else imp, out, scratch, n_rows, ns, T, num_kv_heads,
        select_size, num_selected, num_init, num_local,
        HAS_POS=positions is not None, BR=1, BNS=BNS, NSEL=NSEL, LEAN=lean, CAP=TOPK_CAP, **launch,
    )
    return out
