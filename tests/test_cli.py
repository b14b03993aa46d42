"""`nsa-eval validate / run / report`: every bad suite exits 2 with one message naming file and key,
before any model loads or any file is written."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nsa_eval.cli import main

GOOD = """\
name: cli
output: {out}
defaults: {{pretrained: smollm2-135m, sink: 64, local: 256, budget: 1024}}
models:
  - attention: [full, topk]
tasks:
  - task: nsa_niah
    metadata: {{niah_lengths: [1024], niah_depths: [50]}}
"""

BAD = [
    # (replace, with, what the one-line error must say)
    ("name: cli", "name: cli\ntask: []", "unknown key 'task' (did you mean 'tasks'?)"),
    ("budget: 1024}", "budget: lots}", "defaults.budget: expected an integer or a list of integers"),
    ("smollm2-135m", "/missing/checkpoint", "checkpoint directory '/missing/checkpoint' does not exist"),
    ("[full, topk]", "[full, topkk]", "unknown attention method 'topkk' (did you mean 'topk'?)"),
    ("budget: 1024}", "budget: 300}", "models[0].budget: 300 is below sink + local = 64 + 256 = 320"),
    ("niah_lengths: [1024]", "niah_lenghts: [1024]",
     "tasks[0].metadata.niah_lenghts: nsa_niah: unknown metadata key 'niah_lenghts'"),
    ("budget: 1024}", "budget: 1024, batch_size: 0}", "batch_size: expected a positive integer"),
    ("budget: 1024}", "budget: 1024, device: gpu7}", "device: 'gpu7' is not a device"),
    ("budget: 1024}", "budget: 1024, dense_layers: 31}", "dense_layers: 31 exceeds the 30 layers"),
    ("niah_depths: [50]}", "niah_depths: [50]}\n    gen_kwargs: {max_gen_tokz: 3}",
     "tasks[0].gen_kwargs.max_gen_tokz: unknown generation setting"),
    ("task: nsa_niah", "task: nsa_niahh",
     "tasks[0].task: unknown task 'nsa_niahh' (did you mean 'nsa_niah'?)"),
    ("  - attention: [full, topk]", "  - {label: tiny-b1, attention: full}\n  - {label: tiny-b4, attention: "
     "full, batch_size: 4}", "models: 'tiny-b1' and 'tiny-b4' are the same model"),
]


def write_suite(tmp_path: Path, old: str = "", new: str = "") -> Path:
    text = textwrap.dedent(GOOD).format(out=tmp_path / "run").replace(old, new, 1)
    path = tmp_path / "suite.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("command", ["validate", "run"])
@pytest.mark.parametrize("old,new,message", BAD)
def test_bad_suite_exits_2_with_file_and_key(tmp_path, capsys, command, old, new, message):
    if command == "run" and "nsa_niahh" in new:
        pytest.skip("the task index is the slow check (seconds); validate covers it")
    path = write_suite(tmp_path, old, new)
    assert main([command, str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"nsa-eval: error: {path}")
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()  # nothing written


def test_validate_lists_cells(tmp_path, capsys):
    assert main(["validate", str(write_suite(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "2 models x 1 tasks = 2 cells" in out and "topk@1024/nsa_niah" in out


def test_run_flags_are_checked_before_work(tmp_path, capsys):
    path = write_suite(tmp_path)
    assert main(["run", str(path), "--only", "nothing*"]) == 2
    assert "--only 'nothing*' matches no cell" in capsys.readouterr().err
    assert main(["run", str(path), "--limit", "0"]) == 2
    assert "--limit: expected a positive integer" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_validate_checks_flags_as_run_does(tmp_path, capsys):
    path = write_suite(tmp_path)
    assert main(["validate", str(path), "--limit", "-3"]) == 2
    assert "--limit: expected a positive integer, got -3" in capsys.readouterr().err
    assert main(["validate", str(path), "--device", "gpu7"]) == 2
    assert "--device: 'gpu7' is not a device" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--output", "--report-dir"])
def test_run_into_a_file_exits_2(tmp_path, capsys, flag):
    path = write_suite(tmp_path)
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    assert main(["run", str(path), flag, str(afile)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{flag}: '{afile}' is a file; expected a directory" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_a_device_this_machine_lacks_stops_run_before_work_and_warns_validate(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    cuda = write_suite(tmp_path, "budget: 1024}", "budget: 1024, device: cuda}")
    assert main(["validate", str(cuda)]) == 0  # a suite meant for a GPU machine
    captured = capsys.readouterr()
    assert "is valid" in captured.out and "warning:" in captured.err and "no CUDA GPU" in captured.err
    assert main(["run", str(cuda)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"nsa-eval: error: {cuda}: models (entry 'full' and 1 more).device: 'cuda'")
    assert len(err.splitlines()) == 1
    assert main(["run", str(write_suite(tmp_path)), "--device", "cuda"]) == 2
    assert "--device: 'cuda': no CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_report_of_a_directory_that_is_not_a_run(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "not a run directory (no run.json)" in capsys.readouterr().err


def test_a_key_given_twice_exits_2(tmp_path, capsys):
    path = write_suite(tmp_path, "    metadata:", "    metadata: {niah_depths: [0]}\n    metadata:")
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"nsa-eval: error: {path}:9: duplicate key 'metadata' (the second would silently "
                   "replace the first); keep one")


SCRATCH = """\
name: scratch
report: {committed}
defaults: {{pretrained: full-tiny, dtype: float32}}
models:
  - attention: full
tasks:
  - task: nsa_niah
    metadata: {{niah_lengths: [128], niah_depths: [0]}}
    gen_kwargs: {{max_gen_toks: 2}}
"""


def test_run_into_output_keeps_its_report_beside_the_cells(tmp_path, capsys, monkeypatch, one_torch_thread):
    """A scratch `run --output DIR` must not overwrite the suite's (committed) report; the run
    directory records DIR/report, so a later `nsa-eval report DIR` writes there too."""
    import json

    monkeypatch.chdir(tmp_path)
    committed = tmp_path / "reports" / "scratch"
    committed.mkdir(parents=True)
    (committed / "report.md").write_text("the committed report")
    path = tmp_path / "scratch.yaml"
    path.write_text(SCRATCH.format(committed=committed))
    out = tmp_path / "try"
    assert main(["run", str(path), "--output", str(out), "--limit", "1"]) == 0
    assert f"report: {out / 'report' / 'report.md'}" in capsys.readouterr().out
    assert json.loads((out / "run.json").read_text())["report"] == "report"  # relative to the run
    (out / "report" / "report.md").unlink()
    assert main(["report", str(out)]) == 0
    assert (out / "report" / "report.md").is_file()
    assert [p.name for p in committed.iterdir()] == ["report.md"]
    assert (committed / "report.md").read_text() == "the committed report"


def test_console_entry_point_exit_code(tmp_path):
    """The installed command maps a UsageError to exit code 2 (a real process, not main())."""
    path = write_suite(tmp_path, "[full, topk]", "[full, topkk]")
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-m", "nsa_eval", "validate", str(path)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "unknown attention method 'topkk'" in result.stderr
