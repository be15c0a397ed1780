"""A clip rule is one object (gapo/clip.py): a toy rule added from outside the package is named by algorithm.clip and
reaches the config, the loss, gapo-compare band and the descriptions without a change anywhere else."""

import pytest
import torch
from test_losses import _batch, _logp, _mb, _reference_loss

from gapo import clip
from gapo.algorithms import StepNorm
from gapo.config import AlgorithmConfig
from gapo.study.band import Rule
from gapo.trainer.losses import clip_high, policy_loss


@pytest.fixture
def halves(monkeypatch, tmp_path):
    monkeypatch.setattr(clip, "RULES", dict(clip.RULES))  # the registration ends with the test
    import gapo.config

    monkeypatch.setattr(gapo.config, "RULES", clip.RULES)
    (tmp_path / "halves.py").write_text(TOY)
    exec(compile(TOY, str(tmp_path / "halves.py"), "exec"), {})  # as a plugin would register it
    return AlgorithmConfig(is_level="sequence", clip="halves", eps_lo=3e-3, eps_hi_max=5e-3, loss_agg="token_mean",
                           surrogate="ppo")


def test_a_toy_rule_reaches_config_loss_band_and_descriptions(halves):
    algo = halves
    assert algo.upper == 5e-3 and algo.clip_range == ("3e-3", "5e-3 halves")
    assert algo.describe() == "halves clip 1 - 3e-3 .. 1 + 5e-3"
    c, k = torch.tensor([1, 3, 4, 5, 7]), torch.tensor([8] * 5)
    assert clip_high(c, k, algo).tolist() == pytest.approx([5e-3, 5e-3, 5e-3, 3e-3, 3e-3])
    band = Rule("toy", algo)
    assert [band.upper(x, 8) for x in (1, 4, 5)] == pytest.approx([5e-3, 5e-3, 3e-3])
    assert band.clips(1.004, 0.375, 5, 8) and not band.clips(1.004, 0.5, 4, 8)  # the same ratio, either half
    # the loss applies it: equal to the formula with the rule's per-rollout bound
    logits, tokens, mask, old_logp, ga = _batch(spread=0.02)
    norm = StepNorm(tokens=float(mask.sum()), seqs=float(mask.shape[0]))
    c = torch.arange(len(ga.c)) % 7 + 1  # both halves (the loss reads c and k as given)
    loss, _ = policy_loss(_logp(logits, tokens), _mb(mask, old_logp, ga.adv.double(), c, ga.k), norm, algo)
    bound = clip_high(c, ga.k, algo)
    ref = _reference_loss(_logp(logits, tokens), old_logp, mask, ga.adv.double(), 3e-3, bound, "sequence",
                          norm.tokens)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-10, abs=1e-12)
    wide = _reference_loss(_logp(logits, tokens), old_logp, mask, ga.adv.double(), 3e-3, 5e-3, "sequence", norm.tokens)
    assert abs(wide.item() - loss.item()) > 1e-9  # the tight half's bound mattered in this batch
    assert sorted(set(bound.tolist())) == pytest.approx([3e-3, 5e-3])


def test_a_rule_takes_only_its_own_upper_field_and_unknown_rules_are_refused(halves):
    with pytest.raises(ValueError, match=r"algorithm.eps_hi=0.005: the halves rule .* its upper bound is "
                                         r"algorithm.eps_hi_max"):
        AlgorithmConfig(is_level="sequence", clip="halves", eps_lo=3e-3, eps_hi=5e-3)
    with pytest.raises(ValueError, match=r"algorithm.clip='nope': not in gapo.clip.RULES \(fixed, adaptive, cispo, "
                                         r"halves; a plugin may register another\)"):
        AlgorithmConfig(is_level="sequence", clip="nope", eps_lo=3e-3, eps_hi=5e-3)
    with pytest.raises(ValueError, match="clip rule 'halves' exists already"):
        clip.register(type(clip.RULES["halves"])(tag=" other"))


TOY = '''from dataclasses import dataclass

from gapo import clip


@dataclass(frozen=True)
class Halves(clip.ClipRule):
    name: str = "halves"
    upper_field: str = "eps_hi_max"
    constant: bool = False
    tag: str = " halves"

    def eps_hi(self, c, k, algo):
        return algo.eps_lo + (algo.eps_hi_max - algo.eps_lo) * (c <= k / 2)


clip.register(Halves())
'''


@pytest.mark.e2e
def test_a_toy_rule_from_a_plugin_trains_two_steps_and_counts_in_gapo_compare_band(tmp_path):
    """The rule lives in a file outside the package, named by `plugins`: gapo-train (launcher and rank) trains with
    it, its rollouts log its bounds, and gapo-compare band, run from another folder, finds it through the run's
    saved config."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "halves.py").write_text(TOY)
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "WANDB_SILENT": "true", "OMP_WAIT_POLICY": "PASSIVE"}
    run = tmp_path / "run"
    r = subprocess.run([str(bin_dir / "gapo-train"), "--config", "tiny_cpu", "plugins=[halves.py]",
                        "algorithm.clip=halves", "algorithm.eps_hi_max=5e-2", "trainer.total_steps=2",
                        "trainer.log_rollouts=true", "trainer.ppo_mini_batch_size=8", f"trainer.output_dir={run}"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "halves clip 1 - 3e-3 .. 1 + 0.05" in r.stderr  # the run header, in the base class's words
    records = [json.loads(x) for x in (run / "rollouts.jsonl").read_text().splitlines()]
    bounds = {(x["c"], round(x["eps_hi"], 6)) for x in records if 0 < x["c"] < x["k"]}
    assert bounds and all(b == (5e-2 if c <= 4 else 3e-3) for c, b in bounds), bounds
    # tiny_cpu's groups reach c = 1..3 only; at c = 2 or 3 GAPO's own eq. 8 would log 0.0433 or 0.0364, not 0.05
    assert any(c in (2, 3) for c, _ in bounds), bounds
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = subprocess.run([str(bin_dir / "gapo-compare"), "band", "--rules", "halves:0.003/0.05", "gspo:0.003",
                        str(run)], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "halves:0.003/0.05: 1 - 3e-3 .. 1 + eps_hi(c): 0.05 at c = 1 .. 3e-3 at c = 7" in r.stdout, r.stdout
    assert "| all correct (upper bound) |" in r.stdout
