"""Needles at exact token positions in a prompt of an exact token length: the sizing every NIAH task shares.

A prompt is laid out as (an empty stretch of haystack takes its space with it)

    {head}{haystack} {needle 1} {haystack} {needle 2} ... {needle k} {haystack}{tail}

with consecutive stretches of one haystack text. Lengths are token counts of the whole string as
`tokenizer(text, add_special_tokens=False)` counts them. Let `fixed` be the prompt's length with an
empty haystack, `H = context_length - fixed` the haystack's token budget and `start_i` needle i's
first token with an empty haystack. `place_needles` cuts the haystack so that the prompt has exactly
`context_length` tokens and needle i's first token sits at `start_i + round(depth_i / 100 * H)`: depth
0 right after the head, depth 100 right before the tail, each needle's depth the share of the
haystack before it. Needles are given in prompt order, so depths never decrease.

The cuts are character positions found by search against real token counts, one needle after the
other, then the haystack's end. Where the count jumps by two tokens at the one character that
matters (a word that a small BPE splits oddly), no cut of that text is exact; then the haystack
starts further on (at the next sentence, later at the next word; the same for the same text) and is
cut again. `place_needles` raises only if none of `max_starts` starts is exact; it never returns an
approximation.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from nsa_eval.errors import UsageError

# Haystack starts tried per prompt before giving up: a later start is needed only where a tokenizer's
# count jumps by two tokens at a cut, which the next start almost always avoids, so 64 is ample.
MAX_HAYSTACK_STARTS = 64
START_MARGIN = 4096  # haystack characters a caller adds, so that a later start still leaves enough text


def count_tokens(tokenizer, text: str) -> int:
    """Tokens of text as a prompt's length counts them (no special tokens)."""
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def needle_token_index(tokenizer, text: str, char: int) -> int:
    """Index of the token holding character `char` of text (a fast tokenizer's offsets if it has them)."""
    if getattr(tokenizer, "is_fast", False):
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        for i, (_, end) in enumerate(offsets):
            if end > char:
                return i
        return len(offsets)
    return count_tokens(tokenizer, text[:char].rstrip(" "))


@dataclass(frozen=True)
class Placed:
    """A sized prompt: its text, each needle's first token and character offset (in prompt order),
    and the haystack's token budget H."""

    text: str
    positions: tuple[int, ...]
    chars: tuple[int, ...]
    haystack_tokens: int


def place_needles(tokenizer, context_length: int, head: str, needles: list[str], depths: list[float],
                  tail: str, hay: str, *, max_starts: int = MAX_HAYSTACK_STARTS,
                  what: str = "a prompt") -> Placed:
    """A prompt of exactly `context_length` tokens with each needle at its depth (module docstring).

    Args:
        tokenizer: the model's tokenizer (a transformers tokenizer; fast ones are quicker).
        context_length: prompt length in tokens.
        head, tail: the text before the haystack and after it.
        needles: k sentences in prompt order; depths: k depths in percent (0-100), non-decreasing.
        hay: haystack text, at least about `context_length` tokens long plus `START_MARGIN`
            characters; a shorter one is repeated.
        max_starts: haystack starts to try; what: names the prompt in errors, e.g. "NIAH".

    Returns:
        `Placed` (text, needle token positions and character offsets, H).

    Raises:
        UsageError: `context_length` is shorter than the prompt with an empty haystack.
        RuntimeError: no cut of any of `max_starts` haystack starts is exact.
    """
    if len(depths) != len(needles) or list(depths) != sorted(depths) or not all(0 <= d <= 100
                                                                             for d in depths):
        raise ValueError(f"expected one non-decreasing depth in [0, 100] per needle, got {depths}")
    layout = _Layout(tokenizer, head, tuple(needles), tail)
    zeros = [0] * len(needles)
    fixed = layout.length(hay, zeros, 0)
    starts = [layout.needle_index(hay, zeros[: i + 1]) for i in range(len(needles))]
    budget = context_length - fixed
    if budget < 0:
        raise UsageError(f"{what}: context_length {context_length} is shorter than the template "
                         f"({fixed} tokens)")
    targets = [start + round(depth / 100 * budget) for start, depth in zip(starts, depths, strict=True)]
    for skip in _haystack_starts(hay, max_starts):  # the first exact one; same text, same one
        placed = _fit(layout, hay[skip:], targets, starts, budget, context_length)
        if placed is not None:
            text, positions, chars = placed
            return Placed(text, tuple(positions), tuple(chars), budget)
    at = f"token {targets[0]}" if len(targets) == 1 else f"tokens {targets}"
    raise RuntimeError(
        f"could not size {what} to exactly {context_length} tokens with the needle{'s' * (len(targets) > 1)} "
        f"at {at} with {type(tokenizer).__name__}: tried {max_starts} haystack starts; this tokenizer's "
        "counts jump by more than one token per character at a needle or at the end of the haystack")


