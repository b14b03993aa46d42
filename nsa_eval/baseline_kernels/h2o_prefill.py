"""H2O's sparse prefill as one walk over the queries per query head, O(T x budget) instead of O(T x S).

The controller's reference (`AttentionController._select_stateful`) gives each query past the budget
a `torch.topk` over all S keys' masses. Because a candidate that a query does not keep is evicted for
good (its mass zeroed), the keys a query may keep are at most `budget` at any time: the `sink` leading
keys, the `local` most recent ones and `picks = budget - sink - local` heavy hitters. Query t (the
first sparse one is `t = budget`, the queries before it attend densely) then does exactly this:

1. the pool (the keys query t - 1 kept) holds sink, the local window `t - local .. t - 1` and the
   heavy hitters: `budget` keys. Key `t - local` has just left the local window: the candidates are
   the pool's keys in `[sink, t - local]`, `picks + 1` of them;
2. the candidate with the smallest mass (the mass that the queries before t left) is evicted: its
   mass drops to zero and it never comes back; key t takes its place in the pool;
3. query t attends to the pool (`budget` keys: sink, `t - local + 1 .. t` and the `picks` heavy
   hitters) and adds its probabilities to their masses.

That is the reference's rule wherever the candidates' masses differ and none is zero: the reference
keeps the `picks` largest of the candidates' masses, all other candidates (evicted before) having
mass zero. Ties: among equal masses this walk evicts the oldest key (the lowest position);
`torch.topk`'s order among equal masses is unspecified, and where a candidate's mass is exactly zero
(an underflowed probability) the reference may keep an evicted key (also zero) in its place, which
this walk never does.

Shapes (unpadded batch, no cached keys before the prompt): query `[B, Hq, T, D]`, key/value
`[B, Hkv, T, D]`, `Hq = G * Hkv` and query head h reads KV head `h // G`; the mass `[B, Hq, T]`
float32 (the dense queries' sums on entry, the reference's final state on return); the output
`[B, Hq, T, Dv]` (rows `budget ..` written); the evictions `[B, Hq, T]` int32: the query at which
each key left the pool (T for a key never evicted), from which each query's keys follow
(`keep_from_evictions`).

`h2o_sparse_prefill_reference` is the walk in PyTorch, one step per query (the Triton kernel's
reference, and a readable statement of the rule). `h2o_sparse_prefill` is the Triton kernel. Only the
choice of each step's victim is sequential, and it needs few keys: masses only grow while a key stays
in the pool, so a block of `BT` queries evicts from the candidates with the smallest masses as the block
starts. One program per (sequence, query head) walks its queries in blocks:

- select: the frontier, the `W` candidates of least (mass, position) as the block starts (a threshold
  found by a search warm-started at the previous block's), the keys that become candidates during the
  block (`t - local`), and the block's own keys where they can become candidates within it (`BT > local`);
- A (parallel, tensor cores): the block's logits against the pool; each row's max `m` and `zsafe`, the
  sum of `exp(s - m)` over the keys that stay all block (the pool's outside the frontier, the block's
  own), and the frontier's `exp(s - m)` (a product with its gathered keys) to a `[BT, FW]` scratch;
- B (sequential, over the frontier only): per query one reduction: the victim (mass, position and
  frontier slot packed in one int64) and the sum of the row's other frontier values, so the query's
  normaliser `zsafe + that sum` and the frontier's new masses follow. Every warp holds the whole
  frontier (`FW <= 128` slots), so the reduction needs no shared memory and no barrier;
- C (parallel, tensor cores): the outputs `P @ V` and every pool key's new mass (its column sum of P),
  P recomputed from the logits, `m` and the normalisers, keys as rows so a column sum stays in a warp.

B is exact as long as no key outside the frontier would have been the victim. It checks each step:
the victim must come before the least (mass, position) outside the frontier as the block started (those
masses only grow since). A step that fails ends the block early (its query starts the next block, with
a new frontier), so the walk evicts exactly what the reference does, only slower on such blocks.
B * Hq programs run at once (32 for a 1B Llama at batch 1); a step costs one warp's reduction over the
frontier, not a pass over `budget` keys.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from nsa_eval.kernels._triton_utils import LOG2E, dot, interpreting, launcher, pow2

# Launch constants (not yet measured on a GPU; `tests/methods/test_h2o_fast.py::test_gpu_launch_sweep`
# prints the sweep): queries per block (the logits and outputs of a block are tile products), pool slots
# per tile of phases A and C, least-mass candidates in the frontier (W: W + 64 = 128 slots, the most a
# warp holds at 4 per lane), warps.
BLOCK_QUERIES = 64
BLOCK_KEYS = 64
FRONTIER = 64
NUM_WARPS = 4
KEY_BITS = 20  # a (mass, position) pair packs the position in the low 20 bits: T <= 2**20
SLOT_BITS = 12  # B's packed victim adds the frontier slot below: FW <= 2**12
_NEVER = tl.constexpr(2**63 - 1)  # above every packed value: no candidate


# ----------------------------------------------------------------------------------------------------------
# The reference: the same walk in PyTorch, one query at a time
# ----------------------------------------------------------------------------------------------------------


def h2o_sparse_prefill_reference(query: Tensor, key: Tensor, value: Tensor, mass: Tensor, out: Tensor,
                                 scaling: float, sink: int, local: int, budget: int) -> Tensor:
    """H2O's queries `budget .. T - 1`, one step each, over the pool of `budget` keys (module docstring).

    Args:
        query: `[B, Hq, T, D]`; key, value: `[B, Hkv, T, D|Dv]` (the whole unpadded sequence).
        mass: `[B, Hq, T]` float32, updated in place: on entry the masses that queries `0 .. budget - 1`
            left (dense); on return zero for every evicted key, the accumulated mass for the rest.
        out: `[B, Hq, T, Dv]`: rows `budget ..` are written (in its dtype).
        scaling: the softmax scale; sink, local, budget: the budget settings (`budget >= sink + local`).

    Returns:
        evictions `[B, Hq, T]` int32: the query at which each key was evicted, T for none.
    """
    B, Hq, T, D = query.shape
    G = Hq // key.shape[1]
    k = key.float().repeat_interleave(G, dim=1)  # [B, Hq, T, D]
    v = value.float().repeat_interleave(G, dim=1)  # [B, Hq, T, Dv]
    pool = torch.arange(budget, device=query.device).expand(B, Hq, budget).clone()  # [B, Hq, budget] keys
    pool_mass = mass[..., :budget].clone()  # [B, Hq, budget]
    evictions = torch.full((B, Hq, T), T, dtype=torch.int32, device=query.device)
    for t in range(budget, T):
        candidate = (pool >= sink) & (pool <= t - local)  # [B, Hq, budget]
        # the smallest mass, and among equal masses the oldest key
        least = pool_mass.masked_fill(~candidate, math.inf).amin(-1, keepdim=True)  # [B, Hq, 1]
        victim = pool.masked_fill(~candidate | (pool_mass != least), T).amin(-1, keepdim=True)  # [B, Hq, 1]
        evictions.scatter_(-1, victim, t)
        hit = pool == victim  # [B, Hq, budget]
        pool = torch.where(hit, t, pool)
        pool_mass = pool_mass.masked_fill(hit, 0.0)
        index = pool[..., None]  # [B, Hq, budget, 1]
        kp = k.gather(2, index.expand(-1, -1, -1, D))  # [B, Hq, budget, D]
        vp = v.gather(2, index.expand(-1, -1, -1, v.shape[-1]))  # [B, Hq, budget, Dv]
        logits = (kp @ query[:, :, t, :, None].float())[..., 0] * scaling  # [B, Hq, budget]
        p = torch.softmax(logits, dim=-1)  # [B, Hq, budget]
        pool_mass += p
        out[:, :, t] = (p[:, :, None] @ vp)[:, :, 0].to(out.dtype)  # [B, Hq, Dv]
    mass.zero_()
    mass.scatter_(-1, pool, pool_mass)
    return evictions


def keep_from_evictions(evictions: Tensor, sink: int, local: int, budget: int) -> Tensor:
    """The keys each query attended to, `[B, Hq, T, T]` bool, from `evictions` `[B, Hq, T]` (small T only).

    Query t < budget sees keys `0 .. t`; a later one keeps sink, `t - local + 1 .. t` and the keys in
    between that it has not evicted yet (a key evicted at query e is kept by the queries before e).
    """
    B, Hq, T = evictions.shape
    t = torch.arange(T, device=evictions.device)[:, None]  # [T, 1] queries
    s = torch.arange(T, device=evictions.device)[None, :]  # [1, T] keys
    visible = s <= t  # [T, T]
    forced = (s < sink) | (s > t - local) | (t < budget)  # [T, T]
    kept = t[None, None] < evictions[:, :, None, :].long()  # [B, Hq, T, T]
    return visible & (forced | kept)


def kv_read_from_evictions(evictions: Tensor, groups: int, sink: int, local: int, budget: int) -> Tensor:
    """KV tokens read per KV head by queries `budget .. T - 1`: `[B, Hkv, T - budget]` int32.

    The union over a group's G heads: sink, local and the keys in between that some head still keeps.
    Key s (`sink <= s`) is a candidate of queries `max(s + local, budget) ..` and kept by a head until
    the query that evicts it, so it counts for queries `start(s) .. max_g evictions - 1`.
    evictions: `[B, Hq, T]` int32 (`h2o_sparse_prefill`).
    """
    B, Hq, T = evictions.shape
    last = evictions.view(B, Hq // groups, groups, T).amax(2).long()  # [B, Hkv, T] the group's last query
    s = torch.arange(T, device=evictions.device)
    first = (s + local).clamp_min(budget).expand_as(last)  # [B, Hkv, T] first query it is a candidate of
    counted = (s >= sink) & (first < last)  # [B, Hkv, T]
    delta = torch.zeros(*last.shape[:2], T + 1, dtype=torch.int64, device=evictions.device)  # by query
    delta.scatter_add_(-1, first.clamp_max(T), counted.long())
    delta.scatter_add_(-1, last.clamp_max(T), -counted.long())
    heavy = delta.cumsum(-1)[..., budget:T]  # [B, Hkv, T - budget]
    return (heavy + sink + local).int()


# ----------------------------------------------------------------------------------------------------------
# The Triton kernel
# ----------------------------------------------------------------------------------------------------------

_KEY_BITS = tl.constexpr(KEY_BITS)
_SLOT_BITS = tl.constexpr(SLOT_BITS)
_KEY_MASK = tl.constexpr(2**KEY_BITS - 1)
_SLOT_MASK = tl.constexpr(2**SLOT_BITS - 1)
_ONE = tl.constexpr(0x3F800000 << KEY_BITS)  # mass 1.0 (the mean mass after the dense queries), position 0
_STEP = tl.constexpr(1 << (KEY_BITS + 16))  # the search's first step: 1/128 of a mass's octave
_STEP_MAX = tl.constexpr(1 << 61)


@triton.jit
def _load_rows(base, rows, m_rows, stride, o_d, DIM: tl.constexpr, UPCAST: tl.constexpr):
    # rows `rows` [R] of a [T, DIM] head (unit stride in DIM), rows where m_rows is false as 0: [R, BD]
    x = tl.load(base + rows[:, None].to(tl.int64) * stride + o_d[None, :],
                mask=m_rows[:, None] & (o_d < DIM)[None, :], other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _frontier_bound(outside, packed, tau, W: tl.constexpr):
    # A bound with at most W of the candidates `outside` [NS] below it in packed (mass, position) order
    # `packed` [NS], and at least W // 2 where there are more than W: a galloping search from the previous
    # block's bound `tau` (masses drift slowly from block to block), then bisection. Returns (the bound,
    # the next block's start tau); the bound is above everything where W candidates or fewer remain.
    bound = tau * 0 + _NEVER
    total = tl.sum(outside.to(tl.int32), 0)
    if total > W:
        lo = tau * 0  # count(packed < lo) <= W < count(packed < hi)
        hi = bound
        probe = tau
        step = tau * 0 + _STEP
        go = total > W
        while go:
            count = tl.sum((outside & (packed < probe)).to(tl.int32), 0)
            over = count > W
            hi = tl.where(over, probe, hi)
            lo = tl.where(over, lo, probe)
            go = (over | (count < W // 2)) & (hi - lo > 1)
            gallop = tl.where(over, probe - step, probe + step)
            probe = tl.where((gallop > lo) & (gallop < hi), gallop, lo + (hi - lo) // 2)
            step = tl.minimum(step * 2, _STEP_MAX)
        bound = lo
        tau = lo
    return bound, tau


@triton.jit
def _victim_and_rest(least_a, row_a, rest_a, least_b, row_b, rest_b):
    # combines two (least packed, its row value, the sum of the other row values): the victim and, exactly
    # (no cancellation), what the row keeps without it
    a_wins = least_a < least_b
    least = tl.where(a_wins, least_a, least_b)
    row = tl.where(a_wins, row_a, row_b)
    rest = rest_a + rest_b + tl.where(a_wins, row_b, row_a)
    return least, row, rest


@triton.jit
def _select_frontier(pkey_p, pmass_p, fslot_p, fkey_p, fmass_p, fpos_p, books_p, b0, n, tau,
                     SINK: tl.constexpr, LOCAL: tl.constexpr, NS: tl.constexpr, BT: tl.constexpr,
                     W: tl.constexpr):
    # The block's frontier: the pool's candidates below the bound and the keys that become candidates
    # in the block, compacted to FSLOT (pool slots), FKEY and FMASS (their keys and masses: B and A read
    # them as rows, not gathers) and FPOS; its books reset. Returns (the least packed (mass, key)
    # outside it, its pool slots, the next search start).
    slot = tl.arange(0, NS)
    key = tl.load(pkey_p + slot)  # [NS]
    mass = tl.load(pmass_p + slot)
    packed = (mass.to(tl.int32, bitcast=True).to(tl.int64) << _KEY_BITS) | tl.maximum(key, 0).to(tl.int64)
    candidate = key >= SINK
    outside = candidate & (key < b0 - LOCAL)
    entering = candidate & (key >= b0 - LOCAL) & (key < b0 + n - LOCAL)
    bound, tau = _frontier_bound(outside, packed, tau, W)
    chosen = outside & (packed < bound)
    least_out = tl.min(tl.where(outside & ~chosen, packed, _NEVER), 0)
    front = chosen | entering
    pos = tl.cumsum(front.to(tl.int32), 0) - 1
    tl.store(fslot_p + pos, slot, mask=front)
    tl.store(fkey_p + pos, key, mask=front)
    tl.store(fmass_p + pos, mass, mask=front)
    tl.store(fpos_p + slot, tl.where(front, pos, -1))
    tl.store(books_p + slot, BT)
    tl.store(books_p + NS + tl.arange(0, BT), BT)
    return least_out, tl.sum(front.to(tl.int32), 0), tau


@triton.jit
def _block_logits(q, k_base, sk_t, pkey_p, fpos_p, fkey_p, ef_p, zr_p, b0, n, n_front, scale_log2,
                  BUDGET: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, FW: tl.constexpr,
                  POOL_F: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, OWN_IN_FRONT: tl.constexpr,
                  UPCAST: tl.constexpr):
    # A: the block's logits (log2 units) against the pool and its own keys. Each row's max m [BT] is
    # returned; zsafe (the sum of exp2(s - m) over the keys that stay all block: the pool's outside the
    # frontier, and the block's own unless OWN_IN_FRONT) goes to ZR, the frontier's exp2(s - m) to EF
    o_t = tl.arange(0, BT)
    o_n = tl.arange(0, BN)
    o_d = tl.arange(0, BD)
    m_rows = o_t < n
    m_i = tl.full([BT], float("-inf"), tl.float32)
    l_i = tl.zeros([BT], tl.float32)
    for n0 in range(0, BUDGET, BN):
        cols = n0 + o_n
        kk = tl.load(pkey_p + cols, mask=cols < BUDGET, other=0)  # [BN]: every slot below BUDGET holds a key
        outside = tl.load(fpos_p + cols, mask=cols < BUDGET, other=0) < 0
        k = _load_rows(k_base, kk, cols < BUDGET, sk_t, o_d, D, UPCAST)  # [BN, BD]
        s = dot(q, tl.trans(k))  # [BT, BN]; rows past the block's (q = 0) stay finite and unused
        if BUDGET % BN != 0:
            s = tl.where((cols < BUDGET)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)  # scale_log2 > 0: the max of the products
        e = tl.exp2(s * scale_log2 - m_new[:, None])
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.where(outside[None, :], e, 0.0), 1)
        m_i = m_new
    k = _load_rows(k_base, b0 + o_t, m_rows, sk_t, o_d, D, UPCAST)  # [BT, BD]
    s = tl.where(o_t[None, :] <= o_t[:, None], dot(q, tl.trans(k)), float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
    l_i = l_i * tl.exp2(m_i - m_new)
    if not OWN_IN_FRONT:
        l_i += tl.sum(tl.exp2(s * scale_log2 - m_new[:, None]), 1)
    tl.store(zr_p + o_t, l_i)
    # the frontier's keys gathered (the block's own, where in it, from their own row on)
    o_f = tl.arange(0, FW)
    fkey = tl.load(fkey_p + o_f, mask=o_f < n_front, other=-1)  # [FW]
    if OWN_IN_FRONT:
        fkey = tl.where((o_f >= POOL_F) & (o_f < POOL_F + n), b0 + o_f - POOL_F, fkey)
    k = _load_rows(k_base, fkey, fkey >= 0, sk_t, o_d, D, UPCAST)  # [FW, BD]
    s = dot(q, tl.trans(k))  # [BT, FW]
    seen = m_rows[:, None] & (fkey >= 0)[None, :] & (fkey[None, :] <= b0 + o_t[:, None])
    tl.store(ef_p + o_t[:, None] * FW + o_f[None, :],
             tl.exp2(tl.where(seen, s * scale_log2 - m_new[:, None], float("-inf"))))
    return m_new


@triton.jit
def _walk_block(fkey_p, fmass_p, ef_p, zr_p, books_p, ev_ptr, mass_ptr, b0, n, n_front, least_out,
                SINK: tl.constexpr, LOCAL: tl.constexpr, NS: tl.constexpr, BT: tl.constexpr,
                FW: tl.constexpr, POOL_F: tl.constexpr, OWN_IN_FRONT: tl.constexpr, NW: tl.constexpr):
    # B: one step per query over the frontier, until a step could have evicted a key outside it. Returns
    # the steps done; writes the evictions, each step's normaliser (ZR) and frontier victim (BOOKS). Every
    # warp holds the whole frontier ([NW, FW], one row per warp, FW = 32 x 4 slots or fewer), so a step's
    # one reduction stays within a warp: no shared memory, no barrier; warp 0 writes the books
    o_w = tl.arange(0, NW)[:, None]
    o_f = tl.arange(0, FW)[None, :] + 0 * o_w  # [NW, FW]
    c = o_f - POOL_F
    fkey = tl.load(fkey_p + o_f, mask=o_f < n_front, other=-1)
    if OWN_IN_FRONT:  # the block's keys, from their own step on
        fkey = tl.where((c >= 0) & (c < n), b0 + c, fkey)
    fmass = tl.load(fmass_p + o_f, mask=o_f < n_front, other=0.0)
    alive = fkey >= 0
    row = tl.load(ef_p + o_f)
    live = o_w >= 0  # [NW, 1]: no step has failed yet
    # the books, kept in the frontier's own layout until the block ends (frontier slot i: step i)
    victim = o_f * 0
    victim_key = o_f * 0 - 1
    norm = row * 0.0
    for i in range(0, n):
        t = b0 + i
        next_row = tl.load(ef_p + (i + 1) * FW + o_f, mask=i + 1 < n, other=0.0)  # for the next step
        present = alive & ((fkey < b0) | (fkey <= t))
        victims = present & (fkey >= SINK) & (fkey <= t - LOCAL)
        # mass >= 0, so its bits order as the floats do: the smallest mass, then the oldest key
        packed = (fmass.to(tl.int32, bitcast=True).to(tl.int64) << 32) | \
            (fkey.to(tl.int64) << _SLOT_BITS) | o_f
        row_p = tl.where(present, row, 0.0)
        least, _, rest = tl.reduce((tl.where(victims, packed, _NEVER), row_p, tl.zeros_like(row_p)), 1,
                                   _victim_and_rest)
        least = least[:, None]
        live = live & ((least >> _SLOT_BITS) < least_out)
        fv = (least & _SLOT_MASK).to(tl.int32)  # [NW, 1]
        z = tl.load(zr_p + i) + rest[:, None]
        hit = (o_f == fv) & live
        stay = present & ~hit & live
        fmass = tl.where(stay, fmass + row * (1.0 / z), tl.where(hit, 0.0, fmass))
        alive = alive & ~hit
        step = (o_f == i) & live
        victim = tl.where(step, fv, victim)
        victim_key = tl.where(step, ((least >> _SLOT_BITS) & _KEY_MASK).to(tl.int32), victim_key)
        norm = tl.where(step, z, norm)
        row = next_row
    done = tl.sum(((o_w == 0) & (victim_key >= 0)).to(tl.int32))
    books = (o_w == 0) & (o_f < done)
    tl.store(ev_ptr + victim_key, b0 + o_f, mask=books)
    tl.store(mass_ptr + victim_key, 0.0, mask=books)
    tl.store(zr_p + BT + o_f, norm, mask=books)  # beside zsafe: a warp still in the loop reads that
    tl.store(books_p + NS + BT + o_f, victim, mask=books)
    return done


@triton.jit
def _block_books(fslot_p, books_p, done, NS: tl.constexpr, BT: tl.constexpr, LOCAL: tl.constexpr,
                 POOL_F: tl.constexpr):
    # After B: key b0 + i takes the pool slot of step i's victim (FSLOT[POOL_F + i]); BOOKS gets the step
    # at which each pool slot's key and each block key was evicted
    o_t = tl.arange(0, BT)
    victim = tl.load(books_p + NS + BT + o_t, mask=o_t < done, other=0)  # [BT] frontier slots
    if BT > LOCAL:  # a block's key can be a victim in its own block, passing on the slot it took
        for j in range(0, done):
            tl.store(fslot_p + POOL_F + j, tl.load(fslot_p + tl.load(books_p + NS + BT + j)))
            tl.debug_barrier()
    else:
        tl.store(fslot_p + POOL_F + o_t, tl.load(fslot_p + victim), mask=o_t < done)
    tl.debug_barrier()
    from_pool = victim < POOL_F
    tl.store(books_p + tl.load(fslot_p + victim), o_t, mask=(o_t < done) & from_pool)
    tl.store(books_p + NS + victim - POOL_F, o_t, mask=(o_t < done) & ~from_pool)


@triton.jit
def _block_outputs(q, m_i, k_base, v_base, o_base, sk_t, sv_t, so_t, pkey_p, pmass_p, books_p, zr_p, b0, n,
                   done, O, scale_log2, BUDGET: tl.constexpr, NS: tl.constexpr, BT: tl.constexpr,
                   BN: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
                   UPCAST: tl.constexpr):
    # C: outputs of rows < done, and every pool key's mass gains its column's sum. Pool column j holds
    # until its key's eviction step BOOKS[j], the block's key c from row c until BOOKS[NS + c]. Returns the
    # block keys' column sums [BT]
    o_t = tl.arange(0, BT)
    o_n = tl.arange(0, BN)
    o_d = tl.arange(0, BD)
    o_dv = tl.arange(0, BDV)
    rows = b0 + o_t
    # p = exp2(s * scale - m - log2 z): the normaliser in the exponent; none past the steps done
    z = tl.load(zr_p + BT + o_t, mask=o_t < done, other=1.0)
    shift = tl.where(o_t < done, m_i + tl.log2(z), float("inf"))  # [BT]
    acc = tl.zeros([BT, BDV], tl.float32)
    for n0 in range(0, BUDGET, BN):
        cols = n0 + o_n
        kk = tl.load(pkey_p + cols, mask=cols < BUDGET, other=0)  # [BN]
        until = tl.load(books_p + cols, mask=cols < BUDGET, other=0)
        k = _load_rows(k_base, kk, cols < BUDGET, sk_t, o_d, D, UPCAST)  # [BN, BD]
        # keys as rows: a key's column sum stays within a warp (queries as rows spread it over the warps)
        s = dot(k, tl.trans(q))  # [BN, BT]
        p = tl.exp2(tl.where(o_t[None, :] < until[:, None], s * scale_log2 - shift[None, :], float("-inf")))
        v = _load_rows(v_base, kk, cols < BUDGET, sv_t, o_dv, DV, UPCAST)  # [BN, BDV]
        acc += dot(tl.trans(p).to(v.dtype), v)
        stays = (cols < BUDGET) & (until >= done)
        column_mass = tl.load(pmass_p + cols, mask=stays, other=0.0) + tl.sum(p, 1)
        tl.store(pmass_p + cols, column_mass, mask=stays)
    k = _load_rows(k_base, rows, o_t < n, sk_t, o_d, D, UPCAST)  # [BT, BD]
    s = dot(q, tl.trans(k))
    until = tl.load(books_p + NS + o_t)  # [BT] (as columns)
    keep = (o_t[None, :] <= o_t[:, None]) & (o_t[:, None] < until[None, :])
    p = tl.exp2(tl.where(keep, s * scale_log2 - shift[:, None], float("-inf")))
    v = _load_rows(v_base, rows, o_t < n, sv_t, o_dv, DV, UPCAST)
    acc += dot(p.to(v.dtype), v)
    tl.store(o_base + rows[:, None].to(tl.int64) * so_t + o_dv[None, :], acc.to(O.dtype.element_ty),
             mask=(o_t < done)[:, None] & (o_dv < DV)[None, :])
    return tl.sum(p, 0)


@triton.jit
def _h2o_walk_kernel(
    Q, K, V, O, MASS, EV, PKEY, PMASS, FSLOT, FKEY, FMASS, FPOS, BOOKS, EF, ZR, BLOCKS,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, so_b, so_h, so_t,
    T, HQ, G, scale_log2,
    SINK: tl.constexpr, LOCAL: tl.constexpr, BUDGET: tl.constexpr, NS: tl.constexpr, BT: tl.constexpr,
    BN: tl.constexpr, W: tl.constexpr, FW: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr,
    BDV: tl.constexpr, NW: tl.constexpr, UPCAST: tl.constexpr,
):
    # One program per (sequence, query head) walks queries BUDGET .. T - 1 in blocks of at most BT. Its
    # scratch (global, contiguous per program): the pool, slot -> key PKEY [NS] int32 (-1: unused) and
    # mass PMASS [NS]; the frontier, frontier slot -> pool slot FSLOT [W + 2 BT] (from W + BT on: the
    # pool slot each block key takes), the keys FKEY and masses FMASS [W + 2 BT] of its slots as the
    # block starts, and pool slot -> frontier slot FPOS [NS] (-1: outside); BOOKS
    # [NS + 2 BT] int32, the step at which each pool slot's key, then each block key, was evicted (BT: not
    # in this block), then the frontier slot evicted at each step; EF [BT, FW] float32, the frontier's
    # exp2(s - m) per row; ZR [2 BT], zsafe, then each query's normaliser. BLOCKS [B * Hq] int32 receives
    # the number of blocks. Frontier slots: [0, W + BT) the pool's (at most W) least-mass candidates and
    # the keys that become candidates during the block (compacted), then where BT > LOCAL (the block's
    # keys can become candidates in their own block) [W + BT, W + 2 BT) the block's keys b0 + c; the rest
    # (up to FW, a power of two) unused.
    i_bh = tl.program_id(0)
    i_b = (i_bh // HQ).to(tl.int64)
    i_h = i_bh % HQ
    i_hk = i_h // G
    POOL_F: tl.constexpr = W + BT
    OWN_IN_FRONT: tl.constexpr = BT > LOCAL
    q_base = Q + i_b * sq_b + i_h * sq_h
    k_base = K + i_b * sk_b + i_hk * sk_h
    v_base = V + i_b * sv_b + i_hk * sv_h
    o_base = O + i_b * so_b + i_h * so_h
    mass_ptr = MASS + i_bh.to(tl.int64) * T
    ev_ptr = EV + i_bh.to(tl.int64) * T
    pkey_p = PKEY + i_bh.to(tl.int64) * NS
    pmass_p = PMASS + i_bh.to(tl.int64) * NS
    fslot_p = FSLOT + i_bh.to(tl.int64) * (POOL_F + BT)
    fpos_p = FPOS + i_bh.to(tl.int64) * NS
    fkey_p = FKEY + i_bh.to(tl.int64) * (POOL_F + BT)
    fmass_p = FMASS + i_bh.to(tl.int64) * (POOL_F + BT)
    books_p = BOOKS + i_bh.to(tl.int64) * (NS + 2 * BT)
    ef_p = EF + i_bh.to(tl.int64) * (BT * FW)
    zr_p = ZR + i_bh.to(tl.int64) * (2 * BT)
    slot = tl.arange(0, NS)
    o_t = tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    # the pool before query BUDGET: every key so far, with the dense queries' masses
    tl.store(pkey_p + slot, tl.where(slot < BUDGET, slot, -1))
    tl.store(pmass_p + slot, tl.load(mass_ptr + slot, mask=slot < BUDGET, other=0.0))
    tl.debug_barrier()
    tau = (T * 0).to(tl.int64) + _ONE
    b0 = T * 0 + BUDGET
    blocks = T * 0
    stuck = T * 0
    while b0 < T:
        n = tl.minimum(T - b0, BT)
        least_out, n_front, tau = _select_frontier(pkey_p, pmass_p, fslot_p, fkey_p, fmass_p, fpos_p, books_p,
                                                   b0, n, tau, SINK, LOCAL, NS, BT, W)
        tl.debug_barrier()  # A reads the frontier's positions
        q = _load_rows(q_base, b0 + o_t, o_t < n, sq_t, o_d, D, UPCAST)  # [BT, BD]
        m_i = _block_logits(q, k_base, sk_t, pkey_p, fpos_p, fkey_p, ef_p, zr_p, b0, n, n_front, scale_log2,
                            BUDGET, BT, BN, FW, POOL_F, D, BD, OWN_IN_FRONT, UPCAST)
        tl.debug_barrier()  # B reads the frontier's rows, written by every thread
        done = _walk_block(fkey_p, fmass_p, ef_p, zr_p, books_p, ev_ptr, mass_ptr, b0, n, n_front,
                           least_out, SINK, LOCAL, NS, BT, FW, POOL_F, OWN_IN_FRONT, NW)
        tl.debug_barrier()  # the books read B's, written by single threads
        _block_books(fslot_p, books_p, done, NS, BT, LOCAL, POOL_F)
        tl.debug_barrier()
        column_mass = _block_outputs(q, m_i, k_base, v_base, o_base, sk_t, sv_t, so_t, pkey_p, pmass_p,
                                     books_p, zr_p, b0, n, done, O, scale_log2, BUDGET, NS, BT, BN, D, DV, BD,
                                     BDV, UPCAST)
        tl.debug_barrier()  # C's pool reads come before the block's keys take their slots
        takes = (o_t < done) & (tl.load(books_p + NS + o_t) >= done)
        new_slot = tl.load(fslot_p + POOL_F + o_t, mask=takes, other=0)
        tl.store(pkey_p + new_slot, b0 + o_t, mask=takes)
        tl.store(pmass_p + new_slot, column_mass, mask=takes)
        tl.debug_barrier()
        # a block's first step always passes its check (the frontier holds the least candidates); were
        # it ever not to, skip the query rather than loop for good, and say so in BLOCKS (negative)
        stuck = tl.where(done == 0, 1, stuck)
        b0 += tl.maximum(done, 1)
        blocks += 1
    tl.store(BLOCKS + i_bh, tl.where(stuck == 0, blocks, -blocks))
    key = tl.load(pkey_p + slot)
    tl.store(mass_ptr + key, tl.load(pmass_p + slot), mask=key >= 0)


def h2o_sparse_prefill(query: Tensor, key: Tensor, value: Tensor, mass: Tensor, out: Tensor, scaling: float,
                       sink: int, local: int, budget: int, *, block_queries: int | None = None,
                       block_keys: int | None = None, frontier: int = FRONTIER, num_warps: int = NUM_WARPS,
                       blocks: Tensor | None = None) -> Tensor:
    """`h2o_sparse_prefill_reference` in one Triton launch: same arguments, same result up to rounding.

    Args:
        query: `[B, Hq, T, D]`; key, value: `[B, Hkv, T, D|Dv]`, CUDA (or CPU under TRITON_INTERPRET=1).
        mass: `[B, Hq, T]` float32 contiguous, updated in place (see the reference).
        out: `[B, Hq, T, Dv]` with unit stride in Dv: rows `budget ..` are written.
        block_queries, block_keys: queries per block and pool slots per tile (powers of two, >= 16;
            default `BLOCK_QUERIES`, `BLOCK_KEYS`, 16 under Triton's interpreter).
        frontier: least-mass candidates in each block's frontier (>= 2); it holds `block_queries` more
            slots (the keys entering candidacy), twice that where `block_queries > local`. A frontier of
            128 slots or fewer keeps each step's reduction within a warp.
        blocks: optional `[B, Hq]` int32, receives the number of blocks each (sequence, head) walked: more
            than `ceil((T - budget) / block_queries)` where blocks ended early (a short frontier);
            negative where a block could not take a step (never, by the frontier's construction).

    Returns:
        evictions `[B, Hq, T]` int32 (T for a key never evicted).
    """
    from nsa_eval.kernels import _validate

    _validate.check_installed_triton()
    B, Hq, T, D = query.shape
    Hkv, DV = key.shape[1], value.shape[-1]
    if T <= budget or not budget >= sink + local >= 1 or mass.shape != (B, Hq, T) or out.stride(-1) != 1:
        raise ValueError(f"h2o_sparse_prefill: needs T > budget >= sink + local >= 1 and mass [B, Hq, T] "
                         f"(T={T}, budget={budget}, sink={sink}, local={local}, mass {tuple(mass.shape)})")
    if mass.dtype != torch.float32 or not mass.is_contiguous():
        raise ValueError("h2o_sparse_prefill: mass must be float32 and contiguous")
    # the frontier: W least-mass candidates, the keys entering candidacy, and the block's own keys where
    # they can become candidates in their own block
    if block_queries is None:
        block_queries = 16 if interpreting() else BLOCK_QUERIES
    if block_keys is None:
        block_keys = 16 if interpreting() else BLOCK_KEYS
    own = block_queries if block_queries > local else 0
    slots, width = pow2(budget, block_keys), pow2(frontier + block_queries + own)
    if T > 2**KEY_BITS or frontier < 2 or width > 2**SLOT_BITS:
        raise ValueError(f"h2o_sparse_prefill: needs T <= {2**KEY_BITS} and 2 <= frontier <= "
                         f"{2**SLOT_BITS - block_queries - own} (T={T}, frontier={frontier})")
    query, key, value = (x if x.stride(-1) == 1 else x.contiguous() for x in (query, key, value))
    evictions = torch.full((B, Hq, T), T, dtype=torch.int32, device=query.device)
    programs, dev = B * Hq, query.device
    pool_key = torch.empty(programs, slots, dtype=torch.int32, device=dev)
    pool_mass = torch.empty(programs, slots, dtype=torch.float32, device=dev)
    frontier_slot = torch.empty(programs, frontier + 2 * block_queries, dtype=torch.int32, device=dev)
    frontier_key = torch.empty(programs, frontier + 2 * block_queries, dtype=torch.int32, device=dev)
    frontier_mass = torch.empty(programs, frontier + 2 * block_queries, dtype=torch.float32, device=dev)
    frontier_pos = torch.empty(programs, slots, dtype=torch.int32, device=dev)
    books = torch.empty(programs, slots + 2 * block_queries, dtype=torch.int32, device=dev)
    frontier_exp = torch.empty(programs, block_queries, width, dtype=torch.float32, device=dev)
    norm = torch.empty(programs, 2 * block_queries, dtype=torch.float32, device=dev)
    if blocks is None:
        blocks = torch.empty(B, Hq, dtype=torch.int32, device=dev)
    launcher(_h2o_walk_kernel)[(programs,)](
        query, key, value, out, mass, evictions, pool_key, pool_mass, frontier_slot, frontier_key,
        frontier_mass, frontier_pos, books, frontier_exp, norm, blocks,
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), out.stride(0), out.stride(1), out.stride(2),
        T, Hq, Hq // Hkv, scaling * LOG2E,
        SINK=sink, LOCAL=local, BUDGET=budget, NS=slots, BT=block_queries, BN=block_keys, W=frontier,
        FW=width, D=D, DV=DV, BD=pow2(D), BDV=pow2(DV), NW=1 if interpreting() else num_warps,
        UPCAST=interpreting(),
        num_warps=num_warps,
    )
    return evictions
