"""The NSA model's fused decode step (`NSAModel._decode_layers`) on a CUDA GPU at the 1B model's attention
shape (32 query / 8 KV heads of 64, hidden 2048): the same logits and caches as the unfused layers within
bf16 rounding (one projection GEMM sums in another order than eight), and greedy generation from the
graphed fused step picks the tokens of the eager unfused one. Run with `pytest -m gpu tests/models`.
"""

from __future__ import annotations

import pytest
import torch

from tests.models.test_gpu_decode_graph import decode
from tests.models.test_gpu_model import build

pytestmark = pytest.mark.gpu

ONE_B = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
             head_dim=64, num_hidden_layers=2)


@pytest.mark.parametrize("layout", [{}, dict(compression="mean", shared_kv=True, block_len=64, stride=64),
                                    dict(window=0)], ids=["paper", "fla", "no_window"])
def test_fused_steps_equal_unfused_steps_at_the_1b_shape(layout):
    """60 steps after a 3,000-token prompt, batch 2 (several compressed blocks complete on the way)."""
    model = build(torch.bfloat16, **ONE_B, **layout)
    ids = torch.randint(0, 97, (2, 3060), device="cuda")
    runs = {}
    for fused in (False, True):
        model.model.fuse_decode = fused
        runs[fused] = decode(model, ids, 3000, graph=False)
    (ref, ref_cache), (tri, cache) = runs[False], runs[True]
    torch.testing.assert_close(tri, ref, atol=0.05, rtol=0.02)
    for a, b in zip(cache.layers, ref_cache.layers, strict=True):
        for name in a.tensors():
            x, y = getattr(a, name), getattr(b, name)
            if name in ("k_cmp", "v_cmp"):  # the spare row, which only the unfused step writes
                x, y = x[:, :-1], y[:, :-1]
            torch.testing.assert_close(x, y, atol=0.02, rtol=0.02, msg=name)


def test_graphed_fused_generate_picks_the_eager_unfused_tokens():
    """The same greedy tokens until the unfused step's top two logits come within bf16 rounding of each
    other (a near-tie that the fused GEMM's other summation order may break either way)."""
    model = build(torch.bfloat16, **ONE_B)
    prompt = torch.randint(0, 97, (1, 1500), device="cuda")
    runs = {}
    for fused in (False, True):
        model.model.fuse_decode = model.model.decode_cuda_graph = fused
        with torch.no_grad():
            runs[fused] = model.generate(prompt, max_new_tokens=40, do_sample=False,
                                         return_dict_in_generate=True, output_logits=True)
    top2 = [torch.topk(step[0].float(), 2).values for step in runs[False].logits]
    decided = next((i for i, (a, b) in enumerate(top2) if a - b < 0.02 * a.abs().clamp_min(1)), len(top2))
    assert decided >= 1, "the first new token is a near-tie: nothing to compare"
    new = slice(prompt.shape[1], prompt.shape[1] + decided)
    assert torch.equal(runs[True].sequences[:, new], runs[False].sequences[:, new])


def test_the_fused_step_is_what_the_graph_replays():
    """A CUDA model's decode forward takes the fused layers, and its graphs replay them: one for the steps
    that complete a compressed block (position 1007 here) and one for the others."""
    model = build(torch.bfloat16, **ONE_B)
    ids = torch.randint(0, 97, (1, 1010), device="cuda")
    logits, cache = decode(model, ids, 1000, graph=True)
    assert set(cache.decode_graphs) == {False, True}
    assert all(layer.attn._decode_weight is not None for layer in model.model.layers)
