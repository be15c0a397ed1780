"""The DeepSpeed actor: the policy as DeepSpeed's module, the clipped update, and full weights for the rollout
engine.

One code path for CPU (gloo) and GPU (NCCL); ZeRO stage 0/2/3 from the config. The log-prob computation
itself is gapo/trainer/logprobs.py.
"""

from __future__ import annotations

import contextlib
import logging
import math
import types
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from gapo.memory import REDUCE_BUCKET
from gapo.trainer import logprobs, lora
from gapo.trainer.logprobs import MicroBatch, response_logprobs

if TYPE_CHECKING:
    from gapo.config import Config, TrainerConfig

log = logging.getLogger("gapo.actor")


class Policy(torch.nn.Module):
    """What DeepSpeed wraps: a causal LM whose forward is `response_logprobs`.

    Every forward must go through Actor.deepspeed: under ZeRO-3 its forward is where the
    gradient-accumulation counter advances; calling the model's submodules directly makes each micro-batch
    overwrite the previous one's gradient instead of adding to it.
    """

    def __init__(self, lm: torch.nn.Module, n_chunks: int | None = None):
        super().__init__()
        self.lm = lm
        self.n_chunks = n_chunks  # logit chunks per forward, fixed for the run (see response_logprobs)
        head = lm.get_output_embeddings().weight
        if hasattr(head, "ds_id"):  # ZeRO-3: gather the head once per forward (and once per backward) for all
            import deepspeed  # of its logit chunks, not once per chunk (~1,300 all-gathers a step at 24k tokens)

            deepspeed.zero.register_external_parameter(self, head)

    def forward(self, mb: MicroBatch, temperature: float, entropy: bool = False) -> tuple[Tensor, Tensor | None]:
        with attention_backend():
            return response_logprobs(self.lm.get_decoder(), self.lm.get_output_embeddings(), mb, temperature,
                                     entropy=entropy, n_chunks=self.n_chunks)


ATTENTION = "gapo_sdpa"  # the actor's attention function, registered with transformers (whole_head_sdpa)


