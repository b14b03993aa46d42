"""The NSA model on a CUDA GPU: the same weights through the Triton kernels and the PyTorch reference.

The kernels' own GPU tests (tests/kernels/test_gpu.py) compare each op; these check the model's
wiring around them on the path `kernel_impl="auto"` takes on CUDA: prefill, decode through the
cache, greedy generation and the activated-token statistics (num_local = 0 included, where the
model counts the blocks the kernel returned). Run with `pytest -m gpu tests/models`.
"""

from __future__ import annotations

import pytest
import torch

from nsa_eval.kernels import nsa_attention, reference
from nsa_eval.models import modeling_nsa
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


LAYOUTS = {"paper": {},
           "fla": dict(compression="mean", shared_kv=True, block_len=64, stride=64, select_size=64)}


def layer_inputs(model: NSAForCausalLM, ids: torch.Tensor, monkeypatch) -> list[tuple[tuple, dict]]:
    """The arguments every layer passes to `nsa_attention` in a reference prefill of `ids`."""
    calls = []

    def record(*args, **kwargs):
        calls.append((args, kwargs))
        return nsa_attention(*args, **kwargs)

    monkeypatch.setattr(modeling_nsa, "nsa_attention", record)
    logits_with(model, "reference", lambda m: prefill(m, ids))
    monkeypatch.undo()
    return calls


def importances(q, k_cmp, *, block_len, stride, select_size, **_) -> torch.Tensor:
    """Block importances `[B, T, Hkv, Ns]` in float64: the reference's rule at twice its precision."""
    B, T, _, Dk = q.shape
    positions = torch.arange(T, device=q.device).expand(B, -1)
    _, _, p = reference._compressed_chunk(q.double(), positions, k_cmp.double(), k_cmp[..., :1].double(),
                                          block_len, stride, Dk**-0.5)  # p [B, T, Hkv, G, Tc]
    weights = reference._overlap_weights(k_cmp.shape[1], -(-T // select_size), block_len, stride,
                                         select_size, q.device)
    return p.sum(3) @ weights.double()


def tie_gaps(blocks_a, blocks_b, importance) -> torch.Tensor:
    """For each (b, t, h) row where two block selections differ: the spread of the float64 importances
    of the blocks only one of them chose, relative to the row's largest importance. A near-tie that
    rounding broke either way gives ~1e-7; a wrong choice gives the gap between two real scores."""
    differ = (blocks_a.sort(-1).values != blocks_b.sort(-1).values).any(-1)  # [B, T, Hkv]
    gaps = []
    for b, t, h in differ.nonzero().tolist():
        only_one = sorted(set(blocks_a[b, t, h].tolist()) ^ set(blocks_b[b, t, h].tolist()))
        values = importance[b, t, h, only_one]
        gaps.append(float((values.max() - values.min()) / importance[b, t, h].max()))
    return torch.tensor(gaps, dtype=torch.float64)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_prefill_layers_choose_the_reference_blocks_up_to_near_ties(layout, monkeypatch):
    """Each layer's nsa_attention on the reference run's own inputs (random model, 3,000 tokens, float32):
    Triton picks the reference's blocks except where two blocks' importances tie to within float32
    rounding (shown in float64), and where the picks agree the outputs agree to float32 accuracy.

    This is why a random model's logits cannot be compared exactly at long context: its compressed
    attention is nearly uniform, a few rows per layer hold a near-tie, and the block that wins one
    changes that row's output and, through attention, the later layers'."""
    model = build(**LAYOUTS[layout])
    ids = torch.randint(0, 97, (2, 3000), device="cuda")
    for layer, (args, kwargs) in enumerate(layer_inputs(model, ids, monkeypatch)):
        kwargs = kwargs | dict(return_block_indices=True)
        with torch.no_grad():
            o_tri, blocks_tri = nsa_attention(*args, **kwargs | dict(impl="triton"))
            o_ref, blocks_ref = nsa_attention(*args, **kwargs | dict(impl="reference"))
        gaps = tie_gaps(blocks_tri.long(), blocks_ref.long(), importances(args[0], args[3], **kwargs))
        rows = blocks_ref.shape[0] * blocks_ref.shape[1] * blocks_ref.shape[2]
        assert len(gaps) <= rows // 1000, f"layer {layer}: {len(gaps)} of {rows} rows chose other blocks"
        assert len(gaps) == 0 or gaps.max() < 1e-5, f"layer {layer}: not a near-tie, gaps {gaps.tolist()}"
        same = (blocks_tri.sort(-1).values == blocks_ref.sort(-1).values).all(-1)  # [B, T, Hkv]
        same = same.repeat_interleave(o_ref.shape[2] // same.shape[2], dim=2)  # [B, T, Hq]
        torch.testing.assert_close(o_tri[same], o_ref[same], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_prefill_triton_equals_reference(layout):
    """float32, every product in Triton at float32 accuracy (three tf32 passes): the same logits at
    3,000 tokens on a model whose queries are sharpened (q_proj x 20), so no importance ties within
    rounding and every layer must pick the same blocks (near-ties: the test above)."""
    model = build(**LAYOUTS[layout])
    with torch.no_grad():
        for block in model.model.layers:
            block.attn.q_proj.weight.mul_(20)
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
def test_attention_stats_are_the_same_on_both_paths(num_local):
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
        model.reset_attention_stats()
        logits_with(model, impl, lambda m: step_by_step_logits(m, ids, 1064))
        stats[impl] = model.attention_stats()
    for phase in ("prefill", "decode"):
        got, want = stats["triton"]["phases"][phase], stats["reference"]["phases"][phase]
        assert got["queries"] == want["queries"] > 0
        for key in ("mean", "max"):
            assert got[key] == pytest.approx(want[key], rel=1e-6), (phase, key)
        assert got["mean_per_branch"] == pytest.approx(want["mean_per_branch"], rel=1e-6)
