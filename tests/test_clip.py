"""A clip rule is one object (gapo/clip.py): a toy rule added from outside the package is named by algorithm.clip and
reaches the config, the loss, gapo-compare band and the descriptions without a change anywhere else."""

from dataclasses import dataclass

import pytest
import torch
from test_losses import _batch, _logp, _mb, _reference_loss

from gapo import clip
from gapo.config import AlgorithmConfig
from gapo.study.band import Rule
from gapo.trainer.losses import StepNorm, clip_high, policy_loss


@dataclass(frozen=True)
class Halves(clip.ClipRule):
    """A toy: the widest upper width for the scarce half of the groups (c <= k/2), eps_lo for the rest."""

    name: str = "halves"
    upper_field: str = "eps_hi_max"
    constant: bool = False
    tag: str = " halves"

    def eps_hi(self, c, k, algo):
        return algo.eps_lo + (algo.eps_hi_max - algo.eps_lo) * (c <= k / 2)

    def describe(self, lo, hi):
        return f"halves: 1 + {hi} for c <= k/2, else 1 + {lo}"


@pytest.fixture
def halves(monkeypatch):
    monkeypatch.setattr(clip, "RULES", dict(clip.RULES))  # the registration ends with the test
    import gapo.config

    monkeypatch.setattr(gapo.config, "RULES", clip.RULES)
    clip.register(Halves())
    return AlgorithmConfig(is_level="sequence", clip="halves", eps_lo=3e-3, eps_hi_max=5e-3, loss_agg="token_mean")


def test_a_toy_rule_reaches_config_loss_band_and_descriptions(halves):
    algo = halves
    assert algo.upper == 5e-3 and algo.clip_range == ("3e-3", "5e-3 halves")
    assert algo.describe() == "halves: 1 + 5e-3 for c <= k/2, else 1 + 3e-3"
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
    with pytest.raises(ValueError, match=r"algorithm.clip='nope': no such clip rule; gapo.clip.RULES has fixed, "
                                         r"adaptive, cispo, halves"):
        AlgorithmConfig(is_level="sequence", clip="nope", eps_lo=3e-3, eps_hi=5e-3)
    with pytest.raises(ValueError, match="clip rule 'halves' exists already"):
        clip.register(Halves(tag=" other"))
