"""gapo-compare: several seeds per configuration, compared the way the paper's Tables 6 and 7 compare them.

    gapo-compare seeds --out DIR LABEL=RUN,RUN,... LABEL=RUN,RUN,... [--steps A:B] [--val-step N] [--smooth N]

Per label: the mean over its seeds ± a 95 % confidence interval (Student-t, df = seeds - 1) of the final
validation pass@1 per benchmark and of training metrics over a window of steps. Per pair of labels: the
difference of the means and Welch's t-test (unequal variances) on it. Writes DIR/compare.md with those tables
and, with mean ± CI bands across seeds over steps, the figures of gapo-plot: is_ratio_by_c.png (Fig. 1),
clip_by_c.png and clip_vs_c.png (Fig. 3), val_pass.png (Fig. 4), is_adv_corr.png (Fig. 5), coverage.png (Fig. 8)
and training.png.
Reads what gapo-plot reads (metrics.jsonl and config.yaml), with its loader.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from scipy import stats

from gapo.study.figures import (
    ALL_STEPS,
    RAW_PREFIX,
    PlotError,
    Run,
    Window,
    add_figure_options,
    clip_totals,
    figure_options,
    finish,
    grid,
    in_window,
    load_run,
    md_cell,
    moving_average,
    no_data,
    run_style,
    window_text,
)
from gapo.study.plot import TRAINING_PANELS

LEVEL = 0.95
_VAL_PASS1 = re.compile(r"^val/(.+)/pass@1$")
_VAL_COVERAGE = re.compile(r"^val/(.+)/coverage$")
# Per-step training metrics compared as their mean over the window's steps (besides the exact clip by c).
WINDOW_METRICS = ("reward/mean", "entropy", "response/len_mean", "clip_frac", "is_adv_corr")


class CompareError(PlotError):
    """Inputs that cannot be compared; main() prints it and exits with status 2."""


# ---------------------------------------------------------------------------------------------- statistics


@dataclass(frozen=True)
class Estimate:
    """One label's values of one metric, one per seed: mean ± a Student-t interval (the paper's Table 6), for
    quantities without bounds (entropy, lengths, correlations)."""

    values: tuple[float, ...]

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return float(np.mean(self.values))

    @property
    def centre(self) -> float:
        """What a cell shows as the estimate: inside interval() whenever that is defined."""
        return self.mean

    @property
    def half_width(self) -> float:
        """t_{0.975, n-1} * s / sqrt(n), s the sample standard deviation: the paper's Table 6 interval.
        NaN below two seeds, where the spread, and so the interval, is undefined."""
        return ci_half_width(self.values)

    def interval(self, level: float = LEVEL) -> tuple[float, float]:
        h = ci_half_width(self.values, level)
        return self.mean - h, self.mean + h


@dataclass(frozen=True)
class ProportionEstimate(Estimate):
    """A fraction per seed (pass@k, a clip fraction), whose interval must stay in [0, 1]: a Student-t interval on
    the logit scale over seeds, mapped back, around its own centre (the back-transformed mean logit), so the centre
    is inside it by construction. With three seeds the plain t-interval reached 1.75 on a fraction; this one keeps
    the between-seed spread (a pooled Wilson interval would treat every rollout of every seed as independent and
    look far too sure) and is asymmetric near 0 and 1; fractions are held within [1e-3, 1 - 1e-3]. Seeds that all
    agree give the value itself with a zero-width interval (no spread to estimate), exact at 0 and 1.

    With `counts` (events, units) per seed (the clip fractions per c) the centre is the pooled fraction, sum of
    events over sum of units, the number the pooled count tables show, and the interval is that ratio's
    seed-clustered (sandwich) standard error, Student-t with df = n - 1 on the logit scale. A per-seed logit needs
    a continuity correction, and at 2-7 decisions per seed that correction was the estimate: 1 clip in 25
    decisions over 5 seeds was drawn as 0.11 [0.06, 0.21], excluding both 0 and its own pooled 0.04.

    Why not a bootstrap over seeds (scipy.stats.bootstrap): with 3-5 seeds it has at most a few dozen distinct
    resamples and its percentile interval is too narrow; the t-interval's df = n - 1 pays for the few seeds."""

    counts: tuple[tuple[float, float], ...] = ()

    def _logits(self) -> np.ndarray:
        p = np.clip(np.asarray(self.values, dtype=float), 1e-3, 1 - 1e-3)
        return np.log(p / (1 - p))

    def _pooled(self) -> tuple[float, float]:
        """The pooled fraction and its seed-clustered standard error: Var = n/(n-1) sum_i (e_i - p u_i)^2 / U^2."""
        e, u = (np.array(x, dtype=float) for x in zip(*self.counts, strict=True))
        p, n = e.sum() / u.sum(), len(u)
        return float(p), float(math.sqrt(n / (n - 1) * ((e - p * u) ** 2).sum()) / u.sum())

    @property
    def constant(self) -> bool:
        return self.n > 0 and bool(np.ptp(self.values) == 0)

    @property
    def centre(self) -> float:
        if self.n == 0:
            return float("nan")
        if self.n == 1 or self.constant:
            return float(self.values[0])
        if self.counts:
            return self._pooled()[0]
        return float(1 / (1 + math.exp(-self._logits().mean())))

    def interval(self, level: float = LEVEL) -> tuple[float, float]:
        if self.n < 2:
            return float("nan"), float("nan")
        if self.constant:
            return self.centre, self.centre
        t = stats.t.ppf((1 + level) / 2, self.n - 1)
        if self.counts:  # the delta method: d logit(p) / dp = 1 / (p (1 - p))
            p, se = self._pooled()
            if p in (0.0, 1.0):  # every decision of every seed went one way (seeds with no units differ)
                return p, p
            mid, h = math.log(p / (1 - p)), t * se / (p * (1 - p))
        else:
            z = self._logits()
            mid, h = z.mean(), t * z.std(ddof=1) / math.sqrt(len(z))
        lo, hi = mid - h, mid + h
        return float(1 / (1 + math.exp(-lo))), float(1 / (1 + math.exp(-hi)))


