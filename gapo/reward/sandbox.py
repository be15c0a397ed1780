"""Run untrusted, model-written Python programs against test cases without letting them hurt anything.

Mechanism (why each layer exists):
  * `unshare --net --pid --fork --mount-proc --kill-child` (util-linux, needs root) gives every run an
    empty network namespace (no interface is up: even 127.0.0.1 is unreachable), its own PID namespace
    and a private mount namespace. The harness is PID 1 in it; when PID 1 exits the kernel kills
    everything left in the namespace, which also catches children that escaped with setsid or a double
    fork (a process-group kill alone does not).
  * The harness (gapo/reward/sandbox_harness.py run as a script: trusted code, root inside the
    namespaces; the job protocol between host and harness is at its top) mounts fresh tmpfs over /tmp
    and /dev/shm, so what a program writes vanishes with the namespace, and covers every
    top-level directory except the system ones (/usr, /etc, /dev, ...) with an empty tmpfs, binding only
    the Python installation back in, read-only: the repository, the datasets (which hold the expected
    outputs), /root, /home, /run and /var are not there to read. It then forks one child per test case.
    The child drops to the user `nobody` (uid 65534: RLIMIT_NPROC does not bind root), gets setrlimit
    limits (CPU seconds, address space, file size, open files, processes, no core files), an empty
    environment with HOME set to its private working dir, stdin from the test input, and its own output
    pipes. The harness enforces the per-case wall-clock deadline and the output cap (it reads at most N
    bytes, then kills), and after every case kills every other process in the namespace (kill(-1) from
    PID 1).
  * Verdicts come from outside the program. For stdin/stdout and call-based cases the harness forwards
    the program's output or JSON return value and the PARENT compares it with the expected answer, which
    never enters the sandbox. For check(candidate) test programs, whose asserts must run in the
    program's process, success is a per-case random nonce written on a separate pipe (fd 3) only after
    the test program returned; exiting early (os._exit(0), sys.exit), redefining print, closing stdout or
    printing "PASSED" cannot produce it. Return values handed to check() must be plain data (builtin
    containers and scalars), which stops "always equal" objects; a returned TreeNode / ListNode is rebuilt
    from its plain values with the harness's node class, and the test program gets the harness's own
    tree/list helpers, in its own copy of the globals. A program that digs the nonce out of its
    own memory could still forge it: this stops cheap reward hacks, not a determined in-process attacker.
  * The child cannot touch the harness: different uid (no ptrace, no signals), and PID 1 ignores
    signals from inside its namespace.
  * Without unshare (not root, or util-linux missing) runs fall back to: own session, privilege drop
    where root, the same rlimits, a subreaper harness that kills all descendants, a host temp dir as the
    working dir. There is NO network isolation then, /tmp is shared and everything `nobody` may read is
    visible; if Python lives where `nobody` cannot read, programs can import only the modules the harness
    preloaded. This fallback logs a warning on the "gapo.reward" logger and marks every result
    (`SandboxRun.isolated` False, RewardResult flag "unisolated"), so it can never go unnoticed.

Known limits: uid `nobody` is shared by concurrent runs, so a fork bomb in one run can exhaust the
process limit of another concurrent run for the bomb's lifetime (wall deadline). Memory is bounded per
process (RLIMIT_AS) times the process limit, not per run; run a cgroup around the trainer for a hard cap.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from gapo.reward import sandbox_harness
from gapo.reward.sandbox_harness import GUARD_NAME as GUARD_NAME  # host API: gapo.reward.code writes check programs
from gapo.reward.sandbox_harness import SAFE_PATH

NOBODY_UID = 65534

logger = logging.getLogger("gapo.reward")

_UNSHARE_ARGS = ("--net", "--pid", "--fork", "--mount-proc", "--kill-child")
# Time for unshare + interpreter start + prelude imports, on top of the per-case budgets.
_STARTUP_ALLOWANCE_S = 10.0


@dataclass(frozen=True)
class Limits:
    """Per-case limits. `wall_s` is the wall-clock budget of ONE case (one execution of the program)."""

    wall_s: float = 10.0
    cpu_s: float | None = None  # default: the wall budget
    memory_mb: int = 1024
    max_output_bytes: int = 4 << 20
    max_processes: int = 32
    max_open_files: int = 64
    max_file_mb: int = 16
    tmpfs_mb: int = 64

    def __post_init__(self) -> None:
        for name in ("wall_s", "memory_mb", "max_output_bytes", "max_processes", "max_open_files",
                     "max_file_mb", "tmpfs_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Limits.{name} must be > 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class StdioCase:
    """Run the program as a script with `stdin` as its standard input; its stdout is compared outside."""

    stdin: str
    kind: str = field(default="stdio", init=False)


@dataclass(frozen=True)
class CallCase:
    """Call `fn_name` (a function, or a method of class Solution) with `args`; its JSON value is compared outside."""

    fn_name: str
    args: list
    kind: str = field(default="call", init=False)


@dataclass(frozen=True)
class CheckCase:
    """Run a test `program` after the solution (and `check(entry_point)` if given); passing = no exception."""

    program: str
    entry_point: str | None = None
    kind: str = field(default="check", init=False)


Case = StdioCase | CallCase | CheckCase


@dataclass(frozen=True)
class CaseOutcome:
    """What one case did. status: "ok" (ran to completion; for check cases: passed), "error" (exception,
    non-zero exit, a fault or signal of its own doing, failed assertion), "timeout", "output_limit", "killed" (ended
    by a signal that neither the program, nor its limits, nor the harness sent: the host's doing, no verdict)."""

    status: str
    exit_code: int | None
    stderr: str
    wall_s: float
    stdout: str | None = None
    value: str | None = None


@dataclass(frozen=True)
class SandboxRun:
    """The outcomes in case order (fewer than the cases when stopped early), and how the run went:
    `error` is set when the sandbox itself failed (not the program), `isolated` is False in the fallback."""

    outcomes: tuple[CaseOutcome, ...]
    isolated: bool
    error: str | None
    wall_s: float
    host_fault: bool = False  # the error is the sandbox's death by a signal the supervisor did not send (a host kill)


@functools.cache
def namespaces_available() -> bool:
    """Whether unshare-based isolation works here (probed once per process)."""
    exe = shutil.which("unshare")
    if exe is None:
        logger.warning("sandbox: `unshare` (util-linux) not found")
        return False
    if os.geteuid() != 0:
        logger.warning("sandbox: not running as root, cannot create network/PID namespaces")
        return False
    probe = subprocess.run([exe, *_UNSHARE_ARGS, "--", "true"], capture_output=True, timeout=30, check=False)
    if probe.returncode != 0:
        logger.warning("sandbox: unshare probe failed (%d): %s", probe.returncode, probe.stderr[-300:])
    return probe.returncode == 0


@functools.cache
def pdeathsig_wrapper() -> str | None:
    """setpriv, where it takes --pdeathsig (util-linux 2.33 and later; probed once per process): the sandbox then dies
    with its rank. Older systems run the sandbox without it (its own limits still end it)."""
    exe = shutil.which("setpriv")
    if exe is None or subprocess.run([exe, "--pdeathsig", "KILL", "--", "true"], capture_output=True,
                                     timeout=30, check=False).returncode != 0:
        logger.warning("sandbox: no setpriv with --pdeathsig (util-linux >= 2.33): a sandbox outlives a killed rank "
                       "until its own limits end it")
        return None
    return exe


_warned_unisolated = False


def _warn_unisolated() -> None:
    global _warned_unisolated
    if not _warned_unisolated:
        _warned_unisolated = True
        logger.warning(
            "SANDBOX NOT ISOLATED: running untrusted code without network/PID/mount namespaces. "
            "Programs can reach the network, write to the shared /tmp and leave setsid escapees. "
            "Results carry the 'unisolated' flag. Run as root with util-linux `unshare` to fix this."
        )


_RUNNING: set[subprocess.Popen] = set()
_RUNNING_LOCK = threading.Lock()


def run_program(
    program: str,
    cases: Sequence[Case],
    limits: Limits | None = None,
    *,
    stop_after: Callable[[int, CaseOutcome], bool] | None = None,
    isolation: str = "auto",
) -> SandboxRun:
    """Run `program` on each case in order, in one sandbox. `stop_after(i, outcome)` returning True ends
    the run right away (the caller compares outputs and stops at the first failure).
    `isolation`: "auto" (namespaces when available, else the loud fallback), "namespaces" or "none"."""
    limits = limits or Limits()
    if isolation not in ("auto", "namespaces", "none"):
        raise ValueError(f"isolation must be 'auto', 'namespaces' or 'none', got {isolation!r}")
    if not isinstance(program, str):
        raise TypeError(f"program: expected str, got {type(program).__name__}")
    if not cases:
        raise ValueError("cases: at least one case is required")
    isolated = namespaces_available() if isolation == "auto" else isolation == "namespaces"
    if not isolated:
        _warn_unisolated()
    root = os.geteuid() == 0
    job = {
        "program": program,
        "cases": [asdict(c) for c in cases],
        "limits": {**asdict(limits), "cpu_s": limits.cpu_s or limits.wall_s},
        "isolated": isolated,
        "drop_uid": NOBODY_UID if root else None,
    }
    start = time.monotonic()
    workdir = None if isolated else _host_workdir(root)
    try:
        with tempfile.TemporaryFile() as job_file:
            job_file.write(json.dumps(job).encode("utf-8", "surrogateescape"))
            job_file.seek(0)
            outcomes, error, killed = _supervise(job_file, workdir, isolated, len(cases), limits, stop_after)
    finally:
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=False)
    return SandboxRun(tuple(outcomes), isolated, error, time.monotonic() - start, killed)


