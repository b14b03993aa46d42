"""Run one model-written program (MBPP, HumanEval) and say whether every line of it ran.

`execute(program, timeout) -> ExecutionResult(passed, outcome)`: the program (a candidate and its
tests, as one Python source) runs in a fresh temporary folder under `code_supervisor.py`, a small
process of the standard library alone that

- passes the program only when it exits with status 0 *and* a harness line after its last
  statement ran (a random token sent back on a pipe), so `sys.exit(0)`, `exit()` or `os._exit(0)`
  before a failing assert is a failure;
- limits its address space (MEMORY_BYTES), CPU time (the timeout), file size (FILE_BYTES), open
  files and processes (PROCESSES), and gives it an environment of PATH, HOME, TMPDIR, locale and
  thread counts only, none of the evaluator's variables;
- runs it as `nobody` when nsa-eval runs as root (and `nobody` can run this Python), so it cannot
  signal the evaluator or read its /proc entries, environment or private files;
- ends it at the timeout and then kills every process it started, in its session or not (a child
  subreaper sees through `setsid` and double forks), before this folder is removed.

Nothing the program does raises here: an executor failure is logged and scored as a failed program.
docs/tasks.md says what the guard does not stop. Code runs only with HF_ALLOW_CODE_EVAL=1.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from nsa_eval.errors import UsageError

TIMEOUT_S = 10.0  # seconds per program (its tests included)
MEMORY_BYTES = 1 << 30  # address space: MBPP and HumanEval solutions need a few MB
FILE_BYTES = 16 << 20  # largest file it may write
PROCESSES = 64  # processes and threads it may have at once (on top of the user's, when not root)
OPEN_FILES = 256
OPT_IN_VAR = "HF_ALLOW_CODE_EVAL"
SUPERVISOR = Path(__file__).with_name("code_supervisor.py")
_SUPERVISOR_GRACE_S = 30.0  # the supervisor's own start and clean-up, on top of the timeout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExecutionResult:
    passed: bool
    outcome: str  # "passed", "exit status 1", "signal SIGKILL", "timed out after 10.0 s", ...


def require_code_eval_opt_in() -> None:
    """Raise a UsageError unless HF_ALLOW_CODE_EVAL=1 (code_eval's opt-in for executing code)."""
    if os.environ.get(OPT_IN_VAR) != "1":
        raise UsageError(
            "this task executes model-generated code to score it; this runs only with the environment "
            f"variable {OPT_IN_VAR}=1 (and confirm_run_unsafe_code=True / lm-eval's "
            f"--confirm_run_unsafe_code). Set them only in a sandbox. {OPT_IN_VAR} is "
            f"{os.environ.get(OPT_IN_VAR)!r}"
        )


def execute(program: str, timeout: float = TIMEOUT_S) -> ExecutionResult:
    """Run `program` (Python source) under the guard above; never raises for what the program does."""
    require_code_eval_opt_in()
    try:
        return _supervise(program, float(timeout))
    except Exception as err:  # noqa: BLE001  the scorer must go on: an executor failure fails the program
        log.warning("nsa-eval code execution failed (scored as a failure): %s: %s", type(err).__name__, err)
        return ExecutionResult(False, f"executor error: {type(err).__name__}: {err}")


def _supervise(program: str, timeout: float) -> ExecutionResult:
    workdir = Path(tempfile.mkdtemp(prefix="nsa-code-"))
    try:
        (workdir / "program.py").write_text(program, encoding="utf-8", errors="surrogatepass")
        limits = {"workdir": str(workdir), "timeout": timeout, "memory_bytes": MEMORY_BYTES,
                  "file_bytes": FILE_BYTES, "processes": PROCESSES, "open_files": OPEN_FILES}
        proc = subprocess.Popen([sys.executable, "-I", "-S", str(SUPERVISOR), json.dumps(limits)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=minimal_environment(workdir), cwd=workdir, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout + _SUPERVISOR_GRACE_S)
        except BaseException:  # a hung supervisor, or Ctrl-C: it kills the program's processes first
            _stop(proc)
            raise
        lines = out.decode("utf-8", "replace").strip().splitlines()
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"the supervisor ended with status {proc.returncode}: "
                               + (err.decode("utf-8", "replace").strip().splitlines() or ["no output"])[-1])
        verdict = json.loads(lines[-1])
        result = ExecutionResult(bool(verdict["passed"]), str(verdict["outcome"]))
        if result.outcome.startswith("not started"):
            log.warning("nsa-eval code execution: %s", result.outcome)
        if str(verdict.get("user", "")).startswith("root"):
            _warn_runs_as_root(verdict["user"])
        return result
    finally:
        _remove_tree(workdir)


@functools.cache
def _warn_runs_as_root(user: str) -> None:
    log.warning("nsa-eval code execution: model-written code runs as %s, so it could signal or read the "
                "evaluator's processes and files; install Python where other users can run it, or run "
                "nsa-eval as a non-root user, to have it run as nobody", user)


def minimal_environment(workdir: Path) -> dict[str, str]:
    """What the program's process sees: no variable of the evaluator (tokens, keys, paths)."""
    one_thread = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(workdir), "TMPDIR": str(workdir),
            "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", **one_thread}


def _stop(proc: subprocess.Popen) -> None:
    """Ask the supervisor to end the program and its processes (SIGTERM), then make sure it ends."""
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)
    except (subprocess.TimeoutExpired, OSError):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait()


def _remove_tree(folder: Path) -> None:
    """Remove the program's folder whatever it left there; a failure is logged, never raised."""
    for attempt in range(3):
        shutil.rmtree(folder, ignore_errors=True)
        if not os.path.lexists(folder):
            return
        for root, dirs, _ in os.walk(folder):  # a program may have taken write permission off its folders
            for name in dirs:
                try:
                    os.chmod(os.path.join(root, name), 0o700)
                except OSError:
                    pass
        time.sleep(0.05 * (attempt + 1))
    log.warning("nsa-eval code execution: could not remove %s", folder)
