"""Native Sparse Attention: the public API. Validates inputs, then dispatches on ``impl``.

Every function takes ``impl="auto" | "reference" | "triton"``: ``auto`` runs the Triton kernels on
CUDA tensors and the PyTorch reference (``nsa_eval.kernels.reference``) otherwise; ``triton`` on CPU
tensors is allowed only under Triton's interpreter (``TRITON_INTERPRET=1``). Inputs are checked
before any compute: a bad rank, shape, dtype, device or parameter raises ``ValueError`` naming the
argument and the expected shape. The semantics (compression visibility, geometric-overlap block
importance, forced blocks, tie-break) are documented in ``reference.py``.

Shapes use the flash-attn layout; ``Hq = G * Hkv``; ``Dk`` (q/k) may differ from ``Dv``.

- ``compressed_attention(q[B,T,Hq,Dk], k_cmp[B,Tc,Hkv,Dk], v_cmp[B,Tc,Hkv,Dv])``
  ``-> (o[B,T,Hq,Dv], lse[B,T,Hq] float32)``
- ``select_blocks(q, k_cmp) -> int32[B,T,Hkv,num_selected]`` ascending, ``-1`` padded
- ``selected_attention(q, k[B,T,Hkv,Dk], v[B,T,Hkv,Dv], block_indices[B,T,Hkv,n]) -> o[B,T,Hq,Dv]``
- ``sliding_window_attention(q, k, v) -> o[B,T,Hq,Dv]``
- ``nsa_attention(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa[B,T,Hq]) -> o[B,T,Hq,Dv]``
- ``nsa_decode(q[B,1,Hq,Dk], k[B,S,Hkv,Dk], v, k_cmp[B,Sc,Hkv,Dk], v_cmp, gates[B,1,Hq],``
  ``cache_seqlens[B]) -> o[B,1,Hq,Dv]``

The Triton versions live in ``compression.py`` (``compressed_attention``), ``importance.py``
(``select_blocks``), ``selection.py`` (``selected_attention``), ``window.py`` (``sliding_window_attention``),
``prefill.py`` (``nsa_attention``: the branches and gates as one autograd op) and ``decode.py``
(``nsa_decode``), each with the reference's signature minus ``impl``. They choose their paths from the
shapes and the device; the one choice left to the caller is ``nsa_attention``'s ``gate_in_branches``
(backward memory against time, for training at long context).
"""

from __future__ import annotations

import importlib

import torch

from nsa_eval.kernels import _validate, reference

__all__ = [
    "compressed_attention",
    "nsa_attention",
    "nsa_decode",
    "select_blocks",
    "selected_attention",
    "sliding_window_attention",
]

# public name -> module of its Triton version
_TRITON_MODULES = {
    "compressed_attention": "nsa_eval.kernels.compression",
    "select_blocks": "nsa_eval.kernels.importance",
    "selected_attention": "nsa_eval.kernels.selection",
    "sliding_window_attention": "nsa_eval.kernels.window",
    "nsa_attention": "nsa_eval.kernels.prefill",
    "nsa_decode": "nsa_eval.kernels.decode",
}


def _implementation(name: str, impl: str, q: torch.Tensor, dv: int | None = None):
    """The Triton or the reference version of ``name``; Triton checks its head dims (Dk, and dv).
    The Triton modules are imported on first use: importing this package compiles nothing."""
    if _validate.check_impl(impl, q) == "triton":
        _validate.check_installed_triton()
        _validate.check_triton_head_dims(q, dv)
        return getattr(importlib.import_module(_TRITON_MODULES[name]), name)
    return getattr(reference, name)