def _host_workdir(root: bool) -> str:
    workdir = tempfile.mkdtemp(prefix="gapo-sandbox-")
    if root:
        os.chown(workdir, NOBODY_UID, NOBODY_UID)
    return workdir


def _supervise(job_file, workdir: str | None, isolated: bool, n_cases: int, limits: Limits,
               stop_after: Callable[[int, CaseOutcome], bool] | None
               ) -> tuple[list[CaseOutcome], str | None, bool]:
    harness = [sys.executable, "-I", "-B", os.path.abspath(sandbox_harness.__file__)]
    argv = [shutil.which("unshare") or "unshare", *_UNSHARE_ARGS, "--", *harness] if isolated else harness
    # SLURM signals every process of a job at a preemption (SIGTERM) and ahead of its time limit (SIGUSR1) while the
    # rank finishes its step: a program killed by them would fail its tests and score that step differently. The
    # shell ignores both and execs (same pid); unshare, the harness and the program inherit the ignoring. The
    # supervisor ends a run with SIGKILL.
    argv = ["/bin/sh", "-c", 'trap "" TERM USR1; exec "$@"', "sh", *argv]
    # And it dies with the rank, however the rank dies: setpriv sets the parent-death signal and execs (unshare's
    # --kill-child and its PID namespace then take the harness and the program along).
    if (setpriv := pdeathsig_wrapper()) is not None:
        argv[4:4] = [setpriv, "--pdeathsig", "KILL", "--"]
    proc = subprocess.Popen(
        argv,
        stdin=job_file,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={"PATH": SAFE_PATH, "LANG": "C.UTF-8"},
        cwd=workdir or "/",
        start_new_session=True,
    )
    with _RUNNING_LOCK:
        _RUNNING.add(proc)
    outcomes: list[CaseOutcome] = []
    error, killed = None, False
    budget = _STARTUP_ALLOWANCE_S + n_cases * (limits.wall_s + 1.0)
    deadline = time.monotonic() + budget
    line_cap = 8 * limits.max_output_bytes + 65536
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    selector.register(proc.stderr, selectors.EVENT_READ)
    pending, stderr_tail, done = b"", b"", False
    try:
        while not done and error is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                error = f"sandbox backstop deadline ({budget:.0f}s) exceeded"
                break
            events = selector.select(remaining)
            for key, _ in events:
                chunk = os.read(key.fd, 1 << 20)
                if key.fileobj is proc.stderr:
                    stderr_tail = (stderr_tail + chunk)[-4000:]
                    if not chunk:
                        selector.unregister(proc.stderr)
                    continue
                if not chunk:
                    code = proc.wait()
                    error = _harness_died(code, stderr_tail.decode("utf-8", "replace"))
                    # By a signal, not ours: a host's. unshare passes its child's signal on, or, when it cannot
                    # re-raise it (util-linux 2.38: SIGKILL), says so and exits 1.
                    killed = code < 0 or code > 128 or b"sigprocmask unblock failed" in stderr_tail
                    break
                pending += chunk
                *lines, pending = pending.split(b"\n")
                if len(pending) > line_cap:
                    error = "sandbox harness sent an oversized record"
                    break
                for line in lines:
                    record = json.loads(line)
                    if record.get("done"):
                        done = True
                        break
                    index = record.pop("i")
                    outcome = CaseOutcome(**record)
                    outcomes.append(outcome)
                    if stop_after is not None and stop_after(index, outcome):
                        done = True
                        break
    finally:
        selector.close()
        _terminate(proc, isolated)
        with _RUNNING_LOCK:
            _RUNNING.discard(proc)
    return outcomes, error, killed


