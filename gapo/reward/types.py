"""The record every rewarder returns, shared by the math and code rewarders.

A reward alone cannot tell "the model was wrong" from "the rewarder broke": a verifier that silently
scores 0 ruins a run without anyone noticing. So every score carries a status, and only "correct" and
"wrong" are verdicts about the model; "timeout" and "error" are counted and logged separately.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

STATUSES = ("correct", "wrong", "no_answer", "timeout", "error")

# Flag set when the code sandbox ran without namespace isolation (see gapo.reward.sandbox).
FLAG_UNISOLATED = "unisolated"
# Flag set when math-verify could not parse the gold answer into math and fell back to exact text matching.
FLAG_GOLD_TEXT_ONLY = "gold_text_only"


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
