"""`nsa-eval lm-eval ...`: lm-eval's own command line, with the `nsa-eval` model registered.

lm-eval has no plugin entry point, so its CLI cannot find a model defined outside lm-eval. This
command imports nsa_eval (which registers `nsa-eval`), then hands every argument to lm-eval
unchanged, so all of lm-eval's flags work:

    nsa-eval lm-eval --model_args pretrained=smollm2-135m,attention=quest,budget=2560 \\
        --tasks niah_single_1 --device cpu --limit 4
    accelerate launch -m nsa_eval.cli lm-eval --model_args pretrained=nsa-tiny,attention=nsa ...

Added only when absent: `--model nsa-eval`, and the project's task folder as `--include_path`.
"""

from __future__ import annotations

import argparse
import sys

MODEL_NAME = "nsa-eval"


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "lm-eval", help="lm-eval's CLI with the nsa-eval model registered (flags pass through)",
        description="Run lm-eval's own command line (lm-eval run/ls/validate and every flag) with the "
        "`nsa-eval` model registered; --model defaults to nsa-eval.",
    )
    parser.add_argument("lm_eval_args", nargs=argparse.REMAINDER, help="arguments for lm-eval")
    parser.set_defaults(handler=lambda args: run_passthrough(args.lm_eval_args))


def with_defaults(argv: list[str]) -> list[str]:
    """Add `--model nsa-eval` and the project's `--include_path` when the user gave neither."""
    argv = list(argv)
    runs = not argv or argv[0] not in ("ls", "validate")  # `run`, or lm-eval's legacy flags-only form
    if runs and not _has_flag(argv, "--model"):
        argv += ["--model", MODEL_NAME]
    if not _has_flag(argv, "--include_path"):
        from nsa_eval.tasks import TASKS_DIR

        argv += ["--include_path", str(TASKS_DIR)]
    return argv


def _has_flag(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def run_passthrough(argv: list[str]) -> int:
    """Run lm-eval's CLI on `argv` (everything after `nsa-eval lm-eval`); returns its exit code."""
    import nsa_eval  # noqa: F401  (registers the nsa-eval lm-eval model)

    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError:
        print("nsa-eval: error: lm-eval is not installed (pip install 'lm-eval[hf]')", file=sys.stderr)
        return 2
    saved = sys.argv
    sys.argv = ["lm-eval", *with_defaults(argv)]
    try:
        cli_evaluate()
    except SystemExit as exit_:
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.argv = saved
    return 0
