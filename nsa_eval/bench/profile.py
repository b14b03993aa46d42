"""`nsa-eval bench profile`: where a prompt and a decode step spend the device's time, kernel by kernel.

The harness (harness.py) says how long a step takes; this says why. For each method, length and
decode batch it builds the harness's random checkpoints and loads them as the harness does, then:
- **decode**: a prompt of the batch fills a cache once; warm-up steps (enough for NSA to capture both
  of its graphs, the step that completes a compressed block and the one that does not) come first,
  then `--steps` steps timed by the wall clock, then as many under `torch.profiler`;
- **prefill** (`--prefill`, batch 1): one forward over the prompt after a warm-up forward, under the
  profiler.
The device's kernels are summed by name and divided by the steps: time a step, launches a step and
each kernel's share. The matrix products (cuBLAS's and CUTLASS's kernels) are summed apart: they read
the weights, which every method's step pays alike. On a CPU the profiler sees operators, not kernels
(aten ops, by their own time without their children's), which is what the tiny shape's test reads.
"""

from __future__ import annotations

import csv
import io
import re
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nsa_eval.bench.harness import (
    WARM_UP_STEPS,
    HarnessConfig,
    capture_both_graphs,
    decode_room,
    decode_step,
    free_memory,
    load_lm,
    prefill,
    random_prompt,
    sync,
    write_checkpoint,
)
from nsa_eval.bench.harness_store import write_atomic

# kernel (or operator) names of matrix products: cuBLAS / cuBLASLt (gemm, gemv, nvjet, xmma, and the
# split-K reduction after some of them), CUTLASS, and on a CPU aten's product ops; but not attention,
# whose flash and memory-efficient kernels name CUTLASS's types in their templates
PRODUCT = re.compile(r"gemm|gemv|nvjet|xmma|cutlass|cublas|splitKreduce|aten::(?:mm|addmm|bmm|matmul)$",
                     re.IGNORECASE)
ATTENTION = re.compile(r"flash|fmha|attn|attention", re.IGNORECASE)
FILES = ("profile.md", "profile.csv")
NAME_CHARS = 110  # of a kernel's name in the markdown table (the CSV keeps it whole)


@dataclass
class Kernel:
    """One kernel (or operator) name's time and launches, per step."""

    name: str
    ms: float
    launches: float

    @property
    def product(self) -> bool:
        return bool(PRODUCT.search(self.name)) and not ATTENTION.search(self.name)


@dataclass
class Profile:
    """One profiled figure: `phase` "prefill" (one forward of the prompt) or "decode" (a step)."""

    phase: str
    method: str
    length: int
    batch: int
    kernels: list[Kernel] = field(default_factory=list)  # longest first
    wall_ms: float | None = None  # decode: the wall time of a step, without the profiler
    status: str = "ok"  # or "OOM", or "error: ..."
    cuda: bool = True  # the kernels are a GPU's (else a CPU's operators)

    @property
    def ms(self) -> float:
        return sum(k.ms for k in self.kernels)

    @property
    def launches(self) -> float:
        return sum(k.launches for k in self.kernels)

    @property
    def product_ms(self) -> float:
        return sum(k.ms for k in self.kernels if k.product)


def profile_figures(config: HarnessConfig, *, with_prefill: bool = False, log: Callable[[str], None] = print,
                    load: Callable = load_lm) -> list[Profile]:
    """Every figure of `config` (its methods, lengths and decode batches; with `with_prefill` also each
    length's batch-1 prefill), each model loaded once; `config.decode_tokens` decode steps a figure are
    timed, then as many profiled."""
    dtype = getattr(torch, config.dtype)
    profiles = []
    with tempfile.TemporaryDirectory(prefix="nsa-eval-profile-") as tmp:
        checkpoints: dict[str, Path] = {}
        for method in config.methods:
            kind = "nsa" if method == "nsa" else "llama"
            if kind not in checkpoints:
                checkpoints[kind] = write_checkpoint(kind, config.shape, Path(tmp), config.max_length, dtype,
                                                     config.device)
            model = load(method, checkpoints[kind], config).model
            for length in config.lengths:
                figures = [("prefill", 1)] if with_prefill else []
                for phase, batch in figures + [("decode", b) for b in config.decode_batches]:
                    log(f"profiling {method} {phase} at {length}, batch {batch}")
                    profile = Profile(phase, method, length, batch, cuda=config.device.startswith("cuda"))
                    try:
                        _measure(profile, model, config)
                    except torch.OutOfMemoryError:
                        profile.status = "OOM"
                    except Exception as error:  # one figure's failure is a line of the report, not its end
                        message = (str(error).strip().splitlines() or [""])[0][:200]
                        profile.status = f"error: {type(error).__name__}: {message}"
                    free_memory(config.device)
                    profiles.append(profile)
                    log(f"  {describe(profile)}")
            model = None
            free_memory(config.device)
    return profiles


