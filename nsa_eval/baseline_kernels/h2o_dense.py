"""H2O's prompt attended densely (`sparse_prefill: false`, and the `budget` leading queries of a sparse
prefill): causal attention, and the mass every key received, the state that decode's eviction reads.

The controller's chunked path attends to every visible key and adds each query's probabilities to the
running mass, so after a prompt of T queries (no cached keys)

    mass[b, h, s] = sum over t >= s of softmax_t(s) = sum over t >= s of exp(scale * q_t . k_s - lse_t),

float32, with `lse_t` the natural log-sum-exp of query t's scaled scores. No key is evicted: H2O's
reference code (`H2OKVCache_LayerWise`) likewise attends densely to the prompt and sums its attention
into the heavy-hitter scores, then evicts at decode. Given the lse, the mass is one pass over the causal
score matrix without the `P @ V` product, and exact, not an estimate: `key_mass` runs it per block of
keys over all later queries, summing `exp2` of each score tile into a register tile and across it once
at the end.

The attention and its lse come from the kernel that `F.scaled_dot_product_attention` itself picks
(cuDNN or FlashAttention, asked for the lse it computes anyway; checked once against the reference on
the first rows of a call, `_sdpa_lse`), else from `_lse_fwd_kernel`, a plain online-softmax forward
that returns it. So the dense prefill costs full attention plus one pass of `q . k` and `exp`.

Shapes: q `[B, Hq, T, D]`, k/v `[B, Hkv, T, D|Dv]` (unpadded, no cached keys), `Hq = G * Hkv`, query
head h reads KV head `h // G`; out `[B, Hq, T, Dv]` (q's dtype); lse and mass `[B, Hq, T]` float32.
`dense_prefill_reference`, `attention_lse_reference` and `key_mass_reference` are the PyTorch versions.
"""

from __future__ import annotations

import math
import warnings

import torch
import triton
import triton.language as tl
from torch import Tensor

from nsa_eval.baseline_kernels.h2o_prefill import _load_rows
from nsa_eval.kernels._triton_utils import (
    LOG2E,
    cdiv,
    dot,
    interpreting,
    launcher,
    online_softmax_step,
    online_softmax_step_full,
    pow2,
    softmax_result,
    softmax_start,
)

# Launch constants: the mass pass holds MASS_KEYS keys and streams MASS_QUERIES queries a step (the best
# of tests/methods/test_h2o_dense.py::test_gpu_mass_sweep on an H100: 0.84x SDPA's causal forward at 32k,
# against 0.91x with 128 keys; one exp2 per score bounds both); the fallback forward FWD_ROWS queries
# against FWD_KEYS keys a step.
MASS_KEYS = 64
MASS_QUERIES = 64
MASS_WARPS = 4
FWD_ROWS = 128
FWD_KEYS = 64
FWD_WARPS = 8
_CHECK_ROWS = 256  # queries of a call that `_sdpa_lse` compares once with the reference
_SDPA_CHECKED: dict = {}  # (backend, dtype, layout, device) -> whether its lse matched the reference


# ----------------------------------------------------------------------------------------------------------
# References
# ----------------------------------------------------------------------------------------------------------


