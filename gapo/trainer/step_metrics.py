"""The reduction of a step's gathered per-rollout records to its logged numbers: exact over all ranks, and
testable on hand-made records without the loop (which nothing imports).

Here and not in losses.py, so that the loss stays on one screen beside eq. 8 / eq. 11: the clip fractions by c,
the IS-ratio / advantage correlation (Figs. 3 and 5), the group shares and the sampler-trainer mismatch are
reductions of the per-rollout records (`RolloutStats`, `MismatchStats`) that the loss and the loop produce."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from gapo.reward.types import status_counts
from gapo.rundir import per_c
from gapo.trainer.losses import MAX_LOG_RATIO, RolloutStats

if TYPE_CHECKING:
    from gapo.config import IsLevel
    from gapo.trainer.batch import StepBatch
    from gapo.trainer.logprobs import MicroBatch


@dataclass
class RankStep:
    """What one rank contributes to a step's metrics: per-rollout records and sums, gathered to rank 0."""

    stats: RolloutStats  # one entry per rollout and update
    rewards: Tensor  # [N] one per rollout of this rank
    c: Tensor  # [N] correct rollouts in its group
    k: Tensor  # [N] its group's size
    reward_counts: dict[str, int]  # every status (zeros too) and every flag raised, e.g. an unisolated sandbox
    lengths: list[int]  # response tokens per rollout
    truncated: list[bool]
    mismatch: Tensor  # trainer - engine log-prob per response token
    entropy_sum: float
    kl_ref_sum: float
    first_dev: Tensor  # |log pi - log pi_old| per token of the step's first mini-batch
    off_policy: Tensor  # [len(stats)] bool
    skipped: int  # optimizer steps skipped (the same on every rank)
    tokens: float  # response tokens in the loss
    timings: dict[str, float]  # seconds per phase
    records: list[dict] | None = None  # rollouts.jsonl lines (trainer.log_rollouts)
    per_rollout_mismatch: MismatchStats | None = None  # with the trainer's old-log-prob pass

    @classmethod
    def of(cls, batch: StepBatch, old: OldLogprobs, up: Updates, minis: list[list[MicroBatch]],
           timings: dict[str, float], records: list[dict] | None) -> RankStep:
        """This rank's part of a step: its batch, and what its old-log-prob pass and its updates left to log."""
        rollouts = batch.rollouts
        return cls(stats=RolloutStats.cat(up.stats), rewards=batch.rewards, c=batch.adv.c, k=batch.adv.k,
                   reward_counts=status_counts(batch.flat_results), lengths=[len(x.response_ids) for x in rollouts],
                   truncated=[x.truncated for x in rollouts], mismatch=torch.cat(old.mismatch + up.mismatch),
                   entropy_sum=old.entropy_sum, kl_ref_sum=old.kl_ref_sum, first_dev=torch.cat(up.first_dev),
                   per_rollout_mismatch=MismatchStats.cat(old.per_rollout) if old.per_rollout else None,
                   off_policy=torch.cat(up.off_policy), skipped=up.skipped,
                   tokens=float(sum(float(mb.resp_mask.sum()) for mini in minis for mb in mini)), timings=timings,
                   records=records)


@dataclass
class OldLogprobs:
    """What the step's old-log-prob pass (gapo.trainer.loop.old_logprobs) left to log."""

    entropy_sum: float  # summed over response tokens (the step metric divides by all ranks' tokens)
    kl_ref_sum: float
    mismatch: list[Tensor]  # trainer - engine log-prob per response token, one tensor per micro-batch
    per_rollout: list[MismatchStats]  # the same per rollout, and what the rollout correction did


@dataclass
class Updates:
    """What the step's optimizer steps left to log; `stats` and `stat_rows` are per micro-batch update."""

    stats: list[RolloutStats]
    stat_rows: list[Tensor]  # the rollouts each entry of `stats` is about
    off_policy: list[Tensor]  # per entry of `stats`: False on the step's first mini-batch, where nothing can clip
    first_dev: list[Tensor]  # |log pi - log pi_old| on the step's first mini-batch (pi = pi_old there)
    mismatch: list[Tensor]  # with engine log-probs as old ones: the first mini-batch's trainer - engine
    grad_norm: float  # mean over the applied optimizer steps
    skipped: int  # optimizer steps skipped for a non-finite gradient
    skipped_in_a_row: int  # across steps: too many stop the run


