"""The reduction of a step's gathered per-rollout records to its logged numbers: exact over all ranks, and
testable on hand-made records without the loop (which nothing imports)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from gapo.trainer.losses import MismatchStats, RolloutStats, group_metrics, mismatch_metrics, update_metrics


@dataclass
class RankStep:
    """What one rank contributes to a step's metrics: per-rollout records and sums, gathered to rank 0."""

    stats: RolloutStats  # one entry per rollout and update
    rewards: Tensor  # [N] one per rollout of this rank
    c: Tensor  # [N] correct rollouts in its group
    k: Tensor  # [N] its group's size
    reward_counts: dict[str, int]  # every status (zeros too) and every flag raised, e.g. an unisolated sandbox
    lengths: list[int]  # response tokens per rollout
    truncated: list[bool]
    mismatch: Tensor  # trainer - engine log-prob per response token
    entropy_sum: float
    kl_ref_sum: float
    first_dev: Tensor  # |log pi - log pi_old| per token of the step's first mini-batch
    off_policy: Tensor  # [len(stats)] bool
    skipped: int  # optimizer steps skipped (the same on every rank)
    tokens: float  # response tokens in the loss
    timings: dict[str, float]  # seconds per phase
    records: list[dict] | None = None  # rollouts.jsonl lines (trainer.log_rollouts)
    per_rollout_mismatch: MismatchStats | None = None  # with the trainer's old-log-prob pass


def step_metrics(parts: list[RankStep], is_level: str, grad_norm: float, lr: float,
                 correct_threshold: float, correction: bool = False) -> dict[str, float]:
    """One step's logged numbers from every rank's per-rollout records."""
    stats = RolloutStats.cat([p.stats for p in parts])
    rewards = torch.cat([p.rewards for p in parts])
    c, k = torch.cat([p.c for p in parts]), torch.cat([p.k for p in parts])
    counts: Counter[str] = Counter()
    for p in parts:
        counts.update(p.reward_counts)
    lengths = np.array([n for p in parts for n in p.lengths])
    mism = torch.cat([p.mismatch for p in parts]).double()
    tokens = sum(p.tokens for p in parts)
    gen_tokens = float(lengths.sum())
    tim = {key: max(p.timings[key] for p in parts) for key in parts[0].timings}  # the slowest rank
    first_dev = torch.cat([p.first_dev for p in parts]).double()
    # "correct" is what counts in c (reward >= algorithm.correct_threshold), the rewarder's other verdicts by name.
    m = {"reward/mean": float(rewards.mean()),
         "reward/correct_frac": float((rewards >= correct_threshold).double().mean())}
    for key, n in counts.items():
        if key != "correct":
            m[f"reward/{key}_frac"] = n / len(rewards)
    m.update(group_metrics(c, k))
    m.update(update_metrics(stats, torch.cat([p.off_policy for p in parts]), is_level))
    m.update({"response/len_mean": float(lengths.mean()), "response/len_max": float(lengths.max()),
              "response/truncated_frac": float(np.mean([x for p in parts for x in p.truncated])),
              "entropy": sum(p.entropy_sum for p in parts) / max(tokens, 1.0),
              # k3 KL(pi_old || pi_ref) per token at rollout time (0 without a reference model)
              "kl_ref": sum(p.kl_ref_sum for p in parts) / max(tokens, 1.0),
              "grad_norm": grad_norm, "lr": lr,
              # optimizer steps of this step whose gradient was not finite (not applied)
              "skipped_steps": float(parts[0].skipped),
              # max |log pi_theta - log pi_old| over the first mini-batch's tokens, where theta = theta_old:
              # 0 exactly when the old-log-prob pass and the update compute the same thing
              "first_minibatch/max_abs_log_ratio": float(first_dev.max()) if first_dev.numel() else 0.0,
              "logprob_mismatch/mean_abs": float(mism.abs().mean()) if mism.numel() else 0.0,
              "logprob_mismatch/max_abs": float(mism.abs().max()) if mism.numel() else 0.0,
              # exp(mean(trainer - engine)): the IS ratio a sequence would carry from the engine alone
              "logprob_mismatch/is_ratio": float(torch.exp(mism.mean())) if mism.numel() else 1.0})
    if all(p.per_rollout_mismatch is not None for p in parts):
        m.update(mismatch_metrics(MismatchStats.cat([p.per_rollout_mismatch for p in parts]), correction))
    m.update({f"time/{key}_s": v for key, v in tim.items()})
    m["time/step_s"] = sum(tim.values())
    m["throughput/gen_tokens_per_s"] = gen_tokens / max(tim["generate"], 1e-9)
    m["throughput/train_tokens_per_s"] = tokens / max(tim["train"], 1e-9)
    return m
