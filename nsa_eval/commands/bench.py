"""`nsa-eval bench kernels`: time the Triton NSA kernels against SDPA full attention on a CUDA GPU and
write kernels.csv + kernels.md (see nsa_eval/bench/kernels.py for what is measured).

`nsa-eval bench harness`: time whole models, every attention method beside full attention and plain
transformers, against each decode step's memory floor, and write harness.csv + harness.md as each
figure finishes (nsa_eval/bench/harness.py); a second run into the same folder measures only what is
missing.

`nsa-eval bench profile`: the harness's models under torch.profiler, each figure's kernels summed per
decode step (or prompt), written to profile.md + profile.csv (nsa_eval/bench/profile.py)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from nsa_eval.budget import BudgetConfig
from nsa_eval.errors import UsageError


def _length(text: str, minimum: int = 1024) -> int:
    text = text.strip().lower()
    try:
        value = int(text[:-1]) * 1024 if text.endswith("k") else int(text)
    except ValueError:
        raise UsageError(f"--lengths: expected integers like 8192 or 8k, got {text!r}") from None
    if value < minimum:
        raise UsageError(f"--lengths: each length must be >= {minimum}, got {value}")
    return value


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench", help="benchmarks: kernels (Triton NSA vs SDPA), harness (whole models through lm-eval) or "
        "profile (where a model's prefill and decode step spend the GPU's time, kernel by kernel)")
    parser.add_argument("what", choices=["kernels", "harness", "profile"], help="what to benchmark")
    parser.add_argument("--lengths", nargs="+", default=None,
                        help="sequence lengths (default: kernels 8k 16k 32k 64k, harness 8k 32k 64k, "
                        "profile 64k)")
    parser.add_argument("--out", default=None,
                        help="output folder (default: reports/kernels, reports/harness or reports/profile)")
    parser.add_argument("--decode-batch", type=int, nargs="+", default=None,
                        help="decode batch sizes (default: kernels 16, harness and profile 1 16)")
    parser.add_argument("--no-fla", action="store_true",
                        help="kernels: skip flash-linear-attention's parallel_nsa")
    parser.add_argument("--table-only", action="store_true",
                        help="kernels: only the report's tables (no per-kernel profiles, no ops timed alone)")
    parser.add_argument("--shape", default="llama-3.2-1b",
                        help="harness, profile: the random models' shape (llama-3.2-1b, or tiny for a quick "
                        "check)")
    parser.add_argument("--methods", nargs="+", default=None,
                        help="harness: which rows (default: all, transformers full sink_window topk "
                        "quest h2o h2o_dense nsa); profile: which models (default: full nsa)")
    parser.add_argument("--budget", type=int, default=BudgetConfig.budget,
                        help="harness: the baselines' budget (%(default)s)")
    parser.add_argument("--sink", type=int, default=BudgetConfig.sink,
                        help="harness: the baselines' sink (%(default)s)")
    parser.add_argument("--local", type=int, default=BudgetConfig.local,
                        help="harness: the baselines' local window (%(default)s)")
    parser.add_argument("--decode-tokens", type=int, default=16,
                        help="harness: new tokens timed per decode measurement (16)")
    parser.add_argument("--repeats", type=int, default=3, help="harness: timed calls per figure (median; 3)")
    parser.add_argument("--cap", type=float, default=45.0,
                        help="harness: seconds per figure; one that runs past it is reported as such and the "
                        "table goes on (45)")
    parser.add_argument("--warmup-cap", type=float, default=90.0,
                        help="harness: seconds for a figure's warm-up (its first prefill call, which "
                        "compiles and autotunes at a new length), before its --cap starts (90)")
    parser.add_argument("--throughput-tokens", type=int, default=0,
                        help="harness: new tokens per sequence of the generation-throughput row (full and "
                        "nsa, sampled); 0 = no such row (default); the AIME projection wants 16384")
    parser.add_argument("--throughput-batch", type=int, default=16,
                        help="harness: sequences generated at once for the throughput row (16)")
    parser.add_argument("--throughput-prompt", type=int, default=256,
                        help="harness: prompt tokens of the throughput row (256)")
    parser.add_argument("--throughput-cap", type=float, default=540.0,
                        help="harness: seconds for a throughput figure; past it, the rate so far (540)")
    parser.add_argument("--suite", default="configs/paper.yaml",
                        help="harness: the suite whose AIME entries the throughput row projects "
                        "(configs/paper.yaml)")
    parser.add_argument("--fresh", action="store_true",
                        help="harness: replace the results in --out instead of adding the missing figures")
    parser.add_argument("--device", default="cuda", help="harness, profile: cuda (default) or cpu")
    parser.add_argument("--prefill", action="store_true",
                        help="profile: each length's batch-1 prefill too, not only the decode steps")
    parser.add_argument("--steps", type=int, default=32,
                        help="profile: decode steps profiled per figure (32: NSA's two kinds of step in "
                        "their proportion)")
    parser.add_argument("--top", type=int, default=15, help="profile: kernels listed per figure (15)")
    parser.set_defaults(handler=run)


def run(args) -> int:
    if args.what == "harness":
        return run_harness(args)
    if args.what == "profile":
        return run_profile(args)
    lengths = [_length(x) for x in args.lengths or ["8k", "16k", "32k", "64k"]]
    decode_batch = _one_decode_batch(args.decode_batch)
    import torch

    if not torch.cuda.is_available():
        raise UsageError("bench kernels needs a CUDA GPU (torch.cuda.is_available() is False)")
    from nsa_eval.bench.kernels import run_kernel_benchmark, write_outputs

    rows = run_kernel_benchmark(lengths, decode_batch=decode_batch, fla=not args.no_fla,
                                table_only=args.table_only)
    csv_path, md_path = write_outputs(rows, args.out or "reports/kernels", command=_command_line("kernels"))
    print(md_path.read_text())
    print(f"wrote {csv_path} and {md_path}")
    return 0


def _one_decode_batch(values: list[int] | None) -> int:
    if values is None:
        return 16
    if len(values) != 1:
        raise UsageError(f"bench kernels: --decode-batch takes one size, got {len(values)}")
    if values[0] < 1:
        raise UsageError(f"--decode-batch must be >= 1, got {values[0]}")
    return values[0]


def _command_line(what: str) -> str:
    args = " ".join(a for a in sys.argv[1:] if a not in ("bench", what))
    return f"nsa-eval bench {what} {args}".strip()


def aime_entries(suite_path: str) -> list:
    """The AIME task entries (a task name holding "aime") of the suite at `suite_path`, each with what
    the throughput row's projection needs (nsa_eval/bench/aime.py)."""
    from nsa_eval.bench.aime import aime_entries_of
    from nsa_eval.suite import load_suite
    from nsa_eval.suite.checks import DEFAULT_MAX_GEN_TOKS

    if not Path(suite_path).is_file():
        raise UsageError(f"--suite: {suite_path!r} is not a file; the throughput row projects the AIME "
                         "entries of a suite (configs/paper.yaml from the repository's root)")
    suite = load_suite(suite_path)
    return [entry for task in suite.tasks if "aime" in task.task
            for entry in aime_entries_of(task.label, task.task, task.limit, task.gen_kwargs,
                                         DEFAULT_MAX_GEN_TOKS)]


