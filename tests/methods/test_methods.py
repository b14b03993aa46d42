"""Every method against full attention, through a real (tiny) HF model: logits, generation, cache, padding."""

from __future__ import annotations

import pytest
import torch

from nsa_eval.methods import apply_attention, attention_stats, reset_attention_stats
from tests.methods.conftest import ALL_METHODS, SPARSE_METHODS

TOL = dict(rtol=1e-5, atol=1e-5)


def _logits(model, ids, **kwargs):
    with torch.no_grad():
        return model(ids, **kwargs).logits


@pytest.mark.parametrize("method", ALL_METHODS)
def test_short_inputs_equal_full_attention(model, method):
    """T <= budget (and <= sink + local for sink_window): every method is full attention."""
    ids = torch.randint(3, 128, (2, 48), generator=torch.Generator().manual_seed(1))
    model.set_attn_implementation("sdpa")
    ref_logits = _logits(model, ids)
    with torch.no_grad():
        ref_gen = model.generate(ids, max_new_tokens=8, do_sample=False)
    apply_attention(model, method, budget=64, sink=16, local=48)
    torch.testing.assert_close(_logits(model, ids), ref_logits, **TOL)
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(gen, ref_gen)
    stats = attention_stats(model)
    assert stats["method"] == method
    assert stats["max"] == 55  # decode feeds back 7 of the 8 new tokens: the last query sees 55 keys


@pytest.mark.parametrize("method", SPARSE_METHODS)
def test_long_inputs_differ_and_hold_the_budget(model, method):
    ids = torch.randint(3, 128, (2, 96), generator=torch.Generator().manual_seed(2))
    apply_attention(model, "full")
    ref = _logits(model, ids)
    apply_attention(
        model, method, budget=40, sink=4, local=8, **({"page_size": 4} if method == "quest" else {})
    )
    out = _logits(model, ids)
    assert not torch.allclose(out[:, 40:], ref[:, 40:], atol=1e-3)  # sparse past the budget...
    torch.testing.assert_close(out[:, :12], ref[:, :12], **TOL)  # ...dense within sink + local
    stats = attention_stats(model)
    limit = 40 if method != "sink_window" else 12
    assert stats["max"] == stats["held"]["max"] == limit
    # queries 0..95 attend to min(t + 1, limit) keys
    expected = sum(min(t + 1, limit) for t in range(96)) / 96
    assert stats["mean"] == pytest.approx(expected)
    # KV tokens read per KV head: the union over its 2 query heads
    if method == "sink_window":
        assert stats["kv_read_mean"] == stats["mean"]  # positions only: heads agree
    else:
        assert stats["mean"] < stats["kv_read_mean"] <= 2 * stats["mean"]


@pytest.mark.parametrize("method", ALL_METHODS)
def test_decode_with_cache_matches_one_pass(model, method):
    """Prefill 70 tokens, decode 6 one by one: the same logits as one pass over 76 (state on the cache)."""
    ids = torch.randint(3, 128, (2, 76), generator=torch.Generator().manual_seed(3))
    apply_attention(model, method, budget=32, sink=4, local=8)
    one_pass = _logits(model, ids)
    with torch.no_grad():
        out = model(ids[:, :70], use_cache=True)
        cache = out.cache
        steps = []
        for t in range(70, 76):
            out = model(ids[:, t : t + 1], cache=cache, use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), one_pass[:, 70:], rtol=1e-4, atol=1e-4)
    phases = attention_stats(model)["phases"]
    assert phases["decode"]["queries"] == 2 * 4 * 2 * 6  # B x Hq x layers x steps


@pytest.mark.parametrize("method", ALL_METHODS)
def test_right_padding_matches_unpadded(model, method):
    """lm-eval pads on the right: real positions must not see the padding, nor count it."""
    gen = torch.Generator().manual_seed(4)
    long, short = torch.randint(3, 128, (1, 80), generator=gen), torch.randint(3, 128, (1, 60), generator=gen)
    ids = torch.cat([long, torch.cat([short, torch.zeros(1, 20, dtype=torch.long)], 1)])
    mask = torch.ones_like(ids)
    mask[1, 60:] = 0
    apply_attention(model, method, budget=32, sink=4, local=8)
    batched = _logits(model, ids, attention_mask=mask)
    torch.testing.assert_close(batched[0:1], _logits(model, long), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(batched[1:2, :60], _logits(model, short), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", ALL_METHODS)
def test_left_padded_generate_matches_unpadded(model, method):
    """generate() pads on the left: positions count from each sequence's first real token."""
    gen = torch.Generator().manual_seed(5)
    long, short = torch.randint(3, 128, (1, 50), generator=gen), torch.randint(3, 128, (1, 38), generator=gen)
    ids = torch.cat([long, torch.cat([torch.zeros(1, 12, dtype=torch.long), short], 1)])
    mask = torch.ones_like(ids)
    mask[1, :12] = 0
    apply_attention(model, method, budget=32, sink=4, local=8)
    with torch.no_grad():
        batched = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        alone = [model.generate(x, max_new_tokens=6, do_sample=False) for x in (long, short)]
    assert torch.equal(batched[0, -6:], alone[0][0, -6:])
    assert torch.equal(batched[1, -6:], alone[1][0, -6:])


def test_switching_methods_needs_no_reload(model):
    ids = torch.randint(3, 128, (1, 64), generator=torch.Generator().manual_seed(6))
    apply_attention(model, "topk", budget=24, sink=4, local=8)
    first = _logits(model, ids)
    apply_attention(model, "sink_window", budget=24, sink=4, local=8)
    assert not torch.allclose(_logits(model, ids), first)
    apply_attention(model, "topk", budget=24, sink=4, local=8)
    torch.testing.assert_close(_logits(model, ids), first, rtol=0, atol=0)
    model.set_attn_implementation("sdpa")
    apply_attention(model, "full")
    torch.testing.assert_close(_logits(model, ids), _logits_sdpa(model, ids), rtol=0, atol=0)


def _logits_sdpa(model, ids):
    model.set_attn_implementation("sdpa")
    try:
        return _logits(model, ids)
    finally:
        apply_attention(model, "full")


def test_stats_full_dense_layers_and_decode_only(model):
    T = 50
    ids = torch.randint(3, 128, (1, T), generator=torch.Generator().manual_seed(7))
    apply_attention(model, "full")
    _logits(model, ids)
    stats = attention_stats(model)
    assert stats["mean"] == pytest.approx((T + 1) / 2) and stats["max"] == T
    assert stats["kv_read_mean"] == pytest.approx((T + 1) / 2)
    assert [layer["layer"] for layer in stats["layers"]] == [0, 1]

    apply_attention(model, "topk", budget=20, sink=4, local=8, dense_layers=1)
    _logits(model, ids)
    stats = attention_stats(model)
    assert stats["layers"][0]["max"] == T and stats["layers"][1]["max"] == 20
    assert stats["held"]["max"] == 20 and stats["held"]["queries"] == T * 4

    apply_attention(model, "h2o", budget=20, sink=4, local=8, sparse_prefill=False)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=3, do_sample=False)
    stats = attention_stats(model)
    assert stats["phases"]["prefill"]["max"] == T  # the prompt attends densely
    assert stats["phases"]["decode"]["max"] == 20 == stats["held"]["max"]
    reset_attention_stats(model)
    assert attention_stats(model)["queries"] == 0