def compressed_attention(q, k_cmp, v_cmp, *, block_len=32, stride=16, scale=None, impl="auto"):
    """Attention over compressed keys/values.

    Args:
        q: ``[B, T, Hq, Dk]``; k_cmp: ``[B, Tc, Hkv, Dk]``; v_cmp: ``[B, Tc, Hkv, Dv]``. Compressed block
            ``i`` covers tokens ``[i*stride, i*stride + block_len)``; query ``t`` sees it when
            ``i*stride + block_len - 1 <= t``.
        block_len, stride: compression geometry (paper: 32, 16; fla checkpoints: 64, 64).
        scale: default ``1 / sqrt(Dk)``. impl: ``auto``, ``reference`` or ``triton``.

    Returns:
        o ``[B, T, Hq, Dv]`` (zero where no block is visible), lse ``[B, T, Hq]`` float32 (``-inf`` there).
    """
    _validate.check_compressed_attention(q, k_cmp, v_cmp, block_len, stride, scale)
    fn = _implementation("compressed_attention", impl, q, v_cmp.shape[-1])
    return fn(q, k_cmp, v_cmp, block_len=block_len, stride=stride, scale=scale)


def select_blocks(q, k_cmp, *, block_len=32, stride=16, select_size=64, num_selected=16, num_init=1,
                  num_local=2, scale=None, impl="auto"):
    """Top blocks per query and KV head, from the compression scores (no gradient).

    Args:
        q: ``[B, T, Hq, Dk]``; k_cmp: ``[B, Tc, Hkv, Dk]``.
        block_len, stride, select_size, num_selected, num_init, num_local: see ``reference``.
        scale: default ``1 / sqrt(Dk)``. impl: ``auto``, ``reference`` or ``triton``.

    Returns:
        int32 ``[B, T, Hkv, num_selected]``, ascending, ``-1`` padded at the end.
    """
    _validate.check_select_blocks(q, k_cmp, block_len, stride, select_size, num_selected, num_init,
                                  num_local, scale)
    fn = _implementation("select_blocks", impl, q)
    return fn(q, k_cmp, block_len=block_len, stride=stride, select_size=select_size,
              num_selected=num_selected, num_init=num_init, num_local=num_local, scale=scale)


def selected_attention(q, k, v, block_indices, *, select_size=64, scale=None, impl="auto"):
    """Attention over the tokens of the selected blocks, causal inside the block holding ``t``.

    Args:
        q: ``[B, T, Hq, Dk]``; k: ``[B, T, Hkv, Dk]``; v: ``[B, T, Hkv, Dv]``.
        block_indices: int32/int64 ``[B, T, Hkv, n]``, ``-1`` for padding.
        select_size: block length. scale: default ``1 / sqrt(Dk)``. impl: as above.

    Returns:
        o ``[B, T, Hq, Dv]``.
    """
    _validate.check_selected_attention(q, k, v, block_indices, select_size, scale)
    fn = _implementation("selected_attention", impl, q, v.shape[-1])
    return fn(q, k, v, block_indices, select_size=select_size, scale=scale)


def sliding_window_attention(q, k, v, *, window=512, scale=None, impl="auto"):
    """Causal attention over keys ``t - window + 1 .. t``.

    Args:
        q: ``[B, T, Hq, Dk]``; k: ``[B, T, Hkv, Dk]``; v: ``[B, T, Hkv, Dv]``.
        window: keys per query, itself included. scale: default ``1 / sqrt(Dk)``. impl: as above.

    Returns:
        o ``[B, T, Hq, Dv]``.
    """
    _validate.check_sliding_window_attention(q, k, v, window, scale)
    fn = _implementation("sliding_window_attention", impl, q, v.shape[-1])
    return fn(q, k, v, window=window, scale=scale)


