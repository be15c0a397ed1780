"""gapo-compare table MANIFEST: the paper's table (or figure) from a sweep's evaluations, seeds aggregated.

Reads `<run>/eval/<protocol>/step_N/results.json` of every run and seed of the manifest (written by
`gapo-sweep MANIFEST --eval`, i.e. gapo-eval --run under the table's protocol) and, for the training-dynamics
figures, each run's metrics.jsonl. Writes `<output_root>/<manifest>/compare/`:

- table.md: the paper's layout (Tables 1-3, 8): one row per run, its clip range, the mean over the in-domain
  benchmarks and each benchmark (IFEval apart), each cell "pass@1 / pass@k" as its centre and 95 % interval
  over seeds (Student-t on the logit scale, df = seeds - 1, mapped back: within [0, 100] and around its centre;
  the paper's Table 6 gives mean ± t-interval, which can leave [0, 100] with three seeds), n when seeds are
  missing; then Table 7: for each pair in `compare.against`, the difference of the means of the first metric with
  a paired t-test by trainer.seed (* p < 0.05, ** p < 0.01, *** p < 0.001), or why there is no test;
- table.csv: the same numbers, one line per run x benchmark x metric (n, mean, centre, interval, the values);
- the manifest's figures (`compare.figures`).

A run or seed without its evaluation is a dash in the table and a line under "Missing", with the command that
makes it: a table half-built from a running sweep says what it still lacks.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from gapo import rundir
from gapo.configfile import load_config
from gapo.errors import ConfigError, out_folder
from gapo.study.figures import load_run, md_cell, run_style
from gapo.study.manifest import Job, Manifest, base_results, check_folders, jobs
from gapo.study.seed_figures import build_figures
from gapo.study.seeds import difference_cell
from gapo.study.stats import Estimate, ProportionEstimate, ci_half_width

IN_DOMAIN_MEAN = "mean"  # summary()'s average over the benchmarks other than IFEval


def results(m: Manifest, js: list[Job]) -> dict[tuple[str, int], dict[int, dict[str, float]]]:
    """(run, seed) -> step -> the evaluation's metrics (val/<bench>/pass@k, val/mean/pass@k, ...). A branch's
    steps up to its branch point are its parent's evaluations: the same checkpoint."""
    out: dict[tuple[str, int], dict[int, dict[str, float]]] = {}
    for j in js:
        for step in m.eval.steps:
            owner = j if step in j.own_steps(m.eval.steps) else j.parent
            f = owner.out / rundir.EVAL / m.protocol_name / rundir.step_name(step) / "results.json"
            if f.is_file():
                out.setdefault((j.run.name, j.seed), {})[step] = rundir.read_results(f, "metrics")
    return out


def benchmarks(found: dict) -> list[str]:
    names = {k.split("/")[1] for per_step in found.values() for mets in per_step.values() for k in mets
             if k.startswith("val/") and k.endswith("/pass@1")}
    return sorted(names - {IN_DOMAIN_MEAN, "ifeval"}, key=str) + \
        [IN_DOMAIN_MEAN] * (IN_DOMAIN_MEAN in names) + ["ifeval"] * ("ifeval" in names)


def estimates(m: Manifest, js: list[Job], found: dict, step: int, bench: str, k: int) -> dict[str, Estimate]:
    """Per run label, the seeds' pass@k on `bench` at `step` (seeds without it are left out: n says so)."""
    out = {}
    for r in m.runs:
        got = [(found[(r.name, j.seed)][step][f"val/{bench}/pass@{k}"], j.seed) for j in js
               if j.run.name == r.name and step in found.get((r.name, j.seed), {})
               and f"val/{bench}/pass@{k}" in found[(r.name, j.seed)][step]]
        out[r.label or r.name] = ProportionEstimate(tuple(v for v, _ in got), tuple(s for _, s in got))
    return out


def _cell(e: Estimate | None, seeds: int | None = None) -> str:
    """A pass@k cell in %: its centre and 95 % interval over seeds (within [0, 100], ProportionEstimate); n when a
    seed is missing."""
    if e is None or e.n == 0:
        return "–"
    missing = f" (n = {e.n} of {seeds})" if seeds and e.n < seeds else ""
    if e.n == 1:
        return f"{100 * e.centre:.1f}" + (missing or " (n = 1)")
    lo, hi = e.interval()
    return f"{100 * e.centre:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]{missing}"


