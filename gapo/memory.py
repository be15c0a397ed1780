"""Per-GPU memory plan of a run, from the model's config.json facts and the resolved config alone.

Computed before anything loads (no torch, no weights), so that a run which cannot fit is stopped before it
spends minutes downloading, building vLLM and partitioning weights. Everything is per rank, in bytes;
"GB" in the printed table means GiB (2**30), the unit of `rollout.kv_cache_gb` and of a "80 GB" H100's
memory (79.2 GiB usable).

What one rank holds (each rank runs a colocated vLLM engine and a DeepSpeed actor, see gapo/trainer/loop.py):

- vLLM: takes `gpu_memory_utilization * device` in total for its weights (model dtype), a profile-run
  reserve (VLLM_RESERVE) and, in what is left, the KV cache; `rollout.kv_cache_gb` sets the KV cache
  instead. The step's KV need (every sequence of the rank at once, prompt + max_new_tokens each) may be
  larger: vLLM then preempts and runs the step in waves, slower but not an error. It does refuse to start
  when the cache cannot hold one sequence of max_model_len (prompt + the larger of rollout/eval new tokens).
- Trainer states, ZeRO-partitioned over the ranks (bytes per parameter in STATE_BYTES).
- Activations of the largest micro-batch (micro_batch_size padded sequences of prompt + max_new_tokens, or
  `trainer.max_tokens_per_micro_batch` tokens when it is set), the padding mask, and the vocab
  head's working set (one LOGIT_CHUNK of logits).
- DeepSpeed's buffers and the optimizer step's (zero_buffer_bytes): the reduce bucket, held; while a step
  accumulates and at its optimizer step, AdamW's temporary (foreach on CUDA: a full fp32 copy of what it steps,
  torch/optim/adam.py `_multi_tensor_adam`), flat gradient copies, the bf16 gradients BF16_Optimizer keeps, and
  with an offloaded optimizer the fp32 partition bf16 runs accumulate in on the GPU before it goes to the host.
- A fixed allowance (OVERHEAD) for the CUDA context, NCCL and ZeRO-3 working buffers.
- Not on the GPU: with trainer.offload the host memory per rank (offload_host_bytes): master weights, Adam's
  moments, the fp32 gradient partition, the model-dtype staging copies, pinned blocks rounded up to a power of
  two by torch's caching host allocator; the fused CPU AdamW the actor uses then adds nothing at the step.

With `rollout.sleep_between_steps` vLLM frees its weights and KV cache while the actor trains, so the peak
is max(generation phase, training phase); without it vLLM's share is held in both and simply adds up.

Activations, per token of the micro-batch (b = dtype bytes, h hidden, qd = heads * head_dim, i intermediate,
L layers), counted from what autograd saves in a transformers Qwen2/Llama decoder layer with SDPA attention
(checked on CPU, transformers 5.19, by summing the tensors autograd saved in a padded bf16 forward of a
small Qwen2: they matched these counts to the byte; the CUDA memory-efficient SDPA kernel saves the same
q, k, v, output and mask as the CPU one):
- each RMSNorm saves its input upcast to fp32 (4h), the normalised value in model dtype (b*h) and the
  next linear's input (b*h): (4 + 2b) * h;
- attention saves q and k, v *repeated to all heads* (transformers repeats GQA heads whenever a padding mask
  is given on CUDA) and its output, which is also o_proj's input: 4 * b * qd;
- the SwiGLU MLP saves gate output, its SiLU, up output and their product (down_proj's input): 4 * b * i.
  One layer: 2 * (4 + 2b) * h + 4b * qd + 4b * i. This is Korthikanti et al. 2022 ("Reducing activation
  recomputation in large transformer models", sbh(34 + 5as/h) per layer in 16-bit) redone for this layer:
  no dropout, no s^2 score matrix (memory-efficient SDPA kernel), fp32 norms, GQA, SwiGLU. For
  Qwen2.5-1.5B it is 70.7 * h bytes per token against their 34 * h for a GPT layer with a 4h MLP.
- With gradient checkpointing only each layer's input is kept (L * b * h), and in backward one layer is
  recomputed in full; at its MLP backward the gradients of two of the [tokens, i] intermediates exist next
  to it (+2b * i), and the residual stream's gradient (2b * h) flows through. Without checkpointing all L
  layers stay (+ the same backward terms).
- The padding mask: transformers builds a boolean [B, 1, S, S] mask for SDPA when a micro-batch is padded
  (always, in the worst case planned here), and torch turns it into an additive mask in model dtype that the
  kernel saves for backward: B * S^2 * (1 + b) with checkpointing, B * S^2 * (1 + L * b) without (each
  layer saves its own copy). Quadratic in the sequence length: at 25,600 tokens it is 15 GiB.
- Logits: the head runs on response positions only, LOGIT_CHUNK tokens at a time; the chunk's logits are
  in model dtype (fp32 only LOGPROB_ROWS rows at a time) and are turned into their own gradient in place,
  recomputed in backward (gapo/trainer/logprobs.py), so one chunk * vocab * b, plus the head's weight gradient
  at full size (vocab * h * b) before ZeRO reduces it. The head phase and the layer backward do not peak
  at the same moment; adding both is conservative by about a GiB.

Calibration, honestly: the activation formula is derived from the code and checked against the tensors
autograd saves, but the totals have not been measured on a GPU; allocator fragmentation typically adds
5-15 % on top. VLLM_RESERVE and OVERHEAD are allowances, not measurements. With these constants the
issue's anchors come out as:
- Qwen2.5-Math-1.5B, configs/qwen_math.yaml (bf16, checkpointing, ZeRO-3 on 8 ranks, 8 x 4,096 tokens,
  gpu_memory_utilization 0.5), 80 GB: vLLM 40 + states 3.2 + activations 7.2 + mask 0.4 + logits 0.7 +
  overhead 3 = about 54.6 of 80 GiB: fits (the issue: about 55).
- DeepSeek-R1-Distill-Qwen-1.5B, configs/r1_distill_math.yaml (8 x 25,600 tokens): activations 45.1 GiB
  (the issue: 45-55) plus a 14.6 GiB padding mask next to vLLM's 40: about 107 GiB, does not fit (with
  rollout.sleep_between_steps the peak drops to about 67 GiB and it would).
- Qwen2.5-Math-1.5B on one GPU, configs/qwen_math_1gpu.yaml (ZeRO-2, optimizer offloaded): 32.0 GiB of host
  memory per rank (26.3 GiB of tensors and 5.7 GiB of power-of-two rounding of the pinned ones), where the plan
  once said 23 (it left out the staging copies, the rounding and, with torch's single-tensor AdamW, 11.5 GiB of
  step temporaries); on the GPU the 5.7 GiB fp32 accumulation partition of the step. The CPU measurement of the
  same accounting on SmolLM2-135M is docs/PERFORMANCE.md section 12.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gapo.config import Config

GiB = 2**30

# The actor's log-prob chunking, defined here and imported by gapo.trainer.logprobs: this module must not import
# torch, and the plan sits below the trainer. LOGIT_CHUNK: response tokens per vocab projection (the full
# [tokens, vocab] fp32 logits of a step never exist at once: each chunk's logits are recomputed in backward).
# LOGPROB_ROWS: rows of a chunk turned into probabilities at once (temporaries are [rows, V], never [chunk, V]).
LOGIT_CHUNK = 1024
LOGPROB_ROWS = 64

# vLLM's share beyond weights and KV cache: the peak of its profile run (a forward of up to 16,384 batched
# tokens and the sampler's fp32 logits for up to 1,024 sequences: about 1-1.5 GiB for 1.5B-3B models with
# 128-152k vocabularies) and its CUDA graphs. An allowance for models of that size.
VLLM_RESERVE = 2 * GiB
# Of that reserve, the CUDA graphs: a release that cannot offload them with the weights during sleep (vLLM < 0.32,
# gapo/rollout/vllm_compat.py) keeps them on the GPU while the actor trains. An allowance; unmeasured.
VLLM_GRAPHS = GiB // 2
# An engine's reserve by rollout.engine: the hf engine (a reference sampler) profiles nothing and keeps no graphs.
ENGINE_RESERVE = {"vllm": VLLM_RESERVE, "hf": 0}

# CUDA context and cuBLAS workspaces (about 1 GiB for torch and vLLM in one process), NCCL communicators
# (DeepSpeed's and vLLM's), ZeRO-3's gathered layers and prefetch, and allocator slack (the reduce bucket and the
# optimizer step's buffers are a term of their own: zero_buffer_bytes). An allowance, not a measurement.
OVERHEAD = 3 * GiB

# ZeRO's gradient reduce bucket, in elements: set explicitly in the actor's DeepSpeed config (its default is 5e8,
# 1.86 GiB per rank in fp32) so that the plan and the run hold the same buffer. It is allocated persistently, in
# the communication dtype (fp32: bf16 runs reduce in fp32).
REDUCE_BUCKET = 200_000_000

# Trainer bytes per parameter: (weights, gradients, optimizer state). bf16 runs accumulate gradients in
# fp32 (see Actor: grad_accum_dtype) and keep an fp32 master copy next to Adam's m and v.
STATE_BYTES = {"bfloat16": (2, 4, 4 + 4 + 4), "float32": (4, 4, 4 + 4)}
DTYPE_BYTES = {"bfloat16": 2, "float32": 4}

# ZeRO-3 steps the optimizer one sub-group of at most this many elements at a time (zero_optimization.sub_group_size,
# DeepSpeed 0.19.8's default, which the actor keeps): the step's buffers at stage 3 are at most this big.
SUB_GROUP = 1_000_000_000


def pinned_bytes(nbytes: int) -> int:
    """The page-locked memory a pinned host tensor of `nbytes` takes: torch 2.13's caching host allocator rounds
    every block up to a power of two unless PYTORCH_CUDA_ALLOC_CONF sets pinned_max_round_threshold
    (ATen/core/CachingHostAllocator.h, read in the installed headers), so a 6.2 GB fp32 partition takes 8 GiB.
    DeepSpeed pins through `tensor.pin_memory()`, which goes to that allocator on CUDA (GPU only: unverified on a
    GPU; the actor pins only when CUDA is there)."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def _shape(facts: dict) -> tuple[int, int, int, int, int, int, int]:
    """hidden, intermediate, layers, heads, kv_heads, head_dim, vocab from a config.json dict."""
    h, heads = facts["hidden_size"], facts["num_attention_heads"]
    return (h, facts["intermediate_size"], facts["num_hidden_layers"], heads,
            facts.get("num_key_value_heads") or heads, facts.get("head_dim") or h // heads, facts["vocab_size"])


def param_count(facts: dict) -> int:
    """Parameters of a Llama/Qwen2-style decoder: embeddings (twice when the output head is not tied),
    per layer q, k, v, o (+ Qwen2's q/k/v biases, or `attention_bias`), a SwiGLU MLP and two RMSNorms;
    the final norm."""
    h, i, n_layers, heads, kv, hd, vocab = _shape(facts)
    qd, kvd = heads * hd, kv * hd
    attn = h * qd + 2 * h * kvd + qd * h
    bias = facts.get("attention_bias", facts.get("model_type") == "qwen2")
    if bias:
        attn += qd + 2 * kvd + (h if facts.get("model_type") != "qwen2" else 0)  # Llama's bias is on o too
    mlp = 3 * h * i + ((2 * i + h) if facts.get("mlp_bias") else 0)
    embed = vocab * h * (1 if facts.get("tie_word_embeddings", False) else 2)
    return embed + n_layers * (attn + mlp + 2 * h) + h


def _linears(facts: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear layer of a decoder layer, by the names LoRA targets."""
    h, i, _, heads, kv, hd, _ = _shape(facts)
    qd, kvd = heads * hd, kv * hd
    return {"q_proj": (h, qd), "k_proj": (h, kvd), "v_proj": (h, kvd), "o_proj": (qd, h), "gate_proj": (h, i),
            "up_proj": (h, i), "down_proj": (i, h)}


def lora_param_count(facts: dict, rank: int, targets: list[str]) -> int:
    """Parameters of LoRA adapters (A: rank x in, B: out x rank) on the named linear layers of every decoder layer
    (model.lora.target_modules; names of other modules count nothing)."""
    shapes = _linears(facts)
    return _shape(facts)[2] * sum(rank * sum(shapes[t]) for t in targets if t in shapes)


def largest_adapted(facts: dict, targets: list[str]) -> int:
    """Elements of the largest weight matrix that LoRA adapts (model.lora.target_modules), the one whose merged weight
    costs most to build."""
    shapes = _linears(facts)
    return max((shapes[t][0] * shapes[t][1] for t in targets if t in shapes), default=0)


def lora_merge_bytes(facts: dict, targets: list[str], dtype: str) -> int:
    """The temporaries of one merged weight, base + scale * B @ A (gapo.trainer.lora.merged_weight), which every
    adapted layer builds in its forward, its backward and each push: B @ A in fp32 and its scaled copy (8 bytes an
    element), then in bf16 the base's fp32 copy and the fp32 sum (4 + 4; the cast to bf16 comes after the copy is
    freed); in fp32 the sum alone takes the place of the freed product. One layer's at a time: 12 bytes per element
    of the largest adapted matrix in bf16 (0.17 GB at Qwen2.5-1.5B, 0.8 GB at 7B), 8 in fp32. Counted from the code
    (the order CPython frees temporaries in), not measured on a GPU."""
    return (12 if dtype == "bfloat16" else 8) * largest_adapted(facts, targets)


def largest_param(facts: dict, lora_rank: int | None = None) -> int:
    """Elements of the largest trained parameter: the embedding (vocab x hidden; the untied head is as large), or
    with LoRA the largest adapter matrix (rank x the widest of hidden, intermediate and the query width)."""
    h, i, _, heads, _, hd, vocab = _shape(facts)
    return lora_rank * max(h, i, heads * hd) if lora_rank else max(vocab * h, i * h)


def kv_bytes_per_token(facts: dict, dtype_bytes: int) -> int:
    """K and V of every layer for one token: 2 * layers * kv_heads * head_dim * dtype bytes."""
    _, _, n_layers, _, kv, hd, _ = _shape(facts)
    return 2 * n_layers * kv * hd * dtype_bytes


def trainer_state_bytes(params: int, dtype: str, zero_stage: int, world: int, offload_optimizer: bool = False,
                        offload_params: bool = False, largest: int = 0) -> tuple[int, int]:
    """(on the GPU, in host memory): weights, gradients and optimizer state of one rank. ZeRO stage 1 partitions the
    optimizer state over the ranks, stage 2 also the gradients, stage 3 also the weights. Offloading the optimizer
    moves its state and the fp32 gradient partitions to the host (offload_host_bytes; `largest`: the largest
    trained parameter's elements); what the GPU still holds of the gradients then lives only while a step
    accumulates (zero_buffer_bytes). Offloading the weights moves them too (the layer being gathered is in
    OVERHEAD's ZeRO-3 share)."""
    w, g, opt = STATE_BYTES[dtype]
    if offload_optimizer:
        weights = params * w if zero_stage < 3 else math.ceil(params * w / world)
        host = offload_host_bytes(params, largest, dtype, zero_stage, world, offload_params)
        return (0 if offload_params else weights), host
    w, g, opt = params * w, params * g, params * opt
    w = w if zero_stage < 3 else w / world
    g = g if zero_stage < 2 else g / world
    opt = opt if zero_stage < 1 else opt / world
    host = w if offload_params else 0
    return math.ceil(w + g + opt - host), math.ceil(host)


def offload_host_bytes(params: int, largest: int, dtype: str, zero_stage: int, world: int,
                       offload_params: bool = False, pin: bool = True) -> int:
    """Host memory of one rank with trainer.offload.optimizer=cpu, from DeepSpeed 0.19.8's buffers (read line by line:
    runtime/zero/stage_1_and_2.py, stage3.py) for the rank's partition of P = params / world fp32 elements:

    - fp32 master weights (4P) and Adam's moments (8P, created by torch's AdamW: not pinned);
    - the fp32 gradient partition the step reads (4P, pinned);
    - stage 1/2: the model-dtype copy of the updated partition that goes back to the GPU (b * P, pinned and held),
      the largest parameter's gradient staging buffer (b * largest, pinned), and with fp32 weights (gradients then
      accumulate in the weights' dtype) a host accumulator per parameter of the partition (about 4P: whole
      parameters, each pinned on its own, rounding not counted); the master weights are pinned too;
    - stage 3: the fp32 gradient accumulation buffer (4P, pinned: DeepSpeed puts it on the host when offloading)
      and, unless the weights are offloaded too, the model-dtype copy of one optimizer sub-group that the blocking
      host-to-GPU copy makes (torch converts on the CPU first; a transient of at most SUB_GROUP elements, from
      torch's copy semantics, not read in source here); offloaded weights: b * P pinned.
    - the optimizer step's temporaries: none, with the fused CPU AdamW the actor uses (gapo.trainer.actor.adamw;
      torch's single-tensor AdamW would add 8P, measured in docs/PERFORMANCE.md section 12).

    Pinned tensors are counted as the caching host allocator rounds them (pinned_bytes; `pin`=False: as on the CPU,
    where the actor pins nothing): GPU only, unverified."""
    b = DTYPE_BYTES[dtype]
    part = math.ceil(params / world)
    pinned = pinned_bytes if pin else int
    host = 8 * part + pinned(4 * part)  # Adam's moments, the fp32 gradient partition
    if zero_stage < 3:  # master weights, the updated partition's staging copy, the largest gradient's staging
        host += pinned(4 * part) + pinned(b * part) + pinned(b * largest)
        host += 4 * part if dtype == "float32" else 0
    else:  # master weights (not pinned at stage 3), the gradient accumulation buffer, weights or their transient
        host += 4 * part + pinned(4 * part)
        host += pinned(b * part) if offload_params else b * min(part, SUB_GROUP)
    return host


def activation_bytes(facts: dict, tokens: int, seq_len: int, dtype_bytes: int,
                     checkpointing: bool) -> tuple[int, int]:
    """(activations, padding mask) of one micro-batch of `tokens` tokens in padded sequences of `seq_len`,
    at the peak of its backward (formulas in the module docstring)."""
    h, i, n_layers, heads, _, hd, _ = _shape(facts)
    b = dtype_bytes
    layer = 2 * (4 + 2 * b) * h + 4 * b * heads * hd + 4 * b * i
    backward = 2 * b * i + 2 * b * h
    per_token = (n_layers * b * h + layer if checkpointing else n_layers * layer) + backward
    seq_len = min(seq_len, tokens)
    mask = tokens * seq_len * (1 + (1 if checkpointing else n_layers) * b)  # B * S^2 with B * S = tokens
    return tokens * per_token, mask


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's memory, in bytes. `total` is the peak: max(generation phase, training phase)."""

    params: int
    dtype: str
    zero_stage: int
    world: int
    micro_batch_tokens: int
    sleep: bool
    vllm_weights: int
    vllm_reserve: int
    kv_cache_given: int  # what vLLM gets for its KV cache (after weights and reserve, or kv_cache_gb)
    kv_cache_needed: int  # every sequence of this rank's step at full length, at once
    kv_one_sequence: int  # one sequence of max_model_len: vLLM refuses to start with less
    context: int  # the engine's max_model_len, in tokens
    trainer_states: int
    host_states: int  # what trainer.offload keeps in host memory instead, with its buffers (not in the GPU's peak)
    activations: int
    attention_mask: int
    logits: int
    reduce_bucket: int  # ZeRO's gradient reduce bucket (and offload's staging buffer): held for the whole run
    zero_buffers: int  # while a step accumulates and at the optimizer step: AdamW's temporary, gradient copies and
    # buffers that only exist then (zero_buffer_bytes)
    graphs_asleep: int = 0  # vLLM's CUDA graphs left on the GPU while it sleeps (a release that cannot offload them)
    lora_merge: int = 0  # LoRA: one merged weight's temporaries (lora_merge_bytes), in a forward, backward or push
    overhead: int = OVERHEAD
    split: bool = False  # split placement: a training rank's plan, no engine on its GPU

    @property
    def vllm_total(self) -> int:
        return self.vllm_weights + self.vllm_reserve + self.kv_cache_given

    @property
    def generation(self) -> int:
        """vLLM generating while the trainer's states and DeepSpeed's persistent reduce bucket stay resident; the weight
        push, which builds LoRA's merged weights, happens beside them."""
        return self.vllm_total + self.trainer_states + self.reduce_bucket + self.lora_merge + self.overhead

    @property
    def training(self) -> int:
        """The actor's update; vLLM's share stays unless it sleeps. Asleep, its weights and KV cache are
        freed and its reserve was only a profile-time peak in the same process's allocator, but for the CUDA graphs of
        a release that keeps them (graphs_asleep)."""
        vllm = self.graphs_asleep if self.sleep else self.vllm_total
        return (vllm + self.trainer_states + self.activations + self.attention_mask + self.logits + self.reduce_bucket
                + self.zero_buffers + self.lora_merge + self.overhead)

    @property
    def total(self) -> int:
        return max(self.generation, self.training)

    @property
    def waves(self) -> bool:
        """The step's sequences do not all fit in vLLM's KV cache at once: it preempts and runs in waves."""
        return self.kv_cache_needed > self.kv_cache_given

    def fits(self, device_gb: float) -> bool:
        return self.total <= device_gb * GiB


def graphs_leave_with_weights() -> bool:
    """Whether the installed vLLM offloads its CUDA graphs during sleep, read from its version without importing it
    (the plan runs before anything loads). No vLLM installed: planned as if it kept them."""
    from gapo.rollout.vllm_compat import installed_vllm, offloads_graphs_asleep

    version = installed_vllm()
    return version is not None and offloads_graphs_asleep(version)


def micro_batch_shape(cfg: Config) -> tuple[int, int]:
    """(tokens, padded sequence length) of the largest training micro-batch."""
    seq_len = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    budget = cfg.trainer.max_tokens_per_micro_batch
    return (budget if budget else cfg.trainer.micro_batch_size * seq_len), seq_len


def memory_plan(cfg: Config, facts: dict, world: int, device_gb: float = 80.0,
                max_model_len: int | None = None) -> MemoryPlan:
    """The per-GPU plan of `cfg` for the model described by `facts` (gapo.models.model_facts) on `world`
    training ranks of `device_gb` GiB each, for the vLLM engine (the GPU path). With split placement it is a
    training rank's plan: vLLM runs on the generator ranks, each with a GPU of its own and nothing else on it.
    `max_model_len`: the engine's context, which a run sizes to the longer of its training prompts and its
    validation benchmarks' (gapo.evaluation.context_length); by default the config's data.max_prompt_tokens plus
    the larger of the rollout's and evaluation's new tokens."""
    r, d, m = cfg.rollout, cfg.data, cfg.model
    b = DTYPE_BYTES[m.dtype]
    params = param_count(facts)
    weights = params * b
    split = r.placement == "split"
    if split:
        kv_given = 0
    elif r.kv_cache_gb:
        kv_given = int(r.kv_cache_gb * GiB)
    else:
        kv_given = max(0, int(r.gpu_memory_utilization * device_gb * GiB) - weights - VLLM_RESERVE)
    offload = cfg.trainer.offload
    stage = cfg.zero_stage(world)
    # With LoRA only the adapters have gradients and optimizer state; the frozen base weights are held in the
    # model's dtype (partitioned at stage 3, on the host when the weights are offloaded).
    trained = lora_param_count(facts, m.lora.rank, m.lora.target_modules) if m.lora else params
    largest = largest_param(facts, m.lora.rank if m.lora else None)
    states, host = trainer_state_bytes(trained, m.dtype, stage, world, offload.optimizer == "cpu",
                                       offload.params == "cpu", largest)
    if m.lora:
        frozen = math.ceil(weights / (world if stage == 3 else 1))
        states, host = (states, host + frozen) if offload.params == "cpu" else (states + frozen, host)
    per_token = kv_bytes_per_token(facts, b)
    seq_len = d.max_prompt_tokens + r.max_new_tokens
    max_model_len = max_model_len or d.max_prompt_tokens + max(r.max_new_tokens, cfg.eval.max_new_tokens)
    tokens, padded = micro_batch_shape(cfg)
    activations, mask = activation_bytes(facts, tokens, padded, b, m.gradient_checkpointing)
    _, _, _, _, _, _, vocab = _shape(facts)
    return MemoryPlan(
        params=params, dtype=m.dtype, zero_stage=stage, world=world, micro_batch_tokens=tokens,
        sleep=r.sleep_between_steps, vllm_weights=0 if split else weights,
        vllm_reserve=0 if split else ENGINE_RESERVE[r.engine],
        graphs_asleep=VLLM_GRAPHS if (r.sleep_between_steps and not split and r.engine == "vllm"
                                      and r.compile != "eager" and not graphs_leave_with_weights()) else 0,
        kv_cache_given=kv_given, kv_cache_needed=0 if split else cfg.shape(world).rollouts * seq_len * per_token,
        kv_one_sequence=0 if split else max_model_len * per_token, context=max_model_len, split=split,
        # A KL penalty keeps a frozen reference copy of the weights, partitioned like the actor's.
        trainer_states=states
        + (math.ceil(weights / (world if stage == 3 else 1)) if cfg.algorithm.kl_coef > 0 else 0),
        host_states=host,
        activations=activations, attention_mask=mask,
        logits=LOGIT_CHUNK * vocab * b + vocab * facts["hidden_size"] * b,
        lora_merge=lora_merge_bytes(facts, m.lora.target_modules, m.dtype) if m.lora else 0,
        **zero_buffer_bytes(trained, stage, world, offload.optimizer == "cpu", m.dtype, largest))


def zero_buffer_bytes(params: int, zero_stage: int, world: int, offload: bool = False, dtype: str = "bfloat16",
                      largest: int = 0) -> dict[str, int]:
    """GPU buffers of DeepSpeed 0.19.8 and torch 2.13's AdamW beyond the states, for `params` trained parameters
    (`largest`: the largest one's elements), read in their source (runtime/engine.py picks the optimizer wrapper,
    runtime/zero/stage_1_and_2.py, stage3.py, runtime/bf16_optimizer.py, torch/optim/adam.py); P = params / world
    at stage >= 1, params at stage 0. GPU only: unverified on a GPU.

    reduce_bucket, held from the engine's build on (so while vLLM generates too): REDUCE_BUCKET fp32 elements (or
    all the gradients if fewer) on several ranks at stage >= 2 and with an offloaded optimizer (one rank included);
    offloaded at stage 1/2, also the largest parameter's gradient staging buffer (model dtype).

    zero_buffers, while a step accumulates and at the optimizer step (the training phase):
    - not offloaded: AdamW on CUDA tensors takes torch's foreach path, whose sqrt(exp_avg_sq) is a full fp32 copy
      of what it steps (4P; at stage 3 one sub-group at a time); plus the flat fp32 gradient the step reads where
      it is a copy (4P: stage 3's step buffer, and fp32 weights at stage 1/2; in bf16 at stage 2 it is a view of
      the fp32 accumulation partition), and in bf16 at stage 1 (DeepSpeed's BF16_Optimizer, one bf16 rank
      included) the bf16 gradients autograd writes, kept until the step (immediate_grad_update is off: 2 * params).
    - offloaded: the trainer states keep no gradients on the GPU, but in bf16 with fp32 accumulation stage 1/2 sum
      the step's gradients in an fp32 partition on the GPU (the `compact` buffer, built at the first reduction and
      freed at the step: 4P) before copying it to the host; stage 1 also holds each parameter's fp32 gradient
      until the boundary (4 * params, fp32 weights too). Stage 3 accumulates on the host (offload_host_bytes)."""
    b = DTYPE_BYTES[dtype]
    part = math.ceil(params / world) if zero_stage >= 1 else params
    bucket = min(REDUCE_BUCKET, params) * 4
    if offload:
        held = bucket + (b * largest if zero_stage < 3 else 0)
        step = (4 * params if zero_stage == 1 else 0) + (4 * part if zero_stage < 3 and dtype == "bfloat16" else 0)
        return {"reduce_bucket": held, "zero_buffers": step}
    stepped = min(part, SUB_GROUP) if zero_stage == 3 else part
    flat = 4 * stepped if zero_stage == 3 or (zero_stage >= 1 and dtype == "float32") else 0
    low = 2 * params if zero_stage == 1 and dtype == "bfloat16" else 0
    return {"reduce_bucket": bucket if world > 1 and zero_stage >= 2 else 0, "zero_buffers": 4 * stepped + flat + low}


def format_plan(plan: MemoryPlan, device_gb: float) -> str:
    """A short table to read before launching: each item in GiB, the peak against the device, a verdict."""
    def gb(x: int) -> str:
        return f"{x / GiB:8.1f}"

    need = gb(plan.kv_cache_needed).strip()
    kv_note = (f"step needs {need}: vLLM will preempt / run in waves" if plan.waves
               else f"step needs {need}: all at once")
    engine = [] if plan.split else [
        (f"vLLM weights ({plan.dtype})", plan.vllm_weights, ""),
        ("vLLM profile/graphs reserve", plan.vllm_reserve, ""),
        ("vLLM KV cache", plan.kv_cache_given, kv_note),
    ]
    rows = [
        *engine,
        (f"trainer states (ZeRO-{plan.zero_stage} / {plan.world})", plan.trainer_states,
         f"{plan.params / 1e9:.2f} B params"),
        ("activations", plan.activations, f"{plan.micro_batch_tokens:,} tokens per micro-batch"),
        ("padding mask", plan.attention_mask, ""),
        ("logits chunk + head grad", plan.logits, ""),
        ("ZeRO reduce bucket (held)", plan.reduce_bucket, ""),
        ("ZeRO step buffers", plan.zero_buffers, ""),
        *([("LoRA merged-weight temporaries", plan.lora_merge, "one layer's at a time")] if plan.lora_merge else []),
        ("CUDA / NCCL / ZeRO overhead", plan.overhead, ""),
    ]
    lines = [f"  {name:<32}{gb(x)}  {note}".rstrip() for name, x, note in rows]
    if plan.split:
        lines.insert(0, "  (split placement: a training rank's plan; vLLM runs on the generator ranks)")
    if plan.host_states:
        lines.append(f"  {'(offloaded to host memory)':<32}{gb(plan.host_states)}  per rank, not on the GPU")
    rule = "  " + "-" * 40
    lines.append(rule)
    if plan.graphs_asleep:
        lines.append(f"  {'(vLLM graphs kept while asleep)':<32}{gb(plan.graphs_asleep)}  this vLLM cannot offload "
                     "them (< 0.32): in the training phase")
    if plan.sleep:
        lines.append(f"  {'generation phase':<32}{gb(plan.generation)}")
        lines.append(f"  {'training phase (vLLM asleep)':<32}{gb(plan.training)}")
    short = plan.total / GiB - device_gb
    verdict = "fits" if plan.fits(device_gb) else f"does NOT fit (short by {short:.1f} GB)"
    lines.append(f"  {'peak per GPU':<32}{gb(plan.total)}  of {device_gb:.1f} GB: {verdict}")
    if plan.kv_cache_given < plan.kv_one_sequence:
        lines.append(f"  vLLM's KV cache ({gb(plan.kv_cache_given).strip()} GB) cannot hold one sequence of "
                     f"max_model_len ({gb(plan.kv_one_sequence).strip()} GB): vLLM will refuse to start")
    return "Per-GPU memory plan (GB = GiB, estimates):\n" + "\n".join(lines)


def plan_text(cfg: Config, world: int, device_gb: float | None, max_model_len: int | None = None) -> tuple[str, bool]:
    """The plan of `cfg` on `world` ranks as printed and logged, and whether it fits. `device_gb`: the GPU the
    run found (None: planning away from one, for an 80 GB H100); `max_model_len`: the engine's context where the
    run knows it (memory_plan)."""
    from gapo.models import model_facts

    facts = model_facts(cfg.model.path)
    if not facts:
        return f"No memory plan: no config.json for {cfg.model.path} (local, hub cache or known models).", True
    size = device_gb or 80.0
    plan = memory_plan(cfg, facts, world, size, max_model_len)
    ranks = "training rank" if cfg.rollout.placement == "split" else "rank"  # (split: the generators' are not here)
    where = (f"{world} {ranks}s" if world > 1 else f"1 {ranks}") \
        + ("" if device_gb else ", for an 80 GB GPU (none here)")
    return f"{format_plan(plan, size)}\n  ({cfg.model.path}, {where}, engine context {plan.context:,} tokens)", \
        plan.fits(size)


OFFLOAD_OPTIONS = {"none": ("none", "none"), "optimizer": ("cpu", "none"), "optimizer + params": ("cpu", "cpu")}


def offload_table(cfg: Config, world: int, sizes: list[float]) -> str:
    """`gapo-train --plan`: the peak per GPU of `cfg` under each trainer.offload option, for each GPU size, and
    which fit; the config's own option is marked. With one rank an offload also sets the ZeRO stage it needs."""
    from gapo.config import OffloadConfig
    from gapo.models import model_facts

    facts = model_facts(cfg.model.path)
    if not facts:
        return f"No memory plan: no config.json for {cfg.model.path} (local, hub cache or known models)."
    own = (cfg.trainer.offload.optimizer, cfg.trainer.offload.params)
    head = f"  {'trainer.offload':<22}{'host / rank':>12}" + "".join(f"{f'{g:g} GB GPU':>20}" for g in sizes)
    lines = [f"Peak per GPU by trainer.offload ({cfg.model.path}, {world} rank{'s' if world > 1 else ''}, GB = GiB):",
             head]
    for name, (optimizer, params) in OFFLOAD_OPTIONS.items():
        trainer = cfg.trainer.model_copy(update={"offload": OffloadConfig(optimizer=optimizer, params=params)})
        option = cfg.model_copy(update={"trainer": trainer})
        cells = ""
        for g in sizes:
            plan = memory_plan(option, facts, world, g)
            cells += f"{plan.total / GiB:>11.1f} {'fits' if plan.fits(g) else 'NO':>8}"
        mark = " (this config)" if (optimizer, params) == own else ""
        lines.append(f"  {name + mark:<22}{plan.host_states / GiB:>12.1f}{cells}")
    return "\n".join(lines)
