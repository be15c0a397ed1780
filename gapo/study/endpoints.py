"""The laptop experiment's endpoints (experiments/demo_mechanism_plan.md): the paper's Figs. 1, 3 and 5 as quantities
of one run each, so that seeds are the units and two rules' runs pair by trainer.seed.

Why per run: a pooled count mixes the runs' trajectories, and the rule under test changes the trajectory (which c
arise, how far ratios drift), so pooled decisions are neither independent nor comparable across arms. One number per
run, then a test across seeds, keeps every seed and asks each the same question.

- E1, the premise (Fig. 1: "scarce correct rollouts move away ... substantially faster"): in each run, the slope of
  the correct off-policy decisions' log sequence ratio on their advantage (k - c)/k (least squares); and, judged on
  the same ratios, the slope of the probability that a fixed upper bound clips them. Across seeds: the mean slope,
  its t interval, the one-sample t and the exact sign-flip p.
- E2 (Fig. 5): a run's mean over steps of `is_adv_corr` (Pearson's r of the IS ratio and the advantage in a step),
  GAPO minus a fixed rule, paired by seed.
- E3 (Fig. 3), per run: the least-squares slope of "clipped by the run's own rule" on the advantage (a linear
  probability slope: defined for a run that never clipped, where a logistic one diverges), GAPO minus a fixed rule,
  paired by seed: under GAPO the clip probability should fall with the advantage relative to the fixed rule. The
  same question over every decision at once (secondary): clipped against rule x advantage as a logistic GEE over
  every seed's decisions, seeds as clusters (statsmodels, exchangeable working correlation, the Mancl-DeRouen
  bias-reduced sandwich, which holds with few clusters; not seed fixed effects, which diverge for a seed whose run
  never clipped and would drop it). Beside them, each run's advantage-weighted clip share (the share of the correct
  decisions' advantage that clipping removed: where the signal is), paired by seed.

A decision is one off-policy update of one rollout with A > 0 (the step's first optimizer step is on-policy and
cannot clip), read from rollouts.jsonl (trainer.log_rollouts).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gapo.config import AlgorithmConfig
from gapo.study.band import LEGACY_ON_POLICY, read_rollouts
from gapo.study.figures import PlotError
from gapo.study.stats import holm, paired_t, sign_flip_p


@dataclass(frozen=True)
class Decisions:
    """One run's correct off-policy decisions, one entry each."""

    adv: np.ndarray  # [N] (k - c)/k
    ratio: np.ndarray  # [N] the sequence IS ratio at the update
    clipped: np.ndarray  # [N] bool: the run's own rule clipped it (its upper bound)

    def __len__(self) -> int:
        return len(self.adv)


def decisions(run_dir: Path) -> Decisions:
    return decisions_of(read_rollouts(run_dir))


def decisions_of(records: list[dict]) -> Decisions:
    """The decisions of some of a run's rollout records (one step's: gapo.study.power)."""
    adv, ratio, clipped = [], [], []
    for rec in records:
        if float(rec["adv"]) <= 0:
            continue
        for u in rec["updates"]:
            if u.get("off_policy", abs(float(u["is_ratio"]) - 1) >= LEGACY_ON_POLICY):  # older logs have no flag
                adv.append(float(rec["adv"]))
                ratio.append(float(u["is_ratio"]))
                clipped.append(int(u.get("clip_hi_tokens", 0)) > 0)
    return Decisions(np.array(adv), np.array(ratio), np.array(clipped, dtype=bool))


def slope(x: np.ndarray, y: np.ndarray) -> float:
    """Least-squares slope of y on x; NaN where x does not vary (every decision of one c: no gradient to see)."""
    if len(x) < 2 or np.ptp(x) == 0:
        return float("nan")
    xc = x - x.mean()
    return float((xc * (y - y.mean())).sum() / (xc * xc).sum())


