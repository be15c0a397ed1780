"""End to end against TRL's GRPOTrainer: the same RL work, step time and peak memory, side by side.

    make bench-env && .venv/bin/python bench/e2e_vs_trl.py [--reps 2] [--steps 4] [--gapo KEY=VALUE ...]

Identical work on both sides: SmolLM2-135M-Instruct in fp32 on the CPU, the same 8 arithmetic prompts
every step (so both sides see exactly the same prompts), k = 8 rollouts each, at most 64 new tokens,
temperature 1, GSPO loss (sequence IS, eps 3e-3, token mean), no KL, the same learning rate, two optimizer
steps (32 rollouts, micro-batches of 8) per generation batch. gapo runs as `gapo-train` (vLLM + DeepSpeed
ZeRO-3, one rank) in .venv; TRL (bench/trl_side.py) in .bench-venv, which `make bench-env` builds with the
same torch and transformers. The two alternate, `--reps` times each; a step is one generation batch
(gapo: one step; TRL: two optimizer steps), the first step of every run is warm-up and left out, and the
median over the rest is reported. Peak memory is the sampled PSS of each run's whole process tree.
The CPU it runs on is printed first, the figures last. About 29 min at --reps 1 --steps 3 on a 2-core AMD Zen 3
(cpu family 25, model 1, no AVX-512), `make bench-env` included; 14.5 min on a 2-core AMD Zen 5 with AVX-512
(cpu family 26, model 2), which printed step / TRL 0.408 and memory / TRL 1.476 (a user's report).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import yaml
from _util import cpu_line, median, run_sampled

from gapo.data import arithmetic_problems, build_prompt_ids
from gapo.models import resolve_model

ROOT = Path(__file__).resolve().parents[1]

INSTRUCTION = "Put the final answer in \\boxed{}."
PHASES = ("generate", "reward", "old_logprob", "train", "weight_push")
# gapo configurations to compare (overrides on top of the shared setup). The KV cache is preallocated in
# vLLM; 0.5 GiB holds this batch's ~7k tokens several times over (SmolLM2: 46 KiB per token in fp32).
VARIANTS = {
    "default": ["rollout.kv_cache_gb=0.5"],
    "engine_logprobs": ["rollout.kv_cache_gb=0.5", "rollout.use_engine_logprobs=true"],
}


def setup_work(work: Path, steps: int, seed: int) -> dict:
    from transformers import AutoTokenizer

    model_dir = str(resolve_model("smollm2-135m"))
    tok = AutoTokenizer.from_pretrained(model_dir)
    problems = arithmetic_problems(8, seed=7, levels=["add_small", "add_2digit", "sub_2digit", "mul_small"])
    rows = [{"problem": p.question, "answer": p.gold,
             "prompt_text": tok.decode(build_prompt_ids(tok, p, INSTRUCTION))} for p in problems]
    (work / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    setup = {"model_dir": model_dir, "problems": rows, "prompts": 8, "group_size": 8, "max_new_tokens": 64,
             "lr": 2e-5, "eps": 3e-3, "optimizer_steps_per_batch": 2, "micro_batch_size": 8, "steps": steps,
             "seed": seed}
    (work / "setup.json").write_text(json.dumps(setup, indent=1))
    return setup


def gapo_config(work: Path, setup: dict, run: str) -> Path:
    cfg = {
        "model": {"path": setup["model_dir"], "dtype": "float32"},
        "data": {"train": str(work / "prompts.jsonl"), "instruction": INSTRUCTION, "max_prompt_tokens": 128},
        "rollout": {"engine": "vllm", "group_size": setup["group_size"], "prompts_per_step": setup["prompts"],
                    "temperature": 1.0, "max_new_tokens": setup["max_new_tokens"]},
        "reward": {"math_last_number_fallback": True},
        "algorithm": {"name": "gspo", "eps_lo": setup["eps"], "eps_hi": setup["eps"]},
        "trainer": {"output_dir": str(work / run), "total_steps": setup["steps"], "lr": setup["lr"],
                    "grad_clip": 1.0, "micro_batch_size": setup["micro_batch_size"], "zero_stage": 3,
                    "ppo_mini_batch_size": setup["prompts"] * setup["group_size"] // setup["optimizer_steps_per_batch"],
                    "seed": setup["seed"]},
        "tracking": {"wandb": False},
    }
    path = work / f"{run}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=2, help="runs of each side, alternating")
    ap.add_argument("--steps", type=int, default=3, help="generation batches per run (the first is warm-up)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--gapo", nargs="*", default=[], metavar="KEY=VALUE", help="extra gapo config overrides")
    ap.add_argument("--bench-python", default=str(ROOT / ".bench-venv" / "bin" / "python"))
    args = ap.parse_args()
    if not Path(args.bench_python).exists():
        sys.exit(f"{args.bench_python} not found: build the TRL environment with `make bench-env`")
    if args.steps < 2:
        sys.exit("--steps must be >= 2 (the first step of every run is warm-up)")
    print(cpu_line(), flush=True)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled"}
    steps: dict[str, list[float]] = {v: [] for v in [*args.variants, "TRL"]}
    mem: dict[str, list[float]] = {v: [] for v in steps}
    phases: dict[str, dict[str, list[float]]] = {v: {p: [] for p in PHASES} for v in args.variants}
    with tempfile.TemporaryDirectory(prefix="gapo-e2e-") as tmp:
        work = Path(tmp)
        setup = setup_work(work, args.steps, args.seed)
        for rep in range(args.reps):
            for v in args.variants:
                run = f"{v}_{rep}"
                cfg = gapo_config(work, setup, run)  # the variant's dotted overrides go on gapo-train's command line
                _, peak = run_sampled([str(ROOT / ".venv" / "bin" / "gapo-train"), "--config", str(cfg),
                                       *VARIANTS[v], *args.gapo], env=env)
                rows = [json.loads(x) for x in (work / run / "metrics.jsonl").read_text().splitlines()]
                rows = [r for r in rows if "time/step_wall_s" in r][1:]
                steps[v] += [r["time/step_wall_s"] for r in rows]
                for p in PHASES:
                    phases[v][p] += [r[f"time/{p}_s"] for r in rows]
                mem[v].append(peak)
                print(f"gapo {v} run {rep}: steps {[round(r['time/step_wall_s'], 1) for r in rows]} s, "
                      f"peak {peak:.2f} GiB, reward {[round(r['reward/mean'], 2) for r in rows]}", flush=True)
            out, peak = run_sampled([args.bench_python, str(ROOT / "bench" / "trl_side.py"), "--work", str(work)],
                                    env=env)
            batches = json.loads(out.strip().splitlines()[-1])["batch_s"][1:]
            steps["TRL"] += batches
            mem["TRL"].append(peak)
            print(f"TRL run {rep}: steps {[round(b, 1) for b in batches]} s, peak {peak:.2f} GiB", flush=True)
    print("\n== end to end vs TRL GRPOTrainer (SmolLM2-135M fp32 CPU, 8 prompts x 8, 64 new tokens, "
          "2 optimizer steps per batch) ==")
    t, t_mem = median(steps["TRL"]), max(mem["TRL"])
    print(f"TRL: median step {t:.2f} s over {len(steps['TRL'])} steps, peak memory (PSS) {t_mem:.2f} GiB")
    for v in args.variants:
        g, g_mem = median(steps[v]), max(mem[v])
        print(f"gapo {v}: median step {g:.2f} s over {len(steps[v])} steps, peak memory (PSS) {g_mem:.2f} GiB; "
              + ", ".join(f"{p} {median(x):.2f}" for p, x in phases[v].items()))
        print(f"  step time gapo/TRL {g / t:.3f} (goal <= 0.5), memory gapo/TRL {g_mem / t_mem:.3f} (goal <= 1)")

if __name__ == "__main__":
    main()
