"""gapo-plot: the paper's training-dynamics figures (§4.2) from run directories, several runs overlaid.

    gapo-plot RUN_DIR [RUN_DIR ...] --out DIR [--labels a,b] [--smooth N]

Reads only `metrics.jsonl` and `config.yaml`, so it works on a live run, a finished one, or one copied off a
cluster, without torch or wandb. Writes clip_by_c.png (Fig. 3), is_adv_corr.png (Fig. 5), val_pass.png
(Fig. 4), coverage.png (Fig. 8), training.png and an index.md that shows them with what to look for.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib
import numpy as np
import yaml

# Figures are built with the object API (no pyplot): Figure.savefig renders with Agg, so nothing needs a display
# and importing this module does not switch the backend of a notebook that uses it.
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

Series = list[tuple[int, float]]

# Lines whose label starts with "_" are left out of legends by matplotlib; the raw (unsmoothed) traces and
# reference lines use such labels, so "lines with a plain label" are exactly the runs' series.
RAW_PREFIX = "_raw "
REF_PREFIX = "_ref "

_CLIP_C = re.compile(r"^clip_frac/c(\d+)$")
_VAL_MEAN_PASS = re.compile(r"^val/mean/pass@(\d+)$")
_VAL_COVERAGE = re.compile(r"^val/(.+)/coverage$")


class PlotError(Exception):
    """A problem with the inputs that the user must fix; main() prints it and exits with status 2."""


@dataclass
class Run:
    """One run directory: its legend label, its resolved config and, per metric, the (step, value) points.

    `series` holds only defined values: null / NaN entries are dropped at load time so that no figure can
    plot them as zeros.
    """

    label: str
    path: Path
    config: dict
    series: dict[str, Series] = field(default_factory=dict)
    steps: list[int] = field(default_factory=list)

    def get(self, key: str) -> Series:
        return self.series.get(key, [])

    @property
    def algorithm(self) -> str:
        return str(_algo(self.config).get("name") or "?")

    @property
    def clip_range(self) -> str:
        return clip_range(self.config)

    @property
    def group_size(self) -> int | None:
        k = (self.config.get("rollout") or {}).get("group_size")
        return k if isinstance(k, int) else None


# ----------------------------------------------------------------------------------------------- loading


def parse_metrics(path: Path) -> dict[int, dict[str, float | None]]:
    """Step -> that step's metrics, with resumed segments resolved.

    A resumed run appends to the same file, so a line whose step is lower than the line before it starts a
    new segment: everything the earlier segment logged from that step on is superseded and dropped (it came
    from a trajectory that was thrown away). Lines with the same step inside a segment (e.g. a separate
    eval line, or a resume that repeats the last step) merge, the later value of each key winning.
    A last line without its newline is a write in progress on a live run; it is skipped with a warning.
    """
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    partial_last = not text.endswith("\n")
    records: dict[int, dict[str, float | None]] = {}
    prev: int | None = None
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
            step = obj.get("step")
            if not isinstance(step, int) or isinstance(step, bool):
                raise ValueError(f"'step' must be an integer, got {step!r}")
        except ValueError as e:  # json.JSONDecodeError is a ValueError
            if partial_last and lineno == len(lines):
                print(f"gapo-plot: warning: {path}:{lineno}: incomplete last line skipped (run still writing?)",
                      file=sys.stderr)
                continue
            raise PlotError(f"{path}:{lineno}: malformed line: {e}") from None
        if prev is not None and step < prev:
            records = {s: r for s, r in records.items() if s < step}
        prev = step
        rec = records.setdefault(step, {})
        for k, v in obj.items():
            if k == "step":
                continue
            if v is None or (isinstance(v, int | float) and not isinstance(v, bool)):
                rec[k] = v
    return records


def load_config(run_dir: Path) -> dict:
    path = run_dir / "config.yaml"
    if not path.is_file():
        print(f"gapo-plot: warning: {run_dir} has no config.yaml; labelling it by its directory name",
              file=sys.stderr)
        return {}
    try:
        cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise PlotError(f"{path}: not valid YAML: {e}") from None
    if cfg is None:
        return {}
    if not isinstance(cfg, dict):
        raise PlotError(f"{path}: expected a mapping of config sections, got {type(cfg).__name__}")
    return cfg


def load_run(run_dir: str | Path, label: str | None = None) -> Run:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise PlotError(f"run directory {str(run_dir)!r} does not exist")
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise PlotError(f"run directory {str(run_dir)!r} has no metrics.jsonl (is it a gapo-train output_dir?)")
    records = parse_metrics(metrics)
    cfg = load_config(run_dir)
    series: dict[str, Series] = {}
    for step in sorted(records):
        for k, v in records[step].items():
            if v is not None and math.isfinite(v):
                series.setdefault(k, []).append((step, float(v)))
    if not records:
        print(f"gapo-plot: warning: {metrics} has no steps yet", file=sys.stderr)
    return Run(label=label or default_label(run_dir, cfg), path=run_dir, config=cfg, series=series,
               steps=sorted(records))


def _algo(cfg: dict) -> dict:
    a = cfg.get("algorithm")
    return a if isinstance(a, dict) else {}


def fmt_eps(x: float) -> str:
    """Clip widths the way the paper writes them: 3e-3, 5.25e-3, 7e-5, but 0.2 and 0.28 as decimals."""
    if x == 0 or abs(x) >= 0.01:
        return f"{x:g}"
    mant, exp = f"{x:.4e}".split("e")
    return f"{mant.rstrip('0').rstrip('.')}e{int(exp)}"


def clip_range(cfg: dict) -> str:
    """'eps_lo/eps_hi' of a fixed clip, 'eps_lo/eps_hi_max' of an adaptive one (the paper's (lo, hi_max))."""
    a = _algo(cfg)
    lo = a.get("eps_lo")
    hi = a.get("eps_hi_max") if a.get("clip") == "adaptive" else a.get("eps_hi")
    if hi is None:
        hi = a.get("eps_hi_max")
    if not isinstance(lo, int | float) or not isinstance(hi, int | float):
        return ""
    return f"{fmt_eps(lo)}/{fmt_eps(hi)}"


def default_label(run_dir: Path, cfg: dict) -> str:
    name = (cfg.get("tracking") or {}).get("run_name") or run_dir.resolve().name
    algo = _algo(cfg).get("name")
    detail = " ".join(s for s in (algo, clip_range(cfg)) if s)
    return f"{name} ({detail})" if detail else str(name)


def _unique_labels(runs: list[Run]) -> None:
    """Two runs with one label would share a legend entry; number the repeats."""
    seen: dict[str, int] = {}
    for r in runs:
        seen[r.label] = seen.get(r.label, 0) + 1
        if seen[r.label] > 1:
            r.label = f"{r.label} #{seen[r.label]}"


# ---------------------------------------------------------------------------------------------- plotting


def moving_average(values: np.ndarray, n: int) -> np.ndarray:
    """Trailing mean over the last n logged points (fewer at the start): the smoothed curve starts with the data."""
    if n <= 1 or len(values) == 0:
        return values
    cs = np.concatenate([[0.0], np.cumsum(values)])
    hi = np.arange(1, len(values) + 1)
    lo = np.maximum(hi - n, 0)
    return (cs[hi] - cs[lo]) / (hi - lo)


_LINESTYLES = ("-", "--", "-.", ":")
_MARKERS = ("o", "s", "^", "D", "v", "P")


def _style(i: int) -> dict:
    """Colour, dash pattern and marker per run, the same in every figure: runs that coincide (identical evals,
    a clip fraction stuck at 0) stay distinguishable, and so does a grayscale print."""
    return dict(color=matplotlib.colormaps["tab10"].colors[i % 10], linestyle=_LINESTYLES[i % len(_LINESTYLES)],
                marker=_MARKERS[i % len(_MARKERS)])


def _plot_series(ax, pts: Series, label: str, i: int, smooth: int = 1, markers: bool | None = None) -> None:
    """Run number i on one axes: a faint raw trace under the smoothed line when smoothing, else one line.

    Markers on short series so that a metric logged at a single step (an eval, a rare c) is still visible.
    """
    if not pts:
        return
    x = np.array([p[0] for p in pts], dtype=float)
    y = np.array([p[1] for p in pts], dtype=float)
    style = _style(i)
    if markers is None:
        markers = len(pts) <= 40
    if not markers:
        style["marker"] = None
    if smooth > 1 and len(pts) > 1:
        ax.plot(x, y, color=style["color"], alpha=0.25, linewidth=0.9, label=f"{RAW_PREFIX}{label}")
        y = moving_average(y, smooth)
    ax.plot(x, y, linewidth=1.7, markersize=4.5, markerfacecolor="none" if i % 2 else style["color"],
            label=label, **style)


def _no_data(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} logged", transform=ax.transAxes, ha="center", va="center", color="0.5")


def _finish(fig: Figure, runs: list[Run], title: str, smooth: int = 1) -> Figure:
    """One legend per figure, built from the runs (not from the axes) so it names every run even when a
    panel has no points for some of them; the legend sits below the panels so it never hides a curve."""
    steps = [s for r in runs for s in r.steps]
    for ax in fig.axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if steps:  # every figure spans the whole training, so figures line up and sparse evals show where they fell
            pad = max(0.5, 0.02 * (max(steps) - min(steps)))
            ax.set_xlim(min(steps) - pad, max(steps) + pad)
    handles = [Line2D([], [], linewidth=2, label=r.label, **(_style(i) | dict(marker=None)))
               for i, r in enumerate(runs)]
    width = fig.get_figwidth()
    per_entry = 1.2 + 0.075 * max((len(r.label) for r in runs), default=10)  # inches, at the legend's 10 pt
    fig.legend(handles=handles, loc="outside lower center", ncol=max(1, min(len(runs), int(width // per_entry))),
               frameon=False, handlelength=3)
    if smooth > 1:
        title += f"\n(per-step curves: moving average over {smooth} logged steps, raw values faint)"
    fig.suptitle(title, fontsize=12)
    return fig


def _grid(n: int, max_cols: int, panel: tuple[float, float], sharey: bool = False) -> tuple[Figure, list]:
    cols = max(1, min(n, max_cols))
    rows = math.ceil(n / cols) if n else 1
    fig = Figure(figsize=(panel[0] * cols, panel[1] * rows + 1.0), layout="constrained")
    axes = fig.subplots(rows, cols, sharex=True, sharey=sharey, squeeze=False)
    flat = list(axes.flat)
    for ax in flat[n:]:
        ax.set_visible(False)
    for i, ax in enumerate(flat[:n]):
        if i + cols >= n:  # nothing visible below: this panel carries the step axis
            ax.xaxis.set_tick_params(labelbottom=True)
            ax.set_xlabel("step")
    return fig, flat[:n]


def clip_cs(runs: list[Run]) -> list[int]:
    """c = 1 .. k-1 from the configs' group size, plus any c the logs have (configs may be missing)."""
    cs = {int(m.group(1)) for r in runs for k in r.series if (m := _CLIP_C.match(k))}
    for r in runs:
        if r.group_size:
            cs.update(range(1, r.group_size))
    return sorted(cs)


def fig_clip_by_c(runs: list[Run], smooth: int = 1) -> Figure:
    """Fig. 3: one panel per c on a shared y axis, so both "GAPO vs fixed at a given c" (within a panel)
    and "low c vs high c" (across panels) can be read off directly."""
    cs = clip_cs(runs) or [1]
    fig, axes = _grid(len(cs), 4, (3.6, 2.8), sharey=True)
    k = max((r.group_size for r in runs if r.group_size), default=None)
    for ax, c in zip(axes, cs, strict=True):
        for i, r in enumerate(runs):
            _plot_series(ax, r.get(f"clip_frac/c{c}"), r.label, i, smooth)
        hint = " (scarcest correct)" if c == 1 else " (most abundant)" if k and c == k - 1 else ""
        ax.set_title(f"c = {c}{hint}", fontsize=10)
        if ax.get_subplotspec().is_first_col():
            ax.set_ylabel("clip fraction")
        if not any(r.get(f"clip_frac/c{c}") for r in runs):
            _no_data(ax, f"clip_frac/c{c}")
    return _finish(fig, runs, "Clip fraction of correct rollouts by group success count c (paper Fig. 3)", smooth)


def fig_is_adv_corr(runs: list[Run], smooth: int = 1) -> Figure:
    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.subplots()
    ax.axhline(0.0, color="0.6", linewidth=0.8, label=f"{REF_PREFIX}zero")
    for i, r in enumerate(runs):
        _plot_series(ax, r.get("is_adv_corr"), r.label, i, smooth)
    ax.set_xlabel("step")
    ax.set_ylabel("Pearson r (sequence IS ratio, advantage)")
    ax.set_title("over rollouts with A ≠ 0", fontsize=10)
    if not any(r.get("is_adv_corr") for r in runs):
        _no_data(ax, "is_adv_corr")
    return _finish(fig, runs, "IS ratio – advantage correlation (paper Fig. 5)", smooth)


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
        _plot_series(ax1, r.get("val/mean/pass@1"), r.label, i, markers=True)
        k = kmax[r.label]
        if k and k > 1:
            _plot_series(ax2, r.get(f"val/mean/pass@{k}"), r.label, i, markers=True)
    kname = f"pass@{ks[0]}" if len(ks) == 1 else "pass@k_max (k = " + ", ".join(map(str, ks)) + " by run)"
    ax1.set_title("pass@1, mean over benchmarks", fontsize=10)
    ax2.set_title(f"{kname}, mean over benchmarks", fontsize=10)
    for ax, what in ((ax1, "pass@1"), (ax2, kname if ks else "pass@k")):
        ax.set_xlabel("step")
        ax.set_ylabel(what)
    if not any(r.get("val/mean/pass@1") for r in runs):
        _no_data(ax1, "val/mean/pass@1")
    if not ks:
        _no_data(ax2, "val/mean/pass@k with k > 1")
    return _finish(fig, runs, "Validation pass@1 and pass@k (paper Fig. 4)")


def coverage_benchmarks(runs: list[Run]) -> list[str]:
    names = {m.group(1) for r in runs for k in r.series if (m := _VAL_COVERAGE.match(k))}
    return sorted(names, key=lambda b: (b == "mean", b))


def fig_coverage(runs: list[Run]) -> Figure | None:
    """Fig. 8: one panel per benchmark, since coverage counts problems and benchmarks differ in size."""
    benches = coverage_benchmarks(runs)
    if not benches:
        return None
    fig, axes = _grid(len(benches), 3, (4.6, 3.4))
    for ax, b in zip(axes, benches, strict=True):
        for i, r in enumerate(runs):
            _plot_series(ax, r.get(f"val/{b}/coverage"), r.label, i, markers=True)
        ax.set_title(b, fontsize=10)
        if ax.get_subplotspec().is_first_col():
            ax.set_ylabel("problems with solve rate > threshold")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    return _finish(fig, runs, "Problem coverage: problems with solve rate above the threshold (paper Fig. 8)")


TRAINING_PANELS = (("reward/mean", "mean reward"), ("response/len_mean", "mean response length (tokens)"),
                   ("entropy", "mean token entropy"), ("clip_frac", "clip fraction (all rollouts)"))


def fig_training(runs: list[Run], smooth: int = 1) -> Figure:
    fig, axes = _grid(len(TRAINING_PANELS), 2, (5.6, 3.4))
    for ax, (key, ylabel) in zip(axes, TRAINING_PANELS, strict=True):
        for i, r in enumerate(runs):
            _plot_series(ax, r.get(key), r.label, i, smooth)
        ax.set_title(key, fontsize=10)
        ax.set_ylabel(ylabel)
        if not any(r.get(key) for r in runs):
            _no_data(ax, key)
    return _finish(fig, runs, "Training curves", smooth)


@dataclass(frozen=True)
class FigureSpec:
    filename: str
    title: str
    caption: str  # what to look for
    build: Callable[[list[Run], int], Figure | None]
    missing: str = ""  # said on the index page when build() returns None


FIGURES = (
    FigureSpec("clip_by_c.png", "Clip fraction by c (Fig. 3)",
               "GAPO should clip the scarce correct rollouts of low-c groups less than fixed clipping does, "
               "and the abundant high-c ones at least as much.",
               fig_clip_by_c),
    FigureSpec("is_adv_corr.png", "IS–advantage correlation (Fig. 5)",
               "GAPO should keep the correlation high once clipping starts firing; fixed clipping lets it fall.",
               fig_is_adv_corr),
    FigureSpec("val_pass.png", "Validation pass@1 and pass@k (Fig. 4)",
               "GAPO should hold or exceed the baselines in pass@1 and, especially, pass@k late in training.",
               lambda runs, smooth: fig_val_pass(runs),
               "no validation pass@k in these runs (`val/mean/pass@{k}`; set `trainer.eval_every` > 0)."),
    FigureSpec("coverage.png", "Problem coverage (Fig. 8)",
               "GAPO should keep more problems above the solve-rate threshold, where baselines lose them.",
               lambda runs, smooth: fig_coverage(runs),
               "no coverage in these runs (`val/{benchmark}/coverage`; set `trainer.eval_every` > 0)."),
    FigureSpec("training.png", "Training curves",
               "Sanity checks: reward should rise, entropy should not collapse early, lengths should not blow "
               "up, the overall clip fraction shows when clipping starts firing.",
               fig_training),
)


def build_figures(runs: list[Run], smooth: int = 1) -> dict[str, Figure | None]:
    """Filename -> Figure (None where the runs lack the metrics); kept separate from saving for tests."""
    return {spec.filename: spec.build(runs, smooth) for spec in FIGURES}


# ------------------------------------------------------------------------------------------------ output


def _last(run: Run, key: str) -> str:
    pts = run.get(key)
    return f"{pts[-1][1]:.4g} (step {pts[-1][0]})" if pts else "–"


def _md_cell(s: str) -> str:
    return s.replace("|", "\\|")


def write_index(out: Path, runs: list[Run], figures: dict[str, Figure | None], smooth: int) -> Path:
    lines = ["# GAPO run plots", "", "| label | algorithm | clip | clip range | steps | last reward/mean | dir |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        steps = f"{len(r.steps)} ({r.steps[0]}–{r.steps[-1]})" if r.steps else "0"
        clip = str(_algo(r.config).get("clip") or "")
        cells = (r.label, r.algorithm, clip, r.clip_range, steps, _last(r, "reward/mean"), str(r.path))
        lines.append("| " + " | ".join(_md_cell(c) for c in cells) + " |")
    lines.append("")
    if smooth > 1:
        lines += [f"Per-step curves are smoothed (trailing mean over {smooth} logged steps); raw values are faint.",
                  ""]
    for spec in FIGURES:
        lines += [f"## {spec.title}", ""]
        if figures.get(spec.filename) is None:
            lines += [f"Not drawn: {spec.missing}", ""]
        else:
            lines += [f"![{spec.title}]({spec.filename})", "", spec.caption, ""]
    path = out / "index.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def render(runs: list[Run], out: Path, smooth: int = 1) -> dict[str, Figure | None]:
    out.mkdir(parents=True, exist_ok=True)
    figures = build_figures(runs, smooth)
    for name, fig in figures.items():
        if fig is None:
            (out / name).unlink(missing_ok=True)  # a stale image from an earlier call would contradict index.md
            continue
        fig.savefig(out / name, dpi=110)
    write_index(out, runs, figures, smooth)
    return figures


def parse_args(argv: Iterable[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gapo-plot", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (with metrics.jsonl)")
    p.add_argument("--out", required=True, type=Path, help="directory for the PNGs and index.md")
    p.add_argument("--labels", help="comma-separated legend labels, one per RUN_DIR, replacing the default "
                                    "'run_name (algorithm eps_lo/eps_hi)'")
    p.add_argument("--smooth", type=int, default=1, metavar="N",
                   help="moving average over N logged steps for per-step curves (default 1: none)")
    return p.parse_args(None if argv is None else list(argv))


def main(argv: Iterable[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.smooth < 1:
            raise PlotError(f"--smooth must be >= 1, got {args.smooth}")
        labels: list[str | None] = [None] * len(args.run_dirs)
        if args.labels is not None:
            labels = [s.strip() for s in args.labels.split(",")]
            if len(labels) != len(args.run_dirs) or not all(labels):
                raise PlotError(f"--labels gives {len(labels)} label(s) for {len(args.run_dirs)} run "
                                "director(y/ies); give one non-empty label per RUN_DIR")
        runs = [load_run(d, lab) for d, lab in zip(args.run_dirs, labels, strict=True)]
        _unique_labels(runs)
        figures = render(runs, args.out, args.smooth)
    except PlotError as e:
        print(f"gapo-plot: error: {e}", file=sys.stderr)
        return 2
    drawn = [n for n, f in figures.items() if f is not None]
    skipped = [n for n, f in figures.items() if f is None]
    print(f"gapo-plot: wrote {', '.join(drawn)} and index.md to {args.out}"
          + (f" (skipped {', '.join(skipped)}: no such metrics)" if skipped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
