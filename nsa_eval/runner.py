"""Run a suite's model x task matrix resumably.

The run directory (made by nsa-eval: `.nsa-eval` marks it, see `nsa_eval.folders`) holds:

    suite.yaml                  the suite file as it was run
    run.json                    suite name and hash, the cells (key, label), the report folder
                                (relative to the run directory), the environment
    cells/<key>/samples.jsonl   lm-eval's per-document samples, each row naming its cell }  each written to a
    cells/<key>/results.json    lm-eval's results dict (+ "nsa_eval")                  }  temporary name and
    cells/<key>/config.json     the cell's identity and placement                      }  renamed, in this
    cells/<key>/checksums.json  the cell's key and the sha256 of the three files above }  order

A cell is done when checksums.json, written last, names the cell and matches the three files, and
each file parses: a cell cut short, damaged or copied from another cell is recomputed, with a
warning naming it. `<key>` is the first 16 hex digits of the sha256 of the cell's identity (see
`suite.Cell`), so a re-run skips finished cells, a changed setting recomputes only what it changes,
and a killed run loses only the cell in flight. Each model variant (checkpoint x method x budget)
is built once and runs all its cells before the next one loads.

One process at a time writes a run directory (`folders.RunLock`); a run with nothing to compute
and an unchanged manifest writes nothing, so a finished run on a read-only copy still reports.
Under `accelerate launch` every process runs the same cells on its share of the documents
(lm-eval's data parallelism); only process 0 receives results, takes the lock and writes files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import Any

from nsa_eval.errors import UsageError, print_warning
from nsa_eval.folders import RunLock, check_folder, claim_folder, is_writable, remove_stale_temporaries
from nsa_eval.suite import Cell, ModelSpec, Suite

CELL_FILES = ("config.json", "results.json", "samples.jsonl")
CHECKSUM_FILE = "checksums.json"  # written last: the cell is done when it matches the files above
NOT_STARTED = "not started"  # cell_problem's answer for a cell with no file at all
REPORTED_PACKAGES = ("nsa-eval", "lm-eval", "torch", "transformers", "triton", "accelerate",
                     "datasets", "numpy", "vllm")


@dataclass
class RunSummary:
    run_dir: Path
    cells: int  # cells in this run's selection
    computed: int  # cells evaluated now
    skipped: int  # cells already done before this run
    recomputed: list[str] = dataclasses.field(default_factory=list)  # damaged cells computed again


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during a run: what was finished is kept; the message says how to resume."""

    def __init__(self, run_dir: Path, cell: str | None, done: int, total: int):
        in_flight = f" during cell {cell}" if cell else ""
        super().__init__(f"interrupted{in_flight}; {done} of {total} cells are done and kept in {run_dir}\n"
                         "run the same command again to resume (the cell in flight starts over)")


def cell_dir(run_dir: Path, cell: Cell) -> Path:
    return Path(run_dir) / "cells" / cell.key[:16]


def is_done(folder: Path, key: str | None = None) -> bool:
    """Whether the cell in `folder` is finished and whole (see `cell_problem`)."""
    return cell_problem(folder, key) is None


def cell_problem(folder: Path, key: str | None = None) -> str | None:
    """None when the cell in `folder` is done; else why not, in words (`NOT_STARTED` when no file of
    it exists). `key` is the cell's full key (default: any key the folder's name starts)."""
    folder = Path(folder)
    names = (*CELL_FILES, CHECKSUM_FILE)
    if not any((folder / name).exists() for name in names):
        return NOT_STARTED
    if not (folder / CHECKSUM_FILE).is_file():
        return f"no {CHECKSUM_FILE} (a run stopped while writing the cell, or an older nsa-eval wrote it)"
    try:
        seal = json.loads((folder / CHECKSUM_FILE).read_text(encoding="utf-8"))
        sealed_key, sums = seal["key"], seal["sha256"]
        if not isinstance(sealed_key, str) or not isinstance(sums, dict):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        return f"{CHECKSUM_FILE} is not a checksum record"
    if not (sealed_key == key if key else sealed_key.startswith(folder.name)):
        return f"it holds cell {sealed_key[:16]}, not {(key or folder.name)[:16]}"
    for name in CELL_FILES:
        try:
            problem = _file_problem(folder / name, sums.get(name), sealed_key)
        except OSError as err:
            problem = f"cannot be read ({err.strerror})"
        if problem:
            return f"{name} {problem}"
    return None