def nsa_attention(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, *, k_swa=None, v_swa=None, block_len=32,
                  stride=16, select_size=64, num_selected=16, num_init=1, num_local=2, window=512,
                  scale=None, gate_in_branches=False, return_block_indices=False, impl="auto"):
    """NSA for prefill and training: ``g_cmp * o_cmp + g_slc * o_slc + g_swa * o_swa``.

    Args:
        q: ``[B, T, Hq, Dk]``.
        k, v: selection-branch keys/values ``[B, T, Hkv, Dk]``, ``[B, T, Hkv, Dv]``.
        k_cmp, v_cmp: compressed keys/values ``[B, Tc, Hkv, Dk]``, ``[B, Tc, Hkv, Dv]``.
        g_cmp, g_slc, g_swa: gates ``[B, T, Hq]`` (same dtype as q).
        k_swa, v_swa: window-branch keys/values (default ``k``, ``v``), shaped like ``k``, ``v``.
        block_len, stride, select_size, num_selected, num_init, num_local, window: NSA parameters
            (paper defaults). scale: default ``1 / sqrt(Dk)``.
        gate_in_branches: for training at long context (Triton only; the result is the same): the
            backward applies each branch's gate inside that branch's kernels instead of writing three
            gated copies of the output gradient. At 64k tokens, 64/4 heads, d = 128 on an H200, the
            forward+backward's peak memory above its inputs drops from 9.58 to 7.49 GiB and its time
            rises from 128.1 to 136.6 ms, hence off by default.
        return_block_indices: also return the int32 ``[B, T, Hkv, num_selected]`` selected blocks.
        impl: ``auto``, ``reference`` or ``triton`` (``prefill.nsa_attention``: the Triton branches
            and gates as one autograd op).

    Returns:
        o ``[B, T, Hq, Dv]`` (and the block indices if asked).
    """
    _validate.check_nsa_attention(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, k_swa, v_swa, block_len,
                                  stride, select_size, num_selected, num_init, num_local, window, scale)
    _validate.check_flag("gate_in_branches", gate_in_branches)
    params = dict(block_len=block_len, stride=stride, select_size=select_size, num_selected=num_selected,
                  num_init=num_init, num_local=num_local, window=window, scale=scale)
    fn = _implementation("nsa_attention", impl, q, v.shape[-1])
    if fn is not reference.nsa_attention:  # a choice of the Triton backward; the reference's is autograd's
        params["gate_in_branches"] = gate_in_branches
    return fn(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, k_swa=k_swa, v_swa=v_swa,
              return_block_indices=return_block_indices, **params)


def nsa_decode(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, *, cache_seqlens=None, k_swa=None, v_swa=None,
               block_len=32, stride=16, select_size=64, num_selected=16, num_init=1, num_local=2, window=512,
               scale=None, return_block_indices=False, impl="auto"):
    """NSA for one new query per sequence against a cache of raw and compressed keys/values.

    Args:
        q: ``[B, 1, Hq, Dk]``.
        k, v: cached selection-branch keys/values ``[B, S, Hkv, Dk]``, ``[B, S, Hkv, Dv]``, the new
            token included.
        k_cmp, v_cmp: cached compressed keys/values ``[B, Sc, Hkv, Dk]``, ``[B, Sc, Hkv, Dv]``.
        g_cmp, g_slc, g_swa: gates ``[B, 1, Hq]``.
        cache_seqlens: int32 ``[B]`` valid tokens per sequence including the new one (default ``S``);
            the query sits at position ``cache_seqlens - 1``; cache entries beyond it are ignored.
        k_swa, v_swa: window keys/values ``[B, W, Hkv, Dk]``, ``[B, W, Hkv, Dv]`` (default ``k``, ``v``):
            position ``p`` in row ``p % W``, so ``W = S`` is laid out like ``k``, ``v`` and ``W >= window``
            is a ring of the last ``W`` positions (the window branch reads no older key).
        block_len, stride, select_size, num_selected, num_init, num_local, window, scale: as in
            ``nsa_attention``. impl: ``auto``, ``reference`` or ``triton``.
        return_block_indices: also return the int32 ``[B, 1, Hkv, num_selected]`` selected blocks.

    Returns:
        o ``[B, 1, Hq, Dv]``, equal to row ``cache_seqlens - 1`` of ``nsa_attention`` on the cache
        (and the block indices if asked). Checking ``cache_seqlens`` values costs one host sync,
        skipped while a CUDA graph is being captured.
    """
    _validate.check_nsa_decode(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, cache_seqlens, k_swa, v_swa,
                               block_len, stride, select_size, num_selected, num_init, num_local, window,
                               scale)
    fn = _implementation("nsa_decode", impl, q, v.shape[-1])
    return fn(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, cache_seqlens=cache_seqlens, k_swa=k_swa,
              v_swa=v_swa, block_len=block_len, stride=stride, select_size=select_size,
              num_selected=num_selected, num_init=num_init, num_local=num_local, window=window, scale=scale,
              return_block_indices=return_block_indices)
