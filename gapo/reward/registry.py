"""Rewarder by dataset type: the loop hands over a step's groups and gets one RewardResult per response."""

from __future__ import annotations

from gapo.config import RewardConfig
from gapo.reward.types import RewardResult


def score_groups(kind: str, groups: list[list[str]], golds: list, cfg: RewardConfig) -> list[list[RewardResult]]:
    if kind == "math":
        from gapo.reward.math import score_math

        return [score_math(g, gold, timeout_s=cfg.math_timeout_s, num_workers=cfg.num_workers)
                for g, gold in zip(groups, golds, strict=True)]
    if kind == "code":
        from gapo.reward.code import score_code

        return [score_code(g, tests, timeout_s=cfg.code_timeout_s, memory_mb=cfg.code_memory_mb,
                           num_workers=cfg.num_workers) for g, tests in zip(groups, golds, strict=True)]
    raise ValueError(f"data.type={kind!r}: no rewarder (expected 'math' or 'code')")