def premise(d: Decisions, fixed_eps_hi: list[float]) -> dict[str, float]:
    """E1 for one run: the log-ratio slope, and per fixed upper bound (eps_hi) the clip-probability slope of the same
    ratios judged under it."""
    out = {"log ratio": slope(d.adv, np.log(d.ratio))}
    for eps_hi in fixed_eps_hi:
        out[f"P(clip) at 1 + {eps_hi:g}"] = slope(d.adv, (d.ratio > 1 + eps_hi).astype(float))
    return out


def mean_is_adv_corr(run_dir: Path) -> float:
    """E2 for one run: is_adv_corr averaged over the steps that logged it."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{run_dir}: no metrics.jsonl")
    values = [row["is_adv_corr"] for row in map(json.loads, path.read_text().splitlines())
              if isinstance(row.get("is_adv_corr"), float) and math.isfinite(row["is_adv_corr"])]
    return float(np.mean(values)) if values else float("nan")


def clip_slope(d: Decisions) -> float:
    """E3 for one run: the linear probability slope of "clipped by the run's own rule" on the advantage."""
    return slope(d.adv, d.clipped.astype(float))


def weighted_clip_share(d: Decisions) -> float:
    """E3's per-run figure: the share of the correct decisions' summed advantage whose update clipping removed."""
    total = d.adv.sum()
    return float(d.adv[d.clipped].sum() / total) if total > 0 else float("nan")


@dataclass(frozen=True)
class AcrossSeeds:
    """One endpoint over the seeds: the per-seed values (or paired differences), their mean and t interval, the
    one-sample t p-value and the exact sign-flip p; and every seed that ran but has no value, with why."""

    seeds: list[int]
    values: np.ndarray
    mean: float
    lo: float
    hi: float
    p_t: float
    p_flip: float
    without: dict[int, str] = field(default_factory=dict)  # seed -> why it has no value

    @property
    def sd(self) -> float:
        """The spread of the per-seed values (the plan's per-run SD, or the pairs' SD), to set beside the pilot's."""
        return float(np.std(self.values, ddof=1)) if len(self.values) > 1 else float("nan")


def across_seeds(by_seed: dict[int, float], why: dict[int, str] | None = None) -> AcrossSeeds:
    """Every seed with a finite value, in seed order. A seed without one (no correct decision, one advantage only,
    a run one arm lacks) is not replaced or dropped in silence: it is listed in `without`, with `why[seed]`."""
    seeds = sorted(s for s, v in by_seed.items() if math.isfinite(v))
    values = np.array([by_seed[s] for s in seeds], dtype=float)
    mean, lo, hi, p = paired_t(values)
    without = {s: (why or {}).get(s, "no value") for s in sorted(by_seed) if not math.isfinite(by_seed[s])}
    return AcrossSeeds(seeds, values, mean, lo, hi, p, sign_flip_p(values), without)


def paired(a: dict[int, float], b: dict[int, float]) -> dict[int, float]:
    """a - b by trainer.seed, at every seed either side ran: NaN where one side has no value or no run, so that
    across_seeds names the seed rather than the pair vanishing."""
    return {s: a.get(s, math.nan) - b.get(s, math.nan) for s in sorted(set(a) | set(b))}


def why_paired(labels: tuple[str, str], values: tuple[dict[int, float], dict[int, float]],
               why: tuple[dict[int, str], dict[int, str]]) -> dict[int, str]:
    """Why each seed of a pair has no difference: which side lacks a value, and that side's reason."""
    out = {}
    for s in sorted(set(values[0]) | set(values[1])):
        said = [f"{lab}: {w.get(s, 'no value') if s in v else 'no run'}"
                for lab, v, w in zip(labels, values, why, strict=True) if not math.isfinite(v.get(s, math.nan))]
        if said:
            out[s] = "; ".join(said)
    return out


def why_none(d: Decisions) -> str:
    """Why a run's decisions give no slope (E1, E3) or share."""
    if not len(d):
        return "no correct off-policy decision"
    if np.ptp(d.adv) == 0:
        return f"its {len(d)} decision(s) share one advantage, {d.adv[0]:.3g}: no slope"
    return "no finite value"


