"""End to end on the CPU: a tiny random Llama under two methods on a tiny NIAH grid (6 cells).

One real run through the CLI; then a resumed run that computes nothing, a run killed after its
first cell that resumes to the same numbers, and the HTML report in headless Chromium.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nsa_eval.runner import CELL_FILES, is_done, run_suite
from nsa_eval.suite import load_suite
from tests.suite_fixtures import make_tiny_llama, tiny_suite_text

REPO = str(Path(__file__).resolve().parents[1])  # the subprocesses run this checkout, whatever is installed
ENV = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                    "OMP_NUM_THREADS": "1",
                    "PYTHONPATH": os.pathsep.join([REPO, *filter(None, [os.environ.get("PYTHONPATH")])])}
N_CELLS = 6  # 2 methods x 3 lengths


def nsa_eval_cli(*args, cwd: Path, **kwargs):
    return subprocess.run([sys.executable, "-m", "nsa_eval", *map(str, args)], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=600, **kwargs)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("suite")
    model = make_tiny_llama(root / "model")
    suite = root / "tiny.yaml"
    suite.write_text(tiny_suite_text(model))
    result = nsa_eval_cli("run", suite, "--output", root / "run", "--report-dir", root / "report", cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    return root, suite, result


def cell_folders(run_dir: Path) -> list[Path]:
    return sorted(p for p in (run_dir / "cells").iterdir() if p.is_dir())


def numbers(folder: Path) -> tuple:
    results = json.loads((folder / "results.json").read_text())
    samples = [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]
    return (results["results"]["nsa_niah"]["score,none"],
            [(s["doc_id"], s["filtered_resps"], s["score"]) for s in samples])


def test_run_writes_every_cell_and_the_report(first_run):
    root, _, result = first_run
    assert f"{N_CELLS} cells computed, 0 already done" in result.stdout
    folders = cell_folders(root / "run")
    assert len(folders) == N_CELLS and all(is_done(f) for f in folders)
    assert not list((root / "run").rglob(".*.tmp-*"))  # no temporary file left behind
    config = json.loads((folders[0] / "config.json").read_text())
    assert config["key"].startswith(folders[0].name)
    lengths = {json.loads(line)["doc"]["context_length"] for f in folders
               for line in (f / "samples.jsonl").read_text().splitlines()}
    assert lengths == {128, 192, 256}
    report = root / "report"
    for name in ("report.md", "report.html", "scores.csv", "differences.csv", "niah.csv",
                 "activated_tokens.csv", "report.json"):
        assert (report / name).is_file(), name
    assert sorted(p.name for p in (report / "figures").glob("niah_*.png")) == [
        "niah_niah_full.png", "niah_niah_sink_window-48.png"]
    data = json.loads((report / "report.json").read_text())
    assert data["models"] == ["full", "sink_window@48"]  # sink + local and data["reference"] == "full"
    tokens = {(r["model"], r["part"]): r for r in data["activated_tokens"]}
    assert tokens[("sink_window@48", 256)]["max"] <= 48 < tokens[("full", 256)]["max"]
    assert any(d["a"] == "full" and d["b"] == "sink_window@48" for d in data["differences"])


def test_second_run_resumes_without_loading_a_model(first_run):
    root, suite_path, _ = first_run
    before = {f: (f / "results.json").stat().st_mtime_ns for f in cell_folders(root / "run")}
    built = []
    summary = run_suite(load_suite(suite_path), root / "run", progress=False,
                        lm_factory=lambda model: built.append(model) or pytest.fail("loaded a model"))
    assert (summary.computed, summary.skipped) == (0, N_CELLS) and built == []
    assert before == {f: (f / "results.json").stat().st_mtime_ns for f in cell_folders(root / "run")}


def test_killed_run_resumes_to_the_same_numbers(first_run):
    root, suite_path, _ = first_run
    run_dir = root / "killed"
    only = "full/*"  # the 3 full-attention cells: enough to kill mid-run, half the time
    proc = subprocess.Popen([sys.executable, "-m", "nsa_eval", "run", str(suite_path), "--output",
                             str(run_dir), "--no-report", "--only", only], cwd=root, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            if (run_dir / "cells").is_dir() and any(is_done(f) for f in cell_folders(run_dir)):
                break
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)  # the process group we started, nothing else
    finally:
        proc.wait(timeout=60)
    done = [f for f in cell_folders(run_dir) if is_done(f)]
    assert 1 <= len(done) < 3, "the kill should land after the first cell and before the last"
    # a half-written cell never counts as done: its files appear whole or not at all
    for folder in cell_folders(run_dir):
        for name in CELL_FILES:
            if (folder / name).exists():
                assert (folder / name).stat().st_size > 0

    # a report of the partial run lists what is missing and scores nothing it cannot compare whole
    from nsa_eval.report import write_report

    partial = json.loads((write_report(run_dir, root / "partial_report") / "report.json").read_text())
    assert partial["averages"]["niah"]["full"] is None
    assert len(partial["missing_cells"]) == N_CELLS - len(done)

    summary = run_suite(load_suite(suite_path), run_dir, only=only, progress=False)
    assert (summary.computed, summary.skipped) == (3 - len(done), len(done))
    resumed = cell_folders(run_dir)
    assert len(resumed) == 3
    for folder in resumed:  # the same cells (same keys) as the uninterrupted run, the same numbers
        assert numbers(folder) == numbers(root / "run" / "cells" / folder.name)


def test_html_report_renders_in_headless_chromium(first_run, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("Debian's chromium is not installed (apt-get install -y chromium)")
    html = (first_run[0] / "report" / "report.html").read_text()
    assert "http://" not in html and "https://" not in html  # self-contained
    # Record, once loaded, how many images decoded; a script error would leave no mark.
    probe = ("<script>window.addEventListener('load', () => { const imgs = [...document.images];"
             "document.body.setAttribute('data-probe', JSON.stringify({images: imgs.length,"
             "decoded: imgs.filter(i => i.complete && i.naturalWidth > 0).length,"
             "tables: document.querySelectorAll('table').length})); });</script></body>")
    page = tmp_path / "report.html"
    page.write_text(html.replace("</body>", probe))
    result = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                             "--enable-logging=stderr", "--virtual-time-budget=10000", "--dump-dom",
                             page.as_uri()],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    marker = result.stdout.split('data-probe="', 1)[1].split('"', 1)[0].replace("&quot;", '"')
    probe_data = json.loads(marker)
    assert probe_data["images"] == 2 and probe_data["decoded"] == 2  # both NIAH heatmaps show
    assert probe_data["tables"] >= 5
    assert "Uncaught" not in result.stderr and "ERR_FILE_NOT_FOUND" not in result.stderr
