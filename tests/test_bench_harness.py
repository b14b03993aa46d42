"""`nsa-eval bench harness` on a CPU: the tiny shape, every row, through the real lm-eval adapter."""

from __future__ import annotations

import csv
import math
import subprocess
import sys

import pytest

from nsa_eval.bench import harness


@pytest.mark.slow
def test_harness_times_every_method_beside_full_attention(tmp_path):
    out = tmp_path / "harness"
    done = subprocess.run(
        [sys.executable, "-m", "nsa_eval.cli", "bench", "harness", "--shape", "tiny", "--lengths", "160",
         "--decode-batch", "1", "2", "--decode-tokens", "8", "--repeats", "3", "--device", "cpu",
         "--budget", "96", "--sink", "16", "--local", "32", "--out", str(out)],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = list(csv.DictReader((out / "harness.csv").open()))
    assert {r["method"] for r in rows} == set(harness.METHODS)
    assert {r["decode_batch"] for r in rows} == {"1", "2"}
    for r in rows:
        # decode is a difference of two timed generations: on a busy CPU noise may outweigh 8 tiny steps
        assert float(r["prefill_ms"]) > 0 and math.isfinite(float(r["decode_ms_per_token"])), r
        assert r["compilations"] == "0"  # no Triton on the CPU path
    report = (out / "harness.md").read_text()
    assert "| full | " in report and "(1.00x)" in report
    assert "Command: `nsa-eval bench harness --shape tiny" in report


@pytest.mark.parametrize("args, message", [
    (["--shape", "huge"], "--shape: expected one of"),
    (["--methods", "full", "flash"], "--methods: unknown flash"),
    (["--methods", "topk"], "include full"),
    (["--budget", "100", "--sink", "64", "--local", "64"], "below --sink + --local"),
    (["--decode-batch", "0"], "--decode-batch must be >= 1"),
    (["--lengths", "12"], "each length must be >= 64"),
    (["--device", "tpu"], "--device: expected cpu or cuda"),
])
def test_harness_refuses_bad_arguments_before_building_models(args, message, tmp_path):
    done = subprocess.run([sys.executable, "-m", "nsa_eval.cli", "bench", "harness", "--device", "cpu",
                           "--out", str(tmp_path / "h"), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert message in done.stderr
    assert not (tmp_path / "h").exists()


def test_report_shows_nsa_gpu_step_and_first_step():
    rows = [harness.Measurement("full", 8192, prefill_ms=50.0, decode_ms={1: 20.0}),
            harness.Measurement("nsa", 8192, prefill_ms=40.0, decode_ms={1: 6.0}, decode_gpu_ms={1: 4.0},
                                first_step_ms=120.0)]
    report = harness.markdown_report(rows, shape=harness.SHAPES["tiny"], budget=96, sink=16, local=32)
    assert "| 1 | 4.00 (1.50x) |" in report  # the wall time per token is 1.5x the GPU's step
    assert "first decode step at batch 1 (eager, then captured): 120.0 ms at 8192" in report
