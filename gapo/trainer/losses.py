"""The loss machinery: importance ratios, the step's normalisers, per-rollout stats, the rollout weights.

Pure torch, no I/O. What each algorithm is (its advantage, surrogate and aggregation) lives in gapo/algorithms.py,
side by side; here the ratio is computed at the algorithm's level (per token, or GSPO's per sequence), the clip rule
(gapo/clip.py) gives each rollout its bounds from c and k (eq. 8 for GAPO's adaptive rule), and the algorithm's
surrogate and aggregation make the loss: for PPO's surrogate, eq. 11

    L = E[ max(-A_i * s_i, -A_i * clip(s_i, 1 - eps_lo, 1 + eps_hi(c_i))) ]

Shapes: B rollouts in a micro-batch, T padded response length. `mask[b, t]` is 1 on response tokens.
Every loss here is a *contribution to the optimizer step's loss*: its normaliser is the whole step's
token / sequence count (`StepNorm`), so summing the micro-batch losses (over accumulation and over
data-parallel ranks) gives exactly the loss of the whole step, whatever the split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from gapo.algorithms import AGGREGATIONS, SURROGATES, StepNorm

if TYPE_CHECKING:  # type hints only
    from gapo.config import AlgorithmConfig, RolloutCorrection
    from gapo.trainer.logprobs import MicroBatch

# exp(±20) spans [2e-9, 5e8]. A log-ratio past that only comes from a numerically broken step; clamping
# it keeps exp() finite (no inf * 0 = NaN in the surrogate). The clamped tokens get no gradient, which
# is what clipping would do to them anyway.
MAX_LOG_RATIO = 20.0


# --------------------------------------------------------------------------------------------------
# Surrogate loss
# --------------------------------------------------------------------------------------------------
@dataclass
class RolloutStats:
    """Per-rollout numbers from one loss evaluation; concatenated over the step, they give every metric
    (so metrics are exact over micro-batches and ranks, not means of means)."""

    seq_log_ratio: Tensor  # [B] mean over response tokens of logp - old_logp
    adv: Tensor  # [B]
    c: Tensor  # [B]
    k: Tensor  # [B]
    n_tokens: Tensor  # [B]
    clip_hi_tokens: Tensor  # [B] tokens whose gradient the upper bound removed (CISPO: whose weight it capped)
    clip_lo_tokens: Tensor  # [B]
    kl_sum: Tensor  # [B] sum over tokens of the k3 estimate of KL(old || new): r - 1 - log r, r = pi_new / pi_old

    @classmethod
    def cat(cls, parts: list[RolloutStats]) -> RolloutStats:
        return cls(**{f.name: torch.cat([getattr(p, f.name) for p in parts]) for f in fields(cls)})


def clip_high(c: Tensor, k: Tensor, algo: AlgorithmConfig) -> Tensor:
    """The upper clip width of each rollout [B] (float64), as the algorithm's clip rule (gapo.clip) sets it from c
    and k: eq. 8's eps_hi(c) under the adaptive rule (gapo.clip.adaptive_eps_hi), the constant eps_hi under fixed
    clipping (eps_hi = eps_lo for the symmetric presets) and CISPO's weight cap."""
    # c held to [1, k]: a bound read at c = 0 or c = k is never used (no rollout there has a positive advantage), and
    # held there it stays within the rule's range.
    c = torch.as_tensor(c, dtype=torch.float64)
    k = torch.as_tensor(k, dtype=torch.float64)
    if (k < 2).any():
        raise ValueError(f"clip_high: group size k must be >= 2, got {k.min().item():g}")
    c = torch.minimum(torch.clamp(c, min=1.0), k)
    return torch.as_tensor(algo.rule.eps_hi(c, k, algo), dtype=torch.float64).expand(c.shape).clone()


