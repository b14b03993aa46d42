"""The kernel benchmark's report (CPU): speed-ups are SDPA time / NSA time from rows of one run."""

import pytest
import torch
import triton

from nsa_eval.bench.kernels import MIN_TIMED_CALLS, Row, markdown_report, software_versions, timing_window


def test_report_ratios_g4_per_head_and_variant_line():
    T, hs, g4 = 8192, "64/4", "16/4"
    rows = [Row("fwd", "nsa-triton", T, hs, 1, 2.0), Row("fwd", "sdpa-cudnn", T, hs, 1, 3.0),
            Row("fwd", "sdpa-flash", T, hs, 1, 5.0), Row("fwd+bwd", "nsa-triton", T, hs, 1, 8.0),
            Row("fwd+bwd", "sdpa-cudnn", T, hs, 1, 4.0), Row("fwd+bwd", "sdpa-flash", T, hs, 1, 16.0),
            Row("fwd", "nsa-triton", T, g4, 1, 1.0), Row("fwd+bwd", "nsa-triton", T, g4, 1, 3.0),
            Row("fwd", "nsa-triton [selected stages=2]", T, g4, 1, 1.2),
            Row("decode", "nsa-triton", T, hs, 16, 0.05), Row("decode", "sdpa-cudnn", T, hs, 16, 0.2),
            Row("decode", "nsa-triton [tile map in tf32x3]", T, hs, 16, 0.06)]
    md = markdown_report(rows)
    assert "| 8192 | 2.00 | 3.00 | 5.00 | 1.50x | 2.50x | 8.00 | 4.00 | 16.00 | 0.50x | 2.00x |" in md
    # per query head: G=4 1.0 ms / 16 heads against G=16 2.0 ms / 64 heads -> 2x; fwd+bwd 3/16 : 8/64
    assert "| 8192 | 1.00 | 2.00 | 2.00 | 3.00 | 8.00 | 1.50 |" in md
    assert "G=4 forward at T=8192 with [selected stages=2]: 1.20 ms (the default, above: 1.00 ms)." in md
    assert "4.00x |" in md.split("Decode")[1]  # 0.2 / 0.05 against cuDNN
    assert "Decode at T=8192 with [tile map in tf32x3]: 0.060 ms (the default, above: 0.050 ms)." in md


def test_report_host_check_from_graph_replays():
    """The forwards replayed from CUDA graphs beside the eager ones, with the per-head ratio of the
    replays; no such table without graph rows."""
    T, hs, g4 = 8192, "64/4", "16/4"
    rows = [Row("fwd", "nsa-triton", T, hs, 1, 2.3), Row("fwd", "nsa-triton", T, g4, 1, 1.3),
            Row("fwd", "nsa-triton-graph", T, hs, 1, 2.3), Row("fwd", "nsa-triton-graph", T, g4, 1, 1.1)]
    md = markdown_report(rows)
    # per head, replays: 1.1 / 16 against 2.3 / 64 -> 1.91; the eager G=4 waited for the host
    assert "| 8192 | 2.30 | 2.30 | 1.30 | 1.10 | 1.91 |" in md
    assert "CUDA graph of one call" not in markdown_report(rows[:2])


def test_report_memory_floors():
    """The floors table: reads / fwd, NSA decode / its floor, SDPA cuDNN / floor (the best speed-up)."""
    T, hs = 65536, "64/4"
    rows = [Row("decode", "nsa-triton", T, hs, 16, 0.12), Row("decode", "sdpa-cudnn", T, hs, 16, 0.48),
            Row("floor", "decode: NSA bytes at HBM bandwidth", T, hs, 16, 0.04, "185 MB at 4.60 TB/s"),
            Row("floor", "selected_attention fwd", T, hs, 1, 16.0),
            Row("floor", "selected_attention fwd: its reads alone", T, hs, 1, 12.0, "137.4 GB: 11.45 TB/s")]
    md = markdown_report(rows)
    line = next(x for x in md.splitlines() if x.startswith(f"| {T} | 16.00"))
    assert line == ("| 65536 | 16.00 | 12.00 (137.4 GB: 11.45 TB/s) | 0.75 | 0.040 | 185 MB at 4.60 TB/s | "
                    "3.00 | 12.00x |")
    assert "Memory floors" not in markdown_report(rows[:2])  # no floor rows, no table