def _harness_died(exit_code: int, stderr: str) -> str:
    """The run's error, one line (it reaches the console as a warning and the rollout's detail): the exit code and the
    last line of the harness's stderr, e.g. "KeyboardInterrupt" under a traceback. The whole stderr tail goes to the
    log at INFO, which a training run writes to train.log only."""
    lines = stderr.strip().splitlines()
    if lines:
        logger.info("sandbox harness stderr (exit code %d):\n%s", exit_code, stderr[-1500:])
    last = f": {lines[-1].strip()[:200]}" if lines else ""
    return f"sandbox harness ended without finishing (exit code {exit_code}{last})"


def _terminate(proc: subprocess.Popen, isolated: bool) -> None:
    """Kill the harness first and let unshare reap it: killing unshare first would orphan the harness to
    the machine's init, which in a container may never reap it (a zombie left behind)."""
    if proc.poll() is None:
        if isolated:
            try:
                with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                    harness_pids = [int(p) for p in f.read().split()]
            except FileNotFoundError:
                harness_pids = []  # unshare already gone
            for pid in harness_pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
            try:
                proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                logger.warning("sandbox: unshare did not exit after its child was killed; killing its group")
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                logger.debug("sandbox process group already gone")
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()


@atexit.register
def _kill_running_sandboxes() -> None:
    with _RUNNING_LOCK:
        running = list(_RUNNING)
    for proc in running:
        _terminate(proc, isolated=True)

