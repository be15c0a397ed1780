"""The power of the laptop experiment's primary tests, simulated from its pilot (experiments/demo_mechanism_plan.md).

    python -m gapo.study.power runs/demo_mechanism_pilot --treated gapo --control gspo_sym

Why steps are resampled: two seeds of the demo differ in their data order and their sampling, the same sources of
variation that make one step of a run differ from the next, and each endpoint is a sum over a run's steps. A
synthetic run is the pilot runs' steps of one arm drawn with replacement, as many as a run has; its endpoints are
computed as gapo/study/endpoints.py computes them on a real run. The spread of synthetic runs stands in for the
spread of seeds, which a pilot of one seed per arm cannot measure. Resampling steps as if independent misses what
differs between whole runs (a trajectory, drift building up over its steps), so the spread is likely optimistic: the
plan says so, and the grid's own spread is reported beside it.

Why the effect is shrunk: a pilot's effect is a noisy, often lucky estimate; the synthetic values are shifted so that
the simulated effect is `shrink` x the pilot's (the plan: one half). The arms are drawn independently, so the pairing
by seed, which lowers the variance of a difference where same-seed runs are positively correlated, is not counted
on.

Each replicate draws the three endpoints from the same synthetic runs (E1 and E3 share the control's), applies the
plan's tests (E1 one-sample t, E2 and E3 paired t, two-sided) and Holm over the family, and counts each endpoint
rejected in its predicted direction.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy import stats as st

from gapo.errors import Exit
from gapo.study.band import read_rollouts
from gapo.study.endpoints import PREDICTED, decisions, decisions_of, mean_is_adv_corr, slope
from gapo.study.figures import PlotError
from gapo.study.stats import holm


@dataclass(frozen=True)
class Steps:
    """One arm's pilot steps as sums from which a run's least-squares slopes add up (x: the advantage, r: the log
    ratio, z: clipped or not), and each step's is_adv_corr."""

    sums: np.ndarray  # [S, 7]: n, Σx, Σx², Σr, Σxr, Σz, Σxz
    corr: np.ndarray  # [S] (NaN where the step logged none)
    steps_per_run: int


def arm_steps(run_dirs: list[Path]) -> Steps:
    rows, corr, lengths = [], [], []
    for run in run_dirs:
        by_step: dict[int, list[dict]] = {}
        for rec in read_rollouts(run):
            by_step.setdefault(int(rec["step"]), []).append(rec)
        logged = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
        step_corr = {int(r["step"]): r["is_adv_corr"] for r in logged if isinstance(r.get("is_adv_corr"), float)}
        lengths.append(len(by_step))
        for step in sorted(by_step):
            d = decisions_of(by_step[step])
            x, r, z = d.adv, np.log(d.ratio), d.clipped.astype(float)
            rows.append([len(x), x.sum(), (x * x).sum(), r.sum(), (x * r).sum(), z.sum(), (x * z).sum()])
            corr.append(step_corr.get(step, math.nan))
    if not rows:
        raise ValueError(f"no logged steps in {', '.join(map(str, run_dirs))}")
    return Steps(np.array(rows, dtype=float), np.array(corr, dtype=float), max(lengths))


