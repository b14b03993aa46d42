"""Tiny random models, a locally trained tokenizer and local JSONL lm-eval tasks: nothing from a hub.

On a machine without a GPU a test that asks for the Triton kernels (`kernel_impl="triton"`) runs them in
Triton's interpreter: TRITON_INTERPRET=1 is set here, before any test module imports triton, as
tests/kernels/conftest.py does. The models' default ("auto") still takes the reference on the CPU.
"""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TOY_MC = [
    {"question": "What color is the sky on a clear day?", "choices": ["blue", "green", "red"], "label": 0},
    {"question": "How many legs does a cat have?", "choices": ["two", "four", "six"], "label": 1},
    {"question": "Which number is the largest?", "choices": ["three", "ten", "one"], "label": 1},
    {"question": "What do bees make?", "choices": ["milk", "silk", "honey"], "label": 2},
]
TOY_GEN = [
    {"question": "Repeat the word apple.", "answer": "apple"},
    {"question": "Say the number one in words, please, as briefly as you can.", "answer": "one"},
    {"question": "Name a color.", "answer": "blue"},
]
TOY_PPL = [
    {"text": "The quick brown fox jumps over the lazy dog. " * 3},
    {"text": "def f(x):\n    return x\n"},
]

TASK_YAMLS = {
    "toy_mc": """task: toy_mc
dataset_path: json
dataset_name: null
dataset_kwargs:
  data_files:
    test: {data}/toy_mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list: [{{metric: acc, aggregation: mean, higher_is_better: true}}]
metadata: {{version: 1.0}}
""",
    "toy_gen": """task: toy_gen
dataset_path: json
dataset_name: null
dataset_kwargs:
  data_files:
    test: {data}/toy_gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs: {{until: ["\\n"], max_gen_toks: 6, do_sample: false}}
metric_list: [{{metric: exact_match, aggregation: mean, higher_is_better: true}}]
metadata: {{version: 1.0}}
""",
    "toy_ppl": """task: toy_ppl
dataset_path: json
dataset_name: null
dataset_kwargs:
  data_files:
    test: {data}/toy_ppl.jsonl
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - {{metric: word_perplexity, aggregation: weighted_perplexity, higher_is_better: false}}
metadata: {{version: 1.0}}
""",
}


def tiny_nsa_config(vocab_size: int = 97, **overrides):
    from nsa_eval.models.configuration_nsa import NSAConfig

    params = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, block_len=8, stride=4, select_size=8,
                  num_selected=3, window=8, max_position_embeddings=512)
    params.update(overrides)
    return NSAConfig(**params)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A byte-level BPE (vocab 300) trained in about a second on a few stdlib files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [str(stdlib / name) for name in ("os.py", "json/__init__.py", "textwrap.py")]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = ["<|bos|>", "<|eos|>", "<|pad|>"]
    trainer = trainers.BpeTrainer(vocab_size=300, min_frequency=2, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(files, trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                     pad_token="<|pad|>")
    hf_tok.model_max_length = 512
    out = tmp_path_factory.mktemp("tokenizer")
    hf_tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_nsa_dir(tmp_path_factory, tokenizer_dir) -> Path:
    """A saved random NSA checkpoint (paper layout: MLP compression, separate branch K/V) + tokenizer."""
    from transformers import AutoTokenizer

    from nsa_eval.models.modeling_nsa import NSAForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    config = tiny_nsa_config(len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    out = tmp_path_factory.mktemp("nsa_tiny")
    NSAForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tasks_dir(tmp_path_factory) -> Path:
    """lm-eval task YAMLs over local JSONL files (pass as include_path)."""
    root = tmp_path_factory.mktemp("tasks")
    for name, rows in (("toy_mc", TOY_MC), ("toy_gen", TOY_GEN), ("toy_ppl", TOY_PPL)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (root / f"{name}.yaml").write_text(TASK_YAMLS[name].format(data=root))
    return root


@pytest.fixture(scope="session")
def llama_config_dir(tmp_path_factory) -> Path:
    """A directory with a Llama config.json and no weights: anything that reads weights fails."""
    out = tmp_path_factory.mktemp("llama_config_only")
    (out / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32,
                                                 "num_hidden_layers": 2, "num_attention_heads": 4,
                                                 "num_key_value_heads": 2, "vocab_size": 300}))
    return out


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tokenizer_dir) -> Path:
    """A saved random 2-layer Llama (GQA, 4 query heads over 2 KV heads) + tokenizer, for the baselines."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # sharper attention, so a sparse method's choice changes the scores
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    out = tmp_path_factory.mktemp("llama_tiny")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
