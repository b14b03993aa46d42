"""The report's protocol and environment sections: what ran and how, as the run recorded it.

Per model: checkpoint, attention, budget, sink, local, prefill or decode sparsity, dense layers,
dtype, truncation, max length, backend. Per task: shots, sampling, chat template, each task's own
prompt cut, documents and metadata, then the scoring notes of the tasks that ran (PROTOCOL_NOTES).
The environment: suite, git commit, device, python, packages and the evaluation's wall time.
"""

from __future__ import annotations

import json
from collections import defaultdict

from nsa_eval.report.document import Document
from nsa_eval.report.load import RunData
from nsa_eval.suite.spec import UNBUDGETED


def protocol_section(doc: Document, report) -> None:
    """The models' and tasks' settings as the cells recorded them, and the scoring notes of the tasks
    that ran; `report` is the ReportBuilder."""
    doc.heading("Protocol")
    rows = []
    for model in report.models:
        s = report.run.model_spec(model)
        sparse = s["attention"] not in UNBUDGETED
        dense = s.get("dense_layers") or 0
        rows.append([model, s["pretrained"], s["attention"],
                     str(s["budget"]) if sparse else "-", str(s["sink"]) if sparse else "-",
                     str(s["local"]) if sparse else "-",
                     ("prefill + decode" if s.get("sparse_prefill", True) else "decode only") if sparse
                     else ("native" if s["attention"] == "nsa" else "dense"),
                     (f"first {dense}" if dense else "none") if sparse else "-",
                     s["dtype"], s["truncation"], str(s.get("max_length") or "model's"), s["backend"]])
    doc.table(["method", "checkpoint", "attention", "budget", "sink", "local", "sparsity", "dense layers",
               "dtype", "truncation", "max length", "backend"], rows,
              "Models; dense layers attend to every key (their keys count in the activated tokens)")
    rows = []
    for task in report.tasks:
        spec = report.run.task_spec(task)
        cells = [c for c in report.run.cells if c.task == task]
        results = cells[0].results if cells else {}
        shots = sorted({str(v) for v in results.get("n-shot", {}).values()})
        gen = _generation_kwargs(results)
        docs = documents(report, task)
        limit = cells[0].config.get("limit") if cells else None
        rows.append([task, f"`{spec['task']}`", ", ".join(shots) or "0", gen,
                     _chat_template(report, task, spec), _prompt_cut(spec),
                     docs + (f" (limit {limit})" if limit else ""),
                     json.dumps(spec["metadata"], sort_keys=True) if spec.get("metadata") else ""])
    doc.table(["task", "lm-eval task", "shots", "sampling", "chat template", "prompt cut", "documents",
               "metadata"], rows,
              "Tasks; documents per subtask and method (the parts of a split task summed); a prompt "
              "longer than the model's max length loses its middle (`truncation: middle`) or its head")
    notes = _protocol_notes(report)
    if notes:
        doc.para("Scoring and model choices (docs/tasks.md gives the reasons):")
        doc.bullets(notes)


def _chat_template(report, task: str, spec: dict) -> str:
    """Whether the task's prompts went through the chat template, naming the models that ran it."""
    if not spec.get("apply_chat_template"):
        return "no"
    return "yes: " + ", ".join(report.models_of(task))


def _protocol_notes(report) -> list[str]:
    """The scoring choices of the tasks that ran (PROTOCOL_NOTES), then each model's dense layers."""
    from nsa_eval.tasks import PROTOCOL_NOTES

    notes = [PROTOCOL_NOTES[spec["task"]] for spec in (report.run.task_spec(t) for t in report.tasks)
             if spec["task"] in PROTOCOL_NOTES]
    notes = list(dict.fromkeys(notes))
    for model in report.models:
        s = report.run.model_spec(model)
        dense = s.get("dense_layers") or 0
        if s["attention"] == "quest":
            notes.append(f"{model}: Quest " + (
                f"keeps its first {dense} layers dense, as Quest's own code keeps two" if dense else
                "is sparse in every layer (Quest's own code keeps the first two dense)") + ".")
        elif dense and s["attention"] not in UNBUDGETED:
            notes.append(f"{model}: the first {dense} layers are dense.")
    return notes


def documents(report, task: str) -> str:
    """Documents per subtask of one method, summed over the parts of a split task only; where
    methods ran different numbers, each method's."""
    counts = {}
    for model in report.models_of(task):
        per_subtask = defaultdict(int)
        for c in report.run.cells_of(model, task):
            for sub, n in c.results.get("n-samples", {}).items():
                per_subtask[sub] += n.get("effective") or 0
        counts[model] = ", ".join(sorted({str(v) for v in per_subtask.values()}, key=int))
    if len(set(counts.values())) <= 1:
        return next(iter(counts.values()), "")
    return "differs by method: " + "; ".join(f"{m} {v or '?'}" for m, v in counts.items())


def environment_section(doc: Document, run: RunData) -> None:
    """Package versions, device, git commit and wall time, from run.json and the cells."""
    env = run.manifest.get("environment", {})
    doc.heading("Environment")
    manifest = run.manifest
    items = [f"suite `{manifest.get('suite_path')}`, hash `{manifest.get('suite_hash')}`",
             f"git commit `{env.get('git')}`", f"device {env.get('device')}, {env.get('cpu_count')} CPUs",
             f"python {env.get('python')} on {env.get('platform')}", f"run started {env.get('date')}"]
    packages = env.get("packages", {})
    items.append("packages: " + ", ".join(f"{k} {v}" for k, v in packages.items() if v))
    wall = [(c.label, (c.results.get("nsa_eval") or {}).get("wall_seconds")) for c in run.cells]
    total = sum(w for _, w in wall if w)
    items.append(f"evaluation time over finished cells: {total:,.0f} s")
    doc.bullets(items)


def _generation_kwargs(results: dict) -> str:
    configs = results.get("configs", {})
    kwargs = next((c.get("generation_kwargs") for c in configs.values() if c.get("generation_kwargs")), None)
    if not kwargs:
        return "loglikelihood" if configs else ""
    shown = {k: kwargs[k] for k in ("do_sample", "temperature", "top_p", "max_gen_toks") if k in kwargs}
    if not shown.get("do_sample"):
        shown = {"greedy": True} | {k: v for k, v in shown.items() if k == "max_gen_toks"}
    return ", ".join(f"{k}={v}" for k, v in shown.items())


def _prompt_cut(spec: dict) -> str:
    """The task's own prompt length (a metadata key marked `prompt_length`, e.g. LongBench's), else
    the model's."""
    from nsa_eval.tasks.catalog import prompt_length_key

    key = prompt_length_key(str(spec.get("task", "")))
    length = (spec.get("metadata") or {}).get(key) if key else None
    return f"middle, to {length:,} tokens (`{key}`)" if isinstance(length, int) else "by the model"
