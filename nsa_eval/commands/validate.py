"""`nsa-eval validate SUITE.yaml`: check a suite (keys, types, names, data) without running it."""

from __future__ import annotations


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "validate", help="check a suite file without running it",
        description="Check every key, type, method, checkpoint, task and offline data file of a suite. "
        "Exit code 2 with one message naming the file and key on the first problem.",
    )
    parser.add_argument("suite", help="a suite YAML file, e.g. configs/quickstart.yaml")
    parser.add_argument("--limit", type=int, default=None, help="documents per task (as for run)")
    parser.add_argument("--only", default=None, help="glob over 'MODEL/TASK' cell names (as for run)")
    parser.add_argument("--device", default=None,
                        help="check as `run --device D` would (and that this machine has it)")
    parser.set_defaults(handler=handle)


def handle(args) -> int:
    """A device this machine lacks (cuda on a CPU machine) is a warning, not an error: a suite may
    be validated on a laptop for a GPU machine. With --device, the device must exist here."""

    from nsa_eval.errors import print_warning
    from nsa_eval.folders import check_output_folders
    from nsa_eval.suite import check_suite, load_suite

    suite = load_suite(args.suite)
    check_output_folders([(f"{args.suite}: output", suite.output, "run"),
                          (f"{args.suite}: report", suite.report, "report")])
    warnings = check_suite(suite, device=args.device, runs_here=args.device is not None)
    cells = suite.cells(limit=args.limit, only=args.only)
    for warning in warnings:
        print_warning(warning)
    print(f"{args.suite}: suite {suite.name!r} is valid: {len(suite.models)} models x "
          f"{len(suite.tasks)} tasks = {len(cells)} cells")
    for cell in cells:
        print(f"  {cell.key[:16]}  {cell.label}")
    return 0
