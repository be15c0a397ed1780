"""The per-GPU memory plan: the issue's anchors for the paper's configs, and the arithmetic by hand."""

import math
from dataclasses import replace

import pytest

from gapo.configfile import load_config, resolve
from gapo.memory import (
    OVERHEAD,
    VLLM_RESERVE,
    GiB,
    activation_bytes,
    format_plan,
    kv_bytes_per_token,
    memory_plan,
    micro_batch_shape,
    param_count,
    trainer_state_bytes,
)
from gapo.models import KNOWN_MODELS

QWEN = KNOWN_MODELS["Qwen/Qwen2.5-Math-1.5B"]
R1 = KNOWN_MODELS["deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"]
LLAMA = KNOWN_MODELS["meta-llama/Llama-3.2-3B-Instruct"]

# A made-up Llama-style model small enough to count by hand.
TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=100, tie_word_embeddings=True)


# ---------------------------------------------------------------------------------------------- anchors
def test_qwen_math_fits_at_about_55_of_80_gb():
    cfg = load_config("qwen_math")
    assert (cfg.model.dtype, cfg.model.gradient_checkpointing, cfg.trainer.zero_stage) == ("bfloat16", True, 3)
    plan = memory_plan(cfg, QWEN, world=8, device_gb=80)
    assert plan.micro_batch_tokens == 8 * 4096
    assert plan.vllm_total == pytest.approx(40 * GiB, abs=1)
    assert 45 <= plan.total / GiB <= 65
    assert plan.fits(80)
    assert not plan.waves  # 16 prompts x 8 rollouts x 4,096 tokens of KV: 14 GiB, inside vLLM's 35
    text = format_plan(plan, 80)
    assert "fits" in text and "NOT" not in text and "waves" not in text


EIGHT_ROLLOUTS = ["trainer.max_tokens_per_micro_batch=null"]  # micro-batches of 8 rollouts, not a token budget


def test_r1_distill_at_24k_tokens_does_not_fit_in_80_gb():
    cfg = load_config("r1_distill_math", EIGHT_ROLLOUTS)
    assert (cfg.rollout.max_new_tokens, cfg.trainer.micro_batch_size) == (24576, 8)
    plan = memory_plan(cfg, R1, world=8, device_gb=80)
    assert 40 <= plan.activations / GiB <= 60
    assert plan.vllm_total == pytest.approx(40 * GiB, abs=1)
    assert not plan.fits(80)
    assert plan.waves  # 128 sequences of 25,600 tokens need 87.5 GiB of KV
    text = format_plan(plan, 80)
    short = plan.total / GiB - 80
    assert f"does NOT fit (short by {short:.1f} GB)" in text
    assert "vLLM will preempt / run in waves" in text


@pytest.mark.parametrize("config, facts", [("r1_distill_math", R1), ("deepcoder", R1), ("llama_math", LLAMA)])
def test_long_context_configs_as_shipped_fit_by_their_own_plan(config, facts):
    cfg = load_config(config)
    plan = memory_plan(cfg, facts, world=8, device_gb=80)
    assert cfg.trainer.max_tokens_per_micro_batch and plan.micro_batch_tokens == cfg.trainer.max_tokens_per_micro_batch
    assert plan.fits(80), format_plan(plan, 80)


def test_sleep_mode_lowers_the_peak_to_the_larger_phase():
    awake = memory_plan(load_config("r1_distill_math", EIGHT_ROLLOUTS), R1, world=8)
    asleep = memory_plan(load_config("r1_distill_math", [*EIGHT_ROLLOUTS, "rollout.sleep_between_steps=true"]), R1,
                         world=8)
    assert awake.total == awake.training == awake.vllm_total + asleep.training  # vLLM's share adds up
    assert asleep.total == max(asleep.generation, asleep.training) == asleep.training
    assert asleep.total == awake.total - awake.vllm_total
    assert asleep.generation == awake.generation
    # A phase can dominate the other way: with no activations to speak of, generation is the peak.
    light = replace(asleep, activations=0, attention_mask=0, logits=0)
    assert light.total == light.generation > light.training