@dataclass(frozen=True)
class Interaction:
    """E3's model term: the log odds ratio of clipping per unit of advantage under `rule` against the reference."""

    rule: str
    reference: str
    estimate: float
    lo: float
    hi: float
    p: float
    decisions: int
    clusters: int


def clip_model(runs: dict[str, dict[int, Decisions]], reference: str, level: float = 0.95) -> list[Interaction]:
    """P(clip) ~ rule + advantage + rule:advantage over every decision of every run in `runs` (label -> seed ->
    decisions), seeds as clusters (module docstring); one Interaction per label other than `reference`. The same
    seed's runs under different rules form one cluster: they share their start and their sampling seeds."""
    import pandas as pd
    import statsmodels.api as sm
    import statsmodels.formula.api as smf

    rows = [pd.DataFrame({"clip": d.clipped.astype(float), "adv": d.adv, "rule": label, "seed": seed})
            for label, by_seed in runs.items() for seed, d in by_seed.items() if len(d)]
    if not rows:
        return []
    data = pd.concat(rows, ignore_index=True)
    flat = data.groupby("rule")["clip"].agg(["min", "max"])
    if (flat["min"] == flat["max"]).any():  # a rule that never (or always) clipped: the odds diverge, not estimable
        said = [f"{label}: {'every' if row['min'] == 1 else 'no'} decision clipped" for label, row in flat.iterrows()
                if row["min"] == row["max"]]
        raise ValueError(f"the clip model has nothing to fit ({'; '.join(said)})")
    others = [label for label in runs if label != reference]
    names = {label: f"r{i}" for i, label in enumerate([reference, *others])}  # formula-safe rule names
    data["rule"] = pd.Categorical(data["rule"].map(names), categories=list(names.values()))
    model = smf.gee("clip ~ rule * adv", groups="seed", data=data, family=sm.families.Binomial(),
                    cov_struct=sm.cov_struct.Exchangeable())
    fit = model.fit(cov_type="bias_reduced")
    ci = fit.conf_int(alpha=1 - level)
    out = []
    for label in others:
        term = f"rule[T.{names[label]}]:adv"
        out.append(Interaction(label, reference, float(fit.params[term]), float(ci.loc[term, 0]),
                               float(ci.loc[term, 1]), float(fit.pvalues[term]), int(len(data)),
                               int(data["seed"].nunique())))
    return out


def _cell(a: AcrossSeeds) -> str:
    none = f"; none: {', '.join(map(str, a.without))}" if a.without else ""
    if not a.seeds:
        return f"no seed with a value | | 0{none} | | "
    return (f"{a.mean:+.4g} [{a.lo:+.4g}, {a.hi:+.4g}] | {a.sd:.3g} | {len(a.seeds)} ({', '.join(map(str, a.seeds))})"
            f"{none} | {a.p_t:.3g} | {a.p_flip:.3g}")


def bound_gradient(a: AlgorithmConfig, k: int) -> float | None:
    """How fast a rule's upper width grows per unit of advantage (k - c)/k, from c = k (advantage 0) to c = 1
    (advantage (k - 1)/k): GAPO's eps_hi(c) climbs from eps_lo to eps_hi_max. None for a rule whose bound is
    constant. E1's margin in the plan (0.0137, written 0.014, for 0.003/0.015 at k = 8)."""
    if a.rule.constant or k < 2:
        return None
    return float(a.rule.eps_hi(1, k, a) - a.rule.eps_hi(k, k, a)) * k / (k - 1)


# The plan's predicted sign of each primary endpoint (experiments/demo_mechanism_plan.md, "Endpoints").
PREDICTED = {"E1": +1, "E2": +1, "E3": -1}
NO_ROW = "not estimable (no row: its runs or their rollouts are missing)"


