"""The first GPU's checks, in one go, printed as one table (bench/gpu/check.sh runs it).

    python bench/gpu/kit.py pack bench/gpu/node-cuda-image.txt --split 60   # here: the offline kit in .whl/
    bench/gpu/check.sh --budget 600  # a CUDA host: its torch + transformers; vLLM 0.26 and the rest from the kit
    bench/gpu/check.sh --cpu-smoke   # the same code paths at toy size on the CPU (make test runs it)

Rows, each PASS or FAIL against what it must show, SKIP (with why) where it did not run, INFO for a figure. Each step
runs in its own try/except: an error is a FAIL of the rows it had not written yet, with the message, and the table and
check.json are written whatever happens. On a machine without a GPU every row reads SKIP and the script exits 0;
on one whose GPU torch cannot see, the device row fails.
0. CUDA device: one torch can use (FAIL when nvidia-smi lists a GPU torch does not see: a CPU build of torch; FAIL too
   when nvidia-smi fails, or is missing beside /dev/nvidia* nodes: then nothing says the host has no GPU). A vLLM that
   is installed but does not import is a FAIL of its own ("vLLM import"), not a SKIP.
1. model shape: the largest Qwen2.5 shape (1.5B, else 0.5B) whose step the memory plan puts within 85 % of the GPU
   (a fixed 1.5B shape died at row 1 on a 24 GB GPU); SKIP, and so every row needing it, if none fits.
2. rl step: gapo's loop, DeepSpeed actor in bf16 with fp32 accumulation and gradient checkpointing, token-budget
   micro-batches, two steps at that shape (bench/gpu/rl_steps.py; GQA, unpadded micro-batches included): update
   tokens/s and MFU (INFO), peak allocated memory against the memory plan's share without its OVERHEAD allowance
   (which allocated memory cannot see; within 15 %), skipped steps (0), reward scoring errors (0: a node without
   math-verify scored every boxed answer "error" and trained on).
   The first mini-batch's IS deviation: max |log pi - log pi_old| where pi = pi_old; must be exactly 0 (one SDPA kernel
   for both passes: gapo/trainer/actor.py attention_backend).
   The push probe's bf16 difference on this device (transformers' forward against DeepSpeed's, two kernels): what
   the bf16 probe calibrates on (INFO on how it compares with the floor); every push verified.
3. offloaded optimizer (no vLLM needed): the one-GPU recipe's trainer path, ZeRO-2 with the optimizer on the host
   (pinned buffers, torch's fused CPU AdamW on the rank's share of the cores), two short steps at the same shape: every
   optimizer step seen from torch (a global step pre-hook: its count, its tensors on the host, its threads); peak GPU
   and host memory against the plan (GPU only).
4. LoRA (no vLLM needed): tests/dist/dist_lora_check.py on this device: the adapters' gradient through the DeepSpeed
   actor (bf16 layers computing with the merged weight they push) against the same merge in plain torch (1 %) and PEFT's
   fp32 forward (6 %).
5. NaN step: after a finite step that is applied and moves the weights (the control), a non-finite loss is skipped:
   weights and learning rate untouched.
6. vLLM (SKIP without a vLLM for this device): the engine's weights are zeroed (vLLM's reset_weights), which must
   change the tokens, then the actor's gathered weights are pushed through gapo.trainer.sync (names, version and probe
   verified): the first tokens must equal those before the reset, and on a GPU vLLM's weight checksums those before
   it; a sleep/wake cycle around a push, the sleep freeing at least the weights' memory. Then the engine is closed
   (VLLMEngine.close): its at-leave entry gone, its model collected, and on a GPU as much free memory as the gapo-train
   rows' vLLM asks for (after emptying PyTorch's cache).
7. gapo-train end to end on every GPU of the node (tiny-qwen2, GQA, bf16, ZeRO-3 when there are two or more: the
   NCCL start and ZeRO-3's gather into vLLM): exit 0, every push verified, no traceback on the console.
8. one-GPU recipe: configs/qwen_math_1gpu.yaml's rollout and trainer settings (optimizer offload, vLLM sleep mode, its
   memory share, the token budget) on tiny-qwen2, one GPU: sleep -> train -> wake -> push, 2 steps, every push
   verified. The CPU smoke run has sleep mode off (vLLM refuses it on the CPU), and its sleep row reads SKIP.
Exits 1 if any row fails. Results of the runs so far: docs/PERFORMANCE.md §6 (rows that have not run on a GPU are
unverified there).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

try:  # check.sh may find a Python without torch: the table says so instead of a traceback
    import torch
except ImportError as _err:
    torch = None
    TORCH_MISSING = f"torch not importable by {sys.executable} ({_err})"
else:
    TORCH_MISSING = ""

sys.path.insert(0, str(Path(__file__).resolve().parent))  # rl_steps beside this file (run by path, not as a module)
ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "configs" / "qwen_math_1gpu.yaml"

ROWS: list[tuple[str, str, str, str]] = []  # (status, check, value, must show)


def row(check: str, value: str, must: str, ok: bool | None) -> None:
    """ok None: a figure (INFO), or, with must starting "skipped", a check that did not run (SKIP)."""
    status = ("SKIP" if must.startswith("skipped") else "INFO") if ok is None else "PASS" if ok else "FAIL"
    ROWS.append((status, check, value, must))
    print(f"{status}  {check}: {value}  ({must})", flush=True)


def skip(check: str, why: str) -> None:
    row(check, why, "skipped", None)


@dataclass(frozen=True)
class Step:
    """One step of the check: `run(state)` writes `rows` (check, must show) with row()/skip(); `needs(state)` says
    why it cannot run here ('' when it can), and then each of its rows reads SKIP with that reason."""

    run: Callable[[dict], None]
    rows: tuple[tuple[str, str], ...]
    needs: Callable[[dict], str] = lambda state: state["no_device"]


def run_step(step: Step, state: dict) -> None:
    """A step that raises fails the rows it had not written, with the error, and the next step still runs: one broken
    path must not cost the table (a 24 GB GPU used to get a traceback at row 1 and nothing else)."""
    why = step.needs(state)
    spent = time.monotonic() - state.get("t0", time.monotonic())
    if not why and state.get("budget") and spent > state["budget"]:
        why = f"the --budget of {state['budget']:.0f} s was spent ({spent:.0f} s) before this step"
    if why:
        for check, _ in step.rows:
            skip(check, why)
        return
    start, tic = len(ROWS), time.monotonic()
    try:
        step.run(state)
        error = "not reported by its step (a bug in check.py)"
    except Exception as err:  # noqa: BLE001 (any error is this step's FAIL, not the end of the table)
        traceback.print_exc()
        error = f"{type(err).__name__}: {err}"[:1500]
    written = {check for _, check, *_ in ROWS[start:]}
    for check, must in step.rows:
        if check not in written:
            row(check, error, must, False)
    free_memory()
    state.setdefault("seconds", {})[step.run.__name__] = round(time.monotonic() - tic, 1)
    print(f"[{step.run.__name__}: {time.monotonic() - tic:.0f} s]", flush=True)


def free_memory() -> None:
    """What a finished step left to the garbage collector (DeepSpeed engines hold reference cycles) and to PyTorch's
    cache goes back to the device before the next step asks for it."""
    gc.collect()
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------- dependencies
def gpus_on_host() -> tuple[int, str]:
    """(GPUs the NVIDIA driver lists, whatever torch sees; why that count cannot be trusted, '' when it can): a GPU
    host whose torch cannot see them must fail, not skip, and so must one whose nvidia-smi fails (a driver that does
    not match the kernel module lists nothing), or that has device nodes and no nvidia-smi."""
    nodes = sorted(str(p) for p in Path("/dev").glob("nvidia[0-9]*"))
    try:
        r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        return 0, f"no nvidia-smi, but {', '.join(nodes)} exist" if nodes else ""
    except (OSError, subprocess.TimeoutExpired) as err:
        return 0, f"nvidia-smi -L failed: {type(err).__name__}: {err}"
    if r.returncode:
        return 0, f"nvidia-smi -L exited {r.returncode}: {(r.stdout + r.stderr).strip()[-300:]}"
    return sum(line.startswith("GPU ") for line in r.stdout.splitlines()), ""


def device_gib() -> float:
    return torch.cuda.get_device_properties(0).total_memory / 2**30


def vllm_missing(cpu_smoke: bool) -> str:
    """Why the vLLM rows cannot run with this Python ('' when they can): no vLLM, or one built for another device."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "needs vLLM: not installed for this Python"
    try:
        import vllm
        from vllm.platforms import current_platform
    except Exception as err:  # noqa: BLE001 (installed and broken: a FAIL of its own, and its rows cannot run)
        why = f"vLLM is installed but not importable ({type(err).__name__}: {err})"[:400]
        row("vLLM import", why, "importable where installed", False)
        return f"needs vLLM: {why}"
    if not cpu_smoke and not current_platform.is_cuda_alike():
        return f"needs a CUDA vLLM: vLLM {vllm.__version__} here is for {current_platform.device_type or 'the CPU'}"
    return ""