def ci_half_width(values: Iterable[float], level: float = LEVEL) -> float:
    v = np.asarray(list(values), dtype=float)
    if len(v) < 2:
        return float("nan")
    return float(stats.t.ppf((1 + level) / 2, len(v) - 1) * v.std(ddof=1) / math.sqrt(len(v)))


def welch(a: Iterable[float], b: Iterable[float]) -> tuple[float, float, float]:
    """Welch's t statistic, its Welch-Satterthwaite degrees of freedom and the two-sided p-value (Table 7).
    NaN when a side has fewer than two seeds or neither side has any spread (the test is undefined there:
    significance() says which)."""
    a, b = np.asarray(list(a), dtype=float), np.asarray(list(b), dtype=float)
    if len(a) < 2 or len(b) < 2 or (np.ptp(a) == 0 and np.ptp(b) == 0):
        return float("nan"), float("nan"), float("nan")
    with warnings.catch_warnings():  # one side without spread is a valid case; scipy warns of "nearly identical" data
        warnings.simplefilter("ignore", RuntimeWarning)
        res = stats.ttest_ind(a, b, equal_var=False)
    return float(res.statistic), float(res.df), float(res.pvalue)


def significance(a: Iterable[float], b: Iterable[float]) -> str:
    """Welch's p-value as a table shows it, with the cases where the test is undefined said in words: unpaired,
    because runs of different methods share nothing but the seed's number (their evaluations draw independent
    samples, see gapo-eval --seed), so a paired test would pair unrelated noise."""
    a, b = list(a), list(b)
    if len(a) < 2 or len(b) < 2:
        return "(n < 2: no test)"
    if np.ptp(a) == 0 and np.ptp(b) == 0:
        return "(no spread on either side: identical)" if a[0] == b[0] else \
            "(no spread on either side: every seed differs the same way; no test)"
    _, _, p = welch(a, b)
    return f"{stars(p)} (p = {p:.2g})"


def cmh(strata: list[tuple[float, float, float, float]]) -> tuple[float, float, float]:
    """Cochran–Mantel–Haenszel test of two arms' event rates, stratified by seed: strata of (events_a, units_a,
    events_b, units_b). Returns the Mantel–Haenszel common odds ratio (a over b), the continuity-corrected chi^2
    (1 df) and its p-value; NaN where no stratum has both events and non-events. It uses the counts themselves
    (every clip decision of every seed), so it treats decisions within a seed as independent: the seed-level
    Welch on per-seed fractions stays beside it."""
    num = den = dev = var = 0.0
    for ea, ua, eb, ub in strata:
        total, events = ua + ub, ea + eb
        if total < 2 or events in (0, total):
            continue
        num += ea * (ub - eb) / total
        den += eb * (ua - ea) / total
        dev += ea - ua * events / total
        var += ua * ub * events * (total - events) / (total**2 * (total - 1))
    if var == 0:
        return float("nan"), float("nan"), float("nan")
    chi2 = (abs(dev) - 0.5) ** 2 / var if abs(dev) > 0.5 else 0.0
    odds = num / den if den > 0 else float("inf")
    return odds, chi2, float(stats.chi2.sf(chi2, 1))


