"""Several needles: multi-key and multi-hop NIAH grids beside niah.py's single needle.

Two lm-eval tasks on nsa_niah's grid (`niah_lengths` x `niah_depths`, `niah_samples_per_cell`,
`niah_seed`, `niah_haystack`), sized as it is (needles.py: every prompt has exactly `context_length`
tokens and every needle sits exactly at its depth) and scored as it is (1 when the asked 7-digit value
appears in the answer as a whole number). A doc's `depth_percent` is the depth of the needle that
holds the asked value, so the report pivots a heatmap from the samples as for nsa_niah.

- `nsa_niah_multikey` (RULER's niah_multikey_1): `niah_needles` needles of nsa_niah's form, "One of
  the special magic numbers for {key} is: {value}.", with distinct keys and distinct values. The
  question asks for one key; its needle sits at the cell's depth and the others at seeded depths, so
  an answer with another needle's number scores 0.
- `nsa_niah_multihop`: `niah_chains` chains of two needles, a link "The special magic number for
  {key} is stored under the name {name}." and a value "The number stored under the name {name} is:
  {value}.", with keys, names and values all distinct. The question asks for one key's number: the
  answer needs its link, to learn the name, then the value needle of that name. The asked value
  sits at the cell's depth and its link at a seeded depth before it (a chain reads forward, as in
  RULER's variable tracking); every other chain's value at a seeded depth, its link before it.

The prompt is nsa_niah's, with its default question and answer prefix (the multihop instruction adds
that the numbers are stored under names):

    {instruction}\\n{haystack} {needle} {haystack} {needle} ... {haystack}\\n{question} {answer prefix}

Seeded depths are drawn uniformly and snapped to 0, 100 or another needle's depth when within MIN_GAP
(2.5 %) of it: a needle then sits right beside the other, or a few dozen haystack tokens away, never
one or two (which a tokenizer that merges the haystack's first word with the line break before it
cannot cut exactly).

Seeds: grid doc `s` of cell (length, depth) uses seed `niah_seed * 1000 + s`; its keys, names, values,
the other needles' depths and the builtin haystack come from
`random.Random("nsa-niah-{multikey|multihop}:{seed}:{length}:{depth}")`.
"""

from __future__ import annotations

import functools
import random
from typing import Any

from nsa_eval.errors import UsageError
from nsa_eval.tasks.haystack import haystack_text
from nsa_eval.tasks.metadata import MetadataKey
from nsa_eval.tasks.needles import place_needles
from nsa_eval.tasks.niah import (
    DEFAULT_TEMPLATE,
    GRID_CACHE_SIZE,
    NEEDLE_KEYS,
    NiahTemplate,
    answer_separator,
    grid_depths,
    grid_lengths,
    haystack_chars,
    load_tokenizer,
    prompt_parts,
    tokenizer_name,
)
from nsa_eval.tasks.niah import METADATA as NIAH_METADATA
from nsa_eval.values import is_int

MULTIKEY = DEFAULT_TEMPLATE
MULTIHOP = NiahTemplate(
    instruction="Some special magic numbers are hidden within the following text, each stored under a "
    "name. Make sure to memorize it. I will quiz you about the numbers afterwards.",
)
LINK = "The special magic number for {key} is stored under the name {name}."
VALUE = "The number stored under the name {name} is: {value}."
# Keys (and names) are distinct words of niah.NEEDLE_KEYS (84), so the counts are bounded.
MAX_NEEDLES, MAX_CHAINS = 32, 16
MIN_GAP = 2.5  # percent of the haystack between two needles at different depths, at least
DEFAULT_NEEDLES, DEFAULT_CHAINS = 4, 4


