"""gapo-plot: the paper's training-dynamics figures (§4.2) from run directories, several runs overlaid.

    gapo-plot RUN_DIR [RUN_DIR ...] --out DIR [--labels a,b] [--smooth N] [--steps A:B] [--rollout-steps S,S]

Reads only `metrics.jsonl`, `config.yaml` and, where a run has it, `rollouts.jsonl`, so it works on a live run,
a finished one, or one copied off a cluster, without torch or wandb. Writes is_ratio_by_c.png (Fig. 1),
clip_by_c.png (Fig. 3), clip_vs_c.png (Fig. 3 over a window of steps), is_adv_corr.png (Fig. 5),
val_pass.png (Fig. 4), coverage.png (Fig. 8), training.png, an index.md that shows them with what to look for,
and per run with rollouts a rollouts_<label>.html page of sampled rollouts with their IS ratios and clip decisions.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Figures are built with the object API (no pyplot): Figure.savefig renders with Agg, so nothing needs a display
# and importing this module does not switch the backend of a notebook that uses it.
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from gapo.errors import ConfigError, Exit, out_folder
from gapo.rundir import logged_cs, per_c
from gapo.study.figures import (
    ALL_STEPS,
    REF_PREFIX,
    PlotError,
    Run,
    Window,
    add_figure_options,
    benchmarks,
    clip_totals,
    figure_options,
    finish,
    grid,
    load_run,
    md_cell,
    no_data,
    plot_series,
    run_style,
    window_text,
)
from gapo.study.pages import write_rollout_pages

_VAL_MEAN_PASS = re.compile(r"^val/mean/pass@(\d+)$")


def warn_pre_split(runs: list[Run]) -> None:
    """Runs logged before the off-policy/all split count every update in clip_frac/* and is_adv_corr, the first
    mini-batch's ratio-1 rollouts included; say so rather than draw them as if comparable."""
    for r in runs:
        if "clip_frac" in r.series and not any(k.startswith("all/") for k in r.series):
            print(f"gapo-plot: warning: {r.path} was logged before the off-policy clip metrics: its clip_frac/* and "
                  "is_adv_corr count all updates, including the first mini-batch's (ratio 1, never clipped)",
                  file=sys.stderr)


def _unique_labels(runs: list[Run]) -> None:
    """Two runs with one label would share a legend entry; number the repeats."""
    seen: dict[str, int] = {}
    for r in runs:
        seen[r.label] = seen.get(r.label, 0) + 1
        if seen[r.label] > 1:
            r.label = f"{r.label} #{seen[r.label]}"


# ---------------------------------------------------------------------------------------------- plotting


def clip_cs(runs: list[Run]) -> list[int]:
    """c = 1 .. k-1 from the configs' group size, plus any c the logs have (configs may be missing)."""
    cs = {c for r in runs for c in logged_cs("clip_frac", r.series)}
    for r in runs:
        if r.group_size:
            cs.update(range(1, r.group_size))
    return sorted(cs)


def fig_clip_by_c(runs: list[Run], smooth: int = 1) -> Figure:
    """Fig. 3: one panel per c on a shared y axis, so both "GAPO vs fixed at a given c" (within a panel)
    and "low c vs high c" (across panels) can be read off directly."""
    k = max((r.group_size for r in runs if r.group_size), default=None)
    return _panels_by_c(runs, clip_cs(runs) or [1], "clip_frac", "clip fraction", smooth,
                        "Clip fraction of correct rollouts by group success count c, off-policy updates (paper Fig. 3)",
                        hint=lambda c: " (scarcest correct)" if c == 1 else " (most abundant)" if k and c == k - 1
                        else "")


def fig_is_ratio_by_c(runs: list[Run], smooth: int = 1) -> Figure:
    """Fig. 1: the mean sequence IS ratio of the correct rollouts of groups with c correct, per c over steps:
    before clipping sets in, scarce correct rollouts (low c, large advantage) move their ratio furthest."""
    cs = sorted({c for r in runs for c in logged_cs("is_ratio", r.series)}) or [1]
    return _panels_by_c(runs, cs, "is_ratio", "mean IS ratio, correct rollouts", smooth,
                        "IS ratio of correct rollouts by group success count c, off-policy updates (paper Fig. 1)",
                        ref=1.0)


def _panels_by_c(runs: list[Run], cs: list[int], metric: str, ylabel: str, smooth: int, title: str,
                 ref: float | None = None, hint: Callable[[int], str] = lambda c: "") -> Figure:
    """Figs. 1 and 3: `metric`/c{c} over steps, one panel per c on a shared y axis."""
    fig, axes = grid(len(cs), 4, (3.6, 2.8), sharey=True)
    for ax, c in zip(axes, cs, strict=True):
        if ref is not None:
            ax.axhline(ref, color="0.6", linewidth=0.8, label=f"{REF_PREFIX}ratio {ref:g}")
        for i, r in enumerate(runs):
            plot_series(ax, r.get(per_c(metric, c)), r.label, i, smooth)
        ax.set_title(f"c = {c}{hint(c)}", fontsize=10)
        if ax.get_subplotspec().is_first_col():
            ax.set_ylabel(ylabel)
        if not any(r.get(per_c(metric, c)) for r in runs):
            no_data(ax, per_c(metric, c))
    return finish(fig, runs, title, smooth)


def fig_clip_vs_c(runs: list[Run], window: Window = ALL_STEPS) -> Figure | None:
    """Fig. 3 at a glance: the clip fraction of correct rollouts against c over a window of steps, with the
    rollouts behind each point underneath, so that a point resting on three rollouts reads as such."""
    totals = [clip_totals(r, window) for r in runs]
    cs = sorted({c for t in totals for c in t})
    if not cs:
        return None
    fig = Figure(figsize=(max(7.0, 1.1 * len(cs) + 3), 6.4), layout="constrained")
    ax, ax_n = fig.subplots(2, 1, sharex=True, height_ratios=(2.2, 1))
    width = 0.8 / len(runs)
    for i, (r, t) in enumerate(zip(runs, totals, strict=True)):
        if not t:
            continue
        x = np.array(list(t), dtype=float)
        style = run_style(i)
        ax.plot(x, [v.frac for v in t.values()], linewidth=1.7, markersize=6,
                markerfacecolor="none" if i % 2 else style["color"], label=r.label, **style)
        bars = ax_n.bar(x - 0.4 + width * (i + 0.5), [v.rollouts for v in t.values()], width=width,
                        color=style["color"], alpha=0.75, label=f"{REF_PREFIX}{r.label}")
        ax_n.bar_label(bars, labels=[f"{v.rollouts:.0f}" for v in t.values()], fontsize=7)
    lacking = [r.label for r, t in zip(runs, totals, strict=True) if not t]
    ax.set_title("off-policy updates" + (f"; no clip counts logged by {', '.join(lacking)}" if lacking else ""),
                 fontsize=10)
    ax.set_ylabel("clip fraction (clipped / units)")
    ax.set_ylim(bottom=0)
    ax_n.set_title("correct rollouts per c (one per update)", fontsize=10)
    ax_n.set_ylabel("rollouts")
    ax_n.set_xlabel("c (correct rollouts in the group)")
    ax_n.set_xticks(cs)
    ax_n.set_xlim(cs[0] - 0.5, cs[-1] + 0.5)
    ax_n.margins(y=0.2)
    return finish(fig, runs, f"Clip fraction of correct rollouts against c, {window_text(window)} (paper Fig. 3)",
                   step_axis=False)


def fig_is_adv_corr(runs: list[Run], smooth: int = 1) -> Figure:
    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.subplots()
    ax.axhline(0.0, color="0.6", linewidth=0.8, label=f"{REF_PREFIX}zero")
    for i, r in enumerate(runs):
        plot_series(ax, r.get("is_adv_corr"), r.label, i, smooth)
    ax.set_xlabel("step")
    ax.set_ylabel("Pearson r (sequence IS ratio, advantage)")
    ax.set_title("over rollouts with A ≠ 0, off-policy updates", fontsize=10)
    if not any(r.get("is_adv_corr") for r in runs):
        no_data(ax, "is_adv_corr")
    return finish(fig, runs, "IS ratio – advantage correlation (paper Fig. 5)", smooth)


def val_kmax(run: Run) -> int | None:
    ks = [int(m.group(1)) for k in run.series if (m := _VAL_MEAN_PASS.match(k))]
    return max(ks) if ks else None


def fig_val_pass(runs: list[Run]) -> Figure | None:
    """Fig. 4. Not smoothed: evals are few and far apart, a moving average would hide the trend."""
    kmax = {r.label: val_kmax(r) for r in runs}
    if not any(kmax.values()):
        return None
    fig = Figure(figsize=(12, 4.8), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2, sharex=True)
    ks = sorted({k for k in kmax.values() if k and k > 1})
    for i, r in enumerate(runs):
        plot_series(ax1, r.get("val/mean/pass@1"), r.label, i, markers=True)
        k = kmax[r.label]
        if k and k > 1:
            plot_series(ax2, r.get(f"val/mean/pass@{k}"), r.label, i, markers=True)
    kname = f"pass@{ks[0]}" if len(ks) == 1 else "pass@k_max (k = " + ", ".join(map(str, ks)) + " by run)"
    ax1.set_title("pass@1, mean over benchmarks", fontsize=10)
    ax2.set_title(f"{kname}, mean over benchmarks", fontsize=10)
    for ax, what in ((ax1, "pass@1"), (ax2, kname if ks else "pass@k")):
        ax.set_xlabel("step")
        ax.set_ylabel(what)
    if not any(r.get("val/mean/pass@1") for r in runs):
        no_data(ax1, "val/mean/pass@1")
    if not ks:
        no_data(ax2, "val/mean/pass@k with k > 1")
    return finish(fig, runs, "Validation pass@1 and pass@k (paper Fig. 4)")


def fig_coverage(runs: list[Run]) -> Figure | None:
    """Fig. 8: one panel per benchmark, since coverage counts problems and benchmarks differ in size."""
    benches = benchmarks(runs, "coverage")
    if not benches:
        return None
    fig, axes = grid(len(benches), 3, (4.6, 3.4))
    for ax, b in zip(axes, benches, strict=True):
        for i, r in enumerate(runs):
            plot_series(ax, r.get(f"val/{b}/coverage"), r.label, i, markers=True)
        ax.set_title(b, fontsize=10)
        if ax.get_subplotspec().is_first_col():
            ax.set_ylabel("problems with solve rate > threshold")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    return finish(fig, runs, "Problem coverage: problems with solve rate above the threshold (paper Fig. 8)")


def fig_mismatch(runs: list[Run], smooth: int = 1) -> Figure | None:
    """The sampler-trainer mismatch: its KL (k3, token mean) over steps, and |log pi_old - log pi_rollout| along
    the response (fifths of its length, mean over the logged steps), where it grows in long responses."""
    if not any(r.get("logprob_mismatch/kl_k3") for r in runs):
        return None
    fig = Figure(figsize=(12, 4.6), layout="constrained")
    ax_kl, ax_pos = fig.subplots(1, 2)
    for i, r in enumerate(runs):
        plot_series(ax_kl, r.get("logprob_mismatch/kl_k3"), r.label, i, smooth)
        prof = [(q, float(np.mean([v for _, v in r.get(f"logprob_mismatch/pos{q}")])))
                for q in range(1, 6) if r.get(f"logprob_mismatch/pos{q}")]
        plot_series(ax_pos, prof, r.label, i, markers=True)
    ax_kl.set_title("KL(pi_rollout || pi_old), k3 estimate, token mean", fontsize=10)
    ax_kl.set_xlabel("step")
    ax_kl.set_ylabel("KL per token")
    ax_pos.set_title("mean |log pi_old - log pi_rollout| by position (mean over steps)", fontsize=10)
    ax_pos.set_xlabel("fifth of the response (1: first tokens, 5: last)")
    ax_pos.set_ylabel("|log-ratio|")
    out = finish(fig, runs, "Sampler-trainer mismatch (algorithm.rollout_correction)", smooth)
    ax_pos.set_xlim(0.5, 5.5)  # finish() sets step limits on every axes; this one is positions
    return out


TRAINING_PANELS = (("reward/mean", "mean reward"), ("response/len_mean", "mean response length (tokens)"),
                   ("entropy", "mean token entropy"), ("clip_frac", "clip fraction (off-policy updates)"))


def fig_training(runs: list[Run], smooth: int = 1) -> Figure:
    fig, axes = grid(len(TRAINING_PANELS), 2, (5.6, 3.4))
    for ax, (key, ylabel) in zip(axes, TRAINING_PANELS, strict=True):
        for i, r in enumerate(runs):
            plot_series(ax, r.get(key), r.label, i, smooth)
        ax.set_title(key, fontsize=10)
        ax.set_ylabel(ylabel)
        if not any(r.get(key) for r in runs):
            no_data(ax, key)
    return finish(fig, runs, "Training curves", smooth)


@dataclass(frozen=True)
class FigureSpec:
    filename: str
    title: str
    caption: str  # what to look for
    build: Callable[[list[Run], int, Window], Figure | None]
    missing: str = ""  # said on the index page when build() returns None


FIGURES = (
    FigureSpec("is_ratio_by_c.png", "IS ratio by c (Fig. 1)",
               "Before clipping sets in, the scarce correct rollouts of low-c groups (large advantage) should move "
               "their IS ratio away from 1 fastest; a fixed bound then cuts them off as early as the abundant ones.",
               lambda runs, smooth, window: fig_is_ratio_by_c(runs, smooth)),
    FigureSpec("clip_by_c.png", "Clip fraction by c (Fig. 3)",
               "GAPO should clip the scarce correct rollouts of low-c groups less than fixed clipping does, "
               "and the abundant high-c ones at least as much.",
               lambda runs, smooth, window: fig_clip_by_c(runs, smooth)),
    FigureSpec("clip_vs_c.png", "Clip fraction against c over a window of steps (Fig. 3)",
               "The mechanism at a glance: fixed clipping clips correct rollouts at about the same rate whatever "
               "their c; GAPO should clip low c (scarce, high advantage) less and high c at least as much. The bars "
               "count the rollouts behind each point.",
               lambda runs, smooth, window: fig_clip_vs_c(runs, window),
               "no clip counts in these runs (`clip_units/c{c}`, `clip_hi/c{c}`, `n_correct/c{c}`; logged by "
               "gapo-train since the off-policy clip metrics)."),
    FigureSpec("is_adv_corr.png", "IS–advantage correlation (Fig. 5)",
               "GAPO should keep the correlation high once clipping starts firing; fixed clipping lets it fall.",
               lambda runs, smooth, window: fig_is_adv_corr(runs, smooth)),
    FigureSpec("val_pass.png", "Validation pass@1 and pass@k (Fig. 4)",
               "GAPO should hold or exceed the baselines in pass@1 and, especially, pass@k late in training.",
               lambda runs, smooth, window: fig_val_pass(runs),
               "no validation pass@k in these runs (`val/mean/pass@{k}`; set `trainer.eval_every` > 0)."),
    FigureSpec("coverage.png", "Problem coverage (Fig. 8)",
               "GAPO should keep more problems above the solve-rate threshold, where baselines lose them.",
               lambda runs, smooth, window: fig_coverage(runs),
               "no coverage in these runs (`val/{benchmark}/coverage`; set `trainer.eval_every` > 0)."),
    FigureSpec("mismatch.png", "Sampler-trainer mismatch",
               "How far vLLM's log-probs of the sampled tokens are from the trainer's: in fp32 near 0; in bf16 it "
               "grows with response length (the position profile), which is what algorithm.rollout_correction "
               "corrects.", lambda runs, smooth, window: fig_mismatch(runs, smooth),
               "no mismatch metrics in these runs (`logprob_mismatch/kl_k3`: runs with the trainer's old-log-prob "
               "pass)."),
    FigureSpec("training.png", "Training curves",
               "Sanity checks: reward should rise, entropy should not collapse early, lengths should not blow "
               "up, the overall clip fraction shows when clipping starts firing.",
               lambda runs, smooth, window: fig_training(runs, smooth)),
)


def build_figures(runs: list[Run], smooth: int = 1, window: Window = ALL_STEPS) -> dict[str, Figure | None]:
    """Filename -> Figure (None where the runs lack the metrics); kept separate from saving for tests."""
    return {spec.filename: spec.build(runs, smooth, window) for spec in FIGURES}


# ------------------------------------------------------------------------------------------------ output


def _last(run: Run, key: str) -> str:
    pts = run.get(key)
    return f"{pts[-1][1]:.4g} (step {pts[-1][0]})" if pts else "–"


def write_index(out: Path, runs: list[Run], figures: dict[str, Figure | None], smooth: int,
                pages: dict[str, str] | None = None, window: Window = ALL_STEPS) -> Path:
    lines = ["# GAPO run plots", "", "| label | algorithm | clip range | steps | last reward/mean | dir |",
             "|---|---|---|---|---|---|"]
    for r in runs:
        steps = f"{len(r.steps)} ({r.steps[0]}–{r.steps[-1]})" if r.steps else "0"
        cells = (r.label, r.algorithm, r.clip_range, steps, _last(r, "reward/mean"), str(r.path))
        lines.append("| " + " | ".join(md_cell(c) for c in cells) + " |")
    lines.append("")
    if smooth > 1:
        lines += [f"Per-step curves are smoothed (trailing mean over {smooth} logged steps); raw values are faint.",
                  ""]
    if window != ALL_STEPS:
        lines += [f"Window of the clip-against-c figure: {window_text(window)}.", ""]
    for spec in FIGURES:
        lines += [f"## {spec.title}", ""]
        if figures.get(spec.filename) is None:
            lines += [f"Not drawn: {spec.missing}", ""]
        else:
            lines += [f"![{spec.title}]({spec.filename})", "", spec.caption, ""]
    if pages:
        lines += ["## Rollouts behind the figures", "",
                  "Sampled rollouts per c at a few steps, with their text, advantage, IS ratio per update, bound and "
                  "clip decision:", ""]
        lines += [f"- [{md_cell(label)}]({name})" for label, name in pages.items()]
        lines.append("")
    path = out / "index.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def render(runs: list[Run], out: Path, smooth: int = 1, window: Window = ALL_STEPS,
           rollout_steps: list[int] | None = None, shown_per_c: int = 3) -> dict[str, Figure | None]:
    out_folder(out, "--out")
    figures = build_figures(runs, smooth, window)
    for name, fig in figures.items():
        if fig is None:
            (out / name).unlink(missing_ok=True)  # a stale image from an earlier call would contradict index.md
            continue
        fig.savefig(out / name, dpi=110)
    pages = write_rollout_pages(runs, out, rollout_steps, shown_per_c)  # gapo/study/pages.py
    write_index(out, runs, figures, smooth, pages, window)
    return figures


def parse_args(argv: Iterable[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gapo-plot", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (with metrics.jsonl)")
    p.add_argument("--out", type=Path, help="directory for the PNGs and index.md (default: RUN_DIR/plots with one run, "
                                           "required with several)")
    p.add_argument("--labels", help="comma-separated legend labels, one per RUN_DIR, replacing the default "
                                    "'run_name (algorithm eps_lo/eps_hi)'")
    add_figure_options(p, "moving average over N logged steps for per-step curves", "window of clip_vs_c.png")
    p.add_argument("--rollout-steps", metavar="S,S,...", help="steps shown on the rollouts pages of runs with "
                                                             "rollouts.jsonl (default: first, middle and last)")
    p.add_argument("--rollouts-per-c", type=int, default=3, metavar="N",
                   help="rollouts sampled per c and step on those pages (default 3)")
    return p.parse_args(None if argv is None else list(argv))


def main(argv: Iterable[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.out is None:
            if len(args.run_dirs) > 1:
                raise PlotError(f"--out is needed with {len(args.run_dirs)} run directories (one run's figures go "
                                "to RUN_DIR/plots by default)")
            args.out = Path(args.run_dirs[0]) / "plots"
        smooth, window = figure_options(args)
        if args.rollouts_per_c < 1:
            raise PlotError(f"--rollouts-per-c must be >= 1, got {args.rollouts_per_c}")
        rollout_steps = None
        if args.rollout_steps is not None:
            try:
                rollout_steps = [int(x) for x in args.rollout_steps.split(",")]
            except ValueError:
                raise PlotError(f"--rollout-steps {args.rollout_steps!r}: expected comma-separated step numbers, "
                                "e.g. 1,100,200") from None
        labels: list[str | None] = [None] * len(args.run_dirs)
        if args.labels is not None:
            labels = [s.strip() for s in args.labels.split(",")]
            if len(labels) != len(args.run_dirs) or not all(labels):
                raise PlotError(f"--labels gives {len(labels)} label(s) for {len(args.run_dirs)} run "
                                "director(y/ies); give one non-empty label per RUN_DIR")
        runs = [load_run(d, lab) for d, lab in zip(args.run_dirs, labels, strict=True)]
        _unique_labels(runs)
        warn_pre_split(runs)
        figures = render(runs, args.out, smooth, window, rollout_steps, args.rollouts_per_c)
    except (PlotError, ConfigError) as e:
        print(f"gapo-plot: error: {e}", file=sys.stderr)
        return Exit.CONFIG
    drawn = [n for n, f in figures.items() if f is not None]
    skipped = [n for n, f in figures.items() if f is None]
    print(f"gapo-plot: wrote {', '.join(drawn)} and index.md to {args.out}"
          + (f" (skipped {', '.join(skipped)}: no such metrics)" if skipped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