def stars(p: float) -> str:
    """The paper's marks: * p < 0.05, ** p < 0.01, *** p < 0.001."""
    if not math.isfinite(p):
        return ""
    return "***" if p < 0.001 else "**" if p < 0.01 else "*" if p < 0.05 else ""


# ------------------------------------------------------------------------------------------------- inputs


def parse_group(arg: str) -> tuple[str, list[str]]:
    label, sep, dirs = arg.partition("=")
    runs = [d.strip() for d in dirs.split(",") if d.strip()]
    if not sep or not label.strip() or not runs:
        raise CompareError(f"{arg!r}: expected LABEL=RUN_DIR,RUN_DIR,... (one label, its seeds' run directories)")
    return label.strip(), runs


def load_groups(args: list[str]) -> dict[str, list[Run]]:
    """Label -> its runs, refusing what has no confidence interval: a label with a single run."""
    groups: dict[str, list[Run]] = {}
    for arg in args:
        label, dirs = parse_group(arg)
        if label in groups:
            raise CompareError(f"label {label!r} is given twice; give all its runs in one LABEL=RUN,RUN,...")
        if len(dirs) < 2:
            raise CompareError(f"label {label!r} has one run ({dirs[0]}): a confidence interval needs at least two "
                               "seeds (df = seeds - 1); add its other seeds, or use gapo-plot for single runs")
        try:
            groups[label] = [load_run(d, f"{label} #{i + 1}") for i, d in enumerate(dirs)]
        except PlotError as e:
            raise CompareError(f"label {label!r}: {e}") from None
    if len(groups) < 2:
        print("gapo-compare: warning: one label only: confidence intervals but no comparisons", file=sys.stderr)
    return groups


def final_validation(run: Run, step: int | None = None) -> tuple[int, dict[str, float]] | None:
    """(step, benchmark -> pass@1) at the run's last validation, or at `step`; None when it never validated.
    The benchmarks include `mean` (the average over in-domain benchmarks) when the run logged it."""
    by_bench = {m.group(1): dict(run.get(key)) for key in run.series if (m := _VAL_PASS1.match(key))}
    steps = sorted({s for pts in by_bench.values() for s in pts})
    if not steps:
        return None
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise CompareError(f"{run.path}: no validation at step {step} (validated at {', '.join(map(str, steps))})")
    return step, {b: pts[step] for b, pts in sorted(by_bench.items()) if step in pts}


def _bench_order(names: Iterable[str]) -> list[str]:
    return sorted(names, key=lambda b: (b == "mean", b))


def validation_estimates(groups: dict[str, list[Run]], step: int | None,
                         notes: list[str]) -> tuple[list[str], dict[str, dict[str, Estimate]]]:
    """Benchmarks, and per label and benchmark the seeds' final pass@1. Every run must have validated on the
    same benchmarks: a table with a column missing for some seeds would compare different things."""
    finals = {(label, i): final_validation(r, step) for label, runs in groups.items() for i, r in enumerate(runs)}
    if all(f is None for f in finals.values()):
        return [], {}
    ref_key = next(k for k, f in finals.items() if f is not None)
    ref_run = groups[ref_key[0]][ref_key[1]]
    ref = set(finals[ref_key][1])
    for (label, i), f in finals.items():
        run = groups[label][i]
        have = set(f[1]) if f else set()
        if have != ref:
            raise CompareError(f"label {label!r}: {run.path} validated on {', '.join(sorted(have)) or 'nothing'} "
                               f"but {ref_run.path} on {', '.join(sorted(ref))}: mismatched benchmarks")
    at = sorted({f[0] for f in finals.values()})
    if len(at) > 1:
        where = ", ".join(f"{groups[lab][i].path}: {f[0]}" for (lab, i), f in finals.items())
        notes.append(f"The runs' final validations are at different steps ({where}).")
        print(f"gapo-compare: warning: final validation at different steps ({where})", file=sys.stderr)
    benches = _bench_order(ref)
    est = {label: {b: ProportionEstimate(tuple(finals[(label, i)][1][b] for i in range(len(runs)))) for b in benches}
           for label, runs in groups.items()}
    return benches, est


