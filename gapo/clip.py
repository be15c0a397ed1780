"""Clip rules: what `algorithm.clip` names, one object each.

A rule says which upper field of the algorithm section it reads (fixed and CISPO: eps_hi; GAPO's adaptive rule:
eps_hi_max), the upper width of each rollout from its group's c and k, and how it reads in words. What the bounds
clip, the ratio inside eq. 11's min or CISPO's detached weight, is the algorithm's surrogate (gapo/algorithms.py).
The config, the loss, gapo-plot and
gapo-compare ask the rule; none of them names a rule, so a new rule is one class here and one `register` call
(tests/test_clip.py adds one from outside the package and trains the loss with it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

UPPER_FIELDS = ("eps_hi", "eps_hi_max")  # the algorithm section's upper widths; a rule reads one, the other stays null


def adaptive_eps_hi(c, k, eps_lo: float, eps_hi_max: float):
    """GAPO's eq. 8, eps_hi(c) = eps_lo + (eps_hi_max - eps_lo) * (k - c) / (k - 1), in its one place: plain
    arithmetic, so the loss applies it to tensors (AdaptiveRule.eps_hi, through gapo.trainer.losses.clip_high, which
    also guards c and k) and gapo-compare band to the numbers of a logged rollout."""
    return eps_lo + (eps_hi_max - eps_lo) * (k - c) / (k - 1)


@dataclass(frozen=True)
class ClipRule:
    """A fixed upper bound 1 + eps_hi for every rollout: the PPO/GSPO rule (eps_hi = eps_lo when symmetric)."""

    name: str = "fixed"
    upper_field: str = "eps_hi"  # the algorithm field holding the rule's (widest) upper width
    surrogate: str = "ppo"  # the surrogate its bounds are for (gapo.algorithms.SURROGATES), unless algorithm.surrogate
    constant: bool = True  # the upper width is the same for every c
    tag: str = ""  # after the upper width in a table's clip range: "5e-3 adaptive" (a fixed rule's needs none)

    def eps_hi(self, c: Any, k: Any, algo: Any) -> Any:
        """The upper width of rollouts with c correct of k (numbers or tensors of one shape)."""
        return algo.eps_hi + 0 * c

    def check(self, algo: Any) -> None:
        """Raise ValueError for widths this rule cannot use (its fields are set: AlgorithmConfig checks that)."""
        if algo.eps_lo >= 1.0:
            raise ValueError(f"algorithm.eps_lo={algo.eps_lo}: a PPO lower bound 1 - eps_lo must stay above 0, so "
                             "eps_lo must be < 1 (only clip=cispo allows 1.0)")

    def describe(self, lo: str, hi: str) -> str:
        """The rule in words (the run header, the rehearsal report, gapo-plot): its name and its widest bounds."""
        return f"{self.name} clip 1 - {lo} .. 1 + {hi}"


@dataclass(frozen=True)
class AdaptiveRule(ClipRule):
    """GAPO (eq. 8): the upper width falls from eps_hi_max at c = 1 to eps_lo at c = k."""

    name: str = "adaptive"
    upper_field: str = "eps_hi_max"
    constant: bool = False
    tag: str = " adaptive"

    def eps_hi(self, c: Any, k: Any, algo: Any) -> Any:
        return adaptive_eps_hi(c, k, algo.eps_lo, algo.eps_hi_max)

    def check(self, algo: Any) -> None:
        super().check(algo)
        if algo.eps_lo > algo.eps_hi_max:
            raise ValueError(f"algorithm.eps_lo={algo.eps_lo} > algorithm.eps_hi_max={algo.eps_hi_max}: the adaptive "
                             "upper bound goes from eps_hi_max (c = 1) down to eps_lo (c = k), so eps_lo <= eps_hi_max")

    def describe(self, lo: str, hi: str) -> str:
        return f"adaptive clip 1 - {lo} .. 1 + eps_hi(c), eps_hi from {hi} (c = 1) down to {lo} (c = k)"


@dataclass(frozen=True)
class CispoRule(ClipRule):
    """CISPO's bounds (MiniMax-M1): the IS weight clipped to [1 - eps_lo, 1 + eps_hi] (its surrogate,
    gapo.algorithms.cispo, detaches it); eps_lo = 1 allowed, no lower clip."""

    name: str = "cispo"
    surrogate: str = "cispo"
    tag: str = " cispo"

    def check(self, algo: Any) -> None:
        return None

    def describe(self, lo: str, hi: str) -> str:
        return f"CISPO weight clipped to [1 - {lo}, 1 + {hi}]"


RULES: dict[str, ClipRule] = {r.name: r for r in (ClipRule(), AdaptiveRule(), CispoRule())}


def register(rule: ClipRule) -> None:
    """Add a rule that `algorithm.clip` can then name (a name already taken by another rule is refused)."""
    if RULES.get(rule.name, rule) != rule:
        raise ValueError(f"clip rule {rule.name!r} exists already ({', '.join(RULES)})")
    if rule.upper_field not in UPPER_FIELDS:
        raise ValueError(f"clip rule {rule.name!r}: upper_field must be eps_hi or eps_hi_max, not {rule.upper_field!r}")
    RULES[rule.name] = rule


def fmt_eps(x: float) -> str:
    """Clip widths the way the paper writes them: 3e-3, 5.25e-3, 7e-5, but 0.2 and 0.28 as decimals."""
    if x == 0 or abs(x) >= 0.01:
        return f"{x:g}"
    mant, exp = f"{x:.4e}".split("e")
    return f"{mant.rstrip('0').rstrip('.')}e{int(exp)}"
