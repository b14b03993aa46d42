"""The NSA model's fused decode step (`NSAModel._decode_layers`: one projection GEMM, `decode_inputs`,
`add_rms_norm`) against the unfused layers, on the CPU: the fused kernels run in Triton's interpreter
(conftest sets TRITON_INTERPRET=1), nsa_decode through the reference as the unfused step runs it. In
production the fused step runs only on the GPU (`_fuses_decode`); tests/models/test_gpu_fused_decode.py
checks it there."""

from __future__ import annotations

import copy

import pytest
import torch

from nsa_eval.models.cache_nsa import NSACache, num_compressed
from nsa_eval.models.modeling_nsa import CACHE_FIELD, NSAForCausalLM
from tests.models.conftest import tiny_nsa_config
from tests.models.test_modeling_nsa import LAYOUTS

FUSED_LAYOUTS = {**LAYOUTS, "bias": dict(attention_bias=True),
                 "fla_no_window": dict(LAYOUTS["fla"], window=0),
                 "num_local_0": dict(num_init=0, num_local=0)}


def step(model: NSAForCausalLM, cache, token: torch.Tensor, fused: bool):
    """One decode forward of `token` `[B, 1]` as `NSAModel.forward` runs it: logits `[B, 1, V]` and the
    selected tokens (or None)."""
    x = model.model.embed_tokens(token)  # [B, 1, C]
    cache.begin(1, x.device, x.shape[0])
    hidden, selected = model.model._step(x, cache, fused=fused)
    cache.end(1)
    return model.lm_head(hidden), selected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", list(FUSED_LAYOUTS))
def test_fused_decode_steps_equal_the_unfused(layout, dtype):
    """Six steps after a 26-token prompt (a compressed block completes at 27 and 31): the same logits and
    cache buffers, bit for bit in bf16 (every rounding as torch's), within float32 ulps otherwise (one
    GEMM for eight sums in another order)."""
    torch.manual_seed(0)
    model = NSAForCausalLM(tiny_nsa_config(**FUSED_LAYOUTS[layout])).to(dtype).eval()
    ids = torch.randint(0, 97, (2, 32))
    with torch.no_grad():
        unfused = getattr(model(ids[:, :26], use_cache=True), CACHE_FIELD)
        fused = copy.deepcopy(unfused)
        for t in range(26, 32):
            (ref, sel_ref), (tri, sel) = (step(model, c, ids[:, t : t + 1], f)
                                          for c, f in ((unfused, False), (fused, True)))
            if dtype == torch.bfloat16:
                assert torch.equal(tri, ref)
            else:
                torch.testing.assert_close(tri, ref, atol=1e-5, rtol=1e-5)
            assert (sel is None) == (sel_ref is None) and (sel is None or torch.equal(sel, sel_ref))
    assert int(fused.position) == unfused.length == fused.length == 32
    for a, b in zip(fused.layers, unfused.layers, strict=True):
        assert a.tensors() == b.tensors()
        for name in a.tensors():
            x, y = getattr(a, name), getattr(b, name)
            if name in ("k_cmp", "v_cmp"):  # the last row is the spare that only the unfused step writes:
                assert not x[:, -1].any() and y[:, -1].any(), name  # the fused one skipped the compressor
                x, y = x[:, :-1], y[:, :-1]
            if dtype == torch.bfloat16:
                assert torch.equal(x, y), name
            else:
                torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("block_len", "stride"), [(32, 16), (8, 4), (64, 64), (5, 3)])
def test_a_step_completes_a_block_where_one_more_token_adds_one(block_len, stride):
    """`completes_block` (which graph a decode step replays, and whether the fused step compresses) against
    the compressed blocks the cache counts before and after the token."""
    cache = NSACache(1, block_len, stride)
    for length in range(0, 4 * block_len):
        cache.length = length
        for t in (0, 1):
            blocks = [num_compressed(length + t + n, block_len, stride) for n in (0, 1)]
            assert cache.completes_block(t) == (blocks[1] == blocks[0] + 1)


def test_the_fused_decode_runs_only_on_the_gpu():
    """On the CPU a decode forward takes the unfused layers (the fused kernels would run interpreted)."""
    torch.manual_seed(0)
    model = NSAForCausalLM(tiny_nsa_config()).eval()
    ids = torch.randint(0, 97, (1, 12))
    with torch.no_grad():
        cache = getattr(model(ids[:, :10], use_cache=True), CACHE_FIELD)
        x = model.model.embed_tokens(ids[:, 10:11])
        assert not model.model._fuses_decode(x, cache)
        model(ids[:, 10:11], cache=cache)
    assert all(layer.attn._decode_weight is None for layer in model.model.layers)


def test_the_fused_projection_follows_its_weights():
    """The stacked weight is rebuilt when a source weight changes in place or is replaced, and is not in
    the state dict."""
    torch.manual_seed(0)
    model = NSAForCausalLM(tiny_nsa_config()).eval()
    attn = model.model.layers[0].attn
    weight, bias, gate_column = attn.decode_weight()
    C, Hq, Hkv, D = 32, 4, 2, 8
    assert weight.shape == (Hq * D + 6 * Hkv * D + 3 * Hq, C) and bias is None
    assert gate_column == weight.shape[0] - 3 * Hq
    assert attn.decode_weight()[0] is weight  # unchanged weights: the same tensor
    with torch.no_grad():
        attn.k_proj.weight.mul_(2)
    rebuilt = attn.decode_weight()[0]
    assert rebuilt is not weight and torch.equal(rebuilt[Hq * D : (Hq + Hkv) * D], attn.k_proj.weight)
    model.to(torch.float64)
    assert attn.decode_weight()[0].dtype == torch.float64
    assert not any("decode_weight" in key for key in model.state_dict())
