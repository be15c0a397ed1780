"""gapo/algorithms.py: the algorithms side by side. Every preset's loss and gradient are the values recorded before
the surrogates and aggregations moved here (tests/fixtures/preset_losses.json, written by the loss as it stood at
943695d); a surrogate from a plugin trains with no edit to gapo/."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gapo import algorithms
from gapo.algorithms import PRESETS, StepNorm, Surrogate, group_advantages
from gapo.configfile import resolve
from gapo.trainer.logprobs import MicroBatch
from gapo.trainer.losses import policy_loss

ROOT = Path(__file__).resolve().parents[1]
RECORDED = json.loads((ROOT / "tests" / "fixtures" / "preset_losses.json").read_text())


def batch(seed=0, B=16, T=9, V=11):
    """The recording's batch: 4 groups of 4, ragged lengths, pi_old 0.05 away from pi (float64)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    old = logits + 0.05 * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).to(torch.float64)
    old_logp = torch.log_softmax(old, -1).gather(-1, tokens[..., None]).squeeze(-1)
    rewards = (torch.rand(B, generator=g) < 0.4).to(torch.float64)
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    return logp, mask, old_logp, rewards


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_presets_loss_and_gradient_are_as_recorded_before_the_move(name):
    algo = resolve({"algorithm": {"name": name}}).algorithm
    logp, mask, old_logp, rewards = batch()
    ga = group_advantages(rewards, [4] * 4, std_normalize=algo.std_normalize, focal_gamma=algo.focal_gamma,
                          correct_threshold=algo.correct_threshold)
    logp.requires_grad_(True)
    none = torch.zeros(0, dtype=torch.long)
    mb = MicroBatch(none, none, none, none, mask, old_logp=old_logp, adv=ga.adv.to(torch.float64), c=ga.c, k=ga.k)
    loss, stats = policy_loss(logp, mb, StepNorm(tokens=float(mask.sum()), seqs=16.0, constant=9.0), algo)
    loss.backward()
    want = RECORDED[name]
    assert ga.adv.tolist() == want["adv"]
    assert loss.item() == want["loss"] and logp.grad.flatten().tolist() == want["grad"]  # bit for bit
    assert (stats.clip_hi_tokens.tolist(), stats.clip_lo_tokens.tolist()) == (want["clip_hi_tokens"],
                                                                              want["clip_lo_tokens"])


def test_a_taken_name_is_refused():
    with pytest.raises(ValueError, match="surrogate 'ppo' exists already"):
        algorithms.register_surrogate("ppo", Surrogate(algorithms.cispo))
    with pytest.raises(ValueError, match="loss aggregation 'token_mean' exists already"):
        algorithms.register_aggregation("token_mean", algorithms.seq_sum_constant)
    with pytest.raises(Exception, match=r"algorithm.surrogate='nope': not in gapo.algorithms.SURROGATES \(ppo, cispo"):
        resolve({"algorithm": {"name": "gapo", "surrogate": "nope"}})


def test_the_surrogate_follows_the_clip_rule_unless_named():
    """CISPO's bounds are for CISPO's loss: a config that picks clip=cispo on another preset trains CISPO (as when
    the rule switched the formula), and algorithm.surrogate overrides either way."""
    def algo(**a):
        return resolve({"algorithm": a}).algorithm

    assert algo(name="dapo", clip="cispo", eps_lo=1.0, eps_hi=4.0).surrogate == "cispo"
    assert algo(name="cispo").surrogate == "cispo" and algo(name="gapo").surrogate == "ppo"
    assert algo(name="cispo", surrogate="ppo").surrogate == "ppo"
    assert algo(name="cispo").bounds_the_weight and not algo(name="dapo").bounds_the_weight


TOY = '''from gapo.algorithms import Surrogate, register_surrogate


def still(rho, logp, a, lo, hi):
    """A surrogate that teaches nothing: a zero loss with a zero gradient, which each step's grad_norm shows."""
    return 0.0 * rho, rho.detach() > hi, rho.detach() < lo


register_surrogate("still", Surrogate(still))
'''


@pytest.mark.e2e
def test_a_toy_surrogate_from_a_plugin_trains_two_steps(tmp_path):
    """Defined in a file outside the package and named by `plugins` and algorithm.surrogate: gapo-train's launcher
    and rank resolve it, the loss applies it (every step's gradient is exactly zero, GAPO's never is), and the run's
    saved config names it."""
    (tmp_path / "still.py").write_text(TOY)
    run = tmp_path / "run"
    env = {**os.environ, "WANDB_SILENT": "true", "OMP_WAIT_POLICY": "PASSIVE"}
    r = subprocess.run([str(Path(sys.executable).parent / "gapo-train"), "--config", "tiny_cpu", "plugins=[still.py]",
                        "algorithm.surrogate=still", "trainer.total_steps=2", "tracking.mode=disabled",
                        f"trainer.output_dir={run}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"reward/mean"' in x]
    assert [x["step"] for x in rows] == [1, 2] and all(x["grad_norm"] == 0.0 for x in rows), rows
    assert "surrogate: still" in (run / "config.yaml").read_text()
