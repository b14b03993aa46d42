"""The report of a real lm-eval run: two groups (one `weight_by_size: true`, one false) of two
multiple-choice subtasks of 3 and 12 documents, scored by stand-in LMs whose answers are fixed by
the method, so each method's per-document results and lm-eval's group rows are known."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import numpy as np
import pytest

from nsa_eval.errors import UsageError
from nsa_eval.report import ReportBuilder, load_run, write_report
from nsa_eval.report.builder import _interval
from nsa_eval.report.protocol import documents
from tests.suite_fixtures import choice_task_yaml, make_tiny_llama

CHOICES = ["the", "quick", "dog", "fox"]
LABELS = {"a": [1, 0, 0], "b": [0, 3, 3, 0, 1, 3, 2, 0, 3, 3, 0, 1]}
# the choice each method always picks: topk answers as full does (its differences are zero)
PICKS = {"full": "the", "topk": "the", "sink_window": "fox"}
LABELS_OF = {"full": "full", "topk": "topk@64", "sink_window": "sink_window@48"}  # the suite's labels


def _task_files(folder: Path) -> None:
    for name, labels in LABELS.items():
        rows = [
            {"q": f"question {i} {name}", "choices": CHOICES, "label": label}
            for i, label in enumerate(labels)
        ]
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (folder / f"rt_{name}.yaml").write_text(choice_task_yaml(f"rt_{name}", folder / f"{name}.jsonl"))
    for group, by_size in (("rt_pooled", "true"), ("rt_macro", "false")):
        (folder / f"{group}.yaml").write_text(
            textwrap.dedent(f"""\
            group: {group}
            task: [rt_a, rt_b]
            aggregate_metric_list:
              - metric: acc
                weight_by_size: {by_size}
            metadata:
              version: 1.0
            """)
        )


def _stand_in(model_spec):
    from lm_eval.api.model import LM

    pick = PICKS[model_spec.attention]

    class Fixed(LM):
        def loglikelihood(self, requests):
            return [(0.0 if r.args[1].strip() == pick else -1.0, False) for r in requests]

        def loglikelihood_rolling(self, requests):
            raise NotImplementedError

        def generate_until(self, requests):
            raise NotImplementedError

    return Fixed()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from nsa_eval.runner import run_suite
    from nsa_eval.suite import load_suite

    root = tmp_path_factory.mktemp("report")
    model = make_tiny_llama(root / "model")
    (root / "tasks").mkdir()
    _task_files(root / "tasks")
    suite = root / "suite.yaml"
    suite.write_text(
        textwrap.dedent(f"""\
        name: report_test
        include_path: tasks
        defaults: {{pretrained: {model}, dtype: float32, sink: 16, local: 32, budget: 64}}
        models:
          - attention: [topk, full, sink_window]
        tasks:
          - {{task: rt_pooled, label: pooled}}
          - {{task: rt_macro, label: macro}}
          - {{task: rt_b, label: only_full, models: [full]}}
        """)
    )
    run_suite(load_suite(suite), root / "run", progress=False, lm_factory=_stand_in)
    return root / "run"


@pytest.fixture(scope="module")
def report(run_dir, tmp_path_factory):
    out = write_report(run_dir, tmp_path_factory.mktemp("out") / "report", bootstrap=500)
    return out, json.loads((out / "report.json").read_text()), (out / "report.md").read_text()


def _accuracy(attention: str, name: str) -> np.ndarray:
    return np.array([float(CHOICES[label] == PICKS[attention]) for label in LABELS[name]])


def _results(run_dir: Path, label: str) -> dict:
    run = load_run(run_dir)
    return next(c.results for c in run.cells if c.label == label)


def test_a_size_weighted_group_is_scored_by_lm_evals_aggregate(run_dir, report):
    """rt_pooled declares weight_by_size: true: its score is lm-eval's group row (all 15 documents
    pooled), not the mean of the two subtask accuracies."""
    _, data, md = report
    for attention in ("full", "sink_window"):
        label = LABELS_OF[attention]
        group_row = _results(run_dir, f"{label}/pooled")["results"]["rt_pooled"]["acc,none"]
        pooled = np.concatenate([_accuracy(attention, "a"), _accuracy(attention, "b")]).mean()
        macro = np.mean([_accuracy(attention, "a").mean(), _accuracy(attention, "b").mean()])
        assert group_row == pytest.approx(pooled) and abs(pooled - macro) > 0.05
        score = data["task_scores"]["pooled"][label]
        assert (
            score["value"] == pytest.approx(group_row) and data["averages"]["pooled"][label] == score["value"]
        )
        assert score["weights"] == pytest.approx({"rt_a": 0.2, "rt_b": 0.8})
    assert "| **rt_pooled** (lm-eval group) |" in md


def test_an_unweighted_group_is_the_mean_of_its_subtasks(run_dir, report):
    _, data, _ = report
    group_row = _results(run_dir, "full/macro")["results"]["rt_macro"]["acc,none"]
    macro = np.mean([_accuracy("full", "a").mean(), _accuracy("full", "b").mean()])
    assert group_row == pytest.approx(macro)
    assert data["task_scores"]["macro"]["full"]["value"] == pytest.approx(macro)
    assert data["task_scores"]["macro"]["full"]["weights"] == pytest.approx({"rt_a": 0.5, "rt_b": 0.5})


def test_the_group_difference_agrees_with_the_group_scores(report):
    """The paired bootstrap of a group weights its subtasks as the group score does: its point
    estimate is the difference of the two group scores, for pooled and unweighted groups."""
    _, data, _ = report
    for task in ("pooled", "macro"):
        d = next(
            d
            for d in data["differences"]
            if (d["task"], d["subtask"], d["a"], d["b"]) == (task, "average", "full", "sink_window@48")
        )
        scores = data["task_scores"][task]
        expected = scores["sink_window@48"]["value"] - scores["full"]["value"]
        assert d["difference"] == pytest.approx(expected) and d["low"] <= d["difference"] <= d["high"]
        assert d["metric"] == "acc,none" and d["n"] == 15


def test_summary_average_is_over_the_tasks_every_method_has(report):
    """only_full ran under full attention alone: the average is over the two tasks all ran, for
    every column alike, and says so; report.json has it."""
    _, data, md = report
    assert data["summary_average"]["tasks"] == ["pooled", "macro"]
    for model, value in data["summary_average"]["values"].items():
        assert value == pytest.approx(
            np.mean([data["averages"]["pooled"][model], data["averages"]["macro"][model]])
        )
    assert "| **Average** (2 of 3 tasks, those every method has) |" in md


def test_protocol_counts_the_documents_of_one_method(report):
    _, _, md = report
    tasks = md.split("Tasks; documents", 1)[1]
    pooled = next(line for line in tasks.splitlines() if line.startswith("| pooled |"))
    assert "| 3, 12 |" in pooled  # not 9, 36: three methods ran the same documents


def test_documents_that_differ_by_method_are_listed_per_method(run_dir, tmp_path):
    run = load_run(run_dir)
    cell = next(c for c in run.cells if c.label == "full/pooled")
    cell.results["n-samples"]["rt_b"]["effective"] = 10
    builder = ReportBuilder(run, tmp_path, 10)
    assert (
        documents(builder, "pooled") == "differs by method: topk@64 3, 12; full 3, 10; sink_window@48 3, 12"
    )


def test_a_zero_difference_has_no_sign(report):
    """topk answers as full does, and comes first: the stored topk - full is flipped to
    full - topk... and back; no '-0.000' anywhere."""
    _, data, md = report
    assert "-0.000" not in md
    assert "| rt_a | +0.000 [+0.000, +0.000] |" in md
    assert _interval({"difference": -0.0, "low": -0.0, "high": -1e-12}) == "+0.000 [+0.000, +0.000]"


def test_a_metric_the_results_lack_is_an_error_naming_it(run_dir, tmp_path):
    """A suite `metric:` that the task does not report stops the report before anything is written,
    naming the task, the metric and those there are, instead of scoring another metric."""
    from nsa_eval.runner import write_cell

    broken = tmp_path / "run"
    shutil.copytree(run_dir, broken)
    for folder in broken.glob("cells/*"):  # written again as the runner writes a cell, checksums too
        config = json.loads((folder / "config.json").read_text())
        config["task"]["metric"] = "f1"
        samples: dict[str, list] = {}
        for line in (folder / "samples.jsonl").read_text().splitlines():
            samples.setdefault(json.loads(line)["task"], []).append(json.loads(line))
        write_cell(folder, config["key"], config, json.loads((folder / "results.json").read_text()), samples)
    with pytest.raises(UsageError, match=r"task 'pooled': the suite's metric 'f1' .*'rt_a' \(acc\)"):
        write_report(broken, tmp_path / "report")
    assert not (tmp_path / "report").exists() or not any((tmp_path / "report").iterdir())


@pytest.mark.parametrize("value", ["0", "-5"])
def test_bad_bootstrap_exits_2_before_any_work(value, run_dir, tmp_path, capsys):
    from nsa_eval.cli import main

    assert main(["report", str(run_dir), "--output", str(tmp_path / "r"), "--bootstrap", value]) == 2
    assert (
        capsys.readouterr().err.strip()
        == f"nsa-eval: error: --bootstrap must be an integer >= 1, got {value}"
    )
    assert not (tmp_path / "r").exists()
    with pytest.raises(UsageError, match="--bootstrap must be an integer >= 1"):
        write_report(run_dir, tmp_path / "r", bootstrap=int(value))
    assert not (tmp_path / "r").exists()


def test_a_failed_rebuild_leaves_the_previous_report_whole(run_dir, tmp_path, monkeypatch):
    out = write_report(run_dir, tmp_path / "report", bootstrap=50)
    (out / "figures" / "old.png").write_bytes(b"png")  # a figure the report points at
    before = {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()}

    def crash(self):
        raise RuntimeError("crash while rendering")

    monkeypatch.setattr("nsa_eval.report.document.Document.html", crash)
    with pytest.raises(RuntimeError):
        write_report(run_dir, out, bootstrap=50)
    assert {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]  # no staging folder left behind
    monkeypatch.undo()
    write_report(run_dir, out, bootstrap=50)  # a rebuild drops figures no longer in the report
    assert not (out / "figures" / "old.png").exists()


def test_a_group_row_the_subtasks_do_not_reproduce_is_shown_as_lm_eval_reports_it(run_dir, tmp_path):
    """Where neither weighting of the subtasks gives lm-eval's group number, the number stands as
    lm-eval reported it, and its difference has no interval rather than one of another statistic."""
    run = load_run(run_dir)
    for cell in run.cells:
        if cell.task == "pooled":
            cell.results["results"]["rt_pooled"]["acc,none"] = 0.9
    builder = ReportBuilder(run, tmp_path, 20)
    (tmp_path / "figures").mkdir()
    md = builder.build().markdown(tmp_path)
    score = builder.task_scores[("full", "pooled")]
    assert (score.value, score.weighting, score.weights) == (0.9, None, None)
    assert "| **rt_pooled** (lm-eval group) | n/a | n/a |" in md