def needs_model(state: dict) -> str:
    return state["no_device"] or ("" if state.get("model_dir") else state.get("no_model", "the model was not built"))


def needs_vllm(state: dict) -> str:
    return state["no_device"] or state["no_vllm"]


# ------------------------------------------------------------------------------------------------------- steps
def device_row(state: dict) -> None:
    check = "CUDA device"
    if state["cpu_smoke"]:
        skip(check, "none used: --cpu-smoke runs these code paths at toy size on the CPU")
    elif torch is not None and torch.cuda.is_available():
        row(check, f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}, {device_gib():.1f} GiB, torch "
            f"{torch.__version__}", "a device torch can use", True)
    else:
        seen = TORCH_MISSING or f"torch {torch.__version__}{' (a CPU build)' if torch.version.cuda is None else ''} " \
                                "sees no CUDA device"
        gpus, broken = gpus_on_host()
        if gpus:
            row(check, f"nvidia-smi lists {gpus} GPU(s) but {seen}: use a Python whose torch has CUDA (check.sh "
                "prefers .venv only when it does)", "a device torch can use", False)
        elif broken:
            row(check, f"{seen}, and whether this host has a GPU is unknown: {broken}", "a device torch can use",
                False)
        else:
            skip(check, f"no GPU on this host ({seen}; nvidia-smi lists none)")


