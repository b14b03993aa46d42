"""Top-k of selection-block importances in Triton: the blocks each query (prefill, `select_blocks`)
or each decoded sequence (`decode.py`, in its importance launch) attends to. Forced blocks first
(the first `num_init`, the `num_local` most recent), then the largest importances, ties to the lower
block index, written ascending and `-1` padded, exactly as the reference's stable sort.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa_eval.kernels._triton_utils import cdiv, interpreting, launcher, pow2

# "filter" (the default from run 19 to run 99): a bound from 32 group maxima keeps ~22 candidate blocks of a
# row, compacted, then picked among those (`filtered_top`: by rank since run 54, `TOPK_FILTER_PICK`,
# before by one arg-max pass per pick); "argmax": one arg-max
# pass per pick over the whole row; "radix": the k-th largest by a bitwise search (31 counting
# passes); "bitonic": `tl.topk` over int64 keys (importance, -index), a bitonic top-k, then a sort of
# the k winners by index. The top-k alone at 64k, one row per 1-warp program (run 19): 1.55 ms filter,
# 2.12 arg-max, 2.18 radix, 3.08 bitonic. The benchmark times all.
# "lean" (`lean_filtered_top`, the default since run 100): the filter in half the instructions (its
# path ~1,200 SASS instructions a row against ~2,400, compiled for sm_90), at a register cap that
# leaves that path unspilled (`TOPK_LEAN_MAXNREG`); rows of at most 2,048 blocks (longer ones take the
# filter). Run 100 (`scripts/probe_topk.py lean`), alone at 64k: 0.424 ms against 1.109 for the filter
# (the same blocks; 8k: 0.048 against 0.062); the NSA forward at 64k 33.25 / 33.72 ms against 33.61 /
# 34.31, G = 4 17.07 / 17.53 against 17.34 / 17.99 (run 102: 32.91 / 33.54 against 33.39 / 34.20); at
# 8k the same within the spread. The fused decode's step 2 takes it too since run 106
# (`decode._step2_topk`).
TOPK_METHOD = "lean"
TOPK_METHODS = ("argmax", "radix", "bitonic", "filter", "lean")
# "filter": candidates per row (the blocks at or above the filter's bound, ~22 on random inputs) that
# fit its compacted slots; a row with more takes the arg-max passes over the whole row instead
TOPK_FILTER_CAP = 64
# "filter": how it picks among its candidates. "rank": each candidate's rank (the candidates with a
# larger key) from one [CAP, CAP] comparison, all at once, and the chosen ones in index order (the
# compaction keeps it); "argmax": one arg-max pass per pick, then a sort of the picks by index.
# Run 54 (scripts/probe_topk.py picks): alone at 64k 1.515 ms against 1.548; the decode's step 2
# (`decode._step2_topk`), B = 16 at 64k: 69.4 us against 70.4 (71.9 with arg-max over the whole row)
TOPK_FILTER_PICK = "rank"
TOPK_FILTER_PICKS = ("rank", "argmax")
# rows per program and warps of `topk_blocks` (rows: at most, for 4096 // Ns); decode-sized calls
# (<= 128 rows) take one row per program. Run 14, the top-k alone at 64k (262,144 rows of 1,024
# blocks): one row per 1-warp program 2.12 ms against 2.88 for 4 rows over 4 warps, which puts warps
# along a row, so every arg-max pass reduced across warps through shared memory (2 rows / 1 warp 2.27,
# 2 / 2 2.49; radix 2.18 and bitonic 3.08 at their best, one row per warp). The whole forward: 40.46
# ms against 40.85 (G = 16), 21.79 against 22.32 (G = 4).
TOPK_CONFIG = dict(rows=1, num_warps=1)
# "lean": the registers its launch may take. Its own path needs ~62, the whole kernel 168 (the full pass
# that the rows it does not take fall back to), which would leave 12 one-warp programs an SM; at 80 the
# full pass spills and its own path does not (compiled for sm_90 with Triton 3.8), 25 programs an SM.
# None: the compiler's choice. Run 100, alone at 64k: 0.424 ms at 80, 0.442 at 72, 0.440 at 64, 0.567
# uncapped.
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
def top_blocks(key, num_selected, BNS: tl.constexpr, KP: tl.constexpr):
    """The num_selected largest keys of `block_keys` `[.., BNS]` -> int32 block indices `[.., KP]`,
    ascending, BNS in the empty slots (KP: a power of two, >= 2 (`tl.topk` of 1 does not compile),
    >= num_selected and <= BNS)."""
    top = tl.topk(key, KP)  # [.., KP], largest first
    o_k = tl.arange(0, KP)
    blk = tl.where((top >= 0) & (o_k < num_selected), BNS - 1 - (top & 0xFFFFFFFF).to(tl.int32), BNS)
    return tl.sort(blk)


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
        # a max, then the lowest index holding it: faster than one (value, index) reduction
        # (run 18, the top-k alone at 64k: 2.38 ms with tl.max(return_indices=True))
        best = tl.max(imp, 1)  # [BR]
        first = tl.min(tl.where(imp == best[:, None], o_j[None, :], BNS), 1)  # lowest index among ties
        take = (o_j[None, :] == first[:, None]) & ((best > float("-inf")) & (i < picks))[:, None]
        chosen = tl.where(take, 1, chosen)
        imp = tl.where(take, float("-inf"), imp)
    return chosen


@triton.jit
def filtered_top(imp, o_j, cur, SCR, row, num_selected, num_init, num_local, NS, BNS: tl.constexpr,
                 NSEL: tl.constexpr, CAP: tl.constexpr, RANK: tl.constexpr):
    """One row's blocks through a candidate filter -> (done, blocks int32 [NSEL] ascending). imp float32
    [BNS] with forced blocks +inf and blocks after `cur` -inf. The NSEL-th largest of the maxima of 32
    groups of the row is a lower bound of the num_selected-th largest importance (NSEL >= num_selected
    groups hold a value at least that large), so every block the row keeps is at or above it. On random
    inputs ~22 of 1,024 blocks are; they are compacted, in index order, into the row's CAP slots of
    SCR (int64 keys ordered like (importance, -index)), and the picks are made among those (RANK: by
    rank, else by arg-max passes; `TOPK_FILTER_PICK`). Not done
    (the caller takes the full pass instead) when the row has at most num_selected blocks, more forced
    blocks than slots, or more than CAP candidates."""
    n_init = tl.minimum(num_init, cur + 1)
    lo_local = tl.maximum(num_init, cur - num_local + 1)  # the first forced local block after the initial
    n_local = tl.maximum(cur - lo_local + 1, 0)
    picks = num_selected - n_init - n_local
    o_s = tl.arange(0, NSEL)
    blocks = tl.zeros([NSEL], tl.int32)
    done = (tl.minimum(cur + 1, NS) > num_selected) & (picks >= 1)
    if done:
        x = tl.where(imp == float("inf"), float("-inf"), imp)  # forced blocks are placed, not picked
        # group maxima: with one warp a thread holds 4 adjacent blocks every 128 (Triton's layout of
        # a float32 row), so the groups are its 32 registers and their maxima need no shuffles
        group_max = tl.max(tl.max(tl.reshape(x, [BNS // 128, 32, 4]), 2), 0)  # [32]
        tau = tl.min(tl.topk(group_max, NSEL), 0)
        cand = (x >= tau) & (x > float("-inf"))
        n_cand = tl.sum(cand.to(tl.int32), 0)
        done = n_cand <= CAP
        if done:
            bits = (x + 0.0).to(tl.int32, bitcast=True).to(tl.int64)  # + 0.0: -0.0 -> +0.0, a tie with 0
            key = (bits << 32) + (BNS - 1 - o_j).to(tl.int64)
            tl.store(SCR + row * CAP + tl.cumsum(cand.to(tl.int32), 0) - 1, key, mask=cand)
            tl.debug_barrier()  # the compacted keys, stored by other threads, before they are read
            o_c = tl.arange(0, CAP)
            key = tl.load(SCR + row * CAP + o_c, mask=o_c < n_cand, other=-1)  # [CAP]
            if RANK:
                # keys are distinct (the index in the low bits), and an empty slot's -1 is below all
                rank = tl.sum((key[None, :] > key[:, None]).to(tl.int32), 1)  # [CAP]
                chosen = ((rank < picks) & (o_c < n_cand)).to(tl.int32)
                slot = tl.cumsum(chosen, 0) - 1  # the chosen ones in index order, as compacted
                blk = BNS - 1 - (key & 0xFFFFFFFF).to(tl.int32)  # [CAP]
                mid = tl.sum(tl.where((slot[None, :] == (o_s - n_init)[:, None]) & (chosen > 0)[None, :],
                                      blk[None, :], 0), 1)  # [NSEL]: slot i of the picks at n_init + i
            else:
                picked = tl.full([NSEL], BNS, tl.int32)
                for i in range(picks):
                    best = tl.max(key, 0)
                    picked = tl.where(o_s == i, BNS - 1 - (best & 0xFFFFFFFF).to(tl.int32), picked)
                    key = tl.where(key == best, -1, key)
                picked = tl.sort(picked)  # ascending, BNS in the empty slots
                mid = tl.gather(picked, tl.minimum(tl.maximum(o_s - n_init, 0), NSEL - 1), 0)
            # initial blocks, the picked ones (all between), the local blocks: ascending
            local = lo_local + o_s - n_init - picks
            blocks = tl.where(o_s < n_init, o_s, tl.where(o_s < n_init + picks, mid, local))
    return done, blocks


@triton.jit
def lean_filtered_top(IMP, OUT, SCR, row, cur, num_selected, num_init, num_local, NS, BNS: tl.constexpr,
                      NSEL: tl.constexpr, CAP: tl.constexpr, CACHE: tl.constexpr):
    """One row's blocks, as `filtered_top` but in fewer instructions -> done (the row is written to
    OUT). It reads only the pickable blocks (after the initial ones, before the local ones), bounds the
    picks-th largest importance (not the NSEL-th) by the group maxima, which leaves ~16 candidates on
    random inputs instead of ~22, and compacts them through a bit mask per lane (`_compact_candidates`)
    into the row's 2 x CAP int32 slots of SCR, where they are ranked (`_rank_and_store`). Not done
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
    HAS_POS: tl.constexpr, BR: tl.constexpr, BNS: tl.constexpr, NSEL: tl.constexpr, METHOD: tl.constexpr,
    CAP: tl.constexpr, RANK: tl.constexpr,
):
    # IMP [N_ROWS, NS] float32 (rows ordered (b, t, h_kv)); OUT [N_ROWS, num_selected] int32.
    # Picks forced blocks, then the largest importances (ties: lower block index), writes the
    # chosen indices ascending, -1 after them. SCR: the filter methods' scratch, [N_ROWS, CAP] int64
    # ("filter") or [N_ROWS, 2, CAP] int32 ("lean").
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)  # [BR]
    m_r = rows < N_ROWS
    if HAS_POS:
        t = tl.load(POS + rows // HKV, mask=m_r, other=0)
    else:
        t = ((rows // HKV) % T).to(tl.int32)
    cur = t // select_size  # block holding t
    if METHOD == "lean":  # BR = 1
        done = lean_filtered_top(IMP, OUT, SCR, tl.sum(rows, 0), tl.sum(cur, 0), num_selected, num_init,
                                 num_local, NS, BNS, NSEL, CAP, "")
        if done == 0:  # the few rows the filter does not take: arg-max passes over the whole row
            _top_of_rows(IMP, OUT, SCR, rows, m_r, cur, NS, num_selected, num_init, num_local, BR, BNS, NSEL,
                         "argmax", CAP, RANK)
    else:
        _top_of_rows(IMP, OUT, SCR, rows, m_r, cur, NS, num_selected, num_init, num_local, BR, BNS, NSEL,
                     METHOD, CAP, RANK)


@triton.jit
def _top_of_rows(IMP, OUT, SCR, rows, m_r, cur, NS, num_selected, num_init, num_local, BR: tl.constexpr,
                 BNS: tl.constexpr, NSEL: tl.constexpr, METHOD: tl.constexpr, CAP: tl.constexpr,
                 RANK: tl.constexpr):
    # the rows [BR] by METHOD ("bitonic", "filter", "radix" or "argmax"), from their whole rows of IMP
    o_j = tl.arange(0, BNS)  # [BNS]
    imp = tl.load(IMP + rows[:, None] * NS + o_j[None, :], mask=m_r[:, None] & (o_j < NS)[None, :],
                  other=0.0)  # [BR, BNS]
    o_s = tl.arange(0, NSEL)
    out_ptrs = OUT + rows[:, None] * num_selected + o_s[None, :]
    if METHOD == "bitonic":
        blk = top_blocks(block_keys(imp, o_j[None, :], cur[:, None], num_init, num_local, BNS), num_selected,
                         BNS, NSEL)  # [BR, NSEL]
        tl.store(out_ptrs, tl.where(blk < BNS, blk, -1), mask=m_r[:, None] & (o_s < num_selected)[None, :])
    else:
        forced = (o_j[None, :] < num_init) | (o_j[None, :] > (cur - num_local)[:, None])
        imp = tl.where(forced, float("inf"), imp)
        imp = tl.where(o_j[None, :] > cur[:, None], float("-inf"), imp)
        forced = forced & (o_j[None, :] <= cur[:, None])
        rest = 1  # whether the row still needs the full pass
        if METHOD == "filter":  # BR = 1
            done, blocks = filtered_top(tl.reshape(imp, [BNS]), o_j, tl.sum(cur, 0), SCR, tl.sum(rows, 0),
                                         num_selected, num_init, num_local, NS, BNS, NSEL, CAP, RANK)
            if done:  # every slot filled (the row has more than num_selected blocks)
                tl.store(OUT + tl.sum(rows, 0) * num_selected + o_s, blocks, mask=o_s < num_selected)
            rest = 1 - done.to(tl.int32)
        if rest > 0:
            if METHOD == "radix":
                # the k-th largest importance by a bitwise search over order-preserving int32 keys (31
                # counting passes instead of k arg-max passes), then every larger one and the
                # lowest-index ties
                k_eff = tl.minimum(tl.sum((imp > float("-inf")).to(tl.int32), 1), num_selected)  # [BR]
                bits = (imp + 0.0).to(tl.int32, bitcast=True)  # + 0.0: -0.0 -> +0.0, a tie with 0
                key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # [BR, BNS] ordered like imp
                tau = tl.where(tl.sum((key >= 0).to(tl.int32), 1) >= k_eff, 0, -2147483648)  # [BR]
                for i in range(31):
                    cand = tau | (1 << (30 - i))
                    tau = tl.where(tl.sum((key >= cand[:, None]).to(tl.int32), 1) >= k_eff, cand, tau)
                gt = key > tau[:, None]
                eq = key == tau[:, None]
                need = k_eff - tl.sum(gt.to(tl.int32), 1)  # [BR] ties to take, lowest index first
                take_eq = eq & (tl.cumsum(eq.to(tl.int32), 1) <= need[:, None])
                chosen = (gt | take_eq).to(tl.int32)
            else:
                chosen = _argmax_chosen(imp, forced, o_j, num_selected, BNS)
            rank = tl.cumsum(chosen, 1) - 1  # [BR, BNS] output slot of each chosen block
            count = tl.sum(chosen, 1)  # [BR]
            tl.store(out_ptrs, tl.full([BR, NSEL], -1, tl.int32),
                     mask=m_r[:, None] & (o_s >= count[:, None]) & (o_s < num_selected)[None, :])
            tl.store(OUT + rows[:, None] * num_selected + rank, o_j[None, :] + tl.zeros([BR, BNS], tl.int32),
                     mask=m_r[:, None] & (chosen > 0))


def filter_fits(bns: int, nsel: int) -> bool:
    """Whether the filter (`filtered_top`) takes rows padded to bns blocks picking nsel (both powers of
    two): its 32 group maxima of 4-block runs must hold nsel candidates at least."""
    return nsel <= 32 and bns >= 128


def lean_fits(bns: int) -> bool:
    """Whether the lean filter (`lean_filtered_top`) takes rows padded to bns blocks: a lane's bit
    mask holds at most 64 of them (rows past that take the filter)."""
    return bns <= 2048


def filter_scratch(rows: int, method: str, device) -> torch.Tensor:
    """The compaction slots of `rows` rows for "filter" (CAP int64 keys a row) or "lean" (2 x CAP
    int32: block indices, then their value bits)."""
    if method == "lean":
        return torch.empty(rows, 2 * TOPK_FILTER_CAP, device=device, dtype=torch.int32)
    return torch.empty(rows, TOPK_FILTER_CAP, device=device, dtype=torch.int64)


def topk_blocks(imp, *, T, num_kv_heads, select_size, num_selected, num_init, num_local, positions=None):
    """imp [N_ROWS, NS] float32 (rows (b, t, h_kv)), importances >= 0 (sums of probabilities: the
    filter and bitonic methods order their bit patterns) -> int32 [N_ROWS, num_selected], ascending,
    -1 padded. `positions` (int32 [N_ROWS // num_kv_heads]) overrides t = row's sequence position."""
    n_rows, ns = imp.shape
    out = torch.empty(n_rows, num_selected, device=imp.device, dtype=torch.int32)
    if n_rows == 0:
        return out
    if TOPK_METHOD not in TOPK_METHODS:
        raise ValueError(f"TOPK_METHOD must be one of {TOPK_METHODS}, got {TOPK_METHOD!r}")
    if TOPK_FILTER_PICK not in TOPK_FILTER_PICKS:
        raise ValueError(f"TOPK_FILTER_PICK must be one of {TOPK_FILTER_PICKS}, got {TOPK_FILTER_PICK!r}")
    NSEL = pow2(num_selected, 2)  # >= 2 for tl.topk
    BNS = max(pow2(ns), NSEL)  # the bitonic top-k takes at most BNS
    BR = max(1, min(TOPK_CONFIG["rows"], 4096 // BNS))
    warps = TOPK_CONFIG["num_warps"]
    if n_rows <= 128 and not interpreting():  # decode: few rows, one per program, 4 warps each
        BR, warps = 1, 4
    method, scratch = TOPK_METHOD, out
    if method == "lean" and not lean_fits(BNS):
        method = "filter"
    if method in ("filter", "lean"):
        if filter_fits(BNS, NSEL):
            BR = 1
            scratch = filter_scratch(n_rows, method, imp.device)
        else:
            method = "argmax"
    launch = dict(num_warps=warps)
    if method == "lean" and TOPK_LEAN_MAXNREG and not interpreting():
        launch["maxnreg"] = TOPK_LEAN_MAXNREG
    launcher(_topk_blocks_kernel)[(cdiv(n_rows, BR),)](
        imp, positions if positions is not None else imp, out, scratch, n_rows, ns, T, num_kv_heads,
        select_size, num_selected, num_init, num_local, HAS_POS=positions is not None, BR=BR, BNS=BNS,
        NSEL=NSEL, METHOD=method, CAP=TOPK_FILTER_CAP, RANK=TOPK_FILTER_PICK == "rank", **launch,
    )
    return out
