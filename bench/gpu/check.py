"""The first GPU's checks, in one go, printed as one table (bench/gpu/check.sh runs it; ~6 minutes on an H200).

    bench/gpu/check.sh               # a CUDA host: torch + transformers there; DeepSpeed etc. as wheels in .whl/
    bench/gpu/check.sh --cpu-smoke   # the same code paths at toy size on the CPU (make test runs it)

Rows, each PASS or FAIL against what it must show, SKIP (with why) where it did not run, INFO for a figure:
1. rl step: gapo's loop, DeepSpeed actor in bf16 with fp32 accumulation and gradient checkpointing, token-budget
   micro-batches, two steps at Qwen2.5-1.5B shape (bench/gpu/rl_steps.py; GQA: 12 query, 2 KV heads, unpadded
   micro-batches included): update tokens/s and MFU (INFO), peak allocated memory against the memory plan's
   share without its OVERHEAD allowance (which allocated memory cannot see; within 15 %), skipped steps (0).
2. first mini-batch IS deviation: max |log pi - log pi_old| where pi = pi_old; must be exactly 0 (one SDPA kernel
   for both passes: gapo/trainer/actor.py attention_backend).
3. NaN step: a non-finite loss is skipped: weights, optimizer state and learning rate untouched.
4. vLLM (SKIP without it): the engine's weights are zeroed (vLLM's reset_weights), then the actor's gathered
   weights are pushed through gapo.trainer.sync (names, version and probe verified): the first tokens must equal
   those before the reset, and on a GPU vLLM's weight checksums those before it; a sleep/wake cycle around a push.
5. gapo-train end to end on every GPU of the node (tiny-qwen2, GQA, bf16, ZeRO-3 when there are two or more: the
   NCCL start and ZeRO-3's gather into vLLM): exit 0, every push verified, no traceback on the console.
Exits 1 if any row fails. The GPU-only paths it drives are written from vLLM 0.32 / DeepSpeed 0.19.8's source and
have not run on a GPU before this script does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # rl_steps beside this file (run by path, not as a module)

import rl_steps  # noqa: E402

ROWS: list[tuple[str, str, str, str]] = []  # (status, check, value, must show)


def row(check: str, value: str, must: str, ok: bool | None) -> None:
    """ok None: a figure (INFO), or, with must starting "skipped", a check that did not run (SKIP)."""
    status = ("SKIP" if must.startswith("skipped") else "INFO") if ok is None else "PASS" if ok else "FAIL"
    ROWS.append((status, check, value, must))
    print(f"{status}  {check}: {value}  ({must})", flush=True)


def rl_step(cpu_smoke: bool, out: Path) -> str:
    res = rl_steps.run(cpu_smoke, new_tokens=512, prompts=8, out=out / "rl")
    last = res["steps"][-1]
    row("rl step throughput", f"{last['tokens_per_s']:,.0f} update tokens/s, MFU {last['mfu']:.1%} "
        f"({res['params'] / 1e9:.2f} B params, {res['rollouts']} rollouts x <= {res['new']} tokens)", "a figure", None)
    if res["peak_gib"] is None:
        row("peak memory vs plan", "no CUDA allocator on the CPU", "skipped: GPU only", None)
    else:
        row("peak memory vs plan", f"{res['peak_gib']:.1f} GiB allocated, plan {res['plan_gib']:.1f} GiB (tensors)",
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
        row("vLLM weight push", f"vLLM not importable ({err})", "skipped: needs vLLM", None)
        return
    from gapo.config import resolve
    from gapo.rollout.types import SamplingConfig
    from gapo.rollout.vllm_engine import VLLMEngine
    from gapo.trainer import sync
    from gapo.trainer.actor import Actor

    gpu = torch.cuda.is_available()
    dtype = "float32" if cpu_smoke else "bfloat16"
    if cpu_smoke:  # vLLM's CPU attention needs head_dim >= 32: the toy model's is 16; tiny-qwen2 in fp32 instead
        from gapo.models import resolve_model

        model_dir = str(resolve_model("tiny-qwen2"))
    engine = VLLMEngine(model_dir, dtype=dtype, seed=0, max_model_len=512, sleep_mode=gpu,
                        kv_cache_gb=None if gpu else 0.25, compile="eager" if cpu_smoke else "auto")
    cfg = resolve({"model": {"path": model_dir, "dtype": dtype}, "rollout": {"prompts_per_step": 1, "group_size": 2},
                   "trainer": {"micro_batch_size": 2, "ppo_mini_batch_size": 2}})
    actor = Actor(cfg, model_dir)
    sampling = SamplingConfig(n=2, temperature=1.0, top_p=1.0, max_new_tokens=16)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]

    def tokens() -> list:
        return [[r.response_ids for r in g] for g in engine.generate(prompts, sampling, seeds=[1, 2])]

    def checksums() -> dict:
        return engine.llm.llm_engine.engine_core.engine_core.compute_weight_checksums()[0]

    first, sums = tokens(), checksums()
    engine.llm.collective_rpc("reset_weights")  # zeroed: a push that delivers nothing cannot pass
    tic = time.perf_counter()
    try:
        pushed = sync.push(engine, actor, 1, sync.Probe.of(engine.tokenizer, cfg, pad_id=0))
        error = ""
    except sync.SyncError as err:
        pushed, error = None, str(err)
    push_s = time.perf_counter() - tic
    params = sum(p.numel() for p in actor.module.parameters())
    row("vLLM weight push into zeroed weights", f"{push_s:.2f} s for {params / 1e9:.2f} B params"
        + (f", probe diff {pushed.probe_diff:.2g}" if pushed else f": {error}"),
        "verified by gapo.trainer.sync, and the first tokens equal those before the reset",
        pushed is not None and tokens() == first)
    if gpu:  # vLLM keeps checkpoint-layout weights on a GPU; on the CPU it repacks linear weights, so no checksums
        row("vLLM weight checksums after the push", "equal" if checksums() == sums else "differ",
            "equal to those before the reset", checksums() == sums)
    else:
        row("vLLM weight checksums after the push", "vLLM on the CPU repacks linear weights out of its parameters",
            "skipped: GPU only", None)
    if gpu:  # GPU only; unverified before this script ran on one
        engine.sleep()
        sync.push(engine, actor, 2, None)  # wakes weights, pushes, wakes the KV cache
        row("vLLM sleep / wake", "sleep(level=2), push, wake", "the same tokens after the cycle", tokens() == first)
    else:
        row("vLLM sleep / wake", "vLLM refuses sleep mode on the CPU", "skipped: GPU only", None)


def train_run(out: Path, cpu_smoke: bool) -> None:
    """gapo-train itself on every GPU of the node: the NCCL start (set_device before the first collective) and, with
    two or more GPUs, ZeRO-3's gather into vLLM; tiny-qwen2 is a GQA model (4 query, 2 KV heads)."""
    import subprocess

    n = 1 if cpu_smoke else torch.cuda.device_count()  # (2 CPU ranks: tests/test_sync.py, in make test-all)
    dtype = "float32" if cpu_smoke else "bfloat16"
    cmd = [sys.executable, "-m", "gapo.cli", "--config", "configs/tiny_cpu.yaml", "--nproc", str(n),
           f"trainer.output_dir={out / 'train'}", f"model.dtype={dtype}", "trainer.total_steps=2",
           "tracking.mode=disabled"]
    # This process is a world of one already (RANK, MASTER_PORT, ... set): the child must start its own.
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    rows = [json.loads(x) for x in (out / "train" / "metrics.jsonl").read_text().splitlines()] \
        if (out / "train" / "metrics.jsonl").exists() else []
    verified = [x for x in rows if "sync/probe_logprob_diff" in x]
    console = r.stdout + r.stderr
    ok = r.returncode == 0 and len(verified) == 2 and "Traceback" not in console
    where = f"{n} {'CPU ranks' if cpu_smoke else 'GPUs'}, ZeRO-{3 if n > 1 else 0}"
    row("gapo-train end to end", f"{where}: exit {r.returncode}, {len(verified)} of 2 pushes verified"
        + ("" if ok else f"; console ends: {console[-600:]!r}"), "exit 0, every push verified, no traceback", ok)
    if n < 2:
        row("2-GPU start and ZeRO-3 gather into vLLM", f"one {'CPU rank (smoke)' if cpu_smoke else 'GPU on this node'}",
            "skipped: needs two GPUs", None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("/tmp/gapo_gpu_check"))
    args = ap.parse_args()
    if not args.cpu_smoke and not torch.cuda.is_available():
        print(f"no CUDA device visible to {sys.executable} (torch {torch.__version__}"
              f"{', a CPU build' if torch.version.cuda is None else ''}): on a GPU host, use a Python whose torch has "
              "CUDA (check.sh prefers .venv only when it does); on a CPU machine, --cpu-smoke checks these code "
              "paths at toy size", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU (--cpu-smoke)'}, torch "
          f"{torch.__version__}", flush=True)
    model_dir = rl_step(args.cpu_smoke, args.out)
    nan_step(model_dir)
    vllm_cycle(model_dir, args.cpu_smoke)
    train_run(args.out, args.cpu_smoke)
    width = max(len(c) for _, c, *_ in ROWS)
    print("\n== gapo GPU check ==")
    for status, check, value, must in ROWS:
        print(f"{status}  {check:<{width}}  {value}   [{must}]")
    keys = ("status", "check", "value", "must")
    (args.out / "check.json").write_text(json.dumps([dict(zip(keys, r, strict=True)) for r in ROWS]))
    return 1 if any(status == "FAIL" for status, *_ in ROWS) else 0


if __name__ == "__main__":
    sys.exit(main())