def reading(endpoint: str, a: AcrossSeeds, p_holm: float, e1_margin: float | None = None) -> str:
    """A primary endpoint read by the plan's rules ("How the result will be read"), so that the report states what
    the plan says and nothing chosen after the data: **for** the claim when Holm's p < 0.05 with the predicted sign;
    **against** when the 95 % interval lies wholly on the other side of zero, and for E1 also when it lies wholly
    below `e1_margin`, GAPO's own bound gradient; otherwise inconclusive at this power, with the effects the
    interval still holds. E1 can be both: a positive slope smaller than GAPO's bound assumes."""
    sign = PREDICTED[endpoint]
    if len(a.seeds) > 1 and np.ptp(a.values) == 0:  # the t test is undefined: say what the seeds show instead
        if a.values[0] == 0:
            return (f"inconclusive: every one of the {len(a.seeds)} seeds' values is exactly 0"
                    + (" (the rules never differed on it)" if endpoint != "E1" else "")
                    + ", so there is no effect to read and no interval")
        return (f"inconclusive by the plan's rules, whose t test is undefined without spread: every one of the "
                f"{len(a.seeds)} seeds' values is {a.values[0]:+.4g} (sign-flip p {a.p_flip:.3g})")
    if not a.seeds or not math.isfinite(a.p_t) or not math.isfinite(p_holm):
        return "not estimable (fewer than two seeds with a value): neither for nor against"
    found = []
    if p_holm < 0.05 and sign * a.mean > 0:
        found.append("**for** the claim (Holm p < 0.05, the predicted sign)")
    if (a.hi < 0) if sign > 0 else (a.lo > 0):
        found.append("**against** the claim (the interval wholly on the other side of zero)")
    elif endpoint == "E1" and e1_margin is not None and a.hi < e1_margin:
        found.append(f"**against** the premise as GAPO uses it (the interval wholly below GAPO's bound gradient "
                     f"{e1_margin:.4g})")
    if found:
        return "; ".join(found)
    return (f"inconclusive at this power: the interval still holds effects from {a.lo:+.4g} to {a.hi:+.4g} "
            f"(predicted: {'positive' if sign > 0 else 'negative'})")


Row = tuple[str, str, AcrossSeeds]  # (endpoint, label or pair, its values across seeds)


def report(groups: dict[str, dict[int, Path]], fixed_eps_hi: dict[str, float], control: str | None = None,
           e1_margin: float | None = None, out: Path | None = None) -> list[str]:
    """The endpoints as the plan reads them, for `gapo-compare seeds`: `groups` maps a label to its runs by trainer.seed
    (the method first, then the rules it is compared with); `fixed_eps_hi` the upper bound of each fixed rule's label.
    E1 per label; E2 and E3 the first label against each other, paired by seed; each p unadjusted, with Holm over
    this table's rows beside it (exploratory); every seed without a value named, with why.
    `control`: the plan's control label; its E1 and the first label's E2 and E3 (the P(clip) slope) against it are
    the primary family, Holm-adjusted over those three in a column of their own (the plan's test), and read by the
    plan's rules in a table of their own (`reading`; `e1_margin`: GAPO's bound gradient per unit of advantage); the
    other rows then say secondary or exploratory in their names, as the plan lists them.
    `out`: a folder that also gets every row's per-seed values (endpoints.json, for a re-analysis that needs no
    rollouts) and, with `control`, the primary family's per-seed values against zero (endpoints.png)."""
    labels = list(groups)
    lines = ["", "## Endpoints (experiments/demo_mechanism_plan.md; gapo/study/endpoints.py)", "",
             "Per run, then across seeds: mean [95 % t interval], the SD of the per-seed values (of the differences "
             "for a paired row), the seeds with a value (trainer.seed; those without are named below the table), the "
             "one-sample or paired t p and the exact sign-flip p. With --control, rows outside the plan's primary "
             "family say secondary or exploratory in their name; the column of Holm over every row is exploratory "
             "(the plan's test is the last column).", "",
             "| endpoint | label(s) | mean [95 % CI] | SD | seeds | p (t) | p (sign-flip) | p (Holm, every row: "
             "exploratory) | p (Holm, the plan's primary family) |",
             "|---|---|---|---|---|---|---|---|---|"]
    try:
        dec = {label: {seed: decisions(path) for seed, path in runs.items()} for label, runs in groups.items()}
    except PlotError as err:
        dec = None
        lines.insert(3, f"E1 and E3 need every run's rollouts.jsonl (trainer.log_rollouts=true): {err}")
    rows = endpoint_rows(groups, fixed_eps_hi, control, dec)
    adjusted = holm([r[2].p_t for r in rows])
    primary, family, incomplete = primary_family(rows, labels[0], control)
    if incomplete:
        lines.insert(4, incomplete)
    for i, ((name, label, a), p) in enumerate(zip(rows, adjusted, strict=True)):
        held = i in family and math.isfinite(a.p_t)
        lines.append(f"| {name} | {label} | {_cell(a)} | {p:.3g} | {f'{family[i]:.3g}' if held else ''} |")
    unvalued = [(name, label, a) for name, label, a in rows if a.without]
    if unvalued:
        lines += ["", "Seeds without a value, kept in the design and named here (none is replaced or dropped):", ""]
        lines += [f"- {name} ({label}): " + "; ".join(f"seed {s}: {w}" for s, w in a.without.items())
                  for name, label, a in unvalued]
    absent = [e for e in PREDICTED if e not in {rows[i][0].split()[0] for i in primary}] if control is not None else []
    read = {i: reading(rows[i][0].split()[0], rows[i][2], family[i] if math.isfinite(rows[i][2].p_t) else math.nan,
                       e1_margin) for i in primary}
    if control is not None:
        lines += family_reading(rows, primary, family, read, absent, e1_margin)
    if out is not None:
        lines += write_values(out, rows, adjusted, primary, family, read, absent, e1_margin)
    if dec is not None and len(labels) > 1:
        lines += model_lines(dec, labels, control)
    return lines