def harness_config(args, *, methods: tuple[str, ...], lengths: list[str], needs_full: bool = False):
    """The `HarnessConfig` of `args` (harness and profile; `methods` and `lengths` where they give none),
    every argument checked: a UsageError names the first that is wrong. `needs_full`: the methods must
    include full attention."""
    from nsa_eval.bench import harness

    if args.shape not in harness.SHAPES:
        raise UsageError(f"--shape: expected one of {', '.join(harness.SHAPES)}, got {args.shape!r}")
    methods = tuple(args.methods or methods)
    unknown = [m for m in methods if m not in harness.METHODS]
    if unknown:
        raise UsageError(f"--methods: unknown {', '.join(unknown)}; "
                         f"expected some of {', '.join(harness.METHODS)}")
    if needs_full and "full" not in methods:
        raise UsageError("--methods: include full (every ratio is to full attention of the same run)")
    lengths = [_length(x, minimum=64) for x in args.lengths or lengths]
    batches = tuple(args.decode_batch or [1, 16])
    for name, value, low in (("--decode-batch", min(batches), 1), ("--decode-tokens", args.decode_tokens, 1),
                             ("--repeats", args.repeats, 1), ("--budget", args.budget, 1),
                             ("--local", args.local, 1), ("--sink", args.sink, 0),
                             ("--throughput-tokens", args.throughput_tokens, 0),
                             ("--throughput-batch", args.throughput_batch, 1),
                             ("--throughput-prompt", args.throughput_prompt, 1),
                             ("--steps", args.steps, 1), ("--top", args.top, 1)):
        if value < low:
            raise UsageError(f"{name} must be >= {low}, got {value}")
    for name, value in (("--cap", args.cap), ("--warmup-cap", args.warmup_cap),
                        ("--throughput-cap", args.throughput_cap)):
        if not value > 0:
            raise UsageError(f"{name} must be > 0 seconds, got {value}")
    if args.budget < args.sink + args.local:
        raise UsageError(f"--budget {args.budget} is below --sink + --local = {args.sink + args.local}")
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"bench {args.what} --device cuda needs a CUDA GPU "
                         "(--device cpu --shape tiny runs it on a CPU)")
    if args.device != "cpu" and not args.device.startswith("cuda"):
        raise UsageError(f"--device: expected cpu or cuda[:N], got {args.device!r}")
    return harness.HarnessConfig(
        shape=harness.SHAPES[args.shape], lengths=tuple(lengths), methods=methods, decode_batches=batches,
        decode_tokens=args.decode_tokens, repeats=args.repeats, cap_s=args.cap, warmup_cap_s=args.warmup_cap,
        budget=args.budget, sink=args.sink, local=args.local, device=args.device,
        throughput_tokens=args.throughput_tokens, throughput_batch=args.throughput_batch,
        throughput_prompt=args.throughput_prompt,
        throughput_cap_s=args.throughput_cap)


