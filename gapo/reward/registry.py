"""The rewarder table: what each dataset type (`data.type`, a benchmark's kind) means to a run, in one row each,
and the calls that go through it: the check, before a run starts, that every record is one its rewarder can score,
and the scoring of a step's groups.

A row holds the kind's record check, its scorer and its metrics (and, for a benchmark file that must be refused
whole when it is malformed, a load step). Adding a rewarder is one module and one row:

    1. gapo/reward/<kind>.py with `score_records(groups, problems, cfg) -> list[list[RewardResult]]` (one result per
       response; reward 1.0 exactly when the status is "correct") and, when records can be unscoreable,
       `check_record(problem) -> (reason, detail) | None` (reason one of REASONS);
    2. a row `"<kind>": RewardKind(score=<kind>.score_records, check=<kind>.check_record)` in REWARDERS below.

From outside the package, a file named in the config's `plugins` calls `register("<kind>", RewardKind(...))` when it
is imported (docs/own-data.md).

`data.type=<kind>` then trains with it, and a benchmark of that kind (gapo.evaluation.BENCHMARKS) is evaluated
with it; config.py cannot import this table (it sits below it), so an unknown kind is refused here, by `rewarder`,
before the engine starts.

All of a step's groups go to the pool at once (`score_batch`), so k x prompts verifications share the
workers instead of waiting group by group. If that raises, the step's groups are scored one at a time, so that
a record the load-time check could not catch, or a rewarder bug, costs only its own group: its rollouts get
status "error" (and, in the loop, no gradient) instead of ending a run that may be days in. A rewarder that cannot
run at all (RewarderUnavailable: math-verify missing, workers that never start) ends the run at once instead.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from gapo import faults
from gapo.config import MATH_INSTRUCTION, DataConfig, RewardConfig
from gapo.data import Dropped, Problem, load_training_set, tokenize_problems
from gapo.errors import ConfigError
from gapo.reward import code, ifeval, math
from gapo.reward.types import RewarderUnavailable, RewardResult

log = logging.getLogger("gapo.reward")

# Why a record cannot be trained or evaluated on: the names counted on the console and in dropped_records.jsonl.
REASONS = ("empty prompt", "no answer", "empty answer", "unsupported answer", "no test cases", "tests unparseable",
           "prompt too long")


def scoreable(problem: Problem) -> None:
    """A row's default record check: any record with a prompt can be scored."""
    return None


def no_metrics(per_problem: list[list[RewardResult]]) -> dict[str, float]:
    """A row's default metrics: none beyond the pass@k and coverage that every benchmark gets."""
    return {}


def as_loaded(problems: list[Problem], where: str) -> list[Problem]:
    """A row's default load step: the records as the loader read them."""
    return problems


@dataclass(frozen=True)
class RewardKind:
    """One row of the rewarder table."""

    # One result per response of each group, groups and records in the same order.
    score: Callable[[list[list[str]], list[Problem], RewardConfig], list[list[RewardResult]]]
    # (reason, detail) when a record cannot be scored (it is dropped and counted), else None.
    check: Callable[[Problem], tuple[str, str] | None] = scoreable
    # A benchmark's numbers beyond pass@k (val/<bench>/<name>), from each problem's results.
    metrics: Callable[[list[list[RewardResult]]], dict[str, float]] = no_metrics
    # Run on a benchmark's or training set's records after loading; raises ConfigError to refuse the file whole.
    prepare: Callable[[list[Problem], str], list[Problem]] = as_loaded
    # Appended to an evaluated prompt when gapo-eval names no instruction.
    instruction: str = ""
    # The prompt itself is under test (IFEval): nothing is appended, not even an instruction given explicitly.
    bare_prompt: bool = False
    # Counted in val/mean (IFEval, the paper's out-of-domain probe, is not: Table 3's "Avg." leaves it out).
    in_mean: bool = True


REWARDERS: dict[str, RewardKind] = {
    "math": RewardKind(score=math.score_records, check=math.check_record, instruction=MATH_INSTRUCTION),
    "code": RewardKind(score=code.score_records, check=code.check_record),
    "ifeval": RewardKind(score=ifeval.score_records, metrics=ifeval.metrics, prepare=ifeval.prepare_benchmark,
                         bare_prompt=True, in_mean=False),
}


def register(kind: str, row: RewardKind) -> None:
    """Add a row from outside the package: a file named in the config's plugins calls this when imported."""
    if not kind or not isinstance(row, RewardKind):
        raise ConfigError(f"register({kind!r}, ...): expected a kind name and a RewardKind row")
    if REWARDERS.get(kind, row) is not row:
        raise ConfigError(f"register({kind!r}, ...): the rewarder table has a row of that kind already "
                          f"({', '.join(REWARDERS)}); choose another name")
    REWARDERS[kind] = row


def rewarder(kind: str) -> RewardKind:
    """The table's row for `kind`; an unknown kind is a ConfigError naming the known ones."""
    if kind not in REWARDERS:
        raise ConfigError(f"data.type={kind!r}: no rewarder of that kind; the rewarder table "
                          f"(gapo.reward.registry.REWARDERS) has {', '.join(REWARDERS)}")
    return REWARDERS[kind]


def invalid_reason(kind: str, problem: Problem) -> tuple[str, str] | None:
    """(reason, detail) when the record's prompt or gold cannot be used: the gold must parse the way the rewarder
    parses it at scoring time (its row's check). None when it can."""
    if not problem.question.strip():
        return "empty prompt", "the prompt field is empty"
    return rewarder(kind).check(problem)


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
    problems = rewarder(d.type).prepare(load_training_set(d), "data.train")
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
    row = rewarder(kind)
    try:
        return _score(row, groups, problems, cfg)
    except RewarderUnavailable:  # no group would score either
        raise
    except Exception as err:  # noqa: BLE001 - any rewarder failure: isolate it to its group below
        log.warning("scoring the step's %d groups at once raised %s: %s; scoring them one at a time", len(groups),
                    type(err).__name__, err)
    out = []
    for group, problem in zip(groups, problems, strict=True):
        try:
            out.append(_score(row, [group], [problem], cfg)[0])
        except Exception as err:  # noqa: BLE001 - this group's failure, reported and counted as status "error"
            log.error("problem %s: scoring raised %s: %s; its %d rollouts get status error and no gradient",
                      problem.uid, type(err).__name__, err, len(group))
            out.append([RewardResult.of("error", f"{type(err).__name__}: {err}")] * len(group))
    return out


def _score(row: RewardKind, groups: list[list[str]], problems: list[Problem],
           cfg: RewardConfig) -> list[list[RewardResult]]:
    victim = faults.injected("score_raise")
    if victim is not None and any(p.uid == victim for p in problems):
        raise RuntimeError(f"injected rewarder failure (score_raise:{victim})")
    return row.score(groups, problems, cfg)


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