def model_step(state: dict) -> None:
    """Build the model every row after uses, at the largest shape the memory plan fits on this device."""
    import rl_steps

    check, model = "model shape", state["out"] / "model"
    if state["cpu_smoke"]:
        params = rl_steps.build_model(model, rl_steps.TOY)
        row(check, f"toy Qwen2, {params:,} params (CPU smoke)", "a figure", None)
    else:
        gib = device_gib()
        shape, plans = rl_steps.pick_shape(gib, prompts=8, new_tokens=512)
        planned = ", ".join(f"{name} {p:.1f} GiB" for name, p in plans.items())
        if shape is None:
            state["no_model"] = f"no model shape fits this {gib:.1f} GiB GPU"
            skip(check, f"{state['no_model']}: the step plans {planned}, above {rl_steps.HEADROOM:.0%} of it")
            return
        params = rl_steps.build_model(model, rl_steps.SHAPES[shape])
        state["shape"] = shape
        row(check, f"{shape}, {params / 1e9:.2f} B params (the step plans {planned}; {gib:.1f} GiB here)",
            f"the largest shape planned within {rl_steps.HEADROOM:.0%} of the GPU", None)
    state["model_dir"] = model


def rl_step(state: dict) -> None:
    import rl_steps

    res = rl_steps.run(state["cpu_smoke"], new_tokens=512, prompts=8, out=state["out"] / "rl",
                       shape=state.get("shape", ""), model=state["model_dir"])
    last = res["steps"][-1]
    row("rl step throughput", f"{last['tokens_per_s']:,.0f} update tokens/s, MFU {last['mfu']:.1%} "
        f"({res['params'] / 1e9:.2f} B params, {res['rollouts']} rollouts x <= {res['new']} tokens)", "a figure", None)
    if res["peak_gib"] is None:
        skip("peak memory vs plan", "no CUDA allocator on the CPU")
    else:
        row("peak memory vs plan", f"{res['peak_gib']:.1f} GiB allocated, plan {res['plan_gib']:.1f} GiB (tensors)",
            "within 15 % above the plan", res["peak_gib"] <= 1.15 * res["plan_gib"])
    row("skipped steps", str(sum(x["skipped"] for x in res["steps"])), "0",
        all(x["skipped"] == 0 for x in res["steps"]))
    errors = [x["scoring_errors"] for x in res["steps"]]
    row("reward scoring errors", ", ".join(f"{e:g}" for e in errors), "0 (math-verify scored every answer)",
        all(e == 0.0 for e in errors))
    devs = [x["first_dev"] for x in res["steps"]]
    # (the metric reads 0 for a mini-batch without tokens too: each step must have trained on some)
    row("first mini-batch IS deviation", ", ".join(f"{d:g}" for d in devs), "exactly 0, over steps with tokens",
        all(d == 0.0 for d in devs) and all(x["tokens_per_s"] > 0 for x in res["steps"]))
    from gapo.trainer.sync import BF16_FLOOR

    probes = [x["probe_diff"] for x in res["steps"]]
    # the engine here is transformers' bf16 forward, the trainer DeepSpeed's: this device's kernel difference, which
    # the bf16 probe calibrates on (gapo/trainer/sync.py: 10x the first push's, within [0.05, 0.25])
    row("bf16 push probe difference", ", ".join("none" if d is None else f"{d:.3g}" for d in probes),
        f"every push verified (a first push above the floor {BF16_FLOOR:g} sets the limit to 10x it)",
        all(d is not None for d in probes))


