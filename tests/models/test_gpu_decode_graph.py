"""The NSA model's decode on a CUDA GPU replayed from a CUDA graph: the same logits as launching every
step eagerly, across compressed-block boundaries and cache growth, and no Triton compilation once
`warm_up_decode` ran. Run with `pytest -m gpu tests/models`.
"""

from __future__ import annotations

import pytest
import torch

from nsa_eval.bench.harness import counting_compilations
from nsa_eval.models.cache_nsa import CAPACITY_STEP
from nsa_eval.models.modeling_nsa import CACHE_FIELD
from tests.models.test_gpu_model import LAYOUTS, build

pytestmark = pytest.mark.gpu


def decode(model, ids: torch.Tensor, prompt_len: int, graph: bool):
    """Prefill `prompt_len` tokens, then one token at a time: logits `[B, T, V]` and the cache."""
    model.model.decode_cuda_graph = graph
    with torch.no_grad():
        out = model(ids[:, :prompt_len], use_cache=True)
        cache, logits = getattr(out, CACHE_FIELD), [out.logits]
        for t in range(prompt_len, ids.shape[1]):
            logits.append(model(ids[:, t : t + 1], cache=cache).logits)
    return torch.cat(logits, dim=1).float(), cache


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replays_equal_eager_steps(layout, dtype):
    """80 steps after a 3,000-token prompt (five compressed blocks complete on the way), batch 3."""
    model = build(dtype, **LAYOUTS[layout])
    ids = torch.randint(0, 97, (3, 3080), device="cuda")
    eager, eager_cache = decode(model, ids, 3000, graph=False)
    graphed, cache = decode(model, ids, 3000, graph=True)
    assert eager_cache.decode_graph is None and cache.decode_graph is not None
    assert torch.equal(graphed, eager)
    for a, b in zip(cache.layers, eager_cache.layers, strict=True):
        assert torch.equal(a.k_cmp, b.k_cmp) and torch.equal(a.v_cmp, b.v_cmp)


def test_graph_decode_across_capacity_growth_equals_prefill():
    """Decoding past the cache's capacity captures again over the grown buffers."""
    model = build()
    prompt = CAPACITY_STEP - 6
    ids = torch.randint(0, 97, (2, prompt + 14), device="cuda")
    graphed, cache = decode(model, ids, prompt, graph=True)
    assert cache.capacity == 2 * CAPACITY_STEP and cache.decode_graph is not None
    with torch.no_grad():
        whole = model(ids, use_cache=False).logits.float()
    torch.testing.assert_close(graphed, whole, atol=2e-4, rtol=1e-3)


def test_generate_with_graphs_equals_eager_generate():
    model = build(torch.bfloat16)
    prompt = torch.randint(0, 97, (1, 1500), device="cuda")
    runs = {}
    for graph in (False, True):
        model.model.decode_cuda_graph = graph
        with torch.no_grad():
            runs[graph] = model.generate(prompt, max_new_tokens=40, do_sample=False)
    assert torch.equal(runs[True], runs[False])


def test_no_triton_compilation_after_warm_up():
    """After `warm_up_decode`, decoding at lengths in four different capacities compiles nothing."""
    model = build(torch.bfloat16, max_position_embeddings=4 * CAPACITY_STEP)
    model.warm_up_decode(batch_sizes=(1, 2), max_length=4 * CAPACITY_STEP)
    cases = ((1, 1000), (2, CAPACITY_STEP + 100), (1, 2 * CAPACITY_STEP + 7), (2, 4 * CAPACITY_STEP - 20))
    for B, length in cases:
        ids = torch.randint(0, 97, (B, length + 10), device="cuda")
        model.model.decode_cuda_graph = True
        with torch.no_grad():
            out = model(ids[:, :length], use_cache=True)  # the prefill may compile: not counted
            cache = getattr(out, CACHE_FIELD)
            with counting_compilations() as count:
                for t in range(length, length + 10):
                    model(ids[:, t : t + 1], cache=cache)
                torch.cuda.synchronize()
        assert count[0] == 0, f"{count[0]} compilations while decoding at {length} tokens, batch {B}"
