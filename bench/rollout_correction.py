"""The sampler-trainer mismatch in bf16 on the CPU demo, and what each rollout correction does with it.

    .venv/bin/python bench/rollout_correction.py [--steps 3] [--dtype bfloat16] [--modes off,truncate/token,...]

One gapo-train run per correction (configs/demo_cpu.yaml, model.dtype bf16: vLLM-CPU samples in bf16, the
trainer recomputes the old log-probs in bf16; rollout.use_engine_logprobs off, since the correction needs the
trainer's pass), each for --steps steps from the same seed, one after the other in this process's session.
Step 1 samples the same rollouts in every run (same weights, same seeds), so its logprob_mismatch/* figures
must agree across runs and the rollout_is/* columns compare the corrections on identical data; later steps
drift apart as the corrections change the updates. Prints the CPU, then one table per step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _util import cpu_line

ROOT = Path(__file__).resolve().parents[1]
MODES = ["off", "truncate/token", "truncate/sequence", "mask/token", "mask/sequence", "reject/token",
         "reject/sequence"]
COLUMNS = [("kl_k3", "logprob_mismatch/kl_k3"), ("kl_k1", "logprob_mismatch/kl_k1"),
           ("|d| mean", "logprob_mismatch/mean_abs"), ("|d| max", "logprob_mismatch/max_abs"),
           ("first", "logprob_mismatch/first_token_abs"), ("last", "logprob_mismatch/last_token_abs"),
           ("pos1", "logprob_mismatch/pos1"), ("pos5", "logprob_mismatch/pos5"),
           ("masked tok", "rollout_is/masked_token_frac"), ("masked seq", "rollout_is/masked_seq_frac"),
           ("capped tok", "rollout_is/truncated_token_frac"), ("w mean", "rollout_is/weight_mean"),
           ("w max", "rollout_is/weight_max"), ("reward", "reward/mean"), ("clip", "clip_frac")]


def run(mode: str, steps: int, dtype: str, out: Path) -> dict[int, dict]:
    name, _, level = mode.partition("/")
    args = [f"algorithm.rollout_correction.mode={name}"] + ([f"algorithm.rollout_correction.level={level}"]
                                                           if level else [])
    cmd = [str(Path(sys.executable).parent / "gapo-train"), "--config", "configs/demo_cpu.yaml",
           f"trainer.output_dir={out}", f"trainer.total_steps={steps}", f"model.dtype={dtype}",
           "rollout.use_engine_logprobs=false", "eval.limit=8", "tracking.mode=disabled", *args]
    r = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "WANDB_SILENT": "true"}, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {r.returncode}:\n{r.stderr[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows if "logprob_mismatch/kl_k3" in row}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--modes", default=",".join(MODES))
    a = p.parse_args()
    print(cpu_line())
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in a.modes.split(","):
            results[mode] = run(mode, a.steps, a.dtype, Path(tmp) / mode.replace("/", "-"))
            print(f"ran {mode}", flush=True)
    for step in range(1, a.steps + 1):
        print(f"\nstep {step} ({a.dtype}, demo model, {len(results)} runs)")
        print(f"{'correction':<18}" + "".join(f"{c:>11}" for c, _ in COLUMNS))
        for mode, rows in results.items():
            row = rows.get(step, {})
            cells = "".join(f"{row[k]:>11.4g}" if k in row else f"{'-':>11}" for _, k in COLUMNS)
            print(f"{mode:<18}" + cells)


if __name__ == "__main__":
    main()
