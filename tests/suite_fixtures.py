"""Shared by the suite, runner, report and CLI tests: a tiny random Llama with a byte-level BPE
tokenizer trained in memory (no hub), and small suite files that run it on a tiny NIAH grid."""

from __future__ import annotations

import random
import textwrap
from pathlib import Path

WORDS = ("the quick brown fox jumps over a lazy dog while some special magic numbers are hidden "
         "within the following text make sure to memorize it quiz about afterwards what is mentioned "
         "in provided one of for").split()


def make_tiny_llama(out: Path) -> Path:
    """Save a 2-layer random Llama (hidden 32, 4 query / 2 KV heads) and its tokenizer to `out`."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if (out / "config.json").is_file():
        return out
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(60)) + " 0123456789 .,:?" for _ in range(200)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", bos_token="<|endoftext|>")
    config = LlamaConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    fast.save_pretrained(out)
    return out


def tiny_suite_text(model_dir: Path, name: str = "tiny", methods: str = "[full, sink_window]",
                    lengths: str = "[128, 192, 256]", extra: str = "") -> str:
    """Two methods x a 3-length x 2-depth NIAH grid split by length: 6 cells of 2 documents."""
    return textwrap.dedent(f"""\
        name: {name}
        description: tiny random Llama on a tiny NIAH grid (tests)
        defaults:
          pretrained: {model_dir}
          dtype: float32
          sink: 16
          local: 32
          budget: 64
        models:
          - attention: {methods}
        tasks:
          - task: nsa_niah
            label: niah
            split: niah_lengths
            metadata:
              niah_lengths: {lengths}
              niah_depths: [0, 100]
            gen_kwargs:
              max_gen_toks: 4
        {extra}""")


def choice_task_yaml(task: str, data_file: Path) -> str:
    """An lm-eval multiple-choice task over a JSONL file of {"q", "choices", "label"} rows, scored by acc."""
    return textwrap.dedent(f"""\
        task: {task}
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {data_file}
        test_split: test
        output_type: multiple_choice
        doc_to_text: "{{{{q}}}}"
        doc_to_choice: "{{{{choices}}}}"
        doc_to_target: label
        metric_list:
          - metric: acc
            aggregation: mean
            higher_is_better: true
        metadata:
          version: 1.0
        """)