def make_multikey_doc(tokenizer, context_length: int, depth_percent: float, seed: int,
                      num_needles: int = DEFAULT_NEEDLES, haystack: str = "builtin") -> dict[str, Any]:
    """One multi-key prompt of exactly `context_length` tokens, the asked needle at `depth_percent`.

    Args:
        tokenizer: the model's tokenizer. context_length: prompt length in tokens.
        depth_percent: 0-100, the asked needle's depth. seed: picks everything else.
        num_needles: needles in all, the asked one included (2 to MAX_NEEDLES).
        haystack: "builtin" or a folder of .txt files.

    Returns:
        make_niah_doc's dict (`prompt`, `input`, `gen_prefix`, `answer`, `key`, `context_length`,
        `depth_percent`, `needle_position`, `haystack_tokens`, `seed`) and `needles`: in prompt
        order, each needle's `text`, `depth_percent` and `position` (its first token).
    """
    _check("nsa_niah_multikey", depth_percent, num_needles, 2, MAX_NEEDLES, "niah_needles")
    rng = random.Random(f"nsa-niah-multikey:{seed}:{context_length}:{float(depth_percent)}")
    keys = rng.sample(NEEDLE_KEYS, num_needles)
    values = [str(v) for v in rng.sample(range(1_000_000, 10_000_000), num_needles)]
    depths = [float(depth_percent)]
    for _ in range(num_needles - 1):
        depths.append(_seeded_depth(rng, 100.0, depths))
    needles = [(depth, MULTIKEY.needle.format(key=key, value=value))
               for depth, key, value in zip(depths, keys, values, strict=True)]
    return _build("nsa_niah_multikey", tokenizer, context_length, seed, haystack, rng, MULTIKEY, needles,
                  asked=0, key=keys[0], value=values[0])


def make_multihop_doc(tokenizer, context_length: int, depth_percent: float, seed: int,
                      num_chains: int = DEFAULT_CHAINS, haystack: str = "builtin") -> dict[str, Any]:
    """One multi-hop prompt of exactly `context_length` tokens, the asked value at `depth_percent`.

    Args:
        as make_multikey_doc; num_chains: chains of a link and a value, the asked one included
        (1 to MAX_CHAINS).

    Returns:
        make_multikey_doc's dict (`needle_position` and `depth_percent` are the asked value's), and
        `name` (the asked chain's), `link_position` and `link_depth_percent` (its link's).
    """
    _check("nsa_niah_multihop", depth_percent, num_chains, 1, MAX_CHAINS, "niah_chains")
    rng = random.Random(f"nsa-niah-multihop:{seed}:{context_length}:{float(depth_percent)}")
    words = rng.sample(NEEDLE_KEYS, 2 * num_chains)
    keys, names = words[:num_chains], words[num_chains:]
    values = [str(v) for v in rng.sample(range(1_000_000, 10_000_000), num_chains)]
    needles, taken = [], [float(depth_percent)]
    for chain, (key, name, value) in enumerate(zip(keys, names, values, strict=True)):
        depth = taken[0] if chain == 0 else _seeded_depth(rng, 100.0, taken)
        link = _seeded_depth(rng, depth, taken + [depth])
        taken += [depth, link]
        needles.append((link, LINK.format(key=key, name=name)))
        needles.append((depth, VALUE.format(name=name, value=value)))  # after its link at a tie
    doc = _build("nsa_niah_multihop", tokenizer, context_length, seed, haystack, rng, MULTIHOP, needles,
                 asked=1, key=keys[0], value=values[0], link=0)
    return {**doc, "name": names[0]}


def _seeded_depth(rng: random.Random, highest: float, taken: list[float]) -> float:
    """A depth in [0, highest] with two decimals, or the nearest of 0, 100 and the `taken` depths when
    within MIN_GAP of it: a few haystack tokens between two needles (or a needle and the instruction or
    the question) cannot be cut exactly by every tokenizer, none or a few dozen can."""
    depth = min(round(rng.uniform(0.0, highest), 2), highest)
    near = [t for t in (0.0, 100.0, *taken) if abs(depth - t) < MIN_GAP]
    return min(near, key=lambda t: abs(depth - t)) if near else depth


def _check(task: str, depth_percent: float, count: int, low: int, high: int, name: str) -> None:
    if not 0 <= depth_percent <= 100:
        raise UsageError(f"{task} depth_percent must be in [0, 100]; got {depth_percent}")
    if not is_int(count) or not low <= count <= high:
        raise UsageError(f"{task}: {name} must be an integer from {low} to {high}; got {count!r}")


