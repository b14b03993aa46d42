"""A training signal for NSA's block selection: the compressed keys learn to rank blocks as dense
attention over the selection keys would weigh them.

NSA chooses each query's blocks by the compression branch's attention probabilities (importance,
paper Eq. 8-10), but the choice passes no gradient, so those scores learn only through the compression
branch's own output. Where its gate is nearly closed (the long pair's nsa-tiny start: 0.001-0.06 at the
answer queries, docs/training.md) they learn almost nothing, and at 16k the needle's block ranks in the
hundreds. This loss gives them a direct signal, as DeepSeek-V3.2's sparse attention trains its indexer:
at a few random query positions per row, the KL divergence from the dense attention's mass per selection
block (a target, no gradient) to the block importance the compressed keys give, both over the blocks the
query chooses among (the initial and local blocks, always selected, left out). The queries are detached,
so only the compressed keys (the compressor and its key projection) learn from it. `answer_distill_loss`
takes the same divergence at each retrieval row's answer queries instead, where a far needle's block
must be chosen (random positions mostly attend nearby).
"""

from __future__ import annotations

import torch

from nsa_eval.kernels.reference import _overlap_weights


def query_positions(T: int, queries: int, *, select_size: int, num_init: int, num_local: int,
                    generator: torch.Generator) -> torch.Tensor:
    """Up to `queries` distinct positions, int64 `[n]` ascending, from those with at least two blocks to
    choose among (past the initial and local blocks), drawn by `generator` (CPU)."""
    first = _first_choosing(select_size, num_init, num_local)
    if first >= T:
        return torch.zeros(0, dtype=torch.long)
    pick = torch.randperm(T - first, generator=generator)[:queries]
    return (pick + first).sort().values


def _first_choosing(select_size: int, num_init: int, num_local: int) -> int:
    """The first position with at least two blocks to choose among (past the initial and local blocks)."""
    return (num_init + num_local + 1) * select_size


