"""The supervisor of one model-written program: runs it under limits, then kills all it left.

Started by `code_execution.execute` as `python -I -S code_supervisor.py LIMITS` (LIMITS is JSON:
workdir, timeout, memory_bytes, file_bytes, processes, open_files), with a minimal environment and
the standard library only, so nothing of the evaluator is imported here. It

1. makes itself a child subreaper (Linux `PR_SET_CHILD_SUBREAPER`), so every process the program
   starts, even one that leaves its session with `setsid` and double-forks, stays its descendant;
2. forks the program's process: a new session, stdin a pipe carrying a random token, stdout and
   stderr to /dev/null, limits on address space, CPU time, file size, open files and processes,
   no new privileges, and, when the supervisor is root, the uid and gid of `nobody`, so the program
   can neither signal nor read the evaluator's processes and files; it then execs `python -I -c
   HARNESS` in WORKDIR;
3. waits for that process until the timeout, then SIGKILLs every descendant (rescanning /proc until
   none is left, so a fork loop cannot outrun it) and reaps them;
4. prints one JSON line: {"passed": bool, "outcome": "..."}.

HARNESS reads the token, runs WORKDIR/program.py as __main__, and only after its last statement
writes the token to fd 3. A pass is exit status 0 and the token: a program that leaves early with
`sys.exit(0)`, `exit()` or `os._exit(0)` never reaches that line.
"""

import ctypes
import json
import os
import resource
import signal
import stat
import sys
import time

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
NOBODY = 65534  # uid and gid of `nobody` on Debian, Red Hat and Alpine alike
RESULT_FD = 3
STARTED = b"started\n"
SETUP_FAILED = "setup failed: "
KILL_PHASE_S = 10.0  # a process stuck in the kernel (D state) is given up on after this

HARNESS = r"""
import os, sys
_write, _token = os.write, os.read(0, 64)
_null = os.open(os.devnull, os.O_RDONLY)
os.dup2(_null, 0)
os.close(_null)
os.set_inheritable(3, False)
_write(3, b"started\n")
with open("program.py", "rb") as _f:
    _code = compile(_f.read(), "program.py", "exec")
exec(_code, {"__name__": "__main__", "__file__": os.path.abspath("program.py"), "__builtins__": __builtins__})
_write(3, _token)
"""


def main() -> None:
    limits = json.loads(sys.argv[1])
    workdir = limits["workdir"]
    stop_at = [time.monotonic() + float(limits["timeout"])]
    signal.signal(signal.SIGTERM, lambda *_: stop_at.__setitem__(0, 0.0))  # the evaluator gives up
    libc = ctypes.CDLL(None, use_errno=True)
    subreaper = _prctl(libc, PR_SET_CHILD_SUBREAPER, 1)
    user = "same"
    if os.geteuid() == 0:
        closed = _closed_to_others(workdir)
        user = "nobody" if closed is None else f"root ({closed})"
    if user == "nobody":
        for folder, _, files in os.walk(workdir):
            for path in [folder, *(os.path.join(folder, f) for f in files)]:
                os.chown(path, NOBODY, NOBODY)
    processes = int(limits["processes"])
    nproc = processes + (_threads_of_user(os.getuid()) if user == "same" else 0)
    token = os.urandom(16).hex().encode()
    token_r, token_w = _high_fds(os.pipe())
    result_r, result_w = _high_fds(os.pipe())
    pid = os.fork()
    if pid == 0:  # the program's process: nothing here may return into the supervisor's code
        try:
            _exec_program(libc, limits, nproc, user == "nobody", token_r, result_w)
        except BaseException as err:  # noqa: BLE001  told to the supervisor through the result pipe
            os.write(RESULT_FD, f"{SETUP_FAILED}{type(err).__name__}: {err}".encode()[:1000])
        finally:
            os._exit(127)
    os.close(token_r)
    os.close(result_w)
    os.write(token_w, token)
    os.close(token_w)
    os.set_blocking(result_r, False)
    status, stopped = _wait(pid, stop_at, processes if subreaper else None)
    received = _read_available(result_r)
    reaped = _kill_all(pid, subreaper)
    status = reaped if status is None else status
    if stopped == "timeout":
        _report(False, f"timed out after {limits['timeout']} s", user)
    elif stopped == "processes":
        _report(False, f"stopped: more than {processes} processes", user)
    elif not received.startswith(STARTED):
        reason = received.decode("utf-8", "replace") if received.startswith(SETUP_FAILED.encode()) else (
            f"the sandboxed python ended with {_describe(status)} before running the program")
        _report(False, f"not started: {reason}", user)
    elif status is not None and os.waitstatus_to_exitcode(status) == 0:
        passed = received == STARTED + token
        _report(passed, "passed" if passed else "exit status 0 before its last statement ran", user)
    else:
        _report(False, _describe(status), user)


def _high_fds(fds: tuple[int, int]) -> tuple[int, int]:
    """The pipe's descriptors moved to 10 and up, clear of 0-3, which the program's process sets."""
    import fcntl

    moved = tuple(fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in fds)
    for fd in fds:
        os.close(fd)
    return moved


