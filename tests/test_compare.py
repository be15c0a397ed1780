"""gapo-compare on hand-written seeds of two labels: the intervals and tests against hand arithmetic, the
markdown cells, the figures, and the errors that name what to fix."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from scipy import optimize, special, stats

from gapo.evaluation import BenchResult, summary, write_results
from gapo.study.compare import main as cli
from gapo.study.seeds import load_groups, training_estimates
from gapo.study.stats import ci_half_width, welch

# Student-t quantile q with 2 degrees of freedom in closed form, (2q - 1) / sqrt(2q(1 - q)), at q = 0.975:
# 4.30265272975 (printed tables round it to 4.303).
T_975_DF2 = (2 * 0.975 - 1) / math.sqrt(2 * 0.975 * 0.025)
N = 4  # samples per problem; 4 problems per benchmark
# Final pass@1 per seed: correct samples out of 16 per benchmark.
FINAL = {"gapo": {"aime24": [4, 5, 6], "math500": [8, 10, 12]},
         "gspo": {"aime24": [2, 3, 2], "math500": [8, 9, 7]}}


def bb_profile_by_hand(counts, level: float = 0.95) -> tuple[float, float]:
    """The beta-binomial profile-likelihood interval of the mean rate, another way than gapo.study.seeds computes
    it: scipy's betabinom for the likelihood, its bounded optimizer for the intraclass correlation (on its logit,
    from a scan) and for the peak, brentq for where the deviance reaches the chi-square quantile."""
    e, u = (np.array(x, dtype=float) for x in zip(*counts, strict=True))
    q = stats.chi2.ppf(level, 1)

    def loglik(z, t):
        mu, s = special.expit(z), np.exp(-np.asarray(t, dtype=float))
        return stats.betabinom.logpmf(e[:, None], u[:, None], mu * s, (1 - mu) * s).sum(0)

    def profile(z):
        ts = np.linspace(-18, 12, 61)
        i = int(np.argmax(v := loglik(z, ts)))
        r = optimize.minimize_scalar(lambda t: -loglik(z, [t])[0], bounds=(ts[max(i - 1, 0)], ts[min(i + 1, 60)]),
                                     method="bounded", options={"xatol": 1e-6})
        return max(v[i], -r.fun)

    zs = np.linspace(-16, 16, 65)
    i = int(np.argmax([profile(z) for z in zs]))
    r = optimize.minimize_scalar(lambda z: -profile(z), bounds=(zs[max(i - 1, 0)], zs[min(i + 1, 64)]),
                                 method="bounded")
    zhat, top = r.x, -r.fun

    def dev(z):
        return 2 * (top - profile(z)) - q

    lo = 0.0 if e.sum() == 0 else float(special.expit(optimize.brentq(dev, -16, zhat, xtol=1e-8)))
    hi = 1.0 if e.sum() == u.sum() else float(special.expit(optimize.brentq(dev, zhat, 16, xtol=1e-8)))
    return lo, hi


def compare_seeds(argv: list[str]) -> int:
    """`gapo-compare seeds ...`, in process."""
    return cli(["seeds", *argv])


def test_the_command_is_named_not_guessed(tmp_path, capsys):
    """gapo-compare has two subcommands; one left out is a usage error naming them, not a guess from an "=" in the
    arguments (a manifest path may hold one, and a run directory too)."""
    with pytest.raises(SystemExit) as stop:
        cli(["--out", str(tmp_path), "gapo=a,b", "gspo=c,d"])
    assert stop.value.code == 2 and "{table,seeds,band}" in capsys.readouterr().err
    assert cli(["table", str(tmp_path / "a=b.yaml")]) == 2  # a manifest, however it is named


def _bench(name: str, total_correct: int) -> BenchResult:
    per = [total_correct // 4 + (1 if i < total_correct % 4 else 0) for i in range(4)]  # spread over 4 problems
    return BenchResult(name=name, n=N, correct=per, uids=[f"{name}-{i}" for i in range(4)], statuses={})


def _write_seed(d: Path, algo: str, seed: int, benches: tuple[str, ...] = ("aime24", "math500")) -> Path:
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump({"algorithm": {"name": algo, "clip": "fixed", "eps_lo": 3e-3,
                                                                 "eps_hi": 5e-3}, "rollout": {"group_size": 4},
                                                   "trainer": {"seed": seed}}))
    lines = []
    for step in range(0, 11):
        if step:
            lines.append({"step": step, "reward/mean": 0.2 + 0.01 * step, "entropy": 1 - 0.01 * step + 0.1 * seed,
                          "clip_frac": 0.1, "is_adv_corr": 0.5, "all/clip_frac": 0.05,
                          # c = 1: one of 4 + seed units clipped at the steps with (step + seed) % 3 == 0
                          "clip_frac/c1": float((step + seed) % 3 == 0) / (4 + seed), "is_ratio/c1": 1.0 + 0.001 * step,
                          "clip_hi/c1": float((step + seed) % 3 == 0), "clip_units/c1": 4.0 + seed,
                          "n_correct/c1": 4.0 + seed})
        if step % 5 == 0:  # validation as the loop logs it: a line of summary() after the step's, also in val/
            results = [_bench(b, FINAL[algo][b][seed] if step == 10 else 1 + step // 5) for b in benches]
            write_results(results, d / "val" / f"step_{step:06d}", {"step": step})
            lines.append({"step": step, **summary(results)})
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return d


@pytest.fixture
def seeds(tmp_path: Path) -> dict[str, list[Path]]:
    return {algo: [_write_seed(tmp_path / f"{algo}_s{s}", algo, s) for s in range(3)] for algo in ("gapo", "gspo")}


def _group_args(seeds: dict[str, list[Path]]) -> list[str]:
    return [f"{algo}={','.join(map(str, dirs))}" for algo, dirs in seeds.items()]


def test_ci_half_width_is_student_t():
    # values 0.25, 0.3125, 0.375: mean 0.3125, sample sd 0.0625
    assert ci_half_width([0.25, 0.3125, 0.375]) == pytest.approx(T_975_DF2 * 0.0625 / math.sqrt(3), rel=1e-12)
    assert math.isnan(ci_half_width([0.3]))


def test_welch_by_hand():
    a, b = [0.25, 0.3125, 0.375], [0.125, 0.1875, 0.125]
    va, vb = 0.0625**2, ((0.125 - 0.4375 / 3) ** 2 * 2 + (0.1875 - 0.4375 / 3) ** 2) / 2
    se2 = va / 3 + vb / 3
    t_hand = (0.3125 - 0.4375 / 3) / math.sqrt(se2)
    df_hand = se2**2 / ((va / 3) ** 2 / 2 + (vb / 3) ** 2 / 2)
    t, df, p = welch(a, b)
    assert t == pytest.approx(t_hand, rel=1e-12) and df == pytest.approx(df_hand, rel=1e-12)
    assert p == pytest.approx(2 * stats.t.sf(t_hand, df_hand), rel=1e-9)
    assert all(math.isnan(x) for x in welch([0.5, 0.5], [0.5, 0.5]))  # no spread on either side: undefined


def logit_cell(fracs: list[float]) -> str:
    """A pass@1 cell by hand: the back-transformed mean logit and the Student-t interval on the logit scale, in %."""
    z = [math.log(p / (1 - p)) for p in fracs]
    zm = sum(z) / len(z)
    h = T_975_DF2 * math.sqrt(sum((x - zm) ** 2 for x in z) / 2) / math.sqrt(3)
    c, lo, hi = (100 / (1 + math.exp(-(zm + d))) for d in (0, -h, h))
    assert lo < c < hi
    return f"{c:.2f} [{lo:.2f}, {hi:.2f}] (n = 3)"


def test_report_cells_and_figures(seeds, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert compare_seeds(["--out", str(out), "--steps", "3:8", *_group_args(seeds)]) == 0
    md = (out / "compare.md").read_text()
    val = md.split("## Final validation")[1].split("## Training")[0]
    # aime24 final pass@1: gapo 4, 5, 6 of 16 -> 0.25, 0.3125, 0.375; gspo 2, 3, 2 of 16
    gspo = [2 / 16, 3 / 16, 2 / 16]
    gapo_row = val.split("\n| gapo | ")[1].split("\n")[0]
    assert gapo_row.startswith(logit_cell([0.25, 0.3125, 0.375]) + " | ")
    gspo_row = val.split("\n| gspo | ")[1].split("\n")[0]
    assert gspo_row.startswith(logit_cell(gspo) + " | ")
    # math500: gapo 0.5, 0.625, 0.75 (mean 62.50, logit centre 63.10); the mean column averages the two benchmarks
    assert f"| {logit_cell([0.5, 0.625, 0.75])} |" in gapo_row
    assert "| label | aime24 | math500 | mean |" in val
    # Δ on aime24 paired by trainer.seed: d = 4/16 - 2/16, 5/16 - 3/16, 6/16 - 2/16 = 0.125, 0.125, 0.25;
    # mean 1/6; deviations -1/24, -1/24, 1/12 (paired t p = 0.057: no star, where Welch's unpaired test gave one)
    d = [0.125, 0.125, 0.25]
    sd = math.sqrt(sum((x - 1 / 6) ** 2 for x in d) / 2)
    h = T_975_DF2 * sd / math.sqrt(3)
    p = 2 * stats.t.sf((1 / 6) / (sd / math.sqrt(3)), 2)
    assert 0.05 < p < 0.06
    assert (f"| gapo vs gspo | +{100 / 6:.2f} [{100 * (1 / 6 - h):+.2f}, +{100 * (1 / 6 + h):.2f}] (p = {p:.2g}, "
            f"3 pairs) |") in val
    assert "At step 10 " in md
    # Training window 3..8: c = 1 clips at 2 of the 6 steps for every seed, of 4 + seed units each step.
    # Per c: the pooled fraction (6 clips in 90 decisions) and its seed-clustered standard error, Student-t on
    # the logit scale: Var = n/(n-1) sum (e_i - p u_i)^2 / U^2, half-width t * se / (p (1 - p)), mapped back.
    # The interval is the hull of that one, Clopper-Pearson on 6 of 90 and the beta-binomial profile interval.
    units = [6 * (4 + s) for s in range(3)]
    centre = 6 / sum(units)
    se = math.sqrt(3 / 2 * sum((2 - centre * u) ** 2 for u in units)) / sum(units)
    zm, h = math.log(centre / (1 - centre)), T_975_DF2 * se / (centre * (1 - centre))
    lo, hi = (1 / (1 + math.exp(-(zm + d))) for d in (-h, h))
    cp_lo, cp_hi = stats.beta.ppf(0.025, 6, 85), stats.beta.ppf(0.975, 7, 84)
    bb_lo, bb_hi = bb_profile_by_hand([(2, u) for u in units])
    lo, hi = min(lo, cp_lo, bb_lo), max(hi, cp_hi, bb_hi)
    assert lo < centre < hi
    assert f"{centre:.4g} [{lo:.4g}, {hi:.4g}] (n = 3)" in md
    # the pooled counts: c = 1 is low c (k = 4); the same clips per seed on both sides: odds ratio 1, no difference
    pooled = md.split("## Clip counts pooled over seeds")[1]
    assert "assumes independent decisions" in md.split("## Clip counts pooled over seeds")[1].split("\n")[0]
    assert "| gapo vs gspo | low | 3 | 6 / 90 | 6 / 90 | 1 [" in pooled and "| 0 | 1 | 1 (does not survive) |" in pooled
    assert ("| gapo vs gspo | high | 3 | 0 / 0 | 0 / 0 | – | – | (no stratum with both outcomes: no test) | – |"
            in pooled)
    # the interaction: no high-c decisions in these runs, so no seed has a contrast
    inter = md.split("## The c × rule interaction")[1].split("## Clip counts")[0]
    assert "| gapo − gspo | 0 | – | – | (no test: fewer than 2 pairs) | – | – |" in inter
    assert "steps 3–8" in md
    for name in ("is_ratio_by_c.png", "clip_by_c.png", "clip_vs_c.png", "is_adv_corr.png", "val_pass.png",
                 "coverage.png", "training.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"]({name})" in md
    assert "wrote" in capsys.readouterr().out


def test_window_metrics_are_per_seed_means(seeds):
    groups = load_groups(_group_args(seeds))
    metrics, est = training_estimates(groups, (3, 8))
    assert metrics[:2] == ["reward/mean", "entropy"] and "clip_frac/c1" in metrics
    # entropy at step s, seed j: 1 - 0.01 s + 0.1 j; steps 3..8 average to s = 5.5
    assert est["gapo"]["entropy"].values == pytest.approx([1 - 0.055 + 0.1 * j for j in range(3)])
    assert est["gspo"]["clip_frac/c1"].values == pytest.approx([2 / (6 * (4 + j)) for j in range(3)])


def test_val_step_option(seeds, tmp_path):
    out = tmp_path / "cmp"
    assert compare_seeds(["--out", str(out), "--val-step", "5", *_group_args(seeds)]) == 0
    md = (out / "compare.md").read_text()
    # at step 5 every seed solved 2 of 16 on each benchmark: no spread, and no test
    assert "| gapo | 12.50 [12.50, 12.50] (n = 3) | 12.50 [12.50, 12.50] (n = 3) | 12.50 [12.50, 12.50] (n = 3) |" in md
    assert "+0.00 (3 pairs: identical in every pair; no test)" in md
    assert compare_seeds(["--out", str(out), "--val-step", "7", *_group_args(seeds)]) == 2


def test_one_run_label_is_refused(seeds, tmp_path, capsys):
    assert compare_seeds(["--out", str(tmp_path / "o"), f"gapo={seeds['gapo'][0]}", _group_args(seeds)[1]]) == 2
    err = capsys.readouterr().err
    assert "'gapo'" in err and "one run" in err and "two" in err


def test_run_without_metrics_is_named(seeds, tmp_path, capsys):
    empty = tmp_path / "empty_seed"
    empty.mkdir()
    args = [f"gapo={seeds['gapo'][0]},{empty}", _group_args(seeds)[1]]
    assert compare_seeds(["--out", str(tmp_path / "o"), *args]) == 2
    err = capsys.readouterr().err
    assert "'gapo'" in err and "empty_seed" in err and "metrics.jsonl" in err


def test_mismatched_benchmarks_are_refused(seeds, tmp_path, capsys):
    odd = _write_seed(tmp_path / "gspo_odd", "gspo", 0, benches=("aime24",))
    args = [_group_args(seeds)[0], f"gspo={seeds['gspo'][1]},{odd}"]
    assert compare_seeds(["--out", str(tmp_path / "o"), *args]) == 2
    err = capsys.readouterr().err
    assert "gspo_odd" in err and "mismatched benchmarks" in err and "math500" in err


def test_bad_group_argument(tmp_path, capsys):
    assert compare_seeds(["--out", str(tmp_path / "o"), "no_equals_sign", "x=a,b"]) == 2
    assert "LABEL=RUN_DIR" in capsys.readouterr().err


def test_a_clip_fractions_interval_stays_within_zero_and_one():
    """Three seeds that disagree: the Student-t interval of the fractions themselves leaves [0, 1] (the
    laptop experiment's figure once drew a bar to 1.75); the logit-scale one cannot."""
    from gapo.study.stats import ProportionEstimate, ci_half_width

    fracs, counts = (0.0, 0.9, 0.05), ((0, 20), (18, 20), (1, 20))
    assert sum(fracs) / 3 + ci_half_width(fracs) > 1
    lo, hi = ProportionEstimate(fracs, counts=counts).interval()
    assert 0 < lo < sum(fracs) / 3 < hi < 1
    assert all(math.isnan(x) for x in ProportionEstimate((0.5,)).interval())  # undefined below two seeds


@pytest.mark.parametrize("values, counts", [
    ((0.5, 0.5, 0.5), ()),  # a constant group: the value itself, zero width
    ((0.0, 0.01, 0.0), ()),  # near 0, exact zeros among the seeds
    ((1.0, 0.99, 1.0), ()),  # near 1
    ((0.2, 0.3), ()),  # a missing seed: two of three
    ((0.01,) * 9 + (0.9,), ()),  # one seed far from the others: the plain mean (0.099) left the old interval
    ((0.0, 0.1, 1.0), ((0, 40), (4, 40), (40, 40))),  # counts at both ends
])
def test_every_fraction_cell_has_its_centre_inside_its_interval_inside_zero_one(values, counts):
    from gapo.study.seeds import estimate_cell
    from gapo.study.stats import ProportionEstimate

    e = ProportionEstimate(values, counts=counts)
    lo, hi = e.interval()
    assert 0.0 <= lo <= e.centre <= hi <= 1.0, (lo, e.centre, hi)
    if len(set(values)) == 1:
        assert lo == e.centre == hi == values[0]
    cell = estimate_cell(e, percent=True, expected=3)
    assert cell.endswith(f"(n = {len(values)} of 3)" if len(values) < 3 else f"(n = {len(values)})"), cell


def test_welchs_degenerate_cases_are_said_in_words():
    from gapo.study.seeds import difference_cell
    from gapo.study.stats import ProportionEstimate, significance

    assert significance([0.5, 0.5], [0.5, 0.5]) == "(no spread on either side: identical)"
    assert "every seed differs the same way; no test" in significance([1.0, 1.0, 1.0], [0.5, 0.5, 0.5])
    assert significance([0.3], [0.2, 0.1]) == "(n < 2: no test)"
    assert significance([0.5, 0.5, 0.5], [0.1, 0.2, 0.3]) == "* (p = 0.035)"  # one side constant: testable
    cell = difference_cell(ProportionEstimate((1.0, 1.0)), ProportionEstimate((0.5, 0.5)), percent=True)
    assert cell.startswith("+50.00 unpaired (no spread on either side")  # hand-built: no seeds to pair


def test_cmh_on_one_stratum_by_hand_and_on_identical_arms():
    from gapo.study.stats import cmh

    # 10 of 50 clipped against 2 of 50: E = 50 * 12 / 100 = 6, Var = 50 * 50 * 12 * 88 / (100^2 * 99) = 8/3,
    # chi2 = (|10 - 6| - 0.5)^2 / (8/3) = 4.59375; Mantel-Haenszel odds ratio (10 * 48 / 100) / (2 * 40 / 100) = 6
    odds, chi2, p = cmh([(10, 50, 2, 50)])
    assert odds == pytest.approx(6.0) and chi2 == pytest.approx(4.59375)
    assert p == pytest.approx(stats.chi2.sf(4.59375, 1)) and p < 0.05
    odds, chi2, p = cmh([(3, 30, 3, 30), (5, 20, 5, 20)])
    assert odds == pytest.approx(1.0) and chi2 == 0.0 and p == 1.0
    assert all(math.isnan(x) for x in cmh([(0, 10, 0, 12)]))  # no clip anywhere: nothing to test


def test_a_clip_fraction_per_c_is_pooled_over_seeds_with_a_seed_clustered_interval():
    """1 clip in 25 decisions, 4 of 5 seeds at 0: a per-seed continuity-corrected logit drew it as 0.11 [0.06, 0.21],
    excluding both 0 and its own pooled value. The pooled fraction is 1/25; by hand, the clustered variance is
    5/4 * ((1 - 0.2)^2 + 4 * 0.2^2) / 25^2 = 0.0016, se 0.04, and on the logit scale the half-width is
    t(0.975, 4) * 0.04 / (0.04 * 0.96)."""
    from scipy import stats

    from gapo.study.stats import ProportionEstimate

    counts = ((1, 5), (0, 5), (0, 5), (0, 5), (0, 5))
    e = ProportionEstimate(tuple(c / u for c, u in counts), counts=counts)
    assert e.centre == pytest.approx(0.04)
    h = stats.t.ppf(0.975, 4) * 0.04 / (0.04 * 0.96)
    mid = math.log(0.04 / 0.96)
    lo, hi = e.interval()
    clustered = (1 / (1 + math.exp(-(mid - h))), 1 / (1 + math.exp(-(mid + h))))
    exact = (stats.beta.ppf(0.025, 1, 25), stats.beta.ppf(0.975, 2, 24))  # Clopper-Pearson, 1 of 25
    profile = bb_profile_by_hand(counts)
    assert (lo, hi) == pytest.approx((min(clustered[0], exact[0], profile[0]),
                                      max(clustered[1], exact[1], profile[1])), rel=1e-4)
    assert 0 < lo < 0.01 and 0.04 < hi < 0.5
    # Seeds with different numbers of decisions weigh by their decisions, not one vote each.
    e = ProportionEstimate((1.0, 0.0), counts=((1, 1), (0, 99)))
    assert e.centre == pytest.approx(0.01)


# ------------------------------------------------------------------ pairing by seed, the interaction, coverage


def test_a_missing_seed_pairs_the_rest_by_seed_not_by_position(seeds, tmp_path):
    """gspo's seed 1 is missing: pairing by list position (zip) would set gapo's seed 1 against gspo's seed 2 and
    shift the pairs; by trainer.seed, seeds 0 and 2 pair. aime24: gapo 4/16 and 6/16 against gspo 2/16 and 2/16:
    d = 0.125, 0.25, mean 0.1875 (position would give 0.125, 0.1875: mean 0.15625)."""
    import shutil

    shutil.rmtree(seeds["gspo"].pop(1))
    out = tmp_path / "cmp"
    assert compare_seeds(["--out", str(out), *_group_args(seeds)]) == 0
    md = (out / "compare.md").read_text()
    val = md.split("## Final validation")[1].split("## Training")[0]
    row = val.split("\n| gapo vs gspo | ")[1].split(" | ")[0]
    assert row.startswith("+18.75 [") and row.endswith("2 pairs)"), row
    pooled = md.split("## Clip counts pooled over seeds")[1]
    assert "| gapo vs gspo | low | 2 |" in pooled  # two strata: the seeds both ran
    assert "| gspo | 2 | 0, 2 |" in md  # the runs table names the seeds


def test_a_seed_twice_in_one_label_is_refused(seeds):
    from gapo.study.seeds import CompareError

    twice = f"gapo={seeds['gapo'][0]},{seeds['gapo'][0]}"
    with pytest.raises(CompareError, match="both ran trainer.seed 0"):
        load_groups([twice, f"gspo={','.join(map(str, seeds['gspo']))}"])


def _write_clips(d: Path, algo: str, seed: int, low: tuple[int, int], high: tuple[int, int]) -> Path:
    """A run with k = 4 whose one step clipped low[0] of low[1] correct decisions at c = 1 and high[0] of high[1]
    at c = 3."""
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump({"algorithm": {"name": algo}, "rollout": {"group_size": 4},
                                                   "trainer": {"seed": seed}}))
    rec = {"step": 1, "clip_hi/c1": low[0], "clip_units/c1": low[1], "n_correct/c1": low[1],
           "clip_hi/c3": high[0], "clip_units/c3": high[1], "n_correct/c3": high[1]}
    (d / "metrics.jsonl").write_text(json.dumps(rec) + "\n")
    return d


