"""Preemption: SIGTERM or SIGUSR1 (what SLURM sends at a time limit or a preemption; `--signal=USR1@300` chooses
the lead time) asks the run to stop at the next safe point, save, and exit with gapo.errors.Exit.PREEMPTED (75,
EX_TEMPFAIL), which a requeue script can test for.

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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gapo.distributed import agree

if TYPE_CHECKING:  # torch loads with the run, not with the handlers (installed before the imports: see install)
    import torch

    from gapo.data import Sampler

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

_requested_at: float | None = None  # monotonic time of the first signal


class Preempted(Exception):
    """The run saved its last completed step after a preemption signal and stops."""


def install() -> None:
    """Handlers for SIGTERM and SIGUSR1 in this (rank) process: gapo-train installs them before its seconds of
    imports, so that a preemption during start-up is kept for the first safe point instead of killing the process."""
    for sig in SIGNALS:
        signal.signal(sig, _handler)


def _handler(signum, frame) -> None:  # noqa: ARG001 - signal's signature
    global _requested_at
    if _requested_at is None:
        _requested_at = time.monotonic()


def agreed(device: torch.device) -> float | None:
    """Collective: seconds since the earliest signal any rank received, or None when none has."""
    [since] = agree([-1.0 if _requested_at is None else time.monotonic() - _requested_at], device)
    return None if since < 0 else since


@dataclass(frozen=True)
class StepStart:
    """Where a step started: the sampler's and the RNGs' states, and the steps whose rollouts were requested already.
    An abandoned step goes back to it and saves the previous step with it, so that the resumed run redoes it exactly."""

    step: int
    sampler: dict
    rng: dict
    requested: list[int]


def abandon_if_late(start: StepStart, rest_s: float, deadline_s: float, device: torch.device, sampler: Sampler,
                    save: Callable[[int, list[int]], None] | None, where: Path) -> None:
    """Collective, once the step's rollouts are scored and before any weight moves: when a signal came and the rest of
    the step (`rest_s`, what the previous step took from here on, its checkpoint included) would end past `deadline_s`
    after it, restore `start`, save the previous step (`save(step, requested)`; None when that state is the checkpoint
    this run loaded, which rewriting would first remove) and raise Preempted."""
    from gapo.trainer import checkpoint  # (here: gapo.launch imports this module for SIGNALS alone)

    since = agreed(device)
    if since is None or since + rest_s <= deadline_s:
        return
    checkpoint.set_rng_state(start.rng)
    sampler.load_state_dict(start.sampler)
    if save is not None:
        save(start.step - 1, start.requested)
    raise Preempted(f"preempted {since:.0f} s ago: step {start.step} abandoned (it would end past "
                    f"trainer.preempt_deadline_s={deadline_s:g}), step {start.step - 1} saved in {where}; "
                    "`--resume auto` goes on from there")


def stop_if_signalled(since: float | None, step: int, last_step: int, where: Path) -> None:
    """After the end-of-step save a signal asked for (`since`, from agreed()): stop, unless the run ends here anyway."""
    if since is not None and step < last_step:
        raise Preempted(f"preempted {since:.0f} s ago: step {step} saved in {where}; `--resume auto` goes on from "
                        "there")


def reset() -> None:
    """For tests in one process: forget a signal."""
    global _requested_at
    _requested_at = None