def run_harness(args) -> int:
    """Check every argument and the output folder, then build the models and time them."""
    from nsa_eval.bench import harness, harness_run
    from nsa_eval.bench.harness_store import HarnessStore

    config = harness_config(args, methods=harness.METHODS, lengths=["8k", "32k", "64k"], needs_full=True)
    aime = aime_entries(args.suite) if args.throughput_tokens else None
    store = HarnessStore(args.out or "reports/harness")
    store.check(config.settings(), fresh=args.fresh)
    harness_run.run_harness(config, store, fresh=args.fresh, command=_command_line("harness"), aime=aime)
    print(store.md_path.read_text())
    print(f"wrote {store.csv_path} and {store.md_path}")
    return 0


def run_profile(args) -> int:
    """Check every argument and the output folder, then build the models and profile them."""
    from nsa_eval.bench.kernels import software_versions
    from nsa_eval.bench.profile import profile_figures, write_profiles

    config = harness_config(args, methods=("full", "nsa"), lengths=["64k"])
    # a figure's timed round is the steps profiled, which the models' context (max_length) then covers
    config = dataclasses.replace(config, decode_tokens=args.steps, repeats=1)
    out = Path(args.out or "reports/profile")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out: {str(out)!r} is a file; expected a folder")
    profiles = profile_figures(config, with_prefill=args.prefill)
    md_path, csv_path = write_profiles(profiles, out, top=args.top, command=_command_line("profile"),
                                       versions=software_versions())
    print(md_path.read_text())
    print(f"wrote {md_path} and {csv_path}")
    return 0


if __name__ == "__main__":  # `python -m nsa_eval.commands.bench kernels ...` (machines without lm-eval)
    import argparse

    _parser = argparse.ArgumentParser(prog="nsa-eval")
    register(_parser.add_subparsers())
    _args = _parser.parse_args(["bench", *sys.argv[1:]])
    try:
        sys.exit(_args.handler(_args))
    except UsageError as err:  # as the nsa-eval CLI reports it: one line, exit code 2
        print(f"nsa-eval: error: {err}", file=sys.stderr)
        sys.exit(2)
