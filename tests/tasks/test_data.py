"""Local-first data: layout, the one offline error, group walking, fetch, the `nsa-eval data` CLI."""

from __future__ import annotations

import pytest

from nsa_eval.errors import UsageError
from nsa_eval.tasks import check_task_data, data_dir
from nsa_eval.tasks.data import DataSpec, data_specs, download, fetch, read_jsonl


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
