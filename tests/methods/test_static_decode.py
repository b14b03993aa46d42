"""Decoding from a static cache (static_cache.py, static_decode.py), run eagerly on the CPU: the cache holds
what the dynamic cache holds, and every method's fixed-shape step gives the logits, tokens and statistics of
today's eager path (`_decode` over a `DynamicCache`), across width changes and capacity growth, left padding
and `generate()` with sampling."""

from __future__ import annotations

import gc

import pytest
import torch

from nsa_eval.errors import UsageError
from nsa_eval.methods import (
    BudgetExceededError,
    StaticDecodeCache,
    apply_attention,
    attention_stats,
    attention_stats_paused,
    reset_attention_stats,
)
from nsa_eval.methods.static_decode import _keys_summed
from tests.methods.conftest import tiny_llama

BUDGET = dict(budget=32, sink=4, local=8)
CASES = [
    ("full", {}),
    ("sink_window", BUDGET),
    ("topk", BUDGET),
    ("topk", {**BUDGET, "group_shared": True}),
    ("quest", {**BUDGET, "local": 16}),
    ("quest", BUDGET),  # local < page_size: the query's page reaches past the local window
    ("quest", {**BUDGET, "local": 16, "group_shared": True}),
    ("h2o", BUDGET),
    ("h2o", {**BUDGET, "group_shared": True}),
    ("topk", {**BUDGET, "dense_layers": 1}),
]


def _ids(B: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 128, (B, T), generator=torch.Generator().manual_seed(seed))


