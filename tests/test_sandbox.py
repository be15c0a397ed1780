"""Hostile programs against the real sandbox (unshare namespaces, privilege drop, rlimits, harness).

Every hostile run must be contained: reward 0 or the correct verdict, this test process unharmed, each case's wall
time (from its fork to its end, as the harness measures it) at most the per-case limit + 1 s, no process left
behind (nothing running as `nobody`, no zombie children of ours) and no file left outside the sandbox.

What a test asserts holds on a slow or loaded machine too: where a verdict would race a time limit (a memory hog
against its deadline, output against the clock), the limit is generous and the verdict is what must come first on
any machine; the sandbox's own start (unshare, the interpreter, the prelude) is not timed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import signal
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from gapo.proc import processes, stat_fields
from gapo.reward.code import CodeRunner
from gapo.reward.sandbox import (
    NOBODY_UID,
    CallCase,
    Limits,
    SandboxRun,
    StdioCase,
    namespaces_available,
    run_program,
)
from gapo.reward.types import FLAG_HOST_FAULT

LIMITS = Limits(wall_s=2.0, memory_mb=256)
REPO = Path(__file__).resolve().parents[1]
LEET_TESTS = {"functional": "def check(candidate):\n    assert candidate([1, 2, 3]) == 6\n"
                            "    assert candidate([]) == 0\n\ncheck(Solution().total)"}
GOOD_SOLUTION = "class Solution:\n    def total(self, nums: List[int]) -> int:\n        return sum(nums)\n"
WRONG_SOLUTION = "class Solution:\n    def total(self, nums: List[int]) -> int:\n        return 0\n"


def _nobody_processes() -> list[int]:
    """Processes running as nobody that this test started (its descendants) or that escaped to init (parent 1). A
    sandboxed program of another test process running beside this one (pytest -n) is neither."""
    parent, nobody = {}, []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        except (FileNotFoundError, ProcessLookupError):
            continue  # the process ended while we looked
        pid = int(status.parent.name)
        parent[pid] = int(fields["PPid"])
        if int(fields["Uid"].split()[0]) == NOBODY_UID:
            nobody.append(pid)

    def ours(pid: int) -> bool:
        while pid > 1:
            pid = parent.get(pid, 0)
            if pid == os.getpid():
                return True
        return False

    return [pid for pid in nobody if parent.get(pid) in (0, 1) or ours(pid)]


def _zombie_children() -> list[int]:
    me = os.getpid()
    return [pid for pid, fields in processes() if fields[0] == "Z" and int(fields[1]) == me]


def assert_nothing_left_behind() -> None:
    deadline = time.monotonic() + 2.0
    while (_nobody_processes() or _zombie_children()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _nobody_processes() == [], "sandboxed processes survived the run"
    assert _zombie_children() == [], "unreaped children"


ONE_EMPTY_CASE = (StdioCase(""),)


def run_contained(program: str, cases=ONE_EMPTY_CASE, limits: Limits = LIMITS, **kwargs) -> SandboxRun:
    """Run and check containment. Each case is timed from its fork, so a slow sandbox start on a loaded machine
    cannot fail the check; the run as a whole stayed within the host's backstop deadline (no run.error)."""
    run = run_program(program, cases, limits, **kwargs)
    assert run.error is None, run.error
    for outcome in run.outcomes:
        assert outcome.wall_s <= limits.wall_s + 1.0, outcome
    assert_nothing_left_behind()
    return run


@pytest.fixture(scope="module")
def runner():
    with CodeRunner(num_workers=2, timeout_s=LIMITS.wall_s, memory_mb=LIMITS.memory_mb) as r:
        yield r


@pytest.fixture(scope="module")
def patient():
    """A runner whose time limit no test reaches, for verdicts that must not race the clock on a loaded machine."""
    with CodeRunner(num_workers=2, timeout_s=120.0, memory_mb=LIMITS.memory_mb) as r:
        yield r


def test_isolation_is_available_here() -> None:
    """Sessions and CI run as root with util-linux: the real mechanism, not the fallback, is under test."""
    assert namespaces_available()
    run = run_contained("import os\nprint(os.getuid(), os.getpid())")
    assert run.isolated
    assert run.outcomes[0].stdout.split() == [str(NOBODY_UID), "2"]  # PID 1 is the harness