def test_the_c_by_rule_interaction_is_paired_by_seed(tmp_path):
    """Contrast = low-c minus high-c clip fraction per seed; interaction = difference of contrasts at one seed.
    gapo: low 1/10, 2/10, 1/10 against high 5/10: contrasts -0.4, -0.3, -0.4; gspo: low 5/10, 6/10, 4/10 against
    high 5/10: 0, +0.1, -0.1. Interactions -0.4, -0.4, -0.3: mean -0.3667; every sign negative, so the exact
    sign-flip p is 2/8 = 0.25, the smallest three pairs allow."""
    from gapo.study.seeds import interaction_table
    from gapo.study.stats import sign_flip_p

    g = {"gapo": [_write_clips(tmp_path / f"a{s}", "gapo", s, (lo, 10), (5, 10)) for s, lo in enumerate((1, 2, 1))],
         "gspo": [_write_clips(tmp_path / f"b{s}", "gspo", s, (lo, 10), (5, 10)) for s, lo in enumerate((5, 6, 4))]}
    groups = load_groups([f"{k}={','.join(map(str, v))}" for k, v in g.items()])
    md = "\n".join(interaction_table(groups, (None, None)))
    d = [-0.4, -0.4, -0.3]
    m, sd = sum(d) / 3, math.sqrt(sum((x - sum(d) / 3) ** 2 for x in d) / 2)
    p = 2 * stats.t.sf(abs(m) / (sd / math.sqrt(3)), 2)
    assert "| gapo | 0: -0.400, 1: -0.300, 2: -0.400 |" in md
    h = T_975_DF2 * sd / math.sqrt(3)
    cell = f"{m:+.3f} [{m - h:+.3f}, {m + h:+.3f}] | {p:.2g}"
    assert f"| gapo − gspo | 3 | 0: -0.400, 1: -0.400, 2: -0.300 | {cell}" in md
    assert "| 0.25 | " in md and "Holm (1 tests)" in md
    assert sign_flip_p([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(0.0625)  # 5 pairs, all one way: 2 / 32


def test_holm_by_hand():
    from gapo.study.stats import holm

    # sorted 0.01, 0.02, 0.04 -> 3 * 0.01, max(0.03, 2 * 0.02), max(0.04, 1 * 0.04); NaN is not a test
    assert holm([0.04, 0.01, float("nan"), 0.02]) == pytest.approx([0.04, 0.03, float("nan"), 0.04], nan_ok=True)


def test_mh_odds_interval_on_one_stratum_is_woolfs():
    """With one stratum the Robins-Breslow-Greenland variance reduces to Woolf's 1/a + 1/b + 1/c + 1/d."""
    from gapo.study.stats import mh_odds_interval

    lo, hi = mh_odds_interval([(10, 50, 2, 50)])
    se = math.sqrt(1 / 10 + 1 / 40 + 1 / 2 + 1 / 48)
    z = stats.norm.ppf(0.975)
    assert (lo, hi) == pytest.approx((6 * math.exp(-z * se), 6 * math.exp(z * se)))


@pytest.mark.parametrize("rate, icc", [(0.04, 0.0), (0.04, 0.2), (0.3, 0.2)])
def test_a_pooled_clip_fractions_interval_covers_at_small_counts(rate, icc):
    """Simulated coverage of the nominal 95 % interval at the counts a laptop experiment has: 5 seeds with 2-7
    decisions each. The clustered interval alone gave zero width at 0 of 23 or at 1/2, 2/4, 3/6 (coverage 0.58 at a
    4 % rate); the hull with Clopper-Pearson must cover at least nominally. icc > 0 draws each seed's rate from a
    beta distribution (seeds differ more than binomially). 400 seeded draws: a binomial 95 % band around 0.95 is
    +- 0.021, so 0.93 is the floor."""
    import numpy as np

    from gapo.study.stats import ProportionEstimate

    rng = np.random.default_rng(0)
    units = np.array([2, 3, 5, 6, 7])
    hits = 0
    for _ in range(400):
        p = rng.beta(rate * (1 - icc) / icc, (1 - rate) * (1 - icc) / icc, 5) if icc else np.full(5, rate)
        e = rng.binomial(units, p)
        counts = tuple(zip(e.tolist(), units.tolist(), strict=True))
        lo, hi = ProportionEstimate(tuple(e / units), counts=counts).interval()
        hits += lo <= rate <= hi
    assert hits / 400 >= 0.93


def test_mh_odds_interval_without_events_on_one_side_has_no_bound():
    from gapo.study.stats import mh_odds_interval

    assert mh_odds_interval([(0, 10, 3, 10)]) == (0.0, math.inf)  # odds ratio 0: no finite interval
    assert mh_odds_interval([(3, 10, 0, 10)]) == (0.0, math.inf)


def _coverage(n_seeds: int, icc: float, reps: int, rate: float = 0.1, seed: int = 0) -> float:
    """Simulated coverage of a pooled clip fraction's 95 % interval: per draw, n_seeds seeds with 11-19 decisions
    each (uniform), each seed's rate drawn from a beta with mean `rate` and intraclass correlation
    icc = 1 / (a + b + 1), its clips binomial given that rate; a hit when the interval holds `rate`."""
    from gapo.study.stats import ProportionEstimate

    rng = np.random.default_rng(seed)
    hits = 0
    for _ in range(reps):
        units = rng.integers(11, 20, n_seeds)
        p = rng.beta(rate * (1 / icc - 1), (1 - rate) * (1 / icc - 1), n_seeds) if icc else np.full(n_seeds, rate)
        e = rng.binomial(units, p)
        lo, hi = ProportionEstimate(tuple(e / units),
                                    counts=tuple(zip(e.tolist(), units.tolist(), strict=True))).interval()
        hits += lo <= rate <= hi
    return hits / reps


@pytest.mark.parametrize("n_seeds, reps", [(5, 400), (10, 800)])
def test_a_pooled_clip_fractions_interval_covers_when_seeds_differ(n_seeds, reps):
    """Seeds that differ far more than binomially (ICC 0.5 at a 10 % rate: most seeds clip nothing, a few clip
    often), 11-19 decisions per seed. The hull of Clopper-Pearson and the seed-clustered logit-t covered 0.80 at 5
    seeds and 0.87 at 10 (2000 draws): a sample where no seed, or one or two, clipped gave it no spread to widen
    on. 800 seeded draws put a binomial 95 % band of +- 0.016 around 0.95; 0.93 is the floor."""
    assert _coverage(n_seeds, 0.5, reps) >= 0.93


def test_a_pooled_clip_fractions_interval_at_its_degenerate_counts():
    """No seed clipped: no spread to measure, and seeds that clip all or nothing cannot be ruled out. The chance of
    no clip in u decisions is E[(1 - p)^u] <= 1 - mu, reached when every seed's rate is 0 or 1, so the profile
    log-likelihood of n such seeds is n log(1 - mu) and the upper bound 1 - exp(-q / 2n) (q the chi-square 95 %
    quantile), or Clopper-Pearson's where that is wider; it narrows as seeds that agree are added. Every seed
    clipping everything mirrors it. One seed: as wide as its beta-binomial profile, never narrower than
    Clopper-Pearson on its own counts."""
    from gapo.study.stats import ProportionEstimate

    q, highs = stats.chi2.ppf(0.95, 1), []
    for n in (1, 2, 5, 10):
        zeros = ProportionEstimate((0.0,) * n, counts=((0, 15),) * n)
        lo, hi = zeros.interval()
        cp_hi = 1 - 0.025 ** (1 / (15 * n))
        assert lo == zeros.centre == 0.0 and hi == pytest.approx(max(1 - math.exp(-q / (2 * n)), cp_hi), rel=1e-4)
        ones = ProportionEstimate((1.0,) * n, counts=((15, 15),) * n)
        lo, hi = ones.interval()
        assert hi == ones.centre == 1.0 and lo == pytest.approx(1 - max(1 - math.exp(-q / (2 * n)), cp_hi), rel=1e-4)
        highs.append(zeros.interval()[1])
    assert highs == sorted(highs, reverse=True) and highs[-1] < 0.2
    one = ProportionEstimate((0.2,), counts=((3, 15),))
    lo, hi = one.interval()
    cp = (stats.beta.ppf(0.025, 3, 13), stats.beta.ppf(0.975, 4, 12))
    profile = bb_profile_by_hand([(3, 15)])
    assert (lo, hi) == pytest.approx((min(cp[0], profile[0]), max(cp[1], profile[1])), rel=1e-4)
    assert lo <= cp[0] and hi > cp[1] and lo < one.centre < hi


def _write_band_run(d: Path, algo: dict, seed: int, records: list[dict]) -> Path:
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump({"algorithm": algo, "rollout": {"group_size": 8},
                                                   "trainer": {"seed": seed}}))
    (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    (d / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return d


def test_the_reports_band_counts_count_a_seeds_shared_decisions_once(tmp_path):
    """GAPO 0.003/0.015 against GSPO 0.003/0.015 at c = 4 (GAPO's bound 0.003 + 0.012 * 4/7 = 0.00986): a decision
    at 1.012 differs (GAPO clips), one at 1.02 does not (both clip). Seed 0: the two arms logged the same ratios
    to the end, so its 2 decisions count once. Seed 1: the second arm's first off-policy ratio is 1.013, so the
    logs part there and both runs' 2 decisions count. 6 decisions, 3 in the band (adding both arms' runs: 8, 4)."""
    from gapo.study.seeds import band_tables

    def rec(*ratios):
        ups = [{"is_ratio": 1.0, "off_policy": False}] + [{"is_ratio": r, "off_policy": True} for r in ratios]
        return {"step": 1, "rank": 0, "problem": "p", "text": "t", "c": 4, "k": 8, "adv": 0.5, "updates": ups}

    gapo = {"name": "gapo", "eps_lo": 0.003, "eps_hi_max": 0.015}
    gspo = {"name": "gspo", "eps_lo": 0.003, "eps_hi": 0.015}
    runs = {"gapo": [_write_band_run(tmp_path / "a0", gapo, 0, [rec(1.012, 1.02)]),
                     _write_band_run(tmp_path / "a1", gapo, 1, [rec(1.012, 1.02)])],
            "gspo": [_write_band_run(tmp_path / "b0", gspo, 0, [rec(1.012, 1.02)]),
                     _write_band_run(tmp_path / "b1", gspo, 1, [rec(1.013, 1.02)])]}
    groups = load_groups([f"{k}={','.join(map(str, v))}" for k, v in runs.items()])
    md = "\n".join(band_tables(groups))
    assert "| 4 (correct) | 6 | 3 | 3 | 0 | 50.0% |" in md
    assert "| all correct (upper bound) | 6 | 3 | 3 | 0 | 50.0% |" in md
    assert "2 same-seed pair(s) counted once" in md and "2 shared decision(s)" in md


def test_the_control_is_a_label_after_the_method(seeds, tmp_path, capsys):
    """--control names the plan's control arm: not a label of the runs, or the first label (the method every other
    label is compared with, which would leave E2 and E3 with no row), is refused with what to give."""
    from gapo.study.compare import main

    for control, needle in (("gsp0", "--control 'gsp0': not one of the labels (gapo, gspo)"),
                            ("gapo", "--control 'gapo' is the first label, the method")):
        assert main(["seeds", "--out", str(tmp_path / "out"), "--control", control, *_group_args(seeds)]) == 2
        assert needle in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_with_a_plan_the_endpoints_come_first_and_every_later_section_says_what_it_is(seeds, tmp_path):
    """--control reads the pre-registered plan: its endpoints precede the training tables' uncorrected stars, each
    later heading says what the plan makes of it (secondary: reward, band counts, the held-out pass@1 of
    `gapo-compare table`; nothing else), and the per-seed values are written beside the report. Without it the report
    keeps its order and no plan's words."""
    from gapo.study.compare import main

    assert main(["seeds", "--out", str(tmp_path / "plan"), "--control", "gspo", *_group_args(seeds)]) == 0
    md = (tmp_path / "plan" / "compare.md").read_text()
    heads = [line for line in md.splitlines() if line.startswith("## ")]
    assert heads == [
        "## Runs", "## Endpoints (experiments/demo_mechanism_plan.md; gapo/study/endpoints.py)",
        "## Final validation pass@1, % (Tables 6 and 7) (exploratory; the plan's held-out pass@1 is "
        "`gapo-compare table`'s, secondary)",
        "## Training metrics, all steps (secondary: reward/mean; is_adv_corr is E2, read in the endpoints; the rest "
        "exploratory; p uncorrected)",
        "## Where the rules can differ (band counts) (secondary)",
        "## The c × rule interaction, paired by seed (exploratory)",
        "## Clip counts pooled over seeds (Cochran–Mantel–Haenszel; assumes independent decisions) (exploratory)",
        "## Figures (exploratory)"]
    saved = json.loads((tmp_path / "plan" / "endpoints.json").read_text())
    assert {r["endpoint"].split()[0] for r in saved if r["primary"]} == {"E1", "E2", "E3"}
    assert (tmp_path / "plan" / "endpoints.png").is_file() and "![endpoints.png](endpoints.png)" in md
    assert main(["seeds", "--out", str(tmp_path / "bare"), *_group_args(seeds)]) == 0
    bare = [line for line in (tmp_path / "bare" / "compare.md").read_text().splitlines() if line.startswith("## ")]
    assert bare == ["## Runs", "## Final validation pass@1, % (Tables 6 and 7)", "## Training metrics, all steps",
                    "## Where the rules can differ (band counts)", heads[1], heads[5],
                    "## Clip counts pooled over seeds (Cochran–Mantel–Haenszel; assumes independent decisions)",
                    "## Figures"]
    assert not any(r["primary"] for r in json.loads((tmp_path / "bare" / "endpoints.json").read_text()))
    assert not (tmp_path / "bare" / "endpoints.png").exists()
