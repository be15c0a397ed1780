"""The first GPU's checks, in one go, printed as one table (bench/gpu/check.sh runs it; ~6 minutes on an H200).

    bench/gpu/check.sh               # a CUDA host: torch + transformers there; DeepSpeed etc. as wheels in .whl/
    bench/gpu/check.sh --cpu-smoke   # the same code paths at toy size on the CPU (make test runs it)

Rows, each PASS or FAIL against what it must show:
1. rl step: gapo's loop, DeepSpeed actor in bf16 with fp32 accumulation and gradient checkpointing, token-budget
   micro-batches, two steps at Qwen2.5-1.5B shape (bench/gpu/rl_steps.py): update tokens/s and MFU (figures),
   peak memory against the memory plan's share (must not exceed it by more than 15 %), skipped steps (0).
2. first mini-batch IS deviation: max |log pi - log pi_old| where pi = pi_old; must be exactly 0 (one SDPA kernel
   for both passes: gapo/trainer/actor.py attention_backend).
3. NaN step: a non-finite loss is skipped: weights, optimizer state and learning rate untouched.
4. vLLM (when it imports): generation, a weight push of the same weights (time; the first tokens must be equal
   before and after), and, on a GPU, a sleep/wake cycle around a push (tokens equal again).
Exits 1 if any row fails. The GPU-only paths it drives are written from vLLM 0.32 / DeepSpeed 0.19.8's source and
have not run on a GPU before this script does.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # rl_steps beside this file (run by path, not as a module)

import rl_steps  # noqa: E402

ROWS: list[tuple[str, str, str, bool]] = []  # (check, value, must show, passed)


def row(check: str, value: str, must: str, ok: bool) -> None:
    ROWS.append((check, value, must, ok))
    print(f"{'PASS' if ok else 'FAIL'}  {check}: {value}  ({must})", flush=True)


def rl_step(cpu_smoke: bool, out: Path) -> str:
    res = rl_steps.run(cpu_smoke, new_tokens=512, prompts=8, out=out / "rl")
    last = res["steps"][-1]
    row("rl step throughput", f"{last['tokens_per_s']:,.0f} update tokens/s, MFU {last['mfu']:.1%} "
        f"({res['params'] / 1e9:.2f} B params, {res['rollouts']} rollouts x <= {res['new']} tokens)", "a figure", True)
    if res["peak_gib"] is not None:
        row("peak memory vs plan", f"{res['peak_gib']:.1f} GiB allocated, plan {res['plan_gib']:.1f} GiB",
            "within 15 % above the plan", res["peak_gib"] <= 1.15 * res["plan_gib"])
    row("skipped steps", str(sum(x["skipped"] for x in res["steps"])), "0",
        all(x["skipped"] == 0 for x in res["steps"]))
    devs = [x["first_dev"] for x in res["steps"]]
    row("first mini-batch IS deviation", ", ".join(f"{d:g}" for d in devs), "exactly 0", all(d == 0.0 for d in devs))
    return res["model_dir"]


def nan_step(model_dir: str) -> None:
    from gapo.config import resolve
    from gapo.trainer.actor import Actor
    from gapo.trainer.logprobs import MicroBatch

    cfg = resolve({"model": {"path": model_dir, "dtype": "bfloat16"},
                   "rollout": {"prompts_per_step": 1, "group_size": 2},
                   "trainer": {"micro_batch_size": 2, "ppo_mini_batch_size": 2, "lr": 1e-3, "lr_schedule": "cosine",
                               "total_steps": 4, "warmup_steps": 1}})
    actor = Actor(cfg, model_dir)
    g = torch.Generator().manual_seed(0)
    mb = MicroBatch.pack([torch.randint(3, 300, (5,), generator=g).tolist()] * 2,
                         [torch.randint(3, 300, (6,), generator=g).tolist() for _ in range(2)], 0).to(actor.device)

    def step(poison: bool) -> bool:
        actor.engine.set_gradient_accumulation_boundary(True)
        lp, _ = actor.engine(mb, 1.0)
        loss = -(lp * mb.resp_mask).sum() / 12.0
        return bool(actor.backward(loss * float("nan") if poison else loss))

    step(False)
    before = {n: t.detach().float().clone() for n, t in actor.gathered_weights()}
    lr = actor.lr()
    applied = step(True)
    same = all(torch.equal(before[n], t.detach().float()) for n, t in actor.gathered_weights())
    row("NaN step skipped", f"applied {applied}, weights untouched {same}, lr {lr:g} -> {actor.lr():g}",
        "not applied, weights and lr unchanged", not applied and same and actor.lr() == lr)


def vllm_cycle(model_dir: str, cpu_smoke: bool) -> None:
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        row("vLLM", f"not importable ({err})", "skipped without vLLM", True)
        return
    from gapo.rollout.types import SamplingConfig
    from gapo.rollout.vllm_engine import VLLMEngine
    from gapo.study.evaluate import checkpoint_weights

    gpu = torch.cuda.is_available()
    if cpu_smoke:  # vLLM's CPU attention needs head_dim >= 32: the toy model's is 16; tiny-qwen2 in fp32 instead
        from gapo.models import resolve_model

        model_dir = str(resolve_model("tiny-qwen2"))
    engine = VLLMEngine(model_dir, dtype="float32" if cpu_smoke else "bfloat16", seed=0, max_model_len=512,
                        sleep_mode=gpu, kv_cache_gb=None if gpu else 0.25, compile="eager" if cpu_smoke else "auto")
    sampling = SamplingConfig(n=2, temperature=1.0, top_p=1.0, max_new_tokens=16)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]

    def tokens() -> list:
        return [[r.response_ids for r in g] for g in engine.generate(prompts, sampling, seeds=[1, 2])]

    first = tokens()
    weights = list(checkpoint_weights(Path(model_dir)))
    tic = time.perf_counter()
    engine.push_weights(iter(weights))
    push_s = time.perf_counter() - tic
    row("vLLM weight push", f"{push_s:.2f} s for {sum(t.numel() for _, t in weights) / 1e9:.2f} B params",
        "the same tokens after pushing the same weights", tokens() == first)
    if gpu:  # GPU only; unverified before this script ran on one
        engine.sleep()
        engine.push_weights(iter(weights))  # wakes weights, pushes, wakes the KV cache
        row("vLLM sleep / wake", "sleep(level=2), push, wake", "the same tokens after the cycle", tokens() == first)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("/tmp/gapo_gpu_check"))
    args = ap.parse_args()
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu-smoke for the CPU check of these code paths", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU (--cpu-smoke)'}, torch "
          f"{torch.__version__}", flush=True)
    model_dir = rl_step(args.cpu_smoke, args.out)
    nan_step(model_dir)
    vllm_cycle(model_dir, args.cpu_smoke)
    width = max(len(c) for c, *_ in ROWS)
    print("\n== gapo GPU check ==")
    for check, value, must, ok in ROWS:
        print(f"{'PASS' if ok else 'FAIL'}  {check:<{width}}  {value}   [{must}]")
    keys = ("check", "value", "must", "ok")
    (args.out / "check.json").write_text(json.dumps([dict(zip(keys, r, strict=True)) for r in ROWS]))
    return 0 if all(ok for *_, ok in ROWS) else 1


if __name__ == "__main__":
    sys.exit(main())
