"""The algorithms side by side: what GRPO, Dr.GRPO, DAPO, GSPO, GAPO, F-GRPO and CISPO each are, in one place.

An algorithm is a row of PRESETS: how a group's rewards become advantages (`group_advantages`: mean-centred, divided
by the group's std or not, focal shaping), the importance ratio's level (token or sequence), the clip rule that sets
each rollout's bounds (gapo/clip.py: fixed, GAPO's adaptive eq. 8, CISPO's weight bounds), the surrogate that turns
ratio and advantage into a per-token loss (SURROGATES; by default the one its clip rule's bounds are for), and how
token losses are averaged over the step (AGGREGATIONS). The loss (gapo/trainer/losses.py) computes the ratio, asks the
rule for the bounds, and applies the row's surrogate and aggregation; nothing there names an algorithm. A new
surrogate or aggregation is one function here, or one `register_surrogate` / `register_aggregation` call in a
config's plugin (tests/test_algorithms.py trains a toy one).

Notation (the GAPO paper, §3): a group of k rollouts of one prompt, c of them correct, advantage A_i, ratio rho (per
token; per sequence s_i, GSPO's), bounds 1 - eps_lo and 1 + eps_hi(c). Shapes: B rollouts, T padded response length.
The surrogates and aggregations use tensor methods only, so reading this module (as config resolution does, to check
names) loads no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gapo.clip import RULES
from gapo.errors import ConfigError

if TYPE_CHECKING:
    from torch import Tensor


# --------------------------------------------------------------------------------------------------
# Surrogates: (rho, logp, A, lo, hi) -> (per-token loss, tokens the upper bound clipped, tokens the lower one clipped)
#   rho [B, T] the ratio (with its gradient), logp [B, T] log pi_theta, A [B, 1], lo = 1 - eps_lo,
#   hi [B, 1] = 1 + eps_hi
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Surrogate:
    loss: Callable[..., tuple[Tensor, Tensor, Tensor]]
    bounds_the_weight: bool = False  # the bounds cap the IS weight (CISPO), not the ratio inside a min (what pages say)


def ppo_clip(rho: Tensor, logp: Tensor, a: Tensor, lo: float, hi: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Eq. 11 (PPO's, GSPO's and GAPO's): max(-A rho, -A clip(rho, lo, hi)). Only the bound on A's side clips."""
    per_tok = (-a * rho).maximum(-a * rho.clamp(min=lo).minimum(hi))
    return per_tok, (a > 0) & (rho.detach() > hi), (a < 0) & (rho.detach() < lo)


