"""An offloaded optimizer step's time with a vLLM engine built in the same process: torchrun's one thread per rank
against the rank's share of the cores (gapo.distributed.share_cores; issue 52 item 2).

    .venv/bin/python bench/offload_threads.py [--params-m 200] [--reps 2]

vLLM keeps torch at OMP_NUM_THREADS when it is built in-process (1 when unset), and torchrun sets OMP_NUM_THREADS=1
for every rank, so before gapo.launch shared the cores out, a rank's host-side optimizer step (trainer.offload.
optimizer=cpu: torch's fused CPU AdamW over the fp32 master weights) ran on one core. Each variant runs in a fresh
process (torch's thread count cannot be raised after vLLM froze it): init_distributed, a vLLM engine on tiny-qwen2,
then AdamW(fused=True) over --params-m million fp32 parameters with random gradients: one warm-up step, then the
median of 3. Variants alternate, --reps times each:
- before: OMP_NUM_THREADS=1, what torchrun handed every rank;
- after: share_cores for the one local rank this bench starts, i.e. every core of this machine, which is a rank's
  share on a node with as many cores per GPU (16 cores, 8 GPUs: 2 per rank).
Prints the CPU first and the ratio last; the step time scales with the parameter count (1.5B: 7.5x the 200M figure).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _util import cpu_line, median


def child(params_m: int, share: bool) -> None:
    from gapo.distributed import init_distributed, share_cores

    if share:
        share_cores(1)
    import torch

    from gapo.models import resolve_model
    from gapo.rollout.engine import build_engine

    init_distributed()
    engine = build_engine("vllm", str(resolve_model("tiny-qwen2")), dtype="float32", seed=0, max_model_len=128,
                          compile="eager")
    threads = torch.get_num_threads()  # after the build: what the trainer's host work gets
    g = torch.Generator().manual_seed(0)
    chunks = [torch.nn.Parameter(torch.randn(10_000_000, generator=g)) for _ in range(max(1, params_m // 10))]
    for p in chunks:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    opt = torch.optim.AdamW(chunks, lr=1e-6, fused=True)
    times = []
    for _ in range(4):  # the first is warm-up (state allocation)
        tic = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - tic)
    engine.close()
    print(json.dumps({"threads": threads, "step_s": median(times[1:]), "omp": os.environ.get("OMP_NUM_THREADS")}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params-m", type=int, default=200, help="million parameters stepped (in 10 M tensors)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--child", choices=["before", "after"])
    args = ap.parse_args()
    if args.child:
        child(args.params_m, share=args.child == "after")
        return
    print(cpu_line(), flush=True)
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "GAPO_THREADS_WHY")}
    env = {"before": {**base, "OMP_NUM_THREADS": "1"}, "after": base}
    results: dict[str, list[dict]] = {"before": [], "after": []}
    for _ in range(args.reps):
        for variant in ("before", "after"):
            r = subprocess.run([sys.executable, __file__, "--child", variant, "--params-m", str(args.params_m)],
                               env={**env[variant], "OMP_WAIT_POLICY": "PASSIVE"}, capture_output=True, text=True,
                               cwd=Path(__file__).resolve().parents[1], timeout=900)
            if r.returncode != 0:
                raise SystemExit(f"{variant} failed:\n{r.stderr[-3000:]}")
            results[variant].append(json.loads(r.stdout.strip().splitlines()[-1]))
    print(f"\nfused CPU AdamW step over {args.params_m} M fp32 parameters, a vLLM engine built in the same process "
          f"(median of 3 steps; {args.reps} processes each, alternating):")
    for variant, rows in results.items():
        print(f"  {variant:<6} {rows[0]['threads']} thread(s): "
              + ", ".join(f"{r['step_s']:.3f} s" for r in rows))
    b, a = median([r["step_s"] for r in results["before"]]), median([r["step_s"] for r in results["after"]])
    print(f"after / before: {a / b:.2f} (step {b:.3f} -> {a:.3f} s)")


if __name__ == "__main__":
    main()
