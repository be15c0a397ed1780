"""The algorithm core against hand-computed values, naive references, finite differences and splits."""

import math

import numpy as np
import pytest
import torch

from gapo.algorithms import StepNorm, group_advantages
from gapo.clip import adaptive_eps_hi
from gapo.config import AlgorithmConfig
from gapo.reward.types import FLAG_UNISOLATED, RewardResult, status_counts
from gapo.trainer.logprobs import MicroBatch
from gapo.trainer.losses import (
    RolloutStats,
    clip_high,
    kl_penalty,
    policy_loss,
)
from gapo.trainer.step_metrics import RankStep, group_metrics, loss_metrics, update_metrics

# ---------------------------------------------------------------- eq. 8


def eq8(c, k, eps_lo, eps_hi_max):
    """Eq. 8 as the loss reads it: clip_high under GAPO's adaptive rule."""
    return clip_high(torch.as_tensor(c), torch.as_tensor(k), _algo(clip="adaptive", eps_lo=eps_lo, upper=eps_hi_max))


@pytest.mark.parametrize(
    "k, eps_lo, eps_hi_max, expected",
    [
        # k = 4, token-IS values 0.2 / 0.28: 0.2 + 0.08 * (4 - c) / 3
        (4, 0.2, 0.28, {1: 0.28, 2: 0.2 + 0.08 * 2 / 3, 3: 0.2 + 0.08 / 3}),
        # k = 8, the paper's Qwen values 3e-3 / 5e-3, worked by hand: 3e-3 + 2e-3 * (8 - c) / 7
        (8, 3e-3, 5e-3, {1: 5.0e-3, 2: 4.714285714e-3, 3: 4.428571429e-3, 4: 4.142857143e-3,
                         5: 3.857142857e-3, 6: 3.571428571e-3, 7: 3.285714286e-3}),
        # k = 8, the DS-R1-distill values 7e-5 / 3e-4
        (8, 7e-5, 3e-4, {1: 3e-4, 4: 7e-5 + 2.3e-4 * 4 / 7, 7: 7e-5 + 2.3e-4 / 7}),
    ],
)
def test_clip_high_table(k, eps_lo, eps_hi_max, expected):
    cs = torch.tensor(list(expected))
    got = eq8(cs, k, eps_lo, eps_hi_max)
    np.testing.assert_allclose(got.numpy(), list(expected.values()), rtol=1e-9)


def test_clip_high_monotone_per_group_size_and_edges():
    c = torch.tensor([0, 1, 2, 3, 4, 0, 2, 8])
    k = torch.tensor([4, 4, 4, 4, 4, 8, 8, 8])
    got = eq8(c, k, 0.2, 0.28)
    assert got[0] == pytest.approx(0.28) and got[4] == pytest.approx(0.2)  # c = 0 and c = k stay in range
    assert got[7] == pytest.approx(0.2)
    assert torch.all(got[1:4].diff() < 0)  # more correct -> tighter bound
    assert got[6] == pytest.approx(0.2 + 0.08 * 6 / 7)  # k differs per element


def test_clip_high_rejects_k_below_two():
    with pytest.raises(ValueError, match="k must be >= 2"):
        eq8(torch.tensor([1]), torch.tensor([1]), 0.2, 0.28)


# ---------------------------------------------------------------- advantages


def test_dr_grpo_advantage_is_k_minus_c_over_k():
    rewards = torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 1])
    ga = group_advantages(rewards, [8, 8])
    assert ga.adv[0] == pytest.approx(7 / 8) and ga.adv[1] == pytest.approx(-1 / 8)
    assert ga.adv[8] == pytest.approx(1 / 8) and ga.adv[14] == pytest.approx(-7 / 8)
    assert ga.c.tolist() == [1] * 8 + [7] * 8 and ga.k.tolist() == [8] * 16
    assert torch.equal(ga.correct, rewards >= 1)


