"""Triton helpers shared by the NSA kernels: tile loads (with a q/k head dim split into two column
tiles, `dk_tiles`), online-softmax steps, and the softmax-backward row statistic
`delta = rowsum(o * do)`. The kernels themselves live beside them: `band.py` (the banded attention
of the compression and window branches), `importance.py`, `selection.py`, `topk.py`, `gates.py`, `decode.py`.

Under TRITON_INTERPRET=1 every `tl.dot` runs on float32 operands (`UPCAST`): the interpreter
multiplies bf16 bit patterns as integers (triton-lang/triton#11584).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.runtime import driver
from triton.runtime.jit import JITFunction

LOG2E = 1.4426950408889634


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1). Triton's own knob:
    it follows the environment as `os.environ` does, at a fifth of the host's time."""
    return knobs.runtime.interpret


class Launcher:
    """`kernel[grid](*args, **options)` for a `triton.jit` kernel (`launcher(kernel)`) at about two
    thirds of the host's time of Triton's `JITFunction.run`: that takes 19-57 us a launch on an H200's
    host, against 5-17 us for Triton's argument binder and 7-17 for the compiled kernel's launcher
    (the 8 launches of G = 4's 8k forward: 228-302 us, 146-197 direct). Triton's binder still
    specialises every call (the dtypes, the 16-byte alignment of pointers, the divisibility and the
    value 1 of integers, the constexprs); the compiled kernel of each specialisation, found once
    through `JITFunction.run`, is then launched directly, skipping that run's cache key (`str` of the
    options), launch metadata and hooks. Triton's path is taken instead under the interpreter, with
    launch hooks or pre-run hooks installed (profilers), for a callable grid, and where a global the
    kernel reads changed."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.compiled = {}  # (device, specialisation, options, debug knobs) -> CompiledKernel

    def __getitem__(self, grid):
        return functools.partial(self.launch, grid)

    def launch(self, grid, *args, **options):
        kernel = self.kernel
        if (not isinstance(kernel, JITFunction) or callable(grid) or kernel.pre_run_hooks
                or _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook)):
            return kernel[grid](*args, **options)
        device = driver.active.get_current_device()
        bound, specialization, opts = kernel.device_caches[device][4](*args, **options)
        key = (device, tuple(specialization), tuple(opts.items()), knobs.runtime.debug,
               knobs.compilation.instrumentation_mode)
        compiled = self.compiled.get(key)
        if compiled is None or not self._globals_unchanged():
            compiled = self.compiled[key] = kernel[grid](*args, **options)
            return compiled
        g0, g1, g2 = (*grid, 1, 1)[:3]
        compiled.run(g0, g1, g2, driver.active.get_current_stream(device), compiled.function,
                     compiled.packed_metadata, None, None, None, *bound.values())
        return compiled

    def _globals_unchanged(self) -> bool:
        # Triton raises where a global read by the kernel changed since it compiled: its path says so
        return all(globals_dict.get(name, self) == value
                   for (name, _), (value, globals_dict) in self.kernel.used_global_vals.items())


def _hooked(hook) -> bool:
    # Triton 3.8's launch hooks are chains, empty unless a profiler adds to them
    return hook is not None and bool(getattr(hook, "calls", True))


def launcher(kernel) -> Launcher:
    """The `Launcher` of a `triton.jit` kernel (one a kernel, kept on it)."""
    try:
        return kernel._nsa_launcher
    except AttributeError:
        kernel._nsa_launcher = Launcher(kernel)
        return kernel._nsa_launcher


# Plain integer arithmetic for the host: Triton 3.8's `triton.cdiv` and `triton.next_power_of_2` are
# constexpr functions, 1.3-2.4 us of an H200 host's time a call, and a forward makes dozens of them.
def cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


def pow2(n: int, minimum: int = 16) -> int:
    """The least power of two >= n, and >= minimum."""
    return max(minimum, 1 << max(int(n) - 1, 0).bit_length())


def dk_tiles(dk: int) -> tuple[int, int]:
    """`(BDK, BDK2)`: the column tiles of a q/k head dim in the prefill's kernels. Triton's tiles are
    powers of two; a dim that is the sum of two, both >= 16 (the paper's 192 = 128 + 64; 96, 160),
    runs each score product as two MMAs over columns `[0, BDK)` and `[BDK, BDK + BDK2)`, and its dq
    and dk in two accumulators. Any other dim pads to the next power of two (`BDK2 = 0`). Padded to
    256, the paper's dims cost 1.57x the forward and 1.94x the forward+backward of 128 / 128 at 64k;
    split, the forward at 64k (64/4 heads) took 48.57 ms against 61.91 padded."""
    padded = pow2(dk)
    head, tail = padded // 2, dk - padded // 2
    if dk != padded and tail >= 16 and tail & (tail - 1) == 0:
        return head, tail
    return padded, 0


def default_scale(scale: float | None, dk: int) -> float:
    return 1.0 / math.sqrt(dk) if scale is None else float(scale)


def contiguous(*tensors):
    return tuple(None if t is None else t.contiguous() for t in tensors)


def tma_ok(*tensors: torch.Tensor) -> bool:
    """Whether Hopper's tensor memory accelerator (TMA) can copy tiles of these `[B, T, H, D]` tensors:
    on a GPU of compute capability 9.0 or later (or in Triton's interpreter), with unit stride in the
    head dim and a 16-byte-aligned base and strides (TMA's rows start on 16 bytes), none of them empty
    (a descriptor needs every dimension positive: a prompt shorter than a compression block has no
    compressed keys)."""
    for t in tensors:
        if t.numel() == 0:
            return False
        if t.is_cuda and _capability_major(t.get_device()) < 9:
            return False
        if not t.is_cuda and not interpreting():
            return False
        if t.stride(3) != 1 or t.data_ptr() % 16 or any(s * t.element_size() % 16 for s in t.stride()[:3]):
            return False
    return True


@functools.cache
def _capability_major(device_index: int) -> int:
    # once per device: torch's query costs the host microseconds on every call of every launch
    return torch.cuda.get_device_capability(device_index)[0]


def tma_descriptor(t: torch.Tensor, rows: int, cols: int):
    """`t` `[B, T, H, D]` (`tma_ok`) as a tensor descriptor whose blocks are `[1, rows, 1, cols]`: a
    kernel loads `rows` positions of one (batch, head) in one bulk copy, rows past T and columns past D
    as 0."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, rows, 1, cols])


@triton.jit
def rounded(x, DT: tl.constexpr):
    """float32 `x` rounded to the nearest `DT` value (ties to even), kept as float32: what torch's
    elementwise ops in DT store. bf16 rounds on the bits, since the interpreter's cast truncates."""
    if DT == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536: 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(DT).to(tl.float32)


@triton.jit
def rotated_half(x, x_swapped, first_half, cos, sin, DT: tl.constexpr):
    """x [BD] float32 rotated half by cos/sin as torch's `x * cos + rotate_half(x) * sin` in DT: each
    product and the sum rounded to DT. x_swapped is x with its halves swapped; first_half marks the
    elements of the first half (where rotate_half negates)."""
    x_rot = tl.where(first_half, -x_swapped, x_swapped)
    return rounded(rounded(x * cos, DT) + rounded(x_rot * sin, DT), DT)


@triton.jit
def kv_sources(K, V, i_b, i_hk, sk_b, sk_h, sv_b, sv_h, TMA: tl.constexpr):
    # where a program's key and value tiles come from: the tensor descriptors themselves (TMA), or the
    # base pointers of its (batch, KV head)
    if TMA:
        k_src, v_src = K, V
    else:
        k_src = K + i_b * sk_b + i_hk * sk_h
        v_src = V + i_b * sv_b + i_hk * sv_h
    return k_src, v_src


@triton.jit
def tma_load_pair(A, B, i_b, start, i_h, ROWS: tl.constexpr, COLS_A: tl.constexpr, COLS_B: tl.constexpr):
    # rows [start, start + ROWS) of (batch i_b, head i_h) from two tensor descriptors (`tma_descriptor`,
    # blocks [1, ROWS, 1, COLS]), one bulk copy each: [ROWS, COLS_A], [ROWS, COLS_B]
    a = tl.reshape(A.load([i_b.to(tl.int32), start, i_h, 0]), [ROWS, COLS_A])
    b = tl.reshape(B.load([i_b.to(tl.int32), start, i_h, 0]), [ROWS, COLS_B])
    return a, b


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
def group_rows(T, HQ, G, GP: tl.constexpr, BT: tl.constexpr):
    # the rows of a program on grid (position tiles, B * Hkv) that holds BT positions x the G query
    # heads of one KV head's group, padded to GP (M = BT * GP rows, position-major): batch, KV head,
    # first position, row offsets o_r [M], position r_t [M] and mask m_r [M] of each row
    i_bh = tl.program_id(1)
    HKV = HQ // G
    i_b = (i_bh // HKV).to(tl.int64)
    i_hk = i_bh % HKV
    t0 = tl.program_id(0) * BT
    o_r = tl.arange(0, BT * GP)
    r_t = t0 + o_r // GP  # [M] position of each row
    m_r = (r_t < T) & (o_r % GP < G)
    return i_b, i_hk, t0, o_r, r_t, m_r


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
def softmax_start(M: tl.constexpr, BDV: tl.constexpr):
    # an empty online softmax: running max m_i [M] (-inf), sum l_i [M] and acc [M, BDV] (zeros)
    return tl.full([M], float("-inf"), tl.float32), tl.zeros([M], tl.float32), tl.zeros([M, BDV], tl.float32)


@triton.jit
def dot(a, b, acc=None):
    # a @ b (+ acc, float32, the product's starting sum) for the forwards' scores and P @ V. float32
    # operands (float32 inputs; any input under the interpreter, which ignores the precision) take three
    # tf32 passes, ~float32 accuracy: Triton's default, one tf32 pass (10-bit mantissa), moves scores and
    # outputs by ~1e-3, enough to reorder nearly tied block importances and to leave a float32 model's
    # logits 1e-2 off the float32 reference after a few layers. 16-bit operands multiply exactly either
    # way. The backward kernels keep one pass (`tl.dot`): at their tiles three passes need more shared
    # memory than Hopper has.
    if a.dtype == tl.float32:
        out = tl.dot(a, b, acc, input_precision="tf32x3")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def online_softmax_step(s, valid, v, m_i, l_i, acc, scale):
    # one tile of an online softmax in log2 units: scores s [M, BN] (valid: usable) times `scale` > 0,
    # values v [BN, BDV]; running max m_i [M], sum l_i [M] and acc [M, BDV] -> their new values. The
    # max of s times scale is the max of the products (rounding is monotonic), and s * scale - m is
    # one FMA, so no score is multiplied on its own (an unscaled max saves a multiply per score)
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s * scale - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def online_softmax_step_full(s, v, m_i, l_i, acc, scale):
    # online_softmax_step for a tile where every score is usable: every row of s has a finite max, so
    # neither the -inf fill nor the empty-row guard is needed (same result bit for bit)
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v)
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
    launcher(_delta_kernel)[(cdiv(n, BR),)](o, do, dlse_arg, delta, n, DV=DV, BDV=pow2(DV), BR=BR,
                                            HAS_DLSE=dlse is not None)
    return delta


def wide_rows(dtype: torch.dtype, *dims: int) -> bool:
    """Whether rows of these head dims (padded to powers of two: a key row plus a value row, or q's
    alone) need launches smaller than the defaults to fit the H200's shared memory: float32 inputs
    (twice the bytes, and three tf32 passes in the forwards, `dot`), or 16-bit rows past 768
    bytes (the paper's 192 + 128 fit the defaults; 256 + 256 do not: the compression forward needs
    262,144 of the H200's 232,448 bytes at its 3 stages). Split q/k dims (`dk_tiles`) count
    padded too: 192 as 256, which keeps this bound on the safe side."""
    return dtype == torch.float32 or sum(pow2(d) for d in dims) * dtype.itemsize > 768
