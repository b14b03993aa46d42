"""Decode steps of every attention method on a transformers Llama, replayed from CUDA graphs over a static
cache: the same logits, tokens and statistics as the same steps run eagerly, greedy tokens and statistics
as transformers' dynamic cache gives them, sampling and stop strings through lm-eval, no wait for the GPU
inside a step, and a wall time per token near the step's GPU time. Run with `pytest -m gpu tests/models`.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from nsa_eval.bench.harness import graph_replay_ms
from nsa_eval.methods import StaticDecodeCache, apply_attention, attention_stats, reset_attention_stats
from nsa_eval.models.hf_decode_graph import CACHE_FIELD, enable_decode_graphs
from tests.methods.conftest import tiny_llama

pytestmark = pytest.mark.gpu

BUDGET = dict(budget=32, sink=4, local=8)
CASES = [
    ("full", {}),
    ("sink_window", BUDGET),
    ("topk", BUDGET),
    ("topk", {**BUDGET, "group_shared": True}),
    ("quest", {**BUDGET, "local": 16}),
    ("h2o", BUDGET),
    ("h2o", {**BUDGET, "group_shared": True}),
]
PROMPT, STEPS = 20, 40  # the steps cross the budget (32)


def build(method: str, params: dict, dtype: torch.dtype):
    model = tiny_llama().cuda().to(dtype)
    apply_attention(model, method, **params)
    return model, enable_decode_graphs(model)


def decode(model, runner, ids: torch.Tensor, mode: str, forced: torch.Tensor | None = None):
    """The prompt `ids[:, :PROMPT]`, then STEPS tokens one forward at a time: greedy, or `forced` `[B, STEPS]`
    (teacher forcing). `mode`: "graph" (static cache, steps replayed), "eager" (static cache, steps launched
    one by one) or "dynamic" (transformers' DynamicCache). Returns logits `[STEPS + 1, B, V]` float32,
    tokens `[B, STEPS]`, statistics and the cache. The static cache starts with room for 8 steps (it grows)
    and widths of 16 slots (a capture every 16 tokens)."""
    runner.enabled = mode == "graph"
    cache = StaticDecodeCache(PROMPT + 8, width_step=16) if mode != "dynamic" else None
    reset_attention_stats(model)
    logits, tokens = [], []
    with torch.no_grad():
        out = model(ids[:, :PROMPT], use_cache=True, logits_to_keep=1, **{CACHE_FIELD: cache})
        cache = getattr(out, CACHE_FIELD)
        for t in range(STEPS + 1):
            logits.append(out.logits[:, -1].float())
            if t == STEPS:
                break
            tokens.append(out.logits[:, -1:].argmax(-1) if forced is None else forced[:, t:t + 1])
            out = model(tokens[-1], use_cache=True, logits_to_keep=1, **{CACHE_FIELD: cache})
    torch.cuda.synchronize()
    return torch.stack(logits), torch.cat(tokens, dim=1), attention_stats(model), cache


def agrees_with(reference_logits: torch.Tensor, tokens: torch.Tensor, margin: float,
                steps: torch.Tensor | None = None) -> None:
    """Greedy `tokens` `[B, STEPS]` are the argmax of `reference_logits` `[STEPS + 1, B, V]` at every step
    where its best logit leads the second by more than `margin` (closer calls may go either way at this
    precision), among the steps `steps` `[STEPS]` (bool; None: all)."""
    top2 = reference_logits[:-1].topk(2, dim=-1)  # [STEPS, B, 2]
    clear = (top2.values[..., 0] - top2.values[..., 1]) > margin  # [STEPS, B]
    if steps is not None:
        clear &= steps[:, None]
    assert clear.float().mean() > 0.4, "too few clear steps for the test to mean anything"
    assert torch.equal(tokens.T[clear], top2.indices[..., 0][clear])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize(("method", "params"), CASES)
def test_graph_replays_equal_eager_steps(method, params, B, dtype):
    """40 greedy steps across three capacity growths and widths (a capture each): the graph gives the eager
    static steps' logits bit for bit, their tokens and statistics; against transformers' dynamic cache, fed
    the same tokens, logits to rounding, greedy tokens wherever the choice is clear, the same statistics.
    In bf16 a near-tie of two keys' scores may swap one key at a step (a top-k over bf16 products computed
    by other kernels): at most a tenth of the steps may differ by more than rounding."""
    model, runner = build(method, params, dtype)
    ids = torch.randint(3, 128, (B, PROMPT), device="cuda", generator=torch.Generator("cuda").manual_seed(B))
    graph = decode(model, runner, ids, "graph")
    eager = decode(model, runner, ids, "eager")
    assert graph[3].decode_graph is not None and eager[3].decode_graph is None
    assert runner.captures >= 3  # widths 32, 48 and 64 (room grew past the first capacity twice)
    assert torch.equal(graph[0], eager[0]) and torch.equal(graph[1], eager[1])
    assert graph[2] == eager[2]

    dynamic = decode(model, runner, ids, "dynamic", forced=graph[1])
    if dtype == torch.float32:
        torch.testing.assert_close(graph[0], dynamic[0], rtol=1e-4, atol=1e-4)
        agrees_with(dynamic[0], graph[1], margin=1e-3)
    else:
        close = (graph[0] - dynamic[0]).abs().amax(dim=(1, 2)) <= 1e-2  # [STEPS + 1] per step
        assert close.float().mean() >= 0.9
        agrees_with(dynamic[0], graph[1], margin=2e-2, steps=close[:-1])
    for key in ("queries", "mean", "max"):
        assert graph[2][key] == dynamic[2][key], key
    if dtype == torch.float32:
        assert graph[2] == dynamic[2]
    else:  # a near-tie of bf16 scores may pick another key of the same count
        assert graph[2]["kv_read_mean"] == pytest.approx(dynamic[2]["kv_read_mean"], rel=2e-2)


@pytest.mark.parametrize(("method", "params"), [CASES[0], CASES[4], CASES[5]])
def test_generate_samples_through_graphs(method, params):
    """`generate()` on a left-padded batch of 3 with sampling (T = 0.7, top-p 0.95, a fixed seed): the same
    tokens from graphs as from eager static steps, and in float32 as from transformers' dynamic cache."""
    model, runner = build(method, params, torch.float32)
    ids = torch.randint(3, 128, (3, 24), device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    mask = torch.ones_like(ids)
    mask[0, :7] = mask[2, :3] = 0
    ids[mask == 0] = 0
    runs = {}
    for mode in ("graph", "eager", "dynamic"):
        runner.enabled = mode == "graph"
        extra = {CACHE_FIELD: StaticDecodeCache(24 + 40, width_step=16)} if mode != "dynamic" else {}
        torch.manual_seed(0)
        with torch.no_grad():
            runs[mode] = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=True,
                                        temperature=0.7, top_p=0.95, **extra)
    assert torch.equal(runs["graph"], runs["eager"])
    assert torch.equal(runs["graph"], runs["dynamic"])


