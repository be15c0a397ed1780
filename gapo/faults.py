"""Fault injection for the tests: `GAPO_FAULT=<name>:<argument>` makes one named place of production code fail on
purpose, so that a test can watch the run recover (or stop) the way a real failure would make it.

An environment variable rather than a test double, because the faults must fire inside the gapo-train processes
that the end-to-end tests start, under torchrun, at a given step or on a given rank: a monkeypatch in the test's
own process reaches none of them. This one function is the only reader, so that the faults in use are found by
searching for `injected(`. (A fault that can be injected from the test's side instead is: tests/dist/dist_sync_check.py
patches the trainer inside each rank it starts, with no switch in gapo.)

    score_raise:<problem uid>      gapo.reward.registry: scoring a batch holding that problem raises
    signal:<step>                  the loop: rank 0 sends itself SIGTERM at the start of that step (preemption)
    kill_before_rename:<step>      the checkpoint: rank 0 is killed before the step's checkpoint is renamed
    enospc:<step>, fill:<step>     the checkpoint: a write fails with ENOSPC / the disk fills after the room check
"""

from __future__ import annotations

import os

VARIABLE = "GAPO_FAULT"


def injected(name: str) -> str | None:
    """The argument of fault `name` when GAPO_FAULT asks for it (`name:argument`), else None."""
    got, colon, argument = os.environ.get(VARIABLE, "").partition(":")
    return argument if colon and got == name else None