def window_mean(run: Run, key: str, window: Window) -> float | None:
    vals = [v for s, v in run.get(key) if in_window(s, window)]
    return float(np.mean(vals)) if vals else None


def training_estimates(groups: dict[str, list[Run]],
                       window: Window) -> tuple[list[str], dict[str, dict[str, Estimate]]]:
    """Per label and metric, one value per seed over the window: the exact clip fraction of correct rollouts
    per c (summed counts) and the mean of per-step WINDOW_METRICS. A seed without the metric in the window
    is left out of that cell (its n says so)."""
    per_run: dict[str, list[dict[str, float]]] = {}
    for label, runs in groups.items():
        rows = []
        for r in runs:
            row = {f"clip_frac/c{c}": (t.frac, (t.clipped, t.units)) for c, t in clip_totals(r, window).items()}
            row |= {key: v for key in WINDOW_METRICS if (v := window_mean(r, key, window)) is not None}
            rows.append(row)
        per_run[label] = rows
    keys = {k for rows in per_run.values() for row in rows for k in row}
    clip_keys = sorted((k for k in keys if k.startswith("clip_frac/c")), key=lambda k: int(k.split("/c")[1]))
    metrics = [k for k in WINDOW_METRICS if k in keys] + clip_keys
    def estimate(key: str, rows: list[dict]) -> Estimate:
        got = [row[key] for row in rows if key in row]
        if key.startswith("clip_frac/c"):
            return ProportionEstimate(tuple(v for v, _ in got), counts=tuple(c for _, c in got))
        return ProportionEstimate(tuple(got)) if key == "clip_frac" else Estimate(tuple(got))

    est = {label: {k: estimate(k, rows) for k in metrics} for label, rows in per_run.items()}
    return metrics, est


# -------------------------------------------------------------------------------------------------- tables


def _fmt(x: float, percent: bool) -> str:
    return f"{100 * x:.2f}" if percent else f"{x:.4g}"


def estimate_cell(e: Estimate | None, percent: bool, expected: int | None = None) -> str:
    """`expected`: the seeds asked for; a cell with fewer says how many it has of them."""
    if e is None or e.n == 0:
        return "–"
    n = f"n = {e.n}" + (f" of {expected}" if expected and e.n < expected else "")
    if e.n < 2:
        return f"{_fmt(e.centre, percent)} ({n})"
    if isinstance(e, ProportionEstimate):
        lo, hi = e.interval()
        return f"{_fmt(e.centre, percent)} [{_fmt(lo, percent)}, {_fmt(hi, percent)}] ({n})"
    return f"{_fmt(e.mean, percent)} ± {_fmt(e.half_width, percent)}" + \
        ("" if percent and not (expected and e.n < expected) else f" ({n})")


def difference_cell(a: Estimate | None, b: Estimate | None, percent: bool) -> str:
    """The difference of the arithmetic means over seeds (what Welch's test is about), with its significance."""
    if a is None or b is None or a.n == 0 or b.n == 0:
        return "–"
    delta = a.mean - b.mean
    d = f"{100 * delta:+.2f}" if percent else f"{delta:+.4g}"
    sig = significance(a.values, b.values)
    return f"{d}{sig}" if sig.startswith("*") else f"{d} {sig.strip()}"


def tables(columns: list[str], est: dict[str, dict[str, Estimate]], percent: bool) -> list[str]:
    """Table 6 (labels x columns, mean ± CI) and Table 7 (pairs of labels x columns, Δ with Welch p)."""
    labels = list(est)
    cols = " | ".join(md_cell(c) for c in columns)
    sep = "|---" * (len(columns) + 1) + "|"
    out = [f"| label | {cols} |", sep]
    out += ["| " + " | ".join([md_cell(lab)] + [estimate_cell(est[lab].get(c), percent) for c in columns]) + " |"
            for lab in labels]
    if len(labels) > 1:
        out += ["", f"| Δ = first − second | {cols} |", sep]
        for i, a in enumerate(labels):
            for b in labels[i + 1:]:
                cells = [difference_cell(est[a].get(c), est[b].get(c), percent) for c in columns]
                out.append("| " + " | ".join([md_cell(f"{a} vs {b}")] + cells) + " |")
    return out


