"""configs/paper.yaml makes the protocol choices of docs/tasks.md explicit, and still validates."""

from __future__ import annotations

from pathlib import Path

from nsa_eval.suite import check_suite, load_suite
from nsa_eval.tasks import PROJECT_TASKS

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_paper_suite_states_each_choice():
    suite = load_suite(CONFIGS / "paper.yaml")
    models = {m.label: m for m in suite.models}
    # Quest as its own code runs it: the first two layers dense, passed on to the adapter
    assert models["Quest"].dense_layers == 2 and models["Quest"].model_args()["dense_layers"] == 2
    assert {m.dense_layers for label, m in models.items() if label != "Quest"} == {0}
    tasks = {t.label: t for t in suite.tasks}
    # AIME through the chat template, for each model it runs, named
    for label in ("aime24_8k", "aime24_16k"):
        assert tasks[label].apply_chat_template is True and tasks[label].models == ("NSA", "Full")
    # LongBench at its own length, whatever max_length the NIAH grid needs
    assert tasks["longbench"].metadata == {"longbench_max_length": 31500}
    assert {m.max_length for m in suite.models} == {65568}
    longbench = [c for c in suite.cells() if c.task.label == "longbench"]
    assert longbench and all(c.metadata()["longbench_max_length"] == 31500 for c in longbench)
    # every task reads its data from the local folder (or builds it): nothing hub-only
    assert all(t.task in PROJECT_TASKS for t in suite.tasks)
    check_suite(suite, check_data=False, runs_here=False)


def test_budget_sweep_runs_quest_as_its_code_does():
    suite = load_suite(CONFIGS / "budget_sweep.yaml")
    quest = [m for m in suite.models if m.attention == "quest"]
    assert {m.budget for m in quest} == {640, 1280, 2560, 5120} and {m.dense_layers for m in quest} == {2}
    assert {m.dense_layers for m in suite.models if m.attention != "quest"} == {0}
    assert suite.tasks[1].metadata == {"longbench_max_length": 7500}