def offload_step(state: dict) -> None:
    """The one-GPU recipe's training path without vLLM (rollout.engine=hf): the optimizer offloaded (ZeRO-2, pinned
    host buffers on a GPU, torch's fused AdamW stepping on the host with this process's threads), two steps at the
    model's shape with short responses; peak GPU and host memory against the plan. GPU rows unverified on a GPU."""
    import rl_steps

    res = rl_steps.run(state["cpu_smoke"], new_tokens=128, prompts=4, out=state["out"] / "offload",
                       shape=state.get("shape", ""), model=state["model_dir"], offload=True)
    share = int(os.environ.get("OMP_NUM_THREADS", "0"))  # what gapo.distributed.share_cores gave this rank (main)
    skipped = int(sum(x["skipped"] for x in res["steps"]))
    ran = res["optimizer_steps"]  # measured inside each optimizer step (rl_steps.run's hook)
    where = sorted({(x["optimizer"], x["device"], x["threads"]) for x in ran})
    row("offloaded optimizer: 2 steps, hf engine",
        f"{len(res['steps'])} steps logged, skipped {skipped}; {len(ran)} optimizer steps ran as "
        + "; ".join(f"{name} on {device} tensors with {n} threads" for name, device, n in where)
        + f" ({share} shared to this rank; ZeRO-{res['zero_stage']} configured), train "
        + ", ".join(f"{x['train_s']:.1f}" for x in res["steps"]) + " s per step",
        "both steps applied, each optimizer step on host tensors with the rank's share of the cores",
        len(res["steps"]) == 2 and skipped == 0 and len(ran) == 2 * res["updates_per_step"]
        and all(x["device"] == "cpu" and x["threads"] == share for x in ran))
    if res["peak_gib"] is None:
        skip("offloaded optimizer: peak GPU memory vs plan", "no CUDA allocator on the CPU")
        skip("offloaded optimizer: peak host memory vs plan", "on the CPU the host holds everything, not the offload")
        return
    row("offloaded optimizer: peak GPU memory vs plan", f"{res['peak_gib']:.1f} GiB allocated, plan "
        f"{res['plan_gib']:.1f} GiB (tensors)", "within 15 % above the plan", res["peak_gib"] <= 1.15 * res["plan_gib"])
    weights = res["params"] * 2 / 2**30  # a bf16 copy while the model loads
    row("offloaded optimizer: peak host memory vs plan", f"{res['host_gib']:.1f} GiB above the start, plan "
        f"{res['plan_host_gib']:.1f} GiB of offloaded states + {weights:.1f} GiB of weights loading",
        "within 15 % above the plan", res["host_gib"] <= 1.15 * (res["plan_host_gib"] + weights))


def lora_step(state: dict) -> None:
    """tests/dist/dist_lora_check.py on this device (1 rank, ZeRO-3): the adapters' gradient through the DeepSpeed
    actor, whose bf16 LoRA layers compute with the merged weight they push, against the same merge in plain torch (same
    kernels) and against PEFT's own fp32 forward (LoRA's gradient, up to bf16), with test_lora.py's bounds."""
    out = state["out"] / "lora" / "result"
    out.parent.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
                        "tests/dist/dist_lora_check.py", str(out), "3"], cwd=ROOT, env=own_world_env(),
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"tests/dist/dist_lora_check.py exited {r.returncode}: {r.stderr[-800:]}")
    res = json.loads(Path(f"{out}.0").read_text())
    where = "CPU" if state["cpu_smoke"] else "GPU"
    row("LoRA gradient: merged forward under DeepSpeed vs plain torch",
        f"{res['ds']:.5g} vs {res['merged_bf16']:.5g} ({where}, bf16, {res['lora_layers_merged']} layers merged)",
        "within 1 % (the same merged weights and kernels)",
        abs(res["ds"] - res["merged_bf16"]) <= 1e-2 * abs(res["merged_bf16"]) and res["lora_layers_merged"] > 0)
    row("LoRA gradient: DeepSpeed bf16 vs PEFT fp32", f"{res['ds']:.5g} vs {res['peft_fp32']:.5g}",
        "within 6 % (bf16's rounding; a wrong scale halves or doubles it)",
        abs(res["ds"] - res["peft_fp32"]) <= 6e-2 * abs(res["peft_fp32"]))


