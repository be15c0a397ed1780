"""Math rewarder: extract the final answer, verify it with math-verify in a pool of worker processes.

Why a process pool: math-verify bounds its own work with `signal.alarm`, which only works in a process's
main thread (a framework that called it from threads scored every sample 0), and some answers (e.g.
`\\boxed{9^{9^{9^{9}}}}`) sit in a C-level big-integer computation that no signal can interrupt. So each
item runs in the main thread of a worker process and has a hard deadline enforced from *outside*: the
parent kills a worker that overruns, starts a replacement, and scores the item `timeout`. Inside the
worker a softer alarm (just under the deadline) turns interruptible slow cases into `timeout` without
paying for a respawn. math-verify's own timeouts are switched off because they share the one alarm timer
and, worse, report a timeout as a plain "not equal", which would masquerade as a wrong answer.

Answers are read from a response and gold answers normalised in gapo/reward/math_answer.py (plain string
work, in the parent); this module verifies them.

Statuses: correct / wrong / no_answer / timeout / error. A gold answer that math-verify cannot parse at
all is an `error` (the data is at fault, not the model) and is logged on the "gapo.reward" logger, as are
timeouts, worker deaths and resource errors (MemoryError, RecursionError) raised inside math-verify. A worker that
dies mid-answer gives that answer an `error` naming how it ended; killed by a signal the pool did not send (the
pool kills a worker only after its item has a verdict or timed out), that is the host's doing (the OOM killer, a
kill aimed at the job), and the result carries the flag "host_fault". A gold
answer it can only keep as text (e.g. Minerva's "E_1, E_2": E reads as Euler's number) is matched as an
exact string, and such results carry the flag "gold_text_only" so the weakness stays visible.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gapo.proc import PARENT, me
from gapo.reward.math_answer import MathGold, as_boxed_latex, extract_answer, normalize_gold, with_last_number
from gapo.reward.types import (
    FLAG_GOLD_TEXT_ONLY,
    FLAG_HOST_FAULT,
    Rewarder,
    RewarderUnavailable,
    RewardResult,
    signal_name,
)

if TYPE_CHECKING:
    from gapo.config import RewardConfig
    from gapo.data import Problem

logger = logging.getLogger("gapo.reward")

# How long a fresh worker may take to import sympy/math-verify and answer its warm-up item.
_STARTUP_TIMEOUT_S = 120.0
# Consecutive workers that die before becoming ready before we conclude the installation is broken.
_MAX_STARTUP_FAILURES = 3
# Jobs in flight per worker, and the largest job that may be queued behind a busy worker (a write that
# fills the pipe would block the parent, and with it every other worker's deadline, until the item ends).
_PIPELINE_DEPTH = 2
_PIPELINE_MAX_BYTES = 16384
_ANSWER_LOG_CHARS = 200
# A worker ended by one of these crashed on its own (a fault in a C extension, abort()): the rewarder's failure. Any
# other signal was sent from outside: the host's.
_CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGABRT})

_Verdict = tuple[str, str, tuple[str, ...]]  # status, detail, flags


# --------------------------------------------------------------------------------------------------
# Worker process (runs `_worker_main` in its main thread)
# --------------------------------------------------------------------------------------------------
_GOLD_TEXT_ONLY = "gold parsed only as text (exact match only)"


class _SoftTimeout(BaseException):
    """Raised by the worker's alarm. A BaseException so math-verify's `except Exception` cannot swallow
    it and turn a timeout into a plain False."""


class _ResourceErrorSpy(logging.Handler):
    """math-verify logs and swallows every exception, returning False. Resource exhaustion is not a
    verdict about the answer, so the worker listens for it and reports `error` instead."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, MemoryError | RecursionError):
            self.seen.append(type(exc).__name__)


