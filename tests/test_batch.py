"""The step's batch (gapo/trainer/batch.py): advantages per group, the keep mask, and what the loop reads of it."""

import torch

from gapo.configfile import resolve
from gapo.data import Problem
from gapo.reward.types import RewardResult
from gapo.rollout.types import Rollout
from gapo.trainer.batch import StepBatch

OK, WRONG, ERROR = RewardResult(1.0, "correct"), RewardResult(0.0, "wrong"), RewardResult(0.0, "error")


def rollout(truncated: bool = False) -> Rollout:
    return Rollout(prompt_ids=[1], response_ids=[2, 3], logprobs=[-0.1, -0.2], truncated=truncated, text="t", version=4)


def batch(**rollout_cfg) -> StepBatch:
    cfg = resolve({"rollout": {"group_size": 4, "prompts_per_step": 3, **rollout_cfg},
                   "trainer": {"ppo_mini_batch_size": 12, "micro_batch_size": 4}})
    groups = [[rollout(), rollout(), rollout(truncated=True), rollout()] for _ in range(3)]
    results = [[OK, WRONG, WRONG, WRONG], [ERROR] * 4, [OK, OK, OK, OK]]
    problems = [Problem(f"p{i}", "q", "a") for i in range(3)]
    return StepBatch.scored(5, 4, problems, groups, results, cfg)


def test_a_scored_batch_holds_group_advantages_and_leaves_out_what_carries_no_signal():
    b = batch()
    assert b.step == 5 and b.version == 4 and len(b.rollouts) == len(b.flat_results) == 12
    assert b.rewards.tolist() == [1, 0, 0, 0] + [0] * 4 + [1] * 4
    assert b.adv.c.tolist() == [1] * 4 + [0] * 4 + [4] * 4
    torch.testing.assert_close(b.adv.adv[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]))  # (k - c) / k, -c / k
    assert b.keep.tolist() == [True] * 4 + [False] * 4 + [True] * 4  # the rewarder failed on group 2: no signal
    assert b.problems[2].uid == "p2" and b.groups[2][0] is b.rollouts[8]


def test_uniform_groups_and_truncated_responses_leave_the_loss_when_asked():
    b = batch(filter_uniform_groups=True, mask_truncated=True)
    assert b.keep.tolist() == [True, True, False, True] + [False] * 8