def whole_head_sdpa(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                    attention_mask: Tensor | None, **kwargs) -> tuple[Tensor, None]:
    """transformers' SDPA attention with K/V always repeated to every query head.

    Left to itself, transformers calls SDPA with `enable_gqa=True` and unrepeated K/V whenever a micro-batch has no
    padding (the mask is dropped); the memory-efficient kernel pinned below has no GQA support, so CUDA raised "No
    available kernel" for Qwen2.5 (12 query, 2 KV heads) on every unpadded micro-batch. Repeated K/V is what a padded
    micro-batch gets anyway, and what the memory plan counts. query [B, Hq, S, D]; key, value [B, Hkv, S', D]."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    # What sdpa_attention_forward reads of the module, with the groups already expanded: it then never asks for GQA.
    heads = types.SimpleNamespace(num_key_value_groups=1, is_causal=getattr(module, "is_causal", True),
                                  layer_idx=getattr(module, "layer_idx", None))
    return sdpa_attention_forward(heads, query, repeat_kv(key, groups), repeat_kv(value, groups), attention_mask,
                                  **kwargs)


def attention_backend():
    """One SDPA kernel for the old-log-prob pass (no grad) and the update (grad): on CUDA, torch picks per call
    among flash, memory-efficient, cuDNN and math kernels, and may pick differently with and without autograd
    (cuDNN's forward-only path, say), which would make the first mini-batch's IS ratio differ from 1 by kernel
    rounding. The memory-efficient kernel takes padding masks, runs forward and backward, and is pinned for
    both passes and for the backward, where gradient checkpointing recomputes the forward (GPU only; unverified
    here, bench/gpu/check.sh asserts the deviation is 0). On CPU nothing changes."""
    if not torch.cuda.is_available():
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION])


def register_attention() -> str:
    """Make whole_head_sdpa known to transformers (idempotent) and return its name, for from_pretrained. Its masks
    are SDPA's: transformers picks the mask builder by the same name, and a name it does not know gets no mask at
    all (the shared-prompt suffix pass would attend to the wrong keys)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(ATTENTION, whole_head_sdpa)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    return ATTENTION


def load_model(model_dir: str, ds_config: dict, zero_stage: int) -> torch.nn.Module:
    """The model of `model_dir` in the config's dtype, with gapo's attention; at ZeRO-3 partitioned as it loads.

    from_pretrained runs under zero.Init while an HfDeepSpeedConfig lives, so the config object lives only for
    this call: every later from_pretrained in the process would be partitioned too. zero.Init also swaps
    torch.nn.functional.linear for its own, process-wide and for good ("This will persist unless manually
    reset"); vLLM's unquantised GEMM looks F.linear up at call time, so the swap would reach the rollout engine's logits
    too. It is restored once the weights are partitioned."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    linear = torch.nn.functional.linear
    hf_ds = HfDeepSpeedConfig(ds_config) if zero_stage == 3 else None
    try:
        dtype = torch.bfloat16 if ds_config["bf16"]["enabled"] else torch.float32
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=register_attention())
    finally:
        del hf_ds
        torch.nn.functional.linear = linear


def logit_chunks(cfg: Config) -> int:
    """The logit chunks of every forward of the run: the most response tokens one micro-batch can hold (its rows
    times rollout.max_new_tokens, or the token budget), in logprobs.LOGIT_CHUNK pieces."""
    tokens = cfg.trainer.micro_batch_size * cfg.rollout.max_new_tokens
    if cfg.trainer.max_tokens_per_micro_batch:
        tokens = min(tokens, cfg.trainer.max_tokens_per_micro_batch)
    return max(1, math.ceil(tokens / logprobs.LOGIT_CHUNK))


def adamw(params: list[torch.nn.Parameter], t: TrainerConfig) -> torch.optim.AdamW:
    """The actor's AdamW. With trainer.offload.optimizer=cpu DeepSpeed steps it on the rank's whole fp32 partition,
    one flat host tensor: torch's default there (CPU tensors: neither fused nor foreach) is the single-tensor path,
    whose `exp_avg_sq.sqrt() / bias_correction` makes two temporaries of the partition (+8 bytes per parameter of
    host memory at the step: 11.5 GiB for Qwen2.5-Math-1.5B on one GPU). torch 2.13's fused CPU AdamW updates in place
    (measured: no growth, and 8.7x faster; docs/PERFORMANCE.md section 12) and needs no build, unlike DeepSpeed's
    CPU Adam (a 45-76 s JIT compile); its update equals the single-tensor one to float rounding
    (tests/test_offload_adamw.py). Without offload the default stays: foreach on CUDA, whose temporary
    (sqrt of exp_avg_sq, 4 bytes per parameter) gapo/memory.py counts."""
    return torch.optim.AdamW(params, lr=t.lr, betas=t.adam_betas, weight_decay=t.weight_decay,
                             fused=True if t.offload.optimizer == "cpu" else None)


def deepspeed_config(cfg: Config, world: int, zero_stage: int, load_universal: bool = False) -> dict:
    """The DeepSpeed config of the actor (and, with its stage changed, of the KL reference) from gapo's."""
    t = cfg.trainer
    shape = cfg.shape(world)  # micro-batches per optimizer step, optimizer steps per rollout batch
    bf16 = cfg.model.dtype == "bfloat16"
    ds_config = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": shape.micro_per_mini,
        "train_batch_size": t.micro_batch_size * shape.micro_per_mini * world,
        "gradient_clipping": t.grad_clip,
        "bf16": {"enabled": bf16},
        # small params (norms) stay whole: fewer gathers; the reduce bucket is the memory plan's (gapo/memory.py)
        "zero_optimization": {"stage": zero_stage, "reduce_bucket_size": REDUCE_BUCKET},
        "wall_clock_breakdown": False,
    }
    o = t.offload
    if o.optimizer == "cpu":
        # Pinned host buffers need CUDA; the step runs our fused torch AdamW on the host partitions (`adamw`;
        # DeepSpeed asks for its CPU Adam op by default, a JIT build; GPU only: unverified here).
        pin = torch.cuda.is_available()
        ds_config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
        if o.params == "cpu":
            ds_config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": pin}
        ds_config["zero_force_ds_cpu_optimizer"] = False
    if load_universal and zero_stage > 0:  # resuming a checkpoint of another world size (checkpoint.reshard)
        ds_config["checkpoint"] = {"load_universal": True}
    if bf16:
        # Gradients of bf16 weights are summed over micro-batches and ranks in fp32: a step's token-mean
        # loss over ~10^6 tokens at lr 1e-6 is made of terms that a bf16 sum (8 bits of mantissa) drops.
        ds_config.update(data_types={"grad_accum_dtype": "fp32"}, communication_data_type="fp32")
    return ds_config