# --------------------------------------------------------------------------------------------------
# Resource exhaustion
# --------------------------------------------------------------------------------------------------
def test_fork_bomb(runner: CodeRunner) -> None:
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    run = run_contained(bomb)
    assert run.outcomes[0].status in ("timeout", "error")
    [result] = runner.score([f"```python\n{bomb}```"], {"inputs": [""], "outputs": ["1"]})
    assert result.reward == 0.0
    assert_nothing_left_behind()


def test_memory_hog() -> None:
    """Both hogs reach the 256 MB cap within a few allocations; the time limit is generous so that a loaded machine,
    however slow to fill the pages, cannot reach it first (at 2 s it once did: 'timeout' instead of 'error')."""
    limits = Limits(wall_s=60.0, memory_mb=256)
    gradual = run_contained("blocks = []\nwhile True:\n    blocks.append(bytearray(64 * 1024 * 1024))\n",
                            limits=limits)
    assert gradual.outcomes[0].status == "error" and "MemoryError" in gradual.outcomes[0].stderr
    at_once = run_contained("x = bytearray(8 * 1024 ** 3)\n", limits=limits)
    assert at_once.outcomes[0].status == "error" and "MemoryError" in at_once.outcomes[0].stderr


@pytest.mark.parametrize(
    "program",
    [
        "while True:\n    pass\n",
        "import time\ntime.sleep(10 ** 6)\n",
        "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "while True:\n    pass\n",
    ],
    ids=["busy-loop", "sleep", "ignores-signals"],
)
def test_time_limits(runner: CodeRunner, program: str) -> None:
    run = run_contained(program)
    assert run.outcomes[0].status == "timeout"
    [result] = runner.score([f"```python\n{program}```"], LEET_TESTS)
    assert result.status == "timeout" and result.reward == 0.0


def test_printing_a_gigabyte_is_cut_off() -> None:
    """Status output_limit, not timeout, proves the cap stopped the program before its (generous) time limit."""
    limits = Limits(wall_s=60.0, memory_mb=256)
    for stream in ("stdout", "stderr"):
        run = run_contained(f"import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(1024):\n"
                            f"    sys.{stream}.write(chunk)\n", limits=limits)
        assert run.outcomes[0].status == "output_limit"
        assert len(run.outcomes[0].stdout) <= limits.max_output_bytes + (1 << 20)


def test_file_size_limit() -> None:
    run = run_contained("with open('big', 'wb') as f:\n    f.write(b'x' * (64 << 20))\n")
    assert run.outcomes[0].status == "error"
    assert "File too large" in run.outcomes[0].stderr  # RLIMIT_FSIZE (Python ignores SIGXFSZ: EFBIG)


# --------------------------------------------------------------------------------------------------
# Network, files, secrets
# --------------------------------------------------------------------------------------------------
CONNECT = """\
import socket, sys
host, port = sys.stdin.read().split()
try:
    socket.create_connection((host, int(port)), timeout=1).close()
    print("CONNECTED")
except OSError as exc:
    print("refused", exc.errno)
"""


def test_no_network_to_localhost_or_outside() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    port = server.getsockname()[1]
    try:
        run = run_contained(CONNECT, [StdioCase(f"127.0.0.1 {port}"), StdioCase("192.0.2.1 80")])
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing ever reached our listener
    finally:
        server.close()
    assert [o.stdout.strip() for o in run.outcomes] == ["refused 101", "refused 101"]  # ENETUNREACH
    dns = run_contained("import socket\ntry:\n    socket.getaddrinfo('example.com', 80)\n    print('RESOLVED')\n"
                        "except OSError as exc:\n    print(type(exc).__name__)\n")
    assert dns.outcomes[0].status == "ok" and dns.outcomes[0].stdout.split() == ["gaierror"], dns.outcomes[0]