def run_values(arm: Steps, draws: np.ndarray) -> dict[str, np.ndarray]:
    """The endpoints of synthetic runs, draws [..., steps_per_run] indexing arm's steps: the slope of the log ratio
    ('ratio') and of P(clip) ('clip') on the advantage, and the mean is_adv_corr ('corr'), each [...]."""
    n, sx, sxx, sr, sxr, sz, sxz = np.moveaxis(arm.sums[draws].sum(-2), -1, 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        var = sxx - sx * sx / n
        ok = var > 1e-12
        ratio = np.where(ok, (sxr - sx * sr / n) / var, np.nan)
        clip = np.where(ok, (sxz - sx * sz / n) / var, np.nan)
    return {"ratio": ratio, "clip": clip, "corr": np.nanmean(arm.corr[draws], axis=-1)}


def pilot_effects(treated: list[Path], control: list[Path]) -> dict[str, float]:
    """The pilot's own endpoint values, as endpoints.py computes them: E1 the control's mean log-ratio slope, E2 and
    E3 the treated arm's mean minus the control's."""
    def per_run(runs: list[Path]) -> dict[str, float]:
        ds = [decisions(r) for r in runs]
        return {"ratio": float(np.mean([slope(d.adv, np.log(d.ratio)) for d in ds])),
                "clip": float(np.mean([slope(d.adv, d.clipped.astype(float)) for d in ds])),
                "corr": float(np.mean([mean_is_adv_corr(r) for r in runs]))}

    t, c = per_run(treated), per_run(control)
    return {"E1": c["ratio"], "E2": t["corr"] - c["corr"], "E3": t["clip"] - c["clip"]}


def simulate(treated: Steps, control: Steps, effects: dict[str, float], seeds: int, *, shrink: float = 0.5,
             sims: int = 2000, alpha: float = 0.05, rng: np.random.Generator, steps: int | None = None
             ) -> dict[str, float]:
    """Power of each endpoint (and of all three together) with `seeds` runs per arm of `steps` steps (default: the
    control's pilot runs'), after Holm over the three."""
    L = steps or control.steps_per_run
    tv = run_values(treated, rng.integers(len(treated.sums), size=(sims, seeds, L)))
    cv = run_values(control, rng.integers(len(control.sums), size=(sims, seeds, L)))
    raw = {"E1": cv["ratio"], "E2": tv["corr"] - cv["corr"], "E3": tv["clip"] - cv["clip"]}
    p, right = {}, {}
    for e, v in raw.items():
        v = v - (np.nanmean(v) - shrink * effects[e])  # centred on the simulated effect
        m, sd = np.nanmean(v, axis=1), np.nanstd(v, axis=1, ddof=1)
        k = np.sum(np.isfinite(v), axis=1)
        t = m / (sd / np.sqrt(k))
        p[e] = 2 * st.t.sf(np.abs(t), k - 1)
        right[e] = np.sign(m) == PREDICTED[e]
    adjusted = np.array([holm([p[e][i] for e in raw]) for i in range(sims)])  # [sims, 3]
    hit = {e: (adjusted[:, j] < alpha) & right[e] for j, e in enumerate(raw)}
    out = {e: float(h.mean()) for e, h in hit.items()}
    out["all"] = float(np.logical_and.reduce(list(hit.values())).mean())
    return out


def smallest_effect(sd: float, seeds: int, family: int = 3, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest effect a two-sided one-sample (or paired) t test over `seeds` values of spread `sd` detects with
    `power` at alpha / family (Bonferroni, which Holm never tests more strictly): exact, from the noncentral t."""
    from scipy.optimize import brentq

    crit = st.t.ppf(1 - alpha / family / 2, seeds - 1)
    def gap(d: float) -> float:
        return st.nct.sf(crit, seeds - 1, d / sd * math.sqrt(seeds)) - power

    return brentq(gap, 1e-12 * sd, 50 * sd)


def spread(arm: Steps, key: str, rng: np.random.Generator, sims: int = 2000, steps: int | None = None) -> float:
    """The per-run SD of one quantity over synthetic runs of `arm` of `steps` steps (default: its pilot runs')."""
    draws = rng.integers(len(arm.sums), size=(sims, steps or arm.steps_per_run))
    return float(np.nanstd(run_values(arm, draws)[key], ddof=1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gapo.study.power", description=__doc__.split("\n\n")[0])
    ap.add_argument("root", type=Path, help="the pilot's runs: ROOT/ARM/seedN/ (gapo-sweep's layout)")
    ap.add_argument("--treated", default="gapo")
    ap.add_argument("--control", default="gspo_sym")
    ap.add_argument("--seeds", type=int, nargs="+", default=[10, 12, 16, 20])
    ap.add_argument("--shrink", type=float, default=0.5)
    ap.add_argument("--sims", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=16, help="steps of a planned run (the synthetic runs' length)")
    a = ap.parse_args(argv)
    runs = {arm: sorted(p for p in (a.root / arm).glob("seed*") if re.fullmatch(r"seed\d+", p.name))  # no rehearsal
            for arm in (a.treated, a.control)}
    if not all(runs.values()):
        print(f"power: {a.root}: no seed*/ runs under {[arm for arm, r in runs.items() if not r]}", file=sys.stderr)
        return Exit.CONFIG
    rng = np.random.default_rng(a.seed)
    try:
        t, c = arm_steps(runs[a.treated]), arm_steps(runs[a.control])
        effects = pilot_effects(runs[a.treated], runs[a.control])
    except (PlotError, OSError, ValueError) as err:
        print(f"power: {err}", file=sys.stderr)
        return Exit.CONFIG
    sd = {"E1": spread(c, "ratio", rng, steps=a.steps),
          "E2": math.hypot(spread(t, "corr", rng, steps=a.steps), spread(c, "corr", rng, steps=a.steps)),
          "E3": math.hypot(spread(t, "clip", rng, steps=a.steps), spread(c, "clip", rng, steps=a.steps))}
    print(f"pilot: {a.treated} {[r.name for r in runs[a.treated]]}, {a.control} {[r.name for r in runs[a.control]]}; "
          f"{len(t.sums)} + {len(c.sums)} steps; {a.sims} replicates; effect simulated at {a.shrink:g} x the pilot's; "
          "Holm over E1-E3 at 0.05, two-sided, in the predicted direction\n")
    print(f"| endpoint | pilot effect | per-run SD (E2, E3: of the difference; synthetic runs) | simulated effect | "
          f"{' | '.join(f'power, {n} seeds' for n in a.seeds)} |")
    print("|---|---|---|---|" + "---|" * len(a.seeds))
    powers = {n: simulate(t, c, effects, n, shrink=a.shrink, sims=a.sims, rng=rng, steps=a.steps) for n in a.seeds}
    for e in ("E1", "E2", "E3", "all"):
        head = (f"| {e} | {effects[e]:+.4g} | {sd[e]:.4g} | {a.shrink * effects[e]:+.4g}" if e != "all"
                else "| all three | | |")
        print(f"{head} | {' | '.join(f'{powers[n][e]:.2f}' for n in a.seeds)} |")
    print("\nThe smallest effect each test detects with 80 % power (two-sided t at 0.05 / 3, the strictest level Holm "
          "uses; the per-run SD above), in the predicted direction:\n")
    print(f"| endpoint | {' | '.join(f'{n} seeds' for n in a.seeds)} |")
    print("|---|" + "---|" * len(a.seeds))
    for e in ("E1", "E2", "E3"):
        print(f"| {e} | {' | '.join(f'{PREDICTED[e] * smallest_effect(sd[e], n):+.3g}' for n in a.seeds)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
