"""The kernel benchmark's report (CPU): speed-ups are SDPA time / NSA time from rows of one run."""

import pytest
import torch
import triton

from nsa_eval.bench.kernels import MIN_TIMED_CALLS, Row, markdown_report, software_versions, timing_window
from nsa_eval.errors import UsageError


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


# ---- the harness's report and its memory floor (nsa_eval/bench/harness_report.py, floor.py)

LLAMA_1B = dict(layers=16, kv_heads=8, key_dim=64, value_dim=64, itemsize=2)  # bf16
PAPER_NSA = dict(block_len=32, stride=16, select_size=64, num_selected=16, window=512)


def test_decode_reads_per_method_by_hand():
    """Keys and values per layer and KV head at 8k with the paper's budget 2,560 = 128 + 512 + 1,920."""
    from nsa_eval.bench.floor import NSAReads, read_rows

    kw = dict(budget=2560, sink=128, local=512, page_size=16, nsa=NSAReads(**PAPER_NSA))
    assert read_rows("full", 8192, **kw) == (8192, 8192)
    assert read_rows("transformers", 8192, **kw) == (8192, 8192)
    assert read_rows("sink_window", 8192, **kw) == (640, 640)
    assert read_rows("h2o", 8192, **kw) == (2560, 2560)
    assert read_rows("topk", 8192, **kw) == (8192, 2560)  # scores every key, reads the kept values
    assert read_rows("quest", 8192, **kw) == (2560 + 2 * 512, 2560)  # + each page's key minima and maxima
    # compressed (8192 - 32) // 16 + 1 = 511, selected 16 x 64 = 1,024, window 512
    assert read_rows("nsa", 8192, **kw) == (2047, 2047)
    # a prompt shorter than every budget reads what there is
    assert read_rows("quest", 100, **kw) == (100 + 2 * 7, 100)
    assert read_rows("nsa", 100, **kw) == (5 + 100 + 100, 5 + 100 + 100)  # (100 - 32) // 16 + 1 blocks


def test_floor_arithmetic_of_issue_58():
    """Llama-3.2-1B's shape in bf16 at 64k: full attention reads 2.1 GB per sequence, NSA about a
    twelfth; with 2.47 GB of weights the floor puts NSA at 0.58x full attention at batch 1, 0.15x at 16."""
    from nsa_eval.bench.floor import KVLayout, NSAReads, floor_ms, read_rows

    layout = KVLayout(**LLAMA_1B)
    kw = dict(budget=2560, sink=128, local=512, nsa=NSAReads(**PAPER_NSA))
    full = layout.bytes(read_rows("full", 65536, **kw))
    nsa = layout.bytes(read_rows("nsa", 65536, **kw))
    assert full == 16 * 8 * 65536 * (64 + 64) * 2 == 2_147_483_648
    assert nsa == 16 * 8 * (4095 + 1024 + 512) * (64 + 64) * 2 == 184_516_608
    weights = 1_235_814_400 * 2  # Llama-3.2-1B's parameters (embedding tied to the output head)
    assert floor_ms(weights, full, 1, 3000) == pytest.approx((weights + full) / 3e12 * 1e3)
    assert floor_ms(weights, full, 16, 3000) == pytest.approx((weights + 16 * full) / 3e12 * 1e3)
    ratios = [floor_ms(weights, nsa, b, 3000) / floor_ms(weights, full, b, 3000) for b in (1, 16)]
    assert [round(r, 2) for r in ratios] == [0.58, 0.15]


