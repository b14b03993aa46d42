"""Run a suite's model x task matrix resumably.

The run directory holds:

    suite.yaml                the suite file as it was run
    run.json                  suite name and hash, the cells (key, label), the environment
    cells/<key>/config.json   the cell's identity and placement       } each written to a temporary
    cells/<key>/results.json  lm-eval's results dict (+ "nsa_eval")   } name and renamed; the cell
    cells/<key>/samples.jsonl lm-eval's per-document samples          } is done when all three exist

`<key>` is the first 16 hex digits of the sha256 of the cell's identity (see `suite.Cell`), so a
re-run skips finished cells, a changed setting recomputes only what it changes, and a killed run
loses only the cell in flight. Each model variant (checkpoint x method x budget) is built once and
runs all its cells before the next one loads.

Under `accelerate launch` every process runs the same cells on its share of the documents
(lm-eval's data parallelism); only process 0 receives results and writes files.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import Any

from nsa_eval.errors import UsageError
from nsa_eval.suite import Cell, ModelSpec, Suite

CELL_FILES = ("config.json", "results.json", "samples.jsonl")
REPORTED_PACKAGES = ("nsa-eval", "lm-eval", "torch", "transformers", "triton", "accelerate",
                     "datasets", "numpy", "vllm")


@dataclass
class RunSummary:
    run_dir: Path
    cells: int  # cells in this run's selection
    computed: int  # cells evaluated now
    skipped: int  # cells already done before this run


def cell_dir(run_dir: Path, cell: Cell) -> Path:
    return Path(run_dir) / "cells" / cell.key[:16]


def is_done(folder: Path) -> bool:
    return all((folder / name).is_file() for name in CELL_FILES)


def run_suite(suite: Suite, run_dir: str | Path | None = None, *, limit: int | None = None,
              only: str | None = None, device: str | None = None, progress: bool = True,
              lm_factory=None, report_dir: str | Path | None = None) -> RunSummary:
    """Evaluate every cell that is not done yet; return how many were computed and skipped.

    `device` overrides every model's device (placement is not hashed, so finished cells still
    count). `lm_factory(model_spec) -> lm_eval LM` replaces the default `LMFactory` (tests).
    `report_dir` is the report folder run.json records, where `nsa-eval report RUN_DIR` writes
    (default: the suite's `report`; `run --output DIR` passes DIR/report).
    """
    from tqdm.auto import tqdm

    cells = suite.cells(limit=limit, only=only)
    if device:
        cells = [dataclasses.replace(c, model=dataclasses.replace(c.model, device=device)) for c in cells]
    run_dir = Path(run_dir or suite.output)
    write_manifest(run_dir, suite, suite.cells(limit=limit), device, report_dir)
    todo = [c for c in cells if not is_done(cell_dir(run_dir, c))]
    bar = tqdm(total=len(cells), initial=len(cells) - len(todo), desc=f"{suite.name} cells",
               unit="cell", disable=not progress)
    factory = lm_factory or LMFactory(seed=suite.seed)
    for model, model_cells in groupby(todo, key=lambda c: c.model):
        bar.set_postfix_str(f"loading {model.label}")
        lm = factory(model)
        for cell in model_cells:
            bar.set_postfix_str(cell.label)
            evaluate_cell(lm, cell, run_dir)
            bar.update()
        del lm
    bar.close()
    return RunSummary(run_dir, len(cells), len(todo), len(cells) - len(todo))


def evaluate_cell(lm, cell: Cell, run_dir: Path) -> Path | None:
    """Run one cell through lm-eval and write its three files; None on non-zero ranks."""
    import lm_eval

    started = time.time()
    _reset_activation_stats(lm)
    task = cell.task
    results = lm_eval.simple_evaluate(
        model=lm, tasks=[task.task], num_fewshot=task.num_fewshot, limit=cell.limit,
        gen_kwargs=dict(task.gen_kwargs) or None, task_manager=_task_manager_for(cell),
        log_samples=True, bootstrap_iters=cell.bootstrap_iters, random_seed=cell.seed,
        numpy_random_seed=cell.seed, torch_random_seed=cell.seed, fewshot_random_seed=cell.seed,
        apply_chat_template=task.apply_chat_template, fewshot_as_multiturn=task.fewshot_as_multiturn,
        system_instruction=task.system_instruction, confirm_run_unsafe_code=task.confirm_run_unsafe_code,
    )
    if results is None:  # another rank of a data-parallel run writes the files
        return None
    samples = results.pop("samples", {})
    results["nsa_eval"] = {
        "cell": cell.key, "label": cell.label, "model": cell.model.label, "task": task.label,
        "part": cell.part, "split": task.split,
        "activated_tokens": _activation_stats(lm), "wall_seconds": round(time.time() - started, 3),
    }
    folder = cell_dir(run_dir, cell)
    folder.mkdir(parents=True, exist_ok=True)
    lines = (json.dumps({"task": name} | sample, default=_jsonable) + "\n"
             for name, rows in samples.items() for sample in rows)
    write_atomic(folder / "samples.jsonl", "".join(lines))
    write_atomic(folder / "results.json", json.dumps(results, indent=1, default=_jsonable))
    config = {"key": cell.key, "label": cell.label, "part": cell.part, "identity": cell.identity(),
              "model": dataclasses.asdict(cell.model), "task": dataclasses.asdict(task),
              "limit": cell.limit, "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}
    write_atomic(folder / "config.json", json.dumps(config, indent=1, default=_jsonable))
    return folder


def write_atomic(path: Path, text: str) -> None:
    """Write to a temporary name beside `path`, then rename: a reader sees all of it or nothing."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_manifest(run_dir: Path, suite: Suite, cells: list[Cell], device: str | None,
                   report_dir: str | Path | None = None) -> None:
    """run.json: what ran, and the report folder that `nsa-eval report RUN_DIR` defaults to."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if suite.source:
        write_atomic(run_dir / "suite.yaml", suite.source)
    manifest = {
        "suite": suite.name, "suite_path": suite.path, "suite_hash": suite.hash,
        "description": suite.description, "report": str(report_dir or suite.report), "seed": suite.seed,
        "cells": [{"key": c.key[:16], "label": c.label, "model": c.model.label, "task": c.task.label,
                   "part": c.part} for c in cells],
        "models": [dataclasses.asdict(m) for m in suite.models],
        "tasks": [dataclasses.asdict(t) for t in suite.tasks],
        "environment": environment(device or (suite.models[0].device if suite.models else "cpu")),
    }
    write_atomic(run_dir / "run.json", json.dumps(manifest, indent=1, default=_jsonable))


def environment(device: str) -> dict:
    """Package versions, device, git commit: what a reader needs to reproduce the numbers."""
    from importlib.metadata import PackageNotFoundError, version

    packages = {}
    for name in REPORTED_PACKAGES:
        try:
            packages[name] = version(name)
        except PackageNotFoundError:
            packages[name] = None
    return {"python": sys.version.split()[0], "platform": platform.platform(), "packages": packages,
            "device": _device_name(device), "cpu_count": os.cpu_count(), "git": _git_commit(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S")}


def _device_name(device: str) -> str:
    try:
        import torch
    except ImportError:
        return device
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{device} ({torch.cuda.get_device_name(torch.device(device))}, x{torch.cuda.device_count()})"
    return f"{device} ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _git_commit() -> str | None:
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (commit + ("-dirty" if dirty else "")) or None


def _jsonable(obj: Any):
    from lm_eval.utils import handle_non_serializable

    return handle_non_serializable(obj)


# ---------------------------------------------------------------- building the LM of one model variant


class LMFactory:
    """Builds the lm-eval LM of one model variant: the `nsa-eval` adapter, or lm-eval's vllm.

    `seed` (the suite's) seeds the vllm engine; the adapter's sampling is seeded per cell by
    `simple_evaluate`.
    """

    def __init__(self, seed: int = 1234):
        self.seed = seed

    def __call__(self, model: ModelSpec):
        if model.backend == "vllm":
            return build_vllm_lm(model, seed=self.seed)
        return self._build_adapter(model)

    def _build_adapter(self, model: ModelSpec):
        from lm_eval.api.registry import get_model

        import nsa_eval.models.lm_adapter  # noqa: F401  (registers the `nsa-eval` lm-eval model)

        return get_model("nsa-eval").create_from_arg_obj(model.model_args())


def vllm_model_args(model: ModelSpec, seed: int = 1234) -> dict:
    """lm-eval `vllm` model_args for a full-attention entry (`backend: vllm`).

    The entry's `vllm:` mapping passes engine arguments through (tensor_parallel_size,
    data_parallel_size, gpu_memory_utilization, ...) and wins over the derived ones. `seed` is the
    suite's seed. Every argument but the placement ones (suite.VLLM_PLACEMENT) is in the cell key.
    """
    if model.attention != "full":
        raise UsageError(f"model {model.label!r}: backend vllm runs full attention only")
    args = {"pretrained": _resolve_checkpoint_path(model.pretrained), "dtype": model.dtype,
            "batch_size": model.batch_size if model.batch_size != 1 else "auto", "seed": seed,
            "tensor_parallel_size": 1, "data_parallel_size": 1, "gpu_memory_utilization": 0.9}
    if model.max_length is not None:
        args["max_model_len"] = model.max_length
    return args | model.vllm


def build_vllm_lm(model: ModelSpec, seed: int = 1234):
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise UsageError(f"model {model.label!r} asks for backend: vllm, but vllm is not installed "
                         "(pip install 'lm-eval[vllm]' on a CUDA machine); use backend: hf")
    from lm_eval.api.registry import get_model

    return get_model("vllm").create_from_arg_obj(vllm_model_args(model, seed=seed))


def _resolve_checkpoint_path(pretrained: str) -> str:
    """A short name (smollm2-135m, nsa-tiny) -> its local directory, for backends that need a path."""
    try:
        from nsa_eval.models import resolve_checkpoint
    except ImportError:
        return pretrained
    return str(resolve_checkpoint(pretrained))


def _task_manager_for(cell: Cell):
    """The shared task index with this cell's metadata: lm-eval applies metadata at task build time.

    Like lm-eval's own CLI, the model's args are visible to tasks (RULER-style tasks read
    `pretrained`/`tokenizer` and `max_length`); the suite's task metadata wins.
    """
    from lm_eval.tasks._factory import TaskFactory

    from nsa_eval.suite import task_manager

    metadata = {"pretrained": cell.model.pretrained}
    if cell.model.max_length is not None:
        metadata["max_length"] = cell.model.max_length
    metadata |= cell.metadata()
    manager = copy.copy(task_manager(cell.include_path))  # shares the (slow to build) index
    manager.metadata = metadata
    manager._factory = TaskFactory(meta=metadata)
    return manager


def _reset_activation_stats(lm) -> None:
    reset = getattr(lm, "reset_attention_stats", None)
    if callable(reset):
        reset()


def _activation_stats(lm) -> Any:
    """Activated tokens per query from the adapter (per context length), or None if it has none."""
    stats = getattr(lm, "attention_stats", None)
    return stats() if callable(stats) else None


def check_run_dir(run_dir: str | Path) -> Path:
    run_dir = Path(run_dir)
    if not (run_dir / "run.json").is_file():
        raise UsageError(f"{run_dir}: not a run directory (no run.json); run `nsa-eval run SUITE.yaml` "
                         "first")
    return run_dir
