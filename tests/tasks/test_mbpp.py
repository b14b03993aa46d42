"""nsa_mbpp: builds offline from fixture rows, lm-eval's mbpp prompt, the local pass@1 executor, opt-in."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest

from nsa_eval.errors import UsageError
from nsa_eval.tasks import check_task_data, mbpp, requires_unsafe_code
from nsa_eval.tasks.code_execution import execute
from nsa_eval.tasks.data import data_specs

HUB_PATH, CONFIG = "google-research-datasets/mbpp", "full"
ADD_TESTS = "assert add(1, 2) == 3\nassert add(2, 2) == 4\nassert add(0, 0) == 0"


def _row(task_id: int, text: str = "", code: str = "pass", tests: list[str] | None = None) -> dict:
    """A row in MBPP's schema (made up here)."""
    return {
        "task_id": task_id,
        "text": text or f"Write function number {task_id}.",
        "code": code,
        "test_list": tests or [f"assert f{task_id}({i}) == {i}" for i in range(3)],
        "test_setup_code": "",
        "challenge_test_list": [],
    }


def _lm_eval_fewshot_samples() -> list[dict]:
    """lm-eval's hard-coded mbpp examples, read from its utils.py without importing it (the import
    loads code_eval from the hub)."""
    import lm_eval.tasks

    source = (Path(lm_eval.tasks.__file__).parent / "mbpp" / "utils.py").read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == "list_fewshot_samples":
            return ast.literal_eval(node.body[-1].value)
    raise AssertionError("lm-eval's mbpp/utils.py has no list_fewshot_samples")


@pytest.fixture
def opted_in(monkeypatch):
    monkeypatch.setenv("HF_ALLOW_CODE_EVAL", "1")


@pytest.fixture
def mbpp_rows(data_root, rows):
    """Test rows, and a prompt split holding lm-eval's 3 examples (no is_fewshot) among decoys."""
    examples = [{k: v for k, v in s.items() if k != "is_fewshot"} for s in _lm_eval_fewshot_samples()]
    examples = [{"test_setup_code": "", "challenge_test_list": [], **e} for e in examples]
    prompt = [_row(5), examples[2], _row(1), examples[0], examples[1], _row(6)]  # shuffled on purpose
    test = [_row(11, "Write a function add.", tests=ADD_TESTS.split("\n")), _row(12)]
    rows.write(data_root, HUB_PATH, CONFIG, "prompt", prompt)
    rows.write(data_root, HUB_PATH, CONFIG, "test", test)
    return test


def test_data_specs_fetch_and_check_the_prompt_split(manager, data_root, rows):
    (spec,) = data_specs(["nsa_mbpp"], manager)["nsa_mbpp"]
    assert (spec.path, spec.name, spec.splits) == (HUB_PATH, CONFIG, ("test", "prompt"))
    rows.write(data_root, HUB_PATH, CONFIG, "test", [_row(11)])
    with pytest.raises(UsageError, match="prompt.jsonl"):
        check_task_data(["nsa_mbpp"], manager)
    rows.write(data_root, HUB_PATH, CONFIG, "prompt", [_row(2)])
    check_task_data(["nsa_mbpp"], manager)


def test_task_builds_offline_with_lm_eval_mbpp_prompt(manager, mbpp_rows, opted_in):
    from lm_eval.tasks._yaml_loader import load_yaml

    from nsa_eval.tasks.local_task import LocalFirstTask

    loaded = manager.load(["nsa_mbpp"])
    assert list(loaded["groups"]) == ["nsa_mbpp"]
    (task,) = loaded["tasks"].values()
    assert isinstance(task, mbpp.MbppTask) and task.UNSAFE_CODE
    assert task.config.num_fewshot == 3 and len(task.test_docs()) == 2
    assert [d["task_id"] for d in task.sampler.fewshot_docs()] == [2, 3, 4]

    # lm-eval's own mbpp task, built by lm-eval from its YAML, with only the hub-bound functions
    # swapped for their values (its examples; our scorer), reads the same rows
    import lm_eval.tasks

    cfg = load_yaml(Path(lm_eval.tasks.__file__).parent / "mbpp" / "mbpp.yaml", resolve_func=False)
    cfg["metric_list"][0]["metric"] = mbpp.pass_at_1
    cfg["fewshot_config"]["samples"] = _lm_eval_fewshot_samples()
    reference = LocalFirstTask(config=cfg)
    for doc in mbpp_rows:
        ours = task.fewshot_context(doc=doc, num_fewshot=3)
        assert ours == reference.fewshot_context(doc=doc, num_fewshot=3)
        assert task.doc_to_target(doc) == reference.doc_to_target(doc)
    assert task.config.generation_kwargs == reference.config.generation_kwargs
    assert ours.endswith("[BEGIN]\n") and ours.count("[DONE]") == 3
    assert "Write function number 1." not in ours and "Write function number 5." not in ours