def test_uneven_groups_std_and_uniform_groups():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    ga = group_advantages(rewards, [3, 2, 4, 1], std_normalize=True)
    g1 = np.array([1.0, 0, 0])
    np.testing.assert_allclose(ga.adv[:3].numpy(), (g1 - g1.mean()) / (g1.std(ddof=1) + 1e-6), rtol=1e-5)
    assert torch.all(ga.adv[3:5] == 0) and torch.all(ga.adv[5:9] == 0) and ga.adv[9] == 0  # uniform groups
    assert ga.c.tolist() == [1, 1, 1, 2, 2, 0, 0, 0, 0, 1] and ga.k.tolist() == [3, 3, 3, 2, 2, 4, 4, 4, 4, 1]


def test_focal_shaping():
    rewards = torch.tensor([1.0, 1.0] + [0.0] * 6)
    plain = group_advantages(rewards, [8])
    focal = group_advantages(rewards, [8], focal_gamma=2.0)
    np.testing.assert_allclose(focal.adv.numpy(), plain.adv.numpy() * (1 - 2 / 8) ** 2, rtol=1e-6)
    assert plain.adv[0] == pytest.approx(6 / 8)


def test_correct_threshold_and_group_metrics():
    ga = group_advantages(torch.tensor([0.6, 0.4, 1.0, 1.0, 0.0, 0.0]), [2, 2, 2], correct_threshold=0.5)
    assert ga.c.tolist() == [1, 1, 2, 2, 0, 0]
    m = group_metrics(ga.c, ga.k)
    assert m == {"group/all_correct_frac": pytest.approx(1 / 3), "group/all_wrong_frac": pytest.approx(1 / 3)}


def test_group_sizes_must_match():
    with pytest.raises(ValueError, match="sum to 7"):
        group_advantages(torch.zeros(8), [4, 3])


# ---------------------------------------------------------------- surrogate: reference and gradients


