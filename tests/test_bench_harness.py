"""`nsa-eval bench harness` on a CPU: the tiny shape through the real lm-eval adapter; the time cap, an
out-of-memory figure, incremental rows and resuming, the throughput row and the AIME projection."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nsa_eval.bench import harness
from nsa_eval.bench.harness_run import run_harness
from nsa_eval.bench.harness_store import HarnessStore

REPO = Path(__file__).resolve().parents[1]


def tiny(**overrides) -> harness.HarnessConfig:
    settings = dict(shape=harness.SHAPES["tiny"], lengths=(160,), methods=("full",), decode_batches=(1,),
                    decode_tokens=4, repeats=2, budget=96, sink=16, local=32, device="cpu", cap_s=60.0)
    return harness.HarnessConfig(**(settings | overrides))


def loader(hooks: dict):
    """`load_lm`, then `hooks[method]` as a forward pre-hook on that method's model."""

    def load(method, checkpoint, config):
        lm = harness.load_lm(method, checkpoint, config)
        if method in hooks:
            lm.model.register_forward_pre_hook(hooks[method])
        return lm

    return load


def by_key(figures) -> dict:
    return {(f.kind, f.method, f.length, f.batch): f for f in figures}


@pytest.mark.slow
def test_harness_times_every_method_beside_full_attention(tmp_path):
    out = tmp_path / "harness"
    done = subprocess.run(
        [sys.executable, "-m", "nsa_eval.cli", "bench", "harness", "--shape", "tiny", "--lengths", "160",
         "--decode-batch", "1", "2", "--decode-tokens", "4", "--repeats", "2", "--device", "cpu",
         "--budget", "96", "--sink", "16", "--local", "32", "--throughput-tokens", "4",
         "--throughput-batch", "2", "--throughput-prompt", "16", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = list(csv.DictReader((out / "harness.csv").open()))
    assert {r["method"] for r in rows} == set(harness.METHODS)
    decode = [r for r in rows if r["kind"] == "decode"]
    assert {r["batch"] for r in decode} == {"1", "2"} and len(decode) == 2 * len(harness.METHODS)
    for r in rows:
        assert r["status"] == "ok" and float(r["ms"]) > 0 and math.isfinite(float(r["ms"])), r
    for r in decode:
        assert r["compilations"] == "0"  # no Triton on the CPU path
        assert int(r["weight_bytes"]) > 0 and int(r["kv_bytes"]) > 0 and float(r["bandwidth_gbs"]) > 0
    assert {r["method"] for r in rows if r["kind"] == "throughput"} == {"full", "nsa"}
    report = (out / "harness.md").read_text()
    assert "| full | " in report and "(1.00x; " in report and "x floor)" in report
    assert "Run " in report and ": `nsa-eval bench harness --shape tiny" in report
    assert "| aime24_16k (nsa_aime24_16k) | 30 x 16 x 16,384 |" in report  # configs/paper.yaml's entries
    progress = done.stdout.splitlines()
    assert any(line.startswith("[") and "full 160 decode, batch 2: " in line for line in progress)


def test_a_method_past_the_cap_is_reported_and_the_table_goes_on(tmp_path):
    """topk sleeps 6 s before every forward against a 5 s cap: its warm-up call (under its own, longer
    cap) finishes, its first timed call stops after the first forward, is reported past the cap, and the
    figures it decides are skipped; quest's batch-2 decode
    runs out of memory (raised as a GPU would) and its longer batch-2 figure is skipped; h2o's first
    forward raises another error, which its cell shows, and a later run measures again; everything
    else is measured."""
    from nsa_eval.methods import BudgetExceededError

    def sleep(module, args):
        time.sleep(6.0)

    def no_memory_at_batch_2(module, args):
        if args[0].shape[0] == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (the batch's cache does not fit)")

    def over_budget(module, args):
        raise BudgetExceededError("layer 0: a query attended to 40 keys, over the budget of 32 (method h2o)\n"
                                  "a second line")

    config = tiny(methods=("full", "topk", "quest", "h2o"), lengths=(160, 192), decode_batches=(1, 2),
                  cap_s=5.0)
    lines = []
    figures = by_key(run_harness(config, HarnessStore(tmp_path / "h"), log=lines.append,
                                 load=loader({"topk": sleep, "quest": no_memory_at_batch_2,
                                              "h2o": over_budget})))
    assert len(figures) == 4 * 2 * 3
    prefill = figures[("prefill", "topk", 160, 1)]
    assert prefill.status == "timeout" and prefill.ms is None
    assert 6.0 <= prefill.warmup_s < 9.0 and prefill.note == ""  # the warm-up call took its 6 s
    # the cap then stopped the first timed call at its first check past it, not after every call
    assert 12.0 <= prefill.seconds < 15.0
    for key in [("decode", "topk", 160, 1), ("decode", "topk", 160, 2), ("prefill", "topk", 192, 1),
                ("decode", "topk", 192, 1), ("decode", "topk", 192, 2)]:
        assert figures[key].status == "skipped", key
    assert figures[("prefill", "topk", 192, 1)].note == "the batch-1 prefill ran past the cap at 160"
    assert figures[("decode", "quest", 160, 2)].status == "OOM"
    assert figures[("decode", "quest", 192, 2)].note == "batch 2 ran out of memory at 160"
    measured = [f for f in figures.values() if f.method == "full" or (f.method == "quest" and f.batch == 1)]
    assert len(measured) == 10 and all(f.status == "ok" and f.ms > 0 for f in measured)
    report = (tmp_path / "h" / "harness.md").read_text()
    assert "| topk | > 5 s cap | skipped |" in report  # prefill: past the cap at 160, skipped at 192
    assert "| quest | OOM | skipped |" in report.split("Decode per token, batch 2")[1]
    assert "- topk decode at 160, batch 1: skipped, the batch-1 prefill ran past the cap at 160" in report
    assert any(line.startswith("[") and "topk 160 prefill, batch 1: timeout" in line for line in lines)
    error = figures[("prefill", "h2o", 160, 1)]
    assert error.status == "error" and error.ms is None and not error.settled(5.0)
    assert error.note == "BudgetExceededError: layer 0: a query attended to 40 keys, over the budget of 32 " \
                         "(method h2o)"
    assert figures[("prefill", "h2o", 192, 1)].note == "the batch-1 prefill failed at 160"
    assert "| h2o | error | skipped |" in report
    assert "- h2o prefill at 160, batch 1: error, BudgetExceededError: layer 0: a query" in report


def test_a_slow_warm_up_is_not_the_figure_and_has_its_own_cap(tmp_path):
    """A first forward that takes 6 s (a compile at a new length) against a 5 s cap: under a 30 s warm-up
    cap the figure is measured from the calls after it; under a 5 s one it is reported as a warm-up past
    its cap, and said so under the table."""
    first = {}

    def compiles_once(module, args):
        if not first:
            time.sleep(6.0)
            first["done"] = True

    config = tiny(methods=("full", "topk"), decode_batches=(1,), cap_s=5.0, warmup_cap_s=30.0)
    figures = by_key(run_harness(config, HarnessStore(tmp_path / "a"), log=lambda line: None,
                                 load=loader({"topk": compiles_once})))
    prefill = figures[("prefill", "topk", 160, 1)]
    assert prefill.status == "ok" and prefill.ms < 5000 and prefill.warmup_s >= 6.0, prefill
    assert figures[("decode", "topk", 160, 1)].status == "ok"
    report = (tmp_path / "a" / "harness.md").read_text()
    assert "cap 5 s per figure after a warm-up of up to 30 s" in report

    first.clear()
    config = tiny(methods=("topk",), decode_batches=(1,), cap_s=5.0, warmup_cap_s=5.0)
    figures = by_key(run_harness(config, HarnessStore(tmp_path / "b"), log=lambda line: None,
                                 load=loader({"topk": compiles_once})))
    prefill = figures[("prefill", "topk", 160, 1)]
    assert prefill.status == "timeout" and prefill.warmup_s is None
    assert prefill.note == "its warm-up ran past 5 s"
    report = (tmp_path / "b" / "harness.md").read_text()
    assert "| topk | warm-up past its cap |" in report
    assert "- topk prefill at 160, batch 1: timeout, its warm-up ran past 5 s" in report


def test_results_from_before_a_new_column_are_kept(tmp_path):
    """A harness.csv written before `warmup_s` existed: its figures are read and kept, and the file is
    rewritten with the new header so the next rows line up."""
    config = tiny()
    store = HarnessStore(tmp_path / "h")
    run_harness(config, store, log=lambda line: None)
    rows = list(csv.DictReader(store.csv_path.open()))
    old = [name for name in rows[0] if name != "warmup_s"]
    with store.csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, old, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    lines = []
    again = run_harness(config, HarnessStore(tmp_path / "h"), log=lines.append)
    assert len(again) == len(rows) and all(f.status == "ok" for f in again)
    assert any("figures kept from earlier runs" in line for line in lines)
    assert not any(" prefill, batch 1 ..." in line for line in lines)  # nothing measured again
    assert next(csv.reader(store.csv_path.open())) == list(rows[0])


class KilledAfter(HarnessStore):
    """The store of a run killed right after its `rows`-th row reached the disk."""

    def __init__(self, folder, rows: int):
        super().__init__(folder)
        self.rows = rows

    def append(self, figure):
        super().append(figure)
        self.rows -= 1
        if self.rows == 0:
            raise KeyboardInterrupt


def test_rows_are_written_as_they_finish_and_a_second_run_adds_only_the_missing(tmp_path):
    config = tiny(lengths=(160, 192))
    folder = tmp_path / "h"
    with pytest.raises(KeyboardInterrupt):
        run_harness(config, KilledAfter(folder, 3), log=lambda line: None)
    store = HarnessStore(folder)
    kept = store.figures()
    assert [(f.kind, f.length) for f in kept] == [("prefill", 160), ("decode", 160), ("prefill", 192)]
    assert "| full | " in store.md_path.read_text()  # the report of what finished
    with store.csv_path.open("a") as f:
        f.write("decode,full,192,1,ok,1.")  # and a row cut off mid-write by the kill

    loads, lines = [], []

    def counting_load(method, checkpoint, config):
        loads.append(method)
        return harness.load_lm(method, checkpoint, config)

    figures = run_harness(config, store, log=lines.append, load=counting_load)
    assert loads == ["full"] and sum(line.endswith(" ...") for line in lines) == 1  # only the 192 decode
    assert sorted((f.kind, f.length) for f in figures) == [
        ("decode", 160), ("decode", 192), ("prefill", 160), ("prefill", 192)]
    assert [f.ms for f in figures[:3]] == [f.ms for f in kept]  # the first run's rows, unchanged
    assert len(store.figures()) == 4 and len(json.loads(store.json_path.read_text())["runs"]) == 2

    loads.clear()
    run_harness(config, store, log=lambda line: None, load=counting_load)
    assert loads == []  # every figure settled: no model loads


def test_throughput_row_and_aime_projection_on_a_tiny_suite(tmp_path, monkeypatch):
    """Sampled generation at batch 2 for full and nsa; nsa sleeps past the cap mid-generation and keeps
    the rate of the tokens it made. The projection multiplies the suite's problems x samples x
    max_gen_toks by each rate."""
    from nsa_eval.commands.bench import aime_entries

    suite = tmp_path / "suite.yaml"
    suite.write_text("name: tiny-aime\noutput: runs/tiny\n"
                     "models:\n  - {label: NSA, pretrained: nsa-tiny, attention: nsa}\n"
                     "tasks:\n  - {task: nsa_aime24_8k, label: a8, limit: 5}\n"
                     "  - {task: nsa_aime24_16k, label: a16, gen_kwargs: {max_gen_toks: 1000}}\n"
                     "  - {task: nsa_gsm8k, label: gsm}\n")
    data = tmp_path / "data" / "Maxwell-Jia__AIME_2024" / "default"
    data.mkdir(parents=True)
    rows = [{"ID": i, "Problem": "p", "Solution": "s", "Answer": 1} for i in range(7)]
    (data / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    monkeypatch.setenv("NSA_EVAL_DATA", str(tmp_path / "data"))
    entries = aime_entries(str(suite))
    assert [(e.label, e.problems, e.samples, e.max_gen_toks, e.problems_from) for e in entries] == [
        ("a8", 5, 16, 8192, "limit"), ("a16", 7, 16, 1000, "data")]
    monkeypatch.setenv("NSA_EVAL_DATA", str(tmp_path / "nothing"))
    assert [e.problems_from for e in aime_entries(str(suite))] == ["limit", "AIME 2024"]

    config = tiny(methods=("full", "nsa"), lengths=(), throughput_tokens=12, throughput_batch=2,
                  throughput_prompt=16, throughput_cap_s=8.0)
    figures = run_harness(config, HarnessStore(tmp_path / "h"), aime=entries, log=lambda line: None,
                                  load=loader({"nsa": lambda module, args: time.sleep(0.8)}))
    full, nsa = sorted(figures, key=lambda f: f.method)
    assert (full.kind, full.status, full.batch, full.new_tokens) == ("throughput", "ok", 2, 12)
    assert full.tokens_per_s == pytest.approx(2 * 1000 / full.ms)  # 2 sequences, one token each per step
    assert nsa.status == "timeout" and nsa.note.startswith("over the first ")
    made = int(nsa.note.split()[3])
    assert 1 <= made < 12 and nsa.tokens_per_s == pytest.approx(2 * 1000 / nsa.ms)
    report = (tmp_path / "h" / "harness.md").read_text()
    for e, size in zip(entries, ("5 x 16 x 8,192", "7 x 16 x 1,000"), strict=True):
        full_h, nsa_h = (e.tokens / f.tokens_per_s / 3600 for f in (full, nsa))
        assert f"| {e.label} ({e.task}) | {size} | {full_h:.2f} | >= {nsa_h:.2f} |" in report
    assert "Problem counts from: data, limit" in report


@pytest.mark.parametrize("args, message", [
    (["--shape", "huge"], "--shape: expected one of"),
    (["--methods", "full", "flash"], "--methods: unknown flash"),
    (["--methods", "topk"], "include full"),
    (["--budget", "100", "--sink", "64", "--local", "64"], "below --sink + --local"),
    (["--decode-batch", "0"], "--decode-batch must be >= 1"),
    (["--lengths", "12"], "each length must be >= 64"),
    (["--device", "tpu"], "--device: expected cpu or cuda"),
    (["--cap", "0"], "--cap must be > 0 seconds"),
    (["--throughput-tokens", "-1"], "--throughput-tokens must be >= 0"),
    (["--throughput-tokens", "8", "--suite", "missing.yaml"], "--suite: 'missing.yaml' is not a file"),
])
def test_harness_refuses_bad_arguments_before_building_models(args, message, tmp_path):
    done = subprocess.run([sys.executable, "-m", "nsa_eval.cli", "bench", "harness", "--device", "cpu",
                           "--out", str(tmp_path / "h"), *args], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert done.returncode == 2
    assert message in done.stderr
    assert not (tmp_path / "h").exists()


def test_harness_refuses_a_folder_of_other_settings(tmp_path):
    """Rows of another budget would not compare: refused before any model loads, and the folder is left
    as it was."""
    store = HarnessStore(tmp_path / "h")
    store.open(tiny(budget=128).settings(), run={})
    before = store.json_path.read_text()
    done = subprocess.run([sys.executable, "-m", "nsa_eval.cli", "bench", "harness", "--device", "cpu",
                           "--shape", "tiny", "--budget", "96", "--sink", "16", "--local", "32",
                           "--decode-tokens", "4", "--repeats", "2", "--out", str(tmp_path / "h")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "holds harness results of other settings (budget 128 -> 96)" in done.stderr
    assert store.json_path.read_text() == before


def test_decode_figures_from_a_static_cache(tmp_path):
    """With static decoding on (as the adapter turns it on for a GPU; on the CPU its steps run eagerly), the
    prefill fills a `StaticDecodeCache` with room for every step and replay, and the decode figures run
    from it: the last figure's cache took the warm-up and every timed step."""
    from nsa_eval.models.hf_decode_graph import enable_decode_graphs

    models = []

    def load(method, checkpoint, config):
        lm = harness.load_lm(method, checkpoint, config)
        enable_decode_graphs(lm.model)
        models.append(lm.model)
        return lm

    store = HarnessStore(tmp_path / "harness")
    figures = by_key(run_harness(tiny(methods=("quest",), decode_batches=(1, 2)), store, load=load,
                                 log=lambda line: None))
    assert [f.status for f in figures.values()] == ["ok"] * 3
    assert figures[("decode", "quest", 160, 2)].gpu_ms is None  # no graph on the CPU
    counts = models[0]._nsa_eval_controller._static_counts[-1]
    assert counts.rows == [160, 160] and counts.steps == harness.WARM_UP_STEPS + 2 * 4


def test_the_dense_h2o_row_holds_only_decode_steps_to_the_budget(tmp_path):
    """`h2o_dense` is h2o with `sparse_prefill: false` (a dense prompt, then eviction); `h2o` holds every
    query: its prompt attends to at most the budget's keys, the dense one's to every earlier key."""
    config = tiny()
    checkpoint = harness.write_checkpoint("llama", config.shape, tmp_path, config.max_length, torch.float32,
                                          "cpu")
    attended = {}
    for method in ("h2o", "h2o_dense"):
        lm = harness.load_lm(method, checkpoint, config)
        controller = lm.model._nsa_eval_controller
        assert controller.method.name == "h2o"
        assert controller.config.sparse_prefill is (method == "h2o")
        with torch.no_grad():
            lm.model(torch.randint(3, 1000, (1, 160)))
        attended[method] = controller.stats.summary()["max"]
    assert attended["h2o"] <= config.budget < attended["h2o_dense"]


def test_an_nsa_step_weighs_its_two_graphs_as_a_decode_meets_them():
    """An NSA cache replays a graph for the steps that complete a compressed block and one for the rest;
    the harness's GPU time of a step is their mean over `stride` steps, one of which completes a block,
    and each decode figure leaves room for both graphs' replays."""
    assert harness.mean_step_ms({True: 5.0, False: 1.0}, 16) == pytest.approx((5.0 + 15 * 1.0) / 16)
    assert harness.mean_step_ms({False: 1.5}, 16) == 1.5
    config = tiny()
    steps = config.repeats * config.decode_tokens
    room = harness.decode_room(config)
    assert room == harness.WARM_UP_STEPS + steps + harness.NSA_STRIDE + 2 * (steps + 1)
    assert config.max_length >= max(config.lengths) + room
    from nsa_eval.models.configuration_nsa import NSAConfig

    assert harness.NSA_STRIDE == NSAConfig().stride  # the stride of the NSA checkpoint the harness writes
    assert config.settings()["nsa_gpu_step"] == harness.NSA_GPU_STEP  # older figures are not mixed in