def block_mass(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, *, select_size: int,
               scale: float) -> torch.Tensor:
    """Dense causal attention's probability mass per selection block, averaged over each KV head's group.

    q `[B, n, Hq, D]` (the queries at `positions` `[n]`), k `[B, T, Hkv, D]` -> float32 `[B, n, Hkv, Ns]`,
    Ns = ceil(T / select_size), each row summing to 1.
    """
    B, n, Hq, D = q.shape
    T, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    ns = -(-T // select_size)
    s = torch.einsum("bnkgd,btkd->bnkgt", q.float().view(B, n, Hkv, G, D), k.float()) * scale
    causal = torch.arange(T, device=k.device) <= positions.to(k.device)[:, None]  # [n, T]
    p = s.masked_fill(~causal[None, :, None, None], float("-inf")).softmax(-1)  # [B, n, Hkv, G, T]
    p = torch.nn.functional.pad(p, (0, ns * select_size - T))
    return p.view(B, n, Hkv, G, ns, select_size).sum(-1).mean(3)  # [B, n, Hkv, Ns]


# a finite log 0: every log-sum-exp below stays finite, and so does its gradient, where a block has no mass
LOG_ZERO = -1e30


def block_log_importance(q: torch.Tensor, k_cmp: torch.Tensor, positions: torch.Tensor, *, T: int,
                         block_len: int, stride: int, select_size: int, scale: float) -> torch.Tensor:
    """The log of the compression branch's block importance (paper Eq. 8-10), normalised: q `[B, n, Hq, D]`
    at `positions` `[n]`, k_cmp `[B, Tc, Hkv, D]` -> float32 `[B, n, Hkv, Ns]`, `LOG_ZERO` or less for a
    block that no visible compressed block overlaps.

    Worked out in log space throughout: compressed logits spread by hundreds of nats, so that many
    importances underflow to 0 in probability space, where the loss's log and its gradient overflow.
    """
    B, n, Hq, D = q.shape
    Tc, Hkv = k_cmp.shape[1], k_cmp.shape[2]
    G = Hq // Hkv
    ns = -(-T // select_size)
    s = torch.einsum("bnkgd,bckd->bnkgc", q.float().view(B, n, Hkv, G, D), k_cmp.float()) * scale
    last = torch.arange(Tc, device=k_cmp.device) * stride + block_len - 1  # [Tc] each block's last token
    visible = last <= positions.to(k_cmp.device)[:, None]  # [n, Tc]
    s = s.masked_fill(~visible[None, :, None, None], LOG_ZERO)  # [B, n, Hkv, G, Tc]
    log_p = torch.logsumexp(s - torch.logsumexp(s, -1, keepdim=True), 3)  # [B, n, Hkv, Tc] group's sum
    index, log_w = _overlaps(Tc, ns, block_len, stride, select_size, k_cmp.device)  # [Ns, K] each
    log_imp = torch.logsumexp(log_p[..., index] + log_w, -1)  # [B, n, Hkv, Ns]
    return log_imp - torch.logsumexp(log_imp, -1, keepdim=True)


def block_importance(q: torch.Tensor, k_cmp: torch.Tensor, positions: torch.Tensor, *, T: int,
                     block_len: int, stride: int, select_size: int, scale: float) -> torch.Tensor:
    """`block_log_importance` as probabilities: float32 `[B, n, Hkv, Ns]`, each row summing to 1."""
    return block_log_importance(q, k_cmp, positions, T=T, block_len=block_len, stride=stride,
                                select_size=select_size, scale=scale).exp()


def _overlaps(Tc: int, ns: int, block_len: int, stride: int, select_size: int, device):
    """The compressed blocks overlapping each selection block and the log of their overlap weights
    (`_overlap_weights`): int64 `[Ns, K]` and float32 `[Ns, K]`, K the most any block has (`LOG_ZERO`
    pads a block with fewer)."""
    weights = _overlap_weights(Tc, ns, block_len, stride, select_size, device).t()  # [Ns, Tc]
    overlaps = weights > 0
    k = max(1, int(overlaps.sum(1).max()))
    index = torch.argsort((~overlaps).int(), dim=1, stable=True)[:, :k]  # overlapping ones first
    w = weights.gather(1, index)
    return index, torch.where(w > 0, w.clamp_min(1e-30).log(), LOG_ZERO)


def selection_distill_loss(q: torch.Tensor, k: torch.Tensor, k_cmp: torch.Tensor, *, block_len: int,
                           stride: int, select_size: int, num_init: int, num_local: int, scale: float,
                           queries: int, generator: torch.Generator) -> torch.Tensor:
    """KL(dense block mass || compressed block importance), averaged over `queries` random positions
    (`generator`) and the rows and KV heads, over each query's blocks to choose among (renormalised).

    q `[B, T, Hq, D]`, k `[B, T, Hkv, D]` (the selection branch's, the target: no gradient), k_cmp `[B, Tc,
    Hkv, D]` (gradient) -> a float32 scalar, 0 where no position has a block to choose.
    """
    positions = query_positions(q.shape[1], queries, select_size=select_size, num_init=num_init,
                                num_local=num_local, generator=generator).to(q.device)
    if positions.numel() == 0:
        return k_cmp.sum() * 0.0
    return _divergence(q, k, k_cmp, positions, block_len=block_len, stride=stride, select_size=select_size,
                       num_init=num_init, num_local=num_local, scale=scale).mean()


def answer_positions(answer: torch.Tensor, *, select_size: int, num_init: int,
                     num_local: int) -> list[torch.Tensor]:
    """Per row, the query positions that predict an answer token and have blocks to choose among:
    answer `[B, T]` bool (query t's target is an answer token) -> B int64 tensors `[n_b]`, ascending."""
    first = _first_choosing(select_size, num_init, num_local)
    positions = [row.nonzero()[:, 0] for row in answer]
    return [t[t >= first] for t in positions]


def answer_distill_loss(q: torch.Tensor, k: torch.Tensor, k_cmp: torch.Tensor, answers: list[torch.Tensor], *,
                        block_len: int, stride: int, select_size: int, num_init: int, num_local: int,
                        scale: float) -> torch.Tensor:
    """`selection_distill_loss` at each row's own positions `answers` (`answer_positions`: the queries
    that must find a needle, where random positions are mostly queries that attend nearby): the mean over
    every row's positions and KV heads; 0 where no row has one. Shapes as `selection_distill_loss`'s."""
    terms = [_divergence(q[b : b + 1], k[b : b + 1], k_cmp[b : b + 1], positions, block_len=block_len,
                         stride=stride, select_size=select_size, num_init=num_init, num_local=num_local,
                         scale=scale).flatten()
             for b, positions in enumerate(answers) if positions.numel()]
    return torch.cat(terms).mean() if terms else k_cmp.sum() * 0.0


def _divergence(q, k, k_cmp, positions, *, block_len, stride, select_size, num_init, num_local, scale):
    """The KL divergence at `positions` `[n]` (shared by the rows): float32 `[B, n, Hkv]`."""
    T = q.shape[1]
    qs = q.detach()[:, positions]  # [B, n, Hq, D]
    with torch.no_grad():
        target = block_mass(qs, k.detach(), positions, select_size=select_size, scale=scale)
    log_predicted = block_log_importance(qs, k_cmp, positions, T=T, block_len=block_len, stride=stride,
                                         select_size=select_size, scale=scale)  # [B, n, Hkv, Ns]
    block = torch.arange(target.shape[-1], device=q.device)  # [Ns]
    current = positions[:, None] // select_size  # [n, 1]
    choosable = (block >= num_init) & (block <= current - num_local)  # [n, Ns]
    mask = choosable[None, :, None]
    target = torch.where(mask, target, 0.0)
    target = target / target.sum(-1, keepdim=True).clamp_min(1e-30)
    log_predicted = log_predicted.masked_fill(~mask, LOG_ZERO)
    log_predicted = log_predicted - torch.logsumexp(log_predicted, -1, keepdim=True)  # over the choosable
    kl = torch.xlogy(target, target) - target * log_predicted  # 0 where the target is 0
    return kl.sum(-1)
