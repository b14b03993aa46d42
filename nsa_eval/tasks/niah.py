"""Needle in a haystack: a grid of context lengths x needle depths, sized with the model's tokenizer.

One prompt (RULER niah_single style, template configurable):

    {instruction}\\n{haystack before} {needle} {haystack after}\\n{question} {answer prefix}

- Prompt length: the number of tokens of the whole prompt string above (instruction, haystack,
  needle, question and answer prefix) as `tokenizer(prompt, add_special_tokens=False)` counts them,
  i.e. without BOS and without any chat template. Every prompt has exactly `context_length` tokens.
- Needle depth: let `fixed` be the token count of the prompt built with an empty haystack and
  `H = context_length - fixed` the haystack's token budget. The needle's first token sits at token
  index `start + round(depth_percent / 100 * H)`, where `start` is its index with an empty haystack
  (right after the instruction). So depth 0 puts the needle first, depth 100 last, before the question.
- Haystack: "builtin" (varied English sentences from a seeded grammar, no download, no digits) or a
  folder of .txt files (read in name order, repeated when short, e.g. Paul Graham's essays).
  The haystack is cut at character positions, found by search against real token counts, so the
  length and the depth are exact (`needles.place_needles`, which niah_multi.py's several needles
  share). Where the count jumps by two tokens at the one character that matters (a word that a small
  BPE splits oddly), no cut of that text is exact; then the haystack starts further on (at the next
  sentence, later at the next word; the same for the same seed) and is cut again. `make_niah_doc`
  raises only if none of `MAX_HAYSTACK_STARTS` starts can be exact.
- Needle: "One of the special magic numbers for {key} is: {value}." with a seeded 7-digit value and a
  seeded key word. Score: 1 when the value appears in the answer as a whole number, else 0.

The space between question and answer prefix follows lm-eval's join rule (`answer_separator`): it is
left out when the question ends with whitespace or the prefix starts with it or is empty. So in
lm-eval (`nsa_niah`), joining `input` and `gen_prefix` gives exactly `prompt` for every template;
with a chat template the template's tokens come on top of `context_length`.
"""

from __future__ import annotations

import functools
import os
import random
import re
from dataclasses import asdict, dataclass, fields
from typing import Any

from nsa_eval.errors import UsageError
from nsa_eval.tasks.haystack import check_haystack, haystack_text
from nsa_eval.tasks.metadata import TOKENIZER, MetadataKey, int_list, number_list
from nsa_eval.tasks.needles import (  # noqa: F401  (needle_token_index: part of this module's API)
    MAX_HAYSTACK_STARTS,
    START_MARGIN,
    count_tokens,
    needle_token_index,
    place_needles,
)
from nsa_eval.values import MAX_INT, is_int

# Grids kept per process: a suite split by length asks for every length once per model, and a sweep
# runs each on many models; the paper's whole grid is about 10 MB of text.
GRID_CACHE_SIZE = 64

# The paper's Figure 5 grid: 1K, 8K, 15K, ..., 64K (step 7K) x depths 0, 11.11, ..., 100 %.
PAPER_LENGTHS = [1024 + 7168 * i for i in range(10)]
PAPER_DEPTHS = [round(100 * i / 9, 2) for i in range(10)]


@dataclass(frozen=True)
class NiahTemplate:
    """The four strings of a NIAH prompt; `{key}` and `{value}` are filled per doc."""

    instruction: str = (
        "Some special magic numbers are hidden within the following text. "
        "Make sure to memorize it. I will quiz you about the numbers afterwards."
    )
    needle: str = "One of the special magic numbers for {key} is: {value}."
    question: str = "What is the special magic number for {key} mentioned in the provided text?"
    answer_prefix: str = "The special magic number for {key} mentioned in the provided text is"


DEFAULT_TEMPLATE = NiahTemplate()

# The words a needle's key is drawn from (its value is a 7-digit number).
NEEDLE_KEYS = (
    "amber anchor apricot badger ballad banner barley beacon bramble breeze bucket cactus canyon "
    "cedar chisel cinder clover cobalt comet copper cricket crystal dagger delta dolphin ember "
    "falcon fennel fjord flint garnet gecko glacier granite harbor hazel heron hickory iris ivory "
    "jasper juniper kestrel lagoon lantern lemur lilac lotus magnet maple marble meadow mango "
    "nectar nickel nutmeg oasis obsidian olive orchid otter pebble pepper pigeon plume quartz "
    "quill raven reef saffron sage sapphire sparrow spruce tangerine thistle thunder topaz tulip "
    "velvet violet walnut willow zephyr"
).split()

