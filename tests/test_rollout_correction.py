"""The sampler-trainer correction (algorithm.rollout_correction): r = pi_old / pi_rollout turned into detached
weights and a keep-mask, for every mode at token and sequence level, checked against hand-computed values; how it
composes with every clip rule and with the step's normaliser; and its metrics."""

import math

import pytest
import torch

from gapo.config import AlgorithmConfig, RolloutCorrection
from gapo.configfile import find_config_file, load_config
from gapo.errors import ConfigError
from gapo.trainer.logprobs import MicroBatch
from gapo.trainer.losses import (
    MAX_LOG_RATIO,
    StepNorm,
    policy_loss,
    rollout_weights,
)
from gapo.trainer.step_metrics import mismatch_metrics, mismatch_stats

# Two responses: 3 tokens and 2 tokens (the second's third position is padding).
LOG_R = torch.tensor([[0.1, -0.2, 1.0], [0.05, -0.05, 9.0]])  # log pi_old - log pi_rollout; 9.0 is padding
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
ROLL = torch.full((2, 3), -2.0)
OLD = ROLL + LOG_R


def flat(x) -> list[float]:
    return torch.as_tensor(x, dtype=torch.float64).flatten().tolist()


def rc(**kw) -> RolloutCorrection:
    return RolloutCorrection(**kw)


def test_token_truncate_caps_the_ratio():
    w, keep = rollout_weights(OLD, ROLL, MASK, rc(mode="truncate", level="token", cap=2.0))
    want = [[math.exp(0.1), math.exp(-0.2), 2.0], [math.exp(0.05), math.exp(-0.05), 0.0]]
    assert flat(w) == pytest.approx(flat(want)) and keep.tolist() == [[True] * 3, [True, True, False]]


def test_sequence_truncate_caps_the_product():
    w, keep = rollout_weights(OLD, ROLL, MASK, rc(mode="truncate", level="sequence", cap=2.0))
    first, second = min(math.exp(0.1 - 0.2 + 1.0), 2.0), math.exp(0.0)  # 2.46 -> 2; exp(0) = 1
    assert flat(w) == pytest.approx(flat([[first] * 3, [second, second, 0.0]])) and keep.sum() == 5


def test_token_mask_keeps_the_band_with_its_ratio_as_weight():
    w, keep = rollout_weights(OLD, ROLL, MASK, rc(mode="mask", level="token", mask_low=0.85, mask_high=2.0))
    # exp(-0.2) = 0.819 < 0.85 and exp(1.0) = 2.72 > 2 are masked; the others keep weight r.
    assert keep.tolist() == [[True, False, False], [True, True, False]]
    assert flat(w) == pytest.approx(flat([[math.exp(0.1), 0, 0], [math.exp(0.05), math.exp(-0.05), 0]]))


def test_sequence_mask_by_the_geometric_mean():
    w, keep = rollout_weights(OLD, ROLL, MASK, rc(mode="mask", level="sequence", mask_low=0.5, mask_high=1.3))
    g1 = math.exp((0.1 - 0.2 + 1.0) / 3)  # 1.35 > 1.3: the whole first sequence goes
    assert g1 > 1.3
    assert keep.tolist() == [[False] * 3, [True, True, False]]
    assert flat(w) == pytest.approx(flat([[0.0] * 3, [1.0, 1.0, 0.0]]))


def test_a_long_response_inside_the_band_token_by_token_stays_although_its_product_leaves_it():
    """Sequence-level masking tests the geometric mean, which does not tighten with length: 200 tokens each with
    ratio 1.05 have a product of ~1.7e4 (far out of [0.5, 2]) and a geometric mean of 1.05 (inside). A product
    test would drop this response; the geometric mean keeps it, with weight 1.05 on every token."""
    log_r = torch.full((1, 200), math.log(1.05))
    mask = torch.ones(1, 200)
    rollout = torch.full((1, 200), -1.0)
    assert math.exp(float(log_r.sum())) > 1e4
    w, keep = rollout_weights(rollout + log_r, rollout, mask, rc(mode="mask", level="sequence", mask_low=0.5,
                                                                 mask_high=2.0))
    assert bool(keep.all()) and flat(w) == pytest.approx([1.05] * 200)


def test_reject_by_the_k3_divergence():
    k3 = lambda x: math.exp(x) - 1 - x  # noqa: E731
    w, keep = rollout_weights(OLD, ROLL, MASK, rc(mode="reject", level="token", kl_max=0.01))
    assert [k3(x) <= 0.01 for x in (0.1, -0.2, 1.0)] == [True, False, False]
    assert keep.tolist() == [[True, False, False], [True, True, False]] and w.tolist()[1] == [1.0, 1.0, 0.0]
    w, keep = rollout_weights(OLD, ROLL, MASK, rc(mode="reject", level="sequence", kl_max=0.01))
    assert (k3(0.1) + k3(-0.2) + k3(1.0)) / 3 > 0.01 and (k3(0.05) + k3(-0.05)) / 2 <= 0.01
    assert keep.tolist() == [[False] * 3, [True, True, False]]


