"""Input checks for the public NSA functions: a ValueError naming the argument, before any compute.

Each ``check_*`` function takes the arguments of the public function of the same name and raises
``ValueError`` with the argument's name and the expected shape (``[B, T, Hkv, Dk] = [2, 100, *, 64]``,
``*`` meaning "any size") on the first problem it finds. Beyond what the math needs, one limit of
the Triton kernels: their head dims (`check_triton_head_dims`).
"""

from __future__ import annotations

import functools
import numbers
import os

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
IMPLS = ("auto", "reference", "triton")
# The largest head dim (Dk and Dv, each) the Triton kernels take, per dtype: their launches fit the
# H200's 227 KB of shared memory up to these (tests/kernels/test_h200_resources.py compiles them for
# sm_90). Float32 tiles take twice the bytes: at 256 the selected dk/dv kernel alone needs 246-262 KB
# at 1 or 2 stages, its block's float32 keys and values 128 KB.
TRITON_MAX_HEAD_DIM = {torch.float16: 256, torch.bfloat16: 256, torch.float32: 128}
# The Triton releases the kernels are tested on: 3.6 (torch 2.11's) through 3.8 (torch 2.13's), on a
# GPU and in CI; pyproject.toml declares the same range.
TRITON_VERSIONS = ((3, 6), (3, 8))


def _fmt(layout: str, sizes) -> str:
    shown = ", ".join("*" if s is None else str(s) for s in sizes)
    return f"{layout} = [{shown}]"


def _tensor(name: str, x, layout: str, sizes, *, dtypes=FLOAT_DTYPES, like: torch.Tensor | None = None):
    """Check one tensor: type, rank, dtype (and equal to ``like``'s), device, sizes.

    Args:
        layout: e.g. ``"[B, T, Hkv, Dk]"``; sizes: one int (must match) or None (any) per dim.
    """
    expected = _fmt(layout, sizes)
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor of shape {expected}, got {type(x).__name__}")
    if x.dim() != len(sizes):
        raise ValueError(f"{name}: expected a {len(sizes)}-d tensor of shape {expected}, "
                         f"got {x.dim()}-d shape {list(x.shape)}")
    if x.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name}: expected dtype {allowed}, got {str(x.dtype).replace('torch.', '')}")
    if like is not None:
        if dtypes is FLOAT_DTYPES and x.dtype != like.dtype:
            raise ValueError(f"{name}: expected the same dtype as q ({like.dtype}), got {x.dtype}")
        if x.device != like.device:
            raise ValueError(f"{name}: expected a tensor on q's device ({like.device}), got {x.device}")
    for have, want in zip(x.shape, sizes, strict=True):
        if want is not None and have != want:
            raise ValueError(f"{name}: expected shape {expected}, got {list(x.shape)}")


def _int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")


def check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected True or False, got {value!r}")


def check_impl(impl, q: torch.Tensor) -> str:
    """Resolve ``impl`` to ``"reference"`` or ``"triton"`` (auto: Triton on CUDA, else reference)."""
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {', '.join(IMPLS)}, got {impl!r}")
    if impl == "auto":
        return "triton" if q.is_cuda else "reference"
    if impl == "triton" and not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"impl: 'triton' needs CUDA tensors (q is on {q.device}); "
                         "on a CPU run under Triton's interpreter with TRITON_INTERPRET=1")
    return impl


def check_triton_version(version: str) -> None:
    """Refuse, with the fix, a Triton `version` outside `TRITON_VERSIONS`."""
    found = tuple(int(part) for part in version.split(".")[:2] if part.isdigit())
    (lo_major, lo_minor), (hi_major, hi_minor) = TRITON_VERSIONS
    if not (lo_major, lo_minor) <= found <= (hi_major, hi_minor):
        raise ImportError(
            f"nsa-eval's Triton kernels run on Triton {lo_major}.{lo_minor} to {hi_major}.{hi_minor}, found "
            f"{version}: install one of those (pip install 'triton>={lo_major}.{lo_minor},<{hi_major}."
            f"{hi_minor + 1}', the Triton your torch pins if it is in that range) or use impl='reference'"
        )


@functools.cache
def check_installed_triton() -> None:
    """`check_triton_version` on the installed Triton, once per process, before any kernel compiles."""
    try:
        import triton
    except ImportError:
        raise ImportError("impl='triton' needs the triton package (pip install 'triton>=3.6,<3.9'); "
                          "impl='reference' runs without it") from None
    check_triton_version(triton.__version__)


def check_triton_head_dims(q: torch.Tensor, dv: int | None = None) -> None:
    """The Triton kernels' head-dim limit for q's dtype: Dk = q.shape[-1] and Dv (where given)."""
    limit = TRITON_MAX_HEAD_DIM[q.dtype]
    dims = {"Dk": q.shape[-1]} | ({} if dv is None else {"Dv": dv})
    for name, size in dims.items():
        if size > limit:
            dtype = str(q.dtype).replace("torch.", "")
            hint = " or bfloat16 inputs" if q.dtype == torch.float32 else ""
            raise ValueError(f"q: the Triton kernels take head dims up to {limit} in {dtype}, got {name} = "
                             f"{size}; use impl='reference'{hint}")


