"""What gapo-plot and gapo-compare share: a run directory's logged series (`Run`, `load_run`), windows of
steps, the exact clip totals per c, and the drawing conventions every figure follows (one style per run in
every figure, the legend below the panels, a step axis that spans the whole run).

Reads only `metrics.jsonl` and `config.yaml`, so it works on a live run, a finished one, or one copied off a
cluster, without torch or wandb.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Iterable
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

from gapo import rundir
from gapo.config import AlgorithmConfig
from gapo.configfile import read_yaml, resolve
from gapo.errors import ConfigError
from gapo.rundir import logged_cs, per_c

Series = list[tuple[int, float]]

# Lines whose label starts with "_" are left out of legends by matplotlib; the raw (unsmoothed) traces and
# reference lines use such labels, so "lines with a plain label" are exactly the runs' series.
RAW_PREFIX = "_raw "
REF_PREFIX = "_ref "



class PlotError(Exception):
    """A problem with the inputs that the user must fix; main() prints it and exits with status 2."""


Window = tuple[int | None, int | None]  # steps lo..hi, both included; None: open on that side
ALL_STEPS: Window = (None, None)


def parse_steps(spec: str | None) -> Window:
    """'A:B' -> steps A through B, both included; 'A:' and ':B' leave a side open; None or ':' -> all steps."""
    if spec is None:
        return ALL_STEPS
    lo, sep, hi = spec.partition(":")
    try:
        if not sep:
            raise ValueError
        window = (int(lo) if lo.strip() else None, int(hi) if hi.strip() else None)
    except ValueError:
        raise PlotError(f"--steps {spec!r}: expected A:B (integers, either may be left out), e.g. 100:400") from None
    if None not in window and window[0] > window[1]:
        raise PlotError(f"--steps {spec!r}: the first step is after the last")
    return window


def add_figure_options(p: argparse.ArgumentParser, smooth_help: str, steps_help: str) -> None:
    """--smooth N and --steps A:B, which gapo-plot and `gapo-compare seeds` both take (read with
    `figure_options`): one spelling and one check for both commands."""
    p.add_argument("--smooth", type=int, default=1, metavar="N", help=f"{smooth_help} (default 1: none)")
    p.add_argument("--steps", metavar="A:B", help=f"{steps_help}: steps A through B, both included, either side may "
                                                  "be left out (default: all steps)")


def figure_options(args: argparse.Namespace) -> tuple[int, Window]:
    """(smooth, window) of the options `add_figure_options` added, checked: a bad one is a PlotError naming it."""
    if args.smooth < 1:
        raise PlotError(f"--smooth must be >= 1, got {args.smooth}")
    return args.smooth, parse_steps(args.steps)


def in_window(step: int, window: Window) -> bool:
    lo, hi = window
    return (lo is None or step >= lo) and (hi is None or step <= hi)


def window_text(window: Window) -> str:
    lo, hi = window
    if lo is None:
        return "all steps" if hi is None else f"steps ≤ {hi}"
    return f"steps ≥ {lo}" if hi is None else f"steps {lo}–{hi}"


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
        return str(run_algorithm(self.config).get("name") or "?")

    @property
    def clip_range(self) -> str:
        return clip_range(self.config)

    @property
    def group_size(self) -> int | None:
        k = (self.config.get("rollout") or {}).get("group_size")
        return k if isinstance(k, int) else None


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


def run_config(run_dir: Path) -> dict:
    """A run's saved config.yaml as raw sections (not resolved: a run of an older gapo may hold keys this one
    dropped, and a figure only needs its labels and clip widths)."""
    path = run_dir / rundir.CONFIG
    if not path.is_file():
        print(f"gapo-plot: warning: {run_dir} has no {rundir.CONFIG}; labelling it by its directory name",
              file=sys.stderr)
        return {}
    try:
        cfg = read_yaml(path.read_text(encoding="utf-8"))
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
    metrics = run_dir / rundir.METRICS
    if not metrics.is_file():
        raise PlotError(f"run directory {str(run_dir)!r} has no {rundir.METRICS} (is it a gapo-train output_dir?)")
    records = parse_metrics(metrics)
    cfg = run_config(run_dir)
    series: dict[str, Series] = {}
    for step in sorted(records):
        for k, v in records[step].items():
            if v is not None and math.isfinite(v):
                series.setdefault(k, []).append((step, float(v)))
    if not records:
        print(f"gapo-plot: warning: {metrics} has no steps yet", file=sys.stderr)
    return Run(label=label or default_label(run_dir, cfg), path=run_dir, config=cfg, series=series,
               steps=sorted(records))


def run_algorithm(cfg: dict) -> dict:
    a = cfg.get("algorithm")
    return a if isinstance(a, dict) else {}


def algorithm_of(cfg: dict) -> AlgorithmConfig | None:
    """The run's algorithm as training resolved it (older runs' configs too), or None when its config.yaml is
    missing or holds no algorithm that resolves."""
    if not run_algorithm(cfg):
        return None
    try:
        # the run's plugins first: its clip rule may be one of theirs
        return resolve({"plugins": cfg.get("plugins") or [], "algorithm": run_algorithm(cfg)}).algorithm
    except ConfigError:
        return None


def clip_range(cfg: dict) -> str:
    """The run's AlgorithmConfig.clip_range as 'lower/upper' ('' when its config holds no algorithm)."""
    a = algorithm_of(cfg)
    return "/".join(a.clip_range) if a else ""


