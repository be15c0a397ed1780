"""gapo-compare seeds: several seeds per configuration, compared the way the paper's Tables 6 and 7 compare them.

    gapo-compare seeds --out DIR LABEL=RUN,RUN,... LABEL=RUN,RUN,... [--steps A:B] [--val-step N] [--smooth N]

Per label: the final validation pass@1 per benchmark and training metrics over a window of steps, each with a 95 %
interval over seeds (Student-t, df = seeds - 1, as the seeds are the units and few; clip fractions as
ProportionEstimate says). Per pair of labels: Δ paired by trainer.seed, with a paired t-test. Same-seed runs share
prompt order, rollout sampling and evaluation seeds, so pairing takes that shared noise out of the comparison,
which an unpaired test (Welch's, once used here) leaves in its variance. The laptop experiment's pre-registered
endpoints (experiments/demo_mechanism_plan.md, computed by gapo/study/endpoints.py) are paired the same way; the
c × rule interaction of the earlier five-seed design stays as an exploratory table. Beside each t-test, the exact
sign-flip p assumes only symmetry under no effect, where a few pairs cannot check the t-test's normality.
Writes DIR/compare.md with those tables and, with mean ± CI bands across seeds over steps, the figures of
gapo-plot: is_ratio_by_c.png (Fig. 1), clip_by_c.png and clip_vs_c.png (Fig. 3), val_pass.png (Fig. 4),
is_adv_corr.png (Fig. 5), coverage.png (Fig. 8) and training.png.
Reads what gapo-plot reads (metrics.jsonl and config.yaml), with its loader.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

import numpy as np

from gapo.errors import ConfigError, Exit, out_folder
from gapo.rundir import logged_cs, per_c
from gapo.study import endpoints
from gapo.study.figures import (
    ALL_STEPS,
    PlotError,
    Run,
    Window,
    add_figure_options,
    algorithm_of,
    bench_order,
    clip_totals,
    figure_options,
    in_window,
    load_run,
    md_cell,
    window_text,
)
from gapo.study.seed_figures import build_figures
from gapo.study.stats import (
    LEVEL,
    Estimate,
    ProportionEstimate,
    cmh,
    holm,
    mh_odds_interval,
    paired_differences,
    paired_t,
    sign_flip_p,
    significance,
    stars,
)

_VAL_PASS1 = re.compile(r"^val/(.+)/pass@1$")
# Per-step training metrics compared as their mean over the window's steps (besides the exact clip by c).
WINDOW_METRICS = ("reward/mean", "entropy", "response/len_mean", "clip_frac", "is_adv_corr")


class CompareError(PlotError):
    """Inputs that cannot be compared; main() prints it and exits with status 2."""


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
        seen: dict[int, Run] = {}
        for r in groups[label]:
            if (s := run_seed(r)) in seen:
                raise CompareError(f"label {label!r}: {seen[s].path} and {r.path} both ran trainer.seed {s}; labels "
                                   "are compared seed by seed, so each seed may appear once per label")
            seen[s] = r
    if len(groups) < 2:
        print("gapo-compare: warning: one label only: confidence intervals but no comparisons", file=sys.stderr)
    return groups


def run_seed(run: Run) -> int:
    """trainer.seed of a run (0 when its config predates the key, as training defaulted)."""
    return int((run.config.get("trainer") or {}).get("seed", 0))


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
    benches = bench_order(ref)
    est = {label: {b: ProportionEstimate(tuple(finals[(label, i)][1][b] for i in range(len(runs))),
                                         seeds=tuple(run_seed(r) for r in runs)) for b in benches}
           for label, runs in groups.items()}
    return benches, est


def window_counts(run: Run, events: str, units: str, window: Window) -> tuple[float, float] | None:
    """Sums of a per-step count and its units over the window; None when the run did not log them (older runs)
    or logged no unit."""
    e, u = dict(run.get(events)), dict(run.get(units))
    steps = [st for st in u if in_window(st, window) and st in e]
    total = sum(u[st] for st in steps)
    return (sum(e[st] for st in steps), total) if steps and total > 0 else None


def window_mean(run: Run, key: str, window: Window) -> float | None:
    vals = [v for s, v in run.get(key) if in_window(s, window)]
    return float(np.mean(vals)) if vals else None


def training_estimates(groups: dict[str, list[Run]],
                       window: Window) -> tuple[list[str], dict[str, dict[str, Estimate]]]:
    """Per label and metric, one value per seed over the window: the exact clip fraction of correct rollouts
    per c and overall (summed counts) and the mean of per-step WINDOW_METRICS. A seed without the metric in the
    window is left out of that cell (its n says so)."""
    per_run: dict[str, list[dict[str, float]]] = {}
    seeds: dict[str, list[int]] = {}
    for label, runs in groups.items():
        rows = []
        for r in runs:
            row = {per_c("clip_frac", c): (t.frac, (t.clipped, t.units)) for c, t in clip_totals(r, window).items()}
            row |= {key: v for key in WINDOW_METRICS if (v := window_mean(r, key, window)) is not None}
            if (overall := window_counts(r, "clip_all", "clip_units", window)) is not None:
                row["clip_frac"] = (overall[0] / overall[1], overall)  # exact over the window, as per c
            rows.append(row)
        per_run[label] = rows
        seeds[label] = [run_seed(r) for r in runs]
    keys = {k for rows in per_run.values() for row in rows for k in row}
    clip_keys = [per_c("clip_frac", c) for c in logged_cs("clip_frac", keys)]
    metrics = [k for k in WINDOW_METRICS if k in keys] + clip_keys
    def estimate(key: str, rows: list[dict], label_seeds: list[int]) -> Estimate:
        got = [(row[key], s) for row, s in zip(rows, label_seeds, strict=True) if key in row]
        vals, ss = tuple(v for v, _ in got), tuple(s for _, s in got)
        if vals and isinstance(vals[0], tuple):  # (fraction, (events, units)): the count path
            return ProportionEstimate(tuple(v for v, _ in vals), ss, counts=tuple(c for _, c in vals))
        return ProportionEstimate(vals, ss) if key == "clip_frac" else Estimate(vals, ss)

    est = {label: {k: estimate(k, rows, seeds[label]) for k in metrics} for label, rows in per_run.items()}
    return metrics, est


# -------------------------------------------------------------------------------------------------- tables


def _fmt(x: float, percent: bool) -> str:
    return f"{100 * x:.2f}" if percent else f"{x:.4g}"


def estimate_cell(e: Estimate | None, percent: bool, expected: int | None = None) -> str:
    """`expected`: the seeds asked for; a cell with fewer says how many it has of them."""
    if e is None or e.n == 0:
        return "–"
    n = f"n = {e.n}" + (f" of {expected}" if expected and e.n < expected else "")
    if e.n < 2 and not (isinstance(e, ProportionEstimate) and e.counts):
        return f"{_fmt(e.centre, percent)} ({n})"
    if isinstance(e, ProportionEstimate):
        lo, hi = e.interval()
        return f"{_fmt(e.centre, percent)} [{_fmt(lo, percent)}, {_fmt(hi, percent)}] ({n})"
    return f"{_fmt(e.mean, percent)} ± {_fmt(e.half_width, percent)}" + \
        ("" if percent and not (expected and e.n < expected) else f" ({n})")


def difference_cell(a: Estimate | None, b: Estimate | None, percent: bool) -> str:
    """Δ = the mean over seeds both labels ran of a − b, paired by trainer.seed (same-seed runs share prompt
    order, sampling and evaluation seeds), its 95 % Student-t interval and paired-t p. Values without seeds
    (hand-built estimates) fall back to the unpaired difference of means with Welch's test, said so."""
    if a is None or b is None or a.n == 0 or b.n == 0:
        return "–"
    f = (lambda x: f"{100 * x:+.2f}") if percent else (lambda x: f"{x:+.4g}")
    if not (a.seeds and b.seeds):
        sig = significance(a.values, b.values)
        return f"{f(a.mean - b.mean)} unpaired " + (sig if sig.startswith("*") else sig.strip())
    common, d = paired_differences(a, b)
    if not common:
        return "(no seed in common: no pairs)"
    m, lo, hi, p = paired_t(d)
    if not math.isfinite(p):
        why = "one pair" if len(d) < 2 else "every pair differs the same" if m else "identical in every pair"
        return f"{f(m)} ({len(d)} pairs: {why}; no test)"
    return f"{f(m)} [{f(lo)}, {f(hi)}] {stars(p)}(p = {p:.2g}, {len(d)} pairs)"