# ------------------------------------------------------------------ one prompt


def answer_separator(question: str, answer_prefix: str) -> str:
    """The text between the question and the answer prefix: lm-eval's rule for input + gen_prefix.

    lm-eval (0.4.13, `build_qa_turn` / `requires_delimiter`) puts one space between a doc's `input`
    and its `gen_prefix` only when the prefix is non-empty and there is no whitespace at the join
    (the input does not end with whitespace, the prefix does not start with it). The prompt uses the
    same rule, so what lm-eval assembles is the built prompt for every template.
    """
    if not answer_prefix or not question:
        return ""
    return "" if question[-1].isspace() or answer_prefix[0].isspace() else " "


def make_niah_doc(
    tokenizer,
    context_length: int,
    depth_percent: float,
    seed: int,
    haystack: str = "builtin",
    template: NiahTemplate = DEFAULT_TEMPLATE,
) -> dict[str, Any]:
    """One NIAH prompt of exactly `context_length` tokens with the needle at `depth_percent`.

    Args:
        tokenizer: the model's tokenizer (a transformers tokenizer; fast ones are quicker).
        context_length: prompt length in tokens (module docstring: what is counted).
        depth_percent: 0-100, the needle's position within the haystack's token budget.
        seed: picks the key, the 7-digit value and (builtin haystack) the filler text.
        haystack: "builtin" or a folder of .txt files.
        template: the instruction/needle/question/answer-prefix strings.

    Returns:
        dict with `prompt` (= `input` + " " + `gen_prefix`), `input`, `gen_prefix`, `answer` (the
        value, a string), `key`, `context_length`, `depth_percent`, `needle_position` (token index of
        the needle's first token), `haystack_tokens` (H), `seed`.
    """
    if not 0 <= depth_percent <= 100:
        raise UsageError(f"NIAH depth_percent must be in [0, 100]; got {depth_percent}")
    rng = random.Random(f"nsa-niah:{seed}:{context_length}:{depth_percent}")
    key = rng.choice(NEEDLE_KEYS)
    value = str(rng.randint(1_000_000, 9_999_999))
    hay = haystack_text(haystack, haystack_chars(tokenizer, haystack, context_length), rng)
    head, needle, question, answer_prefix = prompt_parts(template, key, value)
    tail = question + answer_separator(question, answer_prefix) + answer_prefix
    placed = place_needles(tokenizer, context_length, head, [needle], [depth_percent], tail, hay,
                           max_starts=MAX_HAYSTACK_STARTS,
                           what=f"a NIAH prompt (depth {depth_percent}%, seed {seed})")
    text = placed.text
    # lm-eval puts answer_separator(input, gen_prefix) between the two: the model sees `text` exactly
    return {
        "prompt": text,
        "input": text[: len(text) - len(tail) + len(question)],
        "gen_prefix": answer_prefix,
        "answer": value,
        "key": key,
        "context_length": context_length,
        "depth_percent": float(depth_percent),
        "needle_position": placed.positions[0],
        "haystack_tokens": placed.haystack_tokens,
        "seed": seed,
    }


def prompt_parts(template: NiahTemplate, key: str, value: str) -> tuple[str, str, str, str]:
    """(head, needle, question, answer prefix) of a prompt: the head ends the instruction's line and
    the question starts a line of its own."""
    return (template.instruction + "\n", template.needle.format(key=key, value=value),
            "\n" + template.question.format(key=key), template.answer_prefix.format(key=key))


def haystack_chars(tokenizer, haystack: str, context_length: int) -> int:
    """Haystack characters to generate for a `context_length`-token prompt: a quarter more than the
    tokenizer's characters per token on this haystack suggest, and room for later starts."""
    sample = haystack_text(haystack, 4096, random.Random(0))[:4096]
    chars_per_token = len(sample) / max(count_tokens(tokenizer, sample), 1)
    return int(1.25 * chars_per_token * context_length) + 2048 + START_MARGIN


# ------------------------------------------------------------------ lm-eval glue


def load_tokenizer(name_or_tokenizer):
    """A tokenizer object as given, a project short name (e.g. smollm2-135m), a local dir or hub name."""
    if not isinstance(name_or_tokenizer, str):
        return name_or_tokenizer
    return _named_tokenizer(name_or_tokenizer)