class _Layout:
    """Builds the prompt for given haystack cuts and measures it with the tokenizer."""

    def __init__(self, tokenizer, head: str, needles: tuple[str, ...], tail: str):
        self.tokenizer, self.head, self.needles, self.tail = tokenizer, head, needles, tail
        self._cache: dict[str, int] = {}

    def text(self, hay: str, cuts: list[int], end: int | None = None) -> tuple[str, list[int]]:
        """(text, each needle's character offset) with hay[cuts[i - 1]:cuts[i]] before needle i
        (from 0 for the first); with `end`, hay[cuts[-1]:end] and the tail follow the last needle,
        without it the text ends with needle len(cuts) - 1."""
        text, chars, prev = self.head, [], 0
        for i, cut in enumerate(cuts):
            piece = hay[prev:cut]
            text += (" " if i else "") + (piece + " " if piece else "")
            chars.append(len(text))
            text += self.needles[i]
            prev = cut
        if end is None:
            return text, chars
        after = hay[prev:end]
        return text + (" " + after if after else "") + self.tail, chars

    def needle_index(self, hay: str, cuts: list[int], split: int = 0) -> int:
        """Token index of the first token of needle len(cuts) - 1 (text after it cannot move it).

        With `split` (a haystack index of a space, after the previous cut and at most the last one),
        the tokens of the text before it are counted once and cached: exact for tokenizers that never
        merge across a space, which `_fit` checks on the final prompt.
        """
        text, chars = self.text(hay, cuts)
        prev = cuts[-2] if len(cuts) > 1 else 0
        if split <= prev or split > cuts[-1]:
            return needle_token_index(self.tokenizer, text, chars[-1])
        at = chars[-1] - (cuts[-1] - split) - 1  # hay[split] in text (a space follows the piece)
        return self._count(text[:at]) + needle_token_index(self.tokenizer, text[at:], chars[-1] - at)

    def length(self, hay: str, cuts: list[int], extra: int, anchor: int | None = None) -> int:
        """Prompt length in tokens with `extra` haystack characters after the last needle.

        With `anchor` (characters relative to the start of that last stretch; may be negative), the
        text before the last space ahead of that point is counted once and cached, as in needle_index.
        """
        prompt, _ = self.text(hay, cuts, cuts[-1] + extra)
        after_start = len(prompt) - len(self.tail) - extra
        at = prompt.rfind(" ", 0, after_start + anchor) if anchor is not None and anchor <= extra else -1
        if at <= 0:
            return count_tokens(self.tokenizer, prompt)
        return self._count(prompt[:at]) + count_tokens(self.tokenizer, prompt[at:])

    def _count(self, text: str) -> int:
        if text not in self._cache:
            self._cache.clear()
            self._cache[text] = count_tokens(self.tokenizer, text)
        return self._cache[text]


def _fit(layout: _Layout, hay: str, targets: list[int], starts: list[int], budget: int,
         context_length: int) -> tuple[str, list[int], list[int]] | None:
    """(text, needle token positions, needle character offsets) of exactly context_length tokens with
    each needle at its target, cutting this haystack text; None if no cut is exact."""
    offsets = _char_offsets(layout.tokenizer, hay)
    while len(offsets) <= budget + 1:  # a short folder haystack: repeat it
        hay = hay + "\n\n" + hay
        offsets = _char_offsets(layout.tokenizer, hay)
    for fast in (True, False):  # the cached-prefix counts first; full counts if they were not exact
        cuts = _cuts(layout, hay, offsets, targets, starts, context_length, fast)
        if cuts is None:
            continue
        text, chars = layout.text(hay, cuts[:-1], cuts[-1])
        positions = [needle_token_index(layout.tokenizer, text, char) for char in chars]
        if (count_tokens(layout.tokenizer, text), positions) == (context_length, targets):
            return text, positions, chars
    return None