def nan_step(state: dict) -> None:
    from gapo.configfile import resolve
    from gapo.trainer.actor import Actor
    from gapo.trainer.logprobs import MicroBatch

    model_dir = str(state["model_dir"])
    cfg = resolve({"model": {"path": model_dir, "dtype": "bfloat16"},
                   "rollout": {"prompts_per_step": 1, "group_size": 2},
                   "trainer": {"micro_batch_size": 2, "ppo_mini_batch_size": 2, "lr": 1e-3, "lr_schedule": "cosine",
                               "total_steps": 4, "warmup_steps": 1}})
    actor = Actor(cfg, model_dir)
    g = torch.Generator().manual_seed(0)
    mb = MicroBatch.pack([torch.randint(3, 300, (5,), generator=g).tolist()] * 2,
                         [torch.randint(3, 300, (6,), generator=g).tolist() for _ in range(2)], 0).to(actor.device)

    def step(poison: bool) -> bool:
        actor.deepspeed.set_gradient_accumulation_boundary(True)
        lp, _ = actor.deepspeed(mb, 1.0)
        loss = -(lp * mb.resp_mask).sum() / 12.0
        return bool(actor.backward(loss * float("nan") if poison else loss))

    def norms() -> dict[str, float]:
        return {n: float(t.detach().float().norm()) for n, t in actor.gathered_weights()}

    start = norms()
    normal = step(False)  # the control: a finite step is applied and moves the weights, or "untouched" means nothing
    before = {n: t.detach().float().clone() for n, t in actor.gathered_weights()}
    moved = sum(start[n] != float(t.norm()) for n, t in before.items())
    lr = actor.lr()
    applied = step(True)
    same = all(torch.equal(before[n], t.detach().float()) for n, t in actor.gathered_weights())
    row("NaN step skipped", f"finite step applied {normal} ({moved} of {len(before)} tensors moved); NaN step applied "
        f"{applied}, weights untouched {same}, lr {lr:g} -> {actor.lr():g}",
        "the finite step applied; the NaN step not, weights and lr unchanged",
        normal and moved > 0 and not applied and same and actor.lr() == lr)


def _model_ref(worker) -> weakref.ref:
    """Runs inside the vLLM worker (in-process): a weak reference to its model, to see the model freed."""
    return weakref.ref(worker.model_runner.get_model())


def _zero_weights(worker) -> None:
    """Runs inside the vLLM worker: zeroes every parameter in place (vLLM 0.32 has a reset_weights RPC for this, 0.26
    none): a push that delivers nothing cannot pass."""
    with torch.no_grad():
        for p in worker.model_runner.get_model().parameters():
            p.zero_()


def _weight_checksums(worker) -> dict[str, str]:
    """Runs inside the vLLM worker: each parameter's sha256 as the engine holds it (0.32's compute_weight_checksums
    does the same; 0.26 has none)."""
    import hashlib

    return {name: hashlib.sha256(p.detach().cpu().contiguous().view(torch.uint8).numpy()).hexdigest()
            for name, p in worker.model_runner.get_model().named_parameters()}


def vllm_needs(state: dict) -> str:
    return needs_vllm(state) or ("" if state["cpu_smoke"] else needs_model(state))


def vllm_cycle(state: dict) -> None:
    import torch.distributed as dist

    from gapo.distributed import init_distributed
    from gapo.rollout.vllm_engine import VLLMEngine

    if not dist.is_initialized():  # the engine joins the world group (external_launcher): it must exist first (the
        # trainer rows made it, unless --budget skipped them)
        init_distributed()

    cpu_smoke, gpu = state["cpu_smoke"], torch.cuda.is_available()
    model_dir, dtype = str(state.get("model_dir")), "float32" if cpu_smoke else "bfloat16"
    if cpu_smoke:  # vLLM's CPU attention needs head_dim >= 32: the toy model's is 16; tiny-qwen2 in fp32 instead
        from gapo.models import resolve_model

        model_dir = str(resolve_model("tiny-qwen2"))
    # A 1 GiB KV cache on a GPU too: vLLM then takes only its weights and profile peak, and gpu_memory_utilization is
    # no more than its start-up check of free memory (v1/worker/utils.py request_memory), so the actor beside it fits
    # a 24 GB GPU (0.5 of it, as before, would not leave the actor of a 1.5B model room on 48 GB).
    share = None
    if gpu:
        from gapo.memory import VLLM_RESERVE, param_count

        facts = json.loads((Path(model_dir) / "config.json").read_text())
        share = min(0.5, (param_count(facts) * 2 + VLLM_RESERVE + 2 * 2**30) / (device_gib() * 2**30))
    engine = VLLMEngine(model_dir, dtype=dtype, seed=0, max_model_len=512, sleep_mode=gpu, kv_cache_gb=1.0 if gpu
                        else 0.25, compile="eager" if cpu_smoke else "auto",
                        **({"gpu_memory_utilization": share} if share else {}))
    model = None
    try:
        model = engine.llm.collective_rpc(_model_ref)[0]
        _push_cycle(engine, model_dir, dtype, gpu)
    finally:
        gc.collect()  # the cycle's actor, before vLLM's shutdown destroys the process group its DeepSpeed engine used
        _close_engine(engine, model, state)