def _exec_program(libc, limits: dict, processes: int, as_nobody: bool, token_r: int, result_w: int) -> None:
    os.dup2(result_w, RESULT_FD)  # first: a failure below is reported through it
    os.setsid()
    os.dup2(token_r, 0)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.closerange(RESULT_FD + 1, 65536)
    os.chdir(limits["workdir"])
    _prctl(libc, PR_SET_NO_NEW_PRIVS, 1)  # no setuid binary gives it privileges back
    cpu = int(float(limits["timeout"])) + 2
    for which, value in ((resource.RLIMIT_AS, limits["memory_bytes"]), (resource.RLIMIT_CPU, cpu),
                         (resource.RLIMIT_FSIZE, limits["file_bytes"]), (resource.RLIMIT_CORE, 0),
                         (resource.RLIMIT_NOFILE, limits["open_files"]),
                         (resource.RLIMIT_NPROC, processes)):
        resource.setrlimit(which, (int(value), int(value)))
    if as_nobody:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    _prctl(libc, PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it: no orphaned program
    python = sys.executable
    os.execve(python, [python, "-I", "-c", HARNESS], dict(os.environ))


def _wait(pid: int, stop_at: list, max_processes: int | None) -> tuple[int | None, str | None]:
    """(wait status, why it was stopped: "timeout", "processes" or None). Polls, so a SIGTERM from
    the evaluator ends the wait at once; with `max_processes`, counts the program's processes every
    poll after the first few (RLIMIT_NPROC does not bind root, so this is the limit that does)."""
    delay = 0.0005
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status, None
        if time.monotonic() >= stop_at[0]:
            return None, "timeout"
        if max_processes is not None and delay >= 0.004 and len(_descendants(os.getpid())) > max_processes:
            return None, "processes"
        time.sleep(delay)
        delay = min(delay * 2, 0.02)


def _kill_all(main_pid: int, subreaper: bool) -> int | None:
    """SIGKILL every descendant until none is left and reap them; the main process's wait status
    if it was reaped here. Without a subreaper only the program's own session can be reached."""
    main_status = None
    deadline = time.monotonic() + KILL_PHASE_S
    while time.monotonic() < deadline:
        victims = _descendants(os.getpid()) if subreaper else []
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not subreaper:
            try:
                os.killpg(main_pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        children_left = True
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children_left = False
                break
            if pid == 0:
                break
            if pid == main_pid:
                main_status = status
        if not victims and not children_left:
            return main_status
        time.sleep(0.001)
    return main_status


def _descendants(root: int) -> list[int]:
    """Every process below `root` (zombies included), read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        ppid = int(data[data.rindex(b")") + 2:].split()[1])  # the name in parentheses may hold spaces
        children.setdefault(ppid, []).append(int(entry))
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            found.append(child)
            stack.append(child)
    return found


def _threads_of_user(uid: int) -> int:
    """Threads the user runs now: RLIMIT_NPROC counts them all, the evaluator's included."""
    count = 0
    if not os.path.isdir("/proc"):  # no /proc (macOS): RLIMIT_NPROC stays at the 64 of the program alone
        return 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                count += int(fields["Threads"])
        except (OSError, KeyError, ValueError):
            continue
    return count


def _closed_to_others(workdir: str) -> str | None:
    """What `nobody` could not use, or None: the program's folder, the interpreter and the standard
    library must be reachable (o+x on every folder above, o+rx on the library and the binary)."""
    python = os.path.realpath(sys.executable)
    stdlib = os.path.dirname(os.path.realpath(os.__file__))
    checks = [(os.path.dirname(os.path.abspath(workdir)), stat.S_IXOTH),
              (python, stat.S_IROTH | stat.S_IXOTH), (stdlib, stat.S_IROTH | stat.S_IXOTH)]
    for path, needed in checks:
        if os.stat(path).st_mode & needed != needed:
            return f"{path} is closed to other users"
        folder = os.path.dirname(path)
        while folder != os.path.dirname(folder):
            if not os.stat(folder).st_mode & stat.S_IXOTH:
                return f"{folder} is closed to other users"
            folder = os.path.dirname(folder)
    return None


def _read_available(fd: int) -> bytes:
    chunks = []
    try:
        while chunk := os.read(fd, 4096):
            chunks.append(chunk)
            if sum(map(len, chunks)) > 4096:
                break
    except BlockingIOError:  # a descendant still holds the write end open
        pass
    return b"".join(chunks)


def _describe(status: int | None) -> str:
    if status is None:
        return "no exit status"
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


def _prctl(libc, option: int, value: int) -> bool:
    try:
        return libc.prctl(option, value, 0, 0, 0) == 0
    except AttributeError:  # not Linux: no prctl
        return False


def _report(passed: bool, outcome: str, user: str) -> None:
    print(json.dumps({"passed": passed, "outcome": outcome, "user": user}), flush=True)


if __name__ == "__main__":
    main()