def greedy(model, prompt: torch.Tensor, steps: int, cache=None, mask=None):
    """The prompt (left-padded where `mask` `[B, T]` has zeros), then `steps` greedy tokens one forward at
    a time, positions from the mask as `generate()` passes them: logits `[steps + 1, B, V]` (each step's
    last position), tokens `[B, steps]`, the cache."""
    logits, tokens = [], []
    positions = None if mask is None else (mask.cumsum(-1) - 1).clamp(min=0)  # [B, T]
    with torch.no_grad():
        out = model(prompt, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        for _ in range(steps + 1):
            logits.append(out.logits[:, -1].float())
            if len(tokens) == steps:
                break
            tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))
            if mask is not None:
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                positions = mask.sum(-1, keepdim=True) - 1  # [B, 1]
            out = model(tokens[-1], attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
    return torch.stack(logits), torch.cat(tokens, dim=1), cache


def run(method, params, static: bool, B=2, prompt=20, steps=16, capacity=24, width_step=8, mask=None):
    model = tiny_llama()
    apply_attention(model, method, **params)
    cache = StaticDecodeCache(capacity, width_step=width_step) if static else None
    logits, tokens, cache = greedy(model, _ids(B, prompt), steps, cache, mask)
    return logits, tokens, attention_stats(model), cache, model


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("prompt", [20, 40])  # the steps cross the budget (32), or start past it
@pytest.mark.parametrize(("method", "params"), CASES)
def test_static_steps_equal_dynamic_steps(method, params, prompt, B):
    """16 greedy steps from a cache with room for 4 (it grows twice) read in widths of 8 slots (a new
    width every 8 tokens): the same tokens and statistics as the dynamic cache, logits to float32 rounding."""
    dynamic = run(method, params, False, B, prompt)
    static = run(method, params, True, B, prompt, capacity=prompt + 4)
    torch.testing.assert_close(static[0], dynamic[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(static[1], dynamic[1])
    assert static[2] == dynamic[2]
    cache = static[3]
    assert isinstance(cache, StaticDecodeCache) and cache.version >= 1 and cache.capacity >= prompt + 16
    assert cache.lens.tolist() == [prompt + 16] * B and cache.longest == prompt + 16


@pytest.mark.parametrize(("method", "params"), [CASES[2], CASES[3], CASES[7]])
def test_decode_score_kernel_in_both_paths(method, params, monkeypatch):
    """With the GPU's decode scores (baseline_kernels/decode_scores.py, here under Triton's interpreter)
    taken for every decode query, as on a GPU in half precision: the static steps still equal the dynamic
    ones, both scoring through the kernel (H2O's eager step only: its static step scores the kept keys)."""
    from nsa_eval.baseline_kernels import decode_scores as kernel
    from nsa_eval.methods import base

    launches, real = [], kernel.decode_scores

    def counted(query, key, scaling):
        launches.append(key.shape[2])
        return real(query, key, scaling)

    monkeypatch.setattr(base, "half_on_gpu", lambda query, key: True)
    monkeypatch.setattr(kernel, "decode_scores", counted)
    dynamic = run(method, params, False, 2, 40, steps=6)
    widths, launches[:] = list(launches), []
    static = run(method, params, True, 2, 40, steps=6, capacity=44)
    assert widths and bool(launches) == (method != "h2o")  # H2O's static step scores its gathered keys alone
    torch.testing.assert_close(static[0], dynamic[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(static[1], dynamic[1]) and static[2] == dynamic[2]


@pytest.mark.parametrize(("method", "params"), [("full", {}), ("quest", {**BUDGET, "local": 16}),
                                                ("h2o", BUDGET)])
def test_static_cache_holds_the_dynamic_cache(method, params):
    """After a left-padded prompt and 12 steps: row b's keys, values and H2O mass are the dynamic cache's
    real ones, in order from slot 0 (the prompt's copied bit for bit); Quest's page bounds, grown one key at a
    time, are those of its keys."""
    prompt, steps = 24, 12
    mask = torch.ones(3, prompt, dtype=torch.long)
    mask[0, :7] = mask[2, :3] = 0
    dyn = run(method, params, False, 3, prompt, steps, mask=mask)
    sta = run(method, params, True, 3, prompt, steps, capacity=64, mask=mask)
    assert torch.equal(sta[1], dyn[1])
    dynamic, cache = dyn[3], sta[3]
    lens = mask.sum(-1) + steps
    assert cache.lens.tolist() == lens.tolist() and cache.length == prompt + steps
    real = torch.cat([mask, torch.ones(3, steps, dtype=torch.long)], dim=1).bool()  # [B, S]
    for layer in range(2):
        for b in range(3):
            n = int(lens[b])
            for static_x, dynamic_x in ((cache.keys, dynamic.layers[layer].keys),
                                        (cache.values, dynamic.layers[layer].values)):
                ours, theirs = static_x[layer][b, :, :n], dynamic_x[b, :, real[b]]  # [H, n, D]
                first = n - steps  # the prompt's keys are copied; the steps' computed to float32 rounding
                assert torch.equal(ours[:, :first], theirs[:, :first])
                torch.testing.assert_close(ours[:, first:], theirs[:, first:], rtol=1e-5, atol=1e-5)
                assert not static_x[layer][b, :, n:].any()  # never written
            if method == "h2o":
                mass = dynamic.nsa_eval_state[layer].tensors["mass"][b][:, real[b]]
                torch.testing.assert_close(cache.state[layer]["mass"][b, :, :n], mass, rtol=1e-6, atol=1e-7)
            if method == "quest":
                rebuilt = sta[4]._nsa_eval_controller.method.static_state(cache.keys[layer], cache.lens,
                                                                          cache.capacity, None)
                for name in ("key_min", "key_max"):
                    assert torch.equal(cache.state[layer][name], rebuilt[name])


@pytest.mark.parametrize("sample", [False, True])
@pytest.mark.parametrize(("method", "params"), CASES[::2])
def test_generate_with_a_static_cache(method, params, sample):
    """`generate()` on a left-padded batch, greedy or sampled (T = 0.7, top-p 0.95, a fixed seed): the same
    tokens and statistics with a static cache as with transformers' dynamic one."""
    ids = _ids(3, 24, seed=3)
    mask = torch.ones_like(ids)
    mask[0, :7] = mask[2, :3] = 0
    ids[mask == 0] = 0
    runs = []
    for static in (False, True):
        model = tiny_llama()
        apply_attention(model, method, **params)
        extra = {"cache": StaticDecodeCache(44, width_step=16)} if static else {}
        sampling = dict(do_sample=True, temperature=0.7, top_p=0.95) if sample else dict(do_sample=False)
        torch.manual_seed(0)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=20, **sampling, **extra)
        runs.append((out, attention_stats(model)))
    assert torch.equal(runs[1][0], runs[0][0])
    assert runs[1][1] == runs[0][1]


def test_statistics_fold_at_reads_pauses_and_resets():
    """Static steps count when the statistics are read, also after their cache is gone; steps inside
    `attention_stats_paused` do not count, nor do steps before a reset."""
    model = tiny_llama()
    apply_attention(model, "topk", **BUDGET)
    greedy(model, _ids(2, 40), 4, StaticDecodeCache(48, width_step=8))
    gc.collect()  # the cache is gone: its counts are not
    decode = attention_stats(model)["phases"]["decode"]
    assert decode["queries"] == 2 * 4 * 2 * 4 and decode["max"] == 32  # layers x heads x rows x steps
    with attention_stats_paused(model):
        greedy(model, _ids(2, 40), 3, StaticDecodeCache(48, width_step=8))
    assert attention_stats(model)["phases"]["decode"] == decode
    logits, tokens, cache = greedy(model, _ids(2, 40), 2, StaticDecodeCache(48, width_step=8))
    reset_attention_stats(model)
    with torch.no_grad():
        model(tokens[:, -1:], cache=cache)
    assert attention_stats(model)["phases"]["decode"]["queries"] == 2 * 4 * 2


def test_static_step_over_the_budget_raises_at_the_read(monkeypatch):
    """A static step's counts reach the budget check when the statistics are read."""
    from nsa_eval.methods import static_decode

    model = tiny_llama()
    apply_attention(model, "quest", budget=24, sink=2, local=16)
    _, tokens, cache = greedy(model, _ids(1, 30), 1, StaticDecodeCache(40))
    def every_visible_slot(step, sink, n):  # every visible slot listed: more than the budget
        B, R = step.top.shape[:2]
        W = step.chunk.key.shape[2]
        slots = torch.arange(W).expand(B, R, W)
        return slots, slots < step.S[:, None, None]

    monkeypatch.setattr(static_decode, "kept_slots", every_visible_slot)
    with torch.no_grad():
        model(tokens[:, -1:], cache=cache)  # no raise inside the step
    with pytest.raises(BudgetExceededError, match="over the budget of 24"):
        attention_stats(model)


def test_counts_summed_on_the_host():
    for r in (0, 3, 10):
        for first, last in ((0, 0), (0, 7), (2, 9), (5, 6)):
            for cap in (None, 1, 6, 12, 30):
                expected = sum(r + t if cap is None else min(r + t, cap) for t in range(first + 1, last + 1))
                assert _keys_summed(r, first, last, cap) == expected


def test_bad_settings_are_refused():
    for bad in (0, -1, 2.5, True, "64"):
        with pytest.raises(UsageError, match="capacity must be a positive integer"):
            StaticDecodeCache(bad)
    with pytest.raises(UsageError, match="width_step must be a positive integer"):
        StaticDecodeCache(16, width_step=0)

    plain = tiny_llama()  # no method applied: nothing copies the prompt in
    with pytest.raises(UsageError, match="through a model under nsa_eval.methods.apply_attention"):
        plain(_ids(1, 8), cache=StaticDecodeCache(16))

    model = tiny_llama()
    apply_attention(model, "topk", **BUDGET)
    _, tokens, cache = greedy(model, _ids(2, 10), 1, StaticDecodeCache(16))
    with pytest.raises(UsageError, match="one token for each of its 2 rows per step, got input of shape"):
        model(_ids(2, 3), cache=cache)  # a second prompt
    with pytest.raises(UsageError, match="one token for each of its 2 rows"):
        model(tokens[:1, -1:], cache=cache)
    with pytest.raises(UsageError, match="one prompt per cache"):
        cache.fill(None, None, None, {}, 4)
    apply_attention(model, "quest", **{**BUDGET, "local": 16})
    with pytest.raises(UsageError, match="filled under another apply_attention call"):
        model(tokens[:, -1:], cache=cache)
