"""The per-GPU memory plan: the issue's anchors for the paper's configs, and the arithmetic by hand."""

import math
from dataclasses import replace

import pytest

from gapo.config import load_config, resolve
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
    # one rank: nothing reduced, nothing partitioned
    assert zero_buffer_bytes(p, zero_stage=0, world=1) == {"reduce_bucket": 0, "zero_buffers": 0}
    assert memory_plan(cfg, QWEN, world=1).reduce_bucket == memory_plan(cfg, QWEN, world=1).zero_buffers == 0



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