def _worker_main(memory_mb: int) -> None:
    """Loop: read one JSON job per line on stdin, write one JSON result per line to the protocol pipe."""
    import resource

    # The protocol gets a private copy of stdout; fd 1 then points at stderr so that stray prints from
    # libraries can never corrupt a result line.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    if memory_mb > 0:
        limit = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    from math_verify import parse, verify

    spy = _ResourceErrorSpy()
    mv_logger = logging.getLogger("math_verify")
    mv_logger.setLevel(logging.DEBUG)
    mv_logger.propagate = False
    mv_logger.handlers = [spy]

    gold_cache: dict[tuple[str, str | None], Any] = {}

    def parse_gold(answer: str, unit: str | None) -> Any:
        key = (answer, unit)
        if key not in gold_cache:
            if len(gold_cache) > 4096:
                gold_cache.clear()
            gold_cache[key] = parse(as_boxed_latex(answer, unit), parsing_timeout=None)
        return gold_cache[key]

    def check(job: dict[str, Any]) -> tuple[str, str]:
        unit = job["unit"]
        pred = parse(as_boxed_latex(job["answer"], unit), parsing_timeout=None)
        if not pred:
            return "wrong", "answer does not parse as math"
        parsed_golds = [parse_gold(gold, unit) for gold in job["golds"]]
        if not any(parsed_golds):
            return "error", f"gold answer does not parse: {job['golds'][0]!r}"
        note = ""
        if all(isinstance(x, str) for g in parsed_golds for x in g):
            note = _GOLD_TEXT_ONLY  # math-verify could only keep the gold as text: exact string match only
        for parsed in parsed_golds:
            if parsed and verify(parsed, pred, timeout_seconds=None):
                return "correct", note
        return "wrong", note

    def on_alarm(signum: int, frame: Any) -> None:
        raise _SoftTimeout

    signal.signal(signal.SIGALRM, on_alarm)
    check({"answer": "1", "golds": ["1"], "unit": None})  # warm-up: first use builds parser tables
    proto.write("ready\n")

    for line in sys.stdin:
        job = json.loads(line)
        spy.seen.clear()
        try:
            try:
                signal.setitimer(signal.ITIMER_REAL, job["soft_timeout_s"])
                status, detail = check(job)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _SoftTimeout:
            status, detail = "timeout", "verification interrupted by the in-worker alarm"
        except Exception as exc:  # reported as status "error"; the worker stays usable
            status, detail = "error", f"{type(exc).__name__}: {exc}"[:300]
        if spy.seen and status != "correct":
            status, detail = "error", f"{spy.seen[0]} inside math-verify"
        proto.write(json.dumps({"id": job["id"], "status": status, "detail": detail}) + "\n")


# --------------------------------------------------------------------------------------------------
# Parent side: the pool
# --------------------------------------------------------------------------------------------------
@dataclass
class _Job:
    answer: str
    golds: tuple[str, ...]
    unit: str | None