def _build(task: str, tokenizer, context_length: int, seed: int, haystack: str, rng: random.Random,
           template: NiahTemplate, needles: list[tuple[float, str]], *, asked: int, key: str, value: str,
           link: int | None = None) -> dict[str, Any]:
    """The doc of `needles` ((depth, text); at equal depths the earlier in the list comes first), where
    needle `asked` (an index into the list) holds `value` of `key` and needle `link` leads to it."""
    depth = needles[asked][0]
    order = sorted(range(len(needles)), key=lambda i: (needles[i][0], i))
    ordered = [needles[i] for i in order]
    head, _, question, answer_prefix = prompt_parts(template, key, value)
    tail = question + answer_separator(question, answer_prefix) + answer_prefix
    hay = haystack_text(haystack, haystack_chars(tokenizer, haystack, context_length), rng)
    placed = place_needles(tokenizer, context_length, head, [text for _, text in ordered],
                           [d for d, _ in ordered], tail, hay,
                           what=f"a {task} prompt (depth {depth}%, seed {seed})")
    index = {i: at for at, i in enumerate(order)}  # needle -> its place in the prompt
    text = placed.text
    doc = {
        "prompt": text,
        "input": text[: len(text) - len(tail) + len(question)],
        "gen_prefix": answer_prefix,
        "answer": value,
        "key": key,
        "context_length": context_length,
        "depth_percent": float(depth),
        "needle_position": placed.positions[index[asked]],
        "haystack_tokens": placed.haystack_tokens,
        "seed": seed,
        "needles": [{"text": t, "depth_percent": float(d), "position": p}
                    for (d, t), p in zip(ordered, placed.positions, strict=True)],
    }
    if link is not None:
        doc |= {"link_position": placed.positions[index[link]], "link_depth_percent": float(needles[link][0])}
    return doc


# ------------------------------------------------------------------ lm-eval glue

MAKERS = {"nsa_niah_multikey": (make_multikey_doc, "niah_needles", DEFAULT_NEEDLES),
          "nsa_niah_multihop": (make_multihop_doc, "niah_chains", DEFAULT_CHAINS)}


def multikey_dataset(**metadata):
    """lm-eval `custom_dataset` of nsa_niah_multikey: the grid from task metadata (docs/tasks.md)."""
    return _dataset("nsa_niah_multikey", metadata)


def multihop_dataset(**metadata):
    """lm-eval `custom_dataset` of nsa_niah_multihop: the grid from task metadata (docs/tasks.md)."""
    return _dataset("nsa_niah_multihop", metadata)


def _dataset(task: str, metadata: dict):
    import datasets

    _, count_key, default = MAKERS[task]
    docs = _named_grid(task, tokenizer_name(metadata, task), tuple(grid_lengths(metadata)),
                       tuple(grid_depths(metadata)), int(metadata.get("niah_seed", 0)),
                       int(metadata.get("niah_samples_per_cell", 1)),
                       str(metadata.get("niah_haystack", "builtin")), int(metadata.get(count_key, default)))
    return {"test": datasets.Dataset.from_list(list(docs))}


@functools.lru_cache(maxsize=GRID_CACHE_SIZE)
def _named_grid(task: str, name: str, lengths: tuple, depths: tuple, seed: int, samples: int,
                haystack: str, count: int) -> tuple[dict, ...]:
    """Every (length, depth, sample) doc, lengths outermost, built once per process (a sweep builds the
    same grid for every model). Seeds: seed * 1000 + sample."""
    from tqdm.auto import tqdm

    make, _, _ = MAKERS[task]
    tokenizer = load_tokenizer(name)
    cells = [(n, d, s) for n in lengths for d in depths for s in range(samples)]
    docs = []
    for n, d, s in tqdm(cells, desc=f"building {task} prompts"):
        doc = make(tokenizer, n, d, seed * 1000 + s, count, haystack)
        doc.pop("prompt")  # `input` + `gen_prefix` hold it
        docs.append({**doc, "sample": s})
    return tuple(docs)


# ------------------------------------------------------------------ the metadata keys they read

GRID_KEYS = ("tokenizer", "niah_lengths", "niah_depths", "niah_seed", "niah_samples_per_cell",
             "niah_haystack")
MULTIKEY_METADATA: dict[str, MetadataKey] = {
    **{name: NIAH_METADATA[name] for name in GRID_KEYS},
    "niah_needles": MetadataKey(lambda v: is_int(v) and 2 <= v <= MAX_NEEDLES,
                                f"an integer from 2 to {MAX_NEEDLES} (needles, the asked one included)"),
}
MULTIHOP_METADATA: dict[str, MetadataKey] = {
    **{name: NIAH_METADATA[name] for name in GRID_KEYS},
    "niah_chains": MetadataKey(lambda v: is_int(v) and 1 <= v <= MAX_CHAINS,
                               f"an integer from 1 to {MAX_CHAINS} (chains of a link and a value, the "
                               "asked one included)"),
}
