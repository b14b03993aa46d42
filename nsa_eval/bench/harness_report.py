"""harness.md: the harness's tables, rebuilt from harness.json and harness.csv alone (harness_store.py).

Every cell is one figure: its value, its ratio to `full` at the same length and batch, and for decode
its multiple of the memory floor (floor.py); a figure that did not finish shows why ("> cap", "OOM",
"skipped", with the reasons listed under the tables).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from nsa_eval.bench.harness import METHODS as METHOD_ORDER
from nsa_eval.bench.harness_store import Figure, HarnessStore, write_atomic


def write_report(store: HarnessStore, figures: list[Figure]) -> Path:
    write_atomic(store.md_path, markdown_report(figures, store.read_json()))
    return store.md_path


def _length_label(t: int) -> str:
    return f"{t // 1024}k" if t % 1024 == 0 else str(t)


def _cell(figure: Figure | None, value: float | None) -> str | None:
    """The text of a figure that has no value to show, or None when `value` is to be shown."""
    if figure is None:
        return ""
    if figure.status == "OOM":
        return "OOM"
    if figure.status in ("skipped", "error"):
        return figure.status
    if value is None:
        if figure.status != "timeout":
            return ""
        in_warm_up = figure.warmup_s is None and figure.note
        return "warm-up past its cap" if in_warm_up else f"> {figure.cap_s:g} s cap"
    return None


def _text(figure: Figure, value: float | None, digits: int) -> str:
    text = _cell(figure, value)
    return f"{value:.{digits}f}" if text is None else text or "-"


class _Tables:
    """The decode and prefill figures indexed by (kind, method, length, batch)."""

    def __init__(self, figures: list[Figure]):
        self.by_key = {(f.kind, f.method, f.length, f.batch): f for f in figures if f.kind != "throughput"}
        self.lengths = sorted({f.length for f in figures if f.kind != "throughput"})
        self.batches = sorted({f.batch for f in figures if f.kind == "decode"})
        self.methods = [m for m in METHOD_ORDER if any(f.method == m for f in figures)]
        self.header = "| method | " + " | ".join(_length_label(t) for t in self.lengths) + " |"
        self.rule = "|---" * (len(self.lengths) + 1) + "|"

    def get(self, kind: str, method: str, length: int, batch: int) -> Figure | None:
        return self.by_key.get((kind, method, length, batch))

    def table(self, title: str, kind: str, batch: int, value: Callable[[Figure], float | None], digits: int,
              extra: Callable[[Figure, Figure | None], str] | None = None) -> list[str]:
        """A method x length table of `value`, each cell with its ratio to `full` (and `extra`); none
        where no figure has a value or a status to show (memory on a CPU)."""
        lines, shown = [f"## {title}", "", self.header, self.rule], False
        for method in self.methods:
            cells = []
            for t in self.lengths:
                figure, full = self.get(kind, method, t, batch), self.get(kind, "full", t, batch)
                v = value(figure) if figure is not None else None
                text = _cell(figure, v)
                if text is None:
                    base = value(full) if full is not None else None
                    notes = [f"{v / base:.2f}x"] if base else []
                    if extra is not None:
                        notes += [e for e in [extra(figure, full)] if e]
                    text = f"{v:.{digits}f}" + (f" ({'; '.join(notes)})" if notes else "")
                cells.append(text)
                shown = shown or bool(text)
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        return lines + [""] if shown else []


def _floor_multiple(figure: Figure, full: Figure | None) -> str:
    floor_ms = figure.floor_ms
    return f"{figure.ms / floor_ms:.1f}x floor" if floor_ms and figure.ms is not None else ""


def markdown_report(figures: list[Figure], info: dict) -> str:
    """The tables of `figures`; `info` is harness.json (settings, runs, AIME entries)."""
    settings, runs = info.get("settings", {}), info.get("runs", [])
    shape = settings.get("shape", {})
    budget, sink, local = settings.get("budget"), settings.get("sink"), settings.get("local")
    tables = _Tables(figures)
    lines = [
        "# Harness benchmark: whole models, every attention method",
        "",
        f"Random models of shape {json.dumps(shape)} in {settings.get('dtype')} on {settings.get('device')}; "
        f"budget {budget} = {sink} sink + {local} local + {budget - sink - local if budget else '?'} chosen "
        "for the baselines; NSA at the paper's l = 32, d = 16, l' = 64, n = 16, w = 512. Ratios in brackets "
        "are to `full` at the same length and batch, in the same folder of results.",
        "",
        "- Prefill: the model's forward over the prompt, filling its cache, batch 1; median of the timed "
        "calls after one warm-up call.",
        f"- Decode: wall time per token from a cache filled once, median of up to {settings.get('repeats')} "
        f"rounds of {settings.get('decode_tokens')} steps (the model's forward of one token and the next "
        "token's argmax, without generate()'s own per-token work), after two warm-up steps.",
        "- Floor: the time to read the weights once and, per sequence, the keys and values the step reads "
        "(nsa_eval/bench/floor.py gives each method's rule), at the copy bandwidth measured in the run; "
        "each decode figure is shown as a multiple of it.",
        "- Memory: GiB above the weights; the cache is what the prefill leaves allocated.",
        "- `> N s cap`: the figure's timed part ran past its time cap, which starts after its warm-up (the "
        "first prefill call, or a decode figure's prefill and warm-up steps: compiling and autotuning at a "
        "new length), whose own cap is longer; `warm-up past its cap`: that one ran out; `OOM`: out of GPU "
        "memory; `error`: it raised another error; `skipped`: not run; the errors and the reasons are listed "
        "under the tables.",
        "",
    ]
    for run in runs:
        lines.append(f"Run {run.get('started')}: `{run.get('command') or 'run_harness'}`; ran on "
                     f"{run.get('versions')}; copy bandwidth {run.get('bandwidth_gbs', 0):,.0f} GB/s "
                     f"({run.get('copy_mib', 0):,.0f} MiB); cap {run.get('cap_s'):g} s per figure"
                     + (f" after a warm-up of up to {run['warmup_cap_s']:g} s" if "warmup_cap_s" in run
                        else "")
                     + (f", {run['throughput_cap_s']:g} s per throughput figure" if "throughput_cap_s" in run
                        else "") + ".")
        lines.append("")
    if tables.lengths:
        lines += tables.table("Prefill, batch 1 (ms)", "prefill", 1, lambda f: f.ms, 1)
        for b in tables.batches:
            lines += tables.table(f"Decode per token, batch {b} (ms; ratio to full; multiple of the floor)",
                                  "decode", b, lambda f: f.ms, 2, extra=_floor_multiple)
        lines += _floor_tables(tables)
        lines += _nsa_against_full(tables)
        lines += _gpu_step(tables)
        lines += tables.table("Cache after the prefill, batch 1 (GiB)", "prefill", 1,
                              lambda f: f.cache_gib, 2)
        lines += tables.table("Peak memory, batch-1 prefill (GiB)", "prefill", 1, lambda f: f.peak_gib, 2)
        for b in tables.batches:
            lines += tables.table(f"Peak memory, batch {b}: its prefill and decode (GiB)", "decode", b,
                                  lambda f: f.peak_gib, 2)
        lines += _compilations(tables)
    lines += _throughput(figures, info.get("aime"))
    skipped = [f for f in figures if f.status in ("skipped", "error") or (f.status == "timeout" and f.note)]
    if skipped:
        lines += ["Figures not measured in full:", ""]
        lines += [f"- {f.method} {f.kind} at {f.length}, batch {f.batch}: {f.status}, {f.note}"
                  for f in skipped]
        lines.append("")
    return "\n".join(lines)


def _floor_tables(tables: _Tables) -> list[str]:
    lines = ["## Decode floor (ms): the weights and the keys and values one step reads", "",
             "| method | batch | " + " | ".join(_length_label(t) for t in tables.lengths) + " |",
             "|---" * (len(tables.lengths) + 2) + "|"]
    for method in tables.methods:
        for b in tables.batches:
            cells = [tables.get("decode", method, t, b) for t in tables.lengths]
            values = [None if f is None else f.floor_ms for f in cells]
            if any(v is not None for v in values):
                text = " | ".join("" if v is None else f"{v:.2f}" for v in values)
                lines.append(f"| {method} | {b} | {text} |")
    return lines + [""]


def _nsa_against_full(tables: _Tables) -> list[str]:
    """NSA's decode over full attention's, measured and at the floor, every batch side by side."""
    if "nsa" not in tables.methods or "full" not in tables.methods:
        return []
    lines = ["## NSA / full attention, decode: measured (at the floor)", "",
             "| batch | " + " | ".join(_length_label(t) for t in tables.lengths) + " |",
             "|---" * (len(tables.lengths) + 1) + "|"]
    for b in tables.batches:
        cells = []
        for t in tables.lengths:
            nsa, full = tables.get("decode", "nsa", t, b), tables.get("decode", "full", t, b)
            if nsa is None or full is None:
                cells.append("")
                continue
            measured = (f"{nsa.ms / full.ms:.2f}x" if nsa.ms is not None and full.ms is not None
                        else f"nsa {_text(nsa, nsa.ms, 2)}, full {_text(full, full.ms, 2)}")
            if nsa.floor_ms and full.floor_ms:
                measured += f" (floor {nsa.floor_ms / full.floor_ms:.2f}x)"
            cells.append(measured)
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return lines + [""]


def _gpu_step(tables: _Tables) -> list[str]:
    """Each method's decode step from its CUDA graph: GPU ms per step and the wall time's multiple of it."""
    rows = [(m, b, [tables.get("decode", m, t, b) for t in tables.lengths])
            for m in tables.methods for b in tables.batches]
    rows = [row for row in rows if any(f is not None and f.gpu_ms is not None for f in row[2])]
    if not rows:
        return []
    lines = ["## Decode: GPU time per step (graph replays) and the wall time's multiple of it", "",
             "| method | batch | " + " | ".join(_length_label(t) for t in tables.lengths) + " |",
             "|---" * (len(tables.lengths) + 2) + "|"]
    for m, b, cells in rows:
        text = " | ".join("" if f is None or f.gpu_ms is None or f.ms is None
                          else f"{f.gpu_ms:.2f} ({f.ms / f.gpu_ms:.2f}x)" for f in cells)
        lines.append(f"| {m} | {b} | {text} |")
    firsts = []
    for m in dict.fromkeys(m for m, _, _ in rows):
        found = [(t, tables.get("decode", m, t, 1)) for t in tables.lengths]
        found = ", ".join(f"{f.first_step_ms:.1f} ms at {t}" for t, f in found
                          if f is not None and f.first_step_ms is not None)
        if found:
            firsts.append(f"{m} {found}")
    if firsts:
        lines += ["", f"First decode step after the prefill at batch 1 (eager, then captured): "
                  f"{'; '.join(firsts)}."]
    return lines + [""]


def _compilations(tables: _Tables) -> list[str]:
    lines = ["## Triton compilations during the timed decode (batch " + " / ".join(map(str, tables.batches))
             + ")", "", tables.header, tables.rule]
    for method in tables.methods:
        cells = []
        for t in tables.lengths:
            counts = [tables.get("decode", method, t, b) for b in tables.batches]
            counts = ["-" if f is None or f.compilations is None else str(f.compilations) for f in counts]
            cells.append(" / ".join(counts))
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return lines + [""]


def _throughput(figures: list[Figure], aime: list[dict] | None) -> list[str]:
    """The generation-throughput rows and, from them, the projected hours of the suite's AIME entries."""
    rows = [f for f in figures if f.kind == "throughput"]
    if not rows:
        return []
    lines = ["## Generation throughput: sampled decoding (T = 0.7, top-p 0.95) through lm-eval's generation "
             "call", "",
             "| method | batch | prompt | new tokens | tokens/s | ms per step | peak GiB |", "|---" * 7 + "|"]
    for f in sorted(rows, key=lambda f: (METHOD_ORDER.index(f.method), f.batch, f.new_tokens or 0)):
        rate = _cell(f, f.tokens_per_s)
        if rate is None:
            rate = f"{f.tokens_per_s:,.0f}" + (f" ({f.status}: {f.note})" if f.status != "ok" else "")
        step = "" if f.ms is None else f"{f.ms:.2f}"
        peak = "" if f.peak_gib is None else f"{f.peak_gib:.2f}"
        lines.append(f"| {f.method} | {f.batch} | {f.length} | {f.new_tokens} | {rate} | {step} | {peak} |")
    lines.append("")
    rates = {f.method: f for f in rows if f.tokens_per_s}  # the latest row of each method
    if not aime or not rates:
        return lines
    methods = [m for m in METHOD_ORDER if m in rates]
    lines += ["### The suite's AIME entries for one model at these rates (hours)", "",
              "| entry | problems x samples x max_gen_toks | " + " | ".join(methods) + " |",
              "|---" * (len(methods) + 2) + "|"]
    totals = dict.fromkeys(methods, 0.0)
    for e in aime:
        tokens = e["problems"] * e["samples"] * e["max_gen_toks"]
        cells = []
        for m in methods:
            hours = tokens / rates[m].tokens_per_s / 3600
            totals[m] += hours
            cells.append((">= " if rates[m].status != "ok" else "") + f"{hours:.2f}")
        size = f"{e['problems']} x {e['samples']} x {e['max_gen_toks']:,}"
        lines.append(f"| {e['label']} ({e['task']}) | {size} | " + " | ".join(cells) + " |")
    lines.append("| total | | " + " | ".join((">= " if rates[m].status != "ok" else "") + f"{totals[m]:.2f}"
                                              for m in methods) + " |")
    sources = ", ".join(sorted({e["problems_from"] for e in aime}))
    batches = ", ".join(sorted({str(rates[m].batch) for m in methods}))
    lines += ["", "Every sample is taken to run to max_gen_toks at the rate measured above (one rate for all "
              f"entries; sampling at batch {batches}, as one problem's samples decode together). Problem "
              f"counts from: {sources} (limit: the entry's limit; data: rows of the local test split; AIME "
              "2024: its 30 problems, the data not being on disk). >=: the rate over the first tokens of a "
              "generation cut off by the cap, which later tokens only lower.", ""]
    return lines
