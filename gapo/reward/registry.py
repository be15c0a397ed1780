"""Rewarder by dataset type: the loop hands over a step's groups and gets one RewardResult per response; and the
check, before a run starts, that every record is one its rewarder can score.

All of a step's groups go to the pool at once (`score_batch`), so k x prompts verifications share the
workers instead of waiting group by group. If that raises, the step's groups are scored one at a time, so that
a record the load-time check could not catch, or a rewarder bug, costs only its own group: its rollouts get
status "error" (and, in the loop, no gradient) instead of ending a run that may be days in.
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter

from gapo.config import ConfigError, DataConfig, RewardConfig
from gapo.data import Dropped, Problem, load_training_set, tokenize_problems
from gapo.reward.types import RewardResult

log = logging.getLogger("gapo.reward")

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")

# Why a record cannot be trained or evaluated on: the names counted on the console and in dropped_records.jsonl.
REASONS = ("empty prompt", "no answer", "empty answer", "unsupported answer", "no test cases", "tests unparseable",
           "prompt too long")


def with_last_number(response: str) -> str:
    """`reward.math_last_number_fallback`: a response with no boxed answer is scored on its last number.
    Off by default (it rewards ignoring the requested format); on for the CPU demo, whose 135M model
    rarely writes \\boxed{} at first and would otherwise see almost no reward."""
    from gapo.reward.math import extract_answer

    if extract_answer(response) is not None:
        return response
    numbers = _NUMBER.findall(response)
    return f"{response}\n\\boxed{{{numbers[-1]}}}" if numbers else response


def invalid_reason(kind: str, problem: Problem) -> tuple[str, str] | None:
    """(reason, detail) when the record's prompt or gold cannot be used: the gold must parse the way the rewarder
    parses it at scoring time (math: MathGold; code: a test suite with at least one case). None when it can."""
    if not problem.question.strip():
        return "empty prompt", "the prompt field is empty"
    if kind == "math":
        from gapo.reward.math import MathGold

        if problem.gold is None:
            return "no answer", "the answer field is null"
        try:
            MathGold.from_record({**problem.meta, "answer": problem.gold})
        except (TypeError, ValueError) as err:
            reason = "empty answer" if "empty" in str(err) else "unsupported answer"
            return reason, f"{err} (answer {problem.gold!r:.120})"
        return None
    if kind == "code":
        from gapo.reward.code import parse_tests

        if problem.gold is None:
            return "tests unparseable", "the tests field is null"
        try:
            suite = parse_tests(problem.gold)
        except (TypeError, ValueError, SyntaxError, RecursionError, MemoryError) as err:
            return ("no test cases" if "no test cases" in str(err) or "empty list" in str(err)
                    else "tests unparseable"), str(err)[:300]
        return None if suite.cases else ("no test cases", "the test suite holds no case")
    return None  # ifeval: its own loader checks its records (gapo.study.ifeval.prepare)


def check_problems(kind: str, problems: list[Problem], source: str) -> tuple[list[Problem], list[Dropped]]:
    """The records that can be scored, and the others with their reason, in order."""
    kept, dropped = [], []
    for p in problems:
        bad = invalid_reason(kind, p)
        if bad is None:
            kept.append(p)
        else:
            dropped.append(Dropped(source=source, uid=p.uid, reason=bad[0], detail=bad[1]))
    return kept, dropped


def dropped_summary(dropped: list[Dropped], total: int) -> str:
    """'2 of 7474 records (empty answer: 1, no answer: 1)', for the console and the reports."""
    counts = Counter(d.reason for d in dropped)
    return f"{len(dropped)} of {total} records ({', '.join(f'{r}: {n}' for r, n in counts.most_common())})"


def training_set(d: DataConfig, tokenizer) -> tuple[list[Problem], list[list[int]], list[Dropped]]:
    """data.train's records that can be trained on, their prompt ids, and the others with why: every record is
    checked before the engine starts (a public dataset's empty answer must not end a run at a random step).
    data.on_invalid=error refuses the run instead, naming the first records."""
    problems = load_training_set(d)
    total = len(problems)
    problems, dropped = check_problems(d.type, problems, "train")
    if dropped and d.on_invalid == "error":
        first = "; ".join(f"{x.uid}: {x.reason} ({x.detail})" for x in dropped[:5])
        raise ConfigError(f"data.train: {dropped_summary(dropped, total)} cannot be scored (data.on_invalid=error): "
                          f"{first}. Fix the data, or set data.on_invalid=drop to train on the rest")
    if not problems:
        raise ConfigError(f"data.train: no record can be scored: {dropped_summary(dropped, total)}; check "
                          "data.prompt_key / data.answer_key and data.type")
    problems, prompt_ids, too_long = tokenize_problems(tokenizer, problems, d.instruction, d.max_prompt_tokens)
    dropped += too_long
    if dropped:
        log.warning("data.train: dropped %s; trains on the other %d", dropped_summary(dropped, total), len(problems))
    return problems, prompt_ids, dropped


def score_groups(kind: str, groups: list[list[str]], problems: list[Problem],
                 cfg: RewardConfig) -> list[list[RewardResult]]:
    """One result per response. A failure of the whole batch is retried group by group, and a group that still
    fails gets status "error" for each of its rollouts, logged with the problem's id and the exception."""
    if kind not in ("math", "code"):
        raise ValueError(f"data.type={kind!r}: no rewarder (expected 'math' or 'code')")
    try:
        return _score(kind, groups, problems, cfg)
    except Exception as err:  # noqa: BLE001 - any rewarder failure: isolate it to its group below
        log.warning("scoring the step's %d groups at once raised %s: %s; scoring them one at a time", len(groups),
                    type(err).__name__, err)
    out = []
    for group, problem in zip(groups, problems, strict=True):
        try:
            out.append(_score(kind, [group], [problem], cfg)[0])
        except Exception as err:  # noqa: BLE001 - this group's failure, reported and counted as status "error"
            log.error("problem %s: scoring raised %s: %s; its %d rollouts get status error and no gradient",
                      problem.uid, type(err).__name__, err, len(group))
            out.append([RewardResult.of("error", f"{type(err).__name__}: {err}")] * len(group))
    return out


def _score(kind: str, groups: list[list[str]], problems: list[Problem],
           cfg: RewardConfig) -> list[list[RewardResult]]:
    fault = os.environ.get("GAPO_FAULT", "")  # fault injection for the tests: score_raise:<problem uid>
    if fault.startswith("score_raise:") and any(p.uid == fault.split(":", 1)[1] for p in problems):
        raise RuntimeError(f"injected rewarder failure ({fault})")
    if kind == "math":
        from gapo.reward.math import MathGold, default_verifier

        if cfg.math_last_number_fallback:
            groups = [[with_last_number(x) for x in g] for g in groups]
        golds = [MathGold.from_record({**p.meta, "answer": p.gold}) for p in problems]
        return default_verifier(cfg.num_workers, cfg.math_timeout_s).score_batch(list(zip(groups, golds, strict=True)))
    from gapo.reward.code import default_runner

    runner = default_runner(cfg.num_workers, cfg.code_timeout_s, cfg.code_memory_mb)
    return runner.score_batch([(g, p.gold) for g, p in zip(groups, problems, strict=True)])


class RewardsFailed(RuntimeError):
    """Too many of a step's rollouts could not be scored: a broken rewarder must not train on nothing silently."""


def check_rewards(results: list[RewardResult], max_error_frac: float, step: int, device) -> None:
    """Collective: the same decision on every rank, from the step's share of rollouts with status "error"."""
    import torch
    import torch.distributed as dist

    n = torch.tensor([sum(x.status == "error" for x in results), len(results)], dtype=torch.float64, device=device)
    dist.all_reduce(n)
    errors, total = int(n[0]), int(n[1])
    if errors > max_error_frac * total:
        raise RewardsFailed(f"step {step}: {errors} of {total} rollouts could not be scored (status error; "
                            f"reward.max_error_frac={max_error_frac}): the rewarder is failing, see the errors "
                            "logged above in train.log")