def _push_cycle(engine, model_dir: str, dtype: str, gpu: bool) -> None:
    from gapo.configfile import resolve
    from gapo.rollout.types import SamplingConfig
    from gapo.trainer import sync
    from gapo.trainer.actor import Actor

    cfg = resolve({"model": {"path": model_dir, "dtype": dtype}, "rollout": {"prompts_per_step": 1, "group_size": 2},
                   "trainer": {"micro_batch_size": 2, "ppo_mini_batch_size": 2}})
    actor = Actor(cfg, model_dir)
    sampling = SamplingConfig(n=8, temperature=1.0, top_p=1.0, max_new_tokens=16)  # k = 8, as a run samples
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]

    def tokens() -> list:
        return [[r.response_ids for r in g] for g in engine.generate(prompts, sampling, seeds=[1, 2])]

    def checksums() -> dict:
        return engine.llm.collective_rpc(_weight_checksums)[0]

    tic = time.perf_counter()
    first = tokens()
    row("vLLM generation, k = 8", f"{sum(len(r) for g in first for r in g)} tokens in "
        f"{time.perf_counter() - tic:.2f} s ({dtype})", "a figure", None)
    sums = checksums()
    engine.llm.collective_rpc(_zero_weights)  # zeroed: a push that delivers nothing cannot pass
    reset = tokens() != first  # ... provided the reset changed what the engine samples
    tic = time.perf_counter()
    try:
        pushed = sync.push(engine, actor, 1, sync.Probe.of(engine.tokenizer, cfg, pad_id=0))
        error = ""
    except sync.SyncError as err:
        pushed, error = None, str(err)
    push_s = time.perf_counter() - tic
    params = sum(p.numel() for p in actor.module.parameters())
    # On the CPU vLLM computes linear layers from repacked copies that zeroing the parameters does not reach: there it
    # reaches the embeddings and norms only, and tests/test_sync.py's receipt checks (a dropped tensor) the rest.
    row("vLLM weight push into zeroed weights", f"reset changed the tokens {reset}; {push_s:.2f} s for "
        f"{params / 1e9:.2f} B params" + (f", probe diff {pushed.probe_diff:.2g}" if pushed else f": {error}"),
        "the reset changes the tokens; the push is verified by gapo.trainer.sync and brings back the first tokens",
        reset and pushed is not None and tokens() == first)
    if gpu:  # vLLM keeps checkpoint-layout weights on a GPU; on the CPU it repacks linear weights, so no checksums
        row("vLLM weight checksums after the push", "equal" if checksums() == sums else "differ",
            "equal to those before the reset", checksums() == sums)
    else:
        skip("vLLM weight checksums after the push", "vLLM on the CPU repacks linear weights out of its parameters")
    if gpu:  # GPU only; unverified before this script ran on one
        awake = torch.cuda.mem_get_info()[0]
        engine.sleep()
        freed = torch.cuda.mem_get_info()[0] - awake  # vLLM unmaps with the driver: free memory as the driver sees it
        weights = params * 2
        sync.push(engine, actor, 2, None)  # wakes weights, pushes, wakes the KV cache
        row("vLLM sleep / wake", f"sleep(level=2) freed {freed / 2**30:.2f} GiB (weights {weights / 2**30:.2f} GiB), "
            "push, wake", "sleep frees at least the weights; the same tokens after the cycle",
            freed >= weights and tokens() == first)
    else:
        skip("vLLM sleep / wake", "vLLM refuses sleep mode on the CPU")


def _close_engine(engine, model: weakref.ref | None, state: dict) -> None:
    """Item 1 of issue 44: gapo-train's vLLM on the same GPU needs its share free at start; this engine must be gone."""
    from gapo import distributed

    entry = engine._shutdown
    engine.close()
    del engine
    gc.collect()
    gone, collected = entry not in distributed._AT_LEAVE, model is not None and model() is None
    value, ok = f"at-leave entry {'gone' if gone else 'KEPT'}, model {'collected' if collected else 'ALIVE'}", True
    if torch.cuda.is_available():  # GPU only; unverified on a GPU
        from gapo.configfile import load_config

        torch.cuda.empty_cache()  # what the engine's tensors left in PyTorch's cache is free for the next engine
        free, total = torch.cuda.mem_get_info()
        # what the gapo-train rows' vLLM asks for at start (v1/worker/utils.py request_memory): the larger share
        need = total * max(load_config(str(ROOT / "configs" / "tiny_cpu.yaml")).rollout.gpu_memory_utilization,
                           load_config(str(RECIPE)).rollout.gpu_memory_utilization)
        value += f", {free / 2**30:.1f} GiB free for gapo-train's {need / 2**30:.1f} GiB"
        ok = free >= need
    row("vLLM engine freed", value, "at-leave entry gone, model collected (on a GPU: gapo-train's vLLM share free)",
        gone and collected and ok)


