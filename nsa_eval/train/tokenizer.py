"""A small byte-level BPE tokenizer trained on the offline corpus (see data.py).

Digits are split one per token (as in Llama/DeepSeek tokenizers), so a 7-digit NIAH value is always
the same 7 tokens wherever it appears: copying it from the needle to the answer is a plain
induction-head lookup, independent of how BPE would have merged the surrounding characters.

The result is saved as a transformers `PreTrainedTokenizerFast` (tokenizer.json +
tokenizer_config.json), so `AutoTokenizer.from_pretrained(checkpoint_dir)` reloads it offline.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [EOS_TOKEN, PAD_TOKEN]  # ids 0 and 1


def train_bpe(texts: Iterable[str], vocab_size: int = 8192):
    """Train a byte-level BPE on `texts`; returns a transformers PreTrainedTokenizerFast.

    Deterministic for a fixed input order (the `tokenizers` trainer is deterministic).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_chunks(texts), trainer=trainer)
    return wrap_fast(tok)


def wrap_fast(tok):
    """A `tokenizers.Tokenizer` -> transformers PreTrainedTokenizerFast with eos/pad/bos set."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        model_max_length=1_000_000,
        clean_up_tokenization_spaces=False,
    )


def load_tokenizer(path: str | Path):
    """Reload a tokenizer saved by `save_pretrained` (a checkpoint or data directory)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _chunks(texts: Iterable[str], size: int = 1 << 16) -> Iterator[str]:
    """Split long texts so the trainer's per-item work stays small."""
    for text in texts:
        for start in range(0, len(text), size):
            yield text[start : start + size]