# ------------------------------------------------------------------------------------------------- figures


def band(runs: list[Run], key: str, smooth: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Steps, mean across seeds and CI half-width at each step that some seed logged (NaN below two seeds).
    Smoothing is per seed, before the mean, as gapo-plot smooths one run."""
    per_step: dict[int, list[float]] = {}
    for r in runs:
        pts = r.get(key)
        ys = moving_average(np.array([v for _, v in pts], dtype=float), smooth)
        for (s, _), y in zip(pts, ys, strict=True):
            per_step.setdefault(s, []).append(float(y))
    steps = sorted(per_step)
    return (np.array(steps, dtype=float), np.array([np.mean(per_step[s]) for s in steps]),
            np.array([ci_half_width(per_step[s]) for s in steps]))


def _plot_band(ax, runs: list[Run], key: str, label: str, i: int, smooth: int = 1) -> bool:
    x, mean, half = band(runs, key, smooth)
    if not len(x):
        return False
    style = run_style(i)
    ok = np.isfinite(half)
    ax.fill_between(x, np.where(ok, mean - half, mean), np.where(ok, mean + half, mean), color=style["color"],
                    alpha=0.2, linewidth=0, label=f"{RAW_PREFIX}{label} CI")
    if len(x) > 40:
        style["marker"] = None
    ax.plot(x, mean, linewidth=1.7, markersize=4, label=label, **style)
    return True


def _legend_runs(groups: dict[str, list[Run]]) -> list[Run]:
    """One pseudo-run per label for gapo-plot's legend and step range."""
    return [Run(label=lab, path=Path(lab), config={}, steps=sorted({s for r in runs for s in r.steps}))
            for lab, runs in groups.items()]


def _panels(groups: dict[str, list[Run]], keys: list[tuple[str, str]], title: str, smooth: int,
            max_cols: int = 3, sharey: bool = False) -> Figure:
    fig, axes = grid(len(keys), max_cols, (4.6, 3.3), sharey=sharey)
    for ax, (key, name) in zip(axes, keys, strict=True):
        drawn = [_plot_band(ax, runs, key, lab, i, smooth) for i, (lab, runs) in enumerate(groups.items())]
        ax.set_title(name, fontsize=10)
        if not any(drawn):
            no_data(ax, key)
    smoothed = f"; each seed's curve a moving average over {smooth} logged steps" if smooth > 1 else ""
    return finish(fig, _legend_runs(groups), f"{title}\n(mean over seeds ± {LEVEL:.0%} CI, Student-t{smoothed})")


def pooled_clip_table(groups: dict[str, list[Run]], window: Window) -> list[str]:
    """Low c (c <= k/2, GAPO's wide bounds) and high c against each pair of labels: the clip counts pooled over
    seeds by a Cochran–Mantel–Haenszel test (seed i of one label against seed i of the other as a stratum)."""
    totals = {lab: [clip_totals(r, window) for r in runs] for lab, runs in groups.items()}
    half = max(int(r.config.get("rollout", {}).get("group_size", 8)) for runs in groups.values() for r in runs) / 2
    labels = [lab for lab, ts in totals.items() if any(ts)]
    if len(labels) < 2:
        return []
    out = ["", "## Clip counts pooled over seeds (Cochran–Mantel–Haenszel)", "",
           "Correct rollouts' clip decisions over the window's off-policy updates, summed per seed over c ≤ k/2 "
           "(low c) or c > k/2 (high c); each seed pair is a stratum. The common odds ratio is the first label's "
           "odds of a clip over the second's. It counts every decision, so it is surer than the seed-level tests "
           "above; read it beside them.", "", "| comparison | c | clipped / units (first) | clipped / units "
           "(second) | odds ratio | χ² | p |", "|---|---|---|---|---|---|---|"]
    for i, a in enumerate(labels):
        for b in labels[i + 1:]:
            for band, keep in (("low", lambda c: c <= half), ("high", lambda c: c > half)):
                strata = []
                for ta, tb in zip(totals[a], totals[b], strict=False):  # seeds paired by index; extras unpaired
                    ea = sum(t.clipped for c, t in ta.items() if keep(c))
                    ua = sum(t.units for c, t in ta.items() if keep(c))
                    eb = sum(t.clipped for c, t in tb.items() if keep(c))
                    ub = sum(t.units for c, t in tb.items() if keep(c))
                    strata.append((ea, ua, eb, ub))
                odds, chi2, p = cmh(strata)
                sums = [sum(x[j] for x in strata) for j in range(4)]
                test = (f"{odds:.3g} | {chi2:.3g} | {p:.2g}{stars(p)}" if math.isfinite(p)
                        else "– | – | (no stratum with both outcomes: no test)")
                out.append(f"| {md_cell(a)} vs {md_cell(b)} | {band} | {sums[0]:g} / {sums[1]:g} | "
                           f"{sums[2]:g} / {sums[3]:g} | {test} |")
    return out


def fig_clip_vs_c(groups: dict[str, list[Run]], window: Window) -> Figure | None:
    per_label = {lab: [clip_totals(r, window) for r in runs] for lab, runs in groups.items()}
    cs = sorted({c for ts in per_label.values() for t in ts for c in t})
    if not cs:
        return None
    fig = Figure(figsize=(max(7.0, 1.1 * len(cs) + 3), 4.8), layout="constrained")
    ax = fig.subplots()
    for i, (lab, ts) in enumerate(per_label.items()):
        x, m, lo, hi = [], [], [], []
        for c in cs:
            got = [t[c] for t in ts if c in t]
            if got:
                e = ProportionEstimate(tuple(g.frac for g in got), counts=tuple((g.clipped, g.units) for g in got))
                a, b = e.interval()
                x.append(c + 0.06 * (i - (len(per_label) - 1) / 2))  # side by side, not on top of each other
                m.append(e.centre)  # inside [a, b] and within [0, 1] by construction: no bar to clip
                lo.append(e.centre - a if math.isfinite(a) else 0.0)
                hi.append(b - e.centre if math.isfinite(b) else 0.0)
        style = run_style(i)
        ax.errorbar(x, m, yerr=[lo, hi], capsize=3, linewidth=1.7, label=lab, **style)
    ax.set_xticks(cs)
    ax.set_xlim(cs[0] - 0.5, cs[-1] + 0.5)
    ax.set_xlabel("c (correct rollouts in the group)")
    ax.set_ylabel("clip fraction (clipped / decisions, all seeds)")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"off-policy updates, {window_text(window)}", fontsize=10)
    return finish(fig, _legend_runs(groups), f"Clip fraction of correct rollouts against c (paper Fig. 3)\n"
                   f"(pooled over seeds; {LEVEL:.0%} CI: seed-clustered, Student-t on the logit scale, within [0, 1])",
                   step_axis=False)


