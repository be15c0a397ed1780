"""The laptop experiment's endpoints (gapo/study/endpoints.py), each against an independent computation or data with
a known answer."""

import itertools
import json

import numpy as np
import pytest
from scipy import stats

from gapo.study import endpoints as ep
from gapo.study.stats import holm


def write_run(path, records, metrics=()):
    path.mkdir(parents=True, exist_ok=True)
    (path / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return path


def rollout(adv, c, updates):
    return {"step": 1, "adv": adv, "c": c, "k": 8, "updates": [
        {"is_ratio": s, "off_policy": off, "clip_hi_tokens": hi, "clip_lo_tokens": 0} for s, off, hi in updates]}


def test_decisions_are_the_correct_off_policy_updates_only(tmp_path):
    run = write_run(tmp_path / "r", [
        rollout(0.875, 1, [(1.0, False, 0), (1.02, True, 5)]),  # on-policy first update: no decision
        rollout(0.25, 6, [(1.0, False, 0), (0.999, True, 0)]),
        rollout(-0.125, 1, [(1.0, False, 0), (0.97, True, 0)]),  # incorrect: the lower bound's, not here
        rollout(0.0, 0, [(1.0, False, 0), (1.01, True, 0)]),  # no advantage, no gradient
        {"step": 1, "adv": 0.5, "c": 4, "k": 8, "updates": [{"is_ratio": 1.00001}, {"is_ratio": 1.03,
                                                                                      "clip_hi_tokens": 2}]},  # legacy
    ])
    d = ep.decisions(run)
    assert d.adv.tolist() == [0.875, 0.25, 0.5]
    assert d.ratio.tolist() == [1.02, 0.999, 1.03]
    assert d.clipped.tolist() == [True, False, True]


def test_slopes_are_least_squares():
    g = np.random.default_rng(0)
    x = g.choice([0.125, 0.25, 0.5, 0.875], 200)
    y = 0.03 * x + g.normal(0, 0.01, 200)
    assert ep.slope(x, y) == pytest.approx(np.polyfit(x, y, 1)[0], rel=1e-12)
    assert np.isnan(ep.slope(np.full(5, 0.5), y[:5]))  # one c only: no gradient to see
    d = ep.Decisions(x, np.exp(y), y > 0.01)
    e1 = ep.premise(d, [0.003])
    assert e1["log ratio"] == pytest.approx(np.polyfit(x, y, 1)[0], rel=1e-9)
    assert e1["P(clip) at 1 + 0.003"] == pytest.approx(np.polyfit(x, (np.exp(y) > 1.003).astype(float), 1)[0])


def test_weighted_clip_share_and_mean_correlation_by_hand(tmp_path):
    d = ep.Decisions(np.array([0.875, 0.25, 0.5]), np.array([1.02, 1.0, 1.03]), np.array([True, False, True]))
    assert ep.weighted_clip_share(d) == pytest.approx((0.875 + 0.5) / 1.625)
    run = write_run(tmp_path / "r", [], [{"step": 1, "is_adv_corr": 0.2}, {"step": 2, "is_adv_corr": None},
                                         {"step": 3, "is_adv_corr": 0.4}, {"step": 4}])
    assert ep.mean_is_adv_corr(run) == pytest.approx(0.3)


def test_across_seeds_keeps_every_seed_and_tests_exactly():
    by_seed = {0: 0.3, 1: -0.1, 2: 0.5, 3: float("nan"), 4: 0.2, 5: 0.4}
    r = ep.across_seeds(by_seed)
    assert r.seeds == [0, 1, 2, 4, 5] and r.without == {3: "no value"}  # not replaced, and named
    v = np.array([0.3, -0.1, 0.5, 0.2, 0.4])
    assert r.p_t == pytest.approx(stats.ttest_1samp(v, 0).pvalue)
    flips = [abs(np.mean(np.array(s) * v)) for s in itertools.product([1, -1], repeat=len(v))]
    assert r.p_flip == pytest.approx(np.mean([f >= abs(v.mean()) - 1e-12 for f in flips]))
    assert r.sd == pytest.approx(np.std(v, ddof=1))
    a, b = {0: 1.0, 1: 2.0, 3: 5.0, 5: float("nan")}, {1: 0.5, 3: 1.0, 4: 9.0, 5: 2.0}
    d = ep.paired(a, b)
    assert list(d) == [0, 1, 3, 4, 5] and (d[1], d[3]) == (1.5, 4.0) and np.isnan([d[0], d[4], d[5]]).all()
    why = ep.why_paired(("A", "B"), (a, b), ({5: "one advantage"}, {}))
    assert why == {0: "B: no run", 4: "A: no run", 5: "A: one advantage"}
    assert ep.across_seeds(d, why).without == why  # every seed either arm ran is kept in view


def simulated(rng, seeds, interaction, per_run=40):
    """Two rules' runs per seed whose clip log-odds are -2 + 3 adv (reference) and -2 + (3 + interaction) adv, with a
    random seed effect shared by both runs of a seed."""
    runs = {"fixed": {}, "adaptive": {}}
    for seed in range(seeds):
        u = rng.normal(0, 0.7)
        for label, b in (("fixed", 3.0), ("adaptive", 3.0 + interaction)):
            adv = rng.choice([0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875], per_run)
            p = 1 / (1 + np.exp(-(-2 + u + b * adv)))
            runs[label][seed] = ep.Decisions(adv, np.ones(per_run), rng.random(per_run) < p)
    return runs


def test_clip_model_recovers_a_planted_interaction_and_covers_it():
    rng = np.random.default_rng(7)
    [big] = ep.clip_model(simulated(rng, 60, -4.0, per_run=80), reference="fixed")
    assert (big.rule, big.reference, big.clusters) == ("adaptive", "fixed", 60)
    assert big.estimate == pytest.approx(-4.0, abs=1.0) and big.p < 1e-3  # (marginal odds shrink a little)
    covered = 0
    for _ in range(40):  # ten seeds, as the plan: the bias-reduced sandwich's interval covers at its level
        [r] = ep.clip_model(simulated(rng, 10, 0.0), reference="fixed")
        covered += r.lo <= 0.0 <= r.hi
    assert covered >= 34, covered  # >= 85 % of 40 at a nominal 95 %


def test_a_rule_that_never_clipped_is_not_estimable_rather_than_a_precise_zero():
    """With no clip under one rule the odds diverge: statsmodels returns a near-zero term with a tiny interval, which
    would read as a precise null. The model refuses, saying which rule, and the report says so in the row."""
    rng = np.random.default_rng(1)
    runs = simulated(rng, 4, -3.0)
    runs["fixed"] = {s: ep.Decisions(d.adv, d.ratio, np.zeros(len(d), dtype=bool)) for s, d in runs["fixed"].items()}
    with pytest.raises(ValueError, match="fixed: no decision clipped"):
        ep.clip_model(runs, reference="fixed")


def test_clip_model_keeps_a_seed_whose_runs_never_clipped():
    rng = np.random.default_rng(3)
    runs = simulated(rng, 8, -3.0)
    for label in runs:
        runs[label][0] = ep.Decisions(runs[label][0].adv, runs[label][0].ratio, np.zeros(40, dtype=bool))
    [r] = ep.clip_model(runs, reference="fixed")
    assert r.clusters == 8 and np.isfinite([r.estimate, r.lo, r.hi]).all()


def test_the_report_reads_each_endpoint_off_the_runs(tmp_path):
    """gapo-compare seeds' endpoint section: E1 per label, E2 and E3 paired by trainer.seed, the GEE row; each value
    equals the endpoint computed directly on the same runs."""
    rng = np.random.default_rng(5)
    groups, dec = {"GAPO": {}, "GSPO": {}}, {}
    for label, tilt in (("GAPO", 0.02), ("GSPO", 0.01)):
        for seed in (0, 1, 2):
            records = []
            for _ in range(12):
                c = int(rng.integers(1, 8))
                adv = (8 - c) / 8
                s = float(np.exp(tilt * adv + rng.normal(0, 0.004)))
                records.append(rollout(adv, c, [(1.0, False, 0), (s, True, int(s > 1.01))]))
            metrics = [{"step": 1, "is_adv_corr": float(rng.normal(tilt * 10, 0.05))}]
            groups[label][seed] = write_run(tmp_path / label / f"seed{seed}", records, metrics)
            dec[label, seed] = ep.decisions(groups[label][seed])
    lines = ep.report(groups, {"GSPO": 0.003})
    text = "\n".join(lines)
    e1 = ep.across_seeds({s: ep.slope(dec["GAPO", s].adv, np.log(dec["GAPO", s].ratio)) for s in (0, 1, 2)})
    assert (f"| E1 log-ratio slope on (k-c)/k | GAPO | {e1.mean:+.4g} [{e1.lo:+.4g}, {e1.hi:+.4g}] | {e1.sd:.3g} | "
            "3 (0, 1, 2) |") in text
    e2 = ep.across_seeds(ep.paired({s: ep.mean_is_adv_corr(groups["GAPO"][s]) for s in (0, 1, 2)},
                                   {s: ep.mean_is_adv_corr(groups["GSPO"][s]) for s in (0, 1, 2)}))
    assert f"| E2 mean is_adv_corr, Δ | GAPO − GSPO | {e2.mean:+.4g} [" in text
    e3 = ep.across_seeds({s: ep.slope(dec["GAPO", s].adv, dec["GAPO", s].clipped.astype(float))
                          - ep.slope(dec["GSPO", s].adv, dec["GSPO", s].clipped.astype(float)) for s in (0, 1, 2)})
    assert (f"| E3 P(clip) slope on (k-c)/k under the run's rule, Δ | GAPO − GSPO | {e3.mean:+.4g} "
            f"[{e3.lo:+.4g}, {e3.hi:+.4g}] | {e3.sd:.3g} | 3 (0, 1, 2) |") in text
    assert "| E3 advantage-weighted clip share, Δ | GAPO − GSPO |" in text
    [model] = ep.clip_model({"GSPO": {s: dec["GSPO", s] for s in (0, 1, 2)},
                             "GAPO": {s: dec["GAPO", s] for s in (0, 1, 2)}}, reference="GSPO")
    assert f"| GAPO | GSPO | {model.estimate:+.3g} [" in text
    # the plan's family: the control's E1, the first label's E2 and E3 slope against it, Holm over those three
    e1_control = ep.across_seeds({s: ep.slope(dec["GSPO", s].adv, np.log(dec["GSPO", s].ratio)) for s in (0, 1, 2)})
    family = holm([e1_control.p_t, e2.p_t, e3.p_t])
    full = "\n".join(ep.report(groups, {"GSPO": 0.003}, control="GSPO"))
    planned = full.split("### The primary family")[0]
    rows = {line.split(" | ")[0] + " | " + line.split(" | ")[1]: line for line in planned.splitlines()
            if line.startswith("| E")}
    assert rows["| E1 log-ratio slope on (k-c)/k | GSPO"].endswith(f"| {family[0]:.3g} |")
    assert rows["| E2 mean is_adv_corr, Δ | GAPO − GSPO"].endswith(f"| {family[1]:.3g} |")
    assert rows["| E3 P(clip) slope on (k-c)/k under the run's rule, Δ | GAPO − GSPO"].endswith(f"| {family[2]:.3g} |")
    # not in the family, and said so in their names (the plan's secondary analyses)
    assert rows["| E1 log-ratio slope on (k-c)/k (secondary) | GAPO"].endswith("|  |")
    assert rows["| E3 advantage-weighted clip share, Δ (secondary) | GAPO − GSPO"].endswith("|  |")
    assert "E3's model (secondary):" in full and "(secondary)" not in text  # without --control, no plan
    clip_at = ep.across_seeds({s: ep.slope(dec["GSPO", s].adv, (dec["GSPO", s].ratio > 1.003).astype(float))
                               for s in (0, 1, 2)})
    assert rows["| E1 P(clip) at 1 + 0.003 slope (secondary) | GSPO"].startswith(
        f"| E1 P(clip) at 1 + 0.003 slope (secondary) | GSPO | {clip_at.mean:+.4g} [")
    assert "| E1 P(clip)" not in "\n".join(ep.report(groups, {"GSPO": 0.003}))  # only the control's, with --control
    # the family read by the plan's rules, in a table of its own: each row is `reading` of that row's numbers
    read = "\n".join(ep.report(groups, {"GSPO": 0.003}, control="GSPO", e1_margin=0.0137))
    assert "### The primary family, read by the plan's rules" in read
    for name, a, p in (("E1", e1_control, family[0]), ("E2", e2, family[1]), ("E3", e3, family[2])):
        assert f"| {a.mean:+.4g} [{a.lo:+.4g}, {a.hi:+.4g}] | {p:.3g} | {ep.reading(name, a, p, 0.0137)} |" in read
    assert "read by the plan's rules" not in "\n".join(ep.report(groups, {"GSPO": 0.003}))  # no family, no reading
    # beside the report: every row's per-seed values (what the tables summarise) and the family's figure
    (tmp_path / "out").mkdir()
    ep.report(groups, {"GSPO": 0.003}, control="GSPO", e1_margin=0.0137, out=tmp_path / "out")
    saved = {(r["endpoint"], r["labels"]): r for r in json.loads((tmp_path / "out" / "endpoints.json").read_text())}
    for key, a, p in ((("E1 log-ratio slope on (k-c)/k", "GSPO"), e1_control, family[0]),
                      (("E2 mean is_adv_corr, Δ", "GAPO − GSPO"), e2, family[1]),
                      (("E3 P(clip) slope on (k-c)/k under the run's rule, Δ", "GAPO − GSPO"), e3, family[2])):
        r = saved[key]
        assert r["primary"] and r["seeds"] == [0, 1, 2] and r["values"] == pytest.approx(a.values.tolist())
        assert (r["mean"], r["lo"], r["hi"], r["p_holm_family"]) == pytest.approx((a.mean, a.lo, a.hi, p))
        assert r["reading"] == ep.reading(key[0].split()[0], a, p, 0.0137)
    assert not saved["E1 log-ratio slope on (k-c)/k (secondary)", "GAPO"]["primary"]
    assert saved["E1 log-ratio slope on (k-c)/k (secondary)", "GAPO"]["p_holm_family"] is None
    assert (tmp_path / "out" / "endpoints.png").stat().st_size > 10_000
    (groups["GSPO"][2] / "rollouts.jsonl").unlink()  # a run without its rollouts: E1 and E3 say so, E2 stays
    text = "\n".join(ep.report(groups, {"GSPO": 0.003}))
    assert "E1 and E3 need every run's rollouts.jsonl" in text and "| E2 mean is_adv_corr, Δ |" in text
    assert "E1 log-ratio slope" not in text
    # with --control the family is still read: the missing E1 and E3 count as p = 1 in Holm and read not estimable
    text = "\n".join(ep.report(groups, {"GSPO": 0.003}, control="GSPO", e1_margin=0.014, out=tmp_path / "out"))
    assert "The plan's primary family is incomplete here (E1, E3 without runs or without a p)" in text
    stubs = [r for r in json.loads((tmp_path / "out" / "endpoints.json").read_text()) if r["labels"] is None]
    assert [(r["endpoint"], r["primary"], r["reading"]) for r in stubs] == [(e, True, ep.NO_ROW) for e in ("E1", "E3")]
    p_e2 = holm([e2.p_t, 1.0, 1.0])[0]
    assert f"| {e2.mean:+.4g} [{e2.lo:+.4g}, {e2.hi:+.4g}] | {p_e2:.3g} | {ep.reading('E2', e2, p_e2)} |" in text
    for e in ("E1", "E3"):
        assert f"| {e} | | | | not estimable (no row: its runs or their rollouts are missing) |" in text


def test_a_seed_without_a_value_is_named_with_why_in_every_row_it_misses(tmp_path):
    """The plan keeps every seed that ran: a run whose decisions share one advantage has no slope, and a seed one arm
    lacks has no pair; neither vanishes from the report (the table's seeds column and a list below it say why)."""
    rng = np.random.default_rng(2)
    groups = {"GAPO": {}, "GSPO": {}}
    for label, seeds in (("GAPO", (0, 1, 2, 3)), ("GSPO", (0, 1, 2))):
        for seed in seeds:
            cs = [4] * 6 if (label, seed) == ("GSPO", 2) else [int(rng.integers(1, 8)) for _ in range(12)]
            records = [rollout((8 - c) / 8, c, [(1.0, False, 0), (float(np.exp(rng.normal(0.01, 0.01))), True,
                                                                  int(rng.random() < 0.3))]) for c in cs]
            groups[label][seed] = write_run(tmp_path / label / f"seed{seed}", records,
                                            [{"step": 1, "is_adv_corr": float(rng.normal(0, 0.1))}])
    text = "\n".join(ep.report(groups, {"GSPO": 0.003, "other": 0.015}, control="GSPO", out=tmp_path))
    table = text.split("### The primary family")[0]
    # endpoints.json keeps the same seeds and reasons (and is valid JSON: a statistic without a value is null)
    saved = {r["endpoint"]: r for r in json.loads((tmp_path / "endpoints.json").read_text())}
    e1 = saved["E1 log-ratio slope on (k-c)/k"]
    assert e1["seeds"] == [0, 1] and list(e1["without"]) == ["2"] and "share one advantage" in e1["without"]["2"]
    assert saved["E3 P(clip) slope on (k-c)/k under the run's rule, Δ"]["without"]["3"] == "GSPO: no run"
    # GSPO's E1 has two seeds: a t interval; a row of one seed has none, and JSON (which has no NaN) says null
    one = {label: {0: runs[0]} for label, runs in groups.items()}
    ep.report(one, {"GSPO": 0.003}, control="GSPO", out=tmp_path)
    saved = {r["endpoint"]: r for r in json.loads((tmp_path / "endpoints.json").read_text())}
    e1 = saved["E1 log-ratio slope on (k-c)/k"]
    assert e1["seeds"] == [0] and e1["mean"] is not None and e1["lo"] is e1["p_t"] is e1["p_holm_family"] is None
    rows = {line.split(" | ")[0][2:]: line for line in table.splitlines() if line.startswith("| E")}
    assert "| 2 (0, 1); none: 2 |" in rows["E1 log-ratio slope on (k-c)/k"]
    assert "| 3 (0, 1, 2); none: 3 |" in rows["E2 mean is_adv_corr, Δ"]
    assert "| 2 (0, 1); none: 2, 3 |" in rows["E3 P(clip) slope on (k-c)/k under the run's rule, Δ"]
    assert ("- E3 P(clip) slope on (k-c)/k under the run's rule, Δ (GAPO − GSPO): seed 2: GSPO: its 6 decision(s) "
            "share one advantage, 0.5: no slope; seed 3: GSPO: no run") in text
    assert "- E1 log-ratio slope on (k-c)/k (GSPO): seed 2: GSPO" not in text  # one arm: the seed and its own reason
    assert "- E1 log-ratio slope on (k-c)/k (GSPO): seed 2: its 6 decision(s) share one advantage" in text
    # the control's clip slope under its own bound is the plan's secondary; under another rule's, exploratory
    assert "E1 P(clip) at 1 + 0.003 slope (secondary)" in rows and "E1 P(clip) at 1 + 0.015 slope (exploratory)" in rows


def test_a_row_without_any_value_keeps_its_columns_and_every_cause_is_its_own():
    nothing = ep.across_seeds({0: float("nan"), 1: float("nan")}, {0: "no correct off-policy decision"})
    cells = [c.strip() for c in ep._cell(nothing).split("|")]
    assert cells[:3] == ["no seed with a value", "", "0; none: 0, 1"] and len(cells) == 5  # mean, SD, seeds, p, p
    assert ep.why_none(ep.Decisions(np.array([]), np.array([]), np.array([], dtype=bool))) == \
        "no correct off-policy decision"
    one = ep.Decisions(np.full(3, 0.5), np.ones(3), np.zeros(3, dtype=bool))
    assert ep.why_none(one) == "its 3 decision(s) share one advantage, 0.5: no slope"
    assert ep.why_none(ep.Decisions(np.array([0.5, 0.25]), np.zeros(2), np.zeros(2, dtype=bool))) == "no finite value"
    assert "never differed" not in ep.reading("E1", ep.across_seeds(dict.fromkeys(range(4), 0.0)), float("nan"))


@pytest.mark.parametrize("values, expected", [
    ([0.0] * 16, "inconclusive: every one of the 16 seeds' values is exactly 0"),
    ([-0.25] * 16, "inconclusive by the plan's rules, whose t test is undefined without spread: every one of the 16 "
                   "seeds' values is -0.25 (sign-flip p 3.05e-05)"),
])
def test_an_endpoint_without_spread_is_read_in_words_not_as_not_estimable(values, expected):
    """E3 is exactly 0 in every pair when neither rule ever clips: the rules never differed, which the plan reads as
    inconclusive; identical nonzero differences leave the t test undefined, and the sign-flip p is said instead."""
    a = ep.across_seeds(dict(enumerate(values)))
    got = ep.reading("E3", a, float("nan"))
    assert got.startswith(expected), got


def _seeds(mean: float, lo: float, hi: float, p: float = 0.5) -> ep.AcrossSeeds:
    return ep.AcrossSeeds(seeds=list(range(16)), values=np.linspace(lo, hi, 16), mean=mean, lo=lo, hi=hi, p_t=p,
                          p_flip=p)


@pytest.mark.parametrize("endpoint, a, p_holm, expected", [
    # for: Holm p < 0.05 with the predicted sign (E1, E2 positive; E3 negative)
    ("E2", _seeds(0.12, 0.05, 0.19), 0.01, "**for** the claim"),
    ("E3", _seeds(-0.3, -0.5, -0.1), 0.01, "**for** the claim"),
    # significant with the wrong sign is not "for": the interval then lies on the other side, against
    ("E2", _seeds(-0.12, -0.19, -0.05), 0.01, "**against** the claim (the interval wholly on the other side"),
    ("E3", _seeds(0.3, 0.1, 0.5), 0.2, "**against** the claim (the interval wholly on the other side"),
    # E1 only: a positive interval wholly below GAPO's bound gradient counts against the premise as GAPO uses it,
    # and with Holm p < 0.05 it is both
    ("E1", _seeds(0.004, 0.001, 0.007), 0.01, "**for** the claim (Holm p < 0.05, the predicted sign); **against** "
                                              "the premise as GAPO uses it (the interval wholly below GAPO's bound "
                                              "gradient 0.0137)"),
    ("E1", _seeds(0.004, -0.002, 0.010), 0.3, "**against** the premise as GAPO uses it"),
    ("E2", _seeds(0.004, -0.002, 0.010), 0.3, "inconclusive at this power: the interval still holds effects from "
                                              "-0.002 to +0.01 (predicted: positive)"),
    # an interval reaching past the margin is no evidence against: inconclusive, never "does not reproduce"
    ("E1", _seeds(0.01, -0.01, 0.03), 0.4, "inconclusive at this power"),
    ("E1", _seeds(float("nan"), float("nan"), float("nan"), float("nan")), float("nan"), "not estimable"),
])
def test_the_plan_reads_a_primary_endpoint_by_its_own_rules(endpoint, a, p_holm, expected):
    got = ep.reading(endpoint, a, p_holm, e1_margin=0.0137)
    assert got.startswith(expected), got


def test_e1s_margin_is_gapos_bound_gradient_per_unit_of_advantage():
    """The plan's 0.014: eps_hi(c) rises 0.012 from c = 8 to c = 1, over advantages 0 .. 7/8."""
    from gapo.configfile import resolve

    gapo = resolve({"algorithm": {"name": "gapo", "clip_widths": {"sequence": [0.003, 0.015]}}}).algorithm
    assert ep.bound_gradient(gapo, 8) == pytest.approx(0.012 * 8 / 7) and round(ep.bound_gradient(gapo, 8), 3) == 0.014
    assert ep.bound_gradient(resolve({"algorithm": {"name": "gspo"}}).algorithm, 8) is None  # a constant bound