def _measure(profile: Profile, model, config: HarnessConfig) -> None:
    """Fill `profile` (its phase, length and batch) from `model`."""
    device = config.device
    ids = random_prompt(profile.batch, profile.length, config.shape.vocab, device)
    with torch.no_grad():
        if profile.phase == "prefill":  # into a cache with room for a step, as the harness's prefill
            prefill(model, ids, 1)  # warm-up: compiles and autotunes at this length
            sync(device)
            profile.kernels = _profiled(lambda: prefill(model, ids, 1), 1, device)
            return
        cache, token = prefill(model, ids, decode_room(config))
        if hasattr(cache, "reserve"):
            cache.reserve(cache.length + decode_room(config))
        for _ in range(WARM_UP_STEPS):
            token = decode_step(model, cache, token)
        token = capture_both_graphs(model, cache, token)  # NSA's steps then replay in their proportion
        steps = config.decode_tokens
        sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            token = decode_step(model, cache, token)
        sync(device)
        profile.wall_ms = (time.perf_counter() - start) * 1000 / steps

        def run():
            nonlocal token
            for _ in range(steps):
                token = decode_step(model, cache, token)

        profile.kernels = _profiled(run, steps, device)


def _profiled(fn: Callable[[], object], steps: int, device: str) -> list[Kernel]:
    """`fn` under torch.profiler: the device's kernels (a CPU's operators, by self time) summed by name,
    per step, longest first."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        fn()
        sync(device)
    us, launches = defaultdict(float), defaultdict(int)
    for event in prof.events():
        if cuda and event.device_type == DeviceType.CUDA:
            us[event.name] += event.time_range.elapsed_us()
        elif not cuda and event.device_type == DeviceType.CPU and event.name.startswith("aten::"):
            us[event.name] += event.self_cpu_time_total
        else:
            continue
        launches[event.name] += 1
    kernels = [Kernel(name, us[name] / 1000 / steps, launches[name] / steps) for name in us]
    return sorted(kernels, key=lambda k: -k.ms)


def describe(profile: Profile) -> str:
    if profile.status != "ok":
        return profile.status
    unit = "step" if profile.phase == "decode" else "prompt"
    wall = f" (wall {profile.wall_ms:.3f} ms)" if profile.wall_ms is not None else ""
    calls = "kernels" if profile.cuda else "operator calls"
    return (f"{profile.ms:.3f} ms a {unit}{wall} in {profile.launches:.0f} {calls}; matrix products "
            f"{profile.product_ms:.3f} ms ({_share(profile.product_ms, profile.ms)})")


# ---------------------------------------------------------------------------------------------- files


def write_profiles(profiles: list[Profile], folder: str | Path, *, top: int, command: str = "",
                   versions: str = "") -> tuple[Path, Path]:
    """profile.md (each figure's summary and its `top` kernels) and profile.csv (every kernel) in
    `folder`, each written whole or not at all."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    md_path, csv_path = (folder / name for name in FILES)
    write_atomic(md_path, markdown(profiles, top=top, command=command, versions=versions))
    text = io.StringIO()
    writer = csv.writer(text)
    writer.writerow(["phase", "method", "length", "batch", "status", "kernel", "ms", "launches", "product"])
    for p in profiles:
        for k in p.kernels or [Kernel("", 0.0, 0.0)]:
            writer.writerow([p.phase, p.method, p.length, p.batch, p.status, k.name, f"{k.ms:.6f}",
                             f"{k.launches:g}", int(k.product) if k.name else ""])
    write_atomic(csv_path, text.getvalue())
    return md_path, csv_path


def markdown(profiles: list[Profile], *, top: int, command: str = "", versions: str = "") -> str:
    lines = ["# Where the time goes", ""]
    if command:
        lines += [f"Command: `{command}`", ""]
    if versions:
        lines += [f"Ran on: {versions}", ""]
    lines += ["Device time of each kernel (on a CPU: each operator's own time), per decode step or per "
              "prompt, summed by name; matrix products are cuBLAS's and CUTLASS's kernels.", ""]
    for p in profiles:
        lines += [f"## {p.method} {p.phase}, {p.length:,} tokens, batch {p.batch}", "", describe(p), ""]
        if p.status != "ok":
            continue
        lines += ["| kernel | ms | share | launches |" if p.cuda else "| operator | ms | share | calls |",
                  "|---|---|---|---|"]
        for k in p.kernels[:top]:
            name = k.name if len(k.name) <= NAME_CHARS else k.name[: NAME_CHARS - 3] + "..."
            name = name.replace("|", "\\|")
            lines.append(f"| `{name}` | {k.ms:.4f} | {_share(k.ms, p.ms)} | {k.launches:g} |")
        rest = p.kernels[top:]
        if rest:
            rest_ms = sum(k.ms for k in rest)
            lines.append(f"| {len(rest)} others | {rest_ms:.4f} | {_share(rest_ms, p.ms)} | "
                         f"{sum(k.launches for k in rest):g} |")
        lines.append("")
    return "\n".join(lines)


def _share(part: float, whole: float) -> str:
    return f"{part / whole:.1%}" if whole else "-"
