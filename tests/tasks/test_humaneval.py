"""nsa_humaneval: builds offline from fixture rows, lm-eval's humaneval prompt, nsa_mbpp's executor."""

from __future__ import annotations

from pathlib import Path

import pytest

from nsa_eval.errors import UsageError
from nsa_eval.tasks import humaneval, mbpp, requires_unsafe_code
from nsa_eval.tasks.data import data_specs

HUB_PATH = "openai/openai_humaneval"
ADD_PROMPT = 'def add(a, b):\n    """Return a + b."""\n'
ADD_TEST = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(0, 0) == 0\n"
# what a model writes after each prompt: a right body for add, a wrong one for sub
BODIES = {"add": "    return a + b\n", "sub": "    return a + b\n"}


def _row(name: str, prompt: str, test: str) -> dict:
    """A row in openai/openai_humaneval's schema (made up here)."""
    return {"task_id": f"Fixture/{name}", "prompt": prompt, "canonical_solution": "", "test": test,
            "entry_point": name}


ROWS = [
    _row("add", ADD_PROMPT, ADD_TEST),
    _row("sub", 'def sub(a, b):\n    """Return a - b."""\n',
         "def check(candidate):\n    assert candidate(3, 1) == 2\n"),
]


@pytest.fixture
def opted_in(monkeypatch):
    monkeypatch.setenv("HF_ALLOW_CODE_EVAL", "1")


@pytest.fixture
def humaneval_rows(data_root, rows):
    rows.write(data_root, HUB_PATH, None, "test", ROWS)
    return ROWS


def test_data_is_fetched_and_read_locally(manager):
    (spec,) = data_specs(["nsa_humaneval"], manager)["nsa_humaneval"]
    assert (spec.path, spec.name, spec.splits) == (HUB_PATH, None, ("test",))
    assert requires_unsafe_code(["nsa_humaneval"], manager) == ["nsa_humaneval"]


def test_task_builds_offline_with_lm_eval_humaneval_prompt(manager, humaneval_rows, opted_in):
    """lm-eval's own humaneval, built from its YAML with only the hub-bound functions swapped for
    ours (its utils.py loads code_eval from the hub on import), asks and stops the same way."""
    import lm_eval.tasks
    from lm_eval.tasks._yaml_loader import load_yaml

    from nsa_eval.tasks.local_task import LocalFirstTask

    loaded = manager.load(["nsa_humaneval"])
    assert list(loaded["groups"]) == ["nsa_humaneval"]
    (task,) = loaded["tasks"].values()
    assert isinstance(task, humaneval.HumanEvalTask) and task.UNSAFE_CODE
    cfg = load_yaml(Path(lm_eval.tasks.__file__).parent / "humaneval" / "humaneval.yaml", resolve_func=False)
    cfg["metric_list"][0]["metric"] = mbpp.pass_at_1
    cfg["filter_list"][0]["filter"][0]["filter_fn"] = humaneval.build_predictions
    reference = LocalFirstTask(config=cfg)
    for doc in humaneval_rows:
        prompt = task.fewshot_context(doc=doc, num_fewshot=0)
        assert prompt == reference.fewshot_context(doc=doc, num_fewshot=0) == doc["prompt"]
        target = task.doc_to_target(doc)
        assert target == reference.doc_to_target(doc) == doc["test"] + f"\ncheck({doc['entry_point']})"
    assert task.config.generation_kwargs == reference.config.generation_kwargs
    assert task.config.num_fewshot == 0 and task.config.repeats == 1


def test_building_needs_the_code_execution_opt_in(manager, humaneval_rows, monkeypatch):
    monkeypatch.delenv("HF_ALLOW_CODE_EVAL", raising=False)
    with pytest.raises(UsageError, match="HF_ALLOW_CODE_EVAL=1"):
        manager.load(["nsa_humaneval"])


def test_simple_evaluate_runs_the_programs_offline(manager, humaneval_rows, opted_in):
    """The prompt plus the generated body runs against the doc's tests through nsa_mbpp's executor."""
    import lm_eval
    from lm_eval.api.model import LM

    class Writer(LM):
        def generate_until(self, requests):
            return [BODIES[next(n for n in BODIES if f"def {n}(" in r.args[0])] for r in requests]

        def loglikelihood(self, requests):
            raise NotImplementedError

        def loglikelihood_rolling(self, requests):
            raise NotImplementedError

    out = lm_eval.simple_evaluate(model=Writer(), tasks=["nsa_humaneval"], task_manager=manager,
                                  bootstrap_iters=0, confirm_run_unsafe_code=True, log_samples=True)
    passed = {s["doc"]["entry_point"]: s["pass_at_1"] for s in out["samples"]["nsa_humaneval_0shot"]}
    assert passed == {"add": 1.0, "sub": 0.0}
    assert out["results"]["nsa_humaneval"]["pass_at_1,create_test"] == 0.5
