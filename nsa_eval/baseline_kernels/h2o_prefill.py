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
reference, and a readable statement of the rule). `h2o_sparse_prefill` is the Triton kernel: one
program per (sequence, query head) walks its queries in blocks of `BT`:
- A: the block's logits against the pool's keys as the block starts and against the block's own keys
  (`[BT, budget + BT]`, tensor-core products), to a float32 scratch;
- B: the sequential steps above, the pool's keys and masses in registers: per query one min-reduction
  (mass and position packed in one int64), a max and a sum; its probabilities overwrite its scratch row;
- C: the block's outputs, `P @ V` over the same columns (tensor cores), with a column masked where
  the walk evicted its key before that row.
Only B is sequential: a query costs three reductions over `budget` registers, not a pass over S keys.
B * Hq programs run at once (32 for a 1B Llama at batch 1), so the GPU is mostly idle; the cost is
the steps' latency, about T - budget steps per layer.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from nsa_eval.kernels._triton_utils import dot, interpreting, launcher, pow2

# Launch constants (not yet measured on a GPU; `tests/methods/test_h2o_fast.py::test_gpu_launch_sweep`
# prints the sweep): queries per block (the logits and outputs of a block are one tile product each),
# pool slots per tile of phases A and C, warps (more warps share a step's `budget` elements).
BLOCK_QUERIES = 64
BLOCK_KEYS = 64
NUM_WARPS = 8
_NEVER = tl.constexpr(2**63 - 1)  # above every packed (mass, position) pair: a slot that is not a candidate


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