def test_writes_outside_the_sandbox_leave_nothing(tmp_path: Path) -> None:
    name = f"gapo-hostile-{uuid.uuid4().hex}"
    targets = [f"/tmp/{name}", f"/var/tmp/{name}", f"/dev/shm/{name}", str(REPO / name), str(tmp_path / name),
               f"{REPO}/gapo/{name}.py"]
    program = "import sys\nfor path in sys.stdin.read().split():\n    try:\n        open(path, 'w').write('x')\n" \
              "        print('WROTE', path)\n    except OSError as exc:\n        print('denied', path, exc.errno)\n" \
              "open('in-workdir', 'w').write('fine')\nprint(open('in-workdir').read())\n"
    run = run_contained(program, [StdioCase("\n".join(targets))])
    assert run.outcomes[0].stdout.strip().endswith("fine")  # the working dir itself is writable
    for target in targets:
        assert not os.path.exists(target), target
    # /tmp and friends are private tmpfs mounts: writes there "succeed" but vanish with the namespace
    assert f"denied {REPO / name}" in run.outcomes[0].stdout


def test_no_secrets_in_the_environment_or_home(monkeypatch, tmp_path: Path, data_dirs: list[Path]) -> None:
    monkeypatch.setenv("GAPO_FAKE_SECRET", "hunter2")
    secret = tmp_path / "id_rsa"
    secret.write_text("PRIVATE KEY")
    secret.chmod(0o600)
    program = f"""\
import json, os
report = {{"env": dict(os.environ), "home": os.path.expanduser("~")}}
for path in ("/root/.ssh", os.path.expanduser("~/.ssh"), {str(secret)!r}, "/proc/1/environ",
             *{[str(d) for d in data_dirs]!r}, {str(REPO / "tests")!r}):
    try:
        report[path] = os.listdir(path) if os.path.isdir(path) else open(path).read()
    except OSError as exc:
        report[path] = exc.errno
print(json.dumps(report))
"""
    run = run_contained(program)
    report = json.loads(run.outcomes[0].stdout)
    assert "hunter2" not in run.outcomes[0].stdout and "PRIVATE KEY" not in run.outcomes[0].stdout
    assert set(report["env"]) == {"PATH", "HOME", "TMPDIR", "LANG"}
    assert report["home"] == report["env"]["HOME"] == "/tmp/work"  # the private working dir
    assert report["/root/.ssh"] == 2 and report[str(secret)] == 2  # ENOENT: /root and /tmp are masked
    assert report["/proc/1/environ"] == 13  # EACCES: the harness's memory is not ours to read
    assert all(report[str(d)] == 2 for d in data_dirs)  # expected outputs (benchmark data) are out of sight
    assert report[str(REPO / "tests")] == 2