class _Worker:
    """One verifier process and the jobs sent to it. Up to _PIPELINE_DEPTH jobs are in flight, so the
    worker never waits for the parent between items; each item still gets its own deadline, counted from
    when the worker finished the previous one."""

    def __init__(self, memory_mb: int) -> None:
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = package_root + os.pathsep + env.get("PYTHONPATH", "")
        env[PARENT] = me()  # importing gapo ties the worker to this process (gapo.proc.die_with_parent)
        # SLURM signals every process of a job at a preemption (SIGTERM) and ahead of its time limit (SIGUSR1): the
        # rank then finishes its step and saves it, so a worker killed mid-item would turn a `wrong` into an `error`
        # and the saved step would differ from the uninterrupted run's (seen in the cluster tier). Ignored from the
        # first line; the parent ends a worker by EOF or SIGKILL, and PR_SET_PDEATHSIG covers a parent that died.
        # SIGINT (which no Ctrl-C reaches: own session, below) keeps its default action: Python's handler would
        # wait for a C-level computation to return before raising, and the worker should end at once, by the signal,
        # which names the host's fault in the verdict (_died_mid_item).
        code = ("import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "signal.signal(signal.SIGUSR1, signal.SIG_IGN); signal.signal(signal.SIGINT, signal.SIG_DFL); "
                f"from gapo.reward.math import _worker_main; _worker_main({int(memory_mb)})")
        # Own session: a Ctrl-C aimed at the trainer's terminal must not hit the workers mid-item.
        self.proc = subprocess.Popen(
            [sys.executable, "-P", "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        self.buffer = b""
        self.ready = False
        self.jobs: deque[int] = deque()  # sent, unanswered; the worker is verifying the head now
        self.head_since = 0.0  # when the worker started on the head job
        self.startup_deadline = time.monotonic() + _STARTUP_TIMEOUT_S

    def deadline(self, timeout_s: float) -> float:
        if not self.ready:
            return self.startup_deadline
        return self.head_since + timeout_s if self.jobs else math.inf

    def fileno(self) -> int:
        return self.proc.stdout.fileno()

    def send(self, payload: bytes) -> bool:
        try:
            self.proc.stdin.write(payload)
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError):
            return False

    def read_lines(self) -> list[bytes] | None:
        """Complete lines available now; None once the worker has closed its end (it died)."""
        chunk = os.read(self.fileno(), 65536)
        if not chunk:
            return None
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        return lines

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError as exc:  # a broken pipe on close is expected for a dead worker
                logger.debug("closing a dead math worker's pipe: %s", exc)

    def stop(self) -> None:
        """Polite shutdown: EOF on stdin ends the worker's loop; kill it if it does not go."""
        try:
            self.proc.stdin.close()
        except OSError as exc:
            logger.debug("closing a math worker's stdin: %s", exc)
        try:
            self.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


class MathVerifier(Rewarder):
    """A persistent pool of math-verify worker processes; reuse one instance across training steps.

    `score` scores one group (k responses to one problem); `score_batch` scores many groups at once, all
    items spread over the workers. Calls are serialised by a lock, so one instance may be shared by threads.
    """

    def __init__(self, num_workers: int = 2, timeout_s: float = 10.0, memory_mb: int = 4096) -> None:
        super().__init__(num_workers)
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        # The in-worker alarm fires a little before the hard deadline so that interruptible slow
        # items end without a respawn; setitimer takes fractions, unlike math-verify's alarm(int).
        self.soft_timeout_s = max(0.05, min(self.timeout_s * 0.8, self.timeout_s - 0.5))
        self.memory_mb = memory_mb
        if importlib.util.find_spec("math_verify") is None:
            raise RewarderUnavailable(f"math-verify is not installed for {sys.executable}: `pip install "
                                      "math-verify==0.9.0` (data.type=math and the math benchmarks score with it)")
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._startup_failures = 0
        self._closed = False

    # ---------------------------------------------------------------------------------------------
    def score(self, responses: Sequence[str], gold: Any, *, unit: str | None = None) -> list[RewardResult]:
        """Score k responses to one problem against its gold answer (see module docstring for formats)."""
        return super().score(responses, normalize_gold(gold, unit=unit))

    def parse_gold(self, gold: Any) -> MathGold:
        return normalize_gold(gold)

    def score_groups(self, groups: list[Sequence[str]], golds: list[MathGold]) -> list[list[RewardResult]]:
        answers = [[extract_answer(r, gold.multiple) for r in responses] for responses, gold in zip(groups, golds,
                                                                                                  strict=True)]
        jobs: list[_Job] = []
        for gold, group in zip(golds, answers, strict=True):
            jobs.extend(_Job(a, gold.answers, gold.unit) for a in group if a is not None)
        verdicts = iter(self._run(jobs))
        out: list[list[RewardResult]] = []
        for gold, group in zip(golds, answers, strict=True):
            row = []
            for answer in group:
                if answer is None:
                    row.append(RewardResult.of("no_answer", "no \\boxed{} and no 'answer is' phrase"))
                    continue
                status, detail, flags = next(verdicts)
                shown = f"answer {answer[:_ANSWER_LOG_CHARS]!r}"
                if status in ("timeout", "error"):
                    logger.warning("math reward %s: %s; gold %r; %s", status, shown, gold.answers, detail)
                if detail == _GOLD_TEXT_ONLY:
                    flags = (*flags, FLAG_GOLD_TEXT_ONLY)
                row.append(RewardResult.of(status, f"{shown}; {detail}" if detail else shown, flags))
            out.append(row)
        return out

    def close(self) -> None:
        """Stop all workers. Safe to call twice; called for every live instance at interpreter exit."""
        with self._lock:
            self._closed = True
            for worker in self._workers:
                worker.stop()
            self._workers = []

    # ---------------------------------------------------------------------------------------------
    def _run(self, jobs: list[_Job]) -> list[_Verdict]:
        results: list[_Verdict | None] = [None] * len(jobs)
        pending = deque(range(len(jobs)))
        with self._lock:
            if self._closed:
                raise RuntimeError("MathVerifier is closed")
            while len(self._workers) < self.num_workers:
                self._workers.append(_Worker(self.memory_mb))
            while pending or any(w.jobs for w in self._workers):
                for worker in list(self._workers):
                    while worker.ready and len(worker.jobs) < _PIPELINE_DEPTH and pending:
                        if not self._dispatch(worker, jobs, pending):
                            break
                watched = [w for w in self._workers if w.jobs or not w.ready]
                wait_s = max(0.0, min(w.deadline(self.timeout_s) for w in watched) - time.monotonic())
                readable, _, _ = select.select(watched, [], [], wait_s)
                for worker in readable:
                    self._collect(worker, results, pending)
                now = time.monotonic()
                for worker in list(self._workers):
                    if worker.deadline(self.timeout_s) <= now:
                        if worker.jobs:
                            results[worker.jobs.popleft()] = (
                                "timeout", f"no verdict within the {self.timeout_s:g}s deadline", ())
                            pending.extendleft(reversed(worker.jobs))  # queued behind it: not started
                        self._replace(worker, started=worker.ready)
        return [r for r in results if r is not None]

    def _dispatch(self, worker: _Worker, jobs: list[_Job], pending: deque[int]) -> bool:
        """Send the next pending job to `worker`; False if it should not take one now."""
        job = jobs[pending[0]]
        message = {"id": pending[0], "answer": job.answer, "golds": list(job.golds), "unit": job.unit,
                   "soft_timeout_s": self.soft_timeout_s}
        payload = (json.dumps(message) + "\n").encode()
        if worker.jobs and len(payload) > _PIPELINE_MAX_BYTES:
            return False
        if not worker.send(payload):  # died: its unanswered jobs go back, a fresh worker takes its slot
            pending.extendleft(reversed(worker.jobs))
            self._replace(worker, started=True)
            return False
        if not worker.jobs:
            worker.head_since = time.monotonic()
        worker.jobs.append(pending.popleft())
        return True

    def _collect(self, worker: _Worker, results: list[_Verdict | None], pending: deque[int]) -> None:
        lines = worker.read_lines()
        if lines is None:
            code = worker.proc.wait()
            if worker.jobs:
                results[worker.jobs.popleft()] = _died_mid_item(code)
                pending.extendleft(reversed(worker.jobs))
            self._replace(worker, started=worker.ready)
            return
        for line in lines:
            if line == b"ready":
                worker.ready = True
                self._startup_failures = 0
                continue
            message = json.loads(line)
            if worker.jobs and message["id"] == worker.jobs[0]:
                results[worker.jobs.popleft()] = (message["status"], message["detail"], ())
                worker.head_since = time.monotonic()

    def _replace(self, worker: _Worker, *, started: bool) -> None:
        """Kill a worker (hung, dead or failed to start) and put a fresh one in its slot."""
        worker.kill()
        if not started:
            self._startup_failures += 1
            if self._startup_failures >= _MAX_STARTUP_FAILURES:
                # Out of the pool: a later call starts a fresh worker in its slot instead of selecting on its
                # closed pipe.
                self._workers.remove(worker)
                self._startup_failures = 0
                raise RewarderUnavailable(
                    f"math-verify workers failed to start {_MAX_STARTUP_FAILURES} times in a row "
                    f"(last exit code {worker.proc.returncode}; {sys.executable}); see the workers' stderr above"
                )
        self._workers[self._workers.index(worker)] = _Worker(self.memory_mb)


def _died_mid_item(exit_code: int) -> _Verdict:
    """The verdict on the answer a worker was verifying when it ended: never one on the answer itself."""
    if exit_code >= 0:
        return "error", f"verifier worker died (exit code {exit_code})", ()
    signum = -exit_code
    if signum in _CRASH_SIGNALS:
        return "error", f"verifier worker crashed ({signal_name(signum)})", ()
    return ("error", f"verifier worker killed by {signal_name(signum)} from outside the rewarder: a host fault, "
                     "no verdict", (FLAG_HOST_FAULT,))


# --------------------------------------------------------------------------------------------------
# The rewarder table's row (gapo.reward.registry.REWARDERS["math"])
# --------------------------------------------------------------------------------------------------
def default_verifier(num_workers: int = 2, timeout_s: float = 10.0) -> MathVerifier:
    """The shared pool for these settings, created on first use and kept for the life of the process."""
    return MathVerifier.shared(num_workers, float(timeout_s))


def check_record(problem: Problem) -> tuple[str, str] | None:
    """(reason, detail) when the record's answer does not parse the way scoring will parse it, else None."""
    if problem.gold is None:
        return "no answer", "the answer field is null"
    try:
        MathGold.from_record({**problem.meta, "answer": problem.gold})
    except (TypeError, ValueError) as err:
        reason = "empty answer" if "empty" in str(err) else "unsupported answer"
        return reason, f"{err} (answer {problem.gold!r:.120})"
    return None


def score_records(groups: list[list[str]], problems: list[Problem], cfg: RewardConfig) -> list[list[RewardResult]]:
    """Each group of responses against its record's answer (with its `unit` and `is_multiple_answer`), all groups
    in one batch on the shared pool."""
    if cfg.math_last_number_fallback:
        groups = [[with_last_number(x) for x in g] for g in groups]
    golds = [MathGold.from_record({**p.meta, "answer": p.gold}) for p in problems]
    return default_verifier(cfg.num_workers, cfg.math_timeout_s).score_batch(list(zip(groups, golds, strict=True)))
