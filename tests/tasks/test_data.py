"""Local-first data: layout, the one offline error, group walking, fetch, the `nsa-eval data` CLI."""

from __future__ import annotations

import pytest

from nsa_eval.errors import UsageError
from nsa_eval.tasks import check_task_data, data_dir
from nsa_eval.tasks.data import data_specs, download, fetch
from nsa_eval.tasks.local_data import DataSpec, read_jsonl


def test_data_dir_from_env(data_root, monkeypatch):
    assert data_dir() == data_root
    monkeypatch.delenv("NSA_EVAL_DATA")
    assert str(data_dir()).endswith(".cache/nsa-eval/data")


def test_specs_walk_groups_and_member_overrides(manager):
    specs = data_specs(
        ["nsa_mmlu", "nsa_bbh", "nsa_gsm8k", "nsa_longbench", "nsa_aime24_16k", "nsa_niah"], manager
    )
    assert len(specs["nsa_mmlu"]) == 57
    assert {(s.path, s.splits) for s in specs["nsa_mmlu"]} == {("cais/mmlu", ("test", "dev"))}
    assert len(specs["nsa_bbh"]) == 27 and specs["nsa_bbh"][0].path == "SaylorTwift/bbh"
    assert [(s.path, s.name) for s in specs["nsa_gsm8k"]] == [("openai/gsm8k", "main")]
    assert sorted(s.name for s in specs["nsa_longbench"]) == sorted(
        [
            "multifieldqa_en",
            "multifieldqa_zh",
            "qasper",
            "hotpotqa",
            "2wikimqa",
            "gov_report",
            "dureader",
            "passage_retrieval_en",
            "passage_retrieval_zh",
            "lcc",
        ]
    )
    assert [(s.path, s.splits) for s in specs["nsa_aime24_16k"]] == [("Maxwell-Jia/AIME_2024", ("train",))]
    assert specs["nsa_niah"] == []  # builds its own data


def test_missing_data_offline_is_one_clear_error(manager, data_root):
    with pytest.raises(UsageError) as err:
        check_task_data(["nsa_longbench_hotpotqa", "nsa_gsm8k"], manager)
    message = str(err.value)
    assert "task nsa_longbench_hotpotqa" in message and "task nsa_gsm8k" in message
    assert str(data_root / "Xnhyacinth__LongBench" / "hotpotqa" / "test.jsonl") in message
    assert "nsa-eval data fetch nsa_longbench_hotpotqa nsa_gsm8k" in message
    assert message.count("benchmark data is not on disk") == 1  # one error for all tasks


def test_present_data_or_online_passes(manager, data_root, monkeypatch, rows):
    rows.write(data_root, "Xnhyacinth/LongBench", "hotpotqa", "test", rows.longbench())
    check_task_data(["nsa_longbench_hotpotqa", "nsa_niah"], manager)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    check_task_data(["nsa_gsm8k"], manager)  # online: the hub is the fallback


def test_task_build_offline_without_data_raises_usage_error(manager, data_root):
    with pytest.raises(UsageError, match="nsa-eval data fetch nsa_longbench_qasper"):
        manager.load(["nsa_longbench_qasper"])


def test_fetch_refuses_offline(manager):
    with pytest.raises(UsageError, match="needs the network"):
        fetch(["nsa_gsm8k"], manager=manager)


def test_download_writes_the_schema_as_jsonl(tmp_path, data_root):
    # a "hub" dataset that datasets.load_dataset reads offline: a folder of JSON lines
    source = tmp_path / "hub_dataset"
    source.mkdir()
    (source / "test.jsonl").write_text(
        '{"question": "2+2?", "answer": "#### 4"}\n{"question": "1+1?", "answer": "#### 2"}\n'
    )
    spec = DataSpec(task="toy", path=str(source), name=None, splits=("test",))
    assert spec.missing() == spec.files()
    written = download(spec, log=lambda *_: None)
    assert written == spec.files() and spec.missing() == []
    assert read_jsonl(written[0]) == [
        {"question": "2+2?", "answer": "#### 4"},
        {"question": "1+1?", "answer": "#### 2"},
    ]
    assert download(spec) == []  # present: nothing to do without force


