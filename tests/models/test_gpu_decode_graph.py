"""The NSA model's decode on a CUDA GPU replayed from a CUDA graph: the same logits as launching every
step eagerly, across compressed-block boundaries and cache growth, and no Triton compilation once
`warm_up_decode` ran. Run with `pytest -m gpu tests/models`.
"""

from __future__ import annotations

import pytest
import torch

from nsa_eval.bench.harness import counting_compilations, graph_step_ms
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


# num_local = 0: the layers count the blocks the kernel chose, an output of the captured step
GRAPH_LAYOUTS = {**LAYOUTS, "num_local_0": dict(num_init=0, num_local=0)}


@pytest.mark.parametrize("layout", list(GRAPH_LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replays_equal_eager_steps(layout, dtype):
    """80 steps after a 3,000-token prompt (five compressed blocks complete on the way), batch 3: the
    same logits, compressed blocks and activated-token statistics."""
    model = build(dtype, **GRAPH_LAYOUTS[layout])
    ids = torch.randint(0, 97, (3, 3080), device="cuda")
    runs, stats = {}, {}
    for graph in (False, True):
        model.reset_attention_stats()
        runs[graph] = decode(model, ids, 3000, graph=graph)
        stats[graph] = model.attention_stats()
    (eager, eager_cache), (graphed, cache) = runs[False], runs[True]
    assert eager_cache.decode_graph is None and cache.decode_graph is not None
    assert torch.equal(graphed, eager)
    assert stats[True] == stats[False]
    for a, b in zip(cache.layers, eager_cache.layers, strict=True):
        assert torch.equal(a.k_cmp, b.k_cmp) and torch.equal(a.v_cmp, b.v_cmp)


def test_graph_decode_across_capacity_growth_equals_prefill():
    """Decoding past the cache's capacity captures again over the grown buffers (queries sharpened, as in
    test_gpu_model.py, so no near-tie of block importances decides a block)."""
    model = build()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.attn.q_proj.weight.mul_(20)
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
    """After `warm_up_decode`, decoding at lengths in six different capacities (1,024 tokens apart, from
    one compressed tile to past 16 of them) compiles nothing."""
    steps = 20
    model = build(torch.bfloat16, max_position_embeddings=steps * CAPACITY_STEP)
    model.warm_up_decode(batch_sizes=(1, 2), max_length=steps * CAPACITY_STEP)
    cases = ((1, 1000), (2, CAPACITY_STEP + 100), (1, 2 * CAPACITY_STEP + 7), (2, 5 * CAPACITY_STEP - 20),
             (1, 11 * CAPACITY_STEP + 3), (2, 17 * CAPACITY_STEP - 20))
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


def test_harness_gpu_step_time_right_below_a_capacity_step():
    """`graph_step_ms` replays 32 steps after a prompt 3 tokens short of a capacity step (the cache grows
    for them first) and gives a positive time."""
    model = build(torch.bfloat16)
    ids = torch.randint(0, 97, (1, CAPACITY_STEP - 3), device="cuda")
    assert graph_step_ms(model, ids, 32) > 0