def _tag(control: str | None, primary: bool, kind: str = "secondary") -> str:
    """A row's name says secondary or exploratory when a control makes a primary family (the plan's wording)."""
    return "" if control is None or primary else f" ({kind})"


def endpoint_rows(groups: dict[str, dict[int, Path]], fixed_eps_hi: dict[str, float], control: str | None,
                  dec: dict[str, dict[int, Decisions]] | None) -> list[Row]:
    """E1 per label (with the control's P(clip) under each fixed bound), then E2 and E3 of the first label against
    each other, paired by seed; E1 and E3 only where every run's rollouts were read (`dec`)."""
    labels, rows = list(groups), []
    if dec is not None:
        why = {label: {s: why_none(d) for s, d in by_seed.items()} for label, by_seed in dec.items()}
        for label in labels:
            e1 = {s: premise(d, list(fixed_eps_hi.values())) for s, d in dec[label].items()}
            rows.append((f"E1 log-ratio slope on (k-c)/k{_tag(control, label == control)}", label,
                         across_seeds({s: v["log ratio"] for s, v in e1.items()}, why[label])))
            if control is not None and label == control:  # the same ratios judged under each fixed bound
                for eps_hi in dict.fromkeys(fixed_eps_hi.values()):  # two rules at one bound: one row
                    key = f"P(clip) at 1 + {eps_hi:g}"  # the plan names the control's own bound; others: exploratory
                    kind = "secondary" if eps_hi == fixed_eps_hi.get(control) else "exploratory"
                    rows.append((f"E1 {key} slope{_tag(control, False, kind)}", label,
                                 across_seeds({s: v[key] for s, v in e1.items()}, why[label])))
    corr = {label: {seed: mean_is_adv_corr(path) for seed, path in runs.items()} for label, runs in groups.items()}
    corr_why = {label: {s: "no step logged is_adv_corr" for s in by_seed} for label, by_seed in corr.items()}
    first = labels[0]
    for other in labels[1:]:
        pair, main = f"{first} − {other}", other == control
        rows.append((f"E2 mean is_adv_corr, Δ{_tag(control, main)}", pair, across_seeds(
            paired(corr[first], corr[other]),
            why_paired((first, other), (corr[first], corr[other]), (corr_why[first], corr_why[other])))))
        if dec is not None:
            for name, per_run, kind in (("E3 P(clip) slope on (k-c)/k under the run's rule, Δ", clip_slope,
                                         _tag(control, main)),
                                        ("E3 advantage-weighted clip share, Δ", weighted_clip_share,
                                         _tag(control, False))):
                value = {label: {s: per_run(d) for s, d in dec[label].items()} for label in (first, other)}
                rows.append((f"{name}{kind}", pair, across_seeds(
                    paired(value[first], value[other]),
                    why_paired((first, other), (value[first], value[other]), (why[first], why[other])))))
    return rows


