"""Preemption: SIGTERM or SIGUSR1 (what SLURM sends at a time limit or a preemption; `--signal=USR1@300` chooses
the lead time) asks the run to stop at the next safe point, save, and exit with PREEMPTED (75, EX_TEMPFAIL), which
a requeue script can test for.

Every rank installs the handler; a signal only sets a flag, so nothing is interrupted half-way (a second signal
during the save changes nothing: the save is atomic and finishes). The ranks agree at two points of each step, by
an all-reduce, so that they stop together: after the step's rollouts are scored, before any weight moves, the run
abandons the step if finishing it would pass `trainer.preempt_deadline_s` after the signal (the previous step's
checkpoint is saved, with the sampler and RNG as they were before this step, so the step is redone exactly on
resume); at the end of the step it saves that step.
"""

from __future__ import annotations

import signal
import time

import torch
import torch.distributed as dist

PREEMPTED = 75  # EX_TEMPFAIL: try again later (requeue)
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

_requested_at: float | None = None  # monotonic time of the first signal


class Preempted(Exception):
    """The run saved its last completed step after a preemption signal and stops."""


def install() -> None:
    """Handlers for SIGTERM and SIGUSR1 in this (rank) process."""
    for sig in SIGNALS:
        signal.signal(sig, _handler)


def _handler(signum, frame) -> None:  # noqa: ARG001 - signal's signature
    global _requested_at
    if _requested_at is None:
        _requested_at = time.monotonic()


def agreed(device: torch.device) -> float | None:
    """Collective: seconds since the earliest signal any rank received, or None when none has."""
    since = -1.0 if _requested_at is None else time.monotonic() - _requested_at
    t = torch.tensor([since], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return None if float(t) < 0 else float(t)


def reset() -> None:
    """For tests in one process: forget a signal."""
    global _requested_at
    _requested_at = None
