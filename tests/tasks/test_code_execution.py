"""The executor of model-written code (MBPP, HumanEval): hostile and careless programs as fixtures.

Each program below would be scored as a pass, or would outlive or break the evaluator, without the
guard: exiting with status 0 before a failing assert, leaving processes behind (setsid, double
fork), writing in its folder while it is removed, taking memory, processes or disk, reading the
evaluator's environment or signalling it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from nsa_eval.tasks import code_execution, mbpp
from nsa_eval.tasks.code_execution import SUPERVISOR, execute

ADD = "def add(a, b):\n    return a + b\n"
FAILING_TESTS = "assert add(1, 2) == 4\n"


@pytest.fixture(autouse=True)
def opted_in(monkeypatch):
    monkeypatch.setenv("HF_ALLOW_CODE_EVAL", "1")


@pytest.fixture
def temp_root(monkeypatch):
    """The executor's temporary folders go here (a folder `nobody` can reach, like /tmp itself)."""
    root = Path(tempfile.mkdtemp(prefix="nsa-test-code-"))
    root.chmod(0o755)
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def processes_with(marker: str) -> list[int]:
    """Live processes whose command line holds `marker` (zombies have none)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                continue
    return found


def sleeper(marker: str) -> str:
    """Source that replaces the current process with a python sleeping a minute, `marker` in argv."""
    return f"os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])"


def test_a_right_program_passes_and_a_wrong_one_fails():
    assert execute(ADD + "assert add(1, 2) == 3\n") == code_execution.ExecutionResult(True, "passed")
    assert execute(ADD + FAILING_TESTS) == code_execution.ExecutionResult(False, "exit status 1")
    assert not execute("def add(a, b) return\n" + FAILING_TESTS).passed  # a syntax error
    assert not execute("x = '\0'\nassert True\n").passed  # a null byte in the source


@pytest.mark.parametrize("leave", ["import sys\nsys.exit(0)", "import os\nos._exit(0)", "exit()", "quit()",
                                   "raise SystemExit", "import os, signal\nos.kill(os.getpid(), 0)\nexit(0)"])
def test_leaving_with_status_0_before_a_failing_assert_fails(leave):
    result = execute(ADD + leave + "\n" + FAILING_TESTS)
    assert result == code_execution.ExecutionResult(False, "exit status 0 before its last statement ran")


def test_writing_on_the_harness_channel_does_not_fake_a_pass():
    program = "import os\nos.write(3, b'started\\n' + b'0' * 32)\nos._exit(0)\n" + FAILING_TESTS
    assert not execute(program).passed


def test_a_child_that_leaves_the_session_is_killed_with_the_program(temp_root):
    """setsid then a double fork: the grandchild belongs to no session or group of the program."""
    marker = f"nsa-test-escape-{uuid.uuid4().hex}"
    program = textwrap.dedent(f"""\
        import os, sys, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                {sleeper(marker)}
            os._exit(0)
        time.sleep(0.5)
        assert True
        """)
    assert execute(program, timeout=10).passed
    time.sleep(0.2)
    assert processes_with(marker) == []


def test_a_program_that_hangs_is_stopped_with_every_process_it_started(temp_root):
    marker = f"nsa-test-hang-{uuid.uuid4().hex}"
    program = (f"import os, sys, time\nif os.fork() == 0:\n    os.setsid()\n    {sleeper(marker)}\n"
               "time.sleep(60)\n")
    started = time.monotonic()
    result = execute(program, timeout=1.0)
    assert result == code_execution.ExecutionResult(False, "timed out after 1.0 s")
    assert time.monotonic() - started < 10
    time.sleep(0.2)
    assert processes_with(marker) == []


def test_a_process_that_keeps_writing_in_the_folder_does_not_break_the_scorer(temp_root):
    """A detached writer used to make rmtree fail with ENOTEMPTY, out of the scorer and the run."""
    program = textwrap.dedent("""\
        import os, time
        if os.fork() == 0:
            os.setsid()
            i = 0
            while True:
                i += 1
                try:
                    os.makedirs(f"d{i % 7}/e", exist_ok=True)
                    open(f"d{i % 7}/e/f{i % 50}", "w").write("x")
                except OSError:
                    pass
        time.sleep(0.3)
        """)
    assert mbpp.pass_at_1(references=["assert True"], predictions=[program]) == 1.0
    assert list(temp_root.iterdir()) == []  # its folder is gone, whatever it left running


def test_memory_is_limited():
    assert not execute("x = bytearray(2 << 30)\nx[-1] = 1\nassert x[-1] == 1\n").passed


def test_processes_are_limited(temp_root):
    marker = f"nsa-test-fork-{uuid.uuid4().hex}"
    program = (f"import os, sys\nfor _ in range(200):\n    if os.fork() == 0:\n        {sleeper(marker)}\n"
               "assert True\n")
    assert not execute(program, timeout=10).passed
    time.sleep(0.2)
    assert processes_with(marker) == []


def test_file_size_is_limited(temp_root):
    program = ("import os\nwith open('big', 'wb') as f:\n    f.write(b'x' * (32 << 20))\n"
               "assert os.path.getsize('big') == 32 << 20\n")
    assert not execute(program).passed


def test_cpu_time_is_limited():
    program = "import resource\nassert 0 < resource.getrlimit(resource.RLIMIT_CPU)[1] <= 4\n"
    assert execute(program, timeout=2.0).passed


def test_the_program_sees_none_of_the_evaluators_environment(monkeypatch, temp_root):
    monkeypatch.setenv("NSA_TEST_SECRET_TOKEN", "hunter2")
    allowed = set(code_execution.minimal_environment(Path("x")))
    program = (f"import os\nassert 'NSA_TEST_SECRET_TOKEN' not in os.environ\n"
               f"assert 'HF_ALLOW_CODE_EVAL' not in os.environ\nassert set(os.environ) <= {allowed!r}, "
               "sorted(os.environ)\n")
    assert execute(program).passed


def test_an_executor_failure_is_a_failed_program_not_an_exception(monkeypatch, temp_root, caplog):
    def broken(*args, **kwargs):
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(code_execution.subprocess, "Popen", broken)
    result = execute(ADD + "assert add(1, 2) == 3\n")
    assert not result.passed and result.outcome == "executor error: OSError: [Errno 24] Too many open files"
    assert "code execution failed" in caplog.text
    assert mbpp.pass_at_1(references=["assert True"], predictions=["pass"]) == 0.0
    assert list(temp_root.iterdir()) == []


def _python_nobody_can_run() -> str | None:
    """A Python outside closed folders (the supervisor drops root to nobody only for such a one)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        path = os.path.realpath(candidate)
        if os.path.isfile(path) and all(os.stat(p).st_mode & 0o001 for p in Path(path).parents):
            return candidate
    return None


@pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0, reason="the drop to nobody happens only as root")
def test_as_root_the_program_runs_as_nobody_and_cannot_touch_the_evaluator(temp_root):
    python = _python_nobody_can_run()
    if python is None:
        pytest.skip("no Python here that uid 65534 can run")
    workdir = Path(tempfile.mkdtemp(dir=temp_root))
    evaluator = os.getpid()
    (workdir / "program.py").write_text(textwrap.dedent(f"""\
        import os
        assert os.getuid() == 65534 and os.getgid() == 65534
        try:
            os.kill({evaluator}, 0)
        except PermissionError:
            pass
        else:
            raise AssertionError("it could signal the evaluator")
        try:
            open("/proc/{evaluator}/environ", "rb").read()
        except PermissionError:
            pass
        else:
            raise AssertionError("it could read the evaluator's environment")
        """))
    limits = {"workdir": str(workdir), "timeout": 10.0, "memory_bytes": 1 << 30, "file_bytes": 1 << 20,
              "processes": 16, "open_files": 64}
    out = subprocess.run([python, "-I", "-S", str(SUPERVISOR), json.dumps(limits)], capture_output=True,
                         text=True, timeout=60, env=code_execution.minimal_environment(workdir))
    verdict = json.loads(out.stdout.strip().splitlines()[-1])
    assert verdict == {"passed": True, "outcome": "passed", "user": "nobody"}, out.stderr


def test_the_supervisor_imports_nothing_but_the_standard_library():
    """It runs as `python -I -S`: an import of nsa_eval or a third-party package would fail there."""
    import ast

    tree = ast.parse(SUPERVISOR.read_text())
    modules = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert modules <= set(sys.stdlib_module_names), modules - set(sys.stdlib_module_names)