def policy_loss(logp: Tensor, batch: MicroBatch, norm: StepNorm, algo: AlgorithmConfig
                ) -> tuple[Tensor, RolloutStats]:
    """The algorithm's surrogate (eq. 11 for PPO's) and aggregation for one micro-batch (plus the optional KL penalty).

    logp: [B, T] log pi_theta of the response tokens, with gradient. From the batch: in_loss (the mask) and old_logp
    [B, T], adv, c, k [B] (ref_logp [B, T] with a KL penalty). Returns this micro-batch's share of the step
    loss and its per-rollout stats.
    """
    mask = batch.in_loss.to(logp.dtype)
    old_logp, adv = batch.old_logp, batch.adv
    eps_lo, eps_hi = algo.eps_lo, clip_high(batch.c, batch.k, algo)  # [B]
    n_tok = mask.sum(-1)  # [B]
    log_ratio = (logp - old_logp) * mask
    seq_log_ratio = log_ratio.sum(-1) / n_tok.clamp(min=1)  # [B]
    if algo.is_level == "token":
        log_rho = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    else:
        # GSPO-token form: value s_i on every token, gradient s_i * grad log pi(y_t) per token.
        s = seq_log_ratio.detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        log_rho = s[:, None] + logp - logp.detach()
    rho = torch.exp(log_rho)  # [B, T]
    hi = 1.0 + torch.as_tensor(eps_hi, dtype=rho.dtype, device=rho.device)[:, None]
    lo = 1.0 - eps_lo
    a = adv.to(rho.device, rho.dtype)[:, None]
    per_tok, clip_hi, clip_lo = SURROGATES[algo.surrogate].loss(rho, logp, a, lo, hi)
    if batch.rollout_w is not None:  # sampler-trainer correction: detached, after clipping (see rollout_weights)
        per_tok = per_tok * batch.rollout_w.to(per_tok.dtype)
    loss = AGGREGATIONS[algo.loss_agg](per_tok, mask, norm)
    if algo.kl_coef > 0:
        loss = loss + algo.kl_coef * kl_penalty(logp, batch.ref_logp, batch.in_loss, norm)

    with torch.no_grad():
        # k3 estimator of KL(old || new) over tokens sampled from old: r - 1 - log r with r = pi_new / pi_old
        d = (logp - old_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        k3 = (torch.exp(d) - 1 - d) * mask
        # On the CPU, whatever device the loss ran on: stats are gathered across ranks as Python objects.
        stats = RolloutStats(seq_log_ratio=seq_log_ratio.detach().float().cpu(), adv=adv.detach().float().cpu(),
                             c=batch.c.long().cpu(), k=batch.k.long().cpu(), n_tokens=n_tok.detach().float().cpu(),
                             clip_hi_tokens=(clip_hi * mask).sum(-1).float().cpu(),
                             clip_lo_tokens=(clip_lo * mask).sum(-1).float().cpu(), kl_sum=k3.sum(-1).float().cpu())
    return loss, stats


# --------------------------------------------------------------------------------------------------
# Sampler-trainer mismatch (rollout correction)
# --------------------------------------------------------------------------------------------------
def rollout_weights(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, rc: RolloutCorrection
                    ) -> tuple[Tensor, Tensor]:
    """Weights w [B, T] (detached, 0 off the loss) and keep [B, T] (bool: the token stays in the loss and the
    normaliser) from r = pi_old / pi_rollout, the trainer's log-prob of each sampled token against the engine's.

        truncate  token: w = min(r, cap)                 sequence: w = min(prod r, cap) on every token
        mask      token: keep r in [lo, hi], w = r       sequence: keep if geomean(r) in [lo, hi], w = geomean
        reject    token: keep k3(r) <= kl_max, w = 1     sequence: keep if mean k3 <= kl_max, w = 1

    with k3(r) = r - 1 - log r, the sampler-trainer KL estimate. Log-ratios are clamped to +-MAX_LOG_RATIO
    before exp (a product over a long response saturates at `cap`, never at inf); an empty response keeps no
    token. Masking keeps the ratio as weight inside the band (masked IS): the tokens that are kept are still
    reweighted toward pi_old, and only those whose ratio is untrustworthy lose their gradient.
    """
    m = mask.bool()
    log_r = ((old_logp - rollout_logp) * mask).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # [B, T]
    n = mask.sum(-1).clamp(min=1)  # [B]
    if rc.level == "token":
        r = torch.exp(log_r)
        if rc.mode == "truncate":
            w, keep = r.clamp(max=rc.cap), m
        elif rc.mode == "mask":
            w, keep = r, m & (r >= rc.mask_low) & (r <= rc.mask_high)
        elif rc.mode == "reject":
            w, keep = torch.ones_like(r), m & (r - 1 - log_r <= rc.kl_max)
        else:
            raise ValueError(f"rollout correction mode {rc.mode!r}")
    else:
        total = log_r.sum(-1)  # [B] log of the product of the ratios
        if rc.mode == "truncate":
            seq, ok = torch.exp(total.clamp(max=math.log(rc.cap))), torch.ones_like(total, dtype=torch.bool)
        elif rc.mode == "mask":
            seq = torch.exp(total / n)
            ok = (seq >= rc.mask_low) & (seq <= rc.mask_high)
        elif rc.mode == "reject":
            k3 = ((torch.exp(log_r) - 1 - log_r) * mask).sum(-1) / n
            seq, ok = torch.ones_like(total), k3 <= rc.kl_max
        else:
            raise ValueError(f"rollout correction mode {rc.mode!r}")
        w, keep = seq[:, None].expand_as(log_r), m & ok[:, None]
    return torch.where(keep, w, torch.zeros_like(w)).detach(), keep


def kl_penalty(logp: Tensor, ref_logp: Tensor, mask: Tensor, norm: StepNorm) -> Tensor:
    """k3 estimate of KL(pi || pi_ref) per token, token-mean over the step (optional; the paper uses none)."""
    d = (ref_logp - logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return ((torch.exp(d) - 1 - d) * mask).sum() / norm.tokens


