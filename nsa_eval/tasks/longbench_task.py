"""`LongBenchTask`: the LongBench subsets' lm-eval task, which can cut each prompt to a length of its own.

Official LongBench (pred.py) cuts every prompt in the middle to the model's own limit (its
model2maxlen: 31,500 tokens for the 32k models) before the chat template, whatever else the model is
evaluated on. With the task metadata `longbench_max_length: N` (a suite's task entry sets it), this
task does the same, with the model's tokenizer (metadata `tokenizer`, else the `pretrained` the
suite runner passes): a suite whose entries allow 65,568 tokens for NIAH at 64k still gives LongBench
its 31,500-token prompts. Without it, prompts are emitted whole and the model truncates them (the
`nsa-eval` model's truncation=middle, to max_length - max_gen_toks).

The template (longbench/_longbench_template.yaml) selects it with
`class: !function nsa_eval.tasks.longbench_task.LongBenchTask`.
"""

from __future__ import annotations

from nsa_eval.errors import UsageError
from nsa_eval.tasks.local_task import LocalFirstTask
from nsa_eval.tasks.longbench import MAX_LENGTH_KEY, METADATA, truncate_prompt_middle
from nsa_eval.tasks.niah import load_tokenizer


class LongBenchTask(LocalFirstTask):
    """A LocalFirstTask whose prompts are cut in the middle to `longbench_max_length` tokens, if set."""

    def __init__(self, data_dir=None, cache_dir=None, download_mode=None, config=None):
        metadata = (config or {}).get("metadata") or {}
        self.max_prompt_tokens = prompt_limit(metadata, str((config or {}).get("task")))
        # lm-eval's constructor already renders a prompt, so the tokenizer comes first
        self.prompt_tokenizer = None if self.max_prompt_tokens is None else _tokenizer_of(metadata)
        super().__init__(data_dir, cache_dir, download_mode, config=config)

    def doc_to_text(self, doc, doc_to_text=None):
        text = super().doc_to_text(doc, doc_to_text)
        if self.max_prompt_tokens is None or not isinstance(text, str):
            return text
        return truncate_prompt_middle(self.prompt_tokenizer, text, self.max_prompt_tokens)


def prompt_limit(metadata: dict, task: str) -> int | None:
    """The task's `longbench_max_length` (None when unset); a UsageError unless a positive integer."""
    value = metadata.get(MAX_LENGTH_KEY)
    if value is None:
        return None
    if not METADATA[MAX_LENGTH_KEY].accepts(value):
        raise UsageError(f"{task}: metadata {MAX_LENGTH_KEY} must be a positive integer (prompt tokens), "
                         f"got {value!r}")
    return value


def _tokenizer_of(metadata: dict):
    name = metadata.get("tokenizer") or metadata.get("pretrained")
    if not isinstance(name, str) or not name:
        raise UsageError(f"LongBench's {MAX_LENGTH_KEY} counts the model's tokens: pass metadata "
                         '{"tokenizer": "<name or dir>"} (or pretrained=... in model_args)')
    return load_tokenizer(name)