def clip_range(js: list[Job], name: str) -> tuple[str, str]:
    j = next(j for j in js if j.run.name == name)
    return load_config(j.config, j.args).algorithm.clip_range


def write(m: Manifest, root: str | Path | None, out: Path | None = None) -> Path:
    js = jobs(m, root)
    check_folders(js)  # each row is labelled with the manifest's settings: its runs must have been trained with them
    found = results(m, js)
    step = max(m.eval.steps)
    benches = benchmarks(found)
    if not benches:  # an empty table would read as a result
        raise ConfigError(f"{m.name}: no evaluation found under {Path(root or m.output_root) / m.name} (step "
                          f"{', '.join(map(str, m.eval.steps))}, protocol {m.protocol_name}); run `gapo-sweep "
                          f"{m.name} --eval` first")
    out = out_folder(out or Path(root or m.output_root) / m.name / "compare", "--out")
    ks = m.compare.metrics
    labels = [r.label or r.name for r in m.runs]
    est = {(b, k): estimates(m, js, found, step, b, k) for b in benches for k in ks}
    shown = " / ".join(f"pass@{k}" for k in ks)
    lines = [f"# {m.title}", "", f"{m.produces}, from `{m.name}`: {shown} in % at step {step}, centre [95 % "
             f"interval] over seeds {', '.join(map(str, m.seeds))} (Student-t on the logit scale, df = seeds − 1, "
             f"within [0, 100]; n shown where seeds are missing); protocol `{m.protocol_name}`. "
             f"`{IN_DOMAIN_MEAN}` is the average over the in-domain benchmarks (the paper's Avg.).", ""]
    head = ["Method", "eps_lo", "eps_hi", *benches]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = []
    base = base_results(m, js) / "results.json"
    if m.base and base.is_file():
        got = rundir.read_results(base, "metrics")
        cells = [" / ".join(_cell(ProportionEstimate((got[f"val/{b}/pass@{k}"],))) if f"val/{b}/pass@{k}" in got
                            else "–"
                            for k in ks) for b in benches]
        lines.append("| " + " | ".join(["Base (before training)", "", "", *cells]) + " |")
    for r, label in zip(m.runs, labels, strict=True):
        lo, hi = clip_range(js, r.name)
        cells = [" / ".join(_cell(est[(b, k)][label], len(m.seeds)) for k in ks) for b in benches]
        lines.append("| " + " | ".join([md_cell(label), lo, hi, *cells]) + " |")
        for b in benches:
            for k in ks:
                e = est[(b, k)][label]
                lo, hi = e.interval() if e.n > 1 else ("", "")
                rows.append([label, b, f"pass@{k}", step, e.n, e.mean if e.n else "", e.centre if e.n else "", lo,
                             hi, " ".join(f"{v:.6g}" for v in e.values)])
    if m.compare.against:
        lines += ["", f"## Pairwise significance of pass@{ks[0]} (Table 7): Δ = ours − baseline, paired by seed "
                  "(the mean over the seeds both ran, its 95 % Student-t interval and the paired t-test's p: same-seed "
                  "runs share prompt order, sampling and evaluation seeds)", "",
                  "| Comparison | " + " | ".join(benches) + " |", "|" + "---|" * (len(benches) + 1)]
        for ours, theirs in m.compare.against.items():
            for base in theirs:
                cells = [difference_cell(est[(b, ks[0])][ours], est[(b, ks[0])][base], percent=True) for b in benches]
                lines.append(f"| {md_cell(ours)} vs {md_cell(base)} | " + " | ".join(cells) + " |")
    missing = [(j, s) for j in js for s in j.own_steps(m.eval.steps) if s not in found.get((j.run.name, j.seed), {})]
    if m.base and not base.is_file():
        lines += ["", f"The Base row is missing: {base.parent} has no results.json (`gapo-sweep {m.name} --eval`)."]
    if missing:
        lines += ["", "## Missing", "", f"{len(missing)} evaluations are not there yet (their cells are dashes or "
                  "have fewer seeds); `gapo-sweep " + m.name + " --eval` makes them:", ""]
        lines += [f"- {j.run.name} seed {j.seed}, step {s}: {j.out / rundir.EVAL / m.protocol_name}"
                  for j, s in missing]
    with open(out / "table.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method", "benchmark", "metric", "step", "seeds", "mean", "centre", "ci95_low", "ci95_high",
                    "values"])
        w.writerows(rows)
    figures = _figures(m, js, found, benches)
    if figures:
        lines += ["", "## Figures", ""]
        for name, fig in figures.items():
            if fig is not None:
                fig.savefig(out / name, dpi=110)
                lines += [f"![{name}]({name})", ""]
    path = out / "table.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _figures(m: Manifest, js: list[Job], found: dict, benches: list[str]) -> dict[str, Figure | None]:
    want = set(m.compare.figures)
    figs: dict[str, Figure | None] = {}
    groups = {}
    if want & {"is_ratio_by_c", "clip_vs_c", "is_adv_corr", "training"}:
        for r in m.runs:
            dirs = [j.out for j in js if j.run.name == r.name and (j.out / rundir.METRICS).is_file()]
            if dirs:
                groups[r.label or r.name] = [load_run(d, f"{r.label or r.name} seed {i}") for i, d in enumerate(dirs)]
        names = {"is_ratio_by_c": "is_ratio_by_c.png", "clip_vs_c": "clip_vs_c.png", "is_adv_corr": "is_adv_corr.png",
                 "training": "training.png"}
        built = build_figures(groups) if groups else {}
        figs.update({names[w]: built.get(names[w]) for w in want & set(names)})
    if "eval_over_steps" in want:
        figs["eval_over_steps.png"] = fig_over_steps(m, js, found, benches)
    if "coverage" in want:
        figs["coverage.png"] = fig_coverage(m, js, found, benches)
    if "vs_group_size" in want:
        figs["vs_group_size.png"] = fig_vs_group_size(m, js, found)
    if "branch" in want:
        figs["branch.png"] = fig_branch(m, js, found)
    return figs


