"""`nsa-eval run SUITE.yaml`: evaluate a suite's cells resumably, then write its report."""

from __future__ import annotations


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "run", help="run a suite (resumable) and write its report",
        description="Validate the suite, evaluate every model x task cell not already done (each "
        "model loads once; each cell's files are written the moment it finishes), then write the "
        "report. Re-running the same command resumes.",
    )
    parser.add_argument("suite", help="a suite YAML file, e.g. configs/quickstart.yaml")
    parser.add_argument("--limit", type=int, default=None,
                        help="at most N documents per task (a different limit is a different cell)")
    parser.add_argument("--only", default=None,
                        help="run only cells whose 'MODEL/TASK' name matches this glob or substring")
    parser.add_argument("--device", default=None, help="override every model's device (cpu, cuda, cuda:1)")
    parser.add_argument("--output", default=None,
                        help="run directory (default: the suite's `output`); its report then goes to "
                        "OUTPUT/report, not the suite's `report`, and `nsa-eval report OUTPUT` writes "
                        "there too")
    parser.add_argument("--report-dir", default=None,
                        help="this run's report directory (default: OUTPUT/report with --output, else "
                        "the suite's `report`)")
    parser.add_argument("--no-report", action="store_true", help="do not write the report at the end")
    parser.set_defaults(handler=handle)


def handle(args) -> int:

    from nsa_eval.errors import UsageError, print_warning
    from nsa_eval.folders import check_output_folders
    from nsa_eval.suite import check_suite, load_suite

    if args.limit is not None and args.limit <= 0:
        raise UsageError(f"--limit: expected a positive integer, got {args.limit}")
    suite = load_suite(args.suite)
    run_report, report_dir, report_origin = _report_dirs(args, suite)
    output_origin = "--output" if args.output else f"{args.suite}: output"
    folders = [(output_origin, args.output or suite.output, "run")]
    if not args.no_report:
        folders.append((report_origin, report_dir, "report"))
    check_output_folders(folders)
    for warning in check_suite(suite, device=args.device, runs_here=True):
        print_warning(warning)
    suite.cells(limit=args.limit, only=args.only)  # an --only that matches nothing fails here

    from nsa_eval.runner import is_main_process, run_suite

    summary = run_suite(suite, args.output, limit=args.limit, only=args.only, device=args.device,
                        report_dir=run_report)
    print(f"{summary.run_dir}: {summary.computed} cells computed, {summary.skipped} already done")
    if args.no_report or not is_main_process():
        return 0
    from nsa_eval.report import write_report

    out = write_report(summary.run_dir, report_dir)
    print(f"report: {out / 'report.md'} and {out / 'report.html'}")
    return 0


def _report_dirs(args, suite) -> tuple[str, str, str]:
    """(the run directory's report folder, this run's report folder, the flag or key that chose it).

    A run into `--output DIR` keeps its report beside its cells, in DIR/report, so a scratch run
    never overwrites the suite's (often committed) `report`; run.json records that folder, so a
    later `nsa-eval report DIR` writes there too. `--report-dir` places this run's report only."""
    from pathlib import Path

    if args.output:
        run_report, origin = str(Path(args.output) / "report"), "--output"
    else:
        run_report, origin = suite.report, f"{args.suite}: report"
    if args.report_dir:
        return run_report, args.report_dir, "--report-dir"
    return run_report, run_report, origin