def tables(columns: list[str], est: dict[str, dict[str, Estimate]], percent: bool) -> list[str]:
    """Table 6 (labels x columns, mean ± CI) and Table 7 (pairs of labels x columns, Δ paired by seed)."""
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


LowHigh = tuple[float, float, float, float]  # (clipped, decisions) at low c, then at high c


def low_high(run: Run, window: Window, half: float) -> LowHigh:
    """One run's correct-rollout clip counts summed over low c (c <= k/2, where GAPO's bound is widest) and high c."""
    t = clip_totals(run, window)
    return (sum(x.clipped for c, x in t.items() if c <= half), sum(x.units for c, x in t.items() if c <= half),
            sum(x.clipped for c, x in t.items() if c > half), sum(x.units for c, x in t.items() if c > half))


def _half(groups: dict[str, list[Run]]) -> float:
    return max(int(r.config.get("rollout", {}).get("group_size", 8)) for runs in groups.values() for r in runs) / 2


def interaction_table(groups: dict[str, list[Run]], window: Window) -> list[str]:
    """The earlier five-seed design's endpoint, exploratory under the plan (experiments/demo_mechanism_plan.md): the
    c x rule interaction, paired by seed.

    Per seed, a rule's contrast is its clip fraction at low c minus at high c (correct rollouts, off-policy
    decisions pooled within the seed); the interaction of two rules is the difference of their contrasts at the
    same trainer.seed. GAPO's claim is about this shape, that scarce correct rollouts are clipped less relative
    to abundant ones than under a fixed bound, not that a wider bound clips less."""
    half = _half(groups)
    per = {lab: {run_seed(r): low_high(r, window, half) for r in runs} for lab, runs in groups.items()}
    contrast = {lab: {s: x[0] / x[1] - x[2] / x[3] for s, x in got.items() if x[1] > 0 and x[3] > 0}
                for lab, got in per.items()}
    labels = list(groups)
    out = ["", "## The c × rule interaction, paired by seed (exploratory)", "",
           f"Per seed: a rule's contrast is its clip fraction of correct rollouts at low c (c ≤ {half:g}) minus at "
           "high c, each pooled over the seed's off-policy decisions; the interaction of two labels is the "
           "difference of their contrasts at the same trainer.seed. A seed with no decision at low or high c has no "
           "contrast and drops out (pairs counts the rest). Mean [95 % Student-t interval], paired t-test p; the "
           "sign-flip test assumes only symmetry under no effect, and with n pairs cannot go below 2 / 2^n "
           "(0.0625 at 5). Holm's correction is over this table's tests.", "",
           "| label | contrast per seed (low c − high c) | mean [95 % CI] |", "|---|---|---|"]
    for lab in labels:
        c = contrast[lab]
        e = Estimate(tuple(c.values()))
        cell = (f"{e.mean:+.3f} [{e.mean - e.half_width:+.3f}, {e.mean + e.half_width:+.3f}]" if e.n > 1
                else f"{e.mean:+.3f} (n = 1)" if e.n else "–")
        out.append(f"| {md_cell(lab)} | {', '.join(f'{s}: {v:+.3f}' for s, v in sorted(c.items())) or '–'} | "
                   f"{cell} |")
    rows, pvals = [], []
    for i, a in enumerate(labels):
        for b in labels[i + 1:]:
            common = sorted(set(contrast[a]) & set(contrast[b]))
            d = np.array([contrast[a][s] - contrast[b][s] for s in common])
            m, lo, hi, p = paired_t(d) if len(d) else (float("nan"),) * 4
            rows.append((a, b, common, d, m, lo, hi, p, sign_flip_p(d) if len(d) else float("nan")))
            pvals.append(p)
    adjusted = holm(pvals)
    m_tests = sum(math.isfinite(p) for p in pvals)
    out += ["", f"| interaction (first − second) | pairs | per seed | mean [95 % CI] | paired t p | sign-flip p | "
            f"Holm ({m_tests} tests) |", "|---|---|---|---|---|---|---|"]
    for (a, b, common, d, m, lo, hi, p, sp), adj in zip(rows, adjusted, strict=True):
        per_seed = ", ".join(f"{s}: {x:+.3f}" for s, x in zip(common, d, strict=True)) or "–"
        ci = f"{m:+.3f} [{lo:+.3f}, {hi:+.3f}]" if math.isfinite(lo) else (f"{m:+.3f}" if len(d) else "–")
        test = (f"{p:.2g}{stars(p)}" if math.isfinite(p)
                else "(no test: fewer than 2 pairs)" if len(d) < 2 else "(no test: no spread)")
        holm_cell = (f"{adj:.2g} ({'survives' if adj < 0.05 else 'does not survive'})" if math.isfinite(adj)
                     else "–")
        sf = f"{sp:.3g}" if math.isfinite(sp) else "–"
        out.append(f"| {md_cell(a)} − {md_cell(b)} | {len(d)} | {per_seed} | {ci} | {test} | {sf} | {holm_cell} |")
    return out


