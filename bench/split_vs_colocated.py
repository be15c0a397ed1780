"""Colocated against split placement (rollout.placement) at staleness 0 and 1 on the CPU demo, side by side in
one run, and a timing model that turns phase times into a predicted GPU speed-up for each paper config.

    .venv/bin/python bench/split_vs_colocated.py [--steps 8] [--work DIR]      # 33 min on a 2-core Zen 4
    .venv/bin/python bench/split_vs_colocated.py --model-only [--mean-frac 0.5]  # the GPU prediction alone, instant

The three arms are `gapo-train --config configs/demo_cpu.yaml` with the same seed, prompts and batch (8 prompts x 8),
no validation, and the old-log-prob pass in all of them (`rollout.use_engine_logprobs=false`, which staleness needs):
colocated on 1 rank; split with 1 generator + 1 trainer at max_staleness 0; the same at max_staleness 1. Printed:
step time and reward per step, side by side; each arm's median phase times over steps 2..N (step 1 carries the
engine's warm-up); and the model below checked against the measured split steps.

On a CPU both sides share the same cores, so split cannot be faster there: the CPU figures show the protocol's own
cost and what the phases weigh, not a speed-up. The GPU figures are a PREDICTION from a roofline model (no GPU has run
split placement; docs/split.md):

- training (old log-probs + updates) on n GPUs: (2 + 6 x epochs) x params x tokens / (n x peak x MFU_TRAIN);
- generation on g GPUs, each engine holding rollouts/g sequences: every decode step reads the weights once, every
  token the KV cache of its sequence so far; decode is bandwidth-bound (HBM x DECODE_BW_EFF) unless the batch's
  FLOPs say otherwise. The engine runs as many sequences at once as its KV cache holds (vLLM's share of the GPU,
  `rollout.gpu_memory_utilization` colocated, SPLIT_UTIL on a generator that has the GPU to itself, less its
  weights and reserve); the decode steps are the longest response's plus a mean response's per further wave;
- colocated: gen(N) + train(N) + push; split at staleness 0: gen(g) + train(N - g) + push; at staleness 1:
  max(gen(g), train(N - g) + push), with g chosen to minimise it. The responses' mean length is MEAN_FRAC of
  max_new_tokens and the longest reaches it; prompts are PROMPT_TOKENS long. Every constant is an assumption,
  printed with the result.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

from _util import cached_arm, cpu_line, median, run_sampled, save_arm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PHASES = ["generate", "generator", "generator_idle", "reward", "old_logprob", "train", "weight_push"]
COMMON = ["eval.benchmarks=[]", "rollout.use_engine_logprobs=false"]
SPLIT = ["rollout.placement=split", "rollout.generator_ranks=1"]
ARMS = {"colocated": (1, []),
        "split k=0": (2, SPLIT + ["rollout.max_staleness=0"]),
        "split k=1": (2, SPLIT + ["rollout.max_staleness=1"])}

# The model's assumptions (GPU figures are predictions from these, not measurements).
# dense bf16 FLOP/s, HBM bytes/s, memory bytes (NVIDIA spec sheets)
GPUS = {"H100": (989e12, 3.35e12, 80e9), "H200": (989e12, 4.8e12, 141e9)}
MFU_TRAIN = 0.35        # ZeRO-3 actor with gradient checkpointing at 1.5-3B: 0.3-0.4 is what frameworks report
DECODE_BW_EFF = 0.6     # fraction of HBM bandwidth vLLM's decode reaches
DECODE_MFU = 0.5        # when a decode batch is compute-bound instead
MEAN_FRAC = 0.5         # mean response length / max_new_tokens (long-CoT runs truncate a tail, mean well below max)
PROMPT_TOKENS = 256     # math and code prompts are far shorter than max_prompt_tokens
SPLIT_UTIL = 0.9        # a generator's vLLM share when no actor shares its GPU
PUSH_S = 2.0            # gather + reload of the weights into vLLM per step (same in both placements)
NODE_GPUS = 8           # every paper config runs on 1 node x 8 GPUs (their first lines)


def run_arm(work: Path, name: str, nproc: int, overrides: list[str], steps: int) -> dict:
    out = work / name.replace(" ", "_").replace("=", "")
    done = out / "bench_result.json"  # a rerun with the same --work and command reports the arm without running it
    cmd = [str(ROOT / ".venv" / "bin" / "gapo-train"), "--config", str(ROOT / "configs" / "demo_cpu.yaml"),
           "--nproc", str(nproc), f"trainer.output_dir={out}", f"trainer.total_steps={steps}", *COMMON, *overrides]
    cached = cached_arm(done, cmd)
    if cached is not None:
        return cached
    shutil.rmtree(out, ignore_errors=True)  # another command's or an interrupted run's directory: start clean
    print("$", " ".join(cmd[1:]), flush=True)
    _, peak = run_sampled(cmd, cwd=str(ROOT))
    rows = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "reward/mean" in r}
    if sorted(rows) != list(range(1, steps + 1)):
        raise RuntimeError(f"{out}/metrics.jsonl: expected steps 1..{steps}, found {sorted(rows)}")
    later = range(2, steps + 1)
    result = {"step_s": [rows[s]["time/step_wall_s"] for s in range(1, steps + 1)],
              "reward": [rows[s]["reward/mean"] for s in range(1, steps + 1)],
              "staleness": [rows[s]["rollout/staleness"] for s in range(1, steps + 1)],
              "phases": {p: median([rows[s][f"time/{p}_s"] for s in later])
                         for p in PHASES if f"time/{p}_s" in rows[steps]},
              "peak_gb": peak}
    save_arm(done, cmd, result)
    return result


def gen_seconds(facts: dict, gpu: str, g: int, rollouts: int, max_new: int, util: float,
                mean_frac: float) -> float:
    """Generation time of one step on g data-parallel engines (bf16 weights and KV cache), each with `util` of its
    GPU's memory."""
    from gapo.memory import VLLM_RESERVE, kv_bytes_per_token, param_count

    flops, bw, mem = GPUS[gpu]
    params, kvb = param_count(facts), kv_bytes_per_token(facts, 2)
    per_engine, mean = rollouts / g, mean_frac * max_new
    at_once = max((util * mem - 2 * params - VLLM_RESERVE) / (kvb * (PROMPT_TOKENS + mean)), 1.0)
    waves = math.ceil(per_engine / at_once)
    weights = 2 * params * (max_new + (waves - 1) * mean)                # one read per decode step
    kv = per_engine * mean * (PROMPT_TOKENS + mean / 2) * kvb             # each token reads its context
    compute = 2 * params * per_engine * (PROMPT_TOKENS + mean)
    return max((weights + kv) / (bw * DECODE_BW_EFF), compute / (flops * DECODE_MFU))