class _Schedule(torch.optim.lr_scheduler.LambdaLR):
    """A LambdaLR that stays put while `skip` is set. DeepSpeed steps the scheduler unless its optimizer reports
    an overflow, which the plain AdamW of stage 0 never does: a skipped step there would advance the schedule
    ("good, NaN, good" ending one schedule step ahead of "good, good"). `skip` is a plain bool, so the state
    DeepSpeed saves stays picklable."""

    skip = False

    def step(self, *args, **kwargs) -> None:
        if not self.skip:
            super().step(*args, **kwargs)


class Actor:
    def __init__(self, cfg: Config, model_dir: str, load_universal: bool = False):
        import deepspeed
        t = cfg.trainer
        self.cfg = cfg
        self.world = dist.get_world_size()
        shape = cfg.shape(self.world)
        # ZeRO partitions weights, gradients and optimizer state across data-parallel ranks; with one rank there
        # is nothing to partition, and stage 3 there only adds its gather/release hooks and flat copies:
        # +10 s per demo step and +2.3 GiB on the CPU (docs/PERFORMANCE.md); see Config.zero_stage.
        self.zero_stage = cfg.zero_stage(self.world)
        if self.zero_stage != t.zero_stage:
            log.info("trainer.zero_stage=%d with one rank: running DeepSpeed at stage %d (nothing to partition)",
                     t.zero_stage, self.zero_stage)
        ds_config = deepspeed_config(cfg, self.world, self.zero_stage, load_universal)
        model = load_model(model_dir, ds_config, self.zero_stage)
        if cfg.model.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        if cfg.model.lora is not None:
            model = lora.with_lora(model, cfg.model.lora)
        # Only what trains is in the optimizer (with LoRA, the adapters; the base weights are frozen).
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = adamw(trainable, t)
        # DeepSpeed's ZeRO and bf16 optimizers skip a step whose gradient norm is not finite; at stage 0 it
        # would apply it. There the step is skipped here (before the scheduler wraps `step`), decided in
        # backward() from the gradient norm, which is the same on every rank.
        self._skip = False
        adamw_step = torch.optim.AdamW.step
        optimizer.step = types.MethodType(
            lambda opt, *args, **kwargs: None if self._skip else adamw_step(opt, *args, **kwargs), optimizer)
        total = t.total_steps * shape.updates
        warm = t.warmup_steps * shape.updates

        def lr_factor(step: int) -> float:
            if step < warm:
                return (step + 1) / warm
            if t.lr_schedule == "cosine":
                return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))
            return 1.0

        scheduler = _Schedule(optimizer, lr_factor)
        self.deepspeed, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=Policy(model, logit_chunks(cfg)), optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
        # The Hugging Face model inside self.deepspeed (its parameter names, save_pretrained); with LoRA its targeted
        # linear layers are PEFT's (base_layer + lora_A/lora_B), see pushed_names.
        self.module = model
        if cfg.model.lora is not None:
            lora.save_without_frozen(self.deepspeed)
        self._stage0_norm: float | None = None
        self.device = self.deepspeed.device  # micro-batches go here (cuda:LOCAL_RANK on GPU, cpu on CPU)
        self.reference = None
        if cfg.algorithm.kl_coef > 0:
            # A frozen copy of the initial policy for the optional KL penalty, partitioned like the actor.
            ref = load_model(model_dir, ds_config, self.zero_stage)
            # Without an optimizer DeepSpeed allows only stage 3 (partitioned) or 0 (a full copy per rank).
            ref_config = {**ds_config, "zero_optimization": {**ds_config["zero_optimization"],
                                                             "stage": 3 if self.zero_stage == 3 else 0}}
            frozen = Policy(ref.eval().requires_grad_(False), logit_chunks(cfg))
            self.reference, *_ = deepspeed.initialize(model=frozen, config=ref_config)

    def backward(self, loss: Tensor) -> bool | None:
        """Our loss is already this micro-batch's exact share of the whole step (step-global normaliser), so
        undo DeepSpeed's division by the accumulation steps and its averaging over data-parallel ranks.

        At an optimizer-step boundary, returns whether the step was applied: False when the gradient norm was
        not finite (a NaN/inf loss gives one), in which case weights and optimizer state are untouched."""
        with attention_backend():  # gradient checkpointing recomputes the forward here: the same kernel again
            self.deepspeed.backward(loss * self.world, scale_wrt_gas=False)
        boundary = self.deepspeed.is_gradient_accumulation_boundary()
        if self.zero_stage == 0 and boundary:
            # Without ZeRO, DeepSpeed clips but does not report the norm: take it here, where the gradients
            # are complete (all-reduced at the boundary's backward) and not yet clipped.
            self._stage0_norm = float(torch.nn.utils.get_total_norm(
                [p.grad for p in self.module.parameters() if p.grad is not None]))
            self._skip = not math.isfinite(self._stage0_norm)
        self.scheduler.skip = self._skip
        self.deepspeed.step()
        self._skip = self.scheduler.skip = False
        return math.isfinite(self.grad_norm()) if boundary else None

    def grad_norm(self) -> float:
        """The last optimizer step's gradient norm, before clipping (inf or NaN for a skipped step)."""
        g = self._stage0_norm if self.zero_stage == 0 else self.deepspeed.get_global_grad_norm()
        return float(g) if g is not None else float("nan")

    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def pushed_names(self, unique: bool = False) -> list[str]:
        """The names gathered_weights yields (tied parameters under each of their names): the base model's
        Hugging Face names, with or without LoRA; what a push's receipt is checked against. `unique`: a tied
        parameter under its first name only, as save_pretrained writes it."""
        first: dict[int, str] = {}
        names = [hf for _, hf, p, _ in self._push_plan() if hf is not None and first.setdefault(id(p), hf) == hf]
        return names if unique else [hf for _, hf, _, _ in self._push_plan() if hf is not None]

    def _push_plan(self) -> list[tuple[str, str | None, torch.nn.Parameter, torch.nn.Module | None]]:
        """Every parameter as (its name, the HF name it is pushed under or None, the parameter, the LoRA layer
        whose merged weight it is or None). Without LoRA, names are the module's own. With LoRA, a targeted layer's
        `x.base_layer.weight` goes as `x.weight` merged with its adapter; `lora_A`/`lora_B` go under no name
        (they are gathered with their layer and folded into it)."""
        plan = []
        layers = dict(self.module.named_modules(remove_duplicate=False))
        for name, p in self.module.named_parameters(remove_duplicate=False):
            if ".lora_" in name:
                plan.append((name, None, p, None))
            elif ".base_layer." in name:
                prefix, _, leaf = name.partition(".base_layer.")
                plan.append((name, f"{prefix}.{leaf}", p, layers[prefix] if leaf == "weight" else None))
            else:
                plan.append((name, name, p, None))
        return plan

    def gathered_weights(self, bucket_numel: int = 50_000_000) -> Iterator[tuple[str, Tensor]]:
        """Full weights, a bucket at a time (a collective under ZeRO-3: every rank must iterate).

        A bucket holds whole modules (a decoder layer, the embedding, ...) up to `bucket_numel` elements,
        counted by `ds_numel` (`numel()` is 0 for a partitioned parameter), so a large model is never gathered
        whole. Whole layers matter: vLLM fuses q/k/v and gate/up and only loads a fused layer once all its
        parts have arrived, which must happen while they are still gathered.

        With LoRA the rollout engine gets merged weights, base + scale * B @ A, under the base model's names (see
        merged_weight and docs/one-gpu.md, "LoRA"): the same names, versions and probe verify the push as without it.
        """
        import deepspeed

        groups: dict[str, list[tuple[str | None, torch.nn.Parameter, torch.nn.Module | None]]] = {}
        owner: dict[int, str] = {}  # a tied parameter (lm_head = embed_tokens) goes with its first name
        for own, hf, p, layer in self._push_plan():
            # a LoRA layer's adapters group with its base weight: keyed by the layer's name as if it were plain
            parts = (hf or own.partition(".lora_")[0] + ".weight").split(".")
            cut = next((i + 2 for i, x in enumerate(parts) if x == "layers" and i + 1 < len(parts)), len(parts) - 1)
            key = owner.setdefault(id(p), ".".join(parts[:cut]))
            groups.setdefault(key, []).append((hf, p, layer))
        buckets: list[list[tuple[str | None, torch.nn.Parameter, torch.nn.Module | None]]] = [[]]
        size = 0
        for members in groups.values():
            n = sum(getattr(p, "ds_numel", p.numel()) for _, p, _ in members)
            if buckets[-1] and size + n > bucket_numel:
                buckets.append([])
                size = 0
            buckets[-1].extend(members)
            size += n
        for bucket in buckets:
            unique = list({id(p): p for _, p, _ in bucket}.values())
            with deepspeed.zero.GatheredParameters(unique, modifier_rank=None,
                                                   enabled=self.zero_stage == 3):
                for name, p, layer in bucket:
                    if name is not None:
                        yield name, p.data if layer is None else lora.merged_weight(layer)