# ---------------------------------------------------------------------------------------------- arithmetic
def test_parameter_counts_of_the_papers_models():
    assert param_count(QWEN) == pytest.approx(1.54e9, rel=0.005)  # Qwen2.5-Math-1.5B: 1.54 B
    assert param_count(LLAMA) == pytest.approx(3.21e9, rel=0.005)  # Llama-3.2-3B: 3.21 B
    assert param_count(R1) - param_count(QWEN) == R1["vocab_size"] * R1["hidden_size"]  # untied head


def test_parameter_count_by_hand():
    # embed 100*64; per layer q 64*64, k and v 2*64*32, o 64*64, MLP 3*64*128, 2 norms of 64; final norm
    per_layer = 4096 + 4096 + 4096 + 24576 + 128
    assert param_count(TINY) == 6400 + 2 * per_layer + 64
    assert param_count({**TINY, "model_type": "qwen2"}) == param_count(TINY) + 2 * (64 + 2 * 32)  # q, k, v bias
    assert param_count({**TINY, "tie_word_embeddings": False}) == param_count(TINY) + 6400
    assert param_count({k: v for k, v in TINY.items() if k != "head_dim"}) == param_count(TINY)  # 64 / 4 = 16


def test_kv_bytes_per_token():
    assert kv_bytes_per_token(TINY, 2) == 2 * 2 * 2 * 16 * 2  # K and V x layers x kv heads x head_dim x bf16
    assert kv_bytes_per_token(TINY, 4) == 512
    assert kv_bytes_per_token(QWEN, 2) == 2 * 28 * 2 * 128 * 2  # 28 KiB per token


