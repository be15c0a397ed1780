"""What the math and code rewarders share: the record every rewarder returns, and their worker-pool scaffolding.

A reward alone cannot tell "the model was wrong" from "the rewarder broke": a verifier that silently
scores 0 ruins a run without anyone noticing. So every score carries a status, and only "correct" and
"wrong" are verdicts about the model; "timeout" and "error" are counted and logged separately.
"""

from __future__ import annotations

import atexit
import signal
import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Self

STATUSES = ("correct", "wrong", "no_answer", "timeout", "error")

# Flag set when the code sandbox ran without namespace isolation (see gapo.reward.sandbox).
FLAG_UNISOLATED = "unisolated"
# Flag set when math-verify could not parse the gold answer into math and fell back to exact text matching.
FLAG_GOLD_TEXT_ONLY = "gold_text_only"
# Flag set on an "error" whose cause is the host, not the rewarder's code nor the response: the sandboxed program or
# the verifier worker was killed mid-answer by a signal nobody inside sent (the OOM killer, a kill aimed at the job).
FLAG_HOST_FAULT = "host_fault"


def signal_name(signum: int) -> str:
    """SIGKILL for 9; the number itself for a signal Python has no name for."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class RewarderUnavailable(RuntimeError):
    """The rewarder itself cannot run (its library is missing, its workers never start): no group would score,
    so the run stops with this message instead of isolating the failure group by group and training on
    status "error" rollouts."""


@dataclass(frozen=True)
class RewardResult:
    """Binary reward plus why. `reward` is 1.0 exactly when `status == "correct"`, so GAPO's group
    success count c is well defined; `detail` is a short human-readable note for logs (the extracted
    answer, the failing test, the error); `flags` marks degraded conditions such as an unisolated sandbox."""

    reward: float
    status: str
    detail: str = ""
    flags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"RewardResult.status must be one of {STATUSES}, got {self.status!r}")
        if self.reward != (1.0 if self.status == "correct" else 0.0):
            raise ValueError(f"RewardResult.reward {self.reward!r} contradicts status {self.status!r}")

    @classmethod
    def of(cls, status: str, detail: str = "", flags: tuple[str, ...] = ()) -> RewardResult:
        """Build a result whose reward follows from its status, so the two can never disagree."""
        return cls(1.0 if status == "correct" else 0.0, status, _clip(detail), flags)


def _clip(text: str, limit: int = 300) -> str:
    """Details go into logs and metrics; a 1 MB wrong answer must not."""
    text = str(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def status_counts(results: Iterable[RewardResult]) -> dict[str, int]:
    """Per-status counts (every status present, zeros included) plus per-flag counts, for a step's
    metrics: timeouts and errors must show up as numbers, not hide inside the mean reward."""
    counts = dict.fromkeys(STATUSES, 0)
    for result in results:
        counts[result.status] += 1
        for flag in result.flags:
            counts[flag] = counts.get(flag, 0) + 1
    return counts


class Rewarder:
    """A pool of `num_workers` workers kept across training steps (one per setting and process: `shared`),
    closed at interpreter exit, and `score` (one group) / `score_batch` (many groups at once, the trainer's
    call) with one check of their input. A subclass parses a gold answer (`parse_gold`), scores checked
    groups (`score_groups`) and stops its workers (`close`)."""

    gold_name = "gold"  # what an item's second element is called in error messages

    def __init__(self, num_workers: int) -> None:
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        self.num_workers = num_workers
        _LIVE.add(self)

    @classmethod
    def shared(cls, *settings: Any) -> Self:
        """The process's instance for these settings, created on first use: the pool outlives the step."""
        key = (cls, *settings)
        with _SHARED_LOCK:
            if key not in _SHARED:
                _SHARED[key] = cls(*settings)
            return _SHARED[key]

    def score(self, responses: Sequence[str], gold: Any) -> list[RewardResult]:
        """Score k responses to one problem against its gold (answer or tests, as stored)."""
        return self.score_batch([(responses, gold)])[0]

    def score_batch(self, items: Sequence[tuple[Sequence[str], Any]]) -> list[list[RewardResult]]:
        """Score many (responses, gold) groups; all their responses share the workers. Bad input raises
        before any work starts, naming the item."""
        golds = []
        for i, item in enumerate(items):
            if not isinstance(item, tuple | list) or len(item) != 2:
                raise TypeError(f"items[{i}]: expected a (responses, {self.gold_name}) pair, got {type(item).__name__}")
            responses, gold = item
            if not isinstance(responses, list | tuple):
                raise TypeError(f"items[{i}] responses: expected a list of str, got {type(responses).__name__}")
            for j, response in enumerate(responses):
                if not isinstance(response, str):
                    raise TypeError(f"items[{i}] responses[{j}]: expected str, got {type(response).__name__}")
            try:
                golds.append(self.parse_gold(gold))
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"items[{i}]: {exc}") from None
        return self.score_groups([responses for responses, _ in items], golds)

    def parse_gold(self, gold: Any) -> Any:
        raise NotImplementedError

    def score_groups(self, groups: list[Sequence[str]], golds: list[Any]) -> list[list[RewardResult]]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_LIVE: weakref.WeakSet[Rewarder] = weakref.WeakSet()
_SHARED: dict[tuple, Rewarder] = {}
_SHARED_LOCK = threading.Lock()


@atexit.register
def _close_all() -> None:
    for rewarder in list(_LIVE):
        rewarder.close()
