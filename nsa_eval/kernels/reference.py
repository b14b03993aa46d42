"""Native Sparse Attention in plain PyTorch: the ground truth the Triton kernels are tested against.

NSA (Yuan et al., "Native Sparse Attention", arXiv 2502.11089, Sec. 3.3) lets each query t attend
through three branches and mixes them with per-token, per-head gates from the caller:

    o_t = g_cmp * o_cmp + g_slc * o_slc + g_swa * o_swa

Tensors use the flash-attn layout ``[B, T, H, D]``. GQA: query head ``h`` reads KV head ``h // G`` with
``G = Hq / Hkv`` (any integer >= 1). The q/k head dim ``Dk`` may differ from the v head dim ``Dv``.
Every number below is a parameter; the paper's defaults are in brackets.

Compression (Eq. 7). Compressed block ``i`` covers tokens ``[i*d, i*d + l)`` (``l = block_len`` [32],
``d = stride`` [16]). The caller compresses (the learnable MLP belongs to the model) and passes
``k_cmp``/``v_cmp`` ``[B, Tc, Hkv, D]``. Query ``t`` sees block ``i`` only when the whole block lies at
or before it: ``i*d + l - 1 <= t``. A query that sees no block gets a zero output and ``lse = -inf``.
flash-linear-attention checkpoints (mean pooling, ``l = d = l' = 64``) run through the same code.

Selection (Eq. 8-12). Selection blocks of ``l' = select_size`` [64] tokens; block ``j`` covers
``[j*l', (j+1)*l')``. Importance of block ``j`` for query ``t``::

    p_slc[t, j] = sum_i p_cmp[t, i] * |block_i ∩ block_j| / d

where ``p_cmp`` is the compression branch's softmax probability (zero for blocks ``t`` cannot see).
This is the *geometric* overlap: with l=32, d=16, l'=64 the compressed blocks ``4j-1 .. 4j+3``
overlap block ``j`` with weights 1, 2, 2, 2, 1. The paper's Eq. 9 writes the index range
``4j-4 .. 4j`` instead, which scores block ``j`` with compressed blocks that mostly cover block
``j-1``; we follow the geometry because the importance should describe the tokens that block ``j``
actually holds (XunhaoLai's kernels make the same choice). Dividing by ``d`` only rescales (the
weights become small integers); it does not change any ranking. Importances are summed over the
``G`` query heads of a KV head (Eq. 10), so a GQA group shares its blocks.

Query ``t`` may use blocks ``0 .. t // l'`` (no block starting after ``t``). It keeps
``n = num_selected`` [16] of them: always the first ``num_init`` [1] blocks and the ``num_local``
[2] most recent ones (the block holding ``t`` and the one before it), the rest by importance. Ties
go to the lower block index (a stable descending sort). With fewer than ``n`` blocks available it
keeps all of them. Indices are int32 ``[B, T, Hkv, n]``, sorted ascending, padded with ``-1`` at the
end. Inside the block holding ``t`` a token-level causal mask applies.

Sliding window: keys ``t - w + 1 .. t`` (``w = window`` [512]).

Every function is differentiable (``select_blocks`` returns indices, no gradient). Computation runs
in float32 and returns the input dtype (``lse`` stays float32). Queries are processed in chunks (at
most ``query_chunk`` queries and about ``SCORES_PER_CHUNK`` scores) so memory grows with the chunk,
not with ``T^2``; with gradients enabled each chunk is checkpointed (recomputed in backward) for the
same reason. Each branch is one masked softmax over the keys a chunk can reach, the mask built from
the definitions above: short code to check by eye, and fast enough on a CPU for ~4k-token evals.
Inputs are assumed valid: the public dispatcher in ``nsa_eval.kernels`` checks them first.
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

QUERY_CHUNK = 256  # most queries per chunk, the default of every function's `query_chunk`
SCORES_PER_CHUNK = 2**24  # at most this many float32 scores per chunk (64 MiB) at long T


# --------------------------------------------------------------------------------------------------
# Shared pieces
# --------------------------------------------------------------------------------------------------


def _scale_or_default(scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def _masked_softmax(scores: torch.Tensor, mask: torch.Tensor, with_lse: bool):
    """Softmax over the last dim of ``scores`` where ``mask`` is True.

    Rows with no True entry get probabilities 0 and lse ``-inf``, with finite (zero) gradients.

    Args:
        scores: float32 ``[..., S]``, overwritten.
        mask: bool, broadcastable to ``scores``.
        with_lse: also compute the lse (one more pass over the scores).

    Returns:
        p: ``[..., S]`` probabilities; lse: ``[...]`` natural-log sum of exp over the masked entries,
        or None.
    """
    if scores.shape[-1] == 0:  # no keys at all (e.g. no compressed block yet)
        return scores, scores.new_full(scores.shape[:-1], float("-inf"))
    empty = ~mask.any(dim=-1, keepdim=True)  # [..., 1] rows that see nothing
    # In place: ``scores`` is a fresh matmul output that autograd does not need.
    scores = scores.masked_fill_(~(mask | empty), float("-inf"))  # an empty row keeps all its scores,
    p = torch.softmax(scores, dim=-1)  # so its softmax is finite, then zeroed
    if empty.any():
        p = p.masked_fill(empty, 0.0)
    if not with_lse:
        return p, None
    lse = torch.logsumexp(scores, dim=-1, keepdim=True).masked_fill(empty, float("-inf"))  # [..., 1]
    return p, lse.squeeze(-1)


def _attend(q, k, v, mask, scale, with_lse=False):
    """Masked softmax attention of a chunk of queries over a set of keys.

    Args:
        q: ``[B, C, Hq, Dk]`` float32.
        k: ``[B, S, Hkv, Dk]`` float32 keys; v: ``[B, S, Hkv, Dv]`` values.
        mask: bool ``[B, C, Hkv or 1, S]``: which keys each query (and KV head) may use.
        scale: multiplies ``q . k``.
        with_lse: also return the lse.

    Returns:
        o: ``[B, C, Hq, Dv]`` (zero where a query sees no key), lse: ``[B, C, Hq]`` float32 or None,
        p: ``[B, C, Hkv, G, S]`` the probabilities.
    """
    B, C, Hq, Dk = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    # KV head outermost so both matmuls run on contiguous [B, Hkv, C*G, S] scores without copies.
    q = q.reshape(B, C, Hkv, G, Dk).transpose(1, 2).reshape(B, Hkv, C * G, Dk) * scale  # [B, Hkv, C*G, Dk]
    scores = q @ k.permute(0, 2, 3, 1)  # [B, Hkv, C*G, S]
    mask = mask.transpose(1, 2).unsqueeze(3)  # [B, Hkv or 1, C, 1, S]
    p, lse = _masked_softmax(scores.view(B, Hkv, C, G, S), mask, with_lse)  # [B, Hkv, C, G, S]
    o = p.view(B, Hkv, C * G, S) @ v.transpose(1, 2)  # [B, Hkv, C*G, Dv]
    o = o.view(B, Hkv, C, G, -1).transpose(1, 2).reshape(B, C, Hq, -1)  # [B, C, Hq, Dv]
    if lse is not None:
        lse = lse.transpose(1, 2).reshape(B, C, Hq)  # [B, C, Hq]
    return o, lse, p.transpose(1, 2)  # p: [B, C, Hkv, G, S]


def _query_chunks(q: torch.Tensor, query_chunk: int, max_scores: int = SCORES_PER_CHUNK):
    """Yield ``(slice, q_pos)`` over the T query positions of ``q [B, T, Hq, D]``; ``q_pos`` int64 ``[B, C]``.

    A chunk holds at most ``query_chunk`` queries and about ``max_scores`` scores against T keys.
    """
    B, T, Hq, _ = q.shape
    size = max(1, min(query_chunk, max_scores // (B * Hq * T)))
    device = q.device
    for start in range(0, T, size):
        stop = min(T, start + size)
        q_pos = torch.arange(start, stop, device=device).expand(B, -1)  # [B, C]
        yield slice(start, stop), q_pos


def _maybe_checkpoint(fn, *args):
    """Run ``fn(*args)``; under autograd, recompute it in backward instead of keeping activations."""
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in args
    )
    if needs_grad:
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


# --------------------------------------------------------------------------------------------------
# The three branches, on a chunk of queries at absolute positions q_pos
# --------------------------------------------------------------------------------------------------


def _compressed_chunk(q, q_pos, k_cmp, v_cmp, block_len, stride, scale):
    """Compression branch for queries at positions ``q_pos``.

    Args:
        q: ``[B, C, Hq, Dk]`` float32; q_pos: int64 ``[B, C]``.
        k_cmp, v_cmp: ``[B, Tc, Hkv, Dk]``, ``[B, Tc, Hkv, Dv]`` float32.

    Returns:
        o ``[B, C, Hq, Dv]``, lse ``[B, C, Hq]``, p_cmp ``[B, C, Hkv, G, Tc]``.
    """
    Tc = k_cmp.shape[1]
    block_last = torch.arange(Tc, device=q.device) * stride + block_len - 1  # [Tc] last token
    visible = block_last <= q_pos[..., None]  # [B, C, Tc]
    return _attend(q, k_cmp, v_cmp, visible[:, :, None], scale, with_lse=True)


def _overlap_weights(Tc, num_blocks, block_len, stride, select_size, device) -> torch.Tensor:
    """Tokens shared by compressed block i and selection block j, divided by the stride.

    Returns:
        float32 ``[Tc, num_blocks]`` (1, 2, 2, 2, 1 per selection block in the paper's config).
    """
    cmp_start = torch.arange(Tc, device=device) * stride  # [Tc]
    slc_start = torch.arange(num_blocks, device=device) * select_size  # [Ns]
    lo = torch.maximum(cmp_start[:, None], slc_start[None, :])  # [Tc, Ns]
    hi = torch.minimum(cmp_start[:, None] + block_len, slc_start[None, :] + select_size)  # [Tc, Ns]
    return (hi - lo).clamp(min=0).float() / stride


def _select_from_probs(p_cmp, q_pos, num_blocks, block_len, stride, select_size, num_selected,
                       num_init, num_local):
    """Pick the selection blocks of each query from its compression probabilities.

    Args:
        p_cmp: ``[B, C, Hkv, G, Tc]`` compression branch probabilities.
        q_pos: int64 ``[B, C]`` query positions.
        num_blocks: Ns, the number of selection blocks in the key sequence.

    Returns:
        int32 ``[B, C, Hkv, num_selected]``, ascending, ``-1`` padded at the end.
    """
    Tc = p_cmp.shape[-1]
    weights = _overlap_weights(Tc, num_blocks, block_len, stride, select_size, p_cmp.device)
    importance = p_cmp.sum(dim=3) @ weights  # [B, C, Hkv, Ns], summed over the GQA group (Eq. 10)

    block = torch.arange(num_blocks, device=p_cmp.device)  # [Ns]
    current = (q_pos // select_size)[..., None]  # [B, C, 1] block holding t
    available = block <= current  # [B, C, Ns] no block starting after t
    forced = available & ((block < num_init) | (block > current - num_local))  # [B, C, Ns]
    score = importance.masked_fill(forced[:, :, None], float("inf"))
    score = score.masked_fill(~available[:, :, None], float("-inf"))  # [B, C, Hkv, Ns]

    # Stable descending sort: among equal scores the lower block index comes first.
    k = min(num_selected, num_blocks)
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :k]  # [B, C, Hkv, k]
    chosen = torch.gather(score, -1, order) > float("-inf")  # [B, C, Hkv, k]
    order = torch.where(chosen, order, num_blocks)  # unavailable slots sort to the end
    order = order.sort(dim=-1).values
    order = torch.where(order == num_blocks, -1, order)
    if k < num_selected:
        order = torch.nn.functional.pad(order, (0, num_selected - k), value=-1)  # [B, C, Hkv, n]
    return order.to(torch.int32)


def _selected_chunk(q, q_pos, k, v, block_indices, select_size, scale):
    """Selection branch: attend to the tokens of the given blocks, causally masked.

    Negative indices are padding; repeated indices count once; tokens after ``t`` (including all
    of a block starting after ``t``) are masked. A query with no usable token gets zero output.
    The blocks become a token mask over the keys of every block some query of the chunk selected:
    one matmul over those keys is much faster on a CPU than gathering ``n * l'`` keys per query.

    Args:
        q: ``[B, C, Hq, Dk]`` float32; q_pos: int64 ``[B, C]``.
        k, v: ``[B, T, Hkv, Dk]``, ``[B, T, Hkv, Dv]`` float32.
        block_indices: integer ``[B, C, Hkv, n]``.

    Returns:
        o ``[B, C, Hq, Dv]``.
    """
    num_blocks = -(-k.shape[1] // select_size)
    idx = block_indices.long()
    idx = torch.where((idx < 0) | (idx >= num_blocks), num_blocks, idx)  # padding -> spare column
    chosen = torch.zeros(*idx.shape[:-1], num_blocks + 1, dtype=torch.bool, device=q.device)
    chosen.scatter_(-1, idx, True)  # [B, C, Hkv, Ns + 1]
    chosen = chosen[..., :num_blocks]  # [B, C, Hkv, Ns]

    used = chosen.flatten(0, 2).any(0).nonzero().squeeze(1)  # [U] blocks some query selected
    token = (used[:, None] * select_size + torch.arange(select_size, device=q.device)).flatten()  # [U*l']
    token = token[token < k.shape[1]]  # [S] the last block may be partial
    in_block = chosen[..., token // select_size]  # [B, C, Hkv, S]
    causal = token <= q_pos[..., None]  # [B, C, S]
    mask = in_block & causal[:, :, None]  # [B, C, Hkv, S]
    o, _, _ = _attend(q, k[:, token], v[:, token], mask, scale)
    return o


def _window_chunk(q, q_pos, k, v, window, scale):
    """Sliding-window branch: keys ``t - window + 1 .. t``.

    Args:
        q: ``[B, C, Hq, Dk]`` float32; q_pos: int64 ``[B, C]``.
        k, v: ``[B, T, Hkv, Dk]``, ``[B, T, Hkv, Dv]`` float32.

    Returns:
        o ``[B, C, Hq, Dv]``.
    """
    lo = max(0, int(q_pos.min()) - window + 1)
    hi = int(q_pos.max()) + 1
    k_pos = torch.arange(lo, hi, device=q.device)  # [S] only the band this chunk can reach
    diff = q_pos[..., None] - k_pos  # [B, C, S]
    in_window = (diff >= 0) & (diff < window)  # [B, C, S]
    o, _, _ = _attend(q, k[:, lo:hi], v[:, lo:hi], in_window[:, :, None], scale)
    return o


# --------------------------------------------------------------------------------------------------
# Public functions (same names and signatures as the Triton versions, minus ``impl``)
# --------------------------------------------------------------------------------------------------


def compressed_attention(q, k_cmp, v_cmp, *, block_len=32, stride=16, scale=None, query_chunk=QUERY_CHUNK):
    """Attention over compressed keys/values (NSA Eq. 7).

    Args:
        q: queries ``[B, T, Hq, Dk]``; query ``t`` sits at position ``t``.
        k_cmp: compressed keys ``[B, Tc, Hkv, Dk]``; block ``i`` covers ``[i*stride, i*stride + block_len)``.
        v_cmp: compressed values ``[B, Tc, Hkv, Dv]``.
        block_len, stride: compression block length ``l`` and stride ``d``.
        scale: score scale, default ``1 / sqrt(Dk)``.
        query_chunk: most queries computed at once (memory grows with it, not with ``T^2``).

    Returns:
        o: ``[B, T, Hq, Dv]`` in q's dtype, zero for queries that see no compressed block;
        lse: ``[B, T, Hq]`` float32 natural-log sum of exp of the scaled scores (``-inf`` if none).
    """
    Dk = q.shape[-1]
    scale = _scale_or_default(scale, Dk)
    k_cmp, v_cmp = k_cmp.float(), v_cmp.float()

    def chunk(q_chunk, q_pos, k_cmp, v_cmp):
        o, lse, _ = _compressed_chunk(q_chunk.float(), q_pos, k_cmp, v_cmp, block_len, stride, scale)
        return o, lse

    outs, lses = [], []
    for rows, q_pos in _query_chunks(q, query_chunk):
        o, lse = _maybe_checkpoint(chunk, q[:, rows], q_pos, k_cmp, v_cmp)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, dim=1).to(q.dtype), torch.cat(lses, dim=1)  # [B, T, Hq, Dv], [B, T, Hq]


@torch.no_grad()
def select_blocks(q, k_cmp, *, block_len=32, stride=16, select_size=64, num_selected=16, num_init=1,
                  num_local=2, scale=None, query_chunk=QUERY_CHUNK):
    """Choose the selection blocks of every query (NSA Eq. 8-12, geometric overlap, see module doc).

    Args:
        q: queries ``[B, T, Hq, Dk]``.
        k_cmp: compressed keys ``[B, Tc, Hkv, Dk]``.
        block_len, stride: compression geometry; select_size: selection block length ``l'``.
        num_selected: blocks per query ``n``; num_init: leading blocks always kept; num_local: most
            recent blocks always kept (the one holding ``t`` and those before it).
        scale: score scale, default ``1 / sqrt(Dk)``.
        query_chunk: most queries computed at once (memory grows with it, not with ``T^2``).

    Returns:
        int32 ``[B, T, Hkv, num_selected]``: block indices, ascending, ``-1`` padded at the end.
        Shared by the query heads of a GQA group.
    """
    T, Dk = q.shape[1], q.shape[3]
    scale = _scale_or_default(scale, Dk)
    num_blocks = -(-T // select_size)  # ceil: selection blocks in the sequence
    k_cmp = k_cmp.float()
    v_none = k_cmp[..., :1]  # values are irrelevant for the probabilities: a 1-wide dummy
    out = []
    for rows, q_pos in _query_chunks(q, query_chunk):
        _, _, p_cmp = _compressed_chunk(q[:, rows].float(), q_pos, k_cmp, v_none, block_len, stride, scale)
        out.append(_select_from_probs(p_cmp, q_pos, num_blocks, block_len, stride, select_size,
                                      num_selected, num_init, num_local))
    return torch.cat(out, dim=1)  # [B, T, Hkv, n]


def selected_attention(q, k, v, block_indices, *, select_size=64, scale=None, query_chunk=QUERY_CHUNK):
    """Attention over the tokens of selected blocks, with a token-level causal mask.

    Args:
        q: queries ``[B, T, Hq, Dk]``.
        k, v: keys ``[B, T, Hkv, Dk]`` and values ``[B, T, Hkv, Dv]``.
        block_indices: integer ``[B, T, Hkv, n]``; block ``j`` covers tokens ``[j*select_size,
            (j+1)*select_size)``; negative entries are padding, repeats count once.
        select_size: selection block length ``l'``.
        scale: score scale, default ``1 / sqrt(Dk)``.
        query_chunk: most queries computed at once (memory grows with it, not with ``T^2``).

    Returns:
        o: ``[B, T, Hq, Dv]`` in q's dtype (zero for a query with no usable token).
    """
    Dk = q.shape[-1]
    scale = _scale_or_default(scale, Dk)
    k, v = k.float(), v.float()

    def chunk(q_chunk, q_pos, k, v, idx):
        return _selected_chunk(q_chunk.float(), q_pos, k, v, idx, select_size, scale)

    outs = [_maybe_checkpoint(chunk, q[:, rows], q_pos, k, v, block_indices[:, rows])
            for rows, q_pos in _query_chunks(q, query_chunk)]
    return torch.cat(outs, dim=1).to(q.dtype)  # [B, T, Hq, Dv]


def sliding_window_attention(q, k, v, *, window=512, scale=None, query_chunk=QUERY_CHUNK):
    """Causal attention over the last ``window`` keys (``t - window + 1 .. t``).

    Args:
        q: queries ``[B, T, Hq, Dk]``; k, v: ``[B, T, Hkv, Dk]``, ``[B, T, Hkv, Dv]``.
        window: number of keys each query sees, itself included.
        scale: score scale, default ``1 / sqrt(Dk)``.
        query_chunk: most queries computed at once (memory grows with it, not with ``T^2``).

    Returns:
        o: ``[B, T, Hq, Dv]`` in q's dtype.
    """
    Dk = q.shape[-1]
    scale = _scale_or_default(scale, Dk)
    k, v = k.float(), v.float()

    def chunk(q_chunk, q_pos, k, v):
        return _window_chunk(q_chunk.float(), q_pos, k, v, window, scale)

    outs = [_maybe_checkpoint(chunk, q[:, rows], q_pos, k, v)
            for rows, q_pos in _query_chunks(q, query_chunk)]
    return torch.cat(outs, dim=1).to(q.dtype)  # [B, T, Hq, Dv]


def _nsa_chunk(q, q_pos, k, v, k_cmp, v_cmp, k_swa, v_swa, g_cmp, g_slc, g_swa, num_blocks, p):
    """All three branches and the gates for queries at ``q_pos`` (float32 in and out).

    Args:
        q: ``[B, C, Hq, Dk]``; q_pos: int64 ``[B, C]``; gates ``[B, C, Hq]``.
        k, v, k_swa, v_swa: ``[B, S, Hkv, D]``; k_cmp, v_cmp: ``[B, Sc, Hkv, D]``.
        num_blocks: selection blocks in the key sequence; p: dict of the NSA parameters.

    Returns:
        o ``[B, C, Hq, Dv]``, block indices int32 ``[B, C, Hkv, n]``.
    """
    o_cmp, _, p_cmp = _compressed_chunk(q, q_pos, k_cmp, v_cmp, p["block_len"], p["stride"], p["scale"])
    idx = _select_from_probs(p_cmp.detach(), q_pos, num_blocks, p["block_len"], p["stride"],
                             p["select_size"], p["num_selected"], p["num_init"], p["num_local"])
    o_slc = _selected_chunk(q, q_pos, k, v, idx, p["select_size"], p["scale"])
    o_swa = _window_chunk(q, q_pos, k_swa, v_swa, p["window"], p["scale"])
    o = g_cmp[..., None] * o_cmp + g_slc[..., None] * o_slc + g_swa[..., None] * o_swa  # [B, C, Hq, Dv]
    return o, idx


def nsa_attention(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, *, k_swa=None, v_swa=None, block_len=32,
                  stride=16, select_size=64, num_selected=16, num_init=1, num_local=2, window=512,
                  scale=None, return_block_indices=False, query_chunk=QUERY_CHUNK):
    """NSA prefill/training: ``g_cmp * o_cmp + g_slc * o_slc + g_swa * o_swa`` (NSA Eq. 5).

    Args:
        q: queries ``[B, T, Hq, Dk]``.
        k, v: keys/values of the selection branch ``[B, T, Hkv, Dk]``, ``[B, T, Hkv, Dv]``.
        k_cmp, v_cmp: compressed keys/values ``[B, Tc, Hkv, Dk]``, ``[B, Tc, Hkv, Dv]``.
        g_cmp, g_slc, g_swa: gates ``[B, T, Hq]``.
        k_swa, v_swa: keys/values of the window branch, default ``k``, ``v``.
        block_len, stride, select_size, num_selected, num_init, num_local, window: see module doc.
        scale: score scale, default ``1 / sqrt(Dk)``.
        return_block_indices: also return the selected blocks.
        query_chunk: most queries computed at once (memory grows with it, not with ``T^2``).

    Returns:
        o: ``[B, T, Hq, Dv]`` in q's dtype; with ``return_block_indices`` also int32
        ``[B, T, Hkv, num_selected]`` block indices (as ``select_blocks`` returns them).
    """
    Dk = q.shape[-1]
    k_swa = k if k_swa is None else k_swa
    v_swa = v if v_swa is None else v_swa
    params = dict(block_len=block_len, stride=stride, select_size=select_size, num_selected=num_selected,
                  num_init=num_init, num_local=num_local, window=window, scale=_scale_or_default(scale, Dk))
    num_blocks = -(-q.shape[1] // select_size)  # selection blocks in the sequence
    kv = [x.float() for x in (k, v, k_cmp, v_cmp, k_swa, v_swa)]

    def chunk(q_chunk, q_pos, k, v, k_cmp, v_cmp, k_swa, v_swa, g_cmp, g_slc, g_swa):
        return _nsa_chunk(q_chunk.float(), q_pos, k, v, k_cmp, v_cmp, k_swa, v_swa,
                          g_cmp.float(), g_slc.float(), g_swa.float(), num_blocks, params)

    outs, indices = [], []
    for rows, q_pos in _query_chunks(q, query_chunk):
        o, idx = _maybe_checkpoint(chunk, q[:, rows], q_pos, *kv, g_cmp[:, rows], g_slc[:, rows],
                                   g_swa[:, rows])
        outs.append(o)
        indices.append(idx)
    o = torch.cat(outs, dim=1).to(q.dtype)  # [B, T, Hq, Dv]
    if return_block_indices:
        return o, torch.cat(indices, dim=1)  # [B, T, Hkv, n]
    return o


def nsa_decode(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, *, cache_seqlens=None, k_swa=None, v_swa=None,
               block_len=32, stride=16, select_size=64, num_selected=16, num_init=1, num_local=2,
               window=512, scale=None, return_block_indices=False):
    """NSA for one new query per sequence against a cache (same result as row ``t`` of prefill).

    Args:
        q: the new queries ``[B, 1, Hq, Dk]``.
        k, v: cached keys/values of the selection branch ``[B, S, Hkv, Dk]``, ``[B, S, Hkv, Dv]``,
            including the new token.
        k_cmp, v_cmp: cached compressed keys/values ``[B, Sc, Hkv, Dk]``, ``[B, Sc, Hkv, Dv]``.
        g_cmp, g_slc, g_swa: gates ``[B, 1, Hq]``.
        cache_seqlens: int ``[B]`` valid tokens per sequence including the new one (default ``S``);
            the new query sits at position ``cache_seqlens - 1``; anything beyond is ignored.
        k_swa, v_swa: window keys/values ``[B, W, Hkv, Dk]``, ``[B, W, Hkv, Dv]``, default ``k``, ``v``:
            position ``p`` sits in row ``p % W`` (``W = S``: laid out like ``k``, ``v``; ``W >= window``:
            a ring holding the last ``W`` positions).
        block_len, stride, select_size, num_selected, num_init, num_local, window, scale: as in
            ``nsa_attention``.
        return_block_indices: also return the selected blocks.

    Returns:
        o: ``[B, 1, Hq, Dv]`` in q's dtype; with ``return_block_indices`` also int32
        ``[B, 1, Hkv, num_selected]``.
    """
    B, S = k.shape[:2]
    k_swa = k if k_swa is None else k_swa
    v_swa = v if v_swa is None else v_swa
    if cache_seqlens is None:
        q_pos = torch.full((B, 1), S - 1, dtype=torch.long, device=q.device)  # [B, 1]
    else:
        q_pos = (cache_seqlens.long() - 1)[:, None]  # [B, 1]
    params = dict(block_len=block_len, stride=stride, select_size=select_size, num_selected=num_selected,
                  num_init=num_init, num_local=num_local, window=window,
                  scale=_scale_or_default(scale, q.shape[-1]))
    ring = torch.arange(S, device=k_swa.device) % k_swa.shape[1]  # [S] the window row of each position
    kv = [x.float() for x in (k, v, k_cmp, v_cmp, k_swa[:, ring], v_swa[:, ring])]
    o, idx = _nsa_chunk(q.float(), q_pos, *kv, g_cmp.float(), g_slc.float(), g_swa.float(),
                        -(-S // select_size), params)
    o = o.to(q.dtype)  # [B, 1, Hq, Dv]
    return (o, idx) if return_block_indices else o
