"""The algorithms `algorithm.name` selects: each a preset of the loss's switches, and how a preset fills the
switches a config leaves null (`preset_switches`; gapo.configfile.resolve applies it).

Values from the GAPO paper (§4.1, Tables 1-3) and the papers it compares with. A new algorithm is one row of PRESETS
(tests/test_config.py holds each row to the paper's description).
"""

from __future__ import annotations

from typing import Any

from gapo.clip import RULES
from gapo.errors import ConfigError

# --------------------------------------------------------------------------------------------------
# Algorithm presets. Values from the GAPO paper (§4.1, Tables 1-3) and the papers it compares with.
#
# A preset fixes the method (IS level, clip rule, std-normalisation, focal exponent, aggregation) and the
# *shape* of its clip range: "sym" (1 - eps_lo, 1 + eps_lo), "asym" (1 - eps_lo, 1 + eps_hi) or
# "adaptive" (eps_hi(c) from eps_lo to eps_hi_max, eq. 8). The widths themselves belong to the model, not
# to the method (the paper uses 3e-3/5e-3 for Qwen's sequence IS, 7e-5/3e-4 for R1-Distill, 0.2/0.28 for
# token IS everywhere), so they come from `algorithm.clip_widths[is_level]` of the config.
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
    # CISPO (MiniMax-M1, Chen et al. 2025a): the IS *weight* is clipped and detached, every token keeps
    # its gradient. Convention chosen here: weight = sg(clip(rho, 1 - eps_lo, 1 + eps_hi)) with
    # eps_lo = 1.0 (lower bound 0, i.e. no lower clip, as MiniMax-M1) and eps_hi = 4.0 (ScaleRL's
    # eps_max). MiniMax-M1 tunes only the upper bound and does not publish it; TRL and ScaleRL differ.
    # These are weight bounds, not clip widths, so clip_widths does not apply.
    "cispo": dict(is_level="token", clip="cispo", eps_lo=1.0, eps_hi=4.0, std_normalize=False,
                  focal_gamma=0.0, loss_agg="token_mean"),
}

# The paper's widths (eps_lo, eps_hi_max) per IS level for Qwen2.5-Math-1.5B and Llama-3.2-3B (§4.1).
DEFAULT_CLIP_WIDTHS = {"sequence": (3e-3, 5e-3), "token": (0.2, 0.28)}
PRESET_SWITCHES = ("is_level", "clip", "eps_lo", "eps_hi", "eps_hi_max", "std_normalize",
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