def check_scale(scale) -> None:
    if scale is None:
        return
    is_real = isinstance(scale, numbers.Real) and not isinstance(scale, bool)
    if not is_real or not 0 < scale < float("inf"):
        raise ValueError(f"scale: expected None or a finite float > 0, got {scale!r}")


def check_compression_params(block_len, stride) -> None:
    _int("block_len", block_len, 1)
    _int("stride", stride, 1)
    if block_len % stride:
        raise ValueError(f"stride: must divide block_len (block_len={block_len}, stride={stride})")


def check_selection_params(block_len, stride, select_size, num_selected, num_init, num_local) -> None:
    check_compression_params(block_len, stride)
    _int("select_size", select_size, 1)
    _int("num_selected", num_selected, 1)
    _int("num_init", num_init, 0)
    _int("num_local", num_local, 0)
    if select_size % stride:
        raise ValueError(f"select_size: must be a multiple of stride (select_size={select_size}, "
                         f"stride={stride})")
    if num_selected < num_init + num_local:
        raise ValueError(f"num_selected: must be >= num_init + num_local = {num_init + num_local} "
                         f"(the always-kept blocks), got {num_selected}")


def check_window(window) -> None:
    _int("window", window, 1)


def _query(q, T=None) -> tuple[int, int, int, int]:
    _tensor("q", q, "[B, T, Hq, Dk]", [None, T, None, None])
    B, T, Hq, Dk = q.shape
    for name, size in (("B", B), ("T", T), ("Hq", Hq), ("Dk", Dk)):
        if size == 0:
            raise ValueError(f"q: expected shape [B, T, Hq, Dk] with {name} >= 1, got {list(q.shape)}")
    return B, T, Hq, Dk


def _keys(q, k, v, k_name, v_name, seq_len, seq_name, Hkv=None, Dv=None) -> tuple[int, int]:
    """Check a key/value pair against q: ``k [B, S, Hkv, Dk]``, ``v [B, S, Hkv, Dv]``; return Hkv, Dv."""
    B, _, Hq, Dk = q.shape
    _tensor(k_name, k, f"[B, {seq_name}, Hkv, Dk]", [B, seq_len, Hkv, Dk], like=q)
    Hkv = k.shape[2]
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"{k_name}: its head count Hkv={Hkv} must divide q's head count Hq={Hq} "
                         f"(shape [B, {seq_name}, Hkv, Dk] = {list(k.shape)})")
    _tensor(v_name, v, f"[B, {seq_name}, Hkv, Dv]", [B, k.shape[1], Hkv, Dv], like=q)
    if v.shape[3] == 0:
        raise ValueError(f"{v_name}: expected shape [B, {seq_name}, Hkv, Dv] with Dv >= 1, "
                         f"got {list(v.shape)}")
    return Hkv, v.shape[3]