def _cuts(layout: _Layout, hay: str, offsets: list[int], targets: list[int], starts: list[int],
          context_length: int, fast: bool) -> list[int] | None:
    """Haystack indices: one cut before each needle, then the haystack's end; None if a search fails."""
    cuts: list[int] = []
    for target, start in zip(targets, starts, strict=True):
        prev = cuts[-1] if cuts else 0
        guess = max(prev, offsets[target - start] if target > start else 0)
        split = _space_before(hay, guess - 2048, prev) if fast else 0
        cut = _search(lambda c, split=split: layout.needle_index(hay, [*cuts, c], split), target, guess,
                      prev, len(hay))
        if cut is None:
            return None
        cuts.append(cut)
    missing = context_length - layout.length(hay, cuts, 0)
    first = next((i for i, o in enumerate(offsets) if o >= cuts[-1]), len(offsets) - 1)
    guess = offsets[min(first + missing, len(offsets) - 1)] - cuts[-1]
    anchor = guess - 2048 if fast else None
    extra = _search(lambda e: layout.length(hay, cuts, e, anchor), context_length, guess, 0,
                    len(hay) - cuts[-1])
    return None if extra is None else [*cuts, cuts[-1] + extra]


def _search(f, target: int, guess: int, lo_bound: int, hi_bound: int) -> int | None:
    """An x in [lo_bound, hi_bound] with f(x) == target, for f non-decreasing up to small wobbles.

    Starts from a bracket of +-64 around `guess` and widens it until it holds the target, so a
    good guess costs ~10 calls of f.
    """
    step = 64
    lo, hi = max(lo_bound, guess - step), min(hi_bound, guess + step)
    while lo > lo_bound and f(lo) > target:
        step *= 4
        lo = max(lo_bound, lo - step)
    while hi < hi_bound and f(hi) < target:
        step *= 4
        hi = min(hi_bound, hi + step)
    if f(lo) > target:
        return None
    while lo < hi:  # smallest x with f(x) >= target
        mid = (lo + hi) // 2
        if f(mid) >= target:
            hi = mid
        else:
            lo = mid + 1
    for x in sorted(range(max(lo - 12, lo_bound), min(lo + 13, hi_bound + 1)), key=lambda x: abs(x - lo)):
        if f(x) == target:
            return x
    return None


def _space_before(text: str, index: int, lo: int = 0) -> int:
    """The largest i in (lo, index] with text[i] a space (0 when there is none): a cut that a
    whitespace-splitting tokenizer treats as a token boundary."""
    i = text.rfind(" ", lo + 1, max(index, lo + 1) + 1)
    return max(i, 0)


def _char_offsets(tokenizer, text: str) -> list[int]:
    """Start character of each token of text (approximate cuts for the exact search to refine)."""
    if getattr(tokenizer, "is_fast", False):
        return [
            start
            for start, _ in tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)[
                "offset_mapping"
            ]
        ]
    per_token = len(text) / max(count_tokens(tokenizer, text), 1)
    return [int(i * per_token) for i in range(int(len(text) / per_token))]


def _haystack_starts(hay: str, count: int):
    """Up to `count` character offsets to start the haystack at: 0, then sentence starts, then word
    starts, all within the first START_MARGIN characters.

    Sentence starts keep the haystack readable; word starts come last because they also shift a
    haystack that repeats one sentence (a short folder), where every sentence start looks alike.
    """
    yield 0  # nearly always exact: the rest is computed only when it is not
    window = hay[:START_MARGIN]
    sentences = [m.end() for m in re.finditer(r"[.!?]\s+(?=\S)|\n\s*(?=\S)", window)]
    words = [m.end() for m in re.finditer(r"\s+(?=\S)", window)]
    starts = dict.fromkeys([*sentences[: count // 2], *words])  # ordered, no repeats
    yield from [s for s in starts if s > 0][: count - 1]