def test_report_names_the_software_it_ran_with():
    rows = [Row("fwd", "nsa-triton", 8192, "64/4", 1, 2.0)]
    versions = "NVIDIA H200, torch 2.11.0, Triton 3.8.0"
    lines = markdown_report(rows, command="nsa-eval bench kernels", versions=versions).splitlines()
    assert lines[lines.index("Command: `nsa-eval bench kernels`") + 2] == f"Ran on: {versions}"
    assert "Ran on" not in markdown_report(rows)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    assert software_versions() == f"{gpu}, torch {torch.__version__}, Triton {triton.__version__}"


def test_timing_window_times_at_least_five_calls_of_long_functions():
    # do_bench times int(rep / its estimate) calls; its estimate clears L2 first, so runs a bit longer
    for estimate in (0.05, 33.4, 110.0, 450.0):
        rep = timing_window(100, estimate)
        assert int(rep / (1.2 * estimate)) >= MIN_TIMED_CALLS
    assert timing_window(100, 0.05) == 100  # short functions keep do_bench's 100 ms window


def test_table_only_measures_the_tables_alone(monkeypatch):
    """`bench kernels --table-only` (variants=False): every row of the report's tables, for each length,
    and nothing beside them (no other settings, profiles, ops alone, selected floor). The timing
    functions need a CUDA GPU, so stand-ins return fixed times here; what is checked is which
    measurements the benchmark asks for and the report it makes of them."""
    from nsa_eval.bench import kernels as bench

    asked = []

    def stand_in(name, value):
        def measure(*args, **kwargs):
            asked.append((name, kwargs.get("variants")))
            return value
        return measure

    monkeypatch.setattr(bench, "bench_nsa_prefill", stand_in("nsa", (2.0, 8.0)))
    monkeypatch.setattr(bench, "bench_sdpa_prefill", stand_in("sdpa", (3.0, 9.0)))
    monkeypatch.setattr(bench, "bench_fla_prefill", stand_in("fla", (4.0, 10.0)))
    monkeypatch.setattr(bench, "bench_nsa_prefill_graph", stand_in("graph", 1.6))
    monkeypatch.setattr(bench, "bench_decode", stand_in("decode", {
        "nsa": 0.05, "nsa_nograph": 0.5, "flash": 0.2, "cudnn": 0.25, "floor_ms": 0.04, "nsa_bytes": 185e6,
        "hbm_tb_s": 4.6}))
    for name in ("bench_selected_floor", "_profile_decode", "profile_prefill", "bench_ops", "_g4_variants"):
        monkeypatch.setattr(bench, name, stand_in(name, None))
    rows = bench.run_kernel_benchmark([8192, 16384], fla=False, variants=False, log=lambda *a: None)
    assert {name for name, _ in asked} == {"nsa", "sdpa", "decode", "graph"}
    assert ("decode", False) in asked
    md = bench.markdown_report(rows)
    for T in (8192, 16384):
        assert f"| {T} | 2.00 | 3.00 | 3.00 | 1.50x | 1.50x | 8.00 | 9.00 | 9.00 | 1.12x | 1.12x |" in md
        assert f"| {T} | 0.050 | 0.500 | n/a | 0.200 | 0.250 | 4.00x | 5.00x |" in md
        # both forwards replayed from graphs (G=16 and G=4 each 1.6 ms): per head 4x
        assert f"| {T} | 2.00 | 1.60 | 2.00 | 1.60 | 4.00 |" in md
    assert " with [" not in md and "Where the time goes" not in md
    assert sorted({r.case for r in rows}) == ["decode", "floor", "fwd", "fwd+bwd"]


@pytest.mark.parametrize("args,message", [
    (["--lengths", "8x"], "--lengths: expected integers like 8192 or 8k, got '8x'"),
    (["--lengths", "512"], "--lengths: each length must be >= 1024, got 512"),
    (["--decode-batch", "0"], "--decode-batch must be >= 1, got 0"),
])
def test_bench_bad_input_exits_2_in_both_entry_points(args, message, capsys):
    """`nsa-eval bench kernels` and `python -m nsa_eval.commands.bench kernels` (the entry point for
    machines without lm-eval) reject bad arguments alike: one line, exit code 2, before any GPU work."""
    import subprocess
    import sys

    from nsa_eval.cli import main

    assert main(["bench", "kernels", *args]) == 2
    assert capsys.readouterr().err.strip() == f"nsa-eval: error: {message}"
    done = subprocess.run([sys.executable, "-m", "nsa_eval.commands.bench", "kernels", *args],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == f"nsa-eval: error: {message}"
