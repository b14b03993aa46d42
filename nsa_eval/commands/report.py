"""`nsa-eval report RUN_DIR`: rebuild a run's comparison report from its saved cells alone."""

from __future__ import annotations


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "report", help="write the comparison report of a run directory",
        description="Read a run directory's finished cells (config.json, results.json, samples.jsonl) "
        "and write report.md, report.html (self-contained), CSV and JSON of every number, and PNG "
        "figures.",
    )
    parser.add_argument("run_dir", help="a run directory written by `nsa-eval run`")
    parser.add_argument("--output", default=None,
                        help="report directory (default: the one the run recorded: the suite's `report`, "
                        "e.g. reports/quickstart, or RUN_DIR/report for `run --output RUN_DIR`)")
    parser.add_argument("--bootstrap", type=int, default=2000,
                        help="bootstrap resamples for the paired confidence intervals (>= 1)")
    parser.set_defaults(handler=handle)


def handle(args) -> int:
    from nsa_eval.folders import check_folder
    from nsa_eval.report import check_bootstrap, write_report
    from nsa_eval.runner import check_run_dir

    iters = check_bootstrap(args.bootstrap)  # before any work
    run_dir = check_run_dir(args.run_dir)
    if args.output:
        check_folder(args.output, "report", "--output")
    out = write_report(run_dir, args.output, bootstrap=iters)
    print(f"report: {out / 'report.md'} and {out / 'report.html'}")
    return 0
