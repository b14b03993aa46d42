"""The NSA model on a CUDA GPU: the same weights through the Triton kernels and the PyTorch reference.

The kernels' own GPU tests (tests/kernels/test_gpu.py) compare each op; these check the model's
wiring around them on the path `kernel_impl="auto"` takes on CUDA: prefill, decode through the
cache, greedy generation and the activated-token statistics (num_local = 0 included, where the
model counts the blocks the kernel returned). Run with `pytest -m gpu tests/models`.
"""

from __future__ import annotations

import pytest
import torch

from nsa_eval.models.modeling_nsa import NSAForCausalLM
from tests.models.conftest import tiny_nsa_config
from tests.models.test_modeling_nsa import step_by_step_logits

pytestmark = pytest.mark.gpu

# The paper's block geometry at a small width: 8 query heads over 2 KV heads, head dim 32.
PAPER_GEOMETRY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=32, block_len=32, stride=16, select_size=64,
                      num_selected=16, window=512, max_position_embeddings=8192)


def build(dtype=torch.float32, seed: int = 0, **overrides) -> NSAForCausalLM:
    torch.manual_seed(seed)
    config = tiny_nsa_config(**(PAPER_GEOMETRY | overrides))
    return NSAForCausalLM(config).to("cuda", dtype).eval()


def logits_with(model: NSAForCausalLM, impl: str, fn):
    """`fn(model)` with every layer's kernels forced to `impl` ("triton" or "reference")."""
    before = model.config.kernel_impl
    model.config.kernel_impl = impl
    try:
        with torch.no_grad():
            return fn(model)
    finally:
        model.config.kernel_impl = before


def prefill(model, ids):
    return model(ids, use_cache=False).logits.float()  # [B, T, V]


@pytest.mark.parametrize("layout", [{}, dict(compression="mean", shared_kv=True, block_len=64,
                                             stride=64, select_size=64)], ids=["paper", "fla"])
def test_prefill_triton_equals_reference(layout):
    """float32 (three tf32 passes for the scores in Triton): the same logits at 3,000 tokens."""
    model = build(**layout)
    ids = torch.randint(0, 97, (2, 3000), device="cuda")
    triton = logits_with(model, "triton", lambda m: prefill(m, ids))
    reference = logits_with(model, "reference", lambda m: prefill(m, ids))
    torch.testing.assert_close(triton, reference, atol=2e-4, rtol=1e-3)


def test_decode_through_the_cache_equals_prefill_on_triton():
    """A 2,000-token prompt, then 40 tokens one at a time through nsa_decode's Triton kernels."""
    model = build()
    ids = torch.randint(0, 97, (2, 2040), device="cuda")
    whole = logits_with(model, "triton", lambda m: prefill(m, ids))
    stepped = logits_with(model, "triton", lambda m: step_by_step_logits(m, ids, 2000).float())
    torch.testing.assert_close(stepped, whole, atol=2e-4, rtol=1e-3)


def test_greedy_generation_is_the_same_on_both_paths():
    """The same greedy tokens until the reference's top two logits come within 1e-3 of each other (a
    near-tie that float32 rounding may break either way in a random model)."""
    model = build()
    prompt = torch.randint(0, 97, (1, 1500), device="cuda")

    def generate(m):
        return m.generate(prompt, max_new_tokens=24, do_sample=False, return_dict_in_generate=True,
                          output_logits=True)

    reference = logits_with(model, "reference", generate)
    triton = logits_with(model, "triton", generate)
    top2 = [torch.topk(step[0].float(), 2).values for step in reference.logits]
    decided = next((i for i, (a, b) in enumerate(top2) if a - b < 1e-3), len(top2))
    assert decided >= 1, "the first new token is a near-tie: nothing to compare"
    new = slice(prompt.shape[1], prompt.shape[1] + decided)
    assert torch.equal(triton.sequences[:, new], reference.sequences[:, new])


def test_bf16_model_on_triton_tracks_the_float32_reference():
    """The bf16 model (bf16 kernels, fp32 gates cast) against the same weights in float32."""
    ids = torch.randint(0, 97, (1, 2048), device="cuda")
    reference = logits_with(build(torch.float32), "reference", lambda m: prefill(m, ids))
    bf16 = logits_with(build(torch.bfloat16), "triton", lambda m: prefill(m, ids))
    error = (bf16 - reference).norm() / reference.norm()
    assert error < 2e-2, f"relative error {error:.3g}"


@pytest.mark.parametrize("num_local", [2, 0])
def test_activation_stats_are_the_same_on_both_paths(num_local):
    """With num_local = 0 the selected count comes from the kernel's blocks: Triton's must count
    what the reference's do, in prefill and in decode."""
    model = build(num_init=0 if num_local == 0 else 1, num_local=num_local)
    if num_local == 0:  # sharp compressed attention, so the own partial block sometimes wins
        with torch.no_grad():
            for layer in model.model.layers:
                layer.attn.q_proj.weight.mul_(20)
    ids = torch.randint(0, 97, (2, 1100), device="cuda")
    stats = {}
    for impl in ("triton", "reference"):
        model.reset_activation_stats()
        logits_with(model, impl, lambda m: step_by_step_logits(m, ids, 1064))
        stats[impl] = model.activation_stats()
    for phase in ("prefill", "decode"):
        got, want = stats["triton"]["phases"][phase], stats["reference"]["phases"][phase]
        assert got["queries"] == want["queries"] > 0
        for key in ("mean", "max"):
            assert got[key] == pytest.approx(want[key], rel=1e-6), (phase, key)
        assert got["mean_per_branch"] == pytest.approx(want["mean_per_branch"], rel=1e-6)
