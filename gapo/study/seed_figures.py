"""gapo-compare seeds' figures: gapo-plot's, each curve the mean over a label's seeds with its 95 % interval as a
band (Student-t at each step; the clip-against-c figure pooled over seeds with ProportionEstimate's interval).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from gapo.rundir import logged_cs, per_c
from gapo.study.figures import (
    ALL_STEPS,
    RAW_PREFIX,
    Run,
    Window,
    benchmarks,
    clip_totals,
    finish,
    grid,
    moving_average,
    no_data,
    run_style,
    window_text,
)
from gapo.study.plot import TRAINING_PANELS
from gapo.study.stats import LEVEL, ProportionEstimate, ci_half_width


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


def fig_clip_vs_c(groups: dict[str, list[Run]], window: Window) -> Figure | None:
    per_label = {lab: [clip_totals(r, window) for r in runs] for lab, runs in groups.items()}
    cs = sorted({c for ts in per_label.values() for t in ts for c in t})
    if not cs:
        return None
    fig = Figure(figsize=(max(7.0, 1.1 * len(cs) + 3), 4.8), layout="constrained")
    ax = fig.subplots()
    for i, (lab, ts) in enumerate(per_label.items()):
        x, m, lo, hi, single = [], [], [], [], []
        for c in cs:
            got = [t[c] for t in ts if c in t]
            if not got:
                continue
            e = ProportionEstimate(tuple(g.frac for g in got), counts=tuple((g.clipped, g.units) for g in got))
            xc = c + 0.06 * (i - (len(per_label) - 1) / 2)  # side by side, not on top of each other
            if e.n == 1:  # one seed: no spread between seeds; a hollow mark, not a point with an interval
                single.append((xc, e.centre))
                continue
            a, b = e.interval()
            x.append(xc)
            m.append(e.centre)  # inside [a, b] and within [0, 1] by construction: no bar to clip
            lo.append(e.centre - a)
            hi.append(b - e.centre)
        style = run_style(i)
        ax.errorbar(x, m, yerr=[lo, hi], capsize=3, linewidth=1.7, label=lab, **style)
        for xc, yc in single:
            ax.plot([xc], [yc], marker="o", markerfacecolor="none", markeredgecolor=style["color"], linestyle="none")
            ax.annotate("n=1", (xc, yc), textcoords="offset points", xytext=(3, 4), fontsize=7, color=style["color"])
    ax.set_xticks(cs)
    ax.set_xlim(cs[0] - 0.5, cs[-1] + 0.5)
    ax.set_xlabel("c (correct rollouts in the group)")
    ax.set_ylabel("clip fraction (clipped / decisions, all seeds)")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"off-policy updates, {window_text(window)}", fontsize=10)
    return finish(fig, _legend_runs(groups), f"Clip fraction of correct rollouts against c (paper Fig. 3)\n"
                   f"(pooled over seeds; {LEVEL:.0%} CI: hull of Clopper–Pearson, seed-clustered logit-t and "
                   f"beta-binomial profile; hollow: one seed)",
                   step_axis=False)


def build_figures(groups: dict[str, list[Run]], window: Window = ALL_STEPS,
                  smooth: int = 1) -> dict[str, Figure | None]:
    all_runs = [r for runs in groups.values() for r in runs]
    cs = sorted({c for r in all_runs for c in logged_cs("clip_frac", r.series)})
    ratio_cs = sorted({c for r in all_runs for c in logged_cs("is_ratio", r.series)})
    benches, cover = benchmarks(all_runs, "pass@1"), benchmarks(all_runs, "coverage")
    figs: dict[str, Figure | None] = {
        "clip_by_c.png": _panels(groups, [(per_c("clip_frac", c), f"c = {c}") for c in cs or [1]],
                                 "Clip fraction of correct rollouts by c, off-policy updates (paper Fig. 3)", smooth,
                                 max_cols=4, sharey=True),
        "clip_vs_c.png": fig_clip_vs_c(groups, window),
        "is_ratio_by_c.png": _panels(groups, [(per_c("is_ratio", c), f"c = {c}") for c in ratio_cs],
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
