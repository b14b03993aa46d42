"""The adapter's activated-token statistics do not depend on lm-eval's batching.

lm-eval right-pads a batched loglikelihood call and, with `batch_size=auto`, probes the batch size
with dummy forwards; neither may enter the statistics (the scores never depended on them).
"""

from __future__ import annotations

import os

import pytest
import torch

import nsa_eval  # noqa: F401  (registers nsa-eval with lm-eval)
from nsa_eval.models.lm_adapter import NSAEvalLM

TEXT = open(os.__file__).read()
# contexts of different lengths, so a batch of 4 is right-padded
PAIRS = [
    (TEXT[i * 300 : i * 300 + 60 + i * 70], TEXT[i * 300 + 60 + i * 70 : i * 300 + 100 + i * 70])
    for i in range(4)
]


def loglikelihood_requests():
    from lm_eval.api.instance import Instance

    return [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(PAIRS)]


def generate_requests():
    from lm_eval.api.instance import Instance

    return [
        Instance("generate_until", {}, (c, {"until": ["\n\n"], "max_gen_toks": 3, "do_sample": False}), i)
        for i, (c, _) in enumerate(PAIRS)
    ]


def model_args(name, tiny_llama_dir, tiny_nsa_dir):
    if name == "nsa":
        return dict(pretrained=str(tiny_nsa_dir), attention="nsa", max_length=256)
    return dict(pretrained=str(tiny_llama_dir), attention=name, budget=24, sink=4, local=8, max_length=256)


def scored(lm):
    lm.reset_attention_stats()
    scores = [s for s, _ in lm.loglikelihood(loglikelihood_requests(), disable_tqdm=True)]
    return scores, lm.attention_stats()


def flat(value, prefix=""):
    """Nested stats -> {"phases.prefill.mean": 58.7, ...} (lists by index)."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in flat(item, f"{prefix}{key}.").items()}
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in flat(item, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): value}


def same_stats(a: dict, b: dict) -> None:
    a, b = flat(a), flat(b)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key] == pytest.approx(b[key]), key


@pytest.mark.parametrize("attention", ["full", "topk", "h2o", "nsa"])
def test_right_padding_is_not_counted(attention, tiny_llama_dir, tiny_nsa_dir):
    """Batch size 4 (right-padded rows) gives the statistics and scores of batch size 1."""
    args = model_args(attention, tiny_llama_dir, tiny_nsa_dir)
    one = NSAEvalLM(**args, batch_size=1, device="cpu")
    four = NSAEvalLM(**args, batch_size=4, device="cpu")
    lengths = [min(sum(map(len, one._encode_pair(c, x))), 257) - 1 for c, x in PAIRS]  # model inputs
    assert len(set(lengths)) == len(PAIRS)  # every row of the batch of 4 but the longest is padded
    scores_one, stats_one = scored(one)
    scores_four, stats_four = scored(four)
    assert scores_four == pytest.approx(scores_one, rel=1e-5, abs=1e-4)
    same_stats(stats_four, stats_one)
    assert stats_four["queries"] == sum(lengths) * 4 * 2  # tokens * heads * layers: no padding


@pytest.mark.parametrize("attention", ["topk", "nsa"])
def test_batch_size_probe_is_not_counted(attention, tiny_llama_dir, tiny_nsa_dir):
    """batch_size=auto: lm-eval's own probe (`_detect_batch_size`, run on CPU here with
    max_batch_size=2) runs dummy forwards that leave the statistics untouched."""
    args = model_args(attention, tiny_llama_dir, tiny_nsa_dir)
    auto = NSAEvalLM(**args, batch_size="auto", max_batch_size=2, device="cpu")
    one = NSAEvalLM(**args, batch_size=1, device="cpu")

    calls = []
    hook = auto.model.register_forward_pre_hook(lambda module, args: calls.append(1))
    auto.reset_attention_stats()
    auto.loglikelihood(loglikelihood_requests()[:1], disable_tqdm=True)
    before = auto.attention_stats()
    calls.clear()
    assert auto._detect_batch_size() == 2  # HFLM's probe itself: 5 forwards of [2, max_length]
    assert len(calls) == 5
    hook.remove()
    same_stats(auto.attention_stats(), before)

    for run in (
        lambda lm: lm.loglikelihood(loglikelihood_requests(), disable_tqdm=True),
        lambda lm: lm.generate_until(generate_requests(), disable_tqdm=True),
    ):
        stats = []
        for lm in (auto, one):
            lm.reset_attention_stats()
            run(lm)
            stats.append(lm.attention_stats())
        same_stats(*stats)


def test_stats_paused_restores_the_counts(tiny_llama_dir):
    from nsa_eval.models.loading import attention_stats, attention_stats_paused, load_for_eval

    model, _ = load_for_eval(str(tiny_llama_dir), attention="topk", budget=24, sink=4, local=8)
    ids = torch.randint(0, 100, (1, 40))
    with torch.no_grad():
        model(ids)
        before = attention_stats(model)
        with attention_stats_paused(model):
            model(ids)
            assert attention_stats(model)["queries"] == before["queries"]  # counted afresh inside
        assert attention_stats(model) == before
