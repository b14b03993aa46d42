"""The kernel benchmark's report (CPU): speed-ups are SDPA time / NSA time from rows of one run."""

import pytest
import torch
import triton

from nsa_eval.bench.kernels import MIN_TIMED_CALLS, Row, markdown_report, software_versions, timing_window


def test_report_ratios_and_g4_per_head():
    T, hs, g4 = 8192, "64/4", "16/4"
    rows = [Row("fwd", "nsa-triton", T, hs, 1, 2.0), Row("fwd", "sdpa-cudnn", T, hs, 1, 3.0),
            Row("fwd", "sdpa-flash", T, hs, 1, 5.0), Row("fwd+bwd", "nsa-triton", T, hs, 1, 8.0),
            Row("fwd+bwd", "sdpa-cudnn", T, hs, 1, 4.0), Row("fwd+bwd", "sdpa-flash", T, hs, 1, 16.0),
            Row("fwd", "nsa-triton", T, g4, 1, 1.0), Row("fwd+bwd", "nsa-triton", T, g4, 1, 3.0),
            Row("decode", "nsa-triton", T, hs, 16, 0.05), Row("decode", "sdpa-cudnn", T, hs, 16, 0.2)]
    md = markdown_report(rows)
    assert "| 8192 | 2.00 | 3.00 | 5.00 | 1.50x | 2.50x | 8.00 | 4.00 | 16.00 | 0.50x | 2.00x |" in md
    # per query head: G=4 1.0 ms / 16 heads against G=16 2.0 ms / 64 heads -> 2x; fwd+bwd 3/16 : 8/64
    assert "| 8192 | 1.00 | 2.00 | 2.00 | 3.00 | 8.00 | 1.50 |" in md
    assert "4.00x |" in md.split("Decode")[1]  # 0.2 / 0.05 against cuDNN


def test_report_ops_alone():
    """The full benchmark's table of each op timed alone (forward, and forward+backward where it has one)."""
    T, hs = 65536, "64/4"
    rows = [Row("op-fwd", "select_blocks", T, hs, 1, 7.0),
            Row("op-fwd", "selected_attention", T, hs, 1, 13.0),
            Row("op-fwd+bwd", "selected_attention", T, hs, 1, 44.5)]
    md = markdown_report(rows)
    assert f"Where the time goes: each Triton op alone at T={T} ({hs} heads), ms." in md
    assert "| select_blocks | 7.00 | n/a |" in md and "| selected_attention | 13.00 | 44.50 |" in md


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


def stand_ins(asked: list):
    """`Timers` whose measurements record their name in `asked` and return fixed times: the timing
    functions need a CUDA GPU, so what is checked here is which measurements the benchmark asks for
    and the report it makes of them."""
    from nsa_eval.bench.kernels import Timers

    def stand_in(name, value):
        def measure(*args, **kwargs):
            asked.append(name)
            return value
        return measure

    return Timers(nsa_prefill=stand_in("nsa", (2.0, 8.0)), sdpa_prefill=stand_in("sdpa", (3.0, 9.0)),
                  fla_prefill=stand_in("fla", (4.0, 10.0)), nsa_prefill_graph=stand_in("graph", 1.6),
                  decode=stand_in("decode", {"nsa": 0.05, "nsa_nograph": 0.5, "flash": 0.2, "cudnn": 0.25}),
                  ops=stand_in("ops", {"select_blocks": (7.0, None), "selected_attention": (13.0, 44.5)}),
                  profile_prefill=stand_in("profile_prefill", None),
                  profile_decode=stand_in("profile_decode", None))


def test_table_only_measures_the_tables_alone():
    """`bench kernels --table-only`: every row of the report's tables, for each length, and nothing
    beside them (no profiles, no ops alone); without it, also the ops alone and the profiles, once, at
    the longest length."""
    from nsa_eval.bench.kernels import markdown_report, run_kernel_benchmark

    asked = []
    rows = run_kernel_benchmark([8192, 16384], fla=False, table_only=True, log=lambda *a: None,
                                timers=stand_ins(asked))
    assert set(asked) == {"nsa", "sdpa", "decode", "graph"}
    md = markdown_report(rows)
    for T in (8192, 16384):
        assert f"| {T} | 2.00 | 3.00 | 3.00 | 1.50x | 1.50x | 8.00 | 9.00 | 9.00 | 1.12x | 1.12x |" in md
        assert f"| {T} | 0.050 | 0.500 | 0.200 | 0.250 | 4.00x | 5.00x |" in md
        # both forwards replayed from graphs (G=16 and G=4 each 1.6 ms): per head 4x
        assert f"| {T} | 2.00 | 1.60 | 2.00 | 1.60 | 4.00 |" in md
    assert "Where the time goes" not in md
    assert sorted({r.case for r in rows}) == ["decode", "fwd", "fwd+bwd"]

    asked.clear()
    rows = run_kernel_benchmark([8192, 16384], fla=False, log=lambda *a: None, timers=stand_ins(asked))
    assert [name for name in asked if name in ("ops", "profile_prefill", "profile_decode")] == [
        "profile_prefill", "profile_decode", "ops"]
    ops = {(r.case, r.T) for r in rows if r.case.startswith("op-")}
    assert ops == {("op-fwd", 16384), ("op-fwd+bwd", 16384)}


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
