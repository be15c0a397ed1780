"""LoRA against full fine-tuning on the CPU demo, side by side in one run: step time, peak memory, checkpoint size,
and held-out accuracy after 12 steps.

    .venv/bin/python bench/lora_vs_full.py [--steps 12] [--rank 16] [--lora-lr 2e-4] [--reps 1] [--plot FILE]

Both arms are `gapo-train --config configs/demo_cpu.yaml` (SmolLM2-135M, fp32, 1 rank, the same seed, prompts and
sampling seeds), validated on the demo's 200 held-out problems at steps 0, N/2 and N. LoRA: rank 16, alpha 32, all seven
linear layers, at 10x full fine-tuning's learning rate ("LoRA Without Regret", Thinking Machines 2025: LoRA's best
RL learning rate sits about 10x above full fine-tuning's; `--lora-lr` to change it). The arms alternate, `--reps`
times each. Step time is the median of steps 2..N (step 1 carries warm-up); peak memory is the sampled PSS of the
run's whole process tree (vLLM's preallocated KV cache included, the same in both arms); the checkpoint is the
final one on disk. The CPU is printed first, the figures last; `--plot` draws held-out pass@1 and training reward
per step (docs/one-gpu.md's figure). 36 min on a 2-core AMD Zen 4 (cpu family 25, model 17) at the defaults.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from _util import cached_arm, cpu_line, median, run_sampled, save_arm

ROOT = Path(__file__).resolve().parents[1]


def arms(rank: int, lora_lr: float) -> dict[str, list[str]]:
    return {"full": [],
            f"LoRA r{rank}": [f"model.lora.rank={rank}", f"model.lora.alpha={2 * rank}", f"trainer.lr={lora_lr:g}"]}


def dir_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6


def run_arm(work: Path, name: str, overrides: list[str], steps: int) -> dict:
    out = work / name.replace(" ", "_")
    done = out / "bench_result.json"  # a rerun with the same --work and command reports the arm without running it
    cmd = [str(ROOT / ".venv" / "bin" / "gapo-train"), "--config", str(ROOT / "configs" / "demo_cpu.yaml"),
           f"trainer.output_dir={out}", f"trainer.total_steps={steps}", f"trainer.eval_every={steps // 2}", *overrides]
    cached = cached_arm(done, cmd)
    if cached is not None:
        return {**cached, "val": {int(k): v for k, v in cached["val"].items()}}  # (JSON keys are strings)
    shutil.rmtree(out, ignore_errors=True)  # another command's or an interrupted run's directory: start clean
    print("$", " ".join(cmd[1:]), flush=True)
    _, peak = run_sampled(cmd, cwd=str(ROOT))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r["val/mean/pass@1"] for r in rows if "val/mean/pass@1" in r}
    train = {r["step"]: r for r in rows if "reward/mean" in r}
    if sorted(train) != list(range(1, steps + 1)) or 0 not in val or steps not in val:
        raise RuntimeError(f"{out}/metrics.jsonl: expected steps 1..{steps} and validation at 0 and {steps}, "
                           f"found steps {sorted(train)} and validation at {sorted(val)}")
    result = {"step_s": median([train[s]["time/step_wall_s"] for s in range(2, steps + 1)]),
              "train_s": median([train[s]["time/train_s"] for s in range(2, steps + 1)]),
              "push_s": median([train[s]["time/weight_push_s"] for s in range(2, steps + 1)]),
              "peak_gb": peak, "ckpt_mb": dir_mb(out / "checkpoints"), "val": val,
              "reward": [train[s]["reward/mean"] for s in range(1, steps + 1)]}
    save_arm(done, cmd, result)
    return result


def plot(results: dict[str, dict], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.4))
    ax1, ax2 = fig.subplots(1, 2)
    for name, r in results.items():
        steps = sorted(r["val"])
        ax1.plot(steps, [r["val"][s] for s in steps], marker="o", label=name)
        ax2.plot(range(1, len(r["reward"]) + 1), r["reward"], marker=".", label=name)
    ax1.set(xlabel="step", ylabel="held-out pass@1 (200 problems, n=4)", title="held-out accuracy")
    ax2.set(xlabel="step", ylabel="mean reward of the step's rollouts", title="training reward")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("SmolLM2-135M on the CPU demo: LoRA against full fine-tuning (one seed)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lora-lr", type=float, default=2e-4)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--plot", type=Path, help="write the figure here (docs/one-gpu.md's: docs/img/lora_vs_full.png)")
    ap.add_argument("--work", type=Path, help="keep the runs here (default: a temporary folder)")
    args = ap.parse_args()
    print(cpu_line(), flush=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="gapo-lora-bench-"))
    per_arm: dict[str, list[dict]] = {name: [] for name in arms(args.rank, args.lora_lr)}
    for rep in range(args.reps):
        for name, overrides in arms(args.rank, args.lora_lr).items():
            per_arm[name].append(run_arm(work / f"rep{rep}", name, overrides, args.steps))
    last = {name: runs[-1] for name, runs in per_arm.items()}
    if args.plot:
        plot(last, args.plot)
    full, lora = per_arm["full"], per_arm[f"LoRA r{args.rank}"]
    print(f"\n{args.reps} repetition(s), {args.steps} steps each; medians over repetitions")
    print(f"{'':<14}{'step s':>8}{'train s':>9}{'push s':>8}{'peak GB':>9}{'ckpt MB':>9}"
          f"{'pass@1 @0':>11}{f'@{args.steps}':>7}")
    for name, runs in per_arm.items():
        print(f"{name:<14}{median([r['step_s'] for r in runs]):>8.1f}{median([r['train_s'] for r in runs]):>9.1f}"
              f"{median([r['push_s'] for r in runs]):>8.2f}{median([r['peak_gb'] for r in runs]):>9.2f}"
              f"{median([r['ckpt_mb'] for r in runs]):>9.1f}{median([r['val'][0] for r in runs]):>11.3f}"
              f"{median([r['val'][args.steps] for r in runs]):>7.3f}")
    ratio = median([lo["step_s"] / fu["step_s"] for lo, fu in zip(lora, full, strict=True)])
    mem = median([lo["peak_gb"] / fu["peak_gb"] for lo, fu in zip(lora, full, strict=True)])
    print(f"LoRA / full: step time {ratio:.2f}, peak memory {mem:.2f}, checkpoint "
          f"{median([lo['ckpt_mb'] / fu['ckpt_mb'] for lo, fu in zip(lora, full, strict=True)]):.3f}")
    rose = all(r["val"][args.steps] > r["val"][0] for r in lora)
    print(f"LoRA held-out pass@1 rose from step 0 to {args.steps} in every repetition: {'yes' if rose else 'NO'}")
    print(f"runs: {work}")
    sys.exit(0 if rose else 1)


if __name__ == "__main__":
    main()