# --------------------------------------------------------------------------------------------------
def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for child, fields in processes():
        children.setdefault(int(fields[1]), []).append(child)
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _when_the_program_runs(deadline_s: float = 30.0) -> int:
    """The pid of this test's sandboxed program (running as nobody) once it runs, however slow the sandbox's start."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if pids := _nobody_processes():
            return pids[0]
        time.sleep(0.02)
    raise AssertionError(f"no sandboxed program ran within {deadline_s:g}s")


def test_a_run_outlives_the_signals_slurm_sends_every_process_of_a_job() -> None:
    """At a preemption (SIGTERM) or ahead of a time limit (SIGUSR1) SLURM signals every process of the job while the
    rank finishes its step: unshare, the harness and the program must go on, or a correct program would fail."""
    hit: list[int] = []

    def slurm() -> None:
        _when_the_program_runs()
        for pid in _descendants(os.getpid()):
            for sig in (signal.SIGTERM, signal.SIGUSR1):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            hit.append(pid)

    sender = threading.Thread(target=slurm)
    sender.start()
    run = run_contained("import time\ntime.sleep(2.5)\nprint(7)\n", limits=Limits(wall_s=30.0, memory_mb=256))
    sender.join()
    assert run.outcomes[0].stdout == "7\n", run.outcomes
    assert len(hit) >= 2  # unshare (or the harness) and the program were signalled


# --------------------------------------------------------------------------------------------------
# Host faults are not wrong answers
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def test_a_program_killed_from_outside_is_a_rewarder_error_not_a_wrong_answer(patient: CodeRunner,
                                                                                sig: signal.Signals) -> None:
    """The host (the OOM killer, a kill aimed at the job) ends the program mid-run, far under its CPU limit: no
    verdict on the program, so a rewarder error naming the signal, flagged host_fault (counted in the step's
    metrics), never "wrong (exit code -9)" for a program the uninterrupted run would have passed."""
    program = "import time\ntime.sleep(60)\nprint(int(input()) * 2)\n"
    killer = threading.Thread(target=lambda: os.kill(_when_the_program_runs(), sig))
    killer.start()
    [result] = patient.score([f"```python\n{program}```"], {"inputs": ["2"], "outputs": ["4"]})
    killer.join()
    assert result.status == "error" and result.reward == 0.0, result
    assert sig.name in result.detail and "host fault" in result.detail, result
    assert result.flags == (FLAG_HOST_FAULT,)
    assert_nothing_left_behind()


def test_a_harness_stopped_by_sigint_is_one_line_on_the_console(patient: CodeRunner, caplog) -> None:
    """SIGINT to the harness ends the run with a Python traceback on its stderr: the warning (the console's) is one
    line naming the exit code and the traceback's last line, the traceback goes to the log at INFO (train.log)."""
    program = "import time\ntime.sleep(60)\n"

    def interrupt_the_harness() -> None:
        harness = int(stat_fields(_when_the_program_runs())[1])  # the program's parent
        os.kill(harness, signal.SIGINT)

    killer = threading.Thread(target=interrupt_the_harness)
    killer.start()
    with caplog.at_level(logging.INFO, logger="gapo.reward"):
        [result] = patient.score([f"```python\n{program}```"], {"inputs": [""], "outputs": ["4"]})
    killer.join()
    assert result.status == "error" and "KeyboardInterrupt" in result.detail and "\n" not in result.detail, result
    [warning] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "exit code 130: KeyboardInterrupt" in warning and "\n" not in warning, warning
    assert any("Traceback" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
    assert_nothing_left_behind()


def test_a_harness_killed_from_outside_is_a_host_fault(patient: CodeRunner) -> None:
    """The sandbox itself killed by the host (its harness, here; its unshare alike) is no verdict on the program: an
    error flagged host_fault (the fault campaign found it flagged only when the program itself was killed)."""
    def kill_the_harness() -> None:
        os.kill(int(stat_fields(_when_the_program_runs())[1]), signal.SIGKILL)  # the program's parent

    killer = threading.Thread(target=kill_the_harness)
    killer.start()
    [result] = patient.score(["```python\nimport time\ntime.sleep(60)\n```"], {"inputs": [""], "outputs": ["4"]})
    killer.join()
    assert result.status == "error" and FLAG_HOST_FAULT in result.flags, result
    assert_nothing_left_behind()


@pytest.mark.parametrize(
    "program",
    [
        "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
        "import signal\nsignal.raise_signal(signal.SIGINT)\n",
        "import os, signal, time\nif os.fork() == 0:\n    os.kill(os.getppid(), signal.SIGKILL)\n    os._exit(0)\n"
        "time.sleep(30)\n",
        "import os, signal, time\nsignal.alarm(1)\ntime.sleep(30)\n",
        "import ctypes\nctypes.string_at(0)\n",
    ],
    ids=["kills-itself", "raises-sigint", "its-fork-kills-it", "its-own-alarm", "segfault"],
)
def test_a_program_that_signals_itself_is_scored_as_its_own_fault(patient: CodeRunner, program: str) -> None:
    """Faults, its own timers and signals it sent itself (the harness notes what it sends) end a program by its own
    doing: a wrong program, not a host fault."""
    run = run_contained(program, limits=Limits(wall_s=30.0, memory_mb=256))
    assert run.outcomes[0].status == "error" and run.outcomes[0].exit_code < 0, run.outcomes[0]
    [result] = patient.score([f"```python\n{program}print(4)\n```"], {"inputs": [""], "outputs": ["4"]})
    assert result.status == "wrong" and result.flags == (), result


def test_the_sigkill_of_its_own_cpu_limit_is_the_programs_timeout() -> None:
    """RLIMIT_CPU's hard limit ends a program that ignores SIGXCPU with SIGKILL: the program's own doing (it used
    its CPU time up), a timeout, never a host fault. The wall limit is far off, so the CPU limit comes first."""
    limits = Limits(wall_s=120.0, cpu_s=1.0, memory_mb=256)
    ignores = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass\n"
    [hard] = run_contained(ignores, limits=limits).outcomes
    assert (hard.status, hard.exit_code) == ("timeout", -signal.SIGKILL), hard
    [soft] = run_contained("while True:\n    pass\n", limits=limits).outcomes
    assert (soft.status, soft.exit_code) == ("timeout", -signal.SIGXCPU), soft
    with CodeRunner(num_workers=1, timeout_s=120.0, memory_mb=256) as runner:
        runner.limits = limits
        [result] = runner.score([f"```python\n{ignores}```"], {"inputs": [""], "outputs": ["4"]})
    assert result.status == "timeout" and result.flags == (), result


# Attacks on the harness and on the verdict
# --------------------------------------------------------------------------------------------------
def test_killing_the_parent_or_this_process_fails(runner: CodeRunner) -> None:
    attack = f"""\
import os, signal
for pid in (os.getppid(), 1, {os.getpid()}):
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
"""
    [result] = runner.score([f"```python\n{attack}{GOOD_SOLUTION}```"], LEET_TESTS)
    assert result.status == "correct"  # the harness survived and judged the (correct) solution
    suicide = run_contained("import os, signal\nos.kill(-1, signal.SIGKILL)\nprint('alive')\n")
    assert suicide.outcomes[0].status == "error" and "alive" not in suicide.outcomes[0].stdout
    assert run_contained("print(7)").outcomes[0].stdout == "7\n"  # and everything still works


@pytest.mark.parametrize(
    ("prefix", "harmless"),
    [
        ("import os\nos._exit(0)\n", False),
        ("import sys\nsys.exit(0)\n", False),
        ("raise SystemExit\n", False),
        ("import builtins, sys\nbuiltins.print = lambda *a, **k: sys.__stdout__.write('All tests passed\\n')\n"
         "sys.exit = lambda *a: None\nprint('OK')\n", True),
        ("import os\nos.close(1)\nos.close(2)\n", True),
        ("import os\nos.write(3, b'0123456789abcdef0123456789abcdef')\nos._exit(0)\n", False),
        ("import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'PASSED' * 8)\n    except OSError:\n"
         "        pass\n", False),  # tampering with the verdict pipe spoils even a correct solution
        ("import threading, time\nthreading.Thread(target=time.sleep, args=(10 ** 6,)).start()\n", True),
    ],
    ids=["os-exit-0", "sys-exit-0", "raise-systemexit", "fake-print-and-exit", "close-stdout",
         "forged-verdict", "spray-all-fds", "thread-outlives-main"],
)
def test_early_exits_and_fakes_cannot_pass_a_wrong_solution(runner: CodeRunner, prefix: str, harmless: bool) -> None:
    wrong, right = runner.score([f"```python\n{prefix}{WRONG_SOLUTION}```", f"```python\n{GOOD_SOLUTION}{prefix}```"],
                                LEET_TESTS)
    assert wrong.status == "wrong", wrong  # not a timeout: leaving early or faking does not hang the run either
    assert right.status == ("correct" if harmless else "wrong"), right
    assert_nothing_left_behind()


@pytest.mark.parametrize(
    "returns",
    [
        "class AlwaysEqual:\n    def __eq__(self, other):\n        return True\n",
        "class AlwaysEqual(int):\n    def __eq__(self, other):\n        return True\n",
        "class AlwaysEqual(list):\n    def __eq__(self, other):\n        return True\n",
    ],
    ids=["object", "int-subclass", "list-subclass"],
)
def test_always_equal_objects_are_rejected(runner: CodeRunner, returns: str) -> None:
    hack = returns + "class Solution:\n    def total(self, nums):\n        return AlwaysEqual()\n"
    [result] = runner.score([f"```python\n{hack}```"], LEET_TESTS)
    assert result.status == "wrong" and "plain data" in result.detail
    call = run_contained(hack, [CallCase("total", [[1]])])
    assert call.outcomes[0].status == "error"  # call-based values must be JSON data too


def test_closing_stdout_in_a_stdin_program_prints_nothing(runner: CodeRunner) -> None:
    [result] = runner.score(["```python\nimport os\nos.close(1)\nprint(int(input()) * 2)\n```"],
                            {"inputs": ["2"], "outputs": ["4"]})
    assert result.status == "wrong"


def test_thread_outliving_main_in_a_stdin_program(runner: CodeRunner) -> None:
    """Python waits for non-daemon threads, so this program never ends: a timeout, within the limit."""
    program = ("import threading, time\nprint(int(input()) * 2)\n"
               "threading.Thread(target=time.sleep, args=(10 ** 6,)).start()\n")
    run = run_contained(program, [StdioCase("2")])
    assert run.outcomes[0].status == "timeout"
    daemon = program.replace("args=(10 ** 6,))", "args=(10 ** 6,), daemon=True)")
    [result] = runner.score([f"```python\n{daemon}```"], {"inputs": ["2"], "outputs": ["4"]})
    assert result.status == "correct"


def test_setsid_double_fork_escapee_is_killed(runner: CodeRunner) -> None:
    escapee = """\
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(1000)
    os._exit(0)
print(int(input()) * 2)
"""
    [result] = runner.score([f"```python\n{escapee}```"], {"inputs": ["2", "5"], "outputs": ["4", "10"]})
    assert result.status == "correct"
    assert_nothing_left_behind()


def test_privilege_escalation_attempts_fail() -> None:
    program = ("import os\nfor call in (lambda: os.setuid(0), lambda: os.chroot('/'), lambda: os.mknod('/dev/x')):\n"
               "    try:\n        call()\n        print('ESCALATED')\n    except OSError as exc:\n"
               "        print(exc.errno)\n")
    [out] = run_contained(program).outcomes
    # the program ran to its end and the kernel refused each call (none skipped): no setuid, no chroot, no device node
    lines = out.stdout.split()
    assert out.status == "ok" and len(lines) == 3, out
    assert int(lines[0]) == int(lines[1]) == errno.EPERM, out.stdout
    assert int(lines[2]) in (errno.EPERM, errno.EACCES, errno.EROFS), out.stdout


def test_many_cases_in_one_sandbox_each_get_a_fresh_process() -> None:
    """No state (globals, threads, children) carries over from one case to the next."""
    program = "import os\nprint(os.getpid())\n"
    run = run_contained(program, [StdioCase("")] * 3)
    pids = [o.stdout.split()[0] for o in run.outcomes]
    assert len(set(pids)) == 3 and all(o.status == "ok" for o in run.outcomes)


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="cases"):
        run_program("print(1)", [])
    with pytest.raises(ValueError, match="isolation"):
        run_program("print(1)", [StdioCase("")], isolation="maybe")
    with pytest.raises(ValueError, match="Limits.wall_s"):
        Limits(wall_s=0)
    with pytest.raises(TypeError, match="program"):
        run_program(b"print(1)", [StdioCase("")])


# --------------------------------------------------------------------------------------------------
# The loud fallback (no namespaces)
# --------------------------------------------------------------------------------------------------
def test_fallback_is_loud_and_still_contains_time_and_escapees(caplog) -> None:
    before = set(Path(tempfile.gettempdir()).glob("gapo-sandbox-*"))
    caplog.set_level(logging.WARNING, logger="gapo.reward")
    ok = run_contained("print(int(input()) + 1)", [StdioCase("41")], isolation="none")
    assert not ok.isolated and ok.outcomes[0].stdout == "42\n"
    slow = run_contained("import time\ntime.sleep(1000)", isolation="none")
    assert slow.outcomes[0].status == "timeout"
    escapee = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
               "        time.sleep(1000)\n    os._exit(0)\nprint('done')\n")
    run_contained(escapee, isolation="none")  # the subreaper harness finds and kills the grandchild
    assert set(Path(tempfile.gettempdir()).glob("gapo-sandbox-*")) == before  # working dirs removed
    import gapo.reward.sandbox as sandbox

    sandbox._warned_unisolated = False
    run_contained("print(1)", isolation="none")
    assert any("SANDBOX NOT ISOLATED" in r.getMessage() for r in caplog.records)
