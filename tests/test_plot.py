"""gapo-plot on two hand-written run directories: figures, legends, resume/duplicate handling, windows of steps,
rollout pages, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gapo.clip import fmt_eps
from gapo.study.figures import PlotError, clip_totals, load_run, parse_steps
from gapo.study.plot import build_figures, main

PNG_SIG = b"\x89PNG\r\n\x1a\n"
ALL_PNGS = ("is_ratio_by_c.png", "clip_by_c.png", "clip_vs_c.png", "is_adv_corr.png", "val_pass.png", "coverage.png",
            "mismatch.png", "training.png")
K = 4  # group size: clip_frac/c1 .. c3


def _config(name: str, clip: str, lo: float, hi: float, run_name: str | None, out: Path) -> dict:
    return {"algorithm": {"name": name, "clip": clip, "eps_lo": lo, "eps_hi": hi, "eps_hi_max": hi},
            "rollout": {"group_size": K}, "trainer": {"output_dir": str(out)}, "tracking": {"run_name": run_name}}


def _record(step: int, offset: float, val: bool = True) -> dict:
    rec = {"step": step, "reward/mean": 0.1 + 0.02 * step + offset, "clip_frac": 0.01 * step,
           "clip_frac/high": 0.005 * step, "response/len_mean": 100.0 + step, "entropy": 1.0 - 0.01 * step,
           # undefined correlation early on (no rollout with A != 0): null, must not become a zero
           "is_adv_corr": None if step <= 2 else 0.3 + offset,
           "clip_frac/c1": 0.02 + offset, "clip_frac/c2": 0.04 + offset, "is_ratio/c1": 1.001,
           "all/clip_frac": 0.005 * step,
           # per-step sums behind clip_frac/c{c}: c = 1 clips one of 3 rollouts every 4th step; c = 2 has 10 + step
           # units of which 2 (run A) or 7 (run B) clipped
           "clip_hi/c1": 1.0 if step % 4 == 0 else 0.0, "clip_units/c1": 3.0, "n_correct/c1": 3.0,
           "clip_hi/c2": 2.0 + 100 * offset, "clip_units/c2": 10.0 + step, "n_correct/c2": 5.0,
           # the sampler-trainer mismatch, growing along the response
           "logprob_mismatch/kl_k3": 1e-4 * step,
           **{f"logprob_mismatch/pos{q}": 0.01 * q + offset for q in range(1, 6)}}
    if step % 3:  # c = 3 groups only at some steps
        rec["clip_frac/c3"] = 0.06 + offset
    if val and step in (4, 8, 12):
        rec |= {"val/aime24/pass@1": 0.1 + offset, "val/aime24/pass@16": 0.3 + offset,
                "val/math500/pass@1": 0.5, "val/math500/pass@16": 0.8,
                "val/mean/pass@1": 0.3 + offset, "val/mean/pass@16": 0.55 + offset,
                "val/aime24/coverage": 5 + step, "val/math500/coverage": 300 + step}
    return rec


def _write_run(d: Path, cfg: dict, records: list[dict]) -> Path:
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return d


@pytest.fixture
def runs(tmp_path: Path) -> tuple[Path, Path]:
    # Run A: a repeated step 6 whose later line wins, then a resume from step 9 (segment 2 re-logs 9..12).
    a_recs = [_record(s, 0.0) for s in range(1, 12)]
    a_recs.insert(6, _record(6, 0.0) | {"reward/mean": 0.999})  # later duplicate of step 6
    a_recs += [_record(s, 0.0) | {"entropy": 0.5} for s in range(9, 13)]
    a_recs[10]["stale_only_in_segment_1"] = 1.0  # the first segment's step 10: superseded by the resume
    assert a_recs[10]["step"] == 10
    a = _write_run(tmp_path / "a", _config("gapo", "adaptive", 3e-3, 5e-3, "gapo_run", tmp_path / "a"), a_recs)
    b = _write_run(tmp_path / "gspo_dir", _config("gspo", "fixed", 3e-3, 3e-3, None, tmp_path / "gspo_dir"),
                   [_record(s, 0.05) for s in range(1, 13)])
    return a, b


LABELS = ("gapo_run (gapo 3e-3/5e-3 adaptive)", "gspo_dir (gspo 3e-3/3e-3)")


def _series_lines(ax) -> list:
    """The runs' lines: raw (faint) traces and reference lines carry labels starting with '_'."""
    return [ln for ln in ax.get_lines() if not ln.get_label().startswith("_")]