def default_label(run_dir: Path, cfg: dict) -> str:
    name = (cfg.get("tracking") or {}).get("run_name") or run_dir.resolve().name
    algo = run_algorithm(cfg).get("name")
    detail = " ".join(s for s in (algo, clip_range(cfg)) if s)
    return f"{name} ({detail})" if detail else str(name)


def bench_order(names: Iterable[str]) -> list[str]:
    """Benchmarks alphabetically, their mean last: the order of every table's and figure's benchmark columns."""
    return sorted(names, key=lambda b: (b == "mean", b))


def benchmarks(runs: list[Run], metric: str) -> list[str]:
    """The benchmarks some run validated with `metric` (logged as val/<benchmark>/<metric>), in bench_order."""
    key = re.compile(rf"^val/(.+)/{re.escape(metric)}$")
    return bench_order({m.group(1) for r in runs for k in r.series if (m := key.match(k))})


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


def run_style(i: int) -> dict:
    """Colour, dash pattern and marker per run, the same in every figure: runs that coincide (identical evals,
    a clip fraction stuck at 0) stay distinguishable, and so does a grayscale print."""
    return dict(color=matplotlib.colormaps["tab10"].colors[i % 10], linestyle=_LINESTYLES[i % len(_LINESTYLES)],
                marker=_MARKERS[i % len(_MARKERS)])


def plot_series(ax, pts: Series, label: str, i: int, smooth: int = 1, markers: bool | None = None) -> None:
    """Run number i on one axes: a faint raw trace under the smoothed line when smoothing, else one line.

    Markers on short series so that a metric logged at a single step (an eval, a rare c) is still visible.
    """
    if not pts:
        return
    x = np.array([p[0] for p in pts], dtype=float)
    y = np.array([p[1] for p in pts], dtype=float)
    style = run_style(i)
    if markers is None:
        markers = len(pts) <= 40
    if not markers:
        style["marker"] = None
    if smooth > 1 and len(pts) > 1:
        ax.plot(x, y, color=style["color"], alpha=0.25, linewidth=0.9, label=f"{RAW_PREFIX}{label}")
        y = moving_average(y, smooth)
    ax.plot(x, y, linewidth=1.7, markersize=4.5, markerfacecolor="none" if i % 2 else style["color"],
            label=label, **style)


def no_data(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} logged", transform=ax.transAxes, ha="center", va="center", color="0.5")


def finish(fig: Figure, runs: list[Run], title: str, smooth: int = 1, step_axis: bool = True) -> Figure:
    """One legend per figure, built from the runs (not from the axes) so it names every run even when a
    panel has no points for some of them; the legend sits below the panels so it never hides a curve."""
    steps = [s for r in runs for s in r.steps]
    for ax in fig.axes:
        if not step_axis:  # the caller set its own axis (c)
            continue
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if steps:  # every figure spans the whole training, so figures line up and sparse evals show where they fell
            pad = max(0.5, 0.02 * (max(steps) - min(steps)))
            ax.set_xlim(min(steps) - pad, max(steps) + pad)
    handles = [Line2D([], [], linewidth=2, label=r.label, **(run_style(i) | dict(marker=None)))
               for i, r in enumerate(runs)]
    width = fig.get_figwidth()
    per_entry = 1.2 + 0.075 * max((len(r.label) for r in runs), default=10)  # inches, at the legend's 10 pt
    fig.legend(handles=handles, loc="outside lower center", ncol=max(1, min(len(runs), int(width // per_entry))),
               frameon=False, handlelength=3)
    if smooth > 1:
        title += f"\n(per-step curves: moving average over {smooth} logged steps, raw values faint)"
    fig.suptitle(title, fontsize=12)
    return fig


def grid(n: int, max_cols: int, panel: tuple[float, float], sharey: bool = False) -> tuple[Figure, list]:
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


@dataclass(frozen=True)
class ClipTotals:
    """Sums over a window of steps for the correct rollouts of groups with one c, off-policy updates only."""

    clipped: float  # units whose gradient the upper bound removed
    units: float  # tokens under token IS, rollouts under sequence IS (each counted once per update)
    rollouts: float  # correct rollouts (each counted once per update)

    @property
    def frac(self) -> float:
        return self.clipped / self.units


def clip_totals(run: Run, window: Window = ALL_STEPS) -> dict[int, ClipTotals]:
    """c -> the window's clip totals, from the per-step sums `clip_hi/c{c}`, `clip_units/c{c}`, `n_correct/c{c}`.

    Their ratio is the window's exact clip fraction; a mean of the per-step `clip_frac/c{c}` would weigh a step
    with one such rollout like a step with a hundred. Runs logged before those sums existed give {}.
    """
    out: dict[int, ClipTotals] = {}
    for c in logged_cs("clip_units", run.series):
        per_step = {name: dict(run.get(per_c(name, c))) for name in ("clip_hi", "clip_units", "n_correct")}
        steps = [st for st in per_step["clip_units"] if in_window(st, window)]
        missing = [st for st in steps if st not in per_step["clip_hi"] or st not in per_step["n_correct"]]
        if missing:
            raise PlotError(f"{run.path / rundir.METRICS}: step {missing[0]} logs clip_units/c{c} without "
                            f"clip_hi/c{c} and n_correct/c{c}")
        units = sum(per_step["clip_units"][st] for st in steps)
        if units > 0:
            out[c] = ClipTotals(clipped=sum(per_step["clip_hi"][st] for st in steps), units=units,
                                rollouts=sum(per_step["n_correct"][st] for st in steps))
    return dict(sorted(out.items()))


def md_cell(s: str) -> str:
    return s.replace("|", "\\|")


