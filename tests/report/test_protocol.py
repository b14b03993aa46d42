"""The report's Protocol section states each protocol choice of a run: LongBench's own prompt length,
the chat template per task and model, Quest's dense layers, and the scoring rules of the tasks that
ran (AIME's boxed answers, DROP's example and stop, lcc's fuzzy-matching backend), from the saved
cells of a real run of the project's tasks on fixture rows."""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.suite_fixtures import make_tiny_llama
from tests.tasks.test_drop import TRAIN as DROP_TRAIN
from tests.tasks.test_drop import VALIDATION as DROP_VALIDATION


def _stand_in(model_spec):
    """An LM that answers every prompt with a fixed line and renders chats as plain text."""
    from lm_eval.api.model import LM

    class Fixed(LM):
        tokenizer_name = "fixed"

        def generate_until(self, requests):
            return ["\\boxed{100}" if "\\boxed" in r.args[0] else "x = 1" for r in requests]

        def apply_chat_template(self, chat_history, add_generation_prompt=True):
            return "".join(f"<{m['role']}>{m['content']}" for m in chat_history) + "<assistant>"

        def loglikelihood(self, requests):
            raise NotImplementedError

        def loglikelihood_rolling(self, requests):
            raise NotImplementedError

    return Fixed()


@pytest.fixture(scope="module")
def protocol(tmp_path_factory):
    from nsa_eval.report import write_report
    from nsa_eval.runner import run_suite
    from nsa_eval.suite import load_suite
    from nsa_eval.tasks.local_data import write_jsonl

    root = tmp_path_factory.mktemp("protocol")
    data = root / "data"
    mp = pytest.MonkeyPatch()
    mp.setenv("NSA_EVAL_DATA", str(data))
    code = "def add(a, b):\n    return a + b\n" * 40
    write_jsonl(data / "Xnhyacinth__LongBench" / "lcc" / "test.jsonl",
                [{"input": "", "context": code, "answers": ["x = 1"], "length": 400, "dataset": "lcc",
                  "language": "python", "all_classes": None, "_id": "lcc-0"}])
    write_jsonl(data / "Maxwell-Jia__AIME_2024" / "default" / "train.jsonl",
                [{"ID": "2024-I-1", "Problem": "Compute 1 + 99.", "Solution": "Add.", "Answer": 100}])
    write_jsonl(data / "EleutherAI__drop" / "default" / "train.jsonl", DROP_TRAIN)
    write_jsonl(data / "EleutherAI__drop" / "default" / "validation.jsonl", DROP_VALIDATION)
    model = make_tiny_llama(root / "model")
    suite = root / "suite.yaml"
    suite.write_text(textwrap.dedent(f"""\
        name: protocol_test
        defaults: {{pretrained: {model}, dtype: float32, sink: 16, local: 32, budget: 64}}
        models:
          - {{attention: full}}
          - {{attention: quest, dense_layers: 2, params: {{page_size: 16}}}}
        tasks:
          - {{task: nsa_longbench_lcc, label: lcc, metadata: {{longbench_max_length: 300}}}}
          - {{task: nsa_aime24_8k, label: aime, apply_chat_template: true, models: [full]}}
          - {{task: nsa_drop, label: drop, metric: f1, models: [full]}}
        """))
    try:
        run_suite(load_suite(suite), root / "run", progress=False, lm_factory=_stand_in)
        out = write_report(root / "run", root / "report", bootstrap=10)
    finally:
        mp.undo()
    md = (out / "report.md").read_text()
    return md.split("## Protocol", 1)[1].split("## Environment", 1)[0], root / "run"


def _row(section: str, first: str) -> list[str]:
    line = next(line for line in section.splitlines() if line.startswith(f"| {first} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_the_models_table_shows_quests_dense_layers(protocol):
    section, _ = protocol
    header = _row(section, "method")
    assert _row(section, "quest@64")[header.index("dense layers")] == "first 2"
    assert _row(section, "full")[header.index("dense layers")] == "-"
    assert "quest@64: Quest keeps its first 2 layers dense, as Quest's own code keeps two." in section


def test_the_tasks_table_shows_the_prompt_cut_and_the_chat_template_per_model(protocol):
    section, run_dir = protocol
    header = _row(section, "task")
    cut = "middle, to 300 tokens (`longbench_max_length`)"
    assert _row(section, "lcc")[header.index("prompt cut")] == cut
    assert _row(section, "drop")[header.index("prompt cut")] == "by the model"
    assert _row(section, "aime")[header.index("chat template")] == "yes: full"
    assert _row(section, "lcc")[header.index("chat template")] == "no"
    # what the table says is what ran: the AIME prompt went through the (stand-in's) chat template
    samples = [json.loads(line) for folder in (run_dir / "cells").iterdir()
               for line in (folder / "samples.jsonl").read_text().splitlines()]
    aime = next(s for s in samples if s["task"] == "nsa_aime24_8k")
    assert aime["arguments"][0][0].startswith("<user>Compute 1 + 99.")


def test_the_scoring_choices_of_the_tasks_that_ran_are_stated(protocol):
    from nsa_eval.tasks import PROTOCOL_NOTES

    section, _ = protocol
    for task in ("nsa_longbench_lcc", "nsa_aime24_8k", "nsa_drop"):
        assert f"- {PROTOCOL_NOTES[task]}" in section
    assert "python-Levenshtein" in section and "scores 0" in section and "sentence end" in section
    assert PROTOCOL_NOTES["nsa_mbpp"] not in section  # only the tasks that ran