def cispo(rho: Tensor, logp: Tensor, a: Tensor, lo: float, hi: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """CISPO (MiniMax-M1): -A sg(clip(rho, lo, hi)) log pi. The weight is capped and detached; every token keeps its
    gradient, so the clip counts are of tokens whose weight was capped."""
    weight = rho.clamp(min=lo).minimum(hi).detach()
    return -a * weight * logp, rho.detach() > hi, rho.detach() < lo


SURROGATES: dict[str, Surrogate] = {"ppo": Surrogate(ppo_clip), "cispo": Surrogate(cispo, bounds_the_weight=True)}


@dataclass
class StepNorm:
    """Normalisers of the whole optimizer step (all micro-batches, all ranks)."""

    tokens: float  # response tokens in the step
    seqs: float  # rollouts in the step
    constant: float = 1.0  # Dr.GRPO's per-sequence constant (e.g. max response length)


# --------------------------------------------------------------------------------------------------
# Aggregations: (per-token loss [B, T], mask [B, T], the step's normalisers) -> this micro-batch's share of the step's
# loss. Normalised by the whole step's counts, so the shares of all micro-batches and ranks sum to the step's loss.
# --------------------------------------------------------------------------------------------------
def token_mean(per_tok: Tensor, mask: Tensor, norm: StepNorm) -> Tensor:
    """Every token of the step weighs the same (DAPO, GSPO, GAPO)."""
    return (per_tok * mask).sum() / norm.tokens


def seq_mean_token_mean(per_tok: Tensor, mask: Tensor, norm: StepNorm) -> Tensor:
    """Each rollout's token mean, then the mean over rollouts (GRPO as first published)."""
    return ((per_tok * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / norm.seqs


def seq_sum_constant(per_tok: Tensor, mask: Tensor, norm: StepNorm) -> Tensor:
    """Token sums over a constant per sequence (Dr.GRPO): no length bias."""
    return (per_tok * mask).sum() / (norm.seqs * norm.constant)


AGGREGATIONS: dict[str, Callable[..., Tensor]] = {
    f.__name__: f for f in (token_mean, seq_mean_token_mean, seq_sum_constant)}


def register_surrogate(name: str, surrogate: Surrogate) -> None:
    """A surrogate `algorithm.surrogate` can then name (from a config's plugin; a taken name is refused)."""
    if SURROGATES.get(name, surrogate) != surrogate:
        raise ValueError(f"surrogate {name!r} exists already ({', '.join(SURROGATES)})")
    SURROGATES[name] = surrogate


def register_aggregation(name: str, aggregation: Callable[..., Tensor]) -> None:
    """An aggregation `algorithm.loss_agg` can then name (from a config's plugin; a taken name is refused)."""
    if AGGREGATIONS.get(name, aggregation) is not aggregation:
        raise ValueError(f"loss aggregation {name!r} exists already ({', '.join(AGGREGATIONS)})")
    AGGREGATIONS[name] = aggregation


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
    """A_i = R_i - mean of its group (Dr.GRPO, the paper's default; (k - c)/k for a correct rollout).

    std_normalize divides by the group's sample std (GRPO); focal_gamma > 0 multiplies by (1 - c/k)^gamma
    (F-GRPO). Groups are contiguous runs of `rewards` and may differ in size (after filtering).
    A group whose rewards are all equal gets A = 0 exactly (also with std normalisation).
    """
    import torch

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


# --------------------------------------------------------------------------------------------------
# The algorithms (`algorithm.name`). Values from the GAPO paper (§4.1, Tables 1-3) and the papers it compares with
# (tests/test_config.py holds each row to its paper's description).
#
# A row fixes the method and the *shape* of its clip range: "sym" (1 - eps_lo, 1 + eps_lo), "asym" (1 - eps_lo,
# 1 + eps_hi) or "adaptive" (eps_hi(c) from eps_lo to eps_hi_max, eq. 8). The widths belong to the model, not to the
# method (the paper uses 3e-3/5e-3 for Qwen's sequence IS, 7e-5/3e-4 for R1-Distill, 0.2/0.28 for token IS
# everywhere), so they come from `algorithm.clip_widths[is_level]` of the config. The surrogate is the clip rule's
# (gapo.clip: eq. 11's ppo for the fixed and adaptive rules, cispo for CISPO's) unless algorithm.surrogate names one.
# --------------------------------------------------------------------------------------------------
PRESETS: dict[str, dict[str, Any]] = {
    # GRPO (Shao et al. 2024): token IS, symmetric clip, std-normalised advantages.
    "grpo": dict(is_level="token", clip="fixed", shape="sym", std_normalize=True, focal_gamma=0.0,
                 loss_agg="token_mean"),
    # Dr.GRPO (Liu et al. 2025): no std, constant normaliser; the paper's Table 3 row uses 0.2/0.28. Inferred: the
    # constant (algorithm.loss_constant) defaults to rollout.max_new_tokens, as Dr.GRPO's own recipe divides by the
    # generation budget; the GAPO paper does not state it.
    "dr_grpo": dict(is_level="token", clip="fixed", shape="asym", std_normalize=False, focal_gamma=0.0,
                    loss_agg="seq_sum_constant"),
    # DAPO (Yu et al. 2025): clip-higher 0.2/0.28, token-mean over the batch.
    "dapo": dict(is_level="token", clip="fixed", shape="asym", std_normalize=False, focal_gamma=0.0,
                 loss_agg="token_mean"),
    # GSPO (Zheng et al. 2025): sequence IS, symmetric; `algorithm.eps_hi=5e-3` gives the asymmetric run.
    "gspo": dict(is_level="sequence", clip="fixed", shape="sym", std_normalize=False, focal_gamma=0.0,
                 loss_agg="token_mean"),
    # F-GRPO / F-GSPO (Plyusov et al. 2026): focal advantage shaping (1 - c/k)^gamma on top. gamma = 1.0 is ours
    # (inferred): the GAPO paper says only gamma >= 0, and we could not read F-GRPO's own value from here.
    "f_grpo": dict(is_level="token", clip="fixed", shape="sym", std_normalize=True, focal_gamma=1.0,
                   loss_agg="token_mean"),
    "f_gspo": dict(is_level="sequence", clip="fixed", shape="asym", std_normalize=False, focal_gamma=1.0,
                   loss_agg="token_mean"),
    # GAPO (this paper, eq. 8 + 11): sequence IS, adaptive upper bound from eps_lo to eps_hi_max.
    "gapo": dict(is_level="sequence", clip="adaptive", shape="adaptive", std_normalize=False, focal_gamma=0.0,
                 loss_agg="token_mean"),
    "gapo_token": dict(is_level="token", clip="adaptive", shape="adaptive", std_normalize=False, focal_gamma=0.0,
                       loss_agg="token_mean"),
    # CISPO (MiniMax-M1, Chen et al. 2025a): its own surrogate (its rule's: cispo), the IS *weight* clipped and
    # detached. Convention chosen here: weight = sg(clip(rho, 1 - eps_lo, 1 + eps_hi)) with eps_lo = 1.0 (lower bound
    # 0, i.e. no lower clip, as MiniMax-M1) and eps_hi = 4.0 (ScaleRL's eps_max). MiniMax-M1 tunes only the upper
    # bound and does not publish it; TRL and ScaleRL differ. These are weight bounds, not clip widths, so clip_widths
    # does not apply.
    "cispo": dict(is_level="token", clip="cispo", eps_lo=1.0, eps_hi=4.0, std_normalize=False, focal_gamma=0.0,
                  loss_agg="token_mean"),
}

# The paper's widths (eps_lo, eps_hi_max) per IS level for Qwen2.5-Math-1.5B and Llama-3.2-3B (§4.1).
DEFAULT_CLIP_WIDTHS = {"sequence": (3e-3, 5e-3), "token": (0.2, 0.28)}
PRESET_SWITCHES = ("is_level", "clip", "surrogate", "eps_lo", "eps_hi", "eps_hi_max", "std_normalize",
                   "focal_gamma", "loss_agg")


def preset_switches(name: str, algo: dict) -> dict[str, Any]:
    """The preset's switches, its clip bounds taken from the config's widths for the preset's IS level; a
    symmetric preset's upper bound follows an explicit eps_lo."""
    preset = dict(PRESETS[name])
    shape = preset.pop("shape", None)
    if shape is None:  # CISPO: weight bounds of its own
        return preset
    widths = algo.get("clip_widths")
    widths = {**DEFAULT_CLIP_WIDTHS, **(widths if isinstance(widths, dict) else {})}
    pair = widths.get(preset["is_level"])
    if not (isinstance(pair, list | tuple) and len(pair) == 2 and all(isinstance(x, int | float) for x in pair)):
        raise ConfigError(f"algorithm.clip_widths.{preset['is_level']}: expected [eps_lo, eps_hi_max], got {pair!r}")
    lo, hi = float(pair[0]), float(pair[1])
    if RULES[preset["clip"]].upper_field == "eps_hi_max":  # a rule whose widest upper width is eps_hi_max (GAPO)
        return {**preset, "eps_lo": lo, "eps_hi_max": hi}
    own_lo = algo.get("eps_lo")
    return {**preset, "eps_lo": lo, "eps_hi": (lo if own_lo is None else own_lo) if shape == "sym" else hi}
