"""The algorithm core: group advantages, importance ratios, the clipped surrogate and its metrics.

Pure torch, no I/O. Notation follows the GAPO paper (§3): a group of k rollouts of one prompt, c of
them correct, advantage A_i = R_i - mean(R) (= (k-c)/k for a correct rollout with binary rewards),
IS ratio rho (token level) or s_i (sequence level, GSPO), and the surrogate of eq. 11

    L = E[ max(-A_i * s_i, -A_i * clip(s_i, 1 - eps_lo, 1 + eps_hi(c_i))) ]

where eps_hi(c) is eq. 8 (`gapo_clip_high`) for the adaptive rule and a constant for fixed clipping
(`clip_high` picks the rule from the algorithm config).

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

if TYPE_CHECKING:  # type hints only: this module needs torch alone
    from gapo.config import AlgorithmConfig, IsLevel, RolloutCorrection
    from gapo.trainer.logprobs import MicroBatch

# exp(±20) spans [2e-9, 5e8]. A log-ratio past that only comes from a numerically broken step; clamping
# it keeps exp() finite (no inf * 0 = NaN in the surrogate). The clamped tokens get no gradient, which
# is what clipping would do to them anyway.
MAX_LOG_RATIO = 20.0


def gapo_clip_high(c: Tensor | int, k: Tensor | int, eps_lo: float, eps_hi_max: float) -> Tensor:
    """Eq. 8: eps_hi(c) = eps_lo + (eps_hi_max - eps_lo) * (k - c) / (k - 1), elementwise.

    Defined for 1 <= c <= k-1, the groups where a correct rollout has a positive advantage. For c = 0
    and c = k no rollout has a positive advantage, so the upper bound is never used; c = 0 is raised to 1
    (eps_hi_max) and c = k gives the formula's own eps_lo, so the value always lies in [eps_lo, eps_hi_max].
    """
    c = torch.as_tensor(c, dtype=torch.float64)
    k = torch.as_tensor(k, dtype=torch.float64)
    if (k < 2).any():
        raise ValueError(f"gapo_clip_high: group size k must be >= 2, got {k.min().item():g}")
    c = torch.minimum(torch.clamp(c, min=1.0), k)
    return eps_lo + (eps_hi_max - eps_lo) * (k - c) / (k - 1)


# --------------------------------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------------------------------
@dataclass
class GroupAdvantages:
    """Per-rollout advantage and the group statistics that GAPO's clip bound and the metrics need."""

    adv: Tensor  # [N] float
    c: Tensor  # [N] long: correct rollouts in this rollout's group
    k: Tensor  # [N] long: size of this rollout's group
    correct: Tensor  # [N] bool


def group_advantages(rewards: Tensor, group_sizes: list[int] | Tensor, *, std_normalize: bool = False,
                     focal_gamma: float = 0.0, correct_threshold: float = 1.0,
                     std_eps: float = 1e-6) -> GroupAdvantages:
    """A_i = R_i - mean of its group (Dr.GRPO, the paper's default).

    std_normalize divides by the group's sample std (GRPO); focal_gamma > 0 multiplies by (1 - c/k)^gamma
    (F-GRPO). Groups are contiguous runs of `rewards` and may differ in size (after filtering).
    A group whose rewards are all equal gets A = 0 exactly (also with std normalisation).
    """
    rewards = rewards.to(torch.float64)
    sizes = torch.as_tensor(group_sizes, dtype=torch.long)
    if sizes.sum().item() != rewards.numel():
        raise ValueError(f"group sizes sum to {sizes.sum().item()} but there are {rewards.numel()} rewards")
    if (sizes < 1).any():
        raise ValueError("every group needs at least one rollout")
    gid = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
    n = sizes.to(torch.float64)
    correct = rewards >= correct_threshold
    c_group = torch.zeros(len(sizes), dtype=torch.long).index_add_(0, gid, correct.long())
    mean = torch.zeros(len(sizes), dtype=torch.float64).index_add_(0, gid, rewards) / n
    adv = rewards - mean[gid]
    if std_normalize:
        sq = torch.zeros(len(sizes), dtype=torch.float64).index_add_(0, gid, adv**2)
        std = torch.sqrt(sq / (n - 1).clamp(min=1))  # Bessel-corrected, as GRPO implementations do
        adv = adv / (std[gid] + std_eps)
    c, k = c_group[gid], sizes[gid]
    if focal_gamma > 0:
        adv = adv * (1.0 - c / k) ** focal_gamma
    return GroupAdvantages(adv=adv.to(torch.float32), c=c, k=k, correct=correct)


