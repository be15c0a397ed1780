"""The pilot's power simulation (gapo/study/power.py) against the endpoints it stands for and against the t test's
power from the noncentral t distribution."""

import numpy as np
import pytest
from scipy import stats
from test_endpoints import write_run

from gapo.study import endpoints as ep
from gapo.study import power as pw


def pilot_run(path, rng, steps=6, lift=0.02, corr=0.3):
    """A run whose correct rollouts' log ratio rises with the advantage by `lift` per unit, clipped above 1.003."""
    records, metrics = [], []
    for step in range(1, steps + 1):
        for _ in range(12):
            c = int(rng.integers(1, 8))
            adv = (8 - c) / 8
            ratio = float(np.exp(lift * adv + rng.normal(0, 0.004)))
            records.append({"step": step, "adv": adv, "c": c, "k": 8, "updates": [
                {"is_ratio": 1.0, "off_policy": False, "clip_hi_tokens": 0},
                {"is_ratio": ratio, "off_policy": True, "clip_hi_tokens": int(ratio > 1.003)}]})
        metrics.append({"step": step, "is_adv_corr": corr + float(rng.normal(0, 0.05))})
    return write_run(path, records, metrics)


def test_a_synthetic_run_of_every_step_once_has_the_endpoints_of_the_run(tmp_path):
    rng = np.random.default_rng(0)
    run = pilot_run(tmp_path / "gspo_sym" / "seed100", rng)
    arm = pw.arm_steps([run])
    assert arm.steps_per_run == 6 and arm.sums.shape == (6, 7)
    got = pw.run_values(arm, np.arange(6))
    d = ep.decisions(run)
    assert float(got["ratio"]) == pytest.approx(ep.slope(d.adv, np.log(d.ratio)), rel=1e-9)
    assert float(got["clip"]) == pytest.approx(ep.slope(d.adv, d.clipped.astype(float)), rel=1e-9)
    assert float(got["corr"]) == pytest.approx(ep.mean_is_adv_corr(run), rel=1e-12)
    effects = pw.pilot_effects([run], [run])
    assert effects["E1"] == pytest.approx(float(got["ratio"])) and effects["E2"] == 0 == effects["E3"]


def test_power_matches_the_noncentral_t_where_the_other_endpoints_are_certain(tmp_path):
    """E2 and E3 planted far beyond any noise: Holm then tests E1 at the full 0.05, so its simulated power is a
    one-sample t test's at the simulated effect and the synthetic runs' spread."""
    rng = np.random.default_rng(1)
    control = pw.arm_steps([pilot_run(tmp_path / "c" / f"seed{s}", rng, steps=8, corr=0.0) for s in range(2)])
    treated = pw.arm_steps([pilot_run(tmp_path / "t" / f"seed{s}", rng, steps=8, lift=-0.05, corr=0.9)
                            for s in range(2)])
    sd = pw.spread(control, "ratio", np.random.default_rng(2), sims=20000)
    effects = {"E1": 0.7 * sd, "E2": 0.9, "E3": -0.9}
    for n in (6, 12):
        got = pw.simulate(treated, control, effects, n, shrink=1.0, sims=4000, rng=np.random.default_rng(3))
        assert got["E2"] == 1.0 and got["E3"] == 1.0
        crit = stats.t.ppf(0.975, n - 1)
        nc = effects["E1"] / (sd / np.sqrt(n))
        expected = stats.nct.sf(crit, n - 1, nc)
        assert 0.1 < expected < 0.95  # a power the check can tell apart from 0 and 1
        assert got["E1"] == pytest.approx(expected, abs=0.04)
        assert got["all"] == pytest.approx(got["E1"], abs=1e-12)


def test_an_effect_against_the_prediction_has_no_power(tmp_path):
    rng = np.random.default_rng(4)
    arm = pw.arm_steps([pilot_run(tmp_path / "c" / "seed0", rng)])
    got = pw.simulate(arm, arm, {"E1": -0.02, "E2": -0.1, "E3": 0.1}, 10, shrink=1.0, sims=500,
                      rng=np.random.default_rng(5))
    assert got["E1"] == got["E2"] == got["E3"] == 0.0


def test_the_smallest_effect_has_the_power_it_promises(tmp_path):
    """At the smallest effect for 80 % power, E1 tested beside two null endpoints is rejected ~80 % of the time (Holm
    then tests the smallest p at 0.05 / 3, the level smallest_effect assumes)."""
    rng = np.random.default_rng(6)
    arm = pw.arm_steps([pilot_run(tmp_path / "c" / f"seed{s}", rng, steps=8) for s in range(2)])
    sd = pw.spread(arm, "ratio", np.random.default_rng(7), sims=20000)
    n = 10
    d = pw.smallest_effect(sd, n)
    crit = stats.t.ppf(1 - 0.05 / 6, n - 1)
    assert stats.nct.sf(crit, n - 1, d / sd * np.sqrt(n)) == pytest.approx(0.8, abs=1e-6)
    got = pw.simulate(arm, arm, {"E1": d, "E2": 0.0, "E3": 0.0}, n, shrink=1.0, sims=4000,
                      rng=np.random.default_rng(8))
    assert got["E1"] == pytest.approx(0.8, abs=0.05)
    assert pw.smallest_effect(sd, 20) < d  # more seeds, smaller effects


def test_the_command_reads_each_arms_runs_and_not_their_rehearsals(tmp_path, capsys):
    """gapo-sweep --rehearse leaves seedN-rehearsal beside seedN: it is no pilot run (its 2 steps would enter the
    resampled steps, and the spread)."""
    rng = np.random.default_rng(4)
    for arm in ("gapo", "gspo_sym"):
        pilot_run(tmp_path / arm / "seed100", rng)
        (tmp_path / arm / "seed100-rehearsal").mkdir()  # no metrics: read as a run, it would end the command
    assert pw.main([str(tmp_path), "--seeds", "10", "--sims", "20"]) == 0
    out = capsys.readouterr().out
    assert "pilot: gapo ['seed100'], gspo_sym ['seed100']; 6 + 6 steps" in out
