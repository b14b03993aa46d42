"""Triton code shared by the NSA kernels: a banded FlashAttention-2 (forward, dq, dk/dv) used by the
compression and sliding-window branches, the row statistic `delta = rowsum(o * do)`, and the top-k
that turns selection-block importances into block indices.

Key index `i` of the banded attention stands for the token `i * key_stride + key_offset` (its last
token); query `t` sees it when that token is `<= t` and, with a window `w`, `> t - w`:
- compression: `key_stride = d`, `key_offset = l - 1` (block `i` covers tokens `[i*d, i*d + l)`);
- sliding window: `key_stride = 1`, `key_offset = 0`, window `w`.

Under TRITON_INTERPRET=1 every `tl.dot` runs on float32 operands (`UPCAST`): the interpreter
multiplies bf16 bit patterns as integers (triton-lang/triton#11584).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pow2(n: int, minimum: int = 16) -> int:
    return max(minimum, triton.next_power_of_2(int(n)))


# Whether a q/k head dim that is the sum of two powers of two runs its products in two parts (True),
# or padded to the next power of two (False: the kernels before run 44).
# `scripts/probe_prefill.py dims` times both.
SPLIT_DK = True


def dk_tiles(dk: int) -> tuple[int, int]:
    """`(BDK, BDK2)`: the column tiles of a q/k head dim in the prefill's kernels. Triton's tiles are
    powers of two; a dim that is the sum of two, both >= 16 (the paper's 192 = 128 + 64; 96, 160),
    runs each score product as two MMAs over columns `[0, BDK)` and `[BDK, BDK + BDK2)`, and its dq
    and dk in two accumulators. Any other dim pads to the next power of two (`BDK2 = 0`), as 192 did
    to 256 before run 44 (the paper's dims then cost 1.57x the forward and 1.94x the forward+backward
    of 128 / 128 at 64k, run 41)."""
    padded = pow2(dk)
    head, tail = padded // 2, dk - padded // 2
    if SPLIT_DK and dk != padded and tail >= 16 and tail & (tail - 1) == 0:
        return head, tail
    return padded, 0


def default_scale(scale: float | None, dk: int) -> float:
    return 1.0 / math.sqrt(dk) if scale is None else float(scale)


def contiguous(*tensors):
    return tuple(None if t is None else t.contiguous() for t in tensors)


@triton.jit
def load_kv(k_base, v_base, o_k, m_k, sk_t, sv_t, o_dk, o_dv, DK: tl.constexpr, DV: tl.constexpr,
            UPCAST: tl.constexpr):
    # keys and values of token positions o_k [BN] (rows with m_k false read as 0): k [BN, BDK], v [BN, BDV]
    k = tl.load(k_base + o_k[:, None].to(tl.int64) * sk_t + o_dk[None, :],
                mask=m_k[:, None] & (o_dk < DK)[None, :], other=0.0)  # [BN, BDK]
    v = tl.load(v_base + o_k[:, None].to(tl.int64) * sv_t + o_dv[None, :],
                mask=m_k[:, None] & (o_dv < DV)[None, :], other=0.0)  # [BN, BDV]
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def load_tail(row_ptrs, m_rows, MASKED: tl.constexpr, BDK: tl.constexpr, BDK2: tl.constexpr,
              UPCAST: tl.constexpr, TRANSPOSED: tl.constexpr):
    # the tail columns [BDK, BDK + BDK2) of a split head dim (`dk_tiles`) of rows starting at row_ptrs
    # [R] (with MASKED, rows where m_rows is false read as 0): [R, BDK2], or [BDK2, R] if TRANSPOSED
    o_d = BDK + tl.arange(0, BDK2)
    if TRANSPOSED:
        ptrs = row_ptrs[None, :] + o_d[:, None]
        if MASKED:
            x = tl.load(ptrs, mask=m_rows[None, :], other=0.0)
        else:
            x = tl.load(ptrs)
    else:
        ptrs = row_ptrs[:, None] + o_d[None, :]
        if MASKED:
            x = tl.load(ptrs, mask=m_rows[:, None], other=0.0)
        else:
            x = tl.load(ptrs)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def store_tail(row_ptrs, x, m_rows, BDK: tl.constexpr, BDK2: tl.constexpr):
    # x [R, BDK2] into the tail columns [BDK, BDK + BDK2) of the rows starting at row_ptrs [R]
    o_d = BDK + tl.arange(0, BDK2)
    tl.store(row_ptrs[:, None] + o_d[None, :], x.to(row_ptrs.dtype.element_ty), mask=m_rows[:, None])


@triton.jit
def load_rows(row_ptrs, m_rows, DK: tl.constexpr, BDK: tl.constexpr, BDK2: tl.constexpr,
              UPCAST: tl.constexpr):
    # q/k rows starting at row_ptrs [R] (rows where m_rows is false read as 0): x [R, BDK] (columns past
    # DK as 0) and the tail of a split head dim x2 [R, BDK2] (`dk_tiles`; x itself without one)
    o_d = tl.arange(0, BDK)
    x = tl.load(row_ptrs[:, None] + o_d[None, :], mask=m_rows[:, None] & (o_d < DK)[None, :], other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    x2 = x
    if BDK2 > 0:
        x2 = load_tail(row_ptrs, m_rows, True, BDK, BDK2, UPCAST, False)
    return x, x2


@triton.jit
def split_zeros(R: tl.constexpr, BDK: tl.constexpr, BDK2: tl.constexpr):
    # float32 accumulators of a q/k dim: [R, BDK] and the tail's [R, BDK2] (a [R, 16] placeholder
    # without one)
    acc2 = tl.zeros([R, 16], tl.float32)
    if BDK2 > 0:
        acc2 = tl.zeros([R, BDK2], tl.float32)
    return tl.zeros([R, BDK], tl.float32), acc2


@triton.jit
def overlap_weights(stride, block_len, select_size, BC: tl.constexpr, BNS: tl.constexpr):
    """Geometric overlap weights of one chunk, divided by d: compressed block ii (tokens
    [ii*d, ii*d + l) from the chunk's start) with selection block jj of this chunk (main) and of the
    next chunk (spill, the weight of blocks that reach past the chunk). Returns float32 [BC, BNS] x 2."""
    o_c = tl.arange(0, BC)
    o_j = tl.arange(0, BNS)
    c_lo = o_c[:, None] * stride
    c_hi = c_lo + block_len
    s_lo = o_j[None, :] * select_size
    w_main = tl.maximum(tl.minimum(c_hi, s_lo + select_size) - tl.maximum(c_lo, s_lo), 0)
    s_lo2 = s_lo + BNS * select_size
    w_spill = tl.maximum(tl.minimum(c_hi, s_lo2 + select_size) - tl.maximum(c_lo, s_lo2), 0)
    return w_main.to(tl.float32) / stride, w_spill.to(tl.float32) / stride


@triton.jit
def softmax_start(M: tl.constexpr, BDV: tl.constexpr):
    # an empty online softmax: running max m_i [M] (-inf), sum l_i [M] and acc [M, BDV] (zeros)
    return tl.full([M], float("-inf"), tl.float32), tl.zeros([M], tl.float32), tl.zeros([M, BDV], tl.float32)


@triton.jit
def score_dot(a, b):
    # a @ b for attention scores. float32 operands (float32 inputs; any input under the interpreter,
    # which ignores the precision) take three tf32 passes, ~float32 accuracy: Triton's default, one
    # tf32 pass (10-bit mantissa), moves scores by ~1e-3, enough to reorder nearly tied block
    # importances against the float32 reference. 16-bit operands multiply exactly either way.
    if a.dtype == tl.float32:
        out = tl.dot(a, b, input_precision="tf32x3")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def online_softmax_step(s, valid, v, m_i, l_i, acc):
    # one tile of an online softmax in log2 units: scores s [M, BN] (valid: usable), values v [BN, BDV];
    # running max m_i [M], sum l_i [M] and acc [M, BDV] -> their new values
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def online_softmax_step_full(s, v, m_i, l_i, acc):
    # online_softmax_step for a tile where every score is usable: every row of s has a finite max, so
    # neither the -inf fill nor the empty-row guard is needed (same result bit for bit)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def softmax_result(m_i, l_i, acc):
    # output acc / l_i [M, BDV] (0 for rows with no usable key) and natural-log lse [M] (-inf for those)
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    return o, lse


# ---------------------------------------------------------------------------------------------
# delta = rowsum(o * do) - dlse, the softmax-backward row term
# ---------------------------------------------------------------------------------------------
@triton.jit
def _delta_kernel(O, DO, DLSE, DELTA, N, DV: tl.constexpr, BDV: tl.constexpr, BR: tl.constexpr,
                  HAS_DLSE: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)  # [BR]
    cols = tl.arange(0, BDV)
    mask = (rows < N)[:, None] & (cols < DV)[None, :]
    o = tl.load(O + rows[:, None] * DV + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + rows[:, None] * DV + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, axis=1)  # [BR]
    if HAS_DLSE:
        delta -= tl.load(DLSE + rows, mask=rows < N, other=0.0)
    tl.store(DELTA + rows, delta, mask=rows < N)


def row_delta(o: torch.Tensor, do: torch.Tensor, dlse: torch.Tensor | None = None) -> torch.Tensor:
    """`rowsum(o * do) - dlse` in float32. o, do: [B, T, H, Dv] contiguous -> [B, T, H]."""
    B, T, H, DV = o.shape
    delta = torch.empty(B, T, H, device=o.device, dtype=torch.float32)
    n = B * T * H
    if n == 0:
        return delta
    BR = 16
    dlse_arg = dlse.contiguous().float() if dlse is not None else delta
    _delta_kernel[(triton.cdiv(n, BR),)](o, do, dlse_arg, delta, n, DV=DV, BDV=pow2(DV), BR=BR,
                                         HAS_DLSE=dlse is not None)
    return delta


@triton.jit
def _sum3_kernel(A, B, C, OUT, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    total = tl.load(A + offs, mask=m, other=0.0).to(tl.float32)
    total += tl.load(B + offs, mask=m, other=0.0).to(tl.float32)
    total += tl.load(C + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(OUT + offs, total.to(OUT.dtype.element_ty), mask=m)


def sum3(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dtype: torch.dtype,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """`(a + b + c).to(dtype)`, summed in float32 in one pass (one rounding); a, b, c of one shape,
    any float dtypes. `out`: a contiguous tensor of that shape and dtype to write (it may be one of
    the inputs: each element is read before it is written). The reference:
    `(a.float() + b.float() + c.float()).to(dtype)`."""
    a, b, c = contiguous(a, b, c)
    if out is None:
        out = torch.empty(a.shape, device=a.device, dtype=dtype)
    elif out.shape != a.shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"sum3: out must be a contiguous {dtype} tensor of shape {tuple(a.shape)}")
    n = a.numel()
    if n:
        BLOCK = 1024
        _sum3_kernel[(triton.cdiv(n, BLOCK),)](a, b, c, out, n, BLOCK=BLOCK, num_warps=4)
    return out


# ---------------------------------------------------------------------------------------------
# banded FlashAttention-2
# ---------------------------------------------------------------------------------------------
# Split: each loop over tiles runs in three ranges, as in FlashAttention's Triton tutorial: the tiles
# at the window's start and on the diagonal build the causal/window/bounds mask, the interior tiles
# between them (every query sees every key, all in range) skip it. Otherwise one masked loop. The
# tiles stay in ascending order either way, so the results are the same; the benchmark times both.
# The kernels (per branch: "cmp", "swa") that split; True / False: all / none. Run 7 (H200, 64k, side
# by side): compression forward 11.50 ms split / 13.46 masked, its forward+backward 54.81 / 60.07,
# window forward 4.82 / 5.21. The window's forward+backward took 24.59 ms with its backward split,
# against 17.91 masked in run 6 (not side by side), so the window's backward keeps the masked loop.
BAND_SPLIT_MASK = {"cmp": ("fwd", "dq", "dkv"), "swa": ("fwd",)}


def _split_mask(window, part: str) -> bool:
    if isinstance(BAND_SPLIT_MASK, bool):
        return BAND_SPLIT_MASK
    return part in BAND_SPLIT_MASK["cmp" if window is None else "swa"]


@triton.jit
def load_in_range(ptrs, col_mask, PADDED: tl.constexpr):
    # a tile whose rows are all in range: only padded head dims (PADDED: BD > D) need the mask
    if PADDED:
        x = tl.load(ptrs, mask=col_mask, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _key_interior(t0, T, TK, lo, hi, key_stride, key_offset, window, HAS_WINDOW: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr):
    # Key tiles [mid_lo, mid_hi) (steps of BN from lo, inside [lo, hi)) where every query of
    # [t0, t0 + BM) sees every key: all queries < T, all keys < TK, each key position <= t0 (the
    # first query) and, with a window, > t0 + BM - 1 - window (the last query's window).
    n_seen = tl.maximum(t0 - key_offset + key_stride, 0) // key_stride  # keys at positions <= t0
    n_seen = tl.where(t0 + BM <= T, tl.minimum(n_seen, TK), 0)
    mid_lo = lo
    if HAS_WINDOW:
        # first key whose position is > t0 + BM - 1 - window, rounded up to a tile start
        first = tl.maximum(t0 + BM - 1 - window - key_offset + key_stride, 0) // key_stride
        mid_lo = tl.minimum(tl.maximum((first + BN - 1) // BN * BN, lo), hi)
    mid_hi = tl.maximum(tl.minimum(n_seen // BN * BN, hi), mid_lo)
    return mid_lo, mid_hi


@triton.jit
def _query_interior(k0, T, TK, lo, hi, key_stride, key_offset, window, HAS_WINDOW: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr):
    # Query tiles [mid_lo, mid_hi) (steps of BM from lo, inside [lo, hi)) that see every key of
    # [k0, k0 + BN): all keys < TK, all queries < T, each query >= the last key's position and, with a
    # window, < the first key's position + window.
    last_pos = (k0 + BN - 1) * key_stride + key_offset
    mid_lo = tl.minimum(tl.maximum((last_pos + BM - 1) // BM * BM, lo), hi)
    end = T
    if HAS_WINDOW:
        end = tl.minimum(end, k0 * key_stride + key_offset + window)
    end = tl.where(k0 + BN <= TK, end, 0)
    mid_hi = tl.maximum(tl.minimum(end // BM * BM, hi), mid_lo)
    return mid_lo, mid_hi


@triton.jit
def _band_fwd_tile(q, q2, k_base, v_base, start, o_t, m_i, l_i, acc, sk_t, sv_t, TK, scale_log2, key_stride,
                   key_offset, window, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, DK: tl.constexpr,
                   DV: tl.constexpr, BDK: tl.constexpr, BDK2: tl.constexpr, BDV: tl.constexpr,
                   BN: tl.constexpr, UPCAST: tl.constexpr):
    # one key tile [start, start + BN) of the forward for queries o_t [BM]; q [BM, BDK] (q2 [BM, BDK2]:
    # the tail of a split head dim, if BDK2 > 0)
    o_k = start + tl.arange(0, BN)  # [BN] key indices
    o_dk = tl.arange(0, BDK)
    o_dv = tl.arange(0, BDV)
    k_ptrs = k_base + o_k[None, :].to(tl.int64) * sk_t + o_dk[:, None]  # [BDK, BN]
    v_ptrs = v_base + o_k[:, None].to(tl.int64) * sv_t + o_dv[None, :]  # [BN, BDV]
    if MASKED:
        m_k = o_k < TK
        k = tl.load(k_ptrs, mask=m_k[None, :] & (o_dk < DK)[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=m_k[:, None] & (o_dv < DV)[None, :], other=0.0)
    else:
        k = load_in_range(k_ptrs, (o_dk < DK)[:, None], BDK > DK)
        v = load_in_range(v_ptrs, (o_dv < DV)[None, :], BDV > DV)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = score_dot(q, k)  # [BM, BN]
    if BDK2 > 0:
        s += score_dot(q2, load_tail(k_base + o_k.to(tl.int64) * sk_t, o_k < TK, MASKED, BDK, BDK2, UPCAST,
                                     True))
    s = s * scale_log2
    if MASKED:
        k_pos = o_k * key_stride + key_offset
        valid = (k_pos[None, :] <= o_t[:, None]) & m_k[None, :]
        if HAS_WINDOW:
            valid = valid & (k_pos[None, :] > o_t[:, None] - window)
        m_i, l_i, acc = online_softmax_step(s, valid, v, m_i, l_i, acc)
    else:
        m_i, l_i, acc = online_softmax_step_full(s, v, m_i, l_i, acc)
    return m_i, l_i, acc


@triton.jit
def _query_tile_and_head(longest_first):
    """(query tile, batch x head) of a forward or dq program. longest_first: the grid is (heads, query
    tiles) and runs the last query tiles, which see the most keys, first (without a window), so the
    GPU is not left waiting on a few long programs at the end; else (query tiles, heads)."""
    if longest_first:
        i_bh = tl.program_id(0)
        i_m = tl.num_programs(1) - 1 - tl.program_id(1)
    else:
        i_m = tl.program_id(0)
        i_bh = tl.program_id(1)
    return i_m, i_bh


@triton.jit
def _band_fwd_kernel(
    Q, K, V, O, LSE,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, so_b, so_t, so_h,
    T, TK, HQ, G, scale_log2, key_stride, key_offset, window, longest_first,
    HAS_WINDOW: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDK2: tl.constexpr,
    BDV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, UPCAST: tl.constexpr,
    SPLIT_MASK: tl.constexpr,
):
    i_m, i_bh = _query_tile_and_head(longest_first)
    i_b = (i_bh // HQ).to(tl.int64)
    i_h = i_bh % HQ
    i_hk = i_h // G
    t0 = i_m * BM
    o_t = t0 + tl.arange(0, BM)  # [BM] query positions
    o_dv = tl.arange(0, BDV)
    m_t = o_t < T
    q, q2 = load_rows(Q + i_b * sq_b + i_h * sq_h + o_t.to(tl.int64) * sq_t, m_t, DK, BDK, BDK2, UPCAST)
    k_base = K + i_b * sk_b + i_hk * sk_h
    v_base = V + i_b * sv_b + i_hk * sv_h

    t_last = tl.minimum(t0 + BM - 1, T - 1)
    hi = tl.minimum(tl.maximum(t_last - key_offset, 0) // key_stride + 1, TK)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(t0 - window + 1, 0) // BN * BN

    m_i, l_i, acc = softmax_start(BM, BDV)
    if SPLIT_MASK:
        mid_lo, mid_hi = _key_interior(t0, T, TK, lo, hi, key_stride, key_offset, window, HAS_WINDOW, BM, BN)
        if HAS_WINDOW:  # tiles at the window's start
            for start in range(lo, mid_lo, BN):
                m_i, l_i, acc = _band_fwd_tile(q, q2, k_base, v_base, start, o_t, m_i, l_i, acc, sk_t, sv_t,
                                               TK, scale_log2, key_stride, key_offset, window, True,
                                               HAS_WINDOW, DK, DV, BDK, BDK2, BDV, BN, UPCAST)
        for start in range(mid_lo, mid_hi, BN):  # interior: no mask
            m_i, l_i, acc = _band_fwd_tile(q, q2, k_base, v_base, start, o_t, m_i, l_i, acc, sk_t, sv_t,
                                           TK, scale_log2, key_stride, key_offset, window, False, HAS_WINDOW,
                                           DK, DV, BDK, BDK2, BDV, BN, UPCAST)
        for start in range(mid_hi, hi, BN):  # the diagonal (and the keys past TK)
            m_i, l_i, acc = _band_fwd_tile(q, q2, k_base, v_base, start, o_t, m_i, l_i, acc, sk_t, sv_t,
                                           TK, scale_log2, key_stride, key_offset, window, True, HAS_WINDOW,
                                           DK, DV, BDK, BDK2, BDV, BN, UPCAST)
    else:
        for start in range(lo, hi, BN):
            m_i, l_i, acc = _band_fwd_tile(q, q2, k_base, v_base, start, o_t, m_i, l_i, acc, sk_t, sv_t,
                                           TK, scale_log2, key_stride, key_offset, window, True, HAS_WINDOW,
                                           DK, DV, BDK, BDK2, BDV, BN, UPCAST)
    o, lse = softmax_result(m_i, l_i, acc)
    tl.store(O + i_b * so_b + i_h * so_h + o_t[:, None].to(tl.int64) * so_t + o_dv[None, :],
             o.to(O.dtype.element_ty), mask=m_t[:, None] & (o_dv < DV)[None, :])
    tl.store(LSE + (i_b * T + o_t) * HQ + i_h, lse, mask=m_t)


@triton.jit
def _band_dq_tile(q, q2, do, lse, delta, dq, dq2, k_base, v_base, start, o_t, sk_t, sv_t, TK, scale_log2,
                  key_stride, key_offset, window, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr,
                  DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDK2: tl.constexpr,
                  BDV: tl.constexpr, BN: tl.constexpr, UPCAST: tl.constexpr):
    # one key tile [start, start + BN) of dq [BM, BDK] (and dq2 [BM, BDK2], the tail of a split head
    # dim, with q2) for queries o_t [BM]
    o_k = start + tl.arange(0, BN)
    o_dk = tl.arange(0, BDK)
    o_dv = tl.arange(0, BDV)
    if MASKED:
        m_k = o_k < TK
        k, v = load_kv(k_base, v_base, o_k, m_k, sk_t, sv_t, o_dk, o_dv, DK, DV, UPCAST)  # [BN, BDK/BDV]
    else:
        k = load_in_range(k_base + o_k[:, None].to(tl.int64) * sk_t + o_dk[None, :], (o_dk < DK)[None, :],
                          BDK > DK)  # [BN, BDK]
        v = load_in_range(v_base + o_k[:, None].to(tl.int64) * sv_t + o_dv[None, :], (o_dv < DV)[None, :],
                          BDV > DV)  # [BN, BDV]
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k))  # [BM, BN]
    k2 = k  # the tail [BN, BDK2] (unused without one)
    if BDK2 > 0:
        k2 = load_tail(k_base + o_k.to(tl.int64) * sk_t, o_k < TK, MASKED, BDK, BDK2, UPCAST, False)
        s += tl.dot(q2, tl.trans(k2))
    p = tl.exp2(s * scale_log2 - lse[:, None])
    if MASKED:
        k_pos = o_k * key_stride + key_offset
        valid = (k_pos[None, :] <= o_t[:, None]) & m_k[None, :]
        if HAS_WINDOW:
            valid = valid & (k_pos[None, :] > o_t[:, None] - window)
        p = tl.where(valid, p, 0.0)
    dp = tl.dot(do, tl.trans(v))  # [BM, BN]
    ds = p * (dp - delta[:, None])
    dq += tl.dot(ds.to(k.dtype), k)
    if BDK2 > 0:
        dq2 += tl.dot(ds.to(k2.dtype), k2)
    return dq, dq2


@triton.jit
def _band_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
    T, TK, HQ, G, scale, scale_log2, key_stride, key_offset, window, longest_first,
    HAS_WINDOW: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDK2: tl.constexpr,
    BDV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, UPCAST: tl.constexpr,
    SPLIT_MASK: tl.constexpr,
):
    # DO and DQ are contiguous [B, T, HQ, DV] / [B, T, HQ, DK]
    i_m, i_bh = _query_tile_and_head(longest_first)
    i_b = (i_bh // HQ).to(tl.int64)
    i_h = i_bh % HQ
    i_hk = i_h // G
    t0 = i_m * BM
    o_t = t0 + tl.arange(0, BM)
    o_dk = tl.arange(0, BDK)
    o_dv = tl.arange(0, BDV)
    m_t = o_t < T
    row = (i_b * T + o_t.to(tl.int64)) * HQ + i_h  # [BM] flat (b, t, h)
    q, q2 = load_rows(Q + i_b * sq_b + i_h * sq_h + o_t.to(tl.int64) * sq_t, m_t, DK, BDK, BDK2, UPCAST)
    do = tl.load(DO + row[:, None] * DV + o_dv[None, :], mask=m_t[:, None] & (o_dv < DV)[None, :],
                 other=0.0)  # [BM, BDV]
    lse = tl.load(LSE + row, mask=m_t, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse) * 1.4426950408889634
    delta = tl.load(DELTA + row, mask=m_t, other=0.0)
    if UPCAST:
        do = do.to(tl.float32)
    k_base = K + i_b * sk_b + i_hk * sk_h
    v_base = V + i_b * sv_b + i_hk * sv_h
    t_last = tl.minimum(t0 + BM - 1, T - 1)
    hi = tl.minimum(tl.maximum(t_last - key_offset, 0) // key_stride + 1, TK)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(t0 - window + 1, 0) // BN * BN
    dq, dq2 = split_zeros(BM, BDK, BDK2)
    if SPLIT_MASK:
        mid_lo, mid_hi = _key_interior(t0, T, TK, lo, hi, key_stride, key_offset, window, HAS_WINDOW, BM, BN)
        if HAS_WINDOW:  # tiles at the window's start
            for start in range(lo, mid_lo, BN):
                dq, dq2 = _band_dq_tile(q, q2, do, lse, delta, dq, dq2, k_base, v_base, start, o_t, sk_t,
                                        sv_t, TK, scale_log2, key_stride, key_offset, window, True,
                                        HAS_WINDOW, DK, DV, BDK, BDK2, BDV, BN, UPCAST)
        for start in range(mid_lo, mid_hi, BN):  # interior: no mask
            dq, dq2 = _band_dq_tile(q, q2, do, lse, delta, dq, dq2, k_base, v_base, start, o_t, sk_t,
                                    sv_t, TK, scale_log2, key_stride, key_offset, window, False,
                                    HAS_WINDOW, DK, DV, BDK, BDK2, BDV, BN, UPCAST)
        for start in range(mid_hi, hi, BN):  # the diagonal (and the keys past TK)
            dq, dq2 = _band_dq_tile(q, q2, do, lse, delta, dq, dq2, k_base, v_base, start, o_t, sk_t,
                                    sv_t, TK, scale_log2, key_stride, key_offset, window, True,
                                    HAS_WINDOW, DK, DV, BDK, BDK2, BDV, BN, UPCAST)
    else:
        for start in range(lo, hi, BN):
            dq, dq2 = _band_dq_tile(q, q2, do, lse, delta, dq, dq2, k_base, v_base, start, o_t, sk_t,
                                    sv_t, TK, scale_log2, key_stride, key_offset, window, True,
                                    HAS_WINDOW, DK, DV, BDK, BDK2, BDV, BN, UPCAST)
    tl.store(DQ + row[:, None] * DK + o_dk[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=m_t[:, None] & (o_dk < DK)[None, :])
    if BDK2 > 0:
        store_tail(DQ + row * DK, dq2 * scale, m_t, BDK, BDK2)


@triton.jit
def _band_dkv_tile(k, k2, v, k_pos, m_k, dk, dk2, dv, Q, DO, LSE, DELTA, i_b, i_h, start, sq_b, sq_t, sq_h, T,
                   HQ, scale_log2, window, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, DK: tl.constexpr,
                   DV: tl.constexpr, BDK: tl.constexpr, BDK2: tl.constexpr, BDV: tl.constexpr,
                   BM: tl.constexpr, UPCAST: tl.constexpr):
    # one query tile [start, start + BM) of query head i_h for the key tile k [BN, BDK], v [BN, BDV]
    # (key positions k_pos [BN], in range m_k): dk [BN, BDK], dv [BN, BDV]; with a split head dim,
    # its tail k2 and dk2 [BN, BDK2]
    o_t = start + tl.arange(0, BM)
    o_dk = tl.arange(0, BDK)
    o_dv = tl.arange(0, BDV)
    row = (i_b * T + o_t.to(tl.int64)) * HQ + i_h  # [BM]
    q_rows = Q + i_b * sq_b + i_h * sq_h + o_t.to(tl.int64) * sq_t  # [BM]
    q_ptrs = q_rows[:, None] + o_dk[None, :]  # [BM, BDK]
    do_ptrs = DO + row[:, None] * DV + o_dv[None, :]  # [BM, BDV]
    if MASKED:
        m_t = o_t < T
        q = tl.load(q_ptrs, mask=m_t[:, None] & (o_dk < DK)[None, :], other=0.0)
        do = tl.load(do_ptrs, mask=m_t[:, None] & (o_dv < DV)[None, :], other=0.0)
        lse = tl.load(LSE + row, mask=m_t, other=0.0)
        lse = tl.where(lse == float("-inf"), 0.0, lse) * 1.4426950408889634
        delta = tl.load(DELTA + row, mask=m_t, other=0.0)
    else:  # every query < T and sees a key of this tile: lse is finite
        q = load_in_range(q_ptrs, (o_dk < DK)[None, :], BDK > DK)
        do = load_in_range(do_ptrs, (o_dv < DV)[None, :], BDV > DV)
        lse = tl.load(LSE + row) * 1.4426950408889634
        delta = tl.load(DELTA + row)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    s_t = tl.dot(k, tl.trans(q))  # [BN, BM]
    q2 = q  # the tail [BM, BDK2] (unused without one)
    if BDK2 > 0:
        q2 = load_tail(q_rows, o_t < T, MASKED, BDK, BDK2, UPCAST, False)
        s_t += tl.dot(k2, tl.trans(q2))
    p_t = tl.exp2(s_t * scale_log2 - lse[None, :])  # [BN, BM]
    if MASKED:
        valid = (k_pos[:, None] <= o_t[None, :]) & m_t[None, :] & m_k[:, None]
        if HAS_WINDOW:
            valid = valid & (k_pos[:, None] > o_t[None, :] - window)
        p_t = tl.where(valid, p_t, 0.0)
    dv += tl.dot(p_t.to(do.dtype), do)
    dp_t = tl.dot(v, tl.trans(do))  # [BN, BM]
    ds_t = p_t * (dp_t - delta[None, :])
    dk += tl.dot(ds_t.to(q.dtype), q)
    if BDK2 > 0:
        dk2 += tl.dot(ds_t.to(q2.dtype), q2)
    return dk, dk2, dv


@triton.jit
def _band_bwd_dkv_kernel(
    Q, K, V, DO, LSE, DELTA, DK_OUT, DV_OUT,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
    T, TK, HQ, G, SPLIT, scale, scale_log2, key_stride, key_offset, window, longest_first,
    HAS_WINDOW: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDK2: tl.constexpr,
    BDV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, UPCAST: tl.constexpr,
    SPLIT_MASK: tl.constexpr,
):
    # One program per (key tile, kv head, head split); it loops over G // SPLIT query heads.
    # DK_OUT / DV_OUT are contiguous [B, TK, HKV * SPLIT, D].
    if longest_first:  # grid (heads, key tiles): the first key tiles, which see the most queries, first
        i_bh = tl.program_id(0)
        i_n = tl.program_id(1)
    else:
        i_n = tl.program_id(0)
        i_bh = tl.program_id(1)
    HKV = HQ // G
    NH = HKV * SPLIT
    i_b = (i_bh // NH).to(tl.int64)
    i_hs = i_bh % NH  # (kv head, split) index
    i_hk = i_hs // SPLIT
    heads = G // SPLIT
    h_first = i_hk * G + (i_hs % SPLIT) * heads
    k0 = i_n * BN
    o_k = k0 + tl.arange(0, BN)
    o_dk = tl.arange(0, BDK)
    o_dv = tl.arange(0, BDV)
    m_k = o_k < TK
    k, k2 = load_rows(K + i_b * sk_b + i_hk * sk_h + o_k.to(tl.int64) * sk_t, m_k, DK, BDK, BDK2, UPCAST)
    v = tl.load(V + i_b * sv_b + i_hk * sv_h + o_k[:, None].to(tl.int64) * sv_t + o_dv[None, :],
                mask=m_k[:, None] & (o_dv < DV)[None, :], other=0.0)  # [BN, BDV]
    if UPCAST:
        v = v.to(tl.float32)
    k_pos = o_k * key_stride + key_offset
    lo = tl.minimum(k0 * key_stride + key_offset, T) // BM * BM
    hi = T
    if HAS_WINDOW:
        hi = tl.minimum((k0 + BN - 1) * key_stride + key_offset + window, T)
    dk, dk2 = split_zeros(BN, BDK, BDK2)
    dv = tl.zeros([BN, BDV], tl.float32)
    mid_lo, mid_hi = _query_interior(k0, T, TK, lo, hi, key_stride, key_offset, window, HAS_WINDOW, BM,
                                     BN)
    for j in range(0, heads):
        i_h = h_first + j
        if SPLIT_MASK:
            for start in range(lo, mid_lo, BM):  # the diagonal
                dk, dk2, dv = _band_dkv_tile(k, k2, v, k_pos, m_k, dk, dk2, dv, Q, DO, LSE, DELTA, i_b, i_h,
                                             start, sq_b, sq_t, sq_h, T, HQ, scale_log2, window, True,
                                             HAS_WINDOW, DK, DV, BDK, BDK2, BDV, BM, UPCAST)
            for start in range(mid_lo, mid_hi, BM):  # interior: no mask
                dk, dk2, dv = _band_dkv_tile(k, k2, v, k_pos, m_k, dk, dk2, dv, Q, DO, LSE, DELTA, i_b, i_h,
                                             start, sq_b, sq_t, sq_h, T, HQ, scale_log2, window, False,
                                             HAS_WINDOW, DK, DV, BDK, BDK2, BDV, BM, UPCAST)
            for start in range(mid_hi, hi, BM):  # the window's end and the queries past T
                dk, dk2, dv = _band_dkv_tile(k, k2, v, k_pos, m_k, dk, dk2, dv, Q, DO, LSE, DELTA, i_b, i_h,
                                             start, sq_b, sq_t, sq_h, T, HQ, scale_log2, window, True,
                                             HAS_WINDOW, DK, DV, BDK, BDK2, BDV, BM, UPCAST)
        else:
            for start in range(lo, hi, BM):
                dk, dk2, dv = _band_dkv_tile(k, k2, v, k_pos, m_k, dk, dk2, dv, Q, DO, LSE, DELTA, i_b, i_h,
                                             start, sq_b, sq_t, sq_h, T, HQ, scale_log2, window, True,
                                             HAS_WINDOW, DK, DV, BDK, BDK2, BDV, BM, UPCAST)
    out_row = (i_b * TK + o_k.to(tl.int64)) * NH + i_hs  # [BN]
    tl.store(DK_OUT + out_row[:, None] * DK + o_dk[None, :], (dk * scale).to(DK_OUT.dtype.element_ty),
             mask=m_k[:, None] & (o_dk < DK)[None, :])
    if BDK2 > 0:
        store_tail(DK_OUT + out_row * DK, dk2 * scale, m_k, BDK, BDK2)
    tl.store(DV_OUT + out_row[:, None] * DV + o_dv[None, :], dv.to(DV_OUT.dtype.element_ty),
             mask=m_k[:, None] & (o_dv < DV)[None, :])


def _strides(x):
    return x.stride(0), x.stride(1), x.stride(2)


# launch configurations of the banded kernels, per branch ("cmp": compression, "swa": window); the
# benchmark times alternatives to these (tile sizes BM x BN, warps, pipeline stages)
BAND_CONFIGS = {
    # compression fwd at 64k, with the mask split (run 8): 128 x 64, 8 warps, 3 stages 10.74 ms against
    # 11.40 for 64 x 64 / 4 warps / 3 stages (before the split, run 5: 13.6 against 15.0 the other way)
    "cmp": dict(fwd=dict(BM=128, BN=64, num_warps=8, num_stages=3),
                dq=dict(BM=64, BN=64, num_warps=4, num_stages=2),
                # compression fwd+bwd at 64k, 64 x 64 / 4 warps against 64 x 128 / 8 warps: 62.2 vs 59.9
                # (run 5), 59.9 vs 60.9 (run 6), 53.2 vs 54.8 (run 8, with the mask split)
                dkv=dict(BM=64, BN=64, num_warps=4, num_stages=2)),
    # window fwd at 64k (run 8): 64 x 64, 4 warps, 3 stages 4.20 ms against 4.82 for 128 x 64 / 8 warps
    "swa": dict(fwd=dict(BM=64, BN=64, num_warps=4, num_stages=3),
                dq=dict(BM=64, BN=64, num_warps=4, num_stages=2),
                dkv=dict(BM=64, BN=64, num_warps=4, num_stages=2)),
}


# Launch order of the banded kernels' programs: True, heads fastest and the longest tiles first (the
# last query tiles of the forward and dq, the first key tiles of dk/dv: with the compression's causal
# band they do up to 64x the work of the shortest, and a long program launched last keeps its SM busy
# after the others are done); False, tiles fastest in index order (the first versions).
BAND_LONGEST_FIRST = True


def _launch(tiles: int, heads: int) -> tuple[tuple[int, int], int]:
    """(grid, longest_first) of a banded launch. The longest-first grid puts the tiles on CUDA's grid
    y, which holds at most 65,535 tiles (4M tokens in 64-token tiles, 2M keys in the 32-key dk/dv
    tiles of q/k dims past 128): beyond that, index order."""
    longest_first = BAND_LONGEST_FIRST and tiles <= 65535
    return ((heads, tiles) if longest_first else (tiles, heads)), int(longest_first)


def wide_rows(dtype: torch.dtype, *dims: int) -> bool:
    """Whether rows of these head dims (padded to powers of two: a key row plus a value row, or q's
    alone) need launches smaller than the defaults to fit the H200's shared memory: float32 inputs
    (twice the bytes, and three tf32 passes in the forwards, `score_dot`), or 16-bit rows past 768
    bytes (the paper's 192 + 128 fit the defaults; 256 + 256 do not: the compression forward needed
    262,144 of the H200's 232,448 bytes at its 3 stages, run 39). Split q/k dims (`dk_tiles`) count
    padded too: 192 as 256, which keeps this bound on the safe side."""
    return dtype == torch.float32 or sum(pow2(d) for d in dims) * dtype.itemsize > 768


def _band_config(window, part, dtype=torch.bfloat16, dk=128, dv=128):
    cfg = dict(BAND_CONFIGS["cmp" if window is None else "swa"][part])
    if interpreting():
        cfg.update(BM=16, BN=16)
    elif wide_rows(dtype, dk, dv):
        # wide tiles beyond 64 x 64 can overflow shared memory (float32's dk/dv in 64 x 128 needed 262 KB
        # of the H200's 227 KB in run 5), and so can the forward at 3 stages (float32's three tf32
        # passes, `score_dot`: 295 KB); tests/kernels/test_h200_resources.py compiles every default
        if cfg["BM"] * cfg["BN"] > 64 * 64:
            cfg.update(BM=64, BN=64, num_warps=4)
        if part == "fwd":
            cfg["num_stages"] = min(cfg["num_stages"], 2)
    if dk > 128 and part == "dkv":
        # dk/dv past 128 q/k dims holds three float32 accumulators of a key tile (dk in two parts when
        # split, `dk_tiles`) and spills (1,260 bytes at 192 / 128): 32-key tiles. Run 45, 192 / 128
        # at 64k, forward+backward: compression 90.49 ms against 100.22 (8 warps 94.69), window 28.63
        # against 31.56. With it and the selected forward's 2 warps, the NSA at 256 / 256 took 82.70 /
        # 334.93 ms (run 46) against 97.93 / 380.25 (run 44)
        cfg["BN"] = min(cfg["BN"], 32)
    # The paper's 192: 32-key dq tiles, and 2 forward stages (at 3 the window's forward needs 147,456
    # bytes, one program per SM). Run 47 at 64k: compression forward+backward 90.56 ms against 92.32,
    # window 26.35 against 28.33; the window forward 4.75 against 6.57, the compression's 12.60 against
    # 12.84. Taken at 256 too, they left the NSA at 85.44 / 349.47 ms (run 48) against 82.70 / 334.93
    # without (run 46; two runs, whose 128 / 128 differed by 4%), so 256 keeps the launches above.
    if 128 < dk <= 192 and part == "dq":
        cfg["BN"] = min(cfg["BN"], 32)
    if 128 < dk <= 192 and part == "fwd":
        cfg["num_stages"] = min(cfg["num_stages"], 2)
    return cfg


def band_forward(q, k, v, *, scale, key_stride, key_offset, window=None):
    """Banded attention forward. q [B,T,Hq,Dk], k [B,Tk,Hkv,Dk], v [B,Tk,Hkv,Dv] (last dim
    contiguous) -> o [B,T,Hq,Dv] (q.dtype), lse [B,T,Hq] float32 (natural log, -inf if empty)."""
    B, T, HQ, DK = q.shape
    TK, HKV, DV = k.shape[1], k.shape[2], v.shape[3]
    o = torch.empty(B, T, HQ, DV, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, T, HQ, device=q.device, dtype=torch.float32)
    BDK, BDK2 = dk_tiles(DK)
    cfg = _band_config(window, "fwd", q.dtype, DK, DV)
    BM = cfg["BM"]
    grid, longest_first = _launch(triton.cdiv(T, BM), B * HQ)
    _band_fwd_kernel[grid](
        q, k, v, o, lse, *_strides(q), *_strides(k), *_strides(v), *_strides(o),
        T, TK, HQ, HQ // HKV, scale * LOG2E, key_stride, key_offset, window or 0, longest_first,
        HAS_WINDOW=window is not None, DK=DK, DV=DV, BDK=BDK, BDK2=BDK2, BDV=pow2(DV),
        UPCAST=interpreting(), SPLIT_MASK=_split_mask(window, "fwd"), **cfg,
    )
    return o, lse


def band_backward(q, k, v, o, lse, do, dlse=None, *, scale, key_stride, key_offset, window=None,
                  split_heads=False, delta=None):
    """Gradients of `band_forward`: (dq, dk, dv). `split_heads` runs one dk/dv program per query
    head and sums the group afterwards (many keys seen by long query ranges: compression). `delta`:
    float32 `[B, T, Hq]` rowsum(o * do) where the caller has it (then `dlse` must be None)."""
    B, T, HQ, DK = q.shape
    TK, HKV, DV = k.shape[1], k.shape[2], v.shape[3]
    G = HQ // HKV
    do = do.contiguous()
    if delta is None:
        delta = row_delta(o.contiguous(), do, dlse)
    dq = torch.empty(B, T, HQ, DK, device=q.device, dtype=q.dtype)
    BDK, BDK2 = dk_tiles(DK)
    common = dict(HAS_WINDOW=window is not None, DK=DK, DV=DV, BDK=BDK, BDK2=BDK2, BDV=pow2(DV),
                  UPCAST=interpreting())
    cfg = _band_config(window, "dq", q.dtype, DK, DV)
    grid, longest_first = _launch(triton.cdiv(T, cfg["BM"]), B * HQ)
    _band_bwd_dq_kernel[grid](
        q, k, v, do, lse, delta, dq, *_strides(q), *_strides(k), *_strides(v),
        T, TK, HQ, G, scale, scale * LOG2E, key_stride, key_offset, window or 0, longest_first,
        **cfg, **common,
        SPLIT_MASK=_split_mask(window, "dq"),
    )
    split = G if split_heads else 1
    buf_dtype = torch.float32 if split > 1 else k.dtype
    dk = torch.empty(B, TK, HKV * split, DK, device=q.device, dtype=buf_dtype)
    dv = torch.empty(B, TK, HKV * split, DV, device=q.device, dtype=buf_dtype)
    cfg = _band_config(window, "dkv", q.dtype, DK, DV)
    grid, longest_first = _launch(triton.cdiv(TK, cfg["BN"]), B * HKV * split)
    _band_bwd_dkv_kernel[grid](
        q, k, v, do, lse, delta, dk, dv, *_strides(q), *_strides(k), *_strides(v),
        T, TK, HQ, G, split, scale, scale * LOG2E, key_stride, key_offset, window or 0,
        longest_first, **cfg, **common,
        SPLIT_MASK=_split_mask(window, "dkv"),
    )
    if split > 1:
        dk = dk.view(B, TK, HKV, split, DK).sum(3).to(k.dtype)  # [B, TK, HKV, DK]
        dv = dv.view(B, TK, HKV, split, DV).sum(3).to(v.dtype)  # [B, TK, HKV, DV]
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# top-k of selection-block importances
# ---------------------------------------------------------------------------------------------
# "filter" (the default since run 19): a bound from 32 group maxima keeps ~22 candidate blocks of a
# row, compacted, then one arg-max pass per pick over those (`filtered_top`); "argmax": one arg-max
# pass per pick over the whole row; "radix": the k-th largest by a bitwise search (31 counting
# passes); "bitonic": `tl.topk` over int64 keys (importance, -index), a bitonic top-k, then a sort of
# the k winners by index. The top-k alone at 64k, one row per 1-warp program (run 19): 1.55 ms filter,
# 2.12 arg-max, 2.18 radix, 3.08 bitonic. The benchmark times all.
TOPK_METHOD = "filter"
TOPK_METHODS = ("argmax", "radix", "bitonic", "filter")
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
def _topk_blocks_kernel(
    IMP, POS, OUT, SCR, N_ROWS, NS, T, HKV, select_size, num_selected, num_init, num_local,
    HAS_POS: tl.constexpr, BR: tl.constexpr, BNS: tl.constexpr, NSEL: tl.constexpr, METHOD: tl.constexpr,
    CAP: tl.constexpr, RANK: tl.constexpr,
):
    # IMP [N_ROWS, NS] float32 (rows ordered (b, t, h_kv)); OUT [N_ROWS, num_selected] int32.
    # Picks forced blocks, then the largest importances (ties: lower block index), writes the
    # chosen indices ascending, -1 after them. SCR [N_ROWS, CAP] int64: the "filter" method's scratch.
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)  # [BR]
    m_r = rows < N_ROWS
    if HAS_POS:
        t = tl.load(POS + rows // HKV, mask=m_r, other=0)
    else:
        t = ((rows // HKV) % T).to(tl.int32)
    o_j = tl.arange(0, BNS)  # [BNS]
    cur = t // select_size  # block holding t
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
    if method == "filter":
        if NSEL <= 32 and BNS >= 128:  # the filter's 32 groups of the row hold NSEL candidates at least
            BR = 1
            scratch = torch.empty(n_rows, TOPK_FILTER_CAP, device=imp.device, dtype=torch.int64)
        else:
            method = "argmax"
    _topk_blocks_kernel[(triton.cdiv(n_rows, BR),)](
        imp, positions if positions is not None else imp, out, scratch, n_rows, ns, T, num_kv_heads,
        select_size, num_selected, num_init, num_local, HAS_POS=positions is not None, BR=BR, BNS=BNS,
        NSEL=NSEL, METHOD=method, CAP=TOPK_FILTER_CAP, RANK=TOPK_FILTER_PICK == "rank", num_warps=warps,
    )
    return out


# ---------------------------------------------------------------------------------------------
# gated sum of the three branches
# ---------------------------------------------------------------------------------------------
@triton.jit
def _gate_fwd_kernel(OC, OS, OW, GC, GS, GW, O, N, DV: tl.constexpr, BDV: tl.constexpr, BR: tl.constexpr):
    # all contiguous: branch outputs / O [N, DV], gates [N]
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)  # [BR]
    cols = tl.arange(0, BDV)
    m_r = rows < N
    mask = m_r[:, None] & (cols < DV)[None, :]
    offs = rows[:, None] * DV + cols[None, :]
    gc = tl.load(GC + rows, mask=m_r, other=0.0).to(tl.float32)
    gs = tl.load(GS + rows, mask=m_r, other=0.0).to(tl.float32)
    gw = tl.load(GW + rows, mask=m_r, other=0.0).to(tl.float32)
    o = gc[:, None] * tl.load(OC + offs, mask=mask, other=0.0).to(tl.float32)
    o += gs[:, None] * tl.load(OS + offs, mask=mask, other=0.0).to(tl.float32)
    o += gw[:, None] * tl.load(OW + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(O + offs, o.to(O.dtype.element_ty), mask=mask)


@triton.jit
def _gate_bwd_kernel(OC, OS, OW, GC, GS, GW, DO, DOC, DOS, DOW, DGC, DGS, DGW, DELTA, N, DV: tl.constexpr,
                     BDV: tl.constexpr, BR: tl.constexpr, HAS_DELTA: tl.constexpr):
    # d o_x = g_x * do, d g_x = rowsum(o_x * do); everything contiguous as in the forward.
    # HAS_DELTA: also each branch's softmax-backward row term rowsum(o_x * d o_x) = g_x * d g_x,
    # float32 DELTA [3, N] (cmp, slc, swa), so that the branches need no delta pass of their own
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)  # [BR]
    cols = tl.arange(0, BDV)
    m_r = rows < N
    mask = m_r[:, None] & (cols < DV)[None, :]
    offs = rows[:, None] * DV + cols[None, :]
    do = tl.load(DO + offs, mask=mask, other=0.0).to(tl.float32)  # [BR, BDV]
    gc = tl.load(GC + rows, mask=m_r, other=0.0).to(tl.float32)
    gs = tl.load(GS + rows, mask=m_r, other=0.0).to(tl.float32)
    gw = tl.load(GW + rows, mask=m_r, other=0.0).to(tl.float32)
    tl.store(DOC + offs, (gc[:, None] * do).to(DOC.dtype.element_ty), mask=mask)
    tl.store(DOS + offs, (gs[:, None] * do).to(DOS.dtype.element_ty), mask=mask)
    tl.store(DOW + offs, (gw[:, None] * do).to(DOW.dtype.element_ty), mask=mask)
    dgc = tl.sum(tl.load(OC + offs, mask=mask, other=0.0).to(tl.float32) * do, 1)  # [BR]
    tl.store(DGC + rows, dgc.to(DGC.dtype.element_ty), mask=m_r)
    dgs = tl.sum(tl.load(OS + offs, mask=mask, other=0.0).to(tl.float32) * do, 1)
    tl.store(DGS + rows, dgs.to(DGS.dtype.element_ty), mask=m_r)
    dgw = tl.sum(tl.load(OW + offs, mask=mask, other=0.0).to(tl.float32) * do, 1)
    tl.store(DGW + rows, dgw.to(DGW.dtype.element_ty), mask=m_r)
    if HAS_DELTA:
        tl.store(DELTA + rows, gc * dgc, mask=m_r)
        tl.store(DELTA + N + rows, gs * dgs, mask=m_r)
        tl.store(DELTA + 2 * N + rows, gw * dgw, mask=m_r)


def _gate_rows(dv: int) -> int:
    return max(1, min(64, 4096 // pow2(dv)))


class GatedSumFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o_cmp, o_slc, o_swa, g_cmp, g_slc, g_swa):
        inputs = contiguous(o_cmp, o_slc, o_swa, g_cmp, g_slc, g_swa)
        ctx.save_for_backward(*inputs)
        return gate_forward(*inputs)

    @staticmethod
    def backward(ctx, do):
        d_o, d_g, _ = gate_backward(*ctx.saved_tensors, do, with_delta=False)
        return (*d_o, *d_g)


def gate_forward(o_cmp, o_slc, o_swa, g_cmp, g_slc, g_swa):
    """`g_cmp * o_cmp + g_slc * o_slc + g_swa * o_swa` (contiguous inputs), no autograd."""
    dv = o_cmp.shape[-1]
    n = o_cmp.numel() // max(dv, 1)
    o = torch.empty_like(o_cmp)
    if n:
        BR = _gate_rows(dv)
        _gate_fwd_kernel[(triton.cdiv(n, BR),)](o_cmp, o_slc, o_swa, g_cmp, g_slc, g_swa, o, n, DV=dv,
                                                BDV=pow2(dv), BR=BR, num_warps=4)
    return o


def gate_backward(o_cmp, o_slc, o_swa, g_cmp, g_slc, g_swa, do, *, with_delta):
    """Backward of `gated_sum` (contiguous inputs): ([do_cmp, do_slc, do_swa], [dg_cmp, dg_slc,
    dg_swa], delta), with delta float32 `[3, B, T, Hq]`, each branch's rowsum(o_x * do_x), if asked
    (else None)."""
    do = do.contiguous()
    dv = o_cmp.shape[-1]
    n = o_cmp.numel() // max(dv, 1)
    d_o = [torch.empty_like(x) for x in (o_cmp, o_slc, o_swa)]
    d_g = [torch.empty_like(g) for g in (g_cmp, g_slc, g_swa)]
    delta = torch.empty(3, *g_cmp.shape, device=do.device, dtype=torch.float32) if with_delta else None
    if n:
        BR = _gate_rows(dv)
        _gate_bwd_kernel[(triton.cdiv(n, BR),)](o_cmp, o_slc, o_swa, g_cmp, g_slc, g_swa, do, *d_o, *d_g,
                                                delta if with_delta else do, n, DV=dv, BDV=pow2(dv), BR=BR,
                                                HAS_DELTA=with_delta, num_warps=4)
    return d_o, d_g, delta


def gated_sum(o_cmp, o_slc, o_swa, g_cmp, g_slc, g_swa):
    """`g_cmp * o_cmp + g_slc * o_slc + g_swa * o_swa` in one pass (float32 math, one rounding).

    o_*: `[B, T, Hq, Dv]` (same dtype); g_*: `[B, T, Hq]`. Returns `[B, T, Hq, Dv]`; differentiable.
    """
    return GatedSumFunction.apply(o_cmp, o_slc, o_swa, g_cmp, g_slc, g_swa)
