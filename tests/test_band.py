"""gapo-compare band: which logged decisions two clip rules judge differently, counted by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from gapo.errors import ConfigError
from gapo.study import band
from gapo.study.compare import main as cli


def _run(d: Path, records: list[dict]) -> Path:
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump({"algorithm": {"name": "gapo", "eps_lo": 0.003,
                                                                 "eps_hi_max": 0.015}}))
    (d / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return d


def _rec(c: int, adv: float, *ratios: float, off=None) -> dict:
    flags = off or [None] * len(ratios)
    ups = [{"is_ratio": s} | ({} if o is None else {"off_policy": o}) for s, o in zip(ratios, flags, strict=True)]
    return {"c": c, "k": 8, "adv": adv, "updates": ups}


def test_band_counts_by_hand(tmp_path):
    """GAPO 0.003/0.015 against GSPO 0.003/0.015 (k = 8): GAPO's bound at c = 4 is 0.003 + 0.012 * 4/7 = 0.00986.
    - c = 4, s = 1.012: GAPO clips (> 1.00986), GSPO-asym does not (< 1.015): in the band, clipped by the first;
    - c = 4, s = 1.02: both clip; c = 1, s = 1.012: neither (GAPO's bound is 1.015 there): not in the band;
    - an incorrect rollout at s = 0.99: both clip (same eps_lo);
    - the on-policy update (off_policy false) at s = 1.012 is no decision; A = 0 rollouts are none either."""
    d = _run(tmp_path / "r", [
        _rec(4, 0.5, 1.0, 1.012, 1.02, off=[False, True, True]),
        _rec(1, 0.875, 1.012, off=[True]),
        _rec(4, -0.5, 0.99, off=[True]),
        _rec(8, 0.0, 1.5, off=[True]),
        _rec(4, 0.5, 1.012, off=[False]),
    ])
    first, second = band.rule("gapo:0.003/0.015"), band.rule("gspo:0.003/0.015")
    b = band.count([d], first, second)
    assert (b.correct[4].decisions, b.correct[4].differ, b.correct[4].only_first, b.correct[4].only_second) == \
        (2, 1, 1, 0)
    assert (b.correct[1].decisions, b.correct[1].differ) == (1, 0)
    assert (b.incorrect.decisions, b.incorrect.differ) == (1, 0)
    assert (b.all_correct.decisions, b.all_correct.differ) == (3, 1) and not b.legacy
    # Against the symmetric rule at 0.003 the c = 1 decision differs too (1.012 > 1.003), clipped by the second.
    b = band.count([d], first, band.rule("gspo:0.003"))
    assert (b.correct[1].differ, b.correct[1].only_second) == (1, 1)


def test_logs_without_the_off_policy_flag_fall_back_to_the_ratio(tmp_path):
    d = _run(tmp_path / "r", [_rec(4, 0.5, 1.0 + 1e-6, 1.012)])
    b = band.count([d], band.rule("gapo:0.003/0.015"), band.rule("gspo:0.003/0.015"))
    assert b.legacy and b.correct[4].decisions == 1 and b.correct[4].differ == 1


def test_the_command_prints_the_table_and_names_bad_rules(tmp_path, capsys):
    d = _run(tmp_path / "r", [_rec(4, 0.5, 1.012, off=[True])])
    assert cli(["band", str(d), "--rules", "gapo:0.003/0.015", "gspo:0.003/0.015"]) == 0
    out = capsys.readouterr().out
    assert "| 4 (correct) | 1 | 1 | 1 | 0 | 100.0% |" in out and "1 + eps_hi(c): 0.015 at c = 1" in out
    assert cli(["band", str(d), "--rules", "gapo", "gspo:0.003"]) == 2
    assert "expected NAME:EPS_LO[/EPS_HI]" in capsys.readouterr().err
    assert cli(["band", str(d), "--rules", "dapo:0.2/0.28", "gspo:0.003"]) == 2
    assert "band counts need a sequence-level" in capsys.readouterr().err
    assert cli(["band", str(tmp_path / "none"), "--rules", "gapo:0.003/0.015", "gspo:0.003"]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "nolog").mkdir()
    assert cli(["band", str(tmp_path / "nolog"), "--rules", "gapo:0.003/0.015", "gspo:0.003"]) == 2
    assert "trainer.log_rollouts=true" in capsys.readouterr().err


def test_an_unknown_preset_is_named():
    with pytest.raises(ConfigError, match="rule 'nope:0.1'"):
        band.rule("nope:0.1")


def _upper(spec_clip: str, c: int, k: int = 8, eps_lo: float = 0.003, eps_hi_max: float = 0.015) -> float:
    """A correct rollout's upper bound by hand: GAPO's eq. 8, or a fixed rule's eps_hi."""
    return eps_lo + (eps_hi_max - eps_lo) * (k - c) / (k - 1) if spec_clip == "adaptive" else eps_hi_max


def test_the_summary_row_counts_correct_decisions_only(tmp_path):
    """Incorrect rollouts' decisions act on the lower bound, the same 1 - eps_lo for two rules with one eps_lo: they
    can never differ, and adding them to the summary row would dilute its share in the band. Here 2 of 4 correct
    decisions differ (50 %); the 6 incorrect ones, on both sides of 1 - eps_lo, differ in none and stay in their
    own row."""
    recs = [_rec(4, 0.5, 1.012, 1.02, off=[True, True]), _rec(6, 0.25, 1.012, 1.0, off=[True, True]),
            _rec(4, -0.5, 0.99, 0.999, 1.02, off=[True, True, True]),
            _rec(6, -0.75, 0.9, 1.001, 1.2, off=[True, True, True])]
    d = _run(tmp_path / "r", recs)
    first, second = band.rule("gapo:0.003/0.015"), band.rule("gspo:0.003/0.015")
    b = band.count([d], first, second)
    by_hand = [(r["c"], u["is_ratio"]) for r in recs if r["adv"] > 0 for u in r["updates"]]
    differ = sum((s > 1 + _upper("adaptive", c)) != (s > 1 + _upper("fixed", c)) for c, s in by_hand)
    assert (b.all_correct.decisions, b.all_correct.differ, b.all_correct.only_first) == (len(by_hand), differ, differ)
    assert (b.incorrect.decisions, b.incorrect.differ) == (6, 0)
    out = "\n".join(band.table(b, first, second))
    assert f"| all correct (upper bound) | {len(by_hand)} | {differ} | {differ} | 0 | {differ / len(by_hand):.1%} |" \
        in out
    assert "| incorrect (lower bound) | 6 | 0 | 0 | 0 | 0.0% |" in out
    assert "| all |" not in out


@pytest.mark.parametrize("spec", ["gapo:0.003/0.015", "gspo:0.003/0.015", "gspo:0.003"])
def test_the_lower_bound_clips_negative_advantages_below_one_minus_eps_lo(spec):
    """A < 0: clipped below 1 - eps_lo, never above it, however far above the upper bound; A = 0: never clipped;
    A > 0: never clipped from below. For every c, as the adaptive rule's upper bound moves with c."""
    r, eps_lo = band.rule(spec), 0.003
    for c in range(1, 8):
        for adv in (-0.5, -0.125):
            assert r.clips(1 - eps_lo - 1e-4, adv, c, 8) and r.clips(0.5, adv, c, 8)
            assert not r.clips(1 - eps_lo + 1e-4, adv, c, 8)
            assert not r.clips(1 + eps_lo + 1e-4, adv, c, 8) and not r.clips(1.016, adv, c, 8)
            assert not r.clips(2.0, adv, c, 8)
        assert not any(r.clips(s, 0.0, c, 8) for s in (0.5, 1 - eps_lo - 1e-4, 1.0, 1.016, 2.0))
        assert not r.clips(0.5, 0.5, c, 8) and r.clips(1.016, 0.5, c, 8)


def test_count_judges_incorrect_rollouts_on_their_lower_bounds(tmp_path):
    """GAPO with eps_lo 0.003 against GSPO with eps_lo 0.01: an incorrect rollout's decision differs exactly when
    its ratio lies in [0.99, 0.997). Its decisions sit on each side: 0.995 twice (in the band, clipped by GAPO
    only), 0.98 (below both: both clip), 1.005 and 1.02 (above both lower bounds: neither clips; a rule that read
    the lower side as s > 1 + eps_lo would clip 1.005 under GAPO only and 1.02 under both). A correct rollout at
    0.98 is not clipped from below, and a zero-advantage one is no decision."""
    ratios = [0.995, 0.98, 1.005, 0.995, 1.02]
    d = _run(tmp_path / "r", [_rec(3, -0.5, *ratios, off=[True] * 5), _rec(3, 0.5, 0.98, off=[True]),
                              _rec(3, 0.0, 0.98, off=[True])])
    first, second = band.rule("gapo:0.003/0.015"), band.rule("gspo:0.01/0.015")
    b = band.count([d], first, second)
    in_band = sum(1 - 0.01 <= s < 1 - 0.003 for s in ratios)
    assert (b.incorrect.decisions, b.incorrect.differ, b.incorrect.only_first, b.incorrect.only_second) == \
        (5, in_band, in_band, 0) and in_band == 2
    assert (b.correct[3].decisions, b.correct[3].differ) == (1, 0)


def _step_rec(step: int, text: str, c: int, adv: float, *ratios: float) -> dict:
    """A record as the trainer logs it: the first update on-policy (ratio 1), the others off-policy."""
    ups = [{"is_ratio": 1.0, "off_policy": False}] + [{"is_ratio": s, "off_policy": True} for s in ratios]
    return {"step": step, "rank": 0, "problem": f"p{step}", "text": text, "c": c, "k": 8, "adv": adv,
            "eps_hi": 0.0, "updates": ups}


def test_a_same_seed_pair_counts_its_shared_decisions_once(tmp_path):
    """Two arms' runs of one seed: identical through step 1 (the GAPO arm's eps_hi differs, which is no
    difference of trajectory) and through step 2's first update, then a ratio differs. Counted once: all of the
    first run's decisions, and the second run's from the differing ratio on. By hand, per (c, ratio) decision,
    against GAPO's eq. 8 bound and GSPO's 1.015."""
    step1 = [_step_rec(1, "a", 4, 0.5, 1.012, 1.02), _step_rec(1, "b", 4, -0.5, 0.99)]
    first_log = step1 + [_step_rec(2, "c", 4, 0.5, 1.012), _step_rec(2, "d", 2, 0.75, 1.016)]
    second_log = [dict(r, eps_hi=0.015) for r in step1] + [_step_rec(2, "c", 4, 0.5, 1.013),
                                                          _step_rec(2, "d", 2, 0.75, 1.014)]
    da, db = _run(tmp_path / "a", first_log), _run(tmp_path / "b", second_log)
    # step 1: 3 + 2 updates; step 2's first record: its on-policy update, then 1.012 against 1.013
    assert band.shared_prefix(first_log, second_log) == 6
    assert band.shared_prefix(first_log, first_log) == 9  # every update: 3 + 2 + 2 + 2
    assert band.shared_prefix(first_log, first_log[:3]) == 7  # a shorter log (still being written) ends the prefix
    assert band.shared_prefix(first_log, [dict(first_log[0], text="x")] + first_log[1:]) == 0

    correct = [(4, 1.012), (4, 1.02), (4, 1.012), (2, 1.016)] + [(4, 1.013), (2, 1.014)]  # first run, then second's
    first, second = band.rule("gapo:0.003/0.015"), band.rule("gspo:0.003/0.015")
    b = band.count([], first, second, pairs=[(da, db)])
    for c in (2, 4):
        got = [s for cc, s in correct if cc == c]
        differ = sum((s > 1 + _upper("adaptive", c)) != (s > 1.015) for s in got)
        assert (b.correct[c].decisions, b.correct[c].differ) == (len(got), differ), c
    assert b.incorrect.decisions == 1 and (b.pairs, b.shared, b.runs) == (1, 3, 2)
    both = band.count([da, db], first, second)  # each run on its own: the shared decisions twice
    assert both.all_correct.decisions == b.all_correct.decisions + 2 and both.incorrect.decisions == 2
    assert "1 same-seed pair(s) counted once" in "\n".join(band.table(b, first, second))
