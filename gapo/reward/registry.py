"""Rewarder by dataset type: the loop hands over a step's groups and gets one RewardResult per response.

All of a step's groups go to the pool at once (`score_batch`), so k x prompts verifications share the
workers instead of waiting group by group.
"""

from __future__ import annotations

import re

from gapo.config import RewardConfig
from gapo.data import Problem
from gapo.reward.types import RewardResult

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def with_last_number(response: str) -> str:
    """`reward.math_last_number_fallback`: a response with no boxed answer is scored on its last number.
    Off by default (it rewards ignoring the requested format); on for the CPU demo, whose 135M model
    rarely writes \\boxed{} at first and would otherwise see almost no reward."""
    from gapo.reward.math import extract_answer

    if extract_answer(response) is not None:
        return response
    numbers = _NUMBER.findall(response)
    return f"{response}\n\\boxed{{{numbers[-1]}}}" if numbers else response


def score_groups(kind: str, groups: list[list[str]], problems: list[Problem],
                 cfg: RewardConfig) -> list[list[RewardResult]]:
    if kind == "math":
        from gapo.reward.math import MathGold, default_verifier

        if cfg.math_last_number_fallback:
            groups = [[with_last_number(x) for x in g] for g in groups]
        golds = [MathGold.from_record({**p.meta, "answer": p.gold}) for p in problems]
        return default_verifier(cfg.num_workers, cfg.math_timeout_s).score_batch(list(zip(groups, golds, strict=True)))
    if kind == "code":
        from gapo.reward.code import default_runner

        runner = default_runner(cfg.num_workers, cfg.code_timeout_s, cfg.code_memory_mb)
        return runner.score_batch([(g, p.gold) for g, p in zip(groups, problems, strict=True)])
    raise ValueError(f"data.type={kind!r}: no rewarder (expected 'math' or 'code')")