def _band(ax, xs: list[float], per_x: list[list[float]], label: str, i: int) -> None:
    keep = [(x, v) for x, v in zip(xs, per_x, strict=True) if v]
    if not keep:
        return
    x = np.array([k[0] for k in keep], dtype=float)
    mean = np.array([np.mean(k[1]) for k in keep])
    half = np.nan_to_num(np.array([ci_half_width(k[1]) for k in keep]))
    style = run_style(i)
    ax.fill_between(x, mean - half, mean + half, color=style["color"], alpha=0.2, linewidth=0)
    ax.plot(x, mean, linewidth=1.7, markersize=5, label=label, **style)


def _series(m: Manifest, js: list[Job], found: dict, name: str, key: str) -> tuple[list[int], list[list[float]]]:
    steps = sorted(m.eval.steps)
    vals = [[found[(name, j.seed)][s][key] for j in js if j.run.name == name
             and key in found.get((name, j.seed), {}).get(s, {})] for s in steps]
    return steps, vals


def fig_over_steps(m: Manifest, js: list[Job], found: dict, benches: list[str]) -> Figure | None:
    """Fig. 4: pass@1 and pass@k (mean over in-domain benchmarks) at each evaluated checkpoint."""
    if IN_DOMAIN_MEAN not in benches:
        return None
    fig = Figure(figsize=(12, 4.8), layout="constrained")
    axes = fig.subplots(1, len(m.compare.metrics), squeeze=False)[0]
    for ax, k in zip(axes, m.compare.metrics, strict=True):
        for i, r in enumerate(m.runs):
            _band(ax, *_series(m, js, found, r.name, f"val/{IN_DOMAIN_MEAN}/pass@{k}"), r.label or r.name, i)
        ax.set_title(f"pass@{k}, mean over the in-domain benchmarks", fontsize=10)
        ax.set_xlabel("step")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncol=4, frameon=False)
    fig.suptitle(f"{m.title}: evaluation over training (paper Fig. 4)\n(mean over seeds ± 95 % CI, Student-t)")
    return fig


