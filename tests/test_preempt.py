"""Preemption's two stops (gapo/trainer/preempt.py) and what the ranks agree on (gapo.distributed.agree), in one
process: without a process group of several ranks every agreement is the rank's own value, so the decisions are
checked here and their collectives by the preemption tests of tests/test_checkpoint.py."""

import random
import time

import pytest
import torch

from gapo.data import Sampler
from gapo.distributed import agree
from gapo.trainer import checkpoint, preempt
from gapo.trainer.preempt import Preempted, StepStart


@pytest.fixture
def signalled():
    """A preemption signal that came `ago` seconds before now."""

    def at(ago: float) -> None:
        preempt._handler(None, None)
        preempt._requested_at = time.monotonic() - ago

    yield at
    preempt.reset()


def _start(sampler: Sampler) -> StepStart:
    return StepStart(step=3, sampler=sampler.state_dict(), rng=checkpoint.rng_state(), requested=[3, 4])


def test_without_a_signal_or_with_time_left_the_step_goes_on(signalled):
    sampler, saved = Sampler(8, seed=0), []
    start = _start(sampler)
    preempt.abandon_if_late(start, 5.0, 10.0, torch.device("cpu"), sampler, lambda *a: saved.append(a), "ckpts")
    signalled(1.0)
    preempt.abandon_if_late(start, 5.0, 10.0, torch.device("cpu"), sampler, lambda *a: saved.append(a), "ckpts")
    assert saved == []
    preempt.stop_if_signalled(None, 3, 10, "ckpts")


def test_a_late_step_goes_back_to_its_start_saves_the_previous_step_and_stops(signalled):
    sampler, saved = Sampler(8, seed=0), []
    start = _start(sampler)
    expected = [sampler.next(4), random.random(), torch.rand(1)]
    checkpoint.set_rng_state(start.rng)
    sampler.load_state_dict(start.sampler)
    sampler.next(4), random.random(), torch.rand(1)  # the step drew from both before it was abandoned
    signalled(6.0)

    def save(step, requested):
        saved.append((step, requested, sampler.state_dict()))

    with pytest.raises(Preempted, match=r"step 3 abandoned .*preempt_deadline_s=10\).*step 2 saved in ckpts"):
        preempt.abandon_if_late(start, 5.0, 10.0, torch.device("cpu"), sampler, save, "ckpts")
    assert [(s, r) for s, r, _ in saved] == [(2, [3, 4])] and saved[0][2] == start.sampler
    assert [sampler.next(4), random.random(), torch.rand(1)] == expected  # the resumed run redraws the same


def test_a_late_first_step_of_a_resumed_run_saves_nothing_but_stops(signalled):
    sampler = Sampler(8, seed=0)
    signalled(6.0)
    with pytest.raises(Preempted, match="step 3 abandoned"):
        preempt.abandon_if_late(_start(sampler), 5.0, 10.0, torch.device("cpu"), sampler, None, "ckpts")


def test_a_signal_stops_after_the_save_unless_the_run_ends_there():
    with pytest.raises(Preempted, match=r"preempted 7 s ago: step 3 saved in ckpts"):
        preempt.stop_if_signalled(7.0, 3, 10, "ckpts")
    preempt.stop_if_signalled(7.0, 10, 10, "ckpts")


def test_agree_alone_keeps_its_values_and_refuses_an_unknown_reduction():
    assert agree([3, 1], torch.device("cpu")) == [3, 1] and agree([], torch.device("cpu"), op="min") == []
    with pytest.raises(ValueError, match="op must be max or min, not 'sum'"):
        agree([1], torch.device("cpu"), op="sum")
