"""Static decoding of transformers models through the lm-eval adapter, on the CPU (where the steps run
eagerly; tests/models/test_gpu_hf_decode_graph.py replays them from CUDA graphs): `generate_until`, greedy
and sampled, with stop strings, gives what transformers' dynamic cache gives, with the same statistics."""

from __future__ import annotations

import inspect

import pytest
import torch
from lm_eval.api.instance import Instance

from nsa_eval.errors import UsageError
from nsa_eval.methods import StaticDecodeCache, apply_attention, attention_stats
from nsa_eval.models.hf_decode_graph import (
    GRAPHS_ATTRIBUTE,
    disable_decode_graphs,
    enable_decode_graphs,
    static_cache_for,
)
from nsa_eval.models.lm_adapter import NSAEvalLM
from tests.methods.conftest import tiny_llama

PROMPTS = ["a", "a much longer prompt than the others, so the batch is left-padded", "mid length prompt"]


def _generate(lm, until: list[str], **generation) -> list[str]:
    torch.manual_seed(0)
    kwargs = {"until": until, "max_gen_toks": 12, **generation}
    return lm.generate_until([Instance("generate_until", {}, (q, kwargs), i) for i, q in enumerate(PROMPTS)])


@pytest.mark.parametrize(("attention", "sampled"), [("full", False), ("sink_window", False), ("topk", False),
                                                    ("quest", False), ("h2o", False), ("full", True),
                                                    ("quest", True), ("h2o", True)])
def test_generate_until_from_a_static_cache(tiny_llama_dir, attention, sampled):
    """Batch 3, left-padded, budget 16 (the longest prompt runs past it), greedy or sampled at T = 0.7,
    top-p 0.95 with a fixed seed, and a stop string taken from the middle of the second row's free text:
    the same text (cut at the stop string) and statistics with static_decode on and off."""
    generation = dict(do_sample=True, temperature=0.7, top_p=0.95) if sampled else dict(do_sample=False)
    params = {"page_size": 4} if attention == "quest" else {}
    texts, stats = {}, {}
    for static in (False, True):
        lm = NSAEvalLM(pretrained=str(tiny_llama_dir), attention=attention, budget=16, sink=2, local=8,
                       batch_size=3, device="cpu", static_decode=static, **params)
        assert (getattr(lm.model, GRAPHS_ATTRIBUTE, None) is not None) == static
        if not static:
            free = _generate(lm, ["<never generated>"], **generation)
            stop = free[1][4:6]
            lm.reset_attention_stats()
        texts[static] = _generate(lm, [stop], **generation)
        controller = lm.model._nsa_eval_controller
        assert any(counts.steps for counts in controller._static_counts) == static  # it decoded statically
        stats[static] = lm.attention_stats()
    assert texts[True] == texts[False]
    assert texts[True][1] == free[1][:free[1].index(stop)]  # cut where the stop string begins
    assert stats[True] == stats[False] and stats[True]["phases"]["decode"]["queries"] > 0


def test_static_decode_is_off_on_the_cpu_by_default_and_checked(tiny_llama_dir):
    lm = NSAEvalLM(pretrained=str(tiny_llama_dir), attention="full", device="cpu")
    assert getattr(lm.model, GRAPHS_ATTRIBUTE, None) is None and static_cache_for(lm.model, 8) is None
    with pytest.raises(UsageError, match="static_decode='maybe': expected true or false"):
        NSAEvalLM.create_from_arg_string(f"pretrained={tiny_llama_dir},static_decode=maybe")


def test_the_wrapped_forward_keeps_its_signature_and_answers():
    """transformers reads the forward's parameters (`logits_to_keep`); off the GPU the wrapper hands every
    call to the model's own forward, so a static decode is the same with and without it."""
    model = tiny_llama()
    apply_attention(model, "topk", budget=16, sink=2, local=4)
    ids = torch.randint(3, 128, (2, 21), generator=torch.Generator().manual_seed(4))
    logits = {}
    for wrapped in (False, True):
        if wrapped:
            runner = enable_decode_graphs(model)
            assert enable_decode_graphs(model) is runner
            assert "logits_to_keep" in inspect.signature(model.forward).parameters
        cache = static_cache_for(model, 24)
        assert (cache is not None) == wrapped
        cache = cache or StaticDecodeCache(24)
        with torch.no_grad():
            model(ids[:, :20], cache=cache)
            logits[wrapped] = model(ids[:, 20:], cache=cache).logits
        assert cache.decode_graph is None and cache.lens.tolist() == [21, 21]
    assert torch.equal(logits[True], logits[False])
    disable_decode_graphs(model)
    assert "forward" not in vars(model) and getattr(model, GRAPHS_ATTRIBUTE, None) is None


@pytest.mark.parametrize("attention", ["full", "sink_window", "topk", "quest", "h2o"])
def test_a_batch_prompt_prefilled_a_row_at_a_time(attention):
    """A left-padded batch of 3 into a static cache a row at a time (`prefill_tokens` below one row's
    length) holds what the whole batch's prefill leaves: keys, values, lengths and method state, the
    same greedy tokens after it and the same statistics."""
    params = {"page_size": 4} if attention == "quest" else {}
    ids = torch.randint(3, 128, (3, 30), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :11], mask[2, :4] = 0, 0  # left padding
    runs = {}
    for prefill_tokens in (10**6, 8):
        model = tiny_llama()
        apply_attention(model, attention, budget=16, sink=2, local=8, **params)
        enable_decode_graphs(model, prefill_tokens=prefill_tokens)
        cache = StaticDecodeCache(40)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=6, do_sample=False,
                                 pad_token_id=0)
        runs[prefill_tokens] = out, cache, attention_stats(model)
    (whole, whole_cache, whole_stats), (rows, rows_cache, rows_stats) = runs[10**6], runs[8]
    assert torch.equal(rows, whole)
    assert rows_cache.lens.tolist() == whole_cache.lens.tolist() == [24, 35, 31]  # prompt + 5 steps
    # the slots past a row's length are never read (the whole batch's prefill leaves its padding there)
    lens = whole_cache.lens.tolist()
    for a, b in zip(rows_cache.keys + rows_cache.values, whole_cache.keys + whole_cache.values, strict=True):
        for row, n in enumerate(lens):
            torch.testing.assert_close(a[row, :, :n], b[row, :, :n])
    for a, b in zip(rows_cache.state, whole_cache.state, strict=True):
        assert a.keys() == b.keys()
        for name in a:
            if name == "mass":  # H2O's, per slot
                for row, n in enumerate(lens):
                    torch.testing.assert_close(a[name][row, :, :n], b[name][row, :, :n])
            else:  # Quest's page bounds, from the written slots only
                torch.testing.assert_close(a[name], b[name])
    assert rows_stats == whole_stats and rows_stats["phases"]["decode"]["queries"] > 0