def step_metrics(parts: list[RankStep], is_level: str, grad_norm: float, lr: float,
                 correct_threshold: float, correction: bool = False) -> dict[str, float]:
    """One step's logged numbers from every rank's per-rollout records."""
    stats = RolloutStats.cat([p.stats for p in parts])
    rewards = torch.cat([p.rewards for p in parts])
    c, k = torch.cat([p.c for p in parts]), torch.cat([p.k for p in parts])
    counts: Counter[str] = Counter()
    for p in parts:
        counts.update(p.reward_counts)
    lengths = np.array([n for p in parts for n in p.lengths])
    mism = torch.cat([p.mismatch for p in parts]).double()
    tokens = sum(p.tokens for p in parts)
    gen_tokens = float(lengths.sum())
    tim = {key: max(p.timings[key] for p in parts) for key in parts[0].timings}  # the slowest rank
    first_dev = torch.cat([p.first_dev for p in parts]).double()
    # "correct" is what counts in c (reward >= algorithm.correct_threshold), the rewarder's other verdicts by name.
    m = {"reward/mean": float(rewards.mean()),
         "reward/correct_frac": float((rewards >= correct_threshold).double().mean())}
    for key, n in counts.items():
        if key != "correct":
            m[f"reward/{key}_frac"] = n / len(rewards)
    m.update(group_metrics(c, k))
    m.update(update_metrics(stats, torch.cat([p.off_policy for p in parts]), is_level))
    m.update({"response/len_mean": float(lengths.mean()), "response/len_max": float(lengths.max()),
              "response/truncated_frac": float(np.mean([x for p in parts for x in p.truncated])),
              "entropy": sum(p.entropy_sum for p in parts) / max(tokens, 1.0),
              # k3 KL(pi_old || pi_ref) per token at rollout time (0 without a reference model)
              "kl_ref": sum(p.kl_ref_sum for p in parts) / max(tokens, 1.0),
              "grad_norm": grad_norm, "lr": lr,
              # optimizer steps of this step whose gradient was not finite (not applied)
              "skipped_steps": float(parts[0].skipped),
              # max |log pi_theta - log pi_old| over the first mini-batch's tokens, where theta = theta_old:
              # 0 exactly when the old-log-prob pass and the update compute the same thing
              "first_minibatch/max_abs_log_ratio": float(first_dev.max()) if first_dev.numel() else 0.0,
              "logprob_mismatch/mean_abs": float(mism.abs().mean()) if mism.numel() else 0.0,
              "logprob_mismatch/max_abs": float(mism.abs().max()) if mism.numel() else 0.0,
              # exp(mean(trainer - engine)): the IS ratio a sequence would carry from the engine alone
              "logprob_mismatch/is_ratio": float(torch.exp(mism.mean())) if mism.numel() else 1.0})
    if all(p.per_rollout_mismatch is not None for p in parts):
        m.update(mismatch_metrics(MismatchStats.cat([p.per_rollout_mismatch for p in parts]), correction))
    m.update({f"time/{key}_s": v for key, v in tim.items()})
    m["time/step_s"] = sum(tim.values())
    m["throughput/gen_tokens_per_s"] = gen_tokens / max(tim["generate"], 1e-9)
    m["throughput/train_tokens_per_s"] = tokens / max(tim["train"], 1e-9)
    return m


def group_metrics(c: Tensor, k: Tensor) -> dict[str, float]:
    """Share of groups that are all correct / all wrong, from per-rollout c and k (each group weighs 1)."""
    w = 1.0 / k.to(torch.float64)
    groups = w.sum()
    return {"group/all_correct_frac": float((w * (c == k)).sum() / groups),
            "group/all_wrong_frac": float((w * (c == 0)).sum() / groups)}


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
        out[per_c("logprob_mismatch/kl_k1", cc)] = float(s.k1_sum[sel].sum() / s.n_tokens[sel].sum())
        out[per_c("logprob_mismatch/kl_k3", cc)] = float(s.k3_sum[sel].sum() / s.n_tokens[sel].sum())
    if correction:
        for suffix, sel in [("", has), *((per_c("", cc), has & (s.c == cc)) for cc in cs)]:
            n_tok, kept, n_seq = float(s.n_tokens[sel].sum()), float(s.kept[sel].sum()), float(sel.sum())
            out.update({f"rollout_is/masked_token_frac{suffix}": 1 - kept / n_tok,
                        f"rollout_is/masked_seq_frac{suffix}": float((s.kept[sel] < s.n_tokens[sel]).sum()) / n_seq,
                        f"rollout_is/truncated_token_frac{suffix}": float(s.capped[sel].sum()) / n_tok,
                        f"rollout_is/truncated_seq_frac{suffix}": float((s.capped[sel] > 0).sum()) / n_seq,
                        f"rollout_is/weight_mean{suffix}": float(s.w_sum[sel].sum()) / max(kept, 1.0),
                        f"rollout_is/weight_max{suffix}": float(s.w_max[sel].max())})
    return out


def loss_metrics(s: RolloutStats, is_level: IsLevel) -> dict[str, float]:
    """The paper's figures from per-rollout stats (one entry per rollout and update).

    Clip fractions count tokens under token IS and rollouts under sequence IS (a sequence is clipped as a
    whole). `clip_frac/c{c}` and `is_ratio/c{c}` cover positive-advantage (correct) rollouts of groups
    with c correct, c = 1..k-1 (Fig. 3); `clip_hi/c{c}`, `clip_units/c{c}` (that fraction's numerator and
    denominator), `clip_all` and `clip_units` (those of `clip_frac`) and `n_correct/c{c}` (its rollouts) are
    sums, so that a window of steps aggregates exactly instead of averaging fractions of a handful of rollouts
    each. `is_adv_corr` is Pearson's r between the
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
    out = {"clip_frac": float((hi + lo).sum() / total), "clip_all": float((hi + lo).sum()),
           "clip_units": float(units.sum()), "clip_frac/high": float(hi.sum() / total),
           "clip_frac/low": float(lo.sum() / total),
           "approx_kl": float(s.kl_sum.sum() / s.n_tokens.sum().clamp(min=1))}
    ratio = torch.exp(s.seq_log_ratio.double())
    pos = (s.adv > 0) & has
    kmax = int(s.k.max()) if s.k.numel() else 0
    for cc in range(1, kmax):
        sel = pos & (s.c == cc)
        if sel.any():
            out[per_c("clip_frac", cc)] = float(hi[sel].sum() / units[sel].sum().clamp(min=1))
            out[per_c("is_ratio", cc)] = float(ratio[sel].mean())
            out[per_c("clip_hi", cc)] = float(hi[sel].sum())
            out[per_c("clip_units", cc)] = float(units[sel].sum())
            out[per_c("n_correct", cc)] = float(sel.sum())
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