def test_pass_at_1_runs_the_program_with_the_tests(opted_in):
    right = "def add(a, b):\n    return a + b"
    wrong = "def add(a, b):\n    return a * b"
    raises = "def add(a, b):\n    raise RuntimeError('no')"
    assert mbpp.pass_at_1(references=[ADD_TESTS], predictions=[right]) == 1.0
    assert mbpp.pass_at_1(references=[ADD_TESTS], predictions=[wrong]) == 0.0
    assert mbpp.pass_at_1(references=[ADD_TESTS], predictions=[raises]) == 0.0
    assert mbpp.pass_at_1(references=[ADD_TESTS], predictions=["import sys\nsys.exit(3)"]) == 0.0
    assert mbpp.pass_at_1(references=[ADD_TESTS], predictions=["def add(a, b) return"]) == 0.0  # syntax
    assert mbpp.pass_at_1(references=ADD_TESTS, predictions=[[right, wrong]]) == 0.5  # code_eval's form


def test_pass_at_1_runs_in_a_fresh_temporary_directory(opted_in, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    program = "import os, sys\nassert os.getcwd() != {cwd!r}\nassert 'nsa_eval' not in sys.modules\n"
    assert execute(program.format(cwd=str(tmp_path))).passed
    assert list(tmp_path.iterdir()) == []  # nothing left behind where the caller runs


def test_a_hanging_program_fails_at_the_timeout(opted_in):
    started = time.monotonic()
    result = execute("while True:\n    pass", timeout=1.0)
    assert not result.passed and result.outcome == "timed out after 1.0 s"
    assert time.monotonic() - started < 8


def test_code_runs_only_with_the_opt_in(monkeypatch, manager, mbpp_rows):
    for value in (None, "0", "true"):
        if value is None:
            monkeypatch.delenv("HF_ALLOW_CODE_EVAL", raising=False)
        else:
            monkeypatch.setenv("HF_ALLOW_CODE_EVAL", value)
        with pytest.raises(UsageError, match="HF_ALLOW_CODE_EVAL=1"):
            mbpp.pass_at_1(references=[ADD_TESTS], predictions=["def add(a, b):\n    return a + b"])
        with pytest.raises(UsageError, match="HF_ALLOW_CODE_EVAL=1"):
            execute("pass")
        with pytest.raises(UsageError, match="HF_ALLOW_CODE_EVAL=1"):  # before any generation
            manager.load(["nsa_mbpp"])


def test_simple_evaluate_needs_confirm_and_reports_pass_at_1(tiny_lm, manager, mbpp_rows, opted_in):
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    tok_dir, model = tiny_lm
    lm = HFLM(pretrained=model, tokenizer=str(tok_dir), device="cpu", batch_size=1, max_length=2048)
    kwargs = dict(model=lm, tasks=["nsa_mbpp"], task_manager=manager, limit=1, bootstrap_iters=0)
    with pytest.raises(ValueError, match="confirm_run_unsafe_code"):
        lm_eval.simple_evaluate(**kwargs, gen_kwargs={"max_gen_toks": 2})
    out = lm_eval.simple_evaluate(**kwargs, gen_kwargs={"max_gen_toks": 2}, confirm_run_unsafe_code=True)
    assert out["results"]["nsa_mbpp"]["pass_at_1,none"] == 0.0  # two random tokens are not `add`


def test_requires_unsafe_code_reads_the_leaf_configs(manager):
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager

    from nsa_eval.tasks import TASKS_DIR

    assert requires_unsafe_code(["nsa_mbpp", "nsa_gsm8k", "nsa_niah"], manager) == ["nsa_mbpp"]
    lm_eval_dir = Path(lm_eval.tasks.__file__).parent
    folders = [str(lm_eval_dir / d) for d in ("humaneval", "mbpp", "gsm8k")] + [str(TASKS_DIR)]
    small = TaskManager(include_path=folders, include_defaults=False)
    assert requires_unsafe_code(["gsm8k", "humaneval", "mbpp", "nsa_mbpp"], small) == [
        "humaneval",
        "mbpp",
        "nsa_mbpp",
    ]
    with pytest.raises(UsageError, match="unknown task"):
        requires_unsafe_code(["no_such_task"], manager)