def group_metrics(c: Tensor, k: Tensor) -> dict[str, float]:
    """Share of groups that are all correct / all wrong, from per-rollout c and k (each group weighs 1)."""
    w = 1.0 / k.to(torch.float64)
    groups = w.sum()
    return {"group/all_correct_frac": float((w * (c == k)).sum() / groups),
            "group/all_wrong_frac": float((w * (c == 0)).sum() / groups)}


# --------------------------------------------------------------------------------------------------
# Surrogate loss
# --------------------------------------------------------------------------------------------------
@dataclass
class StepNorm:
    """Normalisers of the whole optimizer step (all micro-batches, all ranks)."""

    tokens: float  # response tokens in the step
    seqs: float  # rollouts in the step
    constant: float = 1.0  # Dr.GRPO's per-sequence constant (e.g. max response length)


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
    """The upper clip width of each rollout [B] (float64): eq. 8's eps_hi(c) under the adaptive rule, the
    constant eps_hi under fixed clipping (eps_hi = eps_lo for the symmetric presets) and CISPO's weight cap."""
    if algo.clip == "adaptive":
        return gapo_clip_high(c, k, algo.eps_lo, algo.eps_hi_max)
    return torch.full(c.shape, algo.eps_hi, dtype=torch.float64)


def policy_loss(logp: Tensor, batch: MicroBatch, norm: StepNorm, algo: AlgorithmConfig
                ) -> tuple[Tensor, RolloutStats]:
    """The clipped surrogate of eq. 11 for one micro-batch (plus the optional KL penalty).

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
    if algo.clip == "cispo":
        weight = torch.minimum(torch.clamp(rho, min=lo), hi).detach()
        per_tok = -a * weight * logp
        clip_hi = rho.detach() > hi
        clip_lo = rho.detach() < lo
    else:
        per_tok = torch.maximum(-a * rho, -a * torch.minimum(torch.clamp(rho, min=lo), hi))
        clip_hi = (a > 0) & (rho.detach() > hi)
        clip_lo = (a < 0) & (rho.detach() < lo)

    if batch.rollout_w is not None:  # sampler-trainer correction: detached, after clipping (see rollout_weights)
        per_tok = per_tok * batch.rollout_w.to(per_tok.dtype)
    if algo.loss_agg == "token_mean":
        loss = (per_tok * mask).sum() / norm.tokens
    elif algo.loss_agg == "seq_mean_token_mean":
        loss = ((per_tok * mask).sum(-1) / n_tok.clamp(min=1)).sum() / norm.seqs
    elif algo.loss_agg == "seq_sum_constant":
        loss = (per_tok * mask).sum() / (norm.seqs * norm.constant)
    else:
        raise ValueError(f"unknown loss aggregation {algo.loss_agg!r}")
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


POSITION_BINS = 5  # the mismatch's profile along a response: fifths of its length


@dataclass
class MismatchStats:
    """Per-rollout sums of the sampler-trainer mismatch (log r = log pi_old - log pi_rollout) over its response
    tokens, and what the correction did to them; concatenated over a step, they give exact step metrics."""

    c: Tensor  # [B] correct rollouts in its group
    n_tokens: Tensor  # [B]
    k1_sum: Tensor  # [B] sum of -log r: KL(pi_rollout || pi_old), k1 estimate
    k3_sum: Tensor  # [B] sum of r - 1 - log r: the same KL, k3 estimate (non-negative)
    abs_first: Tensor  # [B] |log r| of the first response token (0 when empty)
    abs_last: Tensor  # [B] |log r| of the last
    pos_abs: Tensor  # [B, POSITION_BINS] sum of |log r| per fifth of the response
    pos_tokens: Tensor  # [B, POSITION_BINS]
    kept: Tensor  # [B] tokens left in the loss by the correction (= n_tokens when off)
    capped: Tensor  # [B] tokens whose weight the cap truncated
    w_sum: Tensor  # [B] sum of the kept tokens' weights
    w_max: Tensor  # [B]

    @classmethod
    def cat(cls, parts: list[MismatchStats]) -> MismatchStats:
        return cls(**{f.name: torch.cat([getattr(p, f.name) for p in parts]) for f in fields(cls)})


def mismatch_stats(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, c: Tensor, w: Tensor | None = None,
                   keep: Tensor | None = None, cap: float = math.inf) -> MismatchStats:
    """The per-rollout sums behind the logprob_mismatch/* and rollout_is/* metrics (w, keep: the correction's)."""
    with torch.no_grad():
        mask = mask.float()
        d = ((old_logp - rollout_logp) * mask).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).double().cpu()
        mask = mask.double().cpu()
        n = mask.sum(-1)
        last = (n - 1).clamp(min=0).long()
        rel = torch.arange(d.shape[1], dtype=torch.float64)[None] / n.clamp(min=1)[:, None]  # position in [0, 1)
        bins = (rel * POSITION_BINS).long().clamp(max=POSITION_BINS - 1)
        onehot = torch.nn.functional.one_hot(bins, POSITION_BINS).double() * mask[..., None]  # [B, T, bins]
        if w is None:
            w, keep = mask, mask.bool()
        w, keep = w.double().cpu(), keep.cpu()
        return MismatchStats(
            c=c.long().cpu(), n_tokens=n, k1_sum=(-d * mask).sum(-1), k3_sum=((d.exp() - 1 - d) * mask).sum(-1),
            abs_first=d[:, 0].abs() * (n > 0), abs_last=d.gather(1, last[:, None]).squeeze(1).abs() * (n > 0),
            pos_abs=(d.abs()[..., None] * onehot).sum(1), pos_tokens=onehot.sum(1), kept=keep.double().sum(-1),
            # w = exp(log cap) may land a rounding below cap: within 1e-3 of it counts as capped
            capped=((w >= cap * (1 - 1e-3)) & keep).double().sum(-1), w_sum=(w * keep).sum(-1),
            w_max=torch.where(keep, w, torch.zeros_like(w)).amax(-1) if w.numel() else torch.zeros(len(n)))


def mismatch_metrics(s: MismatchStats, correction: bool) -> dict[str, float]:
    """logprob_mismatch/kl_k1, kl_k3 (token means), the first and last token's mean |log r| and its profile over
    the response's fifths (pos1..pos5: mismatch grows along a response), k3 by c; with a correction on, the
    rollout_is/* numbers: tokens and sequences it masked, tokens the cap truncated, mean and max weight, by c."""
    tok = float(s.n_tokens.sum())
    if tok == 0:
        return {}
    has = s.n_tokens > 0
    out = {"logprob_mismatch/kl_k1": float(s.k1_sum.sum()) / tok, "logprob_mismatch/kl_k3": float(s.k3_sum.sum()) / tok,
           "logprob_mismatch/first_token_abs": float(s.abs_first[has].mean()),
           "logprob_mismatch/last_token_abs": float(s.abs_last[has].mean())}
    pos = s.pos_abs.sum(0) / s.pos_tokens.sum(0).clamp(min=1)
    out.update({f"logprob_mismatch/pos{i + 1}": float(v) for i, v in enumerate(pos)})
    cs = sorted({int(x) for x in s.c[has]})
    for cc in cs:
        sel = has & (s.c == cc)
        out[f"logprob_mismatch/kl_k1/c{cc}"] = float(s.k1_sum[sel].sum() / s.n_tokens[sel].sum())
        out[f"logprob_mismatch/kl_k3/c{cc}"] = float(s.k3_sum[sel].sum() / s.n_tokens[sel].sum())
    if correction:
        for suffix, sel in [("", has), *((f"/c{cc}", has & (s.c == cc)) for cc in cs)]:
            n_tok, kept, n_seq = float(s.n_tokens[sel].sum()), float(s.kept[sel].sum()), float(sel.sum())
            out.update({f"rollout_is/masked_token_frac{suffix}": 1 - kept / n_tok,
                        f"rollout_is/masked_seq_frac{suffix}": float((s.kept[sel] < s.n_tokens[sel]).sum()) / n_seq,
                        f"rollout_is/truncated_token_frac{suffix}": float(s.capped[sel].sum()) / n_tok,
                        f"rollout_is/truncated_seq_frac{suffix}": float((s.capped[sel] > 0).sum()) / n_seq,
                        f"rollout_is/weight_mean{suffix}": float(s.w_sum[sel].sum()) / max(kept, 1.0),
                        f"rollout_is/weight_max{suffix}": float(s.w_max[sel].max())})
    return out


def kl_penalty(logp: Tensor, ref_logp: Tensor, mask: Tensor, norm: StepNorm) -> Tensor:
    """k3 estimate of KL(pi || pi_ref) per token, token-mean over the step (optional; the paper uses none)."""
    d = (ref_logp - logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return ((torch.exp(d) - 1 - d) * mask).sum() / norm.tokens


def loss_metrics(s: RolloutStats, is_level: IsLevel) -> dict[str, float]:
    """The paper's figures from per-rollout stats (one entry per rollout and update).

    Clip fractions count tokens under token IS and rollouts under sequence IS (a sequence is clipped as a
    whole). `clip_frac/c{c}` and `is_ratio/c{c}` cover positive-advantage (correct) rollouts of groups
    with c correct, c = 1..k-1 (Fig. 3); `clip_hi/c{c}`, `clip_units/c{c}` (that fraction's numerator and
    denominator) and `n_correct/c{c}` (its rollouts) are sums, so that a window of steps aggregates exactly
    instead of averaging fractions of a handful of rollouts each. `is_adv_corr` is Pearson's r between the
    sequence IS ratio and the advantage over rollouts with A != 0 (Fig. 5); zero-advantage rollouts carry
    no gradient and would only dilute it.
    """
    seq = is_level == "sequence"
    has = s.n_tokens > 0
    if seq:  # a rollout counts once, clipped if its (shared) ratio is past the bound
        units = has.float()
        hi = ((s.clip_hi_tokens > 0) & has).float()
        lo = ((s.clip_lo_tokens > 0) & has).float()
    else:
        units, hi, lo = s.n_tokens, s.clip_hi_tokens, s.clip_lo_tokens
    total = units.sum().clamp(min=1)
    out = {"clip_frac": float((hi + lo).sum() / total), "clip_frac/high": float(hi.sum() / total),
           "clip_frac/low": float(lo.sum() / total),
           "approx_kl": float(s.kl_sum.sum() / s.n_tokens.sum().clamp(min=1))}
    ratio = torch.exp(s.seq_log_ratio.double())
    pos = (s.adv > 0) & has
    kmax = int(s.k.max()) if s.k.numel() else 0
    for cc in range(1, kmax):
        sel = pos & (s.c == cc)
        if sel.any():
            out[f"clip_frac/c{cc}"] = float(hi[sel].sum() / units[sel].sum().clamp(min=1))
            out[f"is_ratio/c{cc}"] = float(ratio[sel].mean())
            out[f"clip_hi/c{cc}"] = float(hi[sel].sum())
            out[f"clip_units/c{cc}"] = float(units[sel].sum())
            out[f"n_correct/c{cc}"] = float(sel.sum())
    nz = (s.adv != 0) & has
    out["is_adv_corr"] = pearson(ratio[nz], s.adv[nz].double())
    out["is_ratio/mean"] = float(ratio[has].mean()) if has.any() else 1.0
    return out


def update_metrics(s: RolloutStats, off_policy: Tensor, is_level: IsLevel) -> dict[str, float]:
    """`loss_metrics` over the off-policy updates under the plain names, over all updates under `all/`.

    An update is off-policy when the weights have moved since sampling: every update but those of the step's
    first mini-batch in epoch 0, which still runs at the sampling weights (IS ratio 1, nothing can clip).
    Counting those would dilute every clip fraction and pull `is_adv_corr` toward the on-policy ratios of 1,
    so Figs. 3 and 5 use the off-policy ones. A step with no off-policy update (one mini-batch, one epoch)
    has none of the plain names: undefined, not 0.

    off_policy: [N] bool, one per entry of `s`.
    """
    out = {f"all/{key}": v for key, v in loss_metrics(s, is_level).items()}
    if off_policy.any():
        off = RolloutStats(**{f.name: getattr(s, f.name)[off_policy] for f in fields(RolloutStats)})
        out.update(loss_metrics(off, is_level))
    return out


def pearson(x: Tensor, y: Tensor) -> float:
    """Pearson's r; NaN when either side has no spread (undefined, and reported as such)."""
    if x.numel() < 2:
        return float("nan")
    x, y = x - x.mean(), y - y.mean()
    den = torch.sqrt((x * x).sum() * (y * y).sum())
    return float((x * y).sum() / den) if den > 0 else float("nan")