def _grouped_scores(q: Tensor, k: Tensor) -> Tensor:
    """q `[B, Hq, T, D]`, k `[B, Hkv, S, D]` -> `q . k` `[B, Hq, T, S]` float32, k not repeated per group."""
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    return (q.float().reshape(B, Hkv, (Hq // Hkv) * T, D) @ k.float().transpose(-1, -2)).view(B, Hq, T, S)


def attention_lse_reference(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Causal attention `[B, Hq, T, Dv]` (float32) and its natural log-sum-exp `[B, Hq, T]` (small T only)."""
    B, Hq, T, _ = q.shape
    Hkv = k.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    s = (_grouped_scores(q, k) * scale).masked_fill(~causal, -math.inf)  # [B, Hq, T, T]
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None])
    out = (p.reshape(B, Hkv, -1, T) @ v.float()).view(B, Hq, T, -1)
    return out, lse


def key_mass_reference(q: Tensor, k: Tensor, lse: Tensor, scale: float) -> Tensor:
    """`[B, Hq, T]` float32: each key's probabilities summed over the queries at or after it (small T only).

    Args:
        q: `[B, Hq, T, D]`; k: `[B, Hkv, T, D]`; lse: `[B, Hq, T]` the queries' natural log-sum-exp.
    """
    T = q.shape[2]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    s = (_grouped_scores(q, k) * scale).masked_fill(~causal, -math.inf)  # [B, Hq, T, T]
    return torch.exp(s - lse.float()[..., None]).sum(2)


def dense_prefill_reference(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """`dense_prefill` in PyTorch: out `[B, Hq, T, Dv]` (q's dtype) and mass `[B, Hq, T]` float32."""
    out, lse = attention_lse_reference(q, k, v, scale)
    return out.to(q.dtype), key_mass_reference(q, k, lse, scale)


# ----------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _rows(base, rows, m_rows, stride, DIM: tl.constexpr, BDIM: tl.constexpr, UPCAST: tl.constexpr):
    # rows `rows` [R] of a [T, DIM] head, rows where m_rows is false as 0: [R, BDIM] (the walk's loader)
    return _load_rows(base, rows, m_rows, stride, tl.arange(0, BDIM), DIM, UPCAST)


@triton.jit
def _key_mass_kernel(
    Q, K, NEG_LSE2, MASS,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t,
    T, T_PAD, HQ, G, scale_log2,
    D: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr, BQ: tl.constexpr, UPCAST: tl.constexpr,
):
    # Grid (cdiv(T, BK), B * Hq): keys k0 .. k0 + BK of one query head against every query at or after
    # them. p = exp2(s * scale_log2 + NEG_LSE2) is summed into acc [BK, BQ] tile by tile and across
    # acc's columns once at the end. NEG_LSE2 is contiguous [B, Hq, T_PAD] float32, minus the lse in
    # log2 units, -inf past T (T_PAD a multiple of BQ: its loads need no mask, and a query past T adds
    # exp2(-inf) = 0); MASS is contiguous [B, Hq, T] float32.
    i_k = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = (i_bh // HQ).to(tl.int64)
    i_h = i_bh % HQ
    q_base = Q + i_b * sq_b + i_h * sq_h
    k_base = K + i_b * sk_b + (i_h // G) * sk_h
    lse_ptr = NEG_LSE2 + i_bh.to(tl.int64) * T_PAD
    k0 = i_k * BK
    keys = k0 + tl.arange(0, BK)
    k = _rows(k_base, keys, keys < T, sk_t, D, BD, UPCAST)  # [BK, BD]
    o_q = tl.arange(0, BQ)
    acc = tl.zeros([BK, BQ], tl.float32)
    diagonal_end = tl.minimum((k0 + BK + BQ - 1) // BQ * BQ, T)
    for q0 in range(k0 // BQ * BQ, diagonal_end, BQ):  # tiles that hold some key's own query
        queries = q0 + o_q
        q = _rows(q_base, queries, queries < T, sq_t, D, BD, UPCAST)  # [BQ, BD]
        neg_lse = tl.load(lse_ptr + queries)
        s = dot(k, tl.trans(q)) * scale_log2  # [BK, BQ]
        acc += tl.exp2(tl.where(keys[:, None] <= queries[None, :], s + neg_lse[None, :], float("-inf")))
    for q0 in range(diagonal_end, T, BQ):  # every query after every key of the block
        queries = q0 + o_q
        q = _rows(q_base, queries, queries < T, sq_t, D, BD, UPCAST)
        neg_lse = tl.load(lse_ptr + queries)
        acc += tl.exp2(dot(k, tl.trans(q)) * scale_log2 + neg_lse[None, :])
    tl.store(MASS + i_bh.to(tl.int64) * T + keys, tl.sum(acc, 1), mask=keys < T)


@triton.jit
def _lse_fwd_kernel(
    Q, K, V, O, LSE,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, so_b, so_h, so_t,
    T, HQ, G, scale_log2,
    D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BT: tl.constexpr,
    BN: tl.constexpr, UPCAST: tl.constexpr,
):
    # Grid (cdiv(T, BT), B * Hq): causal attention of queries t0 .. t0 + BT (BN divides BT, so the key
    # tiles below t0 are whole) and their natural lse to LSE, contiguous [B, Hq, T] float32.
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = (i_bh // HQ).to(tl.int64)
    i_h = i_bh % HQ
    k_base = K + i_b * sk_b + (i_h // G) * sk_h
    v_base = V + i_b * sv_b + (i_h // G) * sv_h
    t0 = i_t * BT
    rows = t0 + tl.arange(0, BT)
    q = _rows(Q + i_b * sq_b + i_h * sq_h, rows, rows < T, sq_t, D, BD, UPCAST)  # [BT, BD]
    o_n = tl.arange(0, BN)
    m_i, l_i, acc = softmax_start(BT, BDV)
    for k0 in range(0, t0, BN):
        keys = k0 + o_n
        k = _rows(k_base, keys, keys < T, sk_t, D, BD, UPCAST)  # [BN, BD]
        v = _rows(v_base, keys, keys < T, sv_t, DV, BDV, UPCAST)  # [BN, BDV]
        m_i, l_i, acc = online_softmax_step_full(dot(q, tl.trans(k)), v, m_i, l_i, acc, scale_log2)
    for k0 in range(t0, tl.minimum(t0 + BT, T), BN):  # the diagonal
        keys = k0 + o_n
        k = _rows(k_base, keys, keys < T, sk_t, D, BD, UPCAST)
        v = _rows(v_base, keys, keys < T, sv_t, DV, BDV, UPCAST)
        valid = (keys[None, :] <= rows[:, None]) & (keys < T)[None, :]
        m_i, l_i, acc = online_softmax_step(dot(q, tl.trans(k)), valid, v, m_i, l_i, acc, scale_log2)
    o, lse = softmax_result(m_i, l_i, acc)
    o_dv = tl.arange(0, BDV)
    o_ptrs = O + i_b * so_b + i_h * so_h + rows[:, None].to(tl.int64) * so_t + o_dv[None, :]
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=(rows < T)[:, None] & (o_dv < DV)[None, :])
    tl.store(LSE + i_bh.to(tl.int64) * T + rows, lse, mask=rows < T)


# ----------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------


def _strides(x: Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


def _unit_last(*xs: Tensor) -> tuple[Tensor, ...]:
    return tuple(x if x.stride(-1) == 1 else x.contiguous() for x in xs)


def key_mass(q: Tensor, k: Tensor, lse: Tensor, scale: float, *, block_keys: int = MASS_KEYS,
             block_queries: int = MASS_QUERIES, num_warps: int = MASS_WARPS) -> Tensor:
    """`key_mass_reference` in one Triton launch.

    Args:
        q: `[B, Hq, T, D]`; k: `[B, Hkv, T, D]` (CUDA, or CPU under TRITON_INTERPRET=1).
        lse: `[B, Hq, T]` float32, the queries' natural log-sum-exp (`attention_lse`).
        block_keys, block_queries: keys a program holds and queries a step (powers of two, >= 16).

    Returns:
        mass `[B, Hq, T]` float32.
    """
    B, Hq, T, D = q.shape
    q, k = _unit_last(q, k)
    mass = torch.empty(B, Hq, T, dtype=torch.float32, device=q.device)
    if interpreting():
        block_keys, block_queries = min(block_keys, 16), min(block_queries, 16)
    # minus the lse in log2 units, padded with -inf to whole query tiles: the pass's loop loads it
    # without a mask and adds it in the score's FFMA, with no multiply or negation of its own
    t_pad = cdiv(T, block_queries) * block_queries
    neg_lse2 = torch.full((B, Hq, t_pad), -math.inf, dtype=torch.float32, device=q.device)
    neg_lse2[..., :T] = lse.float() * -LOG2E
    launcher(_key_mass_kernel)[(cdiv(T, block_keys), B * Hq)](
        q, k, neg_lse2, mass, *_strides(q), *_strides(k), T, t_pad, Hq, Hq // k.shape[1], scale * LOG2E,
        D=D, BD=pow2(D), BK=block_keys, BQ=block_queries, UPCAST=interpreting(), num_warps=num_warps,
    )
    return mass


def attention_lse_triton(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """`attention_lse_reference` by `_lse_fwd_kernel`: out `[B, Hq, T, Dv]` (q's dtype), lse `[B, Hq, T]`."""
    B, Hq, T, D = q.shape
    DV = v.shape[-1]
    q, k, v = _unit_last(q, k, v)
    out = torch.empty(B, Hq, T, DV, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, T, dtype=torch.float32, device=q.device)
    rows, keys = (16, 16) if interpreting() else (FWD_ROWS, FWD_KEYS)
    launcher(_lse_fwd_kernel)[(cdiv(T, rows), B * Hq)](
        q, k, v, out, lse, *_strides(q), *_strides(k), *_strides(v), *_strides(out),
        T, Hq, Hq // k.shape[1], scale * LOG2E,
        D=D, DV=DV, BD=pow2(D), BDV=pow2(DV), BT=rows, BN=keys, UPCAST=interpreting(),
        num_warps=FWD_WARPS, num_stages=1 if q.dtype == torch.float32 else 2,
    )
    return out, lse


def _sdpa_backend(q: Tensor, k: Tensor, v: Tensor, scale: float):
    """The backend `F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)` takes here."""
    from torch.nn.attention import SDPBackend

    try:
        return SDPBackend(torch._fused_sdp_choice(q, k, v, None, 0.0, True, scale=scale, enable_gqa=True))
    except (AttributeError, RuntimeError, TypeError, ValueError):  # a torch without the query
        return None


def _sdpa_with_lse(backend, q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor] | None:
    """SDPA's own kernel (cuDNN or FlashAttention, GQA without repeating k and v) asked for its lse:
    out `[B, Hq, T, Dv]`, lse `[B, Hq, T]` float32; None for another backend."""
    from torch.nn.attention import SDPBackend

    B, Hq, T, _ = q.shape
    if backend == SDPBackend.CUDNN_ATTENTION:
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False,
                                                                      scale=scale)[:2]
    elif backend == SDPBackend.FLASH_ATTENTION:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False,
                                                                      scale=scale)[:2]
    else:
        return None
    return out, lse.reshape(B, Hq, -1)[..., :T].float()


def _sdpa_lse(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor] | None:
    """`attention_lse` through SDPA's own kernel, where that kernel returns the lse this file expects: the
    first `_CHECK_ROWS` queries are compared once per (backend, dtype, layout) with the reference (a
    private op's lse layout or units could differ between torch releases). None: take the Triton forward."""
    backend = _sdpa_backend(q, k, v, scale)
    if backend is None:
        return None
    key = (backend, q.dtype, tuple(x.stride(1) > x.stride(2) for x in (q, k, v)), str(q.device))
    ok = _SDPA_CHECKED.get(key)
    if ok is None:
        n = min(q.shape[2], _CHECK_ROWS)
        head = [x[:1, :, :n] for x in (q, k, v)]
        try:
            got = _sdpa_with_lse(backend, *head, scale)
        except RuntimeError:
            got = None
        ok = False
        if got is not None:
            out_ref, lse_ref = attention_lse_reference(*head, scale)
            ok = bool((got[1] - lse_ref).abs().max() < 1e-2 and (got[0].float() - out_ref).abs().max() < 5e-2)
        if not ok:
            warnings.warn(f"h2o dense prefill: SDPA's {backend.name} kernel did not return the expected "
                          "log-sum-exp; using the Triton forward instead (slower)", stacklevel=3)
        _SDPA_CHECKED[key] = ok
    return _sdpa_with_lse(backend, q, k, v, scale) if ok else None



def attention_lse(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Causal attention and its natural log-sum-exp: out `[B, Hq, T, Dv]` (q's dtype), lse `[B, Hq, T]`
    float32. On a GPU SDPA's own kernel (`_sdpa_lse`), else `attention_lse_triton`."""
    if q.is_cuda and not interpreting():
        got = _sdpa_lse(q, k, v, scale)
        if got is not None:
            return got
    return attention_lse_triton(q, k, v, scale)


def dense_prefill(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Dense causal attention over an unpadded prompt with no cached keys, and the mass H2O's state keeps.

    Args:
        q: `[B, Hq, T, D]`; k, v: `[B, Hkv, T, D|Dv]`.
        scale: the softmax scale.

    Returns:
        out `[B, Hq, T, Dv]` (q's dtype) and mass `[B, Hq, T]` float32 (`key_mass_reference`).
    """
    from nsa_eval.kernels import _validate

    _validate.check_installed_triton()
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"dense_prefill: needs as many keys as queries (no cached keys), got {k.shape[2]} "
                         f"keys for {q.shape[2]} queries")
    out, lse = attention_lse(q, k, v, scale)
    return out, key_mass(q, k, lse, scale)