def train_seconds(facts: dict, gpu: str, n: int, rollouts: int, max_new: int, epochs: int, old_pass: bool,
                  mean_frac: float) -> float:
    from gapo.memory import param_count

    tokens = rollouts * (PROMPT_TOKENS + mean_frac * max_new)
    return (2 * old_pass + 6 * epochs) * param_count(facts) * tokens / (n * GPUS[gpu][0] * MFU_TRAIN)


def divides(cfg, trainers: int) -> bool:
    from gapo.errors import ConfigError

    try:
        cfg.shape(trainers)
    except ConfigError:
        return False
    return True


def predict(mean_frac: float = MEAN_FRAC) -> None:
    from gapo.configfile import load_config
    from gapo.models import model_facts

    print(f"\nPREDICTED GPU step times (a roofline model, not a measurement; 1 node x {NODE_GPUS} GPUs): "
          f"MFU_TRAIN {MFU_TRAIN}, decode at {DECODE_BW_EFF:.0%} of HBM bandwidth, mean response {mean_frac:.0%} of "
          f"max_new_tokens, prompts {PROMPT_TOKENS} tokens, push {PUSH_S:g} s, a generator's vLLM share {SPLIT_UTIL}")
    print(f"{'config':<17}{'GPU':<6}{'gen s':>7}{'train s':>9}{'colocated':>11}{'g':>3}{'split k=0':>11}"
          f"{'split k=1':>11}{'speed-up k=1':>14}")
    for name in ["qwen_math", "llama_math", "r1_distill_math", "deepcoder"]:
        cfg = load_config(ROOT / "configs" / f"{name}.yaml")
        facts = model_facts(cfg.model.path)
        r, t = cfg.rollout, cfg.trainer
        rollouts = r.prompts_per_step * r.group_size
        # the generator counts whose training ranks divide the batch (cfg.shape refuses the others)
        splits = [g for g in range(1, NODE_GPUS) if divides(cfg, NODE_GPUS - g)]
        for gpu in GPUS:
            # seconds per step with n GPUs: generating (split: a whole GPU's memory each), training
            gen = {n: gen_seconds(facts, gpu, n, rollouts, r.max_new_tokens, SPLIT_UTIL, mean_frac) for n in splits}
            train = {n: train_seconds(facts, gpu, n, rollouts, r.max_new_tokens, t.ppo_epochs,
                                      not r.use_engine_logprobs, mean_frac) for n in range(1, NODE_GPUS + 1)}
            gen_col = gen_seconds(facts, gpu, NODE_GPUS, rollouts, r.max_new_tokens, r.gpu_memory_utilization,
                                  mean_frac)
            colocated = gen_col + train[NODE_GPUS] + PUSH_S
            g = min(gen, key=lambda g: max(gen[g], train[NODE_GPUS - g] + PUSH_S))
            k0 = gen[g] + train[NODE_GPUS - g] + PUSH_S
            k1 = max(gen[g], train[NODE_GPUS - g] + PUSH_S)
            print(f"{name:<17}{gpu:<6}{gen_col:>7.0f}{train[NODE_GPUS]:>9.0f}{colocated:>11.0f}{g:>3}"
                  f"{k0:>11.0f}{k1:>11.0f}{colocated / k1:>13.2f}x")
    print("gen s / train s: colocated phases on all 8 GPUs; g: generator GPUs of the split (the rest train; only "
          "counts whose training ranks divide the batch). Split at k=0 is slower than colocated (each side has fewer "
          "GPUs and they take turns); k=1 overlaps them.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--work", type=Path, help="keep the runs here (default: a temporary folder)")
    ap.add_argument("--model-only", action="store_true", help="print the GPU prediction only (no runs)")
    ap.add_argument("--mean-frac", type=float, default=MEAN_FRAC,
                    help="the model's mean response length as a fraction of max_new_tokens")
    args = ap.parse_args()
    if args.model_only:
        predict(args.mean_frac)
        return
    print(cpu_line(), flush=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="gapo-split-bench-"))
    res = {name: run_arm(work, name, nproc, overrides, args.steps) for name, (nproc, overrides) in ARMS.items()}

    print("\nPer step (step 1 includes the engine's warm-up): wall seconds | mean reward | staleness")
    print(f"{'step':>4}" + "".join(f"{name:>26}" for name in res))
    for i in range(args.steps):
        print(f"{i + 1:>4}" + "".join(f"{r['step_s'][i]:>12.1f} s{r['reward'][i]:>7.3f}{r['staleness'][i]:>5.0f}"
                                      for r in res.values()))
    print(f"\nMedian phase seconds over steps 2..{args.steps} (generate = the trainer's wait for its rollouts; "
          "generator = the generator sampling them)")
    print(f"{'phase':<16}" + "".join(f"{name:>12}" for name in res))
    for p in PHASES + ["step wall"]:
        cells = [median(r["step_s"][1:]) if p == "step wall" else r["phases"].get(p) for r in res.values()]
        print(f"{p:<16}" + "".join(f"{c:>12.2f}" if c is not None else f"{'-':>12}" for c in cells))
    print(f"{'peak GB (PSS)':<16}" + "".join(f"{r['peak_gb']:>12.2f}" for r in res.values()))
    wall = {name: median(r["step_s"][1:]) for name, r in res.items()}
    print(f"split / colocated step time: k=0 {wall['split k=0'] / wall['colocated']:.2f}, "
          f"k=1 {wall['split k=1'] / wall['colocated']:.2f}")
    k1 = res["split k=1"]["phases"]
    overlap = max(k1["generator"], k1["train"] + k1["old_logprob"] + k1["weight_push"])
    print(f"the model's overlap on this CPU's split k=1 phases: max(generator, old_logprob + train + push) = "
          f"{overlap:.1f} s against {wall['split k=1']:.1f} s measured (the phases as measured while overlapped: on "
          "shared cores each side slows the other, which is why split is slower here than colocated)")
    predict(args.mean_frac)
    print(f"runs: {work}")


if __name__ == "__main__":
    main()