def own_world_env() -> dict[str, str]:
    """This process's environment for a child that starts its own process group: this process is a world of one
    already (RANK, MASTER_PORT, ... set), which the child must not join."""
    return {k: v for k, v in os.environ.items()
            if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}


def gapo_train(out: Path, nproc: int, dtype: str, *overrides: str) -> tuple[str, bool, Path]:
    """gapo-train on configs/tiny_cpu.yaml for 2 steps: (what happened, whether it passed, the run directory)."""
    import shutil

    run = out
    shutil.rmtree(run, ignore_errors=True)  # a previous check's run there would be resumed, its metrics appended to
    cmd = [sys.executable, "-m", "gapo.cli", "--config", "configs/tiny_cpu.yaml", "--nproc", str(nproc),
           f"trainer.output_dir={run}", f"model.dtype={dtype}", "trainer.total_steps=2", "tracking.mode=disabled",
           "rollout.compile=auto", *overrides]  # vLLM's own compile path, as users get it (tiny_cpu is eager)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=own_world_env(), cwd=ROOT)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] \
        if (run / "metrics.jsonl").exists() else []
    verified = [x for x in rows if "sync/probe_logprob_diff" in x]
    console = r.stdout + r.stderr
    ok = r.returncode == 0 and len(verified) == 2 and "Traceback" not in console
    return (f"exit {r.returncode}, {len(verified)} of 2 pushes verified"
            + ("" if ok else f"; console ends: {console[-600:]!r}")), ok, run


def train_run(state: dict) -> None:
    """gapo-train itself on every GPU of the node: the NCCL start (set_device before the first collective) and, with
    two or more GPUs, ZeRO-3's gather into vLLM; tiny-qwen2 is a GQA model (4 query, 2 KV heads)."""
    cpu_smoke = state["cpu_smoke"]
    n = 1 if cpu_smoke else torch.cuda.device_count()  # (2 CPU ranks: tests/test_sync.py, in make test-all)
    what, ok, _ = gapo_train(state["out"] / "train", n, "float32" if cpu_smoke else "bfloat16")
    stage = 3 if n > 1 else 0 if cpu_smoke else 1  # (one rank: fp32 stage 0, bf16 stage 1; Config.zero_stage)
    where = f"{n} {'CPU rank' if cpu_smoke else 'GPU'}{'s' if n > 1 else ''}, ZeRO-{stage}"
    row("gapo-train end to end", f"{where}: {what}", "exit 0, every push verified, no traceback", ok)
    if n < 2:
        skip("2-GPU start and ZeRO-3 gather into vLLM",
             f"needs two GPUs: one {'CPU rank (smoke)' if cpu_smoke else 'GPU on this node'}")
    else:
        row("2-GPU start and ZeRO-3 gather into vLLM", f"{n} GPUs: as the row above", "the row above passes", ok)


def recipe_overrides(path: Path, sleep: bool) -> list[str]:
    """The one-GPU recipe's own rollout and trainer settings as command-line overrides, read from the file so the row
    follows it; sleep mode off where vLLM refuses it (the CPU)."""
    from gapo.configfile import read_yaml

    raw = read_yaml(path.read_text())

    def flat(prefix: str, tree) -> list[str]:
        if isinstance(tree, dict):
            return [x for k, v in tree.items() for x in flat(f"{prefix}.{k}", v)]
        return [f"{prefix}={tree if isinstance(tree, str) else json.dumps(tree)}"]

    out = [x for section in ("rollout", "trainer") for x in flat(section, raw.get(section) or {})]
    if not any(x.startswith("rollout.sleep_between_steps=") for x in out) or \
            not any(x.startswith("trainer.offload.optimizer=") for x in out):
        raise ValueError(f"{path}: no rollout.sleep_between_steps or trainer.offload.optimizer: not the one-GPU "
                         "recipe this row checks")
    return [x for x in out if sleep or not x.startswith("rollout.sleep_between_steps=")] + \
        ([] if sleep else ["rollout.sleep_between_steps=false"])


def one_gpu_run(state: dict) -> None:
    """configs/qwen_math_1gpu.yaml's path on one GPU, at tiny size: the optimizer step on the host (ZeRO-2 offload),
    vLLM asleep while the actor trains, woken for the push."""
    from gapo.configfile import read_yaml

    cpu_smoke = state["cpu_smoke"]
    overrides = recipe_overrides(RECIPE, sleep=not cpu_smoke)
    what, ok, run = gapo_train(state["out"] / "one_gpu", 1, "float32" if cpu_smoke else "bfloat16", *overrides)
    resolved = read_yaml((run / "config.yaml").read_text()) if (run / "config.yaml").exists() else {}
    offload = resolved.get("trainer", {}).get("offload", {}).get("optimizer")
    slept = resolved.get("rollout", {}).get("sleep_between_steps")
    row("one-GPU recipe: optimizer offload, train, push", f"{' '.join(overrides)}: {what}; run's offload.optimizer "
        f"{offload}", "exit 0, every push verified, no traceback, the optimizer offloaded", ok and offload == "cpu")
    if cpu_smoke:
        skip("one-GPU recipe: sleep -> train -> wake -> push",
             "vLLM refuses sleep mode on the CPU (off in the run above)")
    else:  # GPU only; unverified on a GPU
        row("one-GPU recipe: sleep -> train -> wake -> push", f"run's sleep_between_steps {slept}",
            "the run above passed with sleep mode on", ok and slept is True)


