"""A run folder under damage, copies, two writers, Ctrl-C and read-only storage: nothing is lost,
nothing half-written or foreign is accepted, and nothing outside nsa-eval's folders is touched.

Most runs here use a stand-in LM (fixed answers, no model) on a 3-document local task, so each run
takes a second; the Ctrl-C test runs a tiny random Llama through the real CLI."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nsa_eval import folders, runner
from nsa_eval.errors import UsageError
from nsa_eval.report import load_run, write_report
from nsa_eval.runner import CHECKSUM_FILE, cell_problem, is_done, run_suite
from nsa_eval.suite import load_suite
from tests.suite_fixtures import make_tiny_llama, tiny_suite_text

REPO = str(Path(__file__).resolve().parents[1])
ENV = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                    "OMP_NUM_THREADS": "1",
                    "PYTHONPATH": os.pathsep.join([REPO, *filter(None, [os.environ.get("PYTHONPATH")])])}


def stand_in(model_spec):
    """An lm-eval LM that always prefers the first choice: no weights, instant, deterministic."""
    from lm_eval.api.model import LM

    class FirstChoice(LM):
        def loglikelihood(self, requests):
            return [(0.0 if r.args[1].strip() == "yes" else -1.0, False) for r in requests]

        def loglikelihood_rolling(self, requests):
            raise NotImplementedError

        def generate_until(self, requests):
            raise NotImplementedError

    return FirstChoice()


def no_model(model_spec):
    pytest.fail(f"a model was built for {model_spec.label}: the run had nothing to compute")


@pytest.fixture(scope="module")
def task_folder(tmp_path_factory):
    """A local multiple-choice task of 3 documents; one folder for the module, so lm-eval's task index
    (seconds to build) is built once."""
    tasks = tmp_path_factory.mktemp("tasks")
    rows = [{"q": f"question {i}", "label": i % 2} for i in range(3)]
    (tasks / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tasks / "qa.yaml").write_text(textwrap.dedent(f"""\
        task: rf_qa
        dataset_path: json
        dataset_kwargs: {{data_files: {{test: {tasks / 'qa.jsonl'}}}}}
        test_split: test
        output_type: multiple_choice
        doc_to_text: "{{{{q}}}}"
        doc_to_choice: ["yes", "no"]
        doc_to_target: label
        metric_list: [{{metric: acc}}]
        metadata: {{version: 1.0}}
        """))
    return tasks


@pytest.fixture
def project(tmp_path, task_folder):
    """A suite of 2 models x 1 task: 2 cells, written to runs/folder_test under tmp_path."""
    suite = tmp_path / "suite.yaml"
    suite.write_text(textwrap.dedent(f"""\
        name: folder_test
        include_path: {task_folder}
        output: runs/folder_test
        report: reports/folder_test
        defaults: {{pretrained: full-tiny, dtype: float32, sink: 16, local: 32, budget: 64}}
        models:
          - attention: [full, topk]
        tasks:
          - {{task: rf_qa, label: qa}}
        """))
    return tmp_path, load_suite(suite)


def cells_of(run_dir: Path) -> dict[str, Path]:
    """label -> cell folder, from run.json."""
    manifest = json.loads((run_dir / "run.json").read_text())
    return {c["label"]: run_dir / "cells" / c["key"] for c in manifest["cells"]}


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.stat().st_size)
            for p in sorted(folder.rglob("*"))}


def reseal(folder: Path) -> None:
    """Write checksums.json again for the files as they are: a forger who knows the format."""
    import hashlib

    seal = json.loads((folder / CHECKSUM_FILE).read_text())
    for name in seal["sha256"]:
        seal["sha256"][name] = hashlib.sha256((folder / name).read_bytes()).hexdigest()
    (folder / CHECKSUM_FILE).write_text(json.dumps(seal))


DAMAGE = {
    "truncated results.json": (lambda c, other: (c / "results.json").write_bytes(
        (c / "results.json").read_bytes()[:100]), "results.json does not match its checksum"),
    "empty results.json": (lambda c, other: (c / "results.json").write_bytes(b""),
                           "results.json does not match its checksum"),
    "garbage results.json": (lambda c, other: (c / "results.json").write_bytes(b"\x00\xff garbage"),
                             "results.json does not match its checksum"),
    "results.json replaced by {}": (lambda c, other: (c / "results.json").write_text("{}"),
                                    "results.json does not match its checksum"),
    "no checksums.json": (lambda c, other: (c / CHECKSUM_FILE).unlink(), "no checksums.json"),
    "samples.jsonl of another cell": (lambda c, other: shutil.copy(other / "samples.jsonl", c),
                                      "samples.jsonl does not match its checksum"),
    "another cell's folder copied in": (lambda c, other: [shutil.copy(f, c) for f in other.iterdir()],
                                        "it holds cell"),
    "samples.jsonl of another cell, checksums forged": (
        lambda c, other: shutil.copy(other / "samples.jsonl", c) and reseal(c),
        "samples.jsonl line 1 belongs to cell"),
    "results.json not JSON, checksums forged": (
        lambda c, other: (c / "results.json").write_text("{not json") and reseal(c),
        "results.json is not valid JSON"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_cell_is_computed_again_with_a_warning_naming_it(damage, project, monkeypatch):
    root, suite = project
    monkeypatch.chdir(root)
    first = run_suite(suite, progress=False, lm_factory=stand_in)
    assert (first.computed, first.skipped) == (2, 0)
    cells = cells_of(first.run_dir)
    spoil, message = DAMAGE[damage]
    spoil(cells["full/qa"], cells["topk@64/qa"])
    assert not is_done(cells["full/qa"]) and message in cell_problem(cells["full/qa"])

    report_warnings: list[str] = []  # the report names the cell and the file, and leaves it out
    out = write_report(first.run_dir, root / "partial", bootstrap=10, warn=report_warnings.append)
    assert len(report_warnings) == 1 and "cell full/qa left out of the report" in report_warnings[0]
    assert message in report_warnings[0] and str(cells["full/qa"]) in report_warnings[0]
    data = json.loads((out / "report.json").read_text())
    assert data["missing_cells"] == ["full/qa"] and list(data["unreadable_cells"]) == ["full/qa"]

    warnings: list[str] = []
    second = run_suite(suite, progress=False, lm_factory=stand_in, warn=warnings.append)
    assert (second.computed, second.skipped, second.recomputed) == (1, 1, ["full/qa"])
    assert len(warnings) == 1 and warnings[0].startswith(f"cell full/qa ({cells['full/qa']}): {message}")
    assert is_done(cells["full/qa"])
    assert load_run(first.run_dir).unreadable == {}


def test_report_names_an_unreadable_cell_on_the_command_line(project, monkeypatch, capsys):
    from nsa_eval.cli import main

    root, suite = project
    monkeypatch.chdir(root)
    run_suite(suite, progress=False, lm_factory=stand_in)
    cell = cells_of(root / "runs" / "folder_test")["topk@64/qa"]
    (cell / "samples.jsonl").write_text("")
    capsys.readouterr()
    assert main(["report", "runs/folder_test"]) == 0
    err = capsys.readouterr().err.strip()
    assert err == (f"nsa-eval: warning: cell topk@64/qa left out of the report: runs/folder_test/cells/"
                   f"{cell.name}: samples.jsonl does not match its checksum (changed or damaged since it was "
                   "written)")
    assert "`topk@64/qa` (unreadable)" in (root / "reports" / "folder_test" / "report.md").read_text()


def test_a_finished_run_rewrites_nothing_and_reports_from_a_read_only_copy(project, monkeypatch):
    root, suite = project
    monkeypatch.chdir(root)
    run_suite(suite, progress=False, lm_factory=stand_in)
    run_dir = root / "runs" / "folder_test"
    before = snapshot(run_dir)
    time.sleep(0.01)
    summary = run_suite(suite, progress=False, lm_factory=no_model)
    assert (summary.computed, summary.skipped) == (0, 2)
    assert snapshot(run_dir) == before  # run.json and suite.yaml are not written again

    monkeypatch.setattr(runner, "is_writable", lambda folder: False)  # a read-only mount
    assert run_suite(suite, progress=False, lm_factory=no_model).skipped == 2
    out = write_report(run_dir, root / "elsewhere", bootstrap=10)
    assert json.loads((out / "report.json").read_text())["missing_cells"] == []
    assert snapshot(run_dir) == before
    (cells_of(run_dir)["full/qa"] / "results.json").write_text("{}")
    with pytest.raises(UsageError, match=r"runs/folder_test: read-only, and 1 of 2 cells are not done"):
        run_suite(suite, progress=False, lm_factory=no_model)


def test_a_copied_run_reports_beside_itself(project, monkeypatch):
    """run.json records the report folder relative to the run folder, so `report` on a copy writes
    into the copy's report folder, never the original's."""
    root, suite = project
    monkeypatch.chdir(root)
    run_suite(suite, "scratch", progress=False, lm_factory=stand_in, report_dir="scratch/report")
    assert json.loads((root / "scratch" / "run.json").read_text())["report"] == "report"
    shutil.copytree(root / "scratch", root / "copy")
    out = write_report(root / "copy", bootstrap=10)
    assert out.resolve() == (root / "copy" / "report").resolve()
    assert not (root / "scratch" / "report").exists()
    assert (root / "copy" / "report" / folders.MARKER).is_file()


def test_a_foreign_run_json_cannot_send_the_report_into_a_users_folder(project, monkeypatch, capsys):
    from nsa_eval.cli import main

    root, suite = project
    monkeypatch.chdir(root)
    run_suite(suite, progress=False, lm_factory=stand_in)
    run_json = root / "runs" / "folder_test" / "run.json"
    photos = root / "photos"
    photos.mkdir()
    (photos / "cat.png").write_bytes(b"png")
    manifest = json.loads(run_json.read_text())
    run_json.write_text(json.dumps(manifest | {"report": str(photos)}))
    assert main(["report", "runs/folder_test"]) == 2
    assert "already exists and was not made by nsa-eval" in capsys.readouterr().err
    assert [p.name for p in photos.iterdir()] == ["cat.png"]
    manifest["cells"][0]["key"] = "../../../photos"
    run_json.write_text(json.dumps(manifest))
    assert main(["report", "runs/folder_test"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("run.json: not a run manifest (its cells are not a list of {key: 16 hex digits, "
                        "label, ...}); expected the run.json that `nsa-eval run` writes")
    run_json.write_text("[1, 2")
    assert main(["report", "runs/folder_test"]) == 2
    assert "run.json: cannot be read as JSON" in capsys.readouterr().err


HOLD_LOCK = """\
import sys, time
from nsa_eval.folders import RunLock
with RunLock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(600)
"""


def test_one_run_per_output_folder_and_a_killed_holder_leaves_no_lock(project, monkeypatch):
    root, suite = project
    monkeypatch.chdir(root)
    run_dir = root / "runs" / "folder_test"
    folders.claim_folder(run_dir, "run")
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(run_dir)], env=ENV,
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(UsageError) as refused:
            run_suite(suite, progress=False, lm_factory=no_model)
        message = str(refused.value)
        assert message.startswith(f"runs/folder_test is in use by another nsa-eval run (pid {holder.pid} on ")
        assert "wait for it to finish, or stop it" in message
        assert not (run_dir / "cells").exists()  # refused before any cell
    finally:
        os.killpg(holder.pid, signal.SIGKILL)  # the process group we started: kill -9, no clean-up
        holder.wait(timeout=60)
    assert json.loads((run_dir / folders.LOCK_FILE).read_text())["pid"] == holder.pid  # the stale file
    summary = run_suite(suite, progress=False, lm_factory=stand_in)
    assert summary.computed == 2


def test_stale_temporary_files_are_removed_by_the_next_run_that_writes(project, monkeypatch):
    root, suite = project
    monkeypatch.chdir(root)
    run_suite(suite, progress=False, lm_factory=stand_in)
    run_dir = root / "runs" / "folder_test"
    cell = cells_of(run_dir)["full/qa"]
    stale = [run_dir / ".run.json.tmp-4242", cell / ".results.json.tmp-4242", cell / ".samples.jsonl.tmp-1"]
    for path in stale:
        path.write_text("half written")
    (cell / CHECKSUM_FILE).unlink()  # the run that was writing this cell was killed
    assert run_suite(suite, progress=False, lm_factory=stand_in).computed == 1
    assert [p for p in stale if p.exists()] == []


def test_an_output_folder_of_an_older_nsa_eval_is_adopted_but_a_users_is_refused(project, monkeypatch):
    root, suite = project
    monkeypatch.chdir(root)
    run_suite(suite, progress=False, lm_factory=stand_in)
    run_dir = root / "runs" / "folder_test"
    (run_dir / folders.MARKER).unlink()  # as an nsa-eval from before the marker left it
    assert folders.check_folder(run_dir, "run", "output") == run_dir
    (run_dir / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="already exists and was not made by nsa-eval"):
        run_suite(suite, progress=False, lm_factory=no_model)
    assert not folders.is_writable(Path("/proc"))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


def test_ctrl_c_exits_130_with_two_lines_and_the_run_resumes(tiny_model, tmp_path):
    suite = tmp_path / "tiny.yaml"
    suite.write_text(tiny_suite_text(tiny_model))
    run_dir = tmp_path / "run"
    # Ctrl-C's default action in the run, whatever this process inherited: a shell's background job
    # ignores SIGINT, and an ignored signal stays ignored across exec (the run would finish every cell)
    proc = subprocess.Popen([sys.executable, "-m", "nsa_eval", "run", str(suite), "--output", str(run_dir),
                             "--no-report", "--only", "full/*"], cwd=tmp_path, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            if (run_dir / "cells").is_dir() and any(is_done(f) for f in (run_dir / "cells").iterdir()):
                break
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends: the foreground process group
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    done = [f for f in (run_dir / "cells").iterdir() if is_done(f)]
    assert 1 <= len(done) < 3, "Ctrl-C should land after the first cell and before the last"
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    lines = err.strip().splitlines()[-2:]
    assert lines[0].startswith("nsa-eval: interrupted during cell full/niah@")
    assert lines[0].endswith(f"{len(done)} of 3 cells are done and kept in {run_dir}")
    assert lines[1] == "nsa-eval: run the same command again to resume (the cell in flight starts over)"
    summary = run_suite(load_suite(suite), run_dir, only="full/*", progress=False)
    assert (summary.computed, summary.skipped, summary.recomputed) == (3 - len(done), len(done), [])
