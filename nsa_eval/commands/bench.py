"""`nsa-eval bench kernels`: time the Triton NSA kernels against SDPA full attention on a CUDA GPU
and write kernels.csv + kernels.md (see nsa_eval/bench.py for what is measured)."""

from __future__ import annotations

import sys

from nsa_eval.errors import UsageError


def _length(text: str) -> int:
    text = text.strip().lower()
    try:
        value = int(text[:-1]) * 1024 if text.endswith("k") else int(text)
    except ValueError:
        raise UsageError(f"--lengths: expected integers like 8192 or 8k, got {text!r}") from None
    if value < 1024:
        raise UsageError(f"--lengths: each length must be >= 1024, got {value}")
    return value


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks (kernels: Triton NSA vs SDPA on a CUDA GPU)")
    parser.add_argument("what", choices=["kernels"], help="what to benchmark")
    parser.add_argument("--lengths", nargs="+", default=["8k", "16k", "32k", "64k"],
                        help="sequence lengths (default: 8k 16k 32k 64k)")
    parser.add_argument("--out", default="reports/kernels",
                        help="output folder for kernels.csv and kernels.md")
    parser.add_argument("--decode-batch", type=int, default=16, help="decode batch size (default 16)")
    parser.add_argument("--no-fla", action="store_true", help="skip flash-linear-attention's parallel_nsa")
    parser.add_argument("--table-only", action="store_true",
                        help="only the report's tables (no other settings, profiles, ops alone or the "
                        "selected branch's floor)")
    parser.set_defaults(handler=run)


def run(args) -> int:
    lengths = [_length(x) for x in args.lengths]
    if args.decode_batch < 1:
        raise UsageError(f"--decode-batch must be >= 1, got {args.decode_batch}")
    import torch

    if not torch.cuda.is_available():
        raise UsageError("bench kernels needs a CUDA GPU (torch.cuda.is_available() is False)")
    from nsa_eval.bench import run_kernel_benchmark, write_outputs

    rows = run_kernel_benchmark(lengths, decode_batch=args.decode_batch, fla=not args.no_fla,
                                variants=not args.table_only)
    command = "nsa-eval bench kernels " + " ".join(a for a in sys.argv[1:] if a not in ("bench", "kernels"))
    csv_path, md_path = write_outputs(rows, args.out, command=command.strip())
    print(md_path.read_text())
    print(f"wrote {csv_path} and {md_path}")
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