def test_lm_eval_generate_until_through_graphs(tiny_llama_dir):
    """The adapter on a GPU decodes from a static cache through graphs by default: generate_until (batch 3,
    left-padded, a stop string, sampling with a fixed seed) gives the text of static_decode=false."""
    from lm_eval.api.instance import Instance

    from nsa_eval.models.hf_decode_graph import GRAPHS_ATTRIBUTE
    from nsa_eval.models.lm_adapter import NSAEvalLM

    prompts = ["a", "a much longer prompt than the others, so the batch is left-padded", "mid length"]
    texts = {}
    for static in ("auto", "false"):
        lm = NSAEvalLM(pretrained=str(tiny_llama_dir), attention="quest", budget=16, sink=2, local=8,
                       page_size=4, batch_size=3, device="cuda", static_decode=static)
        generation = {"until": ["<never>"], "max_gen_toks": 24, "do_sample": True, "temperature": 0.7,
                      "top_p": 0.95}
        torch.manual_seed(0)
        free = lm.generate_until([Instance("generate_until", {}, (q, generation), i)
                                  for i, q in enumerate(prompts)])
        generation["until"] = [free[1][6:8]]
        torch.manual_seed(0)
        texts[static] = lm.generate_until([Instance("generate_until", {}, (q, generation), i)
                                           for i, q in enumerate(prompts)])
        runner = getattr(lm.model, GRAPHS_ATTRIBUTE, None)
        assert (runner is not None and runner.captures > 0) == (static == "auto")
    assert texts["auto"] == texts["false"]


@pytest.mark.parametrize(("method", "params"), CASES)
def test_replayed_steps_never_wait_for_the_gpu(method, params):
    """A replayed step (host bookkeeping, replay, the logits' copy) makes no device-to-host sync."""
    model, runner = build(method, params, torch.bfloat16)
    ids = torch.randint(3, 128, (2, 40), device="cuda")
    cache = StaticDecodeCache(64, width_step=64)
    with torch.no_grad():
        out = model(ids, use_cache=True, logits_to_keep=1, **{CACHE_FIELD: cache})
        token = out.logits[:, -1:].argmax(-1)
        token = model(token, logits_to_keep=1, **{CACHE_FIELD: cache}).logits[:, -1:].argmax(-1)  # captures
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(8):
                token = model(token, logits_to_keep=1, **{CACHE_FIELD: cache}).logits[:, -1:].argmax(-1)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert runner.captures == 1 and cache.lens.tolist() == [49, 49]  # 40 + the captured step + 8


