"""`nsa-eval data`: benchmark data on local disk.

    nsa-eval data fetch TASK... [--force]   download the tasks' hub datasets as JSONL into $NSA_EVAL_DATA
    nsa-eval data list [TASK...]            the project's tasks and whether their files are on disk
    nsa-eval data check TASK...             the error a run would raise offline, without running

The folder is $NSA_EVAL_DATA (default ~/.cache/nsa-eval/data); docs/tasks.md describes its layout.
"""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    parser = subparsers.add_parser("data", help="fetch and list benchmark data for offline runs")
    actions = parser.add_subparsers(dest="data_command", metavar="ACTION")

    fetch = actions.add_parser("fetch", help="download tasks' data into $NSA_EVAL_DATA (needs network)")
    fetch.add_argument("tasks", nargs="+", metavar="TASK", help="task or group names, e.g. nsa_longbench")
    fetch.add_argument("--force", action="store_true", help="download again even when the files exist")
    fetch.set_defaults(handler=_fetch)

    listing = actions.add_parser("list", help="the project's tasks and their data on disk")
    listing.add_argument("tasks", nargs="*", metavar="TASK", help="default: every project task")
    listing.set_defaults(handler=_list)

    check = actions.add_parser("check", help="fail as an offline run would when data is missing")
    check.add_argument("tasks", nargs="+", metavar="TASK")
    check.set_defaults(handler=_check)

    parser.set_defaults(handler=lambda args: parser.print_help() or 2)


def _fetch(args: argparse.Namespace) -> int:
    from nsa_eval.tasks import data_dir, fetch

    written = fetch(args.tasks, force=args.force)
    print(f"{len(written)} file(s) written under {data_dir()}")
    return 0


def _list(args: argparse.Namespace) -> int:
    from nsa_eval.tasks import PROJECT_TASKS, data_dir
    from nsa_eval.tasks.data import data_specs

    names = args.tasks or list(PROJECT_TASKS)
    print(f"data dir: {data_dir()}")
    for name, specs in data_specs(names).items():
        if not specs:
            state = "builds its own data"
        else:
            missing = sum(bool(spec.missing()) for spec in specs)
            state = f"{len(specs) - missing}/{len(specs)} datasets on disk"
        print(f"{name:36s} {state:28s} {PROJECT_TASKS.get(name, '')}")
    return 0


def _check(args: argparse.Namespace) -> int:
    from nsa_eval.tasks import check_task_data
    from nsa_eval.tasks.data import data_specs

    check_task_data(args.tasks)
    missing = [s for specs in data_specs(args.tasks).values() for s in specs if s.missing()]
    print(
        "all data on disk" if not missing else f"{len(missing)} dataset(s) not on disk: the hub will be used"
    )
    return 0