STEPS = (
    Step(device_row, (("CUDA device", "a device torch can use"),), needs=lambda state: ""),
    Step(model_step, (("model shape", "the largest shape planned within the GPU"),)),
    Step(train_run, (("gapo-train end to end", "exit 0, every push verified, no traceback"),
                     ("2-GPU start and ZeRO-3 gather into vLLM", "the row above passes")), needs=needs_vllm),
    Step(one_gpu_run, (("one-GPU recipe: optimizer offload, train, push", "exit 0, every push verified"),
                       ("one-GPU recipe: sleep -> train -> wake -> push", "passed with sleep mode on")),
         needs=needs_vllm),
    Step(rl_step, (("rl step throughput", "a figure"), ("peak memory vs plan", "within 15 % above the plan"),
                   ("skipped steps", "0"), ("reward scoring errors", "0"),
                   ("first mini-batch IS deviation", "exactly 0"),
                   ("bf16 push probe difference", "every push verified")),
         needs=needs_model),
    Step(offload_step, (("offloaded optimizer: 2 steps, hf engine", "both steps applied"),
                        ("offloaded optimizer: peak GPU memory vs plan", "within 15 % above the plan"),
                        ("offloaded optimizer: peak host memory vs plan", "within 15 % above the plan")),
         needs=needs_model),
    Step(lora_step, (("LoRA gradient: merged forward under DeepSpeed vs plain torch", "within 1 %"),
                     ("LoRA gradient: DeepSpeed bf16 vs PEFT fp32", "within 6 %"))),
    Step(nan_step, (("NaN step skipped", "not applied, weights and lr unchanged"),), needs=needs_model),
    Step(vllm_cycle, (("vLLM generation, k = 8", "a figure"),
                      ("vLLM weight push into zeroed weights", "verified, the first tokens as before the reset"),
                      ("vLLM weight checksums after the push", "equal to those before the reset"),
                      ("vLLM sleep / wake", "the same tokens after the cycle"),
                      ("vLLM engine freed", "at-leave entry gone, model collected")), needs=vllm_needs),
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("/tmp/gapo_gpu_check"))
    ap.add_argument("--budget", type=float, default=0, metavar="S",
                    help="seconds: a step that would start later reads SKIP (the vLLM rows come first)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    ROWS.clear()
    if torch is not None:  # this process builds a vLLM engine, which keeps torch at 1 thread unless told otherwise
        from gapo.distributed import THREADS_WHY, share_cores

        share_cores(1)
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        print(f"threads: {torch.get_num_threads()} ({os.environ[THREADS_WHY]})", flush=True)
    cuda = torch is not None and torch.cuda.is_available()
    state: dict = {"cpu_smoke": args.cpu_smoke, "out": args.out, "budget": args.budget, "t0": time.monotonic()}
    if TORCH_MISSING:
        state["no_device"] = TORCH_MISSING
    elif args.cpu_smoke or cuda:
        state["no_device"] = ""
    else:
        state["no_device"] = "no CUDA device (--cpu-smoke runs these paths at toy size on the CPU)"
    if not state["no_device"]:
        state["no_vllm"] = vllm_missing(args.cpu_smoke)
    print(f"device: {torch.cuda.get_device_name() if cuda else 'CPU (--cpu-smoke)' if args.cpu_smoke else 'none'}, "
          f"torch {torch.__version__ if torch is not None else 'missing'}", flush=True)
    for step in STEPS:
        run_step(step, state)
    width = max(len(c) for _, c, *_ in ROWS)
    print("\n== gapo GPU check ==")
    for status, check, value, must in ROWS:
        print(f"{status}  {check:<{width}}  {value}   [{must}]")
    keys = ("status", "check", "value", "must")
    print("seconds: " + ", ".join(f"{name} {t:.0f}" for name, t in state.get("seconds", {}).items()))
    (args.out / "seconds.json").write_text(json.dumps(state.get("seconds", {})))
    (args.out / "check.json").write_text(json.dumps([dict(zip(keys, r, strict=True)) for r in ROWS]))
    return 1 if any(status == "FAIL" for status, *_ in ROWS) else 0


if __name__ == "__main__":
    sys.exit(main())