@pytest.mark.parametrize("B", [1, 3])
def test_flash_decode_equals_masked_attention(B):
    """FlashAttention's varlen decode over buffers of 8,192 slots read to a width of 8,000, rows of 5, 3,000
    and 8,000 keys (long enough for its split over key blocks): the masked SDPA reference's output."""
    from nsa_eval.methods.static_decode import flash_decode, flash_ready

    g = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(B, 8, 1, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(B, 2, 8192, 64, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    S = torch.tensor([5, 3000, 8000][-B:], device="cuda")
    W = 8000
    if not flash_ready(q, k):
        pytest.skip("FlashAttention is off in this PyTorch")
    try:
        out = flash_decode(q, k[:, :, :W], v[:, :, :W], S, 0.125)  # [B, 1, Hq, Dv]
    except (RuntimeError, TypeError) as error:  # the dense layers then take SDPA (dense_decode's fallback)
        pytest.skip(f"this PyTorch's flash varlen forward does not take seqused_k: {error}")
    mask = (torch.arange(W, device="cuda") < S[:, None])[:, None, None]  # [B, 1, 1, W]
    reference = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k[:, :, :W].float(), v[:, :, :W].float(), attn_mask=mask, scale=0.125,
        enable_gqa=True).transpose(1, 2)  # [B, 1, Hq, Dv]
    torch.testing.assert_close(out.float(), reference, rtol=2e-2, atol=1e-2)


def _llama_1b(layers: int = 16):
    """A random model of Llama-3.2-1B's widths (bf16, on the GPU); `layers` of its 16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=True)
    with torch.device("cuda"):
        return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def _ms_per_token(model, cache, token, steps: int = 32, rounds: int = 5) -> float:
    """Median over `rounds` of the wall ms per greedy token, `steps` at a time (the harness's decode)."""
    times = []
    with torch.no_grad():
        for _ in range(rounds):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                out = model(token, use_cache=True, logits_to_keep=1, **{CACHE_FIELD: cache})
                token = out.logits[:, -1:].argmax(-1)
                cache = getattr(out, CACHE_FIELD)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1000 / steps)
    return statistics.median(times)


@pytest.mark.parametrize("method", ["full", "topk"])
def test_wall_time_per_token_near_the_graphs_gpu_time(method):
    """Llama-3.2-1B's shape, a 4,096-token prompt, batch 1: graphed greedy decoding takes at most 1.2x the
    GPU time of its step (the graph replayed back to back)."""
    model = _llama_1b()
    apply_attention(model, method)
    enable_decode_graphs(model)
    ids = torch.randint(3, 8192, (1, 4096), device="cuda")
    room = 2 + 5 * 32 + 64 + 2
    with torch.no_grad():
        out = model(ids, use_cache=True, logits_to_keep=1, **{CACHE_FIELD: StaticDecodeCache(4096 + room)})
    cache, token = getattr(out, CACHE_FIELD), out.logits[:, -1:].argmax(-1)
    wall = _ms_per_token(model, cache, token)
    gpu = graph_replay_ms(model, cache, token, 64)
    print(f"{method}: {wall:.2f} ms per token, GPU step {gpu:.2f} ms ({wall / gpu:.2f}x)")
    assert wall <= 1.2 * gpu


def test_eager_full_attention_near_plain_transformers():
    """Llama-3.2-1B's shape, a 2,048-token prompt, batch 1, both eager (transformers' dynamic cache): a
    decode step of nsa-eval's `full` takes at most 1.1x plain `sdpa`'s."""
    models = {"sdpa": _llama_1b(), "full": apply_attention(_llama_1b(), "full")}
    models["sdpa"].set_attn_implementation("sdpa")
    ids = torch.randint(3, 8192, (1, 2048), device="cuda")
    ms = {}
    for name in ("sdpa", "full", "sdpa", "full"):  # alternated: clocks and caches warm for both
        with torch.no_grad():
            out = models[name](ids, use_cache=True, logits_to_keep=1)
        ms[name] = _ms_per_token(models[name], getattr(out, CACHE_FIELD), out.logits[:, -1:].argmax(-1))
    print(f"eager decode: sdpa {ms['sdpa']:.2f} ms, full {ms['full']:.2f} ms "
          f"({ms['full'] / ms['sdpa']:.2f}x)")
    assert ms["full"] <= 1.1 * ms["sdpa"]