def _file_problem(path: Path, checksum: str | None, key: str) -> str | None:
    """Why one cell file is not whole (None when it is): absent, changed since its checksum, not JSON,
    or a record of another cell."""
    if not path.is_file():
        return "is missing"
    digest, parsed = hashlib.sha256(), []
    with open(path, "rb") as f:
        if path.suffix == ".jsonl":
            for number, line in enumerate(f, 1):
                digest.update(line)
                if line.strip():
                    parsed.append((number, line))
        else:
            data = f.read()
            digest.update(data)
            parsed.append((None, data))
    if digest.hexdigest() != checksum:
        return "does not match its checksum (changed or damaged since it was written)"
    for number, line in parsed:
        where = f"line {number} " if number else ""
        try:
            record = json.loads(line)
        except ValueError as err:
            return f"{where}is not valid JSON ({err})"
        if not isinstance(record, dict):
            return f"{where}is not a JSON object"
        owner = _owner(path.name, record)
        if owner != key:
            return f"{where}belongs to cell {str(owner)[:16]}, not {key[:16]}"
    return None


def _owner(name: str, record: dict) -> Any:
    """The cell key a parsed cell file (or samples row) says it belongs to."""
    if name == "results.json":
        return (record.get("nsa_eval") or {}).get("cell")
    return record.get("key") if name == "config.json" else record.get("cell")


def run_suite(suite: Suite, run_dir: str | Path | None = None, *, limit: int | None = None,
              only: str | None = None, device: str | None = None, progress: bool = True,
              lm_factory=None, report_dir: str | Path | None = None,
              warn: Callable[[str], None] | None = None) -> RunSummary:
    """Evaluate every cell that is not done yet; return how many were computed and skipped.

    `device` overrides every model's device (placement is not hashed, so finished cells still
    count). `lm_factory(model_spec) -> lm_eval LM` replaces the default `LMFactory` (tests).
    `report_dir` is the report folder run.json records, where `nsa-eval report RUN_DIR` writes
    (default: the suite's `report`; `run --output DIR` passes DIR/report). `warn(line)` receives
    each damaged cell that is recomputed (default: printed to stderr). A UsageError (the folder is
    not nsa-eval's, another run holds it, it is read-only with cells to compute) comes before any
    model loads; Ctrl-C raises `RunInterrupted`.
    """
    from tqdm.auto import tqdm

    warn = warn or print_warning
    cells = suite.cells(limit=limit, only=only)
    if device:
        cells = [dataclasses.replace(c, model=dataclasses.replace(c.model, device=device)) for c in cells]
    run_dir = check_folder(run_dir or suite.output, "run", "output")
    manifest = run_manifest(run_dir, suite, suite.cells(limit=limit), device, report_dir)
    todo = [c for c in cells if not is_done(cell_dir(run_dir, c), c.key)]
    recomputed: list[str] = []
    with contextlib.ExitStack() as stack:
        if is_main_process() and (todo or _manifest_changed(run_dir, manifest, suite.source)):
            if run_dir.is_dir() and not is_writable(run_dir):
                if todo:
                    raise UsageError(f"{run_dir}: read-only, and {len(todo)} of {len(cells)} cells are not "
                                     "done; expected a writable run folder (or --output DIR)")
                warn(f"{run_dir}: read-only; run.json is kept as it is (this run's settings differ)")
            else:
                claim_folder(run_dir, "run")
                stack.enter_context(RunLock(run_dir))
                remove_stale_temporaries(run_dir)
                # read again under the lock: a run that held it may have finished some of them
                problems = {c.key: cell_problem(cell_dir(run_dir, c), c.key) for c in todo}
                todo = [c for c in todo if problems[c.key] is not None]
                for cell in todo:
                    if problems[cell.key] != NOT_STARTED:
                        warn(f"cell {cell.label} ({cell_dir(run_dir, cell)}): {problems[cell.key]}; "
                             "computing it again")
                        recomputed.append(cell.label)
                _write_manifest(run_dir, manifest, suite.source)
        _evaluate_cells(todo, run_dir, cells, lm_factory or LMFactory(seed=suite.seed),
                        tqdm(total=len(cells), initial=len(cells) - len(todo), desc=f"{suite.name} cells",
                             unit="cell", disable=not progress))
    return RunSummary(run_dir, len(cells), len(todo), len(cells) - len(todo), recomputed)


def _evaluate_cells(todo: list[Cell], run_dir: Path, cells: list[Cell], factory, bar) -> None:
    """Each model variant loads once and runs its cells; Ctrl-C becomes RunInterrupted."""
    current = None
    try:
        for model, model_cells in groupby(todo, key=lambda c: c.model):
            bar.set_postfix_str(f"loading {model.label}")
            lm = factory(model)
            for current in model_cells:
                bar.set_postfix_str(current.label)
                evaluate_cell(lm, current, run_dir)
                bar.update()
            current = None
            del lm
    except KeyboardInterrupt:
        done = sum(is_done(cell_dir(run_dir, c), c.key) for c in cells)
        raise RunInterrupted(run_dir, current.label if current else None, done, len(cells)) from None
    finally:
        bar.close()


def is_main_process() -> bool:
    """Process 0 of an `accelerate launch` (or the only process): the one that writes files."""
    return int(os.environ.get("RANK", "0")) == 0


