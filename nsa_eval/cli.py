"""The `nsa-eval` command line: one subcommand per module under nsa_eval/commands/.

Every handler validates its input before it computes. A `UsageError` (bad file, key, name or
value) is printed as one line and exits with code 2. Ctrl-C prints two lines (what was kept, how
to go on) and exits with 130, as a shell does for SIGINT.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from nsa_eval.errors import UsageError

# subcommand -> module under nsa_eval.commands defining register(subparsers)
COMMANDS = {
    "validate": "validate",
    "run": "run",
    "report": "report",
    "lm-eval": "lm_eval",
    "data": "data",
    "bench": "bench",
    "train": "train",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nsa-eval",
        description="Evaluate Native Sparse Attention beside full attention and sparse baselines.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMANDS.values():
        importlib.import_module(f"nsa_eval.commands.{module_name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # `nsa-eval lm-eval ...` passes lm-eval's own flags through untouched.
    if argv[:1] == ["lm-eval"]:
        from nsa_eval.commands.lm_eval import run_passthrough

        return _guarded(run_passthrough, argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    return _guarded(args.handler, args)


INTERRUPTED = 130  # 128 + SIGINT


def _guarded(handler, arg) -> int:
    try:
        return int(handler(arg) or 0)
    except UsageError as err:
        print(f"nsa-eval: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as interrupt:
        import signal

        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the message short
        _close_progress_bars()
        lines = str(interrupt).splitlines() if str(interrupt) else [
            "interrupted", "nothing half-written is kept; run the same command again"]
        print("\n".join(f"nsa-eval: {line}" for line in lines), file=sys.stderr)
        return INTERRUPTED


def _close_progress_bars() -> None:
    """Close the progress bars an interrupt left open: otherwise each prints its last state when the
    interpreter exits, after the two-line message."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


if __name__ == "__main__":
    sys.exit(main())