def test_floor_inputs_from_a_loaded_model():
    """Weights in their dtype (the tied embedding once) and the cached token's layout, read off the
    tiny random models the harness builds."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from nsa_eval.bench.floor import KVLayout, NSAReads, layout_of, nsa_reads_of, weight_bytes
    from nsa_eval.models.configuration_nsa import NSAConfig
    from nsa_eval.models.modeling_nsa import NSAForCausalLM

    C, H, Hkv, D, F, V, L = 64, 4, 2, 16, 128, 512, 2
    common = dict(vocab_size=V, hidden_size=C, intermediate_size=F, num_hidden_layers=L,
                  num_attention_heads=H, num_key_value_heads=Hkv, head_dim=D, tie_word_embeddings=True)
    llama = LlamaForCausalLM(LlamaConfig(**common)).to(torch.bfloat16)
    per_layer = C * H * D + 2 * C * Hkv * D + H * D * C + 3 * C * F + 2 * C  # q, k+v, o, MLP, two norms
    assert weight_bytes(llama) == 2 * (V * C + L * per_layer + C)
    assert layout_of(llama) == KVLayout(layers=L, kv_heads=Hkv, key_dim=D, value_dim=D, itemsize=2)
    nsa = NSAForCausalLM(NSAConfig(**common))
    assert weight_bytes(nsa) == 4 * sum(p.numel() for p in nsa.parameters())  # float32
    assert nsa_reads_of(nsa) == NSAReads(**PAPER_NSA)


def _figures():
    from nsa_eval.bench.harness_store import Figure

    floor = dict(weight_bytes=2_000_000_000, bandwidth_gbs=2000.0)  # 1 ms of weights
    return [
        Figure("prefill", "full", 8192, 1, ms=50.0, calls=3, cache_gib=0.25, peak_gib=1.0),
        Figure("prefill", "nsa", 8192, 1, ms=40.0, calls=3, cache_gib=0.5, peak_gib=1.5),
        Figure("prefill", "topk", 8192, 1, status="timeout", cap_s=60.0),
        # full: 1 GB of keys and values per sequence -> floor 1.5 ms at batch 1, 9 ms at batch 16
        Figure("decode", "full", 8192, 1, ms=6.0, calls=3, kv_bytes=1_000_000_000, **floor),
        Figure("decode", "full", 8192, 16, status="OOM", kv_bytes=1_000_000_000, **floor),
        # nsa: 0.1 GB -> floor 1.05 ms at batch 1, 1.8 ms at batch 16
        Figure("decode", "nsa", 8192, 1, ms=4.2, calls=3, kv_bytes=100_000_000, gpu_ms=3.0,
               first_step_ms=90.0, **floor),
        Figure("decode", "nsa", 8192, 16, ms=9.0, calls=3, kv_bytes=100_000_000, **floor),
        Figure("decode", "topk", 8192, 1, status="skipped",
               note="the batch-1 prefill ran past the cap at 8192"),
    ]


def test_harness_report_decode_against_full_and_the_floor():
    from nsa_eval.bench.harness_report import markdown_report

    info = {"settings": {"budget": 2560, "sink": 128, "local": 512, "repeats": 3, "decode_tokens": 16},
            "runs": [{"started": "2026-12-06 10:00:00", "command": "nsa-eval bench harness",
                      "versions": "NVIDIA H100 80GB HBM3, torch 2.11.0, Triton 3.6.0",
                      "bandwidth_gbs": 2000.0, "copy_mib": 1024, "cap_s": 60.0}]}
    md = markdown_report(_figures(), info)
    batch1 = md.split("## Decode per token, batch 1")[1].split("##")[0]
    assert "| full | 6.00 (1.00x; 4.0x floor) |" in batch1  # 6 ms against a 1.5 ms floor
    assert "| nsa | 4.20 (0.70x; 4.0x floor) |" in batch1  # 4.2 ms against 1.05 ms
    assert "| topk | skipped |" in batch1
    batch16 = md.split("## Decode per token, batch 16")[1].split("##")[0]
    assert "| full | OOM |" in batch16 and "| nsa | 9.00 (5.0x floor) |" in batch16
    assert "| full | 16 | 9.00 |" in md and "| nsa | 1 | 1.05 |" in md  # the floor table
    # NSA over full, side by side: measured 0.70x at batch 1 (floor 1.05 / 1.5), full out of memory at 16
    assert "| 1 | 0.70x (floor 0.70x) |" in md
    assert "| 16 | nsa 9.00, full OOM (floor 0.20x) |" in md
    assert "| topk | > 60 s cap |" in md.split("## Prefill")[1]
    assert "| nsa | 1 | 3.00 (1.40x) |" in md  # NSA's wall time per token is 1.4x its graph's GPU step
    assert "First decode step after the prefill at batch 1 (eager, then captured): nsa 90.0 ms at 8192" in md
    assert "| nsa | 0.50 (2.00x) |" in md.split("## Cache after the prefill")[1]
    assert "- topk decode at 8192, batch 1: skipped, the batch-1 prefill ran past the cap at 8192" in md
    assert "ran on NVIDIA H100 80GB HBM3, torch 2.11.0, Triton 3.6.0; copy bandwidth 2,000 GB/s" in md


def test_harness_store_keeps_the_latest_row_of_each_figure(tmp_path):
    from nsa_eval.bench.harness_store import Figure, HarnessStore

    store = HarnessStore(tmp_path / "h")
    assert store.open({"budget": 1}, run={"command": "a"}) == []
    first, *rest = _figures()
    for figure in (first, *rest):
        store.append(figure)
    again = Figure("prefill", "full", 8192, 1, ms=51.0, calls=3)
    store.append(again)
    figures = store.figures()
    assert figures == [again, *rest]  # parsed back to the same values, the later row in the first's place
    assert store.open({"budget": 1}, run={"command": "b"}) == figures
    with pytest.raises(UsageError, match=r"other settings \(budget 1 -> 2\)"):
        store.open({"budget": 2}, run={})
    assert store.open({"budget": 2}, run={}, fresh=True) == []
    assert not store.md_path.exists()
