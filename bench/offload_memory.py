"""Host memory of the optimizer offload on CPU: the demo model (configs/demo_cpu.yaml, SmolLM2-135M, fp32, one rank)
with trainer.offload.optimizer off and on, against the memory plan's host figure (gapo/memory.py).

    .venv/bin/python bench/offload_memory.py [--cases off,on,on_plain] [--steps 2]

Every case runs in a fresh child process (`--case`): it builds the actor (model_dir from gapo.models), runs `--steps`
optimizer steps of 2 micro-batches (2 rows of 32 prompt + 32 response tokens each: activations stay small, so
what moves is the optimizer's) and reports:

- rss_built / peak: the process's RSS once the actor is built, and its peak RSS (VmHWM) over the whole case;
- step_extra: RSS above what was resident, at the peak of the last optimizer step alone (the base optimizer's
  `step`, wrapped; VmHWM reset with /proc/self/clear_refs just before it);
- offloaded (cases on*): the bytes of DeepSpeed's host buffers, each storage once: fp32 master partition and its
  gradient, the updated partition's staging copy, the largest gradient's staging buffer, the per-parameter host
  accumulators (fp32 weights accumulate over micro-batches in them) and Adam's moments; against
  gapo.memory.offload_host_bytes(..., pin=False) (nothing is pinned on CPU) plus the step's measured extra.

Cases: off (DeepSpeed stage 0, torch AdamW on the weights), on (ZeRO-2 with the optimizer offloaded and the
actor's fused AdamW), on_plain (the same with torch's default AdamW, single-tensor on CPU: the code before).
On CPU the "GPU" and host are one memory; on a GPU the same buffers are pinned and rounded up (GPU only).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

GIB = 2**30
CASES = ("off", "on", "on_plain")


def vm(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := current RSS (Linux >= 4.0)


def offloaded_bytes(zero) -> int:
    """DeepSpeed 0.19.8's host buffers of a ZeRO-1/2 optimizer with offload (stage_1_and_2.py), each storage once."""
    tensors = [*zero.single_partition_of_fp32_groups, *(t.grad for t in zero.single_partition_of_fp32_groups),
               *zero.param_buffer_of_bit16_for_cpu_offload_groups, zero.temp_grad_buffer_for_cpu_offload,
               *zero.accumulated_grads_in_cpu.values()]
    for state in zero.optimizer.state.values():
        tensors += [state["exp_avg"], state["exp_avg_sq"]]
    seen = {}
    for t in tensors:
        if t is not None:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def run_case(case: str, steps: int) -> dict:
    import torch

    import gapo.trainer.actor as actor_mod
    from gapo.configfile import load_config
    from gapo.distributed import init_distributed
    from gapo.memory import largest_param, offload_host_bytes, param_count
    from gapo.models import model_facts, resolve_model
    from gapo.trainer.logprobs import MicroBatch

    torch.manual_seed(0)
    init_distributed()
    offload = case != "off"
    cfg = load_config("demo_cpu", ["trainer.micro_batch_size=2", "trainer.ppo_mini_batch_size=4",
                                   f"trainer.offload.optimizer={'cpu' if offload else 'none'}"])
    if case == "on_plain":  # the actor's optimizer before: torch's default AdamW (single-tensor on CPU tensors)
        actor_mod.adamw = lambda params, t: torch.optim.AdamW(params, lr=t.lr, betas=t.adam_betas,
                                                              weight_decay=t.weight_decay)
    model_dir = str(resolve_model(cfg.model.path))
    actor = actor_mod.Actor(cfg, model_dir)
    rss_built = vm("VmRSS")
    inner = actor.deepspeed.basic_optimizer
    seen = {}
    step = inner.step

    def measured_step(*args, **kwargs):
        reset_peak()
        before = vm("VmRSS")
        t0 = time.perf_counter()
        out = step(*args, **kwargs)
        seen.update(step_extra=vm("VmHWM") - before, step_s=time.perf_counter() - t0)
        return out

    inner.step = measured_step
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        for _ in range(2):
            mb = MicroBatch.pack([torch.randint(3, 3000, (32,), generator=g).tolist() for _ in range(2)],
                                 [torch.randint(3, 3000, (32,), generator=g).tolist() for _ in range(2)], 0)
            lp, _ = actor.deepspeed(mb, 1.0)
            actor.backward(-(lp * mb.resp_mask).sum() / 128.0)
    facts = model_facts(cfg.model.path)
    n = sum(p.numel() for p in actor.module.parameters() if p.requires_grad)
    res = {"case": case, "optimizer": type(inner).__name__, "fused": bool(inner.defaults.get("fused")),
           "stage": actor.zero_stage, "params": n, "param_count": param_count(facts), "rss_built": rss_built,
           "peak": vm("VmHWM"), **seen}
    if offload:
        res["offloaded"] = offloaded_bytes(actor.deepspeed.optimizer)
        res["planned"] = offload_host_bytes(n, largest_param(facts), cfg.model.dtype, actor.zero_stage, 1, pin=False)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        print("RESULT " + json.dumps(run_case(args.case, args.steps)), flush=True)
        return
    results = []
    for case in args.cases.split(","):
        r = subprocess.run([sys.executable, __file__, "--case", case, "--steps", str(args.steps)],
                           capture_output=True, text=True, timeout=1200)
        line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            raise RuntimeError(f"case {case} failed:\n{r.stderr[-3000:]}")
        results.append(json.loads(line[7:]))
        print(f"case {case} done", flush=True)
    print(f"{'case':<10}{'optimizer':<22}{'stage':>6}{'built':>9}{'peak':>9}{'step +':>9}{'step s':>8}"
          f"{'offloaded':>11}{'planned':>9}   (GiB)")
    for r in results:
        opt = r["optimizer"] + (" fused" if r["fused"] else "")
        off = f"{r['offloaded'] / GIB:>11.3f}{r['planned'] / GIB:>9.3f}" if "offloaded" in r else f"{'':>20}"
        print(f"{r['case']:<10}{opt:<22}{r['stage']:>6}{r['rss_built'] / GIB:>9.3f}{r['peak'] / GIB:>9.3f}"
              f"{r['step_extra'] / GIB:>9.3f}{r['step_s']:>8.2f}{off}")
    n = results[0]["params"]
    print(f"{n:,} trained parameters (the plan's count: {results[0]['param_count']:,}); a fp32 copy of them is "
          f"{4 * n / GIB:.3f} GiB")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