def evaluate_cell(lm, cell: Cell, run_dir: Path) -> Path | None:
    """Run one cell through lm-eval and write its files; None on non-zero ranks."""
    import lm_eval

    started = time.time()
    _reset_attention_stats(lm)
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
        "activated_tokens": _attention_stats(lm), "wall_seconds": round(time.time() - started, 3),
    }
    config = {"key": cell.key, "label": cell.label, "part": cell.part, "identity": cell.identity(),
              "model": dataclasses.asdict(cell.model), "task": dataclasses.asdict(task),
              "limit": cell.limit, "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}
    return write_cell(cell_dir(run_dir, cell), cell.key, config, results, samples)


def write_cell(folder: Path, key: str, config: dict, results: dict, samples: dict[str, list]) -> Path:
    """Write a cell's files, checksums.json last; an old checksum goes first, so a crash part-way
    leaves a cell that is not done rather than one that mixes two runs."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CHECKSUM_FILE).unlink(missing_ok=True)
    lines = "".join(json.dumps({"task": name} | sample | {"cell": key}, default=_jsonable) + "\n"
                    for name, rows in samples.items() for sample in rows)
    texts = {"samples.jsonl": lines, "results.json": json.dumps(results, indent=1, default=_jsonable),
             "config.json": json.dumps(config, indent=1, default=_jsonable)}
    for name, text in texts.items():
        write_atomic(folder / name, text)
    sums = {name: hashlib.sha256(text.encode("utf-8")).hexdigest() for name, text in texts.items()}
    write_atomic(folder / CHECKSUM_FILE, json.dumps({"key": key, "sha256": sums}, indent=1))
    return folder


def write_atomic(path: Path, text: str) -> None:
    """Write to a temporary name beside `path`, then rename: a reader sees all of it or nothing."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(text.encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def run_manifest(run_dir: Path, suite: Suite, cells: list[Cell], device: str | None,
                 report_dir: str | Path | None = None) -> dict:
    """run.json: what ran, and the report folder (relative to the run directory, so a copied run
    reports beside itself) that `nsa-eval report RUN_DIR` defaults to."""
    report = os.path.relpath(Path(report_dir or suite.report).absolute(), Path(run_dir).absolute())
    return {
        "suite": suite.name, "suite_path": suite.path, "suite_hash": suite.hash,
        "description": suite.description, "report": Path(report).as_posix(), "seed": suite.seed,
        "cells": [{"key": c.key[:16], "label": c.label, "model": c.model.label, "task": c.task.label,
                   "part": c.part} for c in cells],
        "models": [dataclasses.asdict(m) for m in suite.models],
        "tasks": [dataclasses.asdict(t) for t in suite.tasks],
        "environment": environment(device or (suite.models[0].device if suite.models else "cpu")),
    }


def _manifest_changed(run_dir: Path, manifest: dict, source: str) -> bool:
    """Whether run.json or suite.yaml would say something new (the environment aside: a rerun that
    computes nothing leaves the run directory as it was)."""
    try:
        old = json.loads((run_dir / "run.json").read_text(encoding="utf-8"))
        old_source = (run_dir / "suite.yaml").read_text(encoding="utf-8") if source else ""
    except (OSError, ValueError):
        return True
    if not isinstance(old, dict) or old_source != source:
        return True
    as_json = lambda m: json.dumps({k: v for k, v in m.items() if k != "environment"},  # noqa: E731
                                   sort_keys=True, default=_jsonable)
    return as_json(old) != as_json(manifest)


def _write_manifest(run_dir: Path, manifest: dict, source: str) -> None:
    if source:
        write_atomic(run_dir / "suite.yaml", source)
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
    from nsa_eval.models import resolve_checkpoint

    return str(resolve_checkpoint(pretrained))


def _task_manager_for(cell: Cell):
    """The shared task index with this cell's metadata: lm-eval applies metadata at task build time.

    Like lm-eval's own CLI, the model's args are visible to tasks (RULER-style tasks read
    `pretrained`/`tokenizer` and `max_length`); the suite's task metadata wins.
    """
    from nsa_eval.suite import suite_task_manager
    from nsa_eval.tasks.index import with_metadata

    metadata = {"pretrained": cell.model.pretrained}
    if cell.model.max_length is not None:
        metadata["max_length"] = cell.model.max_length
    metadata |= cell.metadata()
    return with_metadata(suite_task_manager(cell.include_path), metadata)


def _reset_attention_stats(lm) -> None:
    reset = getattr(lm, "reset_attention_stats", None)
    if callable(reset):
        reset()


def _attention_stats(lm) -> Any:
    """Activated tokens per query from the adapter (per context length), or None if it has none."""
    stats = getattr(lm, "attention_stats", None)
    return stats() if callable(stats) else None


def check_run_dir(run_dir: str | Path) -> Path:
    run_dir = Path(run_dir)
    if not (run_dir / "run.json").is_file():
        raise UsageError(f"{run_dir}: not a run directory (no run.json); run `nsa-eval run SUITE.yaml` "
                         "first")
    return run_dir