def _enough_compressed(name, Tc, length, block_len, stride) -> None:
    """A sequence of ``length`` tokens has ``(length - block_len) // stride + 1`` complete blocks."""
    needed = max(0, (length - block_len) // stride + 1)
    if Tc < needed:
        raise ValueError(f"{name}: {length} tokens hold {needed} compressed blocks "
                         f"((T - block_len) // stride + 1 with block_len={block_len}, stride={stride}), "
                         f"got Tc={Tc}; expected shape [B, Tc >= {needed}, Hkv, D]")


def _gates(q, gates: dict, T) -> None:
    B, _, Hq, _ = q.shape
    for name, g in gates.items():
        _tensor(name, g, "[B, T, Hq]", [B, T, Hq], like=q)


def check_compressed_attention(q, k_cmp, v_cmp, block_len, stride, scale) -> None:
    check_compression_params(block_len, stride)
    check_scale(scale)
    _, T, _, _ = _query(q)
    _keys(q, k_cmp, v_cmp, "k_cmp", "v_cmp", None, "Tc")
    _enough_compressed("k_cmp", k_cmp.shape[1], T, block_len, stride)


def check_select_blocks(q, k_cmp, block_len, stride, select_size, num_selected, num_init, num_local,
                        scale) -> None:
    check_selection_params(block_len, stride, select_size, num_selected, num_init, num_local)
    check_scale(scale)
    _, T, _, Dk = _query(q)
    B = q.shape[0]
    _tensor("k_cmp", k_cmp, "[B, Tc, Hkv, Dk]", [B, None, None, Dk], like=q)
    Hkv = k_cmp.shape[2]
    if Hkv == 0 or q.shape[2] % Hkv:
        raise ValueError(f"k_cmp: its head count Hkv={Hkv} must divide q's head count Hq={q.shape[2]}")
    _enough_compressed("k_cmp", k_cmp.shape[1], T, block_len, stride)


def check_block_indices(q, block_indices, Hkv, T) -> None:
    B = q.shape[0]
    _tensor("block_indices", block_indices, "[B, T, Hkv, n]", [B, T, Hkv, None], dtypes=INDEX_DTYPES, like=q)
    if block_indices.shape[3] == 0:
        raise ValueError(f"block_indices: expected shape [B, T, Hkv, n] with n >= 1, "
                         f"got {list(block_indices.shape)}")


def check_selected_attention(q, k, v, block_indices, select_size, scale) -> None:
    _int("select_size", select_size, 1)
    check_scale(scale)
    _, T, _, _ = _query(q)
    Hkv, _ = _keys(q, k, v, "k", "v", T, "T")
    check_block_indices(q, block_indices, Hkv, T)


def check_sliding_window_attention(q, k, v, window, scale) -> None:
    check_window(window)
    check_scale(scale)
    _, T, _, _ = _query(q)
    _keys(q, k, v, "k", "v", T, "T")


def check_nsa_attention(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, k_swa, v_swa, block_len, stride,
                        select_size, num_selected, num_init, num_local, window, scale) -> None:
    check_selection_params(block_len, stride, select_size, num_selected, num_init, num_local)
    check_window(window)
    check_scale(scale)
    _, T, _, _ = _query(q)
    Hkv, Dv = _keys(q, k, v, "k", "v", T, "T")
    _keys(q, k_cmp, v_cmp, "k_cmp", "v_cmp", None, "Tc", Hkv=Hkv, Dv=Dv)
    _enough_compressed("k_cmp", k_cmp.shape[1], T, block_len, stride)
    _swa_keys(q, k, v, k_swa, v_swa)
    _gates(q, {"g_cmp": g_cmp, "g_slc": g_slc, "g_swa": g_swa}, T)


def _swa_keys(q, k, v, k_swa, v_swa) -> None:
    if k_swa is not None:
        _tensor("k_swa", k_swa, "[B, T, Hkv, Dk] (like k)", list(k.shape), like=q)
    if v_swa is not None:
        _tensor("v_swa", v_swa, "[B, T, Hkv, Dv] (like v)", list(v.shape), like=q)


def _window_cache(q, k, v, k_swa, v_swa, window) -> None:
    # the decode's window keys/values: laid out like k, v (W = S) or a ring of W >= window rows
    B, S, Hkv, Dk = k.shape
    W = S if k_swa is None else k_swa.shape[1]
    if W != S and W < window:
        raise ValueError(f"k_swa: expected shape [B, W, Hkv, Dk] with W = S ({S}) or W >= window ({window}) "
                         f"rows (a ring), got {list(k_swa.shape)}")
    if k_swa is not None:
        _tensor("k_swa", k_swa, "[B, W, Hkv, Dk]", [B, W, Hkv, Dk], like=q)
    if W != S and v_swa is None:
        raise ValueError(f"v_swa: expected the window values as a ring of W = {W} rows like k_swa, got None")
    if v_swa is not None:
        _tensor("v_swa", v_swa, "[B, W, Hkv, Dv]", [B, W, Hkv, v.shape[3]], like=q)


def check_nsa_decode(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, cache_seqlens, k_swa, v_swa, block_len,
                     stride, select_size, num_selected, num_init, num_local, window, scale) -> None:
    check_selection_params(block_len, stride, select_size, num_selected, num_init, num_local)
    check_window(window)
    check_scale(scale)
    B, _, _, _ = _query(q, T=1)
    Hkv, Dv = _keys(q, k, v, "k", "v", None, "S")
    S = k.shape[1]
    if S == 0:
        raise ValueError(f"k: expected shape [B, S, Hkv, Dk] with S >= 1 cached tokens, got {list(k.shape)}")
    _keys(q, k_cmp, v_cmp, "k_cmp", "v_cmp", None, "Sc", Hkv=Hkv, Dv=Dv)
    _window_cache(q, k, v, k_swa, v_swa, window)
    _gates(q, {"g_cmp": g_cmp, "g_slc": g_slc, "g_swa": g_swa}, 1)
    longest = S
    if cache_seqlens is not None:
        _tensor("cache_seqlens", cache_seqlens, "[B]", [B], dtypes=INDEX_DTYPES, like=q)
        if cache_seqlens.is_cuda and torch.cuda.is_current_stream_capturing():
            return  # reading the values would sync the device, which graph capture forbids
        lo, hi = int(cache_seqlens.min()), int(cache_seqlens.max())
        if lo < 1 or hi > S:
            raise ValueError(f"cache_seqlens: expected values in [1, S={S}] (valid tokens including the "
                             f"new one), got min {lo}, max {hi}")
        longest = hi
    _enough_compressed("k_cmp", k_cmp.shape[1], longest, block_len, stride)