def pooled_clip_table(groups: dict[str, list[Run]], window: Window, role: str = "") -> list[str]:
    """Low and high c against each pair of labels: the clip counts pooled over seeds by a Cochran–Mantel–Haenszel
    test, each seed a stratum (the same trainer.seed on both sides; a seed only one side ran is left out)."""
    half = _half(groups)
    per = {lab: {run_seed(r): low_high(r, window, half) for r in runs} for lab, runs in groups.items()}
    labels = [lab for lab, got in per.items() if any(x[1] + x[3] for x in got.values())]
    if len(labels) < 2:
        return []
    rows, pvals = [], []
    for i, a in enumerate(labels):
        for b in labels[i + 1:]:
            common = sorted(set(per[a]) & set(per[b]))
            for band, j in (("low", 0), ("high", 2)):
                strata = [(per[a][s][j], per[a][s][j + 1], per[b][s][j], per[b][s][j + 1]) for s in common]
                odds, chi2, p = cmh(strata)
                rows.append((a, b, band, strata, odds, chi2, p, mh_odds_interval(strata)))
                pvals.append(p)
    adjusted = holm(pvals)
    m_tests = sum(math.isfinite(p) for p in pvals)
    out = ["", f"## Clip counts pooled over seeds (Cochran–Mantel–Haenszel; assumes independent decisions){role}", "",
           "Correct rollouts' clip decisions over the window's off-policy updates, summed per seed over c ≤ k/2 "
           "(low c) or c > k/2 (high c); each seed that both labels ran is a stratum. The common odds ratio is the "
           "first label's odds of a clip over the second's, with its Robins–Breslow–Greenland 95 % interval. It "
           "treats every decision as independent, which they are not (a mini-batch's rollouts share one update; "
           "under token IS the units are tokens of one rollout), so its p-values are too small by an unknown "
           "factor: the per-seed tables above come first. Holm's correction is over this table's tests.", "",
           f"| comparison | c | seeds | clipped / decisions (first) | clipped / decisions (second) | odds ratio "
           f"[95 % CI] | χ² | p | Holm ({m_tests} tests) |", "|---|---|---|---|---|---|---|---|---|"]
    for (a, b, band, strata, odds, chi2, p, (lo, hi)), adj in zip(rows, adjusted, strict=True):
        sums = [sum(x[j] for x in strata) for j in range(4)]
        if math.isfinite(p):
            test = f"{odds:.3g} [{lo:.3g}, {hi:.3g}] | {chi2:.3g} | {p:.2g}{stars(p)}"
            holm_cell = f"{adj:.2g} ({'survives' if adj < 0.05 else 'does not survive'})"
        else:
            test, holm_cell = "– | – | (no stratum with both outcomes: no test)", "–"
        out.append(f"| {md_cell(a)} vs {md_cell(b)} | {band} | {len(strata)} | {sums[0]:g} / {sums[1]:g} | "
                   f"{sums[2]:g} / {sums[3]:g} | {test} | {holm_cell} |")
    return out


