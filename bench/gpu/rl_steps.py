"""Two real RL steps on one GPU at the largest Qwen2.5 shape the device holds (1.5B, else 0.5B): gapo's loop with
the DeepSpeed actor (bf16 weights, fp32 gradient accumulation, gradient checkpointing, token-budget micro-batches) and
the transformers engine generating. Reports update tokens/s, MFU, peak memory against the memory plan's trainer
share, and the first mini-batch's IS-ratio deviation (must be 0: the update recomputes exactly the old log-probs).

    PYTHONPATH=. python bench/gpu/rl_steps.py [--new-tokens 1024] [--prompts 8]   # CUDA host, ~5 min on an H200
    .venv/bin/python bench/gpu/rl_steps.py --cpu-smoke                              # same code path, toy size, CPU

Needs gapo's Python dependencies except vLLM (the engine here is `rollout.engine=hf`): deepspeed, pydantic,
pyyaml, tqdm, math-verify (the arithmetic reward) and if-verifiable (imported by gapo.reward.ifeval). Random init:
the throughput and memory of a step do not depend on the weights, and the device has no network; the tiny
built-in tokenizer is reused (its ids are a subset of the vocabulary; responses run to max length, the
worst case for memory). One rank: DeepSpeed runs stage 1 in bf16 (nothing to partition; gapo/trainer/actor.py).
The shape is picked by the memory plan (pick_shape): Qwen2.5-1.5B's step plans more than a 24 GB GPU has.

MFU = FLOPs of the training forwards and backwards (6 x params x tokens for the update epochs, 2 x params x
tokens for the old-log-prob pass) over the `time/train_s + time/old_logprob_s` the loop logged, against the
H200's dense bf16 peak of 989 TFLOP/s; attention's L^2 term is left out (small at these lengths).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

PEAK_FLOPS = 989e12
QWEN15 = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
              num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True)
QWEN05 = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
              num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True)
SHAPES = {"Qwen2.5-1.5B": QWEN15, "Qwen2.5-0.5B": QWEN05}  # largest first: pick_shape takes the first that fits
HEADROOM = 0.85  # of the device: the plan leaves out allocator fragmentation (5-15 %, gapo/memory.py)
TOY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           vocab_size=512, max_position_embeddings=2048, tie_word_embeddings=True)


def build_model(out: Path, shape: dict) -> int:
    """A random bf16 Qwen2 of `shape` with the tiny built-in tokenizer; returns its parameter count."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from gapo.models import resolve_model

    tiny = resolve_model("tiny-qwen2")
    out.mkdir(parents=True, exist_ok=True)
    for f in tiny.iterdir():
        if "token" in f.name or f.name.endswith(".jinja"):
            shutil.copy(f, out / f.name)
    eos = json.loads((tiny / "config.json").read_text())["eos_token_id"]
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**shape, eos_token_id=eos, pad_token_id=0)).to(torch.bfloat16)
    model.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def config(model: Path, run_dir: Path, prompts: int, new: int, offload: bool = False):
    """The two steps' config (the transformers engine, ZeRO-3 as configured, one rank: stage 1 in bf16; `offload`:
    the one-GPU recipe's optimizer offload, ZeRO-2 with torch's fused AdamW stepping on the host)."""
    from gapo.configfile import resolve

    rollouts = prompts * 8
    return resolve({
        "model": {"path": str(model), "dtype": "bfloat16", "gradient_checkpointing": True},
        "data": {"train": "arithmetic", "max_prompt_tokens": 128},
        "rollout": {"engine": "hf", "group_size": 8, "prompts_per_step": prompts, "max_new_tokens": new},
        "reward": {"math_last_number_fallback": True},
        "trainer": {"output_dir": str(run_dir), "total_steps": 2, "zero_stage": 3, "lr": 1e-6,
                    "ppo_mini_batch_size": rollouts // 2, "micro_batch_size": 8,
                    "max_tokens_per_micro_batch": 4 * (128 + new),
                    "offload": {"optimizer": "cpu" if offload else "none"}},
        "tracking": {"wandb": False},
    })


def planned(cfg, facts: dict, device_gib: float):
    """(what the step's tensors should peak at, the same with OVERHEAD) in bytes, from the memory plan. The
    transformers engine holds its own bf16 weights (the plan's vLLM weights) but neither vLLM's reserve nor a
    preallocated KV cache; its generation cache is transient and not in the plan. max_memory_allocated sees tensors
    only: the plan's OVERHEAD allowance (CUDA context, cuBLAS workspaces, NCCL, allocator slack) is not in it, so the
    first figure leaves it out (like with like), the second, what the device must hold, keeps it."""
    from gapo.memory import memory_plan

    plan = memory_plan(cfg, facts, world=1, device_gb=device_gib)
    tensors = plan.training - plan.vllm_reserve - plan.kv_cache_given - plan.overhead
    return tensors, tensors + plan.overhead


def pick_shape(device_gib: float, prompts: int, new_tokens: int) -> tuple[str | None, dict]:
    """(name, plan in GiB by shape name): the largest of SHAPES whose planned step fits HEADROOM of the device, or
    None when none does (a fixed 1.5B shape died at row 1 on a 24 GB GPU, with no table)."""
    cfg = config(Path("unbuilt"), Path("unused"), prompts, new_tokens)
    plans = {name: planned(cfg, {**shape, "model_type": "qwen2"}, device_gib)[1] / 2**30
             for name, shape in SHAPES.items()}
    return next((name for name, gib in plans.items() if gib <= HEADROOM * device_gib), None), plans


