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
        ("The answer is 204. I hope this helps with 3 more things.", 204),  # trailing text
        ("Answer: 17 (since 2 + 15 = 17, checked 5 times)", 17),
        ("We get 7, then 12, so finally 25", 25),  # plain: the last integer
        ("25.0", 25),
        ("no number here", None),
        ("\\boxed{3.5}", None),  # not an integer
        ("cut off \\boxed{12", None),  # a cut-off box is not trusted: 12 may be the start of 123
        ("The answer is 204, so \\boxed{20", 204),  # ... the rules apply to the text before it
        ("\\boxed{200 \\text{ m}^2}", 200),  # units and wrappers around the one integer
        ("$\\boxed{45^\\circ}$", 45),
        ("\\boxed{50\\%}", 50),
        ("\\boxed{1,000}", 1000),
        # a box that holds more than one integer names no answer, not its last number
        ("\\boxed{\\frac{1}{2}}", None),
        ("\\boxed{2^{10}}", None),
        ("\\boxed{3\\sqrt{2}}", None),
        ("\\boxed{12, 34}", None),
        ("\\boxed{12,34}", None),
        ("\\boxed{2 \\times 10^{2}}", None),
    ],
)
def test_extract_answer(response, expected):
    assert aime.extract_answer(response) == expected


def test_process_results_avg_pass_maj():
    doc = {"Answer": "204"}
    samples = ["\\boxed{204}", "\\boxed{13}", "The answer is 204.", "\\boxed{13}", "\\boxed{13}", "nothing"]
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


def test_prompt_asks_for_a_boxed_answer():
    text = aime.doc_to_text({"Problem": "  Find x.  "})
    assert text.startswith("Find x.\n") and "\\boxed{}" in text