@pytest.mark.parametrize("mode", ["truncate", "mask", "reject"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_extreme_ratios_and_empty_responses_stay_finite(mode, level):
    old = torch.tensor([[200.0, -300.0, 0.0], [0.0, 0.0, 0.0]])
    roll = torch.tensor([[-200.0, 300.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])  # the second response is empty
    w, keep = rollout_weights(old, roll, mask, rc(mode=mode, level=level, cap=2.0))
    assert torch.isfinite(w).all() and not keep[1].any() and (w[1] == 0).all()
    assert w.max() <= max(2.0, math.exp(MAX_LOG_RATIO))
    s = mismatch_stats(old, roll, mask, torch.tensor([1, 1]), w, keep)
    assert all(math.isfinite(v) for v in mismatch_metrics(s, correction=True).values())


def _mb(mask, adv):
    none = torch.zeros(0, dtype=torch.long)
    old = torch.zeros(mask.shape)
    return MicroBatch(none, none, none, none, mask.clone(), old_logp=old, adv=torch.tensor(adv),
                      c=torch.tensor([1, 1]), k=torch.tensor([8, 8]))


@pytest.mark.parametrize("name", ["gapo", "gspo", "grpo", "cispo"])
def test_the_weight_multiplies_the_surrogate_of_every_clip_rule(name):
    """Clipping acts on pi_theta / pi_old as without the correction; the weight scales each token's term."""
    from gapo.configfile import resolve

    algo: AlgorithmConfig = resolve({"algorithm": {"name": name}}).algorithm
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    w = torch.tensor([[0.5, 1.5, 2.0], [1.0, 0.25, 0.0]])
    # Row 0 (A > 0) moved up: its token 0 passes CISPO's cap of 5, tokens 0 and 2 a bound of 1.2, and its sequence ratio
    # (~2) every sequence bound; row 1 (A < 0) stays inside every bound.
    logp = torch.tensor([[1.8, 0.0, 0.25], [0.001, -0.002, 0.0]])
    grads = []
    for weight in (None, w):
        lp = logp.clone().requires_grad_(True)
        mb = _mb(mask, [0.875, -0.125])
        mb.rollout_w = weight
        loss, stats = policy_loss(lp, mb, StepNorm(5.0, 2.0, 8.0), algo)
        loss.backward()
        grads.append((lp.grad.clone(), stats.clip_hi_tokens.clone(), stats.clip_lo_tokens.clone()))
    (g0, hi0, lo0), (g1, hi1, lo1) = grads
    assert float(hi0.sum() + lo0.sum()) > 0 and bool((g0 != 0).any())  # this rule clips here, and not everything
    torch.testing.assert_close(g1, g0 * w, atol=1e-7, rtol=1e-6)  # each token's term, scaled by its weight
    assert torch.equal(hi0, hi1) and torch.equal(lo0, lo1)  # the clip decisions do not move


def test_masked_tokens_leave_the_normaliser():
    """As the loop applies it: masked tokens leave the loss mask before the step's token count is taken, so the
    kept tokens' loss is their mean over kept tokens (not over all, which would shrink it as masking grows); the
    forward's mask (resp_mask) keeps them, so both passes project the same tokens."""
    from gapo.configfile import resolve

    algo = resolve({"algorithm": {"name": "grpo"}}).algorithm
    mb = _mb(MASK, [1.0, 1.0])
    w, keep = rollout_weights(OLD, ROLL, MASK, rc(mode="mask", level="token", mask_low=0.85, mask_high=2.0))
    mb.rollout_w, mb.loss_mask = w, mb.resp_mask * keep
    assert torch.equal(mb.resp_mask, MASK)
    norm = StepNorm(tokens=float(mb.in_loss.sum()), seqs=2.0)
    assert norm.tokens == 3.0  # 5 response tokens, 2 masked
    logp = torch.zeros(2, 3, requires_grad=True)  # ratio 1: the surrogate is -A * rho per token
    loss, _ = policy_loss(logp, mb, norm, algo)
    want = -(math.exp(0.1) + math.exp(0.05) + math.exp(-0.05)) / 3
    assert float(loss.detach()) == pytest.approx(want)


def test_metrics_by_hand():
    w, keep = rollout_weights(OLD, ROLL, MASK, rc(mode="truncate", level="token", cap=2.0))
    m = mismatch_metrics(mismatch_stats(OLD, ROLL, MASK, torch.tensor([1, 3]), w, keep, cap=2.0), correction=True)
    d = [0.1, -0.2, 1.0, 0.05, -0.05]
    assert m["logprob_mismatch/kl_k1"] == pytest.approx(-sum(d) / 5)
    assert m["logprob_mismatch/kl_k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 5)
    assert m["logprob_mismatch/first_token_abs"] == pytest.approx((0.1 + 0.05) / 2)
    assert m["logprob_mismatch/last_token_abs"] == pytest.approx((1.0 + 0.05) / 2)
    # fifths: 3 tokens fall in bins 0, 1, 3; 2 tokens in bins 0, 2
    assert m["logprob_mismatch/pos1"] == pytest.approx((0.1 + 0.05) / 2) and m["logprob_mismatch/pos5"] == 0.0
    assert m["rollout_is/truncated_token_frac"] == pytest.approx(1 / 5) and m["rollout_is/masked_token_frac"] == 0
    assert m["rollout_is/weight_max"] == pytest.approx(2.0)
    assert m["rollout_is/weight_mean"] == pytest.approx((math.exp(0.1) + math.exp(-0.2) + 2 + math.exp(0.05)
                                                        + math.exp(-0.05)) / 5)
    # One sequence of two has its token 2 capped (log r = 1.0 > log 2): that one is the c = 1 rollout.
    assert m["rollout_is/truncated_seq_frac"] == 0.5 and m["rollout_is/masked_seq_frac"] == 0
    assert m["rollout_is/truncated_token_frac/c1"] == pytest.approx(1 / 3)
    assert m["rollout_is/truncated_seq_frac/c1"] == 1 and m["rollout_is/truncated_seq_frac/c3"] == 0
    assert m["rollout_is/weight_max/c1"] == pytest.approx(2.0)
    assert m["rollout_is/weight_max/c3"] == pytest.approx(math.exp(0.05))
    assert m["logprob_mismatch/kl_k1/c3"] == pytest.approx(-(0.05 - 0.05) / 2)
    # Sequence level: row 0's ratios multiply to e^0.9 > 2, so its weight is the cap (exp(log 2), a rounding
    # below 2 in float32) on each of its 3 tokens; row 1's multiply to 1.
    w, keep = rollout_weights(OLD, ROLL, MASK, rc(mode="truncate", level="sequence", cap=2.0))
    seq = mismatch_metrics(mismatch_stats(OLD, ROLL, MASK, torch.tensor([1, 3]), w, keep, cap=2.0), correction=True)
    assert seq["rollout_is/truncated_token_frac"] == pytest.approx(3 / 5)
    assert seq["rollout_is/truncated_seq_frac"] == 0.5
    per_c = {"masked_token_frac", "masked_seq_frac", "truncated_token_frac", "truncated_seq_frac", "weight_mean",
             "weight_max"}
    assert {k for k in m if k.endswith(("/c1", "/c3"))} == {
        f"{name}/c{c}" for c in (1, 3) for name in ["logprob_mismatch/kl_k1", "logprob_mismatch/kl_k3",
                                                     *(f"rollout_is/{x}" for x in per_c)]}
    assert not any(k.startswith("rollout_is/") for k in mismatch_metrics(mismatch_stats(OLD, ROLL, MASK,
                                                                                         torch.tensor([1, 3])), False))


def test_off_in_the_paper_configs_and_refused_without_a_trainer_pass():
    for name in ("qwen_math", "llama_math", "r1_distill_math", "deepcoder", "gspo_intervention"):
        assert load_config(name).algorithm.rollout_correction.mode == "off"
    with pytest.raises(ConfigError, match="rollout.use_engine_logprobs=true pi_old is the engine's"):
        load_config("demo_cpu", ["algorithm.rollout_correction.mode=truncate"])
    with pytest.raises(ConfigError, match="mask_low=2.0 must be below mask_high=2.0"):
        load_config("tiny_cpu", ["algorithm.rollout_correction.mask_low=2.0"])


def test_off_written_bare_is_the_mode_not_a_boolean(tmp_path):
    """YAML 1.1 reads a bare `off` as false, on the command line and in a file alike."""
    assert load_config("tiny_cpu", ["algorithm.rollout_correction.mode=off"]).algorithm.rollout_correction.mode == "off"
    f = tmp_path / "c.yaml"
    f.write_text(f"base: {find_config_file('tiny_cpu')}\nalgorithm:\n  rollout_correction:\n    mode: off\n")
    assert load_config(f).algorithm.rollout_correction.mode == "off"
    with pytest.raises(ConfigError, match="algorithm.rollout_correction.mode"):
        load_config("tiny_cpu", ["algorithm.rollout_correction.mode=on"])