def host_rss(peak: bool = False) -> int:
    """This process's resident memory in bytes, or its peak since the last reset_host_peak (VmHWM)."""
    key = "VmHWM:" if peak else "VmRSS:"
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def reset_host_peak() -> None:
    """VmHWM back to the current resident size (Linux >= 4.0), so that a peak read later is this run's."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def run(cpu_smoke: bool, new_tokens: int, prompts: int, out: Path, shape: str = "Qwen2.5-1.5B",
        model: Path | None = None, offload: bool = False) -> dict:
    """The two steps at SHAPES[shape] (TOY with cpu_smoke), or with the model built already in `model` (check.py
    builds it once for its rows); returns what check.py tabulates (and main prints): per step the throughput, the
    first mini-batch's deviation, the push probe's difference; the peaks of GPU and host memory against the plan."""
    new = 16 if cpu_smoke else new_tokens
    prompts = 2 if cpu_smoke else prompts
    shutil.rmtree(out, ignore_errors=True)
    if model is None:
        model = out / "model"
        build_model(model, TOY if cpu_smoke else SHAPES[shape])

    from gapo.cli import train_main
    from gapo.configfile import dump_config
    from gapo.memory import param_count

    rollouts = prompts * 8
    out.mkdir(parents=True, exist_ok=True)
    cfg = config(model, out / "run", prompts, new, offload)
    (out / "rl_steps.yaml").write_text(dump_config(cfg))
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    host_before = host_rss()
    reset_host_peak()
    # Each optimizer step as it runs, seen from torch (a global pre-hook, whatever wraps the optimizer): what check.py
    # judges the offload by is then measured, not read back from the config: how many steps ran, on which device the
    # optimizer's tensors were, with how many threads.
    seen: list[dict] = []

    def on_step(optimizer, args, kwargs) -> None:
        first = next(p for g in optimizer.param_groups for p in g["params"])
        seen.append({"optimizer": type(optimizer).__name__, "device": first.device.type,
                     "threads": torch.get_num_threads()})

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    hook = register_optimizer_step_pre_hook(on_step)
    # In this process (its peak memory is read below), --verbose: without it gapo-train points this process's
    # stdout and stderr at the run's train.log for good, and the check's table would go there too.
    try:
        if train_main(["--config", str(out / "rl_steps.yaml"), "--verbose"]):
            raise RuntimeError("gapo-train failed")
    finally:
        hook.remove()
    rows = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [x for x in rows if "reward/mean" in x]
    facts = json.loads((model / "config.json").read_text())
    params = param_count(facts)
    predicted, _ = planned(cfg, facts, device_gib())
    steps = []
    for x in rows:
        tokens = x["response/len_mean"] * rollouts  # response tokens only (the ~40-token prompts are left out)
        seconds = x["time/train_s"] + x["time/old_logprob_s"]
        steps.append({"step": x["step"], "tokens_per_s": tokens / x["time/train_s"],
                      "mfu": (6 * cfg.trainer.ppo_epochs + 2) * params * tokens / seconds / PEAK_FLOPS,
                      "first_dev": x["first_minibatch/max_abs_log_ratio"], "generate_s": x["time/generate_s"],
                      "skipped": x["skipped_steps"], "scoring_errors": x["reward/error_frac"],
                      "train_s": x["time/train_s"], "probe_diff": x.get("sync/probe_logprob_diff")})
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    from gapo.memory import memory_plan

    return {"params": params, "rollouts": rollouts, "new": new, "steps": steps, "peak_gib": peak,
            "plan_gib": predicted / 2**30, "model_dir": str(model), "optimizer_steps": seen,
            "updates_per_step": rollouts // cfg.trainer.ppo_mini_batch_size * cfg.trainer.ppo_epochs,
            "host_gib": (host_rss(peak=True) - host_before) / 2**30, "zero_stage": cfg.zero_stage(1),
            "plan_host_gib": memory_plan(cfg, facts, world=1, device_gb=device_gib()).host_states / 2**30}


def device_gib() -> float:
    """The first CUDA device's memory in GiB (the unit of the plan); 80 without one (the plan's default device)."""
    return torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 80.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path("/tmp/gapo_rl_steps"))
    args = ap.parse_args()
    if not args.cpu_smoke and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --cpu-smoke for the CPU check of this code path")
    shape, plans = pick_shape(device_gib(), args.prompts, args.new_tokens)
    if shape is None and not args.cpu_smoke:
        sys.exit(f"no model shape fits {device_gib():.1f} GiB: plans {plans}")
    res = run(args.cpu_smoke, args.new_tokens, args.prompts, args.out, shape or "Qwen2.5-0.5B")
    print(f"model: {res['params'] / 1e9:.2f} B params, {res['rollouts']} rollouts x <= {res['new']} new tokens per "
          "step, 2 steps")
    for x in res["steps"]:
        print(f"step {x['step']}: update {x['tokens_per_s']:,.0f} tokens/s, MFU {x['mfu']:.1%}, first mini-batch max "
              f"|log ratio| {x['first_dev']:g}, generate {x['generate_s']:.1f} s")
    if res["peak_gib"] is not None:
        print(f"peak allocated {res['peak_gib']:.1f} GiB; memory plan (actor + engine weights) "
              f"{res['plan_gib']:.1f} GiB")


if __name__ == "__main__":
    main()