def band_tables(groups: dict[str, list[Run]], role: str = "") -> list[str]:
    """For each pair of labels whose runs logged rollouts under sequence-level rules: where the two rules decide
    differently, per c, on both labels' logged ratios (gapo.study.band); a pair the counts cannot cover says why.
    Two labels' runs of one trainer.seed follow the same trajectory until their rules first decide differently,
    so such a pair is counted once up to there (band.count's pairs); a seed only one label ran counts as it is."""
    from gapo.study import band

    rules, why = {}, {}
    for lab, runs in groups.items():
        try:
            rules[lab] = band.run_rule(runs[0].path, lab, runs[0].config)
            band.rollouts_log(runs[0].path)
        except (PlotError, ConfigError) as e:
            why[lab] = str(e)
    labels = list(groups)
    out = ["", f"## Where the rules can differ (band counts){role}", "",
           "Every logged off-policy decision of both labels' runs, judged under both rules: only decisions in the "
           "band between the two bounds can make the runs differ (`gapo-compare band`). The two labels' runs of "
           "one seed share their decisions until the first one that differs; those are counted once."]
    for i, a in enumerate(labels):
        for b in labels[i + 1:]:
            out += ["", f"### {md_cell(a)} vs {md_cell(b)}", ""]
            if a in why or b in why:
                out.append(f"No band count: {why.get(a) or why.get(b)}")
                continue
            by_seed = {run_seed(r): r for r in groups[b]}
            pairs = [(r.path, by_seed[run_seed(r)].path) for r in groups[a] if run_seed(r) in by_seed]
            paired = {run_seed(r) for r in groups[a]} & set(by_seed)
            single = [r.path for r in groups[a] + groups[b] if run_seed(r) not in paired]
            bands = band.count(single, rules[a], rules[b], pairs)
            out += band.table(bands, rules[a], rules[b])
    return out


