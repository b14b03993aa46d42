"""AIME: final-integer extraction and the avg@k / pass@k / maj@k metrics."""

from __future__ import annotations

import pytest

from nsa_eval.tasks import aime


@pytest.mark.parametrize(
    "response, expected",
    [
        ("so the result is $\\boxed{33}$.", 33),
        ("\\boxed{033}", 33),  # AIME answers are 000-999
        ("first \\boxed{12} then, correcting, \\boxed{\\text{204}} is final", 204),  # last box wins
        ("\\boxed{x = 1{,}000}", 1000),
        ("\\boxed 42", 42),
        ("25.0 so \\boxed{25.0}", 25),
        ("\\boxed{3.5}", None),  # not an integer
        ("\\boxed{200 \\text{ m}^2}", 200),  # units and wrappers around the one integer
        ("$\\boxed{45^\\circ}$", 45),
        ("\\boxed{50\\%}", 50),
        ("\\boxed{1,000}", 1000),
        # bold, an equation's right-hand side, a currency sign, a multiple-choice label
        ("\\boxed{\\mathbf{33}}", 33),
        ("\\boxed{\\boldsymbol{33}}", 33),
        ("\\boxed{\\textbf{33}}", 33),
        ("\\boxed{\\mathbf{\\text{033}}}", 33),  # nested wrappers
        ("\\boxed{m+n=33}", 33),
        ("\\boxed{AB^2 = 225}", 225),
        ("\\boxed{2^{10} = 1024}", 1024),
        ("\\boxed{\\$33}", 33),
        ("\\boxed{\\$\\,1{,}000}", 1000),
        ("$\\boxed{\\$33}$", 33),
        ("\\boxed{(B)\\ 33}", 33),
        ("\\boxed{\\textbf{(C) } 204}", 204),
        ("\\boxed{B. 33}", 33),
        ("\\boxed{\\text{Answer: } 33}", 33),
        # a box that holds more than one integer names no answer, not its last number
        ("\\boxed{\\frac{1}{2}}", None),
        ("\\boxed{2^{10}}", None),
        ("\\boxed{3\\sqrt{2}}", None),
        ("\\boxed{12, 34}", None),
        ("\\boxed{12,34}", None),
        ("\\boxed{2 \\times 10^{2}}", None),
        ("\\boxed{x=1, y=33}", None),  # two assignments are not one answer
        ("\\boxed{33 = m+n}", None),  # the right-hand side is not a number
        ("\\boxed{B}", None),  # a label alone
    ],
)
def test_extract_answer_from_a_box(response, expected):
    assert aime.extract_answer(response) == expected


@pytest.mark.parametrize(
    "response",
    [
        "The answer is 204. I hope this helps with 3 more things.",
        "Answer: 17 (since 2 + 15 = 17, checked 5 times)",
        "We get 7, then 12, so finally 25",
        "**Final answer:** 33",
        "no number here",
        "cut off \\boxed{12",  # a cut-off box is not trusted: 12 may be the start of 123
        "The answer is 204, so \\boxed{20",  # ... and the text before it is unfinished work
    ],
)
def test_a_response_without_a_complete_box_has_no_answer(response):
    """Unfinished work (a trace cut at the generation limit) must not score by a number in it."""
    assert aime.extract_answer(response) is None


def test_a_reasoning_trace_is_read_after_its_last_think_tag():
    assert aime.extract_answer("<think>maybe \\boxed{12}</think>The answer is \\boxed{33}.") == 33
    assert aime.extract_answer("so \\boxed{12}?</think>\nFinal: \\boxed{\\mathbf{33}}") == 33
    assert aime.extract_answer("<think>I first try \\boxed{12}</think>no box after thinking") is None
    # opened and never closed: cut off mid-thought, whatever box it wrote on the way
    assert aime.extract_answer("<think>try \\boxed{33}, but wait, let me check") is None


def test_process_results_avg_pass_maj():
    doc = {"Answer": "204"}
    samples = ["\\boxed{204}", "\\boxed{13}", "so \\boxed{m+n=204}", "\\boxed{13}", "\\boxed{13}", "204"]
    out = aime.process_results(doc, [samples])
    assert out["avg_at_k"] == pytest.approx(2 / 6)
    assert out["pass_at_k"] == 1.0
    assert out["maj_at_k"] == 0.0  # 13 is the most common answer
    assert aime.process_results(doc, [["\\boxed{1}"] * 4]) == {
        "avg_at_k": 0.0,
        "pass_at_k": 0.0,
        "maj_at_k": 0.0,
    }
    assert aime.process_results(doc, ["\\boxed{204}"])["avg_at_k"] == 1.0  # one unfiltered response
    # a fraction whose last number is the target scores nothing
    assert aime.process_results({"Answer": "2"}, [["\\boxed{\\frac{1}{2}}"] * 4]) == {
        "avg_at_k": 0.0,
        "pass_at_k": 0.0,
        "maj_at_k": 0.0,
    }
    # unboxed answers are not votes either: the boxed minority wins maj@k
    votes = aime.process_results(doc, [["The answer is 13."] * 3 + ["\\boxed{204}"]])
    assert votes == {"avg_at_k": 0.25, "pass_at_k": 1.0, "maj_at_k": 1.0}


def test_prompt_asks_for_a_boxed_answer():
    text = aime.doc_to_text({"Problem": "  Find x.  "})
    assert text.startswith("Find x.\n") and "\\boxed{}" in text
