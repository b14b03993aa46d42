"""Triton block selection (NSA Eq. 8-12): the importance of every selection block for every query
and KV head, and `select_blocks`, which keeps the forced blocks and the most important ones.

`select_blocks`: one program per (tile of query positions, KV head) loads all G query heads of the
group for `BT` positions (`M = BT * G'` rows, `G'` = G rounded up to a power of two, so `tl.dot`
gets `M >= 16` for any G), streams the compressed keys in chunks aligned with selection blocks,
turns scores into probabilities with the compression branch's lse, sums them over the group, and
maps them onto selection blocks with the geometric overlap weights (`|block_i ∩ block_j| / d`, see
reference.py). The weight of compressed block `c = j * RATIO + r` on selection block `j + k` depends
only on `(r, k)`, so the map is a sum over `r` for each `k` up to `K`, the farthest block a compressed
block reaches, each landing `k` blocks later: a rotation whose wrapped part spills into the next
chunk, carried there. With the paper's sizes (4 compressed blocks a selection block) the compressed
keys are loaded in an order that puts whole selection blocks in each thread's accumulator columns, so
the map runs in registers before the group sum (`LANES`).
The importances (summed over the group) go to a float32 buffer `[B*T*Hkv, Ns]`; `topk.topk_blocks`
keeps the forced blocks and the largest importances (ties to the lower index) and writes them
ascending, `-1` padded. Needs `select_size % stride == 0` with a power-of-two ratio (true for the
paper's 32/16/64 and for fla's 64/64/64).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa_eval.kernels._triton_utils import (
    LOG2E,
    cdiv,
    contiguous,
    default_scale,
    dk_tiles,
    dot,
    group_rows,
    interpreting,
    launcher,
    load_rows,
    load_tail,
    pow2,
    wide_rows,
)
from nsa_eval.kernels.band import band_forward
from nsa_eval.kernels.topk import TOPK_CAP, topk_blocks

# rows (positions x G') a program holds: more rows read each compressed key for more positions (fewer
# bytes) at more registers and shared memory; 256 rows over 8 warps took select_blocks at 64k from
# 7.27 to 6.83 ms against 128. `importance_launch` fits them to the group, the dtype and the head dim.
IMPORTANCE_LAUNCH = dict(rows=256, num_warps=8, num_stages=3)
# G' below 16 holds 128 rows; at G' = 4 (16-bit q/k dims up to 128, where it was measured) 4 warps and
# 2 stages took the kernel at 64k from 1.72 to 1.66 ms.
LAUNCH_BY_GROUP = {4: dict(num_warps=4, num_stages=2)}
# selection blocks a chunk maps at once: the rotation's width, so the farthest block a compressed block
# may reach (K <= 16, `block_importance`'s check) spills into the next chunk at most
CHUNK_BLOCKS = 16
# select_blocks' importances are float32 [queries x Hkv, blocks], quadratic in T (2 GiB for one 64k
# sequence with 8 KV heads): past this many bytes it scores a sequence's queries a chunk of positions at
# a time (6 chunks at 32k, 19 at 64k for 8 KV heads), each chunk filling the GPU still
IMPORTANCE_CHUNK_BYTES = 128 * 2**20


@triton.jit
def _importance_kernel(
    Q, KC, LSE, IMP,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h,
    T, T0, TC, HQ, G, NS, scale_log2,
    block_len: tl.constexpr, stride: tl.constexpr, select_size: tl.constexpr,
    DK: tl.constexpr, BDK: tl.constexpr, BDK2: tl.constexpr, GP: tl.constexpr, BT: tl.constexpr,
    BNS: tl.constexpr, RATIO: tl.constexpr, K: tl.constexpr, UPCAST: tl.constexpr, LANES: tl.constexpr,
):
    # The T queries of Q, LSE and IMP's rows sit at positions T0 .. T0 + T - 1. K: the farthest
    # selection block ahead of its own that a compressed block reaches (<= BNS); LANES: the lane-ordered
    # map of RATIO = 4 (`_importance_chunk`)
    BC: tl.constexpr = BNS * RATIO  # compressed blocks per chunk of BNS selection blocks
    HKV = HQ // G
    i_b, i_hk, t0, o_r, r_t, m_r = group_rows(T, HQ, G, GP, BT)  # t0, r_t: rows of Q, not positions
    r_g = o_r % GP
    o_dk = tl.arange(0, BDK)
    q, q2 = load_rows(Q + i_b * sq_b + (i_hk * G + r_g) * sq_h + r_t.to(tl.int64) * sq_t, m_r, DK, BDK, BDK2,
                      UPCAST)  # [M, BDK], [M, BDK2]
    lse = tl.load(LSE + (i_b * T + r_t) * HQ + i_hk * G + r_g, mask=m_r, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse) * 1.4426950408889634  # [M]
    k_base = KC + i_b * sk_b + i_hk * sk_h
    p_t = T0 + r_t  # [M] position of each row

    t_last = T0 + tl.minimum(t0 + BT - 1, T - 1)
    ns_hi = t_last // select_size + 1
    carry = tl.zeros([BT, BNS], tl.float32)
    r_rows = (i_b * T + t0 + tl.arange(0, BT)) * HKV + i_hk  # [BT] rows of IMP
    m_rows = (t0 + tl.arange(0, BT)) < T
    # chunks whose compressed blocks are all visible to the program's first position, so to every row,
    # skip the visibility mask (a compare and select per probability); padding rows (past T, or heads
    # past G) drop out there through lse = +inf
    n_full = tl.minimum(tl.maximum(T0 + t0 - block_len + 1 + stride, 0) // stride, TC)  # blocks t0 sees
    j_full = (n_full // BC) * BNS
    lse_full = tl.where(m_r, lse, float("inf"))
    for j0 in range(0, j_full, BNS):
        carry = _importance_chunk(q, q2, k_base, sk_t, o_dk, lse_full, p_t, m_r, j0, TC, stride, block_len,
                                  scale_log2, carry, IMP, r_rows, m_rows, NS, select_size, DK, BDK, BDK2, BT,
                                  GP, BNS, RATIO, K, UPCAST, LANES, False)
    for j0 in range(j_full, ns_hi, BNS):
        carry = _importance_chunk(q, q2, k_base, sk_t, o_dk, lse, p_t, m_r, j0, TC, stride, block_len,
                                  scale_log2, carry, IMP, r_rows, m_rows, NS, select_size, DK, BDK, BDK2, BT,
                                  GP, BNS, RATIO, K, UPCAST, LANES, True)


@triton.jit
def _overlap_weight(r: tl.constexpr, k: tl.constexpr, block_len: tl.constexpr, stride: tl.constexpr,
                    select_size: tl.constexpr):
    """a[r, k], a constant: tokens of compressed block r of a selection block (tokens [r*stride,
    r*stride + block_len)) that fall in the selection block k ahead, / stride."""
    lo: tl.constexpr = r * stride
    hi: tl.constexpr = lo + block_len
    end: tl.constexpr = (k + 1) * select_size
    start: tl.constexpr = k * select_size
    tokens: tl.constexpr = (hi if hi < end else end) - (lo if lo > start else start)
    return tokens / stride if tokens > 0 else 0.0


@triton.jit
def _importance_chunk(q, q2, k_base, sk_t, o_dk, lse, r_t, m_r, j0, TC, stride: tl.constexpr,
                      block_len: tl.constexpr, scale_log2, carry, IMP, r_rows, m_rows, NS,
                      select_size: tl.constexpr, DK: tl.constexpr, BDK: tl.constexpr, BDK2: tl.constexpr,
                      BT: tl.constexpr, GP: tl.constexpr, BNS: tl.constexpr, RATIO: tl.constexpr,
                      K: tl.constexpr, UPCAST: tl.constexpr, LANES: tl.constexpr, MASKED: tl.constexpr):
    # importances of selection blocks j0 .. j0 + BNS - 1 (plus `carry`, the weight spilled into them by
    # the previous chunk) stored; returns what spills into the next chunk. MASKED: the chunk may hold
    # blocks some row does not see (or past TC); unmasked chunks are visible to every row.
    BC: tl.constexpr = BNS * RATIO
    o_j = tl.arange(0, BNS)
    if LANES:
        # column n = 16*i + 8*h + 2*l + e holds compressed block r = 2*h + e of selection block 4*i + l.
        # An sm_90 MMA accumulator gives each thread columns 2*(lane % 4) + e + 8*(0, 1, ..): so each
        # thread holds whole selection blocks, and the map over r needs no shuffles. (Any column order
        # gives the same sums; this one only places them.)
        o_n = tl.arange(0, BC)
        o_k = j0 * RATIO + ((o_n // 16) * 4 + (o_n // 2) % 4) * RATIO + ((o_n // 8) % 2) * 2 + o_n % 2
    else:
        o_k = j0 * RATIO + tl.arange(0, BC)  # [BC] compressed block indices
    m_k = o_k < TC
    k_ptrs = k_base + o_k[None, :].to(tl.int64) * sk_t + o_dk[:, None]
    if MASKED:
        k = tl.load(k_ptrs, mask=m_k[None, :] & (o_dk < DK)[:, None], other=0.0)  # [BDK, BC]
    else:
        k = tl.load(k_ptrs, mask=(o_dk < DK)[:, None], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
    s = dot(q, k)  # [M, BC]
    if BDK2 > 0:  # the tail of a split head dim
        k2 = load_tail(k_base + o_k.to(tl.int64) * sk_t, m_k, MASKED, BDK, BDK2, UPCAST, True)  # [BDK2, BC]
        s += dot(q2, k2)
    s = s * scale_log2
    if MASKED:
        visible = ((o_k * stride + block_len - 1)[None, :] <= r_t[:, None]) & m_k[None, :] & m_r[:, None]
        p = tl.where(visible, tl.exp2(s - lse[:, None]), 0.0)  # [M, BC]
    else:
        p = tl.exp2(s - lse[:, None])
    if LANES:  # the map over r first, in registers, then the group sum on 4x fewer values
        p5 = tl.reshape(p, [BT, GP, BNS // 4, 2, 4, 2])  # (position, head, i, h, l, e)
        p5 = tl.permute(p5, (0, 1, 2, 4, 3, 5))  # (.., i, l, h, e)
        p_e0, p_e1 = tl.split(p5)  # [BT, GP, BNS // 4, 4, 2] (.., i, l, h)
        p_r0, p_r2 = tl.split(p_e0)  # [BT, GP, BNS // 4, 4]: p of compressed block r = 2*h + e
        p_r1, p_r3 = tl.split(p_e1)
    else:
        pg = tl.sum(tl.reshape(p, [BT, GP, BC]), 1)  # [BT, BC] summed over the group first
        p3 = tl.reshape(pg, [BT, BNS, RATIO])  # p of compressed block j * RATIO + r
    main = tl.zeros([BT, BNS], tl.float32)
    spill = tl.zeros([BT, BNS], tl.float32)
    c_lo = tl.arange(0, RATIO) * stride  # [RATIO] start of compressed block r in its selection block
    for k in tl.static_range(K + 1):
        # a[r, k] [RATIO]: tokens [r*stride, r*stride + block_len) in selection block k, / stride
        a_k = tl.maximum(tl.minimum(c_lo + block_len, (k + 1) * select_size)
                         - tl.maximum(c_lo, k * select_size), 0).to(tl.float32) / stride
        if LANES:  # the weights are constants: zero terms drop out, ones cost no multiply
            x = tl.zeros([BT, GP, BNS // 4, 4], tl.float32)
            if _overlap_weight(0, k, block_len, stride, select_size) != 0:
                x += p_r0 * _overlap_weight(0, k, block_len, stride, select_size)
            if _overlap_weight(1, k, block_len, stride, select_size) != 0:
                x += p_r1 * _overlap_weight(1, k, block_len, stride, select_size)
            if _overlap_weight(2, k, block_len, stride, select_size) != 0:
                x += p_r2 * _overlap_weight(2, k, block_len, stride, select_size)
            if _overlap_weight(3, k, block_len, stride, select_size) != 0:
                x += p_r3 * _overlap_weight(3, k, block_len, stride, select_size)
            x = tl.reshape(tl.sum(x, 1), [BT, BNS])  # [BT, BNS] block 4*i + l, summed over the group
        else:
            x = tl.sum(p3 * a_k[None, None, :], 2)  # [BT, BNS] weight from block j onto j + k
        if k == 0:
            main += x
        else:  # rot[:, j] = x[:, j - k], wrapping: blocks past the chunk's end spill (all of them at k = BNS)
            shift = tl.broadcast_to(((o_j - k + BNS) % BNS)[None, :], [BT, BNS])
            rot = tl.gather(x, shift, 1)  # [BT, BNS], exact (a register/shared move)
            main += tl.where(o_j[None, :] >= k, rot, 0.0)
            spill += tl.where(o_j[None, :] < k, rot, 0.0)
    cols = j0 + o_j
    tl.store(IMP + r_rows[:, None] * NS + cols[None, :], main + carry,
             mask=m_rows[:, None] & (cols < NS)[None, :])
    return spill


def importance_launch(GP: int, dtype: torch.dtype, dk: int = 128) -> dict:
    """The importance kernel's launch, `IMPORTANCE_LAUNCH` fitted to G', the dtype and the head dim:
    rows (positions x G') at most 128 for wide rows of q (`wide_rows`: float32; 16-bit q fits the
    defaults up to 256 dims, 230,400 bytes at 256) or groups below 16 heads. With fewer heads a
    program holds more positions, and at 256 rows float32 needs more shared memory than the H200 has
    (233,472-245,760 bytes at G' <= 4 against 232,448); G = 4 in bf16 runs slower at 256 rows (1.91
    ms against 1.66 at 64k). Wide rows also keep at most 2 stages: float32 scores multiply in three
    tf32 passes (`dot`), which at 3 stages needs 262,144 bytes. The paper's 192 in 16-bit takes the
    same launch: there the defaults hold one program per SM (173,056 bytes), and select_blocks at 64k
    took 9.05 ms against 9.78. 256 keeps the defaults (`band._band_config` says why). At 16-bit dims
    up to 128, `LAUNCH_BY_GROUP` gives the warps and stages of its G'."""
    launch = dict(IMPORTANCE_LAUNCH)
    wide = wide_rows(dtype, dk) or 128 < dk <= 192
    if wide or GP < 16:
        launch["rows"] = min(launch["rows"], 128)
    if not wide and dk <= 128:
        launch.update(LAUNCH_BY_GROUP.get(GP, {}))
    if wide:
        launch["num_stages"] = min(launch["num_stages"], 2)
    return launch


