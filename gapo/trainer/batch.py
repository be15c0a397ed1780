"""One rank's share of a training step as one record, from the moment its rollouts are scored to the metrics.

The loop's phases read and fill it: generation gives the groups, scoring the results, `advantages_and_keep` the
advantages and the keep mask; packing (gapo.trainer.logprobs.pack_step), the per-rollout records of rollouts.jsonl
and the step metrics read it. It carries the weight version that sampled it, the seam an off-policy trainer needs:
a rollout's age is its step minus that version.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gapo.algorithms import GroupAdvantages, group_advantages
from gapo.config import Config
from gapo.data import Problem
from gapo.reward.types import RewardResult
from gapo.rollout.types import Rollout


@dataclass
class StepBatch:
    """R = groups x k rollouts of one rank, flattened group by group (rollout i is in group i // k)."""

    step: int
    version: int  # the trainer step whose weights sampled every rollout here
    problems: list[Problem]  # one per group
    groups: list[list[Rollout]]
    results: list[list[RewardResult]]  # as `groups`
    rewards: Tensor  # [R] float
    adv: GroupAdvantages  # [R] each: advantage, c, k, correct
    keep: Tensor  # [R] bool: in the loss (a rollout left out keeps its row, every rank runs the same forwards)

    @classmethod
    def scored(cls, step: int, version: int, problems: list[Problem], groups: list[list[Rollout]],
               results: list[list[RewardResult]], cfg: Config) -> StepBatch:
        rewards = torch.tensor([res.reward for g in results for res in g])
        ga, keep = advantages_and_keep(rewards, groups, results, cfg)
        return cls(step, version, problems, groups, results, rewards, ga, keep)

    @property
    def rollouts(self) -> list[Rollout]:
        return [x for g in self.groups for x in g]

    @property
    def flat_results(self) -> list[RewardResult]:
        return [res for g in self.results for res in g]


def advantages_and_keep(rewards: Tensor, groups: list[list[Rollout]], results: list[list[RewardResult]],
                        cfg: Config) -> tuple[GroupAdvantages, Tensor]:
    """Group advantages [R] and the keep mask [R] bool: a rollout left out of the loss keeps its place (every rank
    must run the same forwards under ZeRO-3) and just gets no tokens in the mask, the normaliser or the metrics.
    A group its rewarder failed on (every rollout "error") is left out: a rewarder's failure is no signal about
    the policy; so are uniform groups and truncated responses when the rollout settings say so."""
    r, a = cfg.rollout, cfg.algorithm
    ga = group_advantages(rewards, [r.group_size] * len(groups), std_normalize=a.std_normalize,
                          focal_gamma=a.focal_gamma, correct_threshold=a.correct_threshold)
    keep = torch.tensor([not all(x.status == "error" for x in g) for g in results for _ in g])
    if r.filter_uniform_groups:
        keep &= (ga.c > 0) & (ga.c < ga.k)
    if r.mask_truncated:
        keep &= torch.tensor([not x.truncated for g in groups for x in g])
    return ga, keep
