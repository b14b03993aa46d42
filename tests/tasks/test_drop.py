"""nsa_drop: the 1-shot example shows its real answer, and generation stops after it, not inside "3.5"."""

from __future__ import annotations

import pytest

from nsa_eval.tasks import drop

HUB_PATH = "EleutherAI/drop"


def _row(query_id: str, passage: str, question: str, number="", spans=(), date=("", "", "")) -> dict:
    """A row in EleutherAI/drop's schema (made up here)."""
    return {
        "section_id": "fixture",
        "query_id": query_id,
        "passage": passage,
        "question": question,
        "answer": {
            "number": number,
            "date": {"day": date[0], "month": date[1], "year": date[2]},
            "spans": list(spans),
        },
        "validated_answers": {"number": [], "date": [], "spans": []},
    }


TRAIN = [
    _row("t-number", "The kicker ran 3.5 yards.", "How many yards did he run?", number="3.5"),
    _row("t-spans", "Ann and Bob scored.", "Who scored?", spans=["Ann", "Bob"]),
    _row("t-date", "The bridge opened on 5 May 1990.", "When did it open?", date=("5", "May", "1990")),
]
VALIDATION = [
    _row("v-decimal", "The punt went 12.5 yards.", "How long was the punt?", number="12.5"),
    _row("v-span", "Carla won the race.", "Who won?", spans=["Carla"]),
]
# what the model writes after each question: an answer, then more text on the line or the next
CONTINUATIONS = {
    "How long was the punt?": " 12.5. The crowd cheered.\n\nThe next",
    "Who won?": " Carla.\n\nCarla also",
}


@pytest.fixture
def drop_task(manager, data_root, rows):
    rows.write(data_root, HUB_PATH, None, "train", TRAIN)
    rows.write(data_root, HUB_PATH, None, "validation", VALIDATION)
    (task,) = manager.load(["nsa_drop"])["tasks"].values()
    return task


def test_the_example_shows_its_answer_in_drops_official_form(drop_task):
    targets = {doc["id"]: drop_task.doc_to_target(doc) for doc in drop_task.training_docs()}
    assert targets == {"t-number": "3.5", "t-spans": "Ann, Bob", "t-date": "5 May 1990"}


def test_the_one_shot_prompt(drop_task):
    examples = drop_task.training_docs()
    shots = {f"{d['passage']} {d['question']} {drop_task.doc_to_target(d)}" for d in examples}
    for doc in drop_task.validation_docs():
        context = drop_task.fewshot_context(doc=doc, num_fewshot=1)
        shot, asked = context.split("\n\n")
        assert shot in shots  # e.g. "The kicker ran 3.5 yards. How many yards did he run? 3.5"
        assert asked == f"{doc['passage']} {doc['question']}"
        assert "number,date,spans" not in context


class _Writer:
    """A stand-in LM that writes CONTINUATIONS and stops as lm-eval's HF model does (cut at each
    `until` string)."""

    def __new__(cls):
        from lm_eval.api.model import LM

        class Writer(LM):
            def generate_until(self, requests):
                out = []
                for request in requests:
                    context, settings = request.args
                    text = next(t for q, t in CONTINUATIONS.items() if context.endswith(q))
                    for stop in settings["until"]:
                        text = text.split(stop)[0]
                    out.append(text)
                return out

            def loglikelihood(self, requests):
                raise NotImplementedError

            def loglikelihood_rolling(self, requests):
                raise NotImplementedError

        return Writer()


def test_a_decimal_answer_survives_the_stop_and_scores(drop_task, manager):
    import lm_eval

    assert "." not in drop_task.config.generation_kwargs["until"]
    out = lm_eval.simple_evaluate(
        model=_Writer(), tasks=["nsa_drop"], task_manager=manager, log_samples=True, bootstrap_iters=0
    )
    responses = {s["doc"]["id"]: s["filtered_resps"][0] for s in out["samples"]["drop"]}
    assert responses == {"v-decimal": " 12.5", "v-span": " Carla."}
    assert out["results"]["nsa_drop"]["f1,none"] == 1.0 and out["results"]["nsa_drop"]["em,none"] == 1.0


def test_scoring_is_lm_evals_after_one_final_period():
    from lm_eval.tasks.drop import utils

    doc = {"answers": [["3.5"]]}
    assert drop.process_results(doc, ["3.5."]) == utils.process_results(doc, ["3.5"])
    assert drop.process_results(doc, [" 3.5."]) == {"em": 1.0, "f1": 1.0}
    assert utils.process_results(doc, ["3.5."])["f1"] == 0.0  # lm-eval's normaliser reads "35"
    two = {"answers": [["Ann", "Bob"]]}
    for prediction in ("Ann and Bob", "Carla", "Ann, Bob"):
        assert drop.process_results(two, [prediction]) == utils.process_results(two, [prediction])