def build_figures(groups: dict[str, list[Run]], window: Window = ALL_STEPS,
                  smooth: int = 1) -> dict[str, Figure | None]:
    all_runs = [r for runs in groups.values() for r in runs]
    cs = sorted({int(k.split("/c")[1]) for r in all_runs for k in r.series if re.match(r"^clip_frac/c\d+$", k)})
    ratio_cs = sorted({int(k.split("/c")[1]) for r in all_runs for k in r.series if re.match(r"^is_ratio/c\d+$", k)})
    benches = _bench_order({m.group(1) for r in all_runs for k in r.series if (m := _VAL_PASS1.match(k))})
    cover = _bench_order({m.group(1) for r in all_runs for k in r.series if (m := _VAL_COVERAGE.match(k))})
    figs: dict[str, Figure | None] = {
        "clip_by_c.png": _panels(groups, [(f"clip_frac/c{c}", f"c = {c}") for c in cs] or [("clip_frac/c1", "c = 1")],
                                 "Clip fraction of correct rollouts by c, off-policy updates (paper Fig. 3)", smooth,
                                 max_cols=4, sharey=True),
        "clip_vs_c.png": fig_clip_vs_c(groups, window),
        "is_ratio_by_c.png": _panels(groups, [(f"is_ratio/c{c}", f"c = {c}") for c in ratio_cs],
                                     "IS ratio of correct rollouts by c, off-policy updates (paper Fig. 1)", smooth,
                                     max_cols=4, sharey=True) if ratio_cs else None,
        "is_adv_corr.png": _panels(groups, [("is_adv_corr", "over rollouts with A ≠ 0, off-policy updates")],
                                   "IS ratio – advantage correlation (paper Fig. 5)", smooth),
        "val_pass.png": _panels(groups, [(f"val/{b}/pass@1", f"{b} pass@1") for b in benches],
                                "Validation pass@1 (paper Fig. 4)", 1) if benches else None,
        "coverage.png": _panels(groups, [(f"val/{b}/coverage", b) for b in cover],
                                "Problem coverage: problems with solve rate above the threshold (paper Fig. 8)",
                                1) if cover else None,
        "training.png": _panels(groups, list(TRAINING_PANELS), "Training curves", smooth, max_cols=2),
    }
    return figs