def test_default_labels_and_loading(runs):
    a, b = (load_run(d) for d in runs)
    assert (a.label, b.label) == LABELS
    assert a.clip_range == "3e-3/5e-3 adaptive" and a.algorithm == "gapo"
    reward = dict(a.get("reward/mean"))
    assert reward[6] == 0.999  # the later line of a repeated step wins
    assert a.steps == list(range(1, 13))
    assert dict(a.get("entropy"))[10] == 0.5  # resumed segment's values
    assert "stale_only_in_segment_1" not in a.series  # dropped with the superseded segment
    corr = a.get("is_adv_corr")
    assert [s for s, _ in corr] == list(range(3, 13))  # null steps skipped, not zeros
    assert [s for s, _ in a.get("clip_frac/c3")] == [s for s in range(1, 13) if s % 3]


def test_cli_writes_pngs_and_index(runs, tmp_path, capsys):
    out = tmp_path / "plots"
    assert main([str(runs[0]), str(runs[1]), "--out", str(out), "--smooth", "3"]) == 0
    for name in ALL_PNGS:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_SIG), name
        assert len(data) > 10_000, name
    index = (out / "index.md").read_text()
    for name in ALL_PNGS:
        assert f"]({name})" in index
    for label in LABELS:
        assert label in index
    assert "0.999 (step 6)" not in index and "(step 12)" in index  # last reward/mean is step 12's
    assert "12 (1–12)" in index
    assert "wrote" in capsys.readouterr().out


@pytest.mark.parametrize("smooth", [1, 3])
def test_one_series_per_run_per_axes(runs, smooth):
    loaded = [load_run(d) for d in runs]
    figs = build_figures(loaded, smooth)
    assert set(figs) == set(ALL_PNGS) and all(f is not None for f in figs.values())
    for name, fig in figs.items():
        assert fig._suptitle is not None and fig._suptitle.get_text(), name
        assert [t.get_text() for t in fig.legends[0].get_texts()] == list(LABELS), name
        if name == "clip_vs_c.png":  # against c, not steps: test_clip_against_c_aggregates_counts_exactly
            continue
        axes = [ax for ax in fig.axes if ax.get_visible()]
        assert axes, name
        for ax in axes:
            lines = _series_lines(ax)
            assert sorted(ln.get_label() for ln in lines) == sorted(LABELS), (name, ax.get_title())
            assert ax.get_title(), name
            assert ax.get_ylabel() or not ax.get_subplotspec().is_first_col(), (name, ax.get_title())
            if smooth > 1 and name in ("clip_by_c.png", "is_adv_corr.png", "training.png"):
                raw = [ln for ln in ax.get_lines() if ln.get_label().startswith("_raw")]
                assert len(raw) == len(loaded), (name, ax.get_title())
        assert any(ax.get_xlabel() == "step" for ax in axes), name
    clip = figs["clip_by_c.png"]
    assert [ax.get_title().split(" (")[0] for ax in clip.axes if ax.get_visible()] == ["c = 1", "c = 2", "c = 3"]
    corr_ax = figs["is_adv_corr.png"].axes[0]
    for ln in _series_lines(corr_ax):
        assert min(ln.get_xdata()) == 3  # steps 1-2 were null
    assert "pass@16" in figs["val_pass.png"].axes[1].get_title()
    assert [ax.get_title() for ax in figs["coverage.png"].axes if ax.get_visible()] == ["aime24", "math500"]


def test_no_val_keys_skips_val_figures(tmp_path):
    d = _write_run(tmp_path / "r", _config("gapo", "adaptive", 0.2, 0.28, "tok", tmp_path / "r"),
                   [_record(s, 0.0, val=False) for s in range(1, 6)])
    out = tmp_path / "plots"
    out.mkdir()
    (out / "val_pass.png").write_bytes(PNG_SIG)  # stale output of an earlier call
    assert main([str(d), "--out", str(out), "--labels", "mine"]) == 0
    assert not (out / "val_pass.png").exists() and not (out / "coverage.png").exists()
    assert (out / "clip_by_c.png").exists()
    index = (out / "index.md").read_text()
    assert index.count("Not drawn:") == 2 and "rollouts_" not in index  # no rollouts.jsonl, no page
    assert "](val_pass.png)" not in index
    assert "| mine | gapo | 0.2/0.28 adaptive |" in index


