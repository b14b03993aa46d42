"""`nsa-eval data`: benchmark data on local disk.

    nsa-eval data fetch [TASK...] [--suite SUITE.yaml] [--force]   download the tasks' hub datasets as
                                                                   JSONL into $NSA_EVAL_DATA
    nsa-eval data list [TASK...] [--suite SUITE.yaml]              the tasks, and their files on disk
    nsa-eval data check [TASK...] [--suite SUITE.yaml]             the error a run would raise offline

`--suite` adds every task of a suite file (and reads its include_path), so
`nsa-eval data fetch --suite configs/paper.yaml` fetches all the data the paper's suite reads.
The folder is $NSA_EVAL_DATA (default ~/.cache/nsa-eval/data); docs/tasks.md describes its layout.
"""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    parser = subparsers.add_parser("data", help="fetch and list benchmark data for offline runs")
    actions = parser.add_subparsers(dest="data_command", metavar="ACTION")

    fetch = actions.add_parser("fetch", help="download tasks' data into $NSA_EVAL_DATA (needs network)")
    _task_arguments(fetch, "task or group names, e.g. nsa_longbench")
    fetch.add_argument("--force", action="store_true", help="download again even when the files exist")
    fetch.set_defaults(handler=_fetch)

    listing = actions.add_parser("list", help="the project's tasks and their data on disk")
    _task_arguments(listing, "default: every project task")
    listing.set_defaults(handler=_list)

    check = actions.add_parser("check", help="fail as an offline run would when data is missing")
    _task_arguments(check, "task or group names")
    check.set_defaults(handler=_check)

    parser.set_defaults(handler=lambda args: parser.print_help() or 2)


def _task_arguments(parser: argparse.ArgumentParser, help_text: str) -> None:
    parser.add_argument("tasks", nargs="*", metavar="TASK", help=help_text)
    parser.add_argument("--suite", metavar="SUITE.yaml", default=None,
                        help="also every task of this suite file, e.g. configs/paper.yaml")


def _requested(args: argparse.Namespace, default: list[str] | None = None):
    """(task names, task manager or None): the named tasks, then the suite's, without repeats."""
    from nsa_eval.errors import UsageError

    names, manager = list(args.tasks), None
    if args.suite:
        from nsa_eval.suite import load_suite, suite_task_manager

        suite = load_suite(args.suite)
        names += [task.task for task in suite.tasks]
        manager = suite_task_manager(suite.include_path) if suite.include_path else None
    if not names:
        if default is None:
            raise UsageError(f"nsa-eval data {args.data_command}: name at least one task (e.g. "
                             "nsa_longbench) or give --suite SUITE.yaml")
        names = default
    return list(dict.fromkeys(names)), manager


def _fetch(args: argparse.Namespace) -> int:
    from nsa_eval.tasks import data_dir, fetch

    names, manager = _requested(args)
    written = fetch(names, force=args.force, manager=manager)
    print(f"{len(written)} file(s) written under {data_dir()}")
    return 0


def _list(args: argparse.Namespace) -> int:
    from nsa_eval.tasks import PROJECT_TASKS, data_dir
    from nsa_eval.tasks.data import data_specs, hub_loaded_tasks

    names, manager = _requested(args, default=list(PROJECT_TASKS))
    hub = set(hub_loaded_tasks(names, manager))
    print(f"data dir: {data_dir()}")
    for name, specs in data_specs(names, manager).items():
        if name in hub:
            state = "lm-eval reads the hub itself"
        elif not specs:
            state = "builds its own data"
        else:
            missing = sum(bool(spec.missing()) for spec in specs)
            state = f"{len(specs) - missing}/{len(specs)} datasets on disk"
        print(f"{name:36s} {state:28s} {PROJECT_TASKS.get(name, '')}")
    return 0


def _check(args: argparse.Namespace) -> int:

    from nsa_eval.errors import print_warning
    from nsa_eval.tasks.data import task_data_warnings

    names, manager = _requested(args)
    warnings = task_data_warnings(names, manager)
    for warning in warnings:
        print_warning(warning)
    print("all data on disk" if not warnings else f"{len(warnings)} task(s) not fully on disk")
    return 0