# -------------------------------------------------------------------------------------------------- report


def write_report(out: Path, groups: dict[str, list[Run]], window: Window = ALL_STEPS, val_step: int | None = None,
                 smooth: int = 1, control: str | None = None) -> Path:
    out_folder(out, "--out")
    notes: list[str] = []
    benches, val_est = validation_estimates(groups, val_step, notes)
    metrics, train_est = training_estimates(groups, window)
    lines = ["# gapo-compare", "",
             f"Estimands. pass@1 shows its centre over a label's seeds, the back-transformed mean logit (a typical "
             f"seed), and a {LEVEL:.0%} interval [low, high], Student-t on the logit scale (df = seeds − 1) mapped "
             "back into [0, 1]; seeds that all agree show their value and a zero-width interval. A clip fraction "
             "(per c, and overall) is the pooled fraction, clipped over decisions summed over seeds (decision-"
             "weighted), with the hull of a Clopper–Pearson interval on the pooled counts, a seed-clustered "
             "Student-t interval on the logit scale and a beta-binomial profile-likelihood interval (seeds that "
             "differ more than binomially, or none that clipped). Other metrics show mean ± the Student-t "
             "half-width, as in the "
             "paper's Table 6. n is the number of seeds with a value. Δ is the mean over seeds both labels ran of "
             "first − second, paired by trainer.seed (same-seed runs share prompt order, sampling and evaluation "
             "seeds), with its Student-t interval and paired t-test p: * p < 0.05, ** p < 0.01, *** p < 0.001 "
             "(no multiplicity correction in these tables; the interaction table names its own). Where a test is "
             "undefined the cell says why.", "", "## Runs", "", "| label | seeds | trainer.seed | run directories |",
             "|---|---|---|---|"]
    lines += [f"| {md_cell(lab)} | {len(runs)} | {', '.join(str(run_seed(r)) for r in runs)} | "
              f"{md_cell(', '.join(str(r.path) for r in runs))} |" for lab, runs in groups.items()]
    algos = {label: algorithm_of(runs[0].config) for label, runs in groups.items() if runs}
    fixed = {label: float(a.eps_hi) for label, a in algos.items()
             if a is not None and a.rule.constant and not a.bounds_the_weight}
    first = algos.get(next(iter(groups), ""))
    k = max(int(r.config.get("rollout", {}).get("group_size", 8)) for runs in groups.values() for r in runs)
    margin = endpoints.bound_gradient(first, k) if first is not None else None
    # Read with the figure the plan wrote, two significant digits (0.014 for 0.003/0.015 at k = 8: 0.01371 exactly)
    plan = endpoints.report({label: {run_seed(r): r.path for r in runs} for label, runs in groups.items()}, fixed,
                            control, float(f"{margin:.2g}") if margin else None, out)
    # With a plan (--control) its endpoints come first and every later section says what it is to the plan: a
    # reader must not meet the training tables' uncorrected stars before the pre-registered test.
    role = {"val": " (exploratory; the plan's held-out pass@1 is `gapo-compare table`'s, secondary)",
            "train": " (secondary: reward/mean; is_adv_corr is E2, read in the endpoints; the rest exploratory; "
                     "p uncorrected)", "band": " (secondary)", "pooled": " (exploratory)",
            "figures": " (exploratory)"} if control else {}
    if control:
        lines += ["", "With --control the plan's endpoints come first; every later section's heading says whether "
                  "the plan lists it as secondary or not at all (exploratory)."] + plan
    lines += ["", f"## Final validation pass@1, % (Tables 6 and 7){role.get('val', '')}", ""]
    if benches:
        steps = sorted({final_validation(r, val_step)[0] for runs in groups.values() for r in runs})
        lines += [f"At step {', '.join(map(str, steps))} (each run's {'' if val_step is None else 'chosen '}"
                  "validation; `mean` is the average over the in-domain benchmarks).", ""]
        lines += tables(benches, val_est, percent=True)
    else:
        lines.append("No run logged validation (`val/<benchmark>/pass@1`; set `trainer.eval_every`).")
    lines += ["", f"## Training metrics, {window_text(window)}{role.get('train', '')}", "",
              "`clip_frac/c{c}`: clip fraction of correct rollouts of groups with c correct over the off-policy "
              "updates, per seed from the window's summed counts (`clip_hi/c{c}` / `clip_units/c{c}`); the other "
              "metrics are each seed's mean over the window's logged steps. n is the number of seeds with a value.",
              ""]
    lines += tables(metrics, train_est, percent=False) if metrics else ["No training metrics in the window."]
    lines += band_tables(groups, role.get("band", ""))
    if not control:
        lines += plan
    lines += interaction_table(groups, window)
    lines += pooled_clip_table(groups, window, role.get("pooled", ""))
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    figures = build_figures(groups, window, smooth)
    lines += ["", f"## Figures{role.get('figures', '')}", ""]
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
    """`gapo-compare seeds`'s arguments (gapo.study.compare holds the command line)."""
    p.add_argument("groups", nargs="+", metavar="LABEL=RUN_DIR,RUN_DIR,...",
                   help="a label and its seeds' run directories (two or more); list your method first: Δ is "
                        "earlier label minus later label")
    p.add_argument("--out", required=True, type=Path, help="directory for compare.md and the figures")
    add_figure_options(p, "moving average over N logged steps of each seed's per-step curves",
                       "window of the training metrics")
    p.add_argument("--val-step", type=int, metavar="N",
                   help="compare validation at step N instead of each run's last validation")
    p.add_argument("--control", metavar="LABEL",
                   help="the plan's control arm (experiments/demo_mechanism_plan.md: GSPO 0.003): its E1 and the first "
                        "label's E2 and E3 against it form the primary family, Holm-adjusted in a column of their own")


def run(args: argparse.Namespace) -> int:
    """`gapo-compare seeds`: compare.md and its figures; 2 with a message when the runs cannot be compared."""
    try:
        smooth, window = figure_options(args)
        groups = load_groups(args.groups)
        if args.control is not None and args.control not in groups:
            raise CompareError(f"--control {args.control!r}: not one of the labels ({', '.join(groups)})")
        if args.control is not None and args.control == next(iter(groups)):
            raise CompareError(f"--control {args.control!r} is the first label, the method the others are compared "
                               "with: give the method first and the control after it")
        path = write_report(args.out, groups, window, args.val_step, smooth, args.control)
    except (PlotError, ConfigError) as e:
        print(f"gapo-compare: error: {e}", file=sys.stderr)
        return Exit.CONFIG
    print(f"gapo-compare: wrote {path} and its figures to {args.out}")
    return 0