def test_one_run_plots_into_its_own_folder_by_default(runs, capsys):
    """`gapo-plot RUN_DIR`, as docs/commands.md has it: RUN_DIR/plots; several runs need --out, and say so with gapo's
    exit code for a fix the user makes (errors.Exit.CONFIG)."""
    from gapo.errors import Exit

    assert main([str(runs[0])]) == 0
    assert (runs[0] / "plots" / "index.md").is_file() and (runs[0] / "plots" / "clip_by_c.png").is_file()
    assert main([str(runs[0]), str(runs[1])]) == Exit.CONFIG
    assert "--out is needed with 2 run directories" in capsys.readouterr().err


def test_missing_dir_and_missing_metrics(tmp_path, capsys):
    assert main([str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "nope" in capsys.readouterr().err
    (tmp_path / "empty_run").mkdir()
    assert main([str(tmp_path / "empty_run"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "empty_run" in err and "metrics.jsonl" in err


def test_malformed_line_names_file_and_line(tmp_path, capsys):
    d = tmp_path / "bad"
    d.mkdir()
    (d / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.1}\n{"step": 2}\n{"step": 3, "reward\n'
                                     '{"step": 4}\n')
    assert main([str(d), "--out", str(tmp_path / "o")]) == 2
    assert f"{d / 'metrics.jsonl'}:3" in capsys.readouterr().err
    (d / "metrics.jsonl").write_text('{"step": 1}\n{"reward/mean": 0.1}\n')
    assert main([str(d), "--out", str(tmp_path / "o")]) == 2
    assert "metrics.jsonl:2" in capsys.readouterr().err


def test_incomplete_last_line_of_live_run_is_skipped(tmp_path, capsys):
    d = tmp_path / "live"
    d.mkdir()
    (d / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.1}\n{"step": 2, "reward/me')
    run = load_run(d)
    assert run.steps == [1] and run.label == "live"  # no config.yaml: directory name
    assert "incomplete last line" in capsys.readouterr().err


def test_labels_count_must_match(runs, tmp_path, capsys):
    assert main([str(runs[0]), str(runs[1]), "--out", str(tmp_path / "o"), "--labels", "only_one"]) == 2
    assert "--labels" in capsys.readouterr().err


def test_fmt_eps():
    assert [fmt_eps(x) for x in (3e-3, 5.25e-3, 7e-5, 0.2, 0.28, 4.0)] == ["3e-3", "5.25e-3", "7e-5", "0.2", "0.28",
                                                                           "4"]


def test_python_m_entry_point_runs_main():
    """`python -m gapo.study.plot` reaches main (not only its parser): a missing run folder is named, with gapo's
    exit code for a fix the user makes."""
    from gapo.errors import Exit

    r = subprocess.run([sys.executable, "-m", "gapo.study.plot", "/nonexistent/run"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == Exit.CONFIG and "run directory '/nonexistent/run' does not exist" in r.stderr


def test_parse_steps():
    assert parse_steps(None) == (None, None) and parse_steps("4:9") == (4, 9)
    assert parse_steps("100:") == (100, None) and parse_steps(":50") == (None, 50) and parse_steps(":") == (None, None)
    for bad in ("4", "a:b", "9:4"):
        with pytest.raises(PlotError, match="--steps"):
            parse_steps(bad)


def test_clip_against_c_aggregates_counts_exactly(runs, tmp_path):
    a, b = (load_run(d) for d in runs)
    # Steps 4..9 of run A: c = 1 clips at steps 4 and 8 of 6 x 3 units; c = 2 clips 6 x 2 of sum(10 + s) units.
    t = clip_totals(a, (4, 9))
    assert sorted(t) == [1, 2]  # c = 3 logged no sums
    assert (t[1].clipped, t[1].units, t[1].rollouts) == (2.0, 18.0, 18.0)
    assert t[2].clipped == 12.0 and t[2].units == sum(10 + s for s in range(4, 10)) and t[2].rollouts == 30.0
    # The whole run counts each step once, although run A logged step 6 twice and steps 9-12 in two segments.
    whole = clip_totals(a)
    assert (whole[1].clipped, whole[1].rollouts) == (3.0, 36.0)
    fig = build_figures([a, b], window=(4, 9))["clip_vs_c.png"]
    ax, ax_n = fig.axes
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert sorted(lines) == sorted(LABELS)
    assert list(lines[LABELS[0]].get_xdata()) == [1, 2]
    assert list(lines[LABELS[0]].get_ydata()) == pytest.approx([2 / 18, 12 / 99])
    assert list(lines[LABELS[1]].get_ydata()) == pytest.approx([2 / 18, 6 * 7 / 99])
    heights = sorted(round(p.get_height()) for p in ax_n.patches)
    assert heights == [18, 18, 30, 30]
    assert "steps 4–9" in fig._suptitle.get_text()
    assert ax_n.get_xlabel().startswith("c")


def _rollout(step, c, adv, ratio, hi=0, lo=0, text="x", rank=0):
    return {"step": step, "rank": rank, "problem": f"p{c}", "text": text, "reward": float(adv > 0),
            "status": "correct" if adv > 0 else "wrong", "c": c, "k": K, "adv": adv,
            "eps_hi": 3e-3 + 2e-3 * (K - c) / (K - 1), "len": 12, "truncated": False,
            "updates": [{"is_ratio": ratio, "clip_hi_tokens": hi, "clip_lo_tokens": lo}]}


def test_rollout_pages(runs, tmp_path):
    a = runs[0]
    cfg = yaml.safe_load((a / "config.yaml").read_text())
    cfg["algorithm"]["is_level"] = "sequence"
    (a / "config.yaml").write_text(yaml.safe_dump(cfg))
    recs = []
    for step in (1, 2, 3):
        recs += [_rollout(step, 1, 0.75, 1.0071, hi=12, text="<script>alert('x')</script> & so on"),
                 _rollout(step, 1, -0.25, 0.9962, lo=12), _rollout(step, 1, -0.25, 1.001),
                 _rollout(step, 1, -0.25, 0.999)]
        # c = 3: five correct-or-wrong rollouts, one clipped; at most 3 shown
        recs += [_rollout(step, 3, 0.25, 1.0041, hi=12, rank=1)] + [_rollout(step, 3, 0.25, 1.001, rank=1)] * 2
        recs += [_rollout(step, 3, -0.75, 1.0, rank=1)] * 2
    (a / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "plots"
    assert main([str(a), str(runs[1]), "--out", str(out), "--rollout-steps", "1,3"]) == 0
    page_name = "rollouts_gapo_run_gapo_3e-3_5e-3_adaptive.html"
    assert sorted(p.name for p in out.glob("*.html")) == [page_name]  # run B has no rollouts.jsonl
    page = (out / page_name).read_text()
    assert f"]({page_name})" in (out / "index.md").read_text()
    assert "<script>" not in page and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; so on" in page
    assert page.count('<h2 id="step-') == 2 and 'id="step-1"' in page and 'id="step-3"' in page
    assert page.count("ratio 1.007100 · bound 1+ε_hi = 1.005 → <b class=\"clip\">clipped high</b>") == 2
    assert page.count("ratio 0.996200 · bound 1−ε_lo = 0.997 → <b class=\"clip\">clipped low</b>") == 2
    # c = 1 has 2 clipped and 2 kept rollouts: both clipped ones and one kept one are shown
    kept = [page.count(f"ratio {r} · bound 1−ε_lo = 0.997 → <b class=\"kept\">kept</b>") for r in ("1.001000",
                                                                                                "0.999000")]
    assert sum(kept) == 2
    assert page.count("c = 3 of k = 4 · ε_hi = 0.00366667 · 5 rollouts, 1 clipped · showing 3") == 2
    assert page.count("ratio 1.004100") == 2  # the clipped c = 3 rollout is always among those shown
    assert page.count("<tr class=") == 2 * (3 + 3) and page.count('<tr class="clipped">') == 2 * (2 + 1)
    # default steps: first, middle, last
    main([str(a), "--out", str(out)])
    assert (out / page_name).read_text().count('<h2 id="step-') == 3


@pytest.mark.parametrize("option, message", [(["--smooth", "0"], "--smooth must be >= 1, got 0"),
                                             (["--steps", "5:2"], "--steps '5:2': the first step is after the last")])
def test_plot_and_compare_seeds_read_smooth_and_steps_alike(tmp_path, capsys, option, message):
    """--smooth and --steps are one pair of options (gapo.study.figures.add_figure_options): gapo-plot and
    gapo-compare seeds refuse a bad value with the same words, before reading any run."""
    from gapo.study.compare import main as compare

    assert main([str(tmp_path / "a"), "--out", str(tmp_path / "out"), *option]) == 2
    assert compare(["seeds", "--out", str(tmp_path / "out"), f"x={tmp_path / 'a'},{tmp_path / 'b'}", *option]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"gapo-plot: error: {message}", f"gapo-compare: error: {message}"]
