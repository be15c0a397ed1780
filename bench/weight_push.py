"""Weight push: time to load new weights into the running vLLM engine vs a memcpy of the same bytes, and the
ZeRO-3 gather that produces them on 2 ranks.

    .venv/bin/python bench/weight_push.py [--reps 5]

Push (one process): SmolLM2-135M-Instruct fp32 on the CPU; the tensors are an HF model's
`named_parameters(remove_duplicate=False)`, tied lm_head.weight included, as gapo pushes them.
`VLLMEngine.push_weights` (reload + prefix-cache reset) alternates with the floor: one `dst.copy_(src)` of
every pushed tensor into preallocated tensors of the same sizes, in the same process; `--reps` rounds after
a warm-up round, medians reported.

Gather: 2 ranks (torchrun, gloo) each build gapo's `Actor` at ZeRO-3 and iterate `actor.gathered_weights()`
to the end, counting the bytes of every tensor, `--reps` times after a warm-up; rank 0's median time and the GiB it
yielded are reported. This runs first, in a child (`--gather-worker`), before the engine is built.
Figures are printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from _util import median

from gapo.distributed import free_port, init_distributed
from gapo.models import resolve_model
from gapo.rollout.engine import build_engine

ROOT = Path(__file__).resolve().parents[1]


def gather_worker(reps: int) -> None:
    """One rank of the torchrun child: time full iterations of gathered_weights; rank 0 prints JSON last."""
    import torch.distributed as dist

    from gapo.configfile import resolve
    from gapo.trainer.actor import Actor

    rank = init_distributed().rank
    cfg = resolve({"trainer": {"zero_stage": 3, "micro_batch_size": 8, "ppo_mini_batch_size": 16}})
    actor = Actor(cfg, str(resolve_model("smollm2-135m")))
    times, nbytes = [], 0
    for rep in range(reps + 1):  # the first is warm-up
        dist.barrier()
        tic = time.perf_counter()
        nbytes = 0
        for _, t in actor.gathered_weights():
            nbytes += t.numel() * t.element_size()
        if rep:
            times.append(time.perf_counter() - tic)
    if rank == 0:
        print(json.dumps({"gather_s": median(times), "gib": nbytes / 2**30, "times": times}))


def run_gather(reps: int) -> dict:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           __file__, "--gather-worker", "--reps", str(reps)]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if r.returncode:
        raise RuntimeError(f"gather worker exited with {r.returncode}:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--gather-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.gather_worker:
        gather_worker(args.reps)
        return
    from transformers import AutoModelForCausalLM

    gather = run_gather(args.reps)
    print(f"gather on 2 ranks (rank 0): {[round(t, 3) for t in gather['times']]} s", flush=True)

    init_distributed()
    model_dir = str(resolve_model("smollm2-135m"))
    engine = build_engine("vllm", model_dir, dtype="float32", seed=0, max_model_len=192)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    weights = [(name, p.data) for name, p in model.named_parameters(remove_duplicate=False)]
    dst = [torch.empty_like(t) for _, t in weights]
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    times: dict[str, list[float]] = {"push": [], "memcpy": []}
    for rep in range(args.reps + 1):  # the first round is warm-up
        tic = time.perf_counter()
        engine.push_weights(iter(weights), version=1)
        push = time.perf_counter() - tic
        tic = time.perf_counter()
        for d, (_, s) in zip(dst, weights, strict=True):
            d.copy_(s)
        copy = time.perf_counter() - tic
        if rep:
            times["push"].append(push)
            times["memcpy"].append(copy)
        print(f"round {rep}: push {push:.3f} s, memcpy {copy:.3f} s", flush=True)
    p, c = median(times["push"]), median(times["memcpy"])
    print(f"\n== weight push (SmolLM2-135M fp32 CPU, {len(weights)} tensors, {nbytes / 2**30:.3f} GiB incl. tied "
          "lm_head) ==")
    print(f"vLLM push_weights: {p:.3f} s ({nbytes / 2**30 / p:.2f} GiB/s); memcpy floor: {c:.3f} s "
          f"({nbytes / 2**30 / c:.2f} GiB/s); ratio push/floor {p / c:.2f}   (goal <= 3)")
    print(f"ZeRO-3 gathered_weights, 2 ranks gloo, rank 0: {gather['gather_s']:.3f} s for {gather['gib']:.3f} GiB "
          f"({gather['gib'] / gather['gather_s']:.2f} GiB/s)")


if __name__ == "__main__":
    main()