def primary_family(rows: list[Row], first: str, control: str | None) -> tuple[list[int], dict[int, float], str]:
    """The plan's primary rows (the control's E1, the first label's E2 and E3 slope against it), their Holm p over
    those three, and a note when the family is incomplete."""
    primary = [i for i, (name, label, _) in enumerate(rows) if control is not None and (
        (name.startswith("E1 log-ratio") and label == control) or
        (name.startswith(("E2", "E3 P(clip)")) and label == f"{first} − {control}"))]
    if control is None:
        return primary, {}, ""
    # Holm over the plan's three. A primary row missing (no runs, no rollouts) or without a p counts as p = 1, which
    # keeps the family-wise level (conservative), and reads "not estimable"; the others are still read.
    ps = [rows[i][2].p_t if math.isfinite(rows[i][2].p_t) else 1.0 for i in primary]
    family = dict(zip(primary, holm(ps + [1.0] * (3 - len(primary)))[:len(primary)], strict=True))
    found = {rows[i][0].split()[0] for i in primary if math.isfinite(rows[i][2].p_t)}
    if found == set(PREDICTED):
        return primary, family, ""
    missing = ", ".join(sorted(set(PREDICTED) - found))
    return primary, family, (f"The plan's primary family is incomplete here ({missing} without runs or without a p): "
                             "counted as p = 1 in Holm (conservative), read as not estimable, or in words where its "
                             "seeds show no spread.")


def family_reading(rows: list[Row], primary: list[int], family: dict[int, float], read: dict[int, str],
                   absent: list[str], e1_margin: float | None) -> list[str]:
    """The primary family in a table of its own, each row read by the plan's rules."""
    margin = (f"E1's margin, the first label's bound gradient per unit of advantage, to the two digits the plan "
              f"writes: {e1_margin:.4g}" if e1_margin
              else "E1's margin: none (the first label's bound does not grow with the advantage), so E1 counts "
                   "against only on the other side of zero")
    lines = ["", "### The primary family, read by the plan's rules", "", f"{margin}.", "",
             "| endpoint | label(s) | mean [95 % CI] | p (Holm, the family) | reading |", "|---|---|---|---|---|"]
    for i in primary:
        name, label, a = rows[i]
        p = family[i] if math.isfinite(a.p_t) else float("nan")
        lines.append(f"| {name} | {label} | {a.mean:+.4g} [{a.lo:+.4g}, {a.hi:+.4g}] | {p:.3g} | {read[i]} |")
    return lines + [f"| {e} | | | | {NO_ROW} |" for e in absent]


