"""The PyTorch reference against a brute-force dense-mask NSA written here from the definitions.

The brute force builds, in float64, the full boolean mask of every branch (compression visibility,
selected blocks with the causal mask, the sliding window) and runs a plain masked softmax over all
T keys; selection ranks blocks in a Python loop. The reference (chunked, float32, different code)
must match it in outputs, lse, block indices and gradients.
"""

from __future__ import annotations

import pytest
import torch

from nsa_eval import kernels
from nsa_eval.kernels import reference

PAPER = dict(block_len=8, stride=4, select_size=16, num_selected=4, num_init=1, num_local=2, window=32)
FLA = dict(block_len=16, stride=16, select_size=16, num_selected=4, num_init=1, num_local=2, window=32)
HEADS = [(2, 2), (6, 2), (4, 1), (8, 1), (16, 1)]  # (Hq, Hkv): G = 1, 3, 4, 8, 16


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def err_ratio(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative RMS error (fla's get_err_ratio)."""
    x, ref = x.double(), ref.double()
    return ((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------------------------
# Brute force, straight from the definitions
# ------------------------------------------------------------------------------------------------


def dense_attention(q, k, v, mask, scale):
    """q [B, T, Hq, Dk], k/v [B, S, Hq, D] (heads already repeated), mask [B, Hq, T, S] -> o, lse, p."""
    scores = torch.einsum("bthd,bshd->bhts", q, k) * scale
    empty = ~mask.any(-1, keepdim=True)
    allowed = mask | empty  # rows with no key: softmax over everything, then zeroed (finite grads)
    p = scores.masked_fill(~allowed, float("-inf")).softmax(-1) * mask
    lse = scores.masked_fill(~allowed, float("-inf")).logsumexp(-1)  # [B, Hq, T]
    lse = torch.where(empty.squeeze(-1), float("-inf"), lse)
    o = torch.einsum("bhts,bshd->bthd", p, v)
    return o, lse.transpose(1, 2), p


def brute_select(p_cmp, T, Hkv, block_len, stride, select_size, num_selected, num_init, num_local):
    """Selection from compression probabilities p_cmp [B, Hq, T, Tc] by explicit ranking."""
    B, Hq, _, Tc = p_cmp.shape
    G = Hq // Hkv
    num_blocks = -(-T // select_size)
    length = max(T, Tc * stride + block_len)
    covers = torch.zeros(Tc, length, dtype=torch.float64)  # compressed block i covers token s
    for i in range(Tc):
        covers[i, i * stride: i * stride + block_len] = 1
    holds = torch.zeros(length, num_blocks + length // select_size + 1, dtype=torch.float64)
    holds[torch.arange(length), torch.arange(length) // select_size] = 1  # token s in selection block j
    overlap = (covers @ holds)[:, :num_blocks]  # [Tc, Ns] shared tokens
    importance = p_cmp.reshape(B, Hkv, G, T, Tc).sum(2) @ overlap  # [B, Hkv, T, Ns]
    scores = importance.tolist()
    out = torch.full((B, T, Hkv, num_selected), -1, dtype=torch.int32)
    for b in range(B):
        for h in range(Hkv):
            for t in range(T):
                current = t // select_size
                available = list(range(current + 1))
                forced = [j for j in available if j < num_init or j > current - num_local]
                row = scores[b][h][t]
                rest = sorted((j for j in available if j not in forced), key=lambda j: (-row[j], j))
                chosen = sorted(forced + rest[: num_selected - len(forced)])
                out[b, t, h, : len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
    return out, importance


def brute_nsa(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, k_swa, v_swa, *, block_len, stride, select_size,
              num_selected, num_init, num_local, window, scale=None):
    """Dense-mask NSA: returns o [B, T, Hq, Dv], block indices, o_cmp, lse, o_slc, o_swa."""
    B, T, Hq, Dk = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    scale = Dk**-0.5 if scale is None else scale
    rep = lambda x: x.repeat_interleave(G, dim=2)  # [B, S, Hkv, D] -> [B, S, Hq, D]
    t = torch.arange(T)

    Tc = k_cmp.shape[1]
    visible = (torch.arange(Tc) * stride + block_len - 1)[None, :] <= t[:, None]  # [T, Tc]
    o_cmp, lse, p_cmp = dense_attention(q, rep(k_cmp), rep(v_cmp), visible.expand(B, Hq, T, Tc), scale)

    idx, _ = brute_select(p_cmp.detach(), T, Hkv, block_len, stride, select_size, num_selected, num_init,
                          num_local)
    in_selected = torch.zeros(B, Hkv, T, T, dtype=torch.bool)  # [B, Hkv, query, key]
    for j in range(num_selected):
        block = idx[:, :, :, j].permute(0, 2, 1).long()  # [B, Hkv, T]
        key_block = t // select_size  # [S]
        in_selected |= (block[..., None] == key_block) & (block[..., None] >= 0)
    causal = t[None, :] <= t[:, None]  # [T, S]
    slc_mask = rep(in_selected.transpose(1, 2)).transpose(1, 2) & causal  # [B, Hq, T, S]
    o_slc, _, _ = dense_attention(q, rep(k), rep(v), slc_mask, scale)

    in_window = causal & (t[None, :] > t[:, None] - window)
    o_swa, _, _ = dense_attention(q, rep(k_swa), rep(v_swa), in_window.expand(B, Hq, T, T), scale)
    o = g_cmp[..., None] * o_cmp + g_slc[..., None] * o_slc + g_swa[..., None] * o_swa
    return o, idx, o_cmp, lse, o_slc, o_swa


def make_inputs(B, T, Hq, Hkv, Dk, Dv, block_len, stride, extra_cmp=0, separate_swa=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen)
    Tc = max(0, (T - block_len) // stride + 1) + extra_cmp
    x = dict(q=randn(B, T, Hq, Dk), k=randn(B, T, Hkv, Dk), v=randn(B, T, Hkv, Dv),
             k_cmp=randn(B, Tc, Hkv, Dk), v_cmp=randn(B, Tc, Hkv, Dv),
             g_cmp=torch.rand(B, T, Hq, generator=gen), g_slc=torch.rand(B, T, Hq, generator=gen),
             g_swa=torch.rand(B, T, Hq, generator=gen))
    x["q"] = x["q"] * 2  # sharper compression softmax: importances spread out, fewer near-ties
    if separate_swa:
        x["k_swa"], x["v_swa"] = randn(B, T, Hkv, Dk), randn(B, T, Hkv, Dv)
    else:
        x["k_swa"], x["v_swa"] = None, None
    return x


def nsa_args(x):
    return [x[n] for n in ("q", "k", "v", "k_cmp", "v_cmp", "g_cmp", "g_slc", "g_swa")]


CHUNK = 37  # queries per chunk of the reference: several chunks per sequence, at odd boundaries


# ------------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [PAPER, FLA], ids=["paper", "fla"])
@pytest.mark.parametrize("Hq,Hkv", HEADS, ids=[f"Hq{hq}-Hkv{hkv}" for hq, hkv in HEADS])
@pytest.mark.parametrize("T", [150, 300])
def test_nsa_attention_matches_brute_force(config, Hq, Hkv, T):
    B, Dk, Dv = 2, 24, 16
    x = make_inputs(B, T, Hq, Hkv, Dk, Dv, config["block_len"], config["stride"], extra_cmp=1,
                    seed=Hq * 7 + T)
    leaves = {n: t.clone().requires_grad_(True) for n, t in x.items() if t is not None}
    ref_in = {n: leaves.get(n) for n in x}
    o, idx = reference.nsa_attention(*nsa_args(ref_in), k_swa=ref_in["k_swa"], v_swa=ref_in["v_swa"],
                                     return_block_indices=True, query_chunk=CHUNK, **config)

    bf_leaves = {n: t.detach().double().requires_grad_(True) for n, t in leaves.items()}
    bf_in = {n: bf_leaves.get(n) for n in x}
    o_bf, idx_bf, *_ = brute_nsa(*nsa_args(bf_in), bf_in["k_swa"], bf_in["v_swa"], **config)

    assert o.dtype == torch.float32 and o.shape == (B, T, Hq, Dv)
    assert torch.equal(idx, idx_bf)
    assert err_ratio(o, o_bf) < 1e-5

    do = torch.randn_like(o)
    (o * do).sum().backward()
    (o_bf * do.double()).sum().backward()
    for name, leaf in leaves.items():
        assert err_ratio(leaf.grad, bf_leaves[name].grad) < 1e-5, name


@pytest.mark.parametrize("config", [PAPER, FLA], ids=["paper", "fla"])
@pytest.mark.parametrize("T", [5, 16, 131])
def test_branches_match_brute_force(config, T):
    """Each public branch alone, including T shorter than one compressed block (no block visible)."""
    B, Hq, Hkv, Dk, Dv = 2, 6, 2, 24, 16
    x = make_inputs(B, T, Hq, Hkv, Dk, Dv, config["block_len"], config["stride"], separate_swa=False, seed=T)
    x64 = {n: (t.double() if t is not None else None) for n, t in x.items()}
    _, idx_bf, o_cmp_bf, lse_bf, o_slc_bf, _ = brute_nsa(*nsa_args(x64), x64["k"], x64["v"], **config)
    geometry = dict(block_len=config["block_len"], stride=config["stride"])

    q = x["q"].clone().requires_grad_(True)
    o_cmp, lse = reference.compressed_attention(q, x["k_cmp"], x["v_cmp"], query_chunk=CHUNK, **geometry)
    q64 = x64["q"].clone().requires_grad_(True)
    _, _, o_cmp_bf, lse_bf, _, _ = brute_nsa(q64, *nsa_args(x64)[1:], x64["k"], x64["v"], **config)
    assert lse.dtype == torch.float32 and lse.shape == (B, T, Hq)
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_bf))
    finite = torch.isfinite(lse_bf)
    if finite.any():
        assert err_ratio(lse[finite], lse_bf[finite]) < 1e-6
        assert err_ratio(o_cmp, o_cmp_bf) < 1e-5
    blind = ~finite  # queries that see no compressed block: zero output, finite zero gradient
    assert (o_cmp.detach()[blind] == 0).all()
    (o_cmp.sum() + lse[finite].sum()).backward()  # gradients through o and lse
    (o_cmp_bf.sum() + lse_bf[finite].sum()).backward()
    assert torch.isfinite(q.grad).all()
    assert err_ratio(q.grad, q64.grad) < 1e-5
    if blind.any():
        assert (q.grad[blind] == 0).all()

    idx = reference.select_blocks(x["q"], x["k_cmp"], select_size=config["select_size"],
                                  num_selected=config["num_selected"], query_chunk=CHUNK, **geometry)
    assert idx.dtype == torch.int32 and torch.equal(idx, idx_bf)

    o_slc = reference.selected_attention(x["q"], x["k"], x["v"], idx, select_size=config["select_size"],
                                         query_chunk=CHUNK)
    assert err_ratio(o_slc, o_slc_bf) < 1e-5

    o_swa = reference.sliding_window_attention(x["q"], x["k"], x["v"], window=config["window"],
                                               query_chunk=CHUNK)
    t = torch.arange(T)
    in_window = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - config["window"])
    rep = lambda y: y.double().repeat_interleave(Hq // Hkv, dim=2)
    o_swa_bf, _, _ = dense_attention(x64["q"], rep(x["k"]), rep(x["v"]), in_window.expand(B, Hq, T, T),
                                     Dk**-0.5)
    assert err_ratio(o_swa, o_swa_bf) < 1e-5


def test_selected_attention_ignores_padding_repeats_and_future_blocks():
    """-1 padding, a repeated block and a block after t change nothing."""
    B, T, Hq, Hkv, D = 1, 64, 2, 1, 8
    q, k, v = torch.randn(B, T, Hq, D), torch.randn(B, T, Hkv, D), torch.randn(B, T, Hkv, D)
    current = (torch.arange(T) // 16).view(1, T, 1, 1).int()  # [B, T, Hkv, 1]
    base = torch.cat([torch.zeros_like(current), current], -1)  # blocks {0, current}
    messy = torch.cat([current, torch.full_like(current, -1), current, torch.zeros_like(current),
                       torch.full_like(current, 3)], -1)  # repeats, padding, block 3 (future for t < 48)
    o_base = kernels.selected_attention(q, k, v, base, select_size=16, impl="reference")
    o_messy = kernels.selected_attention(q, k, v, messy, select_size=16, impl="reference")
    assert torch.allclose(o_base, o_messy, atol=1e-6)
    o_current = kernels.selected_attention(q, k, v, current, select_size=16, impl="reference")
    assert not torch.allclose(o_base[:, 16:], o_current[:, 16:], atol=1e-3)  # block 0 does matter


def test_bf16_inputs_keep_dtype_and_match_fp32():
    B, T, Hq, Hkv = 1, 100, 4, 2
    x = make_inputs(B, T, Hq, Hkv, 16, 16, 8, 4)
    x16 = {n: (t.bfloat16() if t is not None else None) for n, t in x.items()}
    o16 = kernels.nsa_attention(*nsa_args(x16), k_swa=x16["k_swa"], v_swa=x16["v_swa"], impl="reference",
                                **PAPER)
    x32 = {n: (t.float() if t is not None else None) for n, t in x16.items()}
    o32 = kernels.nsa_attention(*nsa_args(x32), k_swa=x32["k_swa"], v_swa=x32["v_swa"], impl="reference",
                                **PAPER)
    assert o16.dtype == torch.bfloat16
    assert err_ratio(o16, o32) < 1e-2


def test_auto_on_cpu_uses_reference():
    x = make_inputs(1, 40, 4, 2, 8, 8, 8, 4)
    o_auto = kernels.nsa_attention(*nsa_args(x), **PAPER)
    o_ref = reference.nsa_attention(*nsa_args(x), **PAPER)
    assert torch.equal(o_auto, o_ref)


@pytest.mark.parametrize("config", [PAPER, FLA], ids=["paper", "fla"])
def test_decode_equals_prefill_rows(config):
    """nsa_decode at position t (ragged cache_seqlens, garbage-free full cache) = prefill row t."""
    B, T, Hq, Hkv, Dk, Dv = 4, 100, 8, 2, 16, 8
    x = make_inputs(B, T, Hq, Hkv, Dk, Dv, config["block_len"], config["stride"])
    o_full, idx_full = kernels.nsa_attention(*nsa_args(x), k_swa=x["k_swa"], v_swa=x["v_swa"],
                                             return_block_indices=True, impl="reference", **config)
    rows = torch.arange(B)
    for step in range(T // B):
        pos = step + (T // B) * rows  # each sequence at its own position; every t is visited once
        gather = lambda y, pos=pos: y[rows, pos][:, None]  # [B, 1, ...]
        o, idx = kernels.nsa_decode(gather(x["q"]), x["k"], x["v"], x["k_cmp"], x["v_cmp"],
                                    gather(x["g_cmp"]), gather(x["g_slc"]), gather(x["g_swa"]),
                                    cache_seqlens=(pos + 1).int(), k_swa=x["k_swa"], v_swa=x["v_swa"],
                                    return_block_indices=True, impl="reference", **config)
        assert o.shape == (B, 1, Hq, Dv)
        assert err_ratio(o, gather(o_full)) < 1e-5, step
        assert torch.equal(idx, gather(idx_full)), step
    # a cache trimmed to the sequence (cache_seqlens=None) gives the same last row
    t = 77
    o, idx = reference.nsa_decode(x["q"][:, t:t + 1], x["k"][:, :t + 1], x["v"][:, :t + 1], x["k_cmp"],
                                  x["v_cmp"], x["g_cmp"][:, t:t + 1], x["g_slc"][:, t:t + 1],
                                  x["g_swa"][:, t:t + 1], k_swa=x["k_swa"][:, :t + 1],
                                  v_swa=x["v_swa"][:, :t + 1], return_block_indices=True, **config)
    assert err_ratio(o, o_full[:, t:t + 1]) < 1e-5
    assert torch.equal(idx, idx_full[:, t:t + 1])


def test_long_sequence_chunks_bound_memory():
    """At long T the chunk shrinks so the score tensor stays within SCORES_PER_CHUNK (here 4096: chunks
    of 10 queries), and the result does not depend on the chunks."""
    x = make_inputs(1, 100, 4, 2, 8, 8, 8, 4)
    sizes = [rows.stop - rows.start for rows, _ in reference._query_chunks(x["q"], 256, max_scores=4096)]
    assert sizes == [10] * 10
    o_small = reference.nsa_attention(*nsa_args(x), **PAPER, query_chunk=10)
    o_big = reference.nsa_attention(*nsa_args(x), **PAPER)
    assert err_ratio(o_small, o_big) < 1e-6