def test_cli_data_check_exits_2_with_the_message(manager, data_root, capsys):
    from nsa_eval.cli import main

    assert main(["data", "check", "nsa_longbench_lcc"]) == 2
    assert "nsa-eval data fetch nsa_longbench_lcc" in capsys.readouterr().err
    assert main(["data", "list", "nsa_niah", "nsa_longbench"]) == 0
    out = capsys.readouterr().out
    assert "builds its own data" in out and "0/10 datasets on disk" in out


PAPER = __import__("pathlib").Path(__file__).resolve().parents[2] / "configs" / "paper.yaml"


class _AnySplit(dict):
    """A stand-in for `datasets.load_dataset`'s result: every split holds one row."""

    def __contains__(self, split):
        return True

    def __getitem__(self, split):
        return [{"row": split}]


def _fake_hub(monkeypatch) -> list[tuple[str, str | None]]:
    """Online, with `datasets.load_dataset` answered locally; returns the (path, name) it was asked."""
    import datasets

    asked = []
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    def load_dataset(path, name=None):
        asked.append((path, name))
        return _AnySplit()

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return asked


def test_every_dataset_the_paper_suite_reads_is_fetched_then_checked_offline(data_root, monkeypatch, capsys):
    """configs/paper.yaml runs offline: `data fetch --suite` covers every task but NIAH (MMLU-Pro,
    CMMLU, MATH and HumanEval included), `data check --suite` and `validate` pass afterwards."""
    from nsa_eval.cli import main
    from nsa_eval.suite import check_suite, load_suite, suite_task_manager
    from nsa_eval.tasks.data import hub_loaded_tasks

    suite = load_suite(PAPER)
    names = [task.task for task in suite.tasks]
    manager = suite_task_manager(suite.include_path)
    specs = data_specs(names, manager)
    assert [name for name in names if not specs[name]] == ["nsa_niah"]  # it builds its own prompts
    assert hub_loaded_tasks(names, manager) == []
    paths = {spec.path for found in specs.values() for spec in found}
    added = {"TIGER-Lab/MMLU-Pro", "haonan-li/cmmlu", "EleutherAI/hendrycks_math", "openai/openai_humaneval"}
    assert added <= paths

    with pytest.raises(UsageError) as err:  # offline and nothing on disk: validate names every task
        check_suite(suite, runs_here=False)
    for name in set(names) - {"nsa_niah"}:
        assert f"task {name}:" in str(err.value)

    asked = _fake_hub(monkeypatch)
    assert main(["data", "fetch", "--suite", str(PAPER)]) == 0
    expected = {(spec.path, spec.name) for found in specs.values() for spec in found}
    assert set(asked) == expected and len(asked) == len(expected)  # each dataset once
    assert all(not spec.missing() for found in specs.values() for spec in found)

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    capsys.readouterr()
    assert main(["data", "check", "--suite", str(PAPER)]) == 0
    assert "all data on disk" in capsys.readouterr().out
    warnings = check_suite(suite, runs_here=False)
    assert not [w for w in warnings if "data" in w or "hub" in w]


def test_validate_online_names_the_data_it_will_download(manager, data_root, monkeypatch):
    from nsa_eval.tasks.data import task_data_warnings

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    warnings = task_data_warnings(["nsa_gsm8k", "nsa_niah"], manager)
    assert len(warnings) == 1 and warnings[0].startswith("task nsa_gsm8k: 1 data file(s) not on disk")
    assert str(data_root / "openai__gsm8k" / "main" / "test.jsonl") in warnings[0]


def test_a_task_lm_eval_loads_itself_is_named(data_root):
    from nsa_eval.tasks import task_manager
    from nsa_eval.tasks.data import hub_loaded_tasks, task_data_warnings

    manager = task_manager()
    assert hub_loaded_tasks(["gsm8k", "nsa_gsm8k", "nsa_niah"], manager) == ["gsm8k"]
    (warning,) = task_data_warnings(["gsm8k"], manager)
    assert warning.startswith("task gsm8k: lm-eval loads its data from the hub")


def test_cli_data_needs_tasks_or_a_suite(capsys):
    from nsa_eval.cli import main

    assert main(["data", "fetch"]) == 2
    assert "name at least one task" in capsys.readouterr().err