def fig_coverage(m: Manifest, js: list[Job], found: dict, benches: list[str]) -> Figure | None:
    """Fig. 8: per benchmark, the problems solved in more than 5 % of the evaluation's samples (gapo-eval's
    val/<bench>/coverage, at the protocol's n: 256 for Table 3) at each evaluated checkpoint."""
    cover = [b for b in benches if any(f"val/{b}/coverage" in mets for per in found.values() for mets in per.values())]
    if not cover:
        return None
    fig = Figure(figsize=(max(7.0, 4.2 * len(cover)), 4.6), layout="constrained")
    axes = fig.subplots(1, len(cover), squeeze=False)[0]
    for ax, b in zip(axes, cover, strict=True):
        for i, r in enumerate(m.runs):
            _band(ax, *_series(m, js, found, r.name, f"val/{b}/coverage"), r.label or r.name, i)
        ax.set_title(f"{b}: problems solved in > 5 % of samples", fontsize=10)
        ax.set_xlabel("step")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncol=4, frameon=False)
    axes[0].set_ylabel("problems")
    fig.suptitle(f"{m.title}\nproblem coverage over training (paper Fig. 8; mean over seeds ± 95 % CI, Student-t)",
                 fontsize=11)
    return fig


def fig_vs_group_size(m: Manifest, js: list[Job], found: dict) -> Figure | None:
    """Fig. 6: final pass@1 (in-domain mean) against the group size k, one line per method (the run's label
    before ' k=')."""
    step = max(m.eval.steps)
    series: dict[str, list[tuple[int, list[float]]]] = {}
    for r in m.runs:
        k = load_config(next(j for j in js if j.run.name == r.name).config,
                        next(j for j in js if j.run.name == r.name).args).rollout.group_size
        method = (r.label or r.name).split(" k=")[0]
        series.setdefault(method, []).append((k, _series(m, js, found, r.name, f"val/{IN_DOMAIN_MEAN}/pass@1")[1]
                                              [sorted(m.eval.steps).index(step)]))
    fig = Figure(figsize=(7, 4.8), layout="constrained")
    ax = fig.subplots()
    for i, (method, pts) in enumerate(series.items()):
        pts.sort()
        _band(ax, [p[0] for p in pts], [p[1] for p in pts], method, i)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("group size k")
    ax.set_ylabel(f"pass@1 at step {step}, in-domain mean")
    ax.legend(frameon=False)
    fig.suptitle(f"{m.title} (paper Fig. 6)\n(mean over seeds ± 95 % CI, Student-t)")
    return fig


def fig_branch(m: Manifest, js: list[Job], found: dict) -> Figure | None:
    """Fig. 7: from the branch point on, the parent and its branch: IS ratio-advantage correlation (training) and
    pass@k at the evaluated checkpoints."""
    branches = [r for r in m.runs if r.branch]
    if not branches:
        return None
    b = branches[0]
    at = b.branch.step
    fig = Figure(figsize=(13, 4.8), layout="constrained")
    ax_corr, *ax_k = fig.subplots(1, 1 + len(m.compare.metrics))
    for i, r in enumerate([m.run(b.branch.run), b]):
        per_step: dict[int, list[float]] = {}
        for j in (j for j in js if j.run.name == r.name and (j.out / rundir.METRICS).is_file()):
            for s, v in load_run(j.out).get("is_adv_corr"):
                if s >= at:
                    per_step.setdefault(s, []).append(v)
        steps = sorted(per_step)
        _band(ax_corr, steps, [per_step[s] for s in steps], r.label or r.name, i)
        for ax, k in zip(ax_k, m.compare.metrics, strict=True):
            xs, vals = _series(m, js, found, r.name, f"val/{IN_DOMAIN_MEAN}/pass@{k}")
            _band(ax, [x for x in xs if x >= at], [v for x, v in zip(xs, vals, strict=True) if x >= at],
                  r.label or r.name, i)
            ax.set_title(f"pass@{k}, in-domain mean", fontsize=10)
    ax_corr.set_title("IS ratio – advantage correlation", fontsize=10)
    for ax in (ax_corr, *ax_k):
        ax.set_xlabel("step")
    fig.legend(*ax_corr.get_legend_handles_labels(), loc="outside lower center", ncol=2, frameon=False)
    fig.suptitle(f"{m.title}: from the step-{at} checkpoint on (paper Fig. 7)\n(mean over seeds ± 95 % CI)")
    return fig
