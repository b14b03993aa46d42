"""DROP 1-shot as lm-eval's `drop`, with its shot's answer and its stop fixed.

lm-eval 0.4.13's `drop` (the base of `nsa_drop`, general/nsa_drop.yaml) has two faults that the
group's member entry overrides, keeping its prompt, its data processing and its F1 / EM:

- its `doc_to_target` is `{{ answer|join(',') }}` on the row's `answer` dict, so the 1-shot example
  shows the literal text "number,date,spans" where its answer belongs, and its empty
  `target_delimiter` glues that text to the question. `doc_to_target` here is the example's first
  answer as DROP's official evaluation reads it (`answer_json_to_strings`; lm-eval's `parse_answer`
  is the same rule): the number, else the spans joined by ", ", else the date "day month year";
  the delimiter is " ".
- it stops generating at ".", which cuts "3.5" to "3". Here generation stops at a newline or at a
  sentence end (". "), which no decimal point makes, and `process_results` drops one final "." before
  lm-eval's scorer (whose normaliser would read "3.5." as the word "35").
"""

from __future__ import annotations


def doc_to_target(doc: dict) -> str:
    """The doc's first answer (`answers[0]`, lm-eval's parse_answer of its `answer`) as text."""
    return ", ".join(doc["answers"][0])


def final_answer(prediction: str) -> str:
    """The prediction without surrounding whitespace and one sentence-final period."""
    text = prediction.strip()
    return text[:-1].rstrip() if text.endswith(".") else text


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """lm-eval's DROP em and F1 of the prediction after `final_answer`."""
    from lm_eval.tasks.drop import utils

    return utils.process_results(doc, [final_answer(r) for r in results])