def block_importance(q, k_cmp, lse, *, block_len, stride, select_size, scale, first=0, num_blocks=None):
    """Importance of every selection block for every (query, KV head), summed over the group.

    q [B,T,Hq,Dk], k_cmp [B,Tc,Hkv,Dk], lse [B,T,Hq] (compression branch) -> float32
    [B*T*Hkv, Ns]; entries of blocks after a row's own block are left unwritten. The queries sit at
    positions `first .. first + T - 1`; Ns = `num_blocks`, default the blocks of `first + T` tokens.
    """
    B, T, HQ, DK = q.shape
    TC, HKV = k_cmp.shape[1], k_cmp.shape[2]
    G = HQ // HKV
    ns = cdiv(first + T, select_size) if num_blocks is None else num_blocks
    if select_size % stride or (select_size // stride) & (select_size // stride - 1):
        raise ValueError(
            f"the Triton select_blocks needs select_size a power-of-two multiple of stride, got "
            f"select_size={select_size}, stride={stride}"
        )
    if block_len - stride > 16 * select_size:
        raise ValueError(f"block_len - stride must be <= 16 * select_size, got {block_len}, {stride}")
    ratio = select_size // stride
    # K: selection blocks ahead of its own that a compressed block reaches (its last one, r = ratio - 1,
    # ends at token select_size - stride + block_len - 1 of its selection block); <= 16 by the check above
    shifts = (select_size - stride + block_len - 1) // select_size
    imp = torch.empty(B * T * HKV, ns, device=q.device, dtype=torch.float32)
    GP = pow2(G, 1)
    launch = importance_launch(GP, q.dtype, DK)
    rows = launch.pop("rows")
    BT = max(1, (16 if interpreting() else rows) // GP)
    BDK, BDK2 = dk_tiles(DK)
    launcher(_importance_kernel)[(cdiv(T, BT), B * HKV)](
        q, k_cmp, lse, imp, q.stride(0), q.stride(1), q.stride(2), k_cmp.stride(0), k_cmp.stride(1),
        k_cmp.stride(2), T, first, TC, HQ, G, ns, scale * LOG2E, block_len, stride, select_size,
        DK=DK, BDK=BDK, BDK2=BDK2, GP=GP, BT=BT, BNS=CHUNK_BLOCKS, RATIO=ratio, K=shifts,
        UPCAST=interpreting(), LANES=ratio == 4, **launch,
    )
    return imp


@torch.no_grad()
def select_blocks(q, k_cmp, *, block_len=32, stride=16, select_size=64, num_selected=16, num_init=1,
                  num_local=2, scale=None, lse=None, chunk_bytes=None):
    """Choose the selection blocks of every query (see reference.py for the exact rule).

    Args:
        q: queries `[B, T, Hq, Dk]`; k_cmp: compressed keys `[B, Tc, Hkv, Dk]`.
        lse: optional `[B, T, Hq]` float32 lse of the compression branch (recomputed if None).
        chunk_bytes: the most bytes of importances (and the top-k's scratch) held at once (default
            `IMPORTANCE_CHUNK_BYTES`): past it the queries of each sequence go in chunks of positions
            (the same blocks).

    Returns:
        int32 `[B, T, Hkv, num_selected]`, ascending, `-1` padded at the end.
    """
    B, T, HQ, DK = q.shape
    HKV = k_cmp.shape[2]
    scale = default_scale(scale, DK)
    q, k_cmp = contiguous(q, k_cmp)
    if lse is None:
        _, lse = band_forward(q, k_cmp, k_cmp[..., :1], scale=scale, key_stride=stride,
                              key_offset=block_len - 1)
    lse = lse.contiguous()
    params = dict(block_len=block_len, stride=stride, select_size=select_size, scale=scale)
    top = dict(num_kv_heads=HKV, select_size=select_size, num_selected=num_selected, num_init=num_init,
               num_local=num_local)
    ns = cdiv(T, select_size)
    per_query = HKV * (ns + 2 * TOPK_CAP) * 4  # float32 importances, int32 scratch of the lean top-k
    chunk_bytes = IMPORTANCE_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    if B * T * per_query <= chunk_bytes:
        imp = block_importance(q, k_cmp, lse, **params)
        return topk_blocks(imp, T=T, **top).view(B, T, HKV, num_selected)
    out = torch.empty(B, T, HKV, num_selected, device=q.device, dtype=torch.int32)
    span = max(16, chunk_bytes // per_query // 16 * 16)  # positions a chunk, starts aligned as T's
    for b in range(B):
        for lo in range(0, T, span):
            rows = (slice(b, b + 1), slice(lo, lo + span))
            imp = block_importance(q[rows], k_cmp[b : b + 1], lse[rows], **params, first=lo, num_blocks=ns)
            positions = torch.arange(lo, min(lo + span, T), device=q.device, dtype=torch.int32)
            out[rows] = topk_blocks(imp, T=T, positions=positions, **top).view(1, -1, HKV, num_selected)
            del imp  # before the next chunk's
    return out