def _batch(B=12, T=9, V=11, seed=0, dtype=torch.float64, spread=0.05):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=dtype)
    old_logits = logits + spread * torch.randn(B, T, V, generator=g, dtype=dtype)
    tokens = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).to(dtype)
    old_logp = torch.log_softmax(old_logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    rewards = (torch.rand(B, generator=g) < 0.4).to(dtype)
    ga = group_advantages(rewards, [4] * (B // 4))
    return logits, tokens, mask, old_logp, ga


def _logp(logits, tokens):
    return torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)


def _algo(is_level="sequence", clip="fixed", eps_lo=0.2, upper=0.28, loss_agg="token_mean", kl_coef=0.0):
    """A resolved algorithm; `upper` is the rule's upper width (eps_hi_max when adaptive, else eps_hi)."""
    bound = {"eps_hi_max": upper} if clip == "adaptive" else {"eps_hi": upper}
    return AlgorithmConfig(is_level=is_level, clip=clip, eps_lo=eps_lo, loss_agg=loss_agg, kl_coef=kl_coef,
                           surrogate="cispo" if clip == "cispo" else "ppo", **bound)


def _mb(mask, old_logp, adv, c, k, ref_logp=None):
    """A micro-batch as the loss sees it: mask, old log-probs and per-rollout numbers (it never reads the
    forward's inputs, which are left empty here)."""
    none = torch.zeros(0, dtype=torch.long)
    return MicroBatch(none, none, none, none, mask, old_logp=old_logp, adv=adv, c=c, k=k, ref_logp=ref_logp)


def _reference_loss(logp, old_logp, mask, adv, eps_lo, eps_hi, is_level, n_tokens_total):
    """Straight from the paper's formula, one rollout at a time, no vectorisation tricks. The sequence
    form is GSPO's own: s_i = exp(mean log-ratio) with its gradient, weighted by |y_i| under token-mean."""
    total = 0.0
    for i in range(logp.shape[0]):
        n = int(mask[i].sum())
        lr = logp[i, :n] - old_logp[i, :n]
        hi = float(eps_hi[i]) if torch.is_tensor(eps_hi) else eps_hi
        a = float(adv[i])
        if is_level == "token":
            rho = torch.exp(lr)
            total = total + torch.maximum(-a * rho, -a * rho.clamp(1 - eps_lo, 1 + hi)).sum()
        else:
            s = torch.exp(lr.mean())
            total = total + n * torch.maximum(-a * s, -a * s.clamp(1 - eps_lo, 1 + hi))
    return total / n_tokens_total


@pytest.mark.parametrize("is_level", ["token", "sequence"])
@pytest.mark.parametrize("adaptive", [False, True])
def test_loss_and_gradient_match_reference(is_level, adaptive):
    logits, tokens, mask, old_logp, ga = _batch(spread=0.3 if is_level == "token" else 0.02)
    eps_lo, eps_hi_max = (0.2, 0.28) if is_level == "token" else (3e-3, 5e-3)
    eps_hi = eq8(ga.c, ga.k, eps_lo, eps_hi_max) if adaptive else eps_hi_max
    norm = StepNorm(tokens=float(mask.sum()), seqs=float(mask.shape[0]))
    algo = _algo(is_level, "adaptive" if adaptive else "fixed", eps_lo, eps_hi_max)

    p1 = logits.clone().requires_grad_(True)
    loss, stats = policy_loss(_logp(p1, tokens), _mb(mask, old_logp, ga.adv.double(), ga.c, ga.k), norm, algo)
    loss.backward()
    p2 = logits.clone().requires_grad_(True)
    ref = _reference_loss(_logp(p2, tokens), old_logp, mask, ga.adv.double(), eps_lo, eps_hi, is_level, norm.tokens)
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(p1.grad, p2.grad, rtol=1e-9, atol=1e-12)
    assert p1.grad.abs().sum() > 0
    # The data really exercises clipping: some rollouts/tokens are clipped and some are not.
    assert 0 < stats.clip_hi_tokens.sum() + stats.clip_lo_tokens.sum() < mask.sum()


@pytest.mark.parametrize("is_level", ["token", "sequence"])
def test_gradient_matches_finite_differences(is_level):
    logits, tokens, mask, old_logp, ga = _batch(B=8, T=5, V=6, seed=3, spread=0.2 if is_level == "token" else 0.01)
    algo = _algo("sequence", "adaptive", 3e-3, 5e-3) if is_level == "sequence" else _algo("token", "fixed", 0.2, 0.28)
    norm = StepNorm(tokens=float(mask.sum()), seqs=8.0)

    def f(x):
        return policy_loss(_logp(x, tokens), _mb(mask, old_logp, ga.adv.double(), ga.c, ga.k), norm, algo)[0]

    x = logits.clone().requires_grad_(True)
    f(x).backward()
    h = 1e-6
    g = torch.Generator().manual_seed(1)
    for _ in range(25):
        idx = tuple(int(torch.randint(0, s, (1,), generator=g)) for s in logits.shape)
        xp, xm = logits.clone(), logits.clone()
        xp[idx] += h
        xm[idx] -= h
        fd = (f(xp) - f(xm)).item() / (2 * h)
        assert x.grad[idx].item() == pytest.approx(fd, rel=1e-5, abs=1e-9)


def _single(adv, c, ratio, eps_hi=None, is_level="sequence", n=4):
    """One rollout (of a group of 8) of n tokens whose IS ratio is `ratio` everywhere, eps_lo = 3e-3, a fixed
    upper bound eps_hi or (None) GAPO's adaptive one up to 5e-3; returns (grad wrt logp, stats)."""
    old = torch.full((1, n), -2.0, dtype=torch.float64)
    logp = (old + math.log(ratio)).requires_grad_(True)
    mask = torch.ones(1, n, dtype=torch.float64)
    algo = _algo(is_level, "adaptive", 3e-3, 5e-3) if eps_hi is None else _algo(is_level, "fixed", 3e-3, eps_hi)
    loss, stats = policy_loss(logp, _mb(mask, old, torch.tensor([adv]), torch.tensor([c]), torch.tensor([8])),
                              StepNorm(tokens=n, seqs=1), algo)
    loss.backward()
    return logp.grad, stats


def test_low_c_correct_rollout_is_not_clipped_where_fixed_clip_would():
    # c = 1: A = 7/8, ratio 1.004 lies past GSPO's 1 + 3e-3 but inside GAPO's 1 + 5e-3.
    assert eq8(torch.tensor([1]), 8, 3e-3, 5e-3).item() == pytest.approx(5e-3)
    g_gapo, s_gapo = _single(7 / 8, 1, 1.004)  # the adaptive rule picks eps_hi(c = 1)
    g_fixed, s_fixed = _single(7 / 8, 1, 1.004, 3e-3)
    assert torch.all(g_gapo < 0) and s_gapo.clip_hi_tokens.item() == 0  # still pushes logp up
    assert torch.all(g_fixed == 0) and s_fixed.clip_hi_tokens.item() == 4


def test_high_c_correct_rollout_is_clipped_where_wide_fixed_clip_is_not():
    # c = 7: A = 1/8, GAPO's bound is 1 + 3.29e-3; GSPO-asym's fixed 1 + 5e-3 lets 1.004 through.
    assert eq8(torch.tensor([7]), 8, 3e-3, 5e-3).item() == pytest.approx(3e-3 + 2e-3 / 7)
    g_gapo, _ = _single(1 / 8, 7, 1.004)  # the adaptive rule picks eps_hi(c = 7)
    g_asym, _ = _single(1 / 8, 7, 1.004, 5e-3)
    assert torch.all(g_gapo == 0) and torch.all(g_asym < 0)


def test_negative_advantage_uses_lower_bound_only():
    g_in, _ = _single(-1 / 8, 1, 0.998, 5e-3)  # 0.998 > 1 - 3e-3: inside
    g_out, s_out = _single(-1 / 8, 1, 0.996, 5e-3)  # below 1 - 3e-3: clipped
    g_up, _ = _single(-1 / 8, 1, 1.5, 5e-3)  # a negative rollout is never clipped from above
    assert torch.all(g_in > 0) and torch.all(g_out == 0) and torch.all(g_up > 0)
    assert s_out.clip_lo_tokens.item() == 4 and s_out.clip_hi_tokens.item() == 0


def test_cispo_keeps_gradient_with_capped_weight():
    old = torch.full((1, 3), -1.0, dtype=torch.float64)
    logp = (old + math.log(3.0)).requires_grad_(True)  # rho = 3 > 1 + eps_hi
    mask = torch.ones(1, 3, dtype=torch.float64)
    loss, stats = policy_loss(logp, _mb(mask, old, torch.tensor([0.5]), torch.tensor([1]), torch.tensor([2])),
                              StepNorm(tokens=3, seqs=1), _algo("token", "cispo", 1.0, 1.0))
    loss.backward()
    # d/dlogp of -sg(min(rho, 2)) * A * logp / N = -2 * 0.5 / 3 per token: capped weight, gradient kept
    torch.testing.assert_close(logp.grad, torch.full((1, 3), -1.0 / 3, dtype=torch.float64))
    assert stats.clip_hi_tokens.item() == 3


def test_overflowing_log_ratio_stays_finite():
    old = torch.full((2, 3), -200.0, dtype=torch.float64)
    logp = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)  # log-ratio 200: exp would overflow
    for level in ("token", "sequence"):
        loss, _ = policy_loss(logp, _mb(torch.ones(2, 3), old, torch.tensor([1.0, -1.0]), torch.tensor([1, 1]),
                                        torch.tensor([2, 2])), StepNorm(6, 2), _algo(level, "fixed", 0.2, 0.28))
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()


def test_clip_rule_picks_each_rollouts_upper_bound():
    c, k = torch.tensor([0, 1, 2, 3, 4]), torch.tensor([4] * 5)
    adaptive = clip_high(c, k, _algo(clip="adaptive", eps_lo=0.2, upper=0.28))
    assert torch.allclose(adaptive, adaptive_eps_hi(c.clamp(min=1).double(), k.double(), 0.2, 0.28))  # eq. 8
    assert clip_high(c, k, _algo(clip="fixed", eps_lo=0.2, upper=0.25)).tolist() == [0.25] * 5
    with pytest.raises(ValueError, match="the fixed rule .* has no such bound; its upper bound is algorithm.eps_hi"):
        AlgorithmConfig(clip="fixed", eps_lo=0.2, eps_hi=0.25, eps_hi_max=0.3)  # one shape per rule
    assert clip_high(c, k, _algo("token", "cispo", 1.0, 4.0)).tolist() == [4.0] * 5  # CISPO's weight cap


def test_kl_penalty_joins_the_surrogate_with_its_coefficient():
    logits, tokens, mask, old_logp, ga = _batch(seed=4)
    ref = old_logp + 0.1 * torch.randn(old_logp.shape, generator=torch.Generator().manual_seed(1), dtype=old_logp.dtype)
    mb = _mb(mask, old_logp, ga.adv.double(), ga.c, ga.k, ref_logp=ref)
    norm = StepNorm(float(mask.sum()), 12.0)
    logp = _logp(logits, tokens)
    plain, _ = policy_loss(logp, mb, norm, _algo())
    with_kl, _ = policy_loss(logp, mb, norm, _algo(kl_coef=0.3))
    assert float(kl_penalty(logp, ref, mask, norm)) > 0
    assert with_kl.item() == pytest.approx(plain.item() + 0.3 * kl_penalty(logp, ref, mask, norm).item(), rel=1e-12)


# ---------------------------------------------------------------- invariance to micro-batches and ranks


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean", "seq_sum_constant"])
@pytest.mark.parametrize("is_level", ["token", "sequence"])
def test_gradient_invariant_to_micro_batches_and_ranks(dtype, tol, loss_agg, is_level):
    logits, tokens, mask, old_logp, ga = _batch(B=16, T=7, V=9, seed=5, dtype=dtype, spread=0.1)
    algo = _algo(is_level, "adaptive", 0.2, 0.28, loss_agg=loss_agg)
    norm = StepNorm(tokens=float(mask.sum()), seqs=16.0, constant=7.0)

    def grad_of(splits):
        """splits: list of ranks, each a list of micro-batch index ranges; gradients summed as DP all-reduce."""
        total = torch.zeros_like(logits)
        for rank in splits:
            p = logits.clone().requires_grad_(True)
            for lo, hi in rank:
                sl = slice(lo, hi)
                mb = _mb(mask[sl], old_logp[sl], ga.adv[sl].to(dtype), ga.c[sl], ga.k[sl])
                loss, _ = policy_loss(_logp(p[sl], tokens[sl]), mb, norm, algo)
                loss.backward()
            total += p.grad
        return total

    full = grad_of([[(0, 16)]])
    assert full.abs().max() > 0
    for splits in ([[(0, 8), (8, 16)]], [[(0, 4), (4, 8), (8, 12), (12, 16)]],
                   [[(0, 8)], [(8, 16)]], [[(0, 4), (4, 8)], [(8, 12), (12, 16)]]):
        torch.testing.assert_close(grad_of(splits), full, rtol=tol, atol=tol)


# ---------------------------------------------------------------- metrics


def _stats(seq_ratio, adv, c, k, n_tok, hi, lo):
    t = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    return RolloutStats(seq_log_ratio=torch.log(t(seq_ratio)), adv=t(adv), c=torch.tensor(c), k=torch.tensor(k),
                        n_tokens=t(n_tok), clip_hi_tokens=t(hi), clip_lo_tokens=t(lo), kl_sum=t([0.1] * len(adv)))


def test_loss_metrics_by_c_token_and_sequence_units():
    s = _stats(seq_ratio=[1.3, 1.1, 1.05, 0.9, 1.0], adv=[0.875, 0.5, 0.5, -0.5, 0.0], c=[1, 4, 4, 4, 8],
               k=[8, 8, 8, 8, 8], n_tok=[10, 4, 6, 5, 3], hi=[10, 1, 0, 0, 0], lo=[0, 0, 0, 5, 0])
    tok = loss_metrics(s, "token")
    assert tok["clip_frac/c1"] == pytest.approx(1.0)
    assert tok["clip_frac/c4"] == pytest.approx(1 / 10)  # 1 of the 4 + 6 tokens of correct c = 4 rollouts
    assert tok["clip_frac"] == pytest.approx(16 / 28) and tok["clip_frac/low"] == pytest.approx(5 / 28)
    assert tok["is_ratio/c4"] == pytest.approx((1.1 + 1.05) / 2, rel=1e-6)
    assert "clip_frac/c8" not in tok and "clip_frac/c2" not in tok
    seq = loss_metrics(s, "sequence")
    assert seq["clip_frac/c4"] == pytest.approx(1 / 2) and seq["clip_frac"] == pytest.approx(3 / 5)
    expected_r = np.corrcoef([1.3, 1.1, 1.05, 0.9], [0.875, 0.5, 0.5, -0.5])[0, 1]  # A = 0 rollout excluded
    assert seq["is_adv_corr"] == pytest.approx(expected_r, rel=1e-5)
    assert seq["approx_kl"] == pytest.approx(0.5 / 28, rel=1e-6)


def test_metrics_from_a_real_loss_evaluation():
    logits, tokens, mask, old_logp, ga = _batch(B=16, T=8, V=7, seed=9, spread=0.05)
    _, stats = policy_loss(_logp(logits, tokens), _mb(mask, old_logp, ga.adv.double(), ga.c, ga.k),
                           StepNorm(float(mask.sum()), 16.0), _algo("sequence", "fixed", 3e-3, 5e-3))
    m = loss_metrics(stats, "sequence")
    r = torch.exp(stats.seq_log_ratio.double())
    expected_hi = ((ga.adv > 0) & (r > 1 + 5e-3)).double().mean()
    assert m["clip_frac/high"] == pytest.approx(float(expected_hi))
    assert m["approx_kl"] > 0


def test_approx_kl_is_k3_of_kl_old_new():
    """k3 = r - 1 - log r with r = pi_new / pi_old (Schulman's estimator of KL(old || new) from old's samples):
    for new = old + d on every token it is exp(d) - 1 - d, which is not symmetric in d."""
    mask = torch.ones(1, 4)
    old = torch.zeros(1, 4)
    for d in (0.3, -0.3):
        _, st = policy_loss(old + d, _mb(mask, old, torch.ones(1), torch.tensor([1]), torch.tensor([8])),
                            StepNorm(4.0, 1.0), _algo("token", "fixed", 0.2, 0.2))
        assert loss_metrics(st, "token")["approx_kl"] == pytest.approx(math.exp(d) - 1 - d, rel=1e-5)


# ---------------------------------------------------------------- on- / off-policy updates of a step

# Two ranks, k = 4, adaptive clip (0.2, 0.28): eps_hi(c=1) = 0.28, eps_hi(c=2) = 0.2 + 0.08 * 2/3 = 0.25333.
# Each rank runs two mini-batches of one group: the first at the sampling weights (ratio exactly 1), the
# second after an optimizer step, with the sequence IS ratios below.
OFF_RATIOS = {0: [1.3, 0.9, 0.7, 1.0],  # c = 1: correct 1.3 > 1.28 clips high; 0.7 < 0.8 clips low
              1: [1.2, 1.27, 0.95, 1.05]}  # c = 2: correct 1.2 <= 1.2533 kept, 1.27 clips high
REWARDS = {0: [1.0, 0.0, 0.0, 0.0], 1: [1.0, 1.0, 0.0, 0.0]}


def _rank_part(rank: int, groups_off_policy: list[bool], results: list[RewardResult] | None = None) -> RankStep:
    """What one rank's loop gathers for a step: per micro-batch stats from a real loss evaluation."""
    g = torch.Generator().manual_seed(rank)
    rewards = torch.tensor(REWARDS[rank] * len(groups_off_policy))
    ga = group_advantages(rewards, [4] * len(groups_off_policy))
    stats, off = [], []
    for j, moved in enumerate(groups_off_policy):
        b = slice(4 * j, 4 * j + 4)
        T = 6
        mask = (torch.arange(T)[None] < torch.tensor([6, 3, 5, 4])[:, None]).float()
        old = -torch.rand(4, T, generator=g) * 3
        ratio = torch.tensor(OFF_RATIOS[rank]) if moved else torch.ones(4)
        logp = old + torch.log(ratio)[:, None]
        _, st = policy_loss(logp, _mb(mask, old, ga.adv[b], ga.c[b], ga.k[b]), StepNorm(18.0, 4.0),
                            _algo("sequence", "adaptive", 0.2, 0.28))
        stats.append(st)
        off.append(torch.full((4,), moved))
    n = len(rewards)
    return RankStep(stats=RolloutStats.cat(stats), off_policy=torch.cat(off), rewards=rewards, c=ga.c, k=ga.k,
                    reward_counts=status_counts(results or [RewardResult.of("correct")] * n), lengths=[4] * n,
                    truncated=[False] * n, mismatch=torch.zeros(0), entropy_sum=0.0, kl_ref_sum=0.0,
                    first_dev=torch.zeros(1), skipped=0, tokens=18.0 * n, timings={"generate": 1.0, "train": 1.0})


def test_clip_metrics_count_only_off_policy_updates():
    from gapo.trainer.step_metrics import step_metrics

    m = step_metrics([_rank_part(0, [False, True]), _rank_part(1, [False, True])], "sequence", 1.0, 1e-6, 1.0)
    # Off-policy: only the second mini-batch of each rank, 8 rollouts.
    assert m["clip_frac/c1"] == 1.0  # 1 of 1 correct c = 1 rollout
    assert m["clip_frac/c2"] == 0.5  # 1 of 2
    assert (m["clip_hi/c1"], m["clip_units/c1"], m["n_correct/c1"]) == (1.0, 1.0, 1.0)
    assert (m["clip_hi/c2"], m["clip_units/c2"], m["n_correct/c2"]) == (1.0, 2.0, 2.0)
    assert m["clip_frac"] == 3 / 8 and m["clip_frac/high"] == 2 / 8 and m["clip_frac/low"] == 1 / 8
    assert m["is_ratio/c1"] == pytest.approx(1.3, rel=1e-6)
    assert m["is_ratio/c2"] == pytest.approx((1.2 + 1.27) / 2, rel=1e-6)
    off_ratio = OFF_RATIOS[0] + OFF_RATIOS[1]
    off_adv = [0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5]
    assert m["is_adv_corr"] == pytest.approx(np.corrcoef(off_ratio, off_adv)[0, 1], rel=1e-5)
    assert m["is_ratio/mean"] == pytest.approx(sum(off_ratio) / 8, rel=1e-6)
    # All updates: the on-policy halves add ratio-1, unclipped rollouts of the same kinds.
    assert m["all/clip_frac/c1"] == 1 / 2 and m["all/clip_frac/c2"] == 1 / 4
    assert m["all/n_correct/c2"] == 4.0 and m["all/clip_frac"] == 3 / 16
    all_ratio = [1.0] * 4 + OFF_RATIOS[0] + [1.0] * 4 + OFF_RATIOS[1]
    all_adv = off_adv[:4] * 2 + off_adv[4:] * 2
    assert m["all/is_adv_corr"] == pytest.approx(np.corrcoef(all_ratio, all_adv)[0, 1], rel=1e-5)
    assert m["approx_kl"] > m["all/approx_kl"] > 0


def test_step_without_off_policy_update_has_no_clip_metrics():
    from gapo.trainer.step_metrics import step_metrics

    m = step_metrics([_rank_part(0, [False])], "sequence", 1.0, 1e-6, 1.0)
    assert m["all/clip_frac"] == 0.0 and m["all/clip_frac/c1"] == 0.0 and m["all/is_ratio/c1"] == 1.0
    for key in ("clip_frac", "clip_frac/c1", "clip_hi/c1", "is_adv_corr", "approx_kl", "is_ratio/mean"):
        assert key not in m, key


def test_reward_statuses_and_flags_reach_the_step_metrics():
    """Every status is a fraction of the step's rollouts over all ranks, and so is every flag a rewarder raised
    (an unisolated sandbox must show in the metrics, not only in a log line)."""
    from gapo.trainer.step_metrics import step_metrics

    unisolated = (FLAG_UNISOLATED,)
    rank0 = [RewardResult.of("correct", flags=unisolated)] * 3 + [RewardResult.of("wrong", flags=unisolated)] + \
        [RewardResult.of("timeout")] * 4
    rank1 = [RewardResult.of("wrong")] * 7 + [RewardResult.of("error")]
    parts = [_rank_part(0, [False, True], rank0), _rank_part(1, [False, True], rank1)]
    m = step_metrics(parts, "sequence", 1.0, 1e-6, 1.0)
    assert m["reward/unisolated_frac"] == 4 / 16
    assert (m["reward/wrong_frac"], m["reward/timeout_frac"], m["reward/error_frac"], m["reward/no_answer_frac"]) == \
        (8 / 16, 4 / 16, 1 / 16, 0.0)
    # "correct" is one definition, the one c counts: reward >= correct_threshold (rewards 1 of 4, then 2 of 4)
    assert m["reward/correct_frac"] == 6 / 16
    assert "reward/gold_text_only_frac" not in m  # a flag nobody raised is not a metric
    assert "reward/unisolated_frac" not in step_metrics(parts[1:], "sequence", 1.0, 1e-6, 1.0)


def test_correct_frac_follows_the_threshold_that_defines_c():
    """With partial rewards and a threshold below 1, correct_frac counts what c counts, whatever the statuses."""
    from gapo.trainer.step_metrics import step_metrics

    part = _rank_part(0, [False])
    part.rewards = torch.tensor([0.6, 0.4, 1.0, 0.0])
    part.reward_counts = status_counts([RewardResult.of("wrong")] * 4)
    assert step_metrics([part], "sequence", 1.0, 1e-6, 0.5)["reward/correct_frac"] == 2 / 4
    assert step_metrics([part], "sequence", 1.0, 1e-6, 1.0)["reward/correct_frac"] == 1 / 4


def test_update_metrics_on_token_units():
    """Token IS counts tokens: clip_units/c{c} sums the tokens of the correct rollouts, n_correct the rollouts."""
    s = _stats(seq_ratio=[1.0, 1.3, 1.1, 1.05], adv=[0.5, 0.875, 0.5, 0.5], c=[4, 1, 4, 4], k=[8] * 4,
               n_tok=[7, 10, 4, 6], hi=[0, 10, 1, 0], lo=[0, 0, 0, 0])
    m = update_metrics(s, torch.tensor([False, True, True, True]), "token")
    assert (m["clip_hi/c4"], m["clip_units/c4"], m["n_correct/c4"]) == (1.0, 10.0, 2.0)
    assert m["all/clip_units/c4"] == 17.0 and m["all/clip_frac/c4"] == pytest.approx(1 / 17)
    assert m["clip_frac/c1"] == 1.0
