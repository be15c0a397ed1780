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
    assert (b.total.decisions, b.total.differ) == (4, 1) and not b.legacy
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