@functools.lru_cache(maxsize=4)
def _named_tokenizer(name: str):
    """Loaded once per process: every NIAH and LongBench cell, and the suite's context check, ask."""
    from transformers import AutoTokenizer

    # trust_remote_code=False: unset, transformers asks on stdin whether to run an auto_map's code
    if os.path.exists(name) or "/" in name:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=False)
    from nsa_eval.models import resolve_checkpoint  # short names: the tokenizer files, not the weights

    return AutoTokenizer.from_pretrained(resolve_checkpoint(name), trust_remote_code=False)


def framing_tokens(tokenizer, *, chat: bool = False, system_instruction: str | None = None,
                   template: NiahTemplate = DEFAULT_TEMPLATE) -> int:
    """Tokens lm-eval puts around a NIAH prompt on top of its `context_length`: the special tokens
    the tokenizer adds (a BOS), a `system_instruction` (which lm-eval writes straight before the
    prompt without a chat template), or a chat template's turns (the answer prefix continues the
    assistant's turn), as lm-eval 0.4.13 renders and encodes them. Exact for special tokens alone;
    with a system instruction or a chat template it is measured on a short stand-in prompt, so it
    can be a token off where they meet a long prompt's first and last words."""
    body, prefix = "x", template.answer_prefix.format(key=NEEDLE_KEYS[0])
    bare = body + answer_separator(body, prefix) + prefix
    if chat:
        messages = ([{"role": "system", "content": system_instruction}] if system_instruction else [])
        messages.append({"role": "user", "content": body})
        if prefix:
            messages.append({"role": "assistant", "content": prefix})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=not prefix,
                                             continue_final_message=bool(prefix))
    else:
        text = (system_instruction or "") + bare
    bos = getattr(tokenizer, "bos_token", None)
    specials = not (bos and text.startswith(bos))  # lm-eval adds none before a BOS already there
    return len(tokenizer(text, add_special_tokens=specials)["input_ids"]) - count_tokens(tokenizer, bare)


def _as_list(value, cast) -> list:
    if isinstance(value, str):
        value = [v for v in re.split(r"[,\s]+", value.strip("[]")) if v]
    return [cast(v) for v in (value if isinstance(value, list | tuple) else [value])]


def grid_docs(
    tokenizer,
    lengths=PAPER_LENGTHS,
    depths=PAPER_DEPTHS,
    *,
    seed: int = 0,
    samples_per_cell: int = 1,
    haystack: str = "builtin",
    template: NiahTemplate = DEFAULT_TEMPLATE,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Every (length, depth, sample) doc, lengths outermost. Seeds: seed * 1000 + sample."""
    from tqdm.auto import tqdm

    cells = [(n, d, s) for n in lengths for d in depths for s in range(samples_per_cell)]
    docs = []
    for n, d, s in tqdm(cells, desc="building NIAH prompts", disable=not progress):
        doc = make_niah_doc(tokenizer, n, d, seed * 1000 + s, haystack, template)
        doc.pop("prompt")  # `input` + `gen_prefix` hold it; halves the size of logged samples
        docs.append({**doc, "sample": s})
    return docs


def niah_dataset(**metadata):
    """lm-eval `custom_dataset`: the grid from task metadata (docs/tasks.md lists the keys)."""
    import datasets

    docs = _named_grid(
        tokenizer_name(metadata, "nsa_niah"),
        tuple(grid_lengths(metadata)),
        tuple(grid_depths(metadata)),
        int(metadata.get("niah_seed", 0)),
        int(metadata.get("niah_samples_per_cell", 1)),
        str(metadata.get("niah_haystack", "builtin")),
        grid_template(metadata),
    )
    return {"test": datasets.Dataset.from_list(list(docs))}


@functools.lru_cache(maxsize=GRID_CACHE_SIZE)
def _named_grid(name: str, lengths: tuple, depths: tuple, seed: int, samples: int, haystack: str,
                template: NiahTemplate) -> tuple[dict, ...]:
    """`grid_docs` for a tokenizer by name, built once per process: the prompts are fully seeded, and a
    budget sweep builds the same grid for every method (a 64k prompt takes seconds)."""
    return tuple(grid_docs(load_tokenizer(name), list(lengths), list(depths), seed=seed,
                           samples_per_cell=samples, haystack=haystack, template=template))


def grid_lengths(metadata: dict) -> list[int]:
    """The prompt lengths a task's metadata asks for (`niah_lengths`, default the paper's)."""
    return _as_list(metadata.get("niah_lengths", PAPER_LENGTHS), int)


def grid_depths(metadata: dict) -> list[float]:
    """The needle depths a task's metadata asks for (`niah_depths`, default the paper's)."""
    return _as_list(metadata.get("niah_depths", PAPER_DEPTHS), float)


def tokenizer_name(metadata: dict, task: str) -> str:
    """The tokenizer a grid task builds its prompts with: metadata `tokenizer`, else the model's."""
    name = metadata.get("tokenizer") or metadata.get("pretrained")
    if not name:
        raise UsageError(
            f"{task} builds its prompts with the model's tokenizer: pass metadata "
            '{"tokenizer": "<name or dir>"} (or pretrained=... in model_args)'
        )
    return str(name)