# -------------------------------------------------------------------------------------------------- report


def write_report(out: Path, groups: dict[str, list[Run]], window: Window = ALL_STEPS, val_step: int | None = None,
                 smooth: int = 1) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    benches, val_est = validation_estimates(groups, val_step, notes)
    metrics, train_est = training_estimates(groups, window)
    lines = ["# gapo-compare", "",
             f"A fraction (pass@1, a clip fraction) shows its centre over a label's seeds and a {LEVEL:.0%} interval "
             "[low, high]: Student-t on the logit scale (df = seeds − 1), mapped back, so both stay within [0, 1]; "
             "seeds that all agree show their value and a zero-width interval. A clip fraction per c shows the pooled "
             "fraction (clipped over decisions, summed over seeds) with a seed-clustered interval on the same scale. "
             "Other metrics show mean ± the "
             "Student-t half-width, as in the paper's Table 6. n is the number of seeds with a value. Δ is the "
             "first label's mean minus the second's, with the two-sided p-value of Welch's t-test (unequal "
             "variances, unpaired) as in Table 7: * p < 0.05, ** p < 0.01, *** p < 0.001; where the test is "
             "undefined the cell says why.", "", "## Runs", "", "| label | seeds | run directories |", "|---|---|---|"]
    lines += [f"| {md_cell(lab)} | {len(runs)} | {md_cell(', '.join(str(r.path) for r in runs))} |"
              for lab, runs in groups.items()]
    lines += ["", "## Final validation pass@1, % (Tables 6 and 7)", ""]
    if benches:
        steps = sorted({final_validation(r, val_step)[0] for runs in groups.values() for r in runs})
        lines += [f"At step {', '.join(map(str, steps))} (each run's {'' if val_step is None else 'chosen '}"
                  "validation; `mean` is the average over the in-domain benchmarks).", ""]
        lines += tables(benches, val_est, percent=True)
    else:
        lines.append("No run logged validation (`val/<benchmark>/pass@1`; set `trainer.eval_every`).")
    lines += ["", f"## Training metrics, {window_text(window)}", "",
              "`clip_frac/c{c}`: clip fraction of correct rollouts of groups with c correct over the off-policy "
              "updates, per seed from the window's summed counts (`clip_hi/c{c}` / `clip_units/c{c}`); the other "
              "metrics are each seed's mean over the window's logged steps. n is the number of seeds with a value.",
              ""]
    lines += tables(metrics, train_est, percent=False) if metrics else ["No training metrics in the window."]
    lines += pooled_clip_table(groups, window)
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    figures = build_figures(groups, window, smooth)
    lines += ["", "## Figures", ""]
    for name, fig in figures.items():
        if fig is None:
            (out / name).unlink(missing_ok=True)
            continue
        fig.savefig(out / name, dpi=110)
        lines += [f"![{name}]({name})", ""]
    path = out / "compare.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`gapo-compare seeds`'s arguments (gapo.study.tables.cli holds the command line)."""
    p.add_argument("groups", nargs="+", metavar="LABEL=RUN_DIR,RUN_DIR,...",
                   help="a label and its seeds' run directories (two or more); list your method first: Δ is "
                        "earlier label minus later label")
    p.add_argument("--out", required=True, type=Path, help="directory for compare.md and the figures")
    add_figure_options(p, "moving average over N logged steps of each seed's per-step curves",
                       "window of the training metrics")
    p.add_argument("--val-step", type=int, metavar="N",
                   help="compare validation at step N instead of each run's last validation")


def run(args: argparse.Namespace) -> int:
    """`gapo-compare seeds`: compare.md and its figures; 2 with a message when the runs cannot be compared."""
    try:
        smooth, window = figure_options(args)
        groups = load_groups(args.groups)
        path = write_report(args.out, groups, window, args.val_step, smooth)
    except PlotError as e:
        print(f"gapo-compare: error: {e}", file=sys.stderr)
        return 2
    print(f"gapo-compare: wrote {path} and its figures to {args.out}")
    return 0