def write_values(out: Path, rows: list[Row], adjusted: list[float], primary: list[int], family: dict[int, float],
                 read: dict[int, str], absent: list[str], e1_margin: float | None) -> list[str]:
    """endpoints.json (every row's per-seed values) and, with a primary family, endpoints.png into `out`; the
    report's lines that name them."""
    def num(x: float | None) -> float | None:  # JSON has no NaN: a statistic without spread is null
        return float(x) if x is not None and math.isfinite(x) else None

    values = [{"endpoint": name, "labels": label, "primary": i in primary, "seeds": a.seeds,
               "values": a.values.tolist(), "without": {str(s): w for s, w in a.without.items()},
               "mean": num(a.mean), "lo": num(a.lo), "hi": num(a.hi), "sd": num(a.sd), "p_t": num(a.p_t),
               "p_sign_flip": num(a.p_flip), "p_holm_every_row": num(p),
               "p_holm_family": num(family.get(i) if math.isfinite(a.p_t) else None), "reading": read.get(i)}
              for i, ((name, label, a), p) in enumerate(zip(rows, adjusted, strict=True))]
    values += [{"endpoint": e, "labels": None, "primary": True, "seeds": [], "values": [], "without": {},
                "reading": NO_ROW} for e in absent]
    (out / "endpoints.json").write_text(json.dumps(values, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    named = ["endpoints.json: every row's per-seed values"]
    if primary:
        figure([rows[i] for i in primary], e1_margin).savefig(out / "endpoints.png", dpi=110)
        named.append("endpoints.png: the primary family's per-seed values")
    else:
        (out / "endpoints.png").unlink(missing_ok=True)  # an earlier report's family is not this one's
    return ["", f"Beside this report: {'; '.join(named)}."] + (["", "![endpoints.png](endpoints.png)"]
                                                                if primary else [])


def model_lines(dec: dict[str, dict[int, Decisions]], labels: list[str], control: str | None) -> list[str]:
    """E3's logistic GEE of each other label against the first, as table rows."""
    lines = ["", f"E3's model{_tag(control, False)}: P(clip) of a correct decision ~ rule × advantage, logistic GEE "
             "over every seed's decisions, seeds as clusters, bias-reduced sandwich; the term is the log odds ratio "
             "per unit of advantage of the first label against the reference.", "",
             "| rule | reference | rule × advantage [95 % CI] | p | decisions | seeds |",
             "|---|---|---|---|---|---|"]
    for other in labels[1:]:
        try:
            fitted = clip_model({other: dec[other], labels[0]: dec[labels[0]]}, reference=other)
        except ValueError as err:
            lines.append(f"| {labels[0]} | {other} | not estimable: {err} | | | |")
            continue
        for r in fitted:
            lines.append(f"| {r.rule} | {r.reference} | {r.estimate:+.3g} [{r.lo:+.3g}, {r.hi:+.3g}] | "
                         f"{r.p:.3g} | {r.decisions} | {r.clusters} |")
    return lines


def figure(rows: list[tuple[str, str, AcrossSeeds]], e1_margin: float | None = None):
    """The primary family as the seeds gave it: every seed's value (its trainer.seed beside it), the mean with its
    95 % t interval, zero, and E1's margin; a reader sees the spread the test summarises and which seeds lead it."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.2 * len(rows), 4.4), layout="constrained")
    for ax, (name, label, a) in zip(fig.subplots(1, len(rows), squeeze=False)[0], rows, strict=True):
        endpoint = name.split()[0]
        x = np.linspace(-0.25, 0.25, len(a.seeds)) if len(a.seeds) > 1 else np.zeros(len(a.seeds))
        ax.plot(x, a.values, "o", color="tab:blue", alpha=0.7, label="one seed")
        for xi, yi, s in zip(x, a.values, a.seeds, strict=True):
            ax.annotate(str(s), (xi, yi), textcoords="offset points", xytext=(4, 0), fontsize=6, va="center")
        if len(a.seeds) > 1 and math.isfinite(a.lo):
            ax.errorbar([0.6], [a.mean], yerr=[[a.mean - a.lo], [a.hi - a.mean]], fmt="s", color="black", capsize=4,
                        label="mean, 95 % t interval")
        elif a.seeds:  # one seed, or no spread: the mean without an interval
            ax.plot([0.6], [a.mean], "s", color="black", label="mean (no interval)")
        ax.axhline(0, color="gray", linewidth=0.8)
        if endpoint == "E1" and e1_margin:
            ax.axhline(e1_margin, color="tab:red", linestyle="--", linewidth=0.8,
                       label=f"GAPO's gradient {e1_margin:g}")
        ax.set_xlim(-0.5, 0.9)
        ax.set_xticks([])
        ax.set_title(f"{name}\n{label} (predicted {'> 0' if PREDICTED[endpoint] > 0 else '< 0'})", fontsize=8)
        if a.without:
            ax.set_xlabel(f"no value: seed(s) {', '.join(map(str, a.without))}", fontsize=7)
        ax.legend(fontsize=6, loc="best")
    fig.suptitle("The plan's primary endpoints, per seed (experiments/demo_mechanism_plan.md)", fontsize=10)
    return fig