@pytest.mark.parametrize("dtype,expected", [
    # (weights, grads, optimizer) bytes per parameter: bf16 (2, 4, 12), fp32 (4, 4, 8); 1000 params, 4 ranks
    ("bfloat16", {0: 18000, 1: 2000 + 4000 + 3000, 2: 2000 + 1000 + 3000, 3: 18000 // 4}),
    ("float32", {0: 16000, 1: 4000 + 4000 + 2000, 2: 4000 + 1000 + 2000, 3: 16000 // 4}),
])
def test_trainer_states_under_each_zero_stage(dtype, expected):
    for stage, n in expected.items():
        assert trainer_state_bytes(1000, dtype, stage, world=4) == (n, 0), stage
        assert trainer_state_bytes(1000, dtype, stage, world=1) == (expected[0], 0)  # one rank: nothing to split


def test_activation_bytes_by_hand():
    # bf16, 2 sequences of 10 tokens. One layer per token: 2 norms x (4 + 2*2) * 64 + 4*2*64 (q, k, v, out)
    # + 4*2*128 (MLP) = 2560; backward: 2*2*128 + 2*2*64 = 768.
    acts, mask = activation_bytes(TINY, tokens=20, seq_len=10, dtype_bytes=2, checkpointing=True)
    assert acts == 20 * (2 * 2 * 64 + 2560 + 768)  # layer inputs of both layers, one layer recomputed
    assert mask == 2 * 10 * 10 * (1 + 2)  # bool mask + one additive bf16 copy
    acts, mask = activation_bytes(TINY, tokens=20, seq_len=10, dtype_bytes=2, checkpointing=False)
    assert acts == 20 * (2 * 2560 + 768)
    assert mask == 2 * 10 * 10 * (1 + 2 * 2)  # every layer keeps its own copy


def test_plan_of_a_small_config_by_hand():
    cfg = resolve({"model": {"dtype": "bfloat16"},
                   "rollout": {"prompts_per_step": 8, "group_size": 4, "max_new_tokens": 90,
                               "gpu_memory_utilization": 0.5},
                   "data": {"max_prompt_tokens": 10},
                   "trainer": {"ppo_mini_batch_size": 32, "micro_batch_size": 4, "zero_stage": 2}})
    plan = memory_plan(cfg, TINY, world=2, device_gb=8)
    p = param_count(TINY)
    assert plan.vllm_weights == 2 * p
    assert plan.kv_cache_given == 4 * GiB - 2 * p - VLLM_RESERVE
    assert plan.kv_cache_needed == 4 * 4 * 100 * 256  # 4 prompts per rank x 4 rollouts x 100 tokens x 256 B
    assert plan.trainer_states == trainer_state_bytes(p, "bfloat16", 2, 2)[0]
    assert plan.micro_batch_tokens == 400
    assert plan.overhead == OVERHEAD
    assert plan.fits(8) and not plan.fits(4)
    given = memory_plan(resolve({**cfg.model_dump(), "rollout": {**cfg.rollout.model_dump(), "kv_cache_gb": 1.5}}),
                        TINY, world=2, device_gb=8)
    assert given.kv_cache_given == int(1.5 * GiB)
    assert given.vllm_total == 2 * p + VLLM_RESERVE + int(1.5 * GiB)


def test_a_kv_cache_smaller_than_one_sequence_is_flagged():
    cfg = load_config("r1_distill_math", ["rollout.kv_cache_gb=0.5", "eval.max_new_tokens=30000"])
    plan = memory_plan(cfg, R1, world=8)
    assert plan.kv_one_sequence == (1024 + 30000) * kv_bytes_per_token(R1, 2)  # eval sets max_model_len
    assert "vLLM will refuse to start" in format_plan(plan, 80)


def test_the_engine_context_is_planned_as_the_run_sizes_it():
    """A run sizes vLLM's context to the longer of its training prompts and its validation benchmarks' longest
    (gapo.evaluation.context_length; issue 52 item 7): the plan's one-sequence check and its text follow it."""
    from gapo.memory import plan_text

    cfg = load_config("qwen_math")
    default = memory_plan(cfg, QWEN, world=8)
    assert default.context == cfg.data.max_prompt_tokens + max(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens)
    longer = memory_plan(cfg, QWEN, world=8, max_model_len=default.context + 1000)
    assert longer.kv_one_sequence == default.kv_one_sequence + 1000 * kv_bytes_per_token(QWEN, 2)
    text, _ = plan_text(cfg, 8, 80, max_model_len=default.context + 1000)
    assert f"engine context {default.context + 1000:,} tokens" in text


def test_a_token_budget_sets_the_micro_batch_size():
    cfg = load_config("r1_distill_math", ["trainer.max_tokens_per_micro_batch=null"])
    assert micro_batch_shape(cfg) == (8 * 25600, 25600)
    budgeted = load_config("r1_distill_math")  # as shipped: a budget of 32,768 tokens
    assert micro_batch_shape(budgeted) == (32768, 25600)
    plan = memory_plan(budgeted, R1, world=8)
    assert plan.micro_batch_tokens == 32768
    assert plan.activations < memory_plan(cfg, R1, world=8).activations / 5


def test_zero3_buffers_are_planned():
    """ZeRO's persistent reduce bucket (set explicitly in the actor, REDUCE_BUCKET fp32 elements) and, per
    optimizer step, a flat fp32 copy of the rank's gradient partition and the optimizer's temporary."""
    from gapo.memory import REDUCE_BUCKET, param_count, zero_buffer_bytes

    cfg = load_config("qwen_math")
    plan = memory_plan(cfg, QWEN, world=8, device_gb=80)
    p = param_count(QWEN)
    assert plan.reduce_bucket == REDUCE_BUCKET * 4  # 0.75 GiB
    assert plan.zero_buffers == 2 * math.ceil(p / 8) * 4  # 2 x 0.72 GiB for 1.54 B params on 8 ranks
    assert 1.4 < plan.zero_buffers / GiB < 1.5
    # The bucket is allocated with the engine and held while vLLM generates: both phases count it.
    assert plan.generation == plan.vllm_total + plan.trainer_states + plan.reduce_bucket + plan.overhead
    assert plan.training - plan.reduce_bucket - plan.zero_buffers == (
        plan.vllm_total + plan.trainer_states + plan.activations + plan.attention_mask + plan.logits + plan.overhead)
    text = format_plan(plan, 80)
    assert "ZeRO reduce bucket (held)" in text and "ZeRO step buffers" in text
    # one rank: nothing reduced (no bucket), but the optimizer step still has its temporaries (next test)
    assert zero_buffer_bytes(p, zero_stage=0, world=1, dtype="float32")["reduce_bucket"] == 0
    assert memory_plan(cfg, QWEN, world=1).reduce_bucket == 0


def test_one_rank_plans_the_optimizer_steps_temporaries():
    """AdamW on CUDA tensors runs torch's foreach path, whose sqrt(exp_avg_sq) is a full fp32 copy of what it steps
    (torch/optim/adam.py, _multi_tensor_adam); the plan once counted nothing for it on one rank. In bf16 one rank runs
    DeepSpeed's BF16_Optimizer (stage 1), which also keeps the bf16 gradients until the step. By hand for
    Qwen2.5-Math-1.5B: 1,543,714,304 parameters."""
    from gapo.memory import zero_buffer_bytes

    n = 1_543_714_304
    assert param_count(QWEN) == n
    bf16 = memory_plan(load_config("qwen_math"), QWEN, world=1)  # bf16 on one rank: stage 1
    assert bf16.zero_stage == 1
    assert bf16.zero_buffers == 6_174_857_216 + 3_087_428_608  # fp32 sqrt copy (4 n) + bf16 gradients (2 n)
    fp32 = memory_plan(load_config("qwen_math", ["model.dtype=float32"]), QWEN, world=1)  # stage 0
    assert fp32.zero_stage == 0 and fp32.zero_buffers == 6_174_857_216
    assert bf16.training - bf16.zero_buffers == (bf16.vllm_total + bf16.trainer_states + bf16.activations
                                                 + bf16.attention_mask + bf16.logits + bf16.overhead)
    # several ranks: the temporary is the partition's; a flat fp32 gradient copy where the step makes one
    part = n // 4  # 385,928,576
    assert zero_buffer_bytes(n, 2, 4, dtype="bfloat16")["zero_buffers"] == 4 * part  # the step reads a view
    assert zero_buffer_bytes(n, 2, 4, dtype="float32")["zero_buffers"] == 8 * part
    assert zero_buffer_bytes(n, 1, 4, dtype="float32")["zero_buffers"] == 8 * part
    assert zero_buffer_bytes(n, 1, 4, dtype="bfloat16")["zero_buffers"] == 4 * part + 2 * n
    assert zero_buffer_bytes(n, 3, 4, dtype="bfloat16")["zero_buffers"] == 8 * part
    assert zero_buffer_bytes(4_000_000_000, 3, 2, dtype="bfloat16")["zero_buffers"] == 8 * 10**9  # one sub-group


def test_pinned_host_blocks_round_up_to_a_power_of_two():
    from gapo.memory import pinned_bytes

    assert [pinned_bytes(x) for x in (0, 1, 4096, 4097, 3 * 2**20)] == [0, 1, 4096, 8192, 4 * 2**20]
    assert pinned_bytes(6_174_857_216) == 8 * GiB  # Qwen2.5-Math-1.5B's fp32 partition on one rank


def test_one_gpu_offload_by_hand_for_qwen_math():
    """configs/qwen_math_1gpu.yaml: ZeRO-2 on one rank, optimizer offloaded, bf16. Every term by hand from
    DeepSpeed 0.19.8's buffers (gapo/memory.py offload_host_bytes, zero_buffer_bytes): n = 1,543,714,304 parameters,
    the largest the 151,936 x 1,536 embedding (233,373,696). The plan said 23 GiB of host memory; the issue
    estimated ~40 GB with torch's single-tensor AdamW."""
    from gapo.memory import REDUCE_BUCKET, offload_host_bytes

    cfg = load_config("qwen_math_1gpu")
    plan = memory_plan(cfg, QWEN, world=1, device_gb=24)
    n, emb = 1_543_714_304, 151_936 * 1_536
    assert (plan.zero_stage, plan.dtype) == (2, "bfloat16")
    # host: Adam's moments 8n (not pinned), fp32 gradient partition 4n and fp32 master weights 4n (pinned: 8 GiB
    # blocks each), the bf16 copy of the updated weights 2n (pinned: 4 GiB) and the largest gradient's bf16
    # staging buffer (pinned: 512 MiB); no step temporaries with the fused AdamW.
    assert plan.host_states == 12_349_714_432 + 2 * 8 * GiB + 4 * GiB + 512 * 2**20 == 34_361_421_824  # 32.0 GiB
    assert offload_host_bytes(n, emb, "bfloat16", 2, 1, pin=False) == 18 * n + 2 * emb  # unrounded, as on CPU
    # GPU: the bf16 weights as states; the held bucket plus the largest gradient's bf16 staging buffer; while a
    # step accumulates, the fp32 partition bf16 runs accumulate in (4 n) before it is copied to the host: the
    # 4 bytes per parameter the plan left out with offload.
    assert plan.trainer_states == 2 * n
    assert plan.reduce_bucket == REDUCE_BUCKET * 4 + 2 * emb
    assert plan.zero_buffers == 4 * n == 6_174_857_216
    assert plan.training == (plan.trainer_states + plan.activations + plan.attention_mask + plan.logits
                             + plan.reduce_bucket + 4 * n + plan.overhead)  # vLLM asleep
    assert "32.0  per rank" in format_plan(plan, 24)
    # fp32 weights accumulate their gradients in their own dtype: no GPU partition, a host accumulator instead
    fp32 = memory_plan(load_config("qwen_math_1gpu", ["model.dtype=float32"]), QWEN, world=1)
    assert fp32.zero_buffers == 0
    assert offload_host_bytes(n, emb, "float32", 2, 1, pin=False) == 24 * n + 4 * emb
    # ZeRO-1 (several ranks) also keeps each parameter's fp32 gradient on the GPU until the step's boundary
    stage1 = memory_plan(load_config("qwen_math_1gpu", ["trainer.zero_stage=1"]), QWEN, world=2)
    assert stage1.zero_stage == 1 and stage1.zero_buffers == 4 * n + 4 * (n // 2)


def test_lora_plans_its_merged_weights_temporaries():
    """Every adapted layer builds base + scale * B @ A in its forward, backward and each push (issue 52 item 3): in
    bf16 12 bytes per element of the largest adapted matrix, Qwen2.5-1.5B's 1,536 x 8,960 MLP (0.17 GB), 8 in fp32;
    only the adapted names count, and a run without LoRA plans none."""
    cfg = load_config("qwen_math_1gpu", ["model.lora.rank=16"])
    plan = memory_plan(cfg, QWEN, world=1, device_gb=24)
    assert plan.lora_merge == 12 * 1_536 * 8_960 == 165_150_720
    without = memory_plan(load_config("qwen_math_1gpu"), QWEN, world=1, device_gb=24)
    assert without.lora_merge == 0 and "LoRA merged" not in format_plan(without, 24)
    assert plan.training - plan.lora_merge == (plan.vllm_total * (not plan.sleep) + plan.trainer_states
                                               + plan.activations + plan.attention_mask + plan.logits
                                               + plan.reduce_bucket + plan.zero_buffers + plan.overhead)
    assert plan.generation - plan.lora_merge == (plan.vllm_total + plan.trainer_states + plan.reduce_bucket
                                                 + plan.overhead)  # the push builds them beside the engine
    assert "LoRA merged-weight temporaries" in format_plan(plan, 24)
    attention = load_config("qwen_math_1gpu", ["model.lora.rank=16", "model.lora.target_modules=[q_proj,v_proj]",
                                                "model.dtype=float32"])
    assert memory_plan(attention, QWEN, world=1).lora_merge == 8 * 1_536 * 1_536  # q_proj: 12 heads x 128


def test_offloaded_weights_by_hand_for_qwen_math():
    """optimizer + params offloaded (ZeRO-3, one rank): stage 3 accumulates gradients on the host, so the GPU keeps
    no gradient partition; the host holds the fp32 gradient and accumulation buffers (pinned), the fp32 master
    weights (not pinned at stage 3), Adam's moments and the bf16 weights (pinned)."""
    from gapo.memory import REDUCE_BUCKET

    cfg = load_config("qwen_math_1gpu", ["trainer.offload.params=cpu"])
    plan = memory_plan(cfg, QWEN, world=1, device_gb=24)
    n = 1_543_714_304
    assert plan.zero_stage == 3
    assert plan.host_states == 12_349_714_432 + 8 * GiB + 6_174_857_216 + 8 * GiB + 4 * GiB
    assert plan.trainer_states == 0 and plan.zero_buffers == 0
    assert plan.reduce_bucket == REDUCE_BUCKET * 4
    # weights on the GPU: the blocking host-to-GPU copy of the updated weights converts on the host first (2 n)
    cfg3 = load_config("qwen_math_1gpu", ["trainer.zero_stage=3"])
    kept = memory_plan(cfg3, QWEN, world=2)
    half = n // 2
    assert kept.zero_stage == 3 and kept.trainer_states == half * 2
    assert kept.host_states == 8 * half + 4 * GiB + 4 * half + 4 * GiB + 2 * half


@pytest.mark.parametrize("placement, given, share", [
    ("colocated", None, 0.5), ("split", None, 0.9), ("split", 0.7, 0.7), ("colocated", 0.8, 0.8)])
def test_a_split_generator_takes_most_of_its_gpu_by_default(placement, given, share):
    """A generator in split placement has its GPU to itself: left unset, its vLLM share is 0.9 (vLLM's own
    default), not the colocated 0.5 that leaves half of a GPU idle; a value given is kept."""
    over = [f"rollout.placement={placement}"] + (["rollout.generator_ranks=1"] if placement == "split" else [])
    if given is not None:
        over.append(f"rollout.gpu_memory_utilization={given}")
    cfg = load_config("tiny_cpu", over)
    assert cfg.rollout.gpu_memory_utilization == share
    # the paper's config leaves it unset (null), so its split runs get the generator's share too
    paper = load_config("qwen_math", over)
    assert paper.rollout.gpu_memory_utilization == share



def test_a_split_training_rank_is_planned_without_an_engine(capsys):
    """Split placement: vLLM runs on the generator ranks, so a training rank's GPU holds no engine share. The plan
    once charged every training rank gpu_memory_utilization of its GPU for vLLM and refused on GPU the runs split
    placement is for (a helper read of the GPU path); its advice (sleep mode) is refused with split."""
    from gapo.cli import train_main

    col = memory_plan(load_config("r1_distill_math"), R1, world=4, device_gb=80)
    cfg = load_config("r1_distill_math", ["rollout.placement=split", "rollout.generator_ranks=4"])
    split = memory_plan(cfg, R1, world=4, device_gb=80)
    assert split.vllm_total == 0 and split.kv_cache_needed == 0
    assert col.total - split.total == col.vllm_total  # the same trainer, less the engine it does not run
    text = format_plan(split, 80)
    assert "vLLM runs on the generator ranks" in text and "vLLM KV cache" not in text
    # --plan plans the training ranks: 8 - 4 generator ranks
    assert train_main(["--config", "r1_distill_math", "--nproc", "8", "--plan", "80", "rollout.placement=split",
                       "rollout.generator_ranks=4"]) == 0
    assert "4 training ranks" in capsys.readouterr().out
    assert train_main(["--config", "r1_distill_math", "--nproc", "2", "--plan", "80", "rollout.placement=split",
                       "rollout.generator_ranks=2"]) == 2
    assert "leaves no training rank" in capsys.readouterr().err


def test_the_engine_reserve_comes_from_the_engine_kind():
    """memory.ENGINE_RESERVE has a row for every rollout.engine; the hf engine plans no vLLM reserve."""
    from typing import get_args

    from gapo.config import EngineKind
    from gapo.configfile import load_config
    from gapo.memory import ENGINE_RESERVE, VLLM_RESERVE, memory_plan

    assert set(ENGINE_RESERVE) == set(get_args(EngineKind))
    assert memory_plan(load_config("qwen_math"), QWEN, world=8).vllm_reserve == VLLM_RESERVE
    assert memory_plan(load_config("qwen_math", ["rollout.engine=hf"]), QWEN, world=8).vllm_reserve == 0
