"""Several needles at exact token positions in a prompt of an exact length (needles.place_needles)."""

from __future__ import annotations

import random

import pytest

from nsa_eval.errors import UsageError
from nsa_eval.tasks import needles
from nsa_eval.tasks.haystack import builtin_haystack
from nsa_eval.tasks.needles import count_tokens, needle_token_index, place_needles

HEAD, TAIL = "Remember the numbers below.\n", "\nWhich number belongs to the otter? The number is"
NEEDLES = ["The otter keeps 1234567.", "The heron keeps 7654321.", "The lemur keeps 5550123."]


def _hay(seed: int = 0) -> str:
    return builtin_haystack(30_000, random.Random(seed))


def _empty_starts(tokenizer, sentences: list[str]) -> list[int]:
    """Each needle's first token with an empty haystack, from the layout written out by hand."""
    text = HEAD + " ".join(sentences) + TAIL
    at = [text.index(s) for s in sentences]
    return [needle_token_index(tokenizer, text, char) for char in at]


@pytest.mark.parametrize("tokenizer_name", ["bpe_tokenizer", "unigram_tokenizer"])
@pytest.mark.parametrize("depths", [[0.0, 50.0, 100.0], [10.0, 10.0, 90.0], [33.33, 66.67, 66.67]])
def test_each_needle_sits_at_its_depth_in_a_prompt_of_exact_length(tokenizer_name, depths, request):
    tokenizer = request.getfixturevalue(tokenizer_name)
    for length in (400, 1500):
        placed = place_needles(tokenizer, length, HEAD, NEEDLES, depths, TAIL, _hay())
        assert count_tokens(tokenizer, placed.text) == length
        assert placed.text.startswith(HEAD) and placed.text.endswith(TAIL)
        found = [needle_token_index(tokenizer, placed.text, placed.text.index(s)) for s in NEEDLES]
        starts = _empty_starts(tokenizer, NEEDLES)
        budget = length - count_tokens(tokenizer, HEAD + " ".join(NEEDLES) + TAIL)
        assert placed.haystack_tokens == budget
        expected = [s + round(d / 100 * budget) for s, d in zip(starts, depths, strict=True)]
        assert list(placed.positions) == found == expected, (length, depths)
        assert [placed.text.index(s) for s in NEEDLES] == list(placed.chars)


def test_equal_depths_put_needles_side_by_side_and_the_extremes_at_the_ends(bpe_tokenizer):
    placed = place_needles(bpe_tokenizer, 600, HEAD, NEEDLES, [0, 0, 100], TAIL, _hay())
    assert placed.text.startswith(HEAD + NEEDLES[0] + " " + NEEDLES[1] + " ")
    assert placed.text.endswith(" " + NEEDLES[2] + TAIL)


def test_same_text_same_prompt(bpe_tokenizer):
    a = place_needles(bpe_tokenizer, 700, HEAD, NEEDLES, [5, 40, 80], TAIL, _hay(1))
    assert a == place_needles(bpe_tokenizer, 700, HEAD, NEEDLES, [5, 40, 80], TAIL, _hay(1))
    assert a.text != place_needles(bpe_tokenizer, 700, HEAD, NEEDLES, [5, 40, 80], TAIL, _hay(2)).text


def test_a_short_haystack_is_repeated(bpe_tokenizer):
    hay = "A river runs by the mill. "
    placed = place_needles(bpe_tokenizer, 500, HEAD, NEEDLES, [20, 50, 70], TAIL, hay)
    assert count_tokens(bpe_tokenizer, placed.text) == 500
    assert placed.text.count("A river runs by the mill.") > 10


def test_bad_layouts_are_refused(bpe_tokenizer):
    with pytest.raises(ValueError, match="non-decreasing depth"):
        place_needles(bpe_tokenizer, 500, HEAD, NEEDLES, [50, 20, 70], TAIL, _hay())
    with pytest.raises(ValueError, match="one non-decreasing depth"):
        place_needles(bpe_tokenizer, 500, HEAD, NEEDLES, [50, 70], TAIL, _hay())
    with pytest.raises(UsageError, match="context_length 20 is shorter than the template"):
        place_needles(bpe_tokenizer, 20, HEAD, NEEDLES, [0, 50, 100], TAIL, _hay(), what="a test prompt")


def test_haystack_starts_sentences_then_words():
    import random

    hay = builtin_haystack(20_000, random.Random(0))
    starts = list(needles._haystack_starts(hay, 64))
    assert starts[0] == 0 and len(starts) == len(set(starts)) == 64
    assert all(0 < s < needles.START_MARGIN for s in starts[1:])
    sentences = starts[1:33]
    assert sentences == sorted(sentences)
    assert all(hay[s - 2 : s] in (". ", "\n\n") and hay[s].isupper() for s in sentences)
    assert all(hay[s - 1] == " " and hay[s] != " " for s in starts[33:])  # word starts
    # one sentence repeated: sentence starts all look alike, word starts give other texts to cut
    periodic = "The quick brown fox jumps over the lazy dog again. " * 100
    windows = {periodic[s : s + 20] for s in needles._haystack_starts(periodic, 64)}
    assert len(windows) >= 10