@triton.jit
def _load_rows(base, rows, m_rows, stride, o_d, DIM: tl.constexpr, UPCAST: tl.constexpr):
    # rows `rows` [R] of a [T, DIM] head (unit stride in DIM), rows where m_rows is false as 0: [R, BD]
    x = tl.load(base + rows[:, None].to(tl.int64) * stride + o_d[None, :],
                mask=m_rows[:, None] & (o_d < DIM)[None, :], other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _h2o_prefill_kernel(
    Q, K, V, O, MASS, EV, SCR, POOL,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, so_b, so_h, so_t,
    T, HQ, G, scale_log2,
    SINK: tl.constexpr, LOCAL: tl.constexpr, BUDGET: tl.constexpr, NS: tl.constexpr, BT: tl.constexpr,
    BN: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # One program per (sequence, query head): queries BUDGET .. T - 1 in blocks of BT. The pool (slot ->
    # key, mass) lives in registers [NS] (slots past BUDGET unused); SCR [BT, BUDGET + BT] float32 holds
    # a block's logits, then its probabilities: column j < BUDGET for the key in slot j as the block
    # starts, column BUDGET + c for the block's key b0 + c. POOL [2, NS] int32: the pool's keys as the
    # block starts, and the step at which each slot's key was first replaced (BT: not in this block).
    i_bh = tl.program_id(0)
    i_b = (i_bh // HQ).to(tl.int64)
    i_h = i_bh % HQ
    i_hk = i_h // G
    WS: tl.constexpr = BUDGET + BT
    q_base = Q + i_b * sq_b + i_h * sq_h
    k_base = K + i_b * sk_b + i_hk * sk_h
    v_base = V + i_b * sv_b + i_hk * sv_h
    o_base = O + i_b * so_b + i_h * so_h
    mass_ptr = MASS + i_bh.to(tl.int64) * T
    ev_ptr = EV + i_bh.to(tl.int64) * T
    scr = SCR + i_bh.to(tl.int64) * (BT * WS)
    pool_ptr = POOL + i_bh.to(tl.int64) * (2 * NS)
    slot = tl.arange(0, NS)
    valid = slot < BUDGET
    key = tl.where(valid, slot, -1)  # the pool before query BUDGET: every key so far
    mass = tl.load(mass_ptr + slot, mask=valid, other=0.0)
    o_t = tl.arange(0, BT)
    o_n = tl.arange(0, BN)
    o_d = tl.arange(0, BD)
    o_dv = tl.arange(0, BDV)
    for b0 in range(BUDGET, T, BT):
        tl.store(pool_ptr + slot, key)
        tl.debug_barrier()  # phases A and C read the pool in tiles, from other threads
        rows = b0 + o_t
        m_rows = rows < T
        q = _load_rows(q_base, rows, m_rows, sq_t, o_d, D, UPCAST)  # [BT, BD]
        # A: logits against the pool's keys, then against the block's own keys
        for n0 in range(0, BUDGET, BN):
            cols = n0 + o_n
            m_c = cols < BUDGET
            kk = tl.load(pool_ptr + cols, mask=m_c, other=0)
            k = _load_rows(k_base, kk, m_c, sk_t, o_d, D, UPCAST)  # [BN, BD]
            tl.store(scr + o_t[:, None] * WS + cols[None, :], dot(q, tl.trans(k)), mask=m_c[None, :])
        k = _load_rows(k_base, rows, m_rows, sk_t, o_d, D, UPCAST)  # [BT, BD]
        tl.store(scr + o_t[:, None] * WS + BUDGET + o_t[None, :], dot(q, tl.trans(k)))
        tl.debug_barrier()  # B reads the rows that A's threads wrote
        # B: one step per query
        col = slot  # scratch column of each slot's key
        first = tl.full([NS], BT, tl.int32)  # the step that first replaced each slot's key
        for i in range(0, tl.minimum(BT, T - b0)):
            t = b0 + i
            row = scr + i * WS
            logit = tl.load(row + col, mask=valid, other=float("-inf"))  # [NS], issued before the eviction
            own = tl.load(row + BUDGET + i)  # q_t . k_t, for the slot key t is about to take
            candidate = (key >= SINK) & (key <= t - LOCAL)
            # mass >= 0, so its bits order as the floats do: the smallest mass, then the oldest key
            packed = (mass.to(tl.int32, bitcast=True).to(tl.int64) << 32) | key.to(tl.int64)
            victim = (tl.min(tl.where(candidate, packed, _NEVER), 0) & 0x7FFFFFFF).to(tl.int32)
            tl.store(ev_ptr + victim, t)
            tl.store(mass_ptr + victim, 0.0)
            hit = key == victim
            key = tl.where(hit, t, key)
            mass = tl.where(hit, 0.0, mass)
            col = tl.where(hit, BUDGET + i, col)
            first = tl.where(hit & (first == BT), i, first)
            logit = tl.where(hit, own, logit)
            e = tl.exp2((logit - tl.max(logit, 0)) * scale_log2)  # unused slots: exp2(-inf) = 0
            p = e / tl.sum(e, 0)
            mass += p
            tl.store(row + col, p, mask=valid)
        tl.store(pool_ptr + NS + slot, first)
        tl.debug_barrier()  # C reads B's probabilities and the evictions, written by other threads
        # C: outputs. Column j holds row i's probability while i < first[j]; the block's key b0 + c
        # (column BUDGET + c) from row c on, until the query that evicted it (evictions are absolute)
        acc = tl.zeros([BT, BDV], tl.float32)
        for n0 in range(0, BUDGET, BN):
            cols = n0 + o_n
            m_c = cols < BUDGET
            kk = tl.load(pool_ptr + cols, mask=m_c, other=0)
            until = tl.load(pool_ptr + NS + cols, mask=m_c, other=0)
            p = tl.load(scr + o_t[:, None] * WS + cols[None, :], mask=o_t[:, None] < until[None, :],
                        other=0.0)  # [BT, BN]
            v = _load_rows(v_base, kk, m_c, sv_t, o_dv, DV, UPCAST)  # [BN, BDV]
            acc += dot(p.to(v.dtype), v)
        gone = tl.load(ev_ptr + rows, mask=m_rows, other=0)  # [BT] (as columns)
        live = (o_t[None, :] <= o_t[:, None]) & (rows[:, None] < gone[None, :])  # [BT, BT]
        p = tl.load(scr + o_t[:, None] * WS + BUDGET + o_t[None, :], mask=live, other=0.0)
        v = _load_rows(v_base, rows, m_rows, sv_t, o_dv, DV, UPCAST)  # [BT, BDV]
        acc += dot(p.to(v.dtype), v)
        tl.store(o_base + rows[:, None].to(tl.int64) * so_t + o_dv[None, :], acc.to(O.dtype.element_ty),
                 mask=m_rows[:, None] & (o_dv < DV)[None, :])
        tl.debug_barrier()  # the next block's A overwrites what C read
    tl.store(mass_ptr + key, mass, mask=valid)


def h2o_sparse_prefill(query: Tensor, key: Tensor, value: Tensor, mass: Tensor, out: Tensor, scaling: float,
                       sink: int, local: int, budget: int, *, block_queries: int = BLOCK_QUERIES,
                       block_keys: int = BLOCK_KEYS, num_warps: int = NUM_WARPS) -> Tensor:
    """`h2o_sparse_prefill_reference` in one Triton launch: same arguments, same result up to rounding.

    Args:
        query: `[B, Hq, T, D]`; key, value: `[B, Hkv, T, D|Dv]`, CUDA (or CPU under TRITON_INTERPRET=1).
        mass: `[B, Hq, T]` float32 contiguous, updated in place (see the reference).
        out: `[B, Hq, T, Dv]` with unit stride in Dv: rows `budget ..` are written.
        block_queries, block_keys: queries per block and pool slots per tile (powers of two, >= 16).

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
    query, key, value = (x if x.stride(-1) == 1 else x.contiguous() for x in (query, key, value))
    evictions = torch.full((B, Hq, T), T, dtype=torch.int32, device=query.device)
    scratch = torch.empty(B * Hq, block_queries, budget + block_queries, dtype=torch.float32,
                          device=query.device)
    slots = pow2(budget, block_keys)
    pool = torch.empty(B * Hq, 2, slots, dtype=torch.int32, device=query.device)
    launcher(_h2o_prefill_kernel)[(B * Hq,)](
        query, key, value, out, mass, evictions, scratch, pool,
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), out.stride(0), out.stride(1), out.stride(2),
        T, Hq, Hq // Hkv, scaling * math.log2(math.e),
        SINK=sink, LOCAL=local, BUDGET=budget, NS=slots, BT=block_queries, BN=block_keys, D=D, DV=DV,
        BD=pow2(D), BDV=pow2(DV), UPCAST=interpreting(),
        num_warps=num_warps,
    )
    return evictions