def grid_template(metadata: dict) -> NiahTemplate:
    """The prompt template: `niah_template`'s strings over the default ones."""
    return NiahTemplate(**{**asdict(DEFAULT_TEMPLATE), **(metadata.get("niah_template") or {})})


def needle_found(answer: str, value: str) -> bool:
    """True when `value` appears in `answer` as a whole number (not inside a longer digit run)."""
    return re.search(rf"(?<!\d){re.escape(str(value))}(?!\d)", answer) is not None


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    return {"score": float(needle_found(results[0], doc["answer"]))}


# ------------------------------------------------------------------ the metadata keys nsa_niah reads

TEMPLATE_KEYS = tuple(f.name for f in fields(NiahTemplate))
# The placeholders each template string is filled with (the instruction is used as it is written,
# braces and all).
TEMPLATE_FIELDS = {"needle": ("key", "value"), "question": ("key",), "answer_prefix": ("key",)}


def check_template(template: dict, where: str) -> None:
    """Each template string formats with the placeholders NIAH fills ({key}, and {value} in the
    needle, which must show it), so a typo fails when the suite loads rather than when the prompts
    are built; `where` starts the message (the suite's file and key)."""
    import string

    for name, allowed in TEMPLATE_FIELDS.items():
        if name not in template:
            continue
        expected = " and ".join(f"{{{a}}}" for a in allowed)
        try:
            parsed = [(f, spec, conv) for _, f, spec, conv in string.Formatter().parse(template[name])
                      if f is not None]
        except ValueError as err:
            raise UsageError(f"{where}.{name}: {err}; expected the placeholders {expected} (write "
                             "{{ and }} for literal braces)") from None
        for field_name, spec, conversion in parsed:
            if field_name not in allowed or spec or conversion:
                shown = field_name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")
                raise UsageError(f"{where}.{name}: unknown placeholder {{{shown}}}; expected "
                                 f"{expected} as they are (write {{{{ and }}}} for literal braces)")
        if name == "needle" and "value" not in {f for f, _, _ in parsed}:
            raise UsageError(f"{where}.needle: no {{value}} placeholder, so the needle would hide "
                             "no number; expected a sentence with {key} and {value}")


METADATA: dict[str, MetadataKey] = {
    "tokenizer": TOKENIZER,
    "niah_lengths": MetadataKey(lambda v: int_list(v, lambda x: 0 < x <= MAX_INT),
                                "a positive integer or a list of them (prompt lengths in tokens)"),
    "niah_depths": MetadataKey(lambda v: number_list(v, lambda x: 0 <= x <= 100),
                               "a number from 0 to 100 or a list of them (needle depths in percent)"),
    "niah_seed": MetadataKey(lambda v: is_int(v) and abs(v) <= MAX_INT, "an integer"),
    "niah_samples_per_cell": MetadataKey(lambda v: is_int(v) and 1 <= v <= MAX_INT, "a positive integer"),
    "niah_haystack": MetadataKey(lambda v: isinstance(v, str) and bool(v),
                                 "'builtin' or a folder of .txt files", check_here=check_haystack),
    "niah_template": MetadataKey(lambda v: isinstance(v, dict) and all(
        k in TEMPLATE_KEYS and isinstance(x, str) for k, x in v.items()),
        "a mapping with any of " + ", ".join(TEMPLATE_KEYS) + " (strings)", check=check_template),
}
