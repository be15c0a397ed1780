"""Engine start-up against generation speed, for each way vLLM can compile the model on this CPU.

    .venv/bin/python bench/startup.py [--reps 3] [--model smollm2-135m] [--modes cache,aot,eager]

vLLM 0.32 compiles the model with torch.compile when its engine starts. On CPU it compiles with torch's stock
inductor backend, and its ahead-of-time (AOT) artifacts, on by default under torch >= 2.10, then fail to load
('function' object has no attribute 'finalize_loading': the loader expects vLLM's own backend), so with the
default every start compiles again. The candidates (`rollout.compile`):

- aot: vLLM's default (VLLM_USE_AOT_COMPILE=1): writes AOT artifacts it cannot read back on CPU;
- cache: VLLM_USE_AOT_COMPILE=0: dynamo traces at every start and inductor reuses its on-disk graph cache;
- eager: no torch.compile at all (enforce_eager): no compile time, slower generation.

Each candidate runs in a fresh process twice: cold (empty vLLM and inductor caches in a temporary directory)
and warm (the same caches again), alternating between candidates. Per run: the engine's build time and the
generation rate on a fixed workload (8 arithmetic prompts x 8 samples x 64 tokens, EOS ignored, one warm-up
round, then the median of --reps rounds). Last, what a start plus `make demo`'s generation would cost per
candidate (the demo generates about DEMO_TOKENS tokens: 12 steps x 64 rollouts x ~30 tokens and two
validations of 200 x 4 samples), which is how the default was chosen. Prints the CPU it ran on first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _util import cpu_line, median

MODES = {"cache": {"VLLM_USE_AOT_COMPILE": "0"}, "aot": {"VLLM_USE_AOT_COMPILE": "1"}, "eager": {}}
DEMO_TOKENS = 12 * 64 * 30 + 2 * 200 * 4 * 30  # make demo's generated tokens, about (see the docstring)


def child(mode: str, model: str, reps: int) -> None:
    """One engine start and its generation rate, as a JSON line on stdout."""
    tic = time.perf_counter()
    from gapo.data import arithmetic_problems, build_prompt_ids
    from gapo.distributed import init_distributed
    from gapo.models import resolve_model
    from gapo.rollout.engine import build_engine

    init_distributed()
    model_dir = str(resolve_model(model))
    imported = time.perf_counter() - tic
    tic = time.perf_counter()
    engine = build_engine("vllm", model_dir, dtype="float32", seed=0, max_model_len=192, compile=mode)
    build = time.perf_counter() - tic
    from vllm import SamplingParams

    tok = engine.tokenizer
    problems = arithmetic_problems(8, seed=7, levels=["add_small", "add_2digit", "sub_2digit", "mul_small"])
    prompts = [build_prompt_ids(tok, p, "Put the final answer in \\boxed{}.") for p in problems]
    rates = []
    for rep in range(reps + 1):  # the first round is warm-up
        params = [SamplingParams(n=8, temperature=1.0, max_tokens=64, ignore_eos=True, seed=1000 * rep + i)
                  for i in range(len(prompts))]
        tic = time.perf_counter()
        outs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        n = sum(len(c.token_ids) for o in outs for c in o.outputs)
        if rep:
            rates.append(n / (time.perf_counter() - tic))
    print(json.dumps({"mode": mode, "import_s": imported, "build_s": build, "tokens_per_s": median(rates)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.model, args.reps)
    modes = args.modes.split(",")
    print(cpu_line(), flush=True)
    results: dict[tuple[str, str], dict] = {}
    with tempfile.TemporaryDirectory(prefix="gapo-startup-") as tmp:
        for phase in ("cold", "warm"):
            for mode in modes:
                cache = Path(tmp) / mode
                env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "VLLM_CACHE_ROOT": str(cache / "vllm"),
                       "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), **MODES[mode]}
                tic = time.perf_counter()
                out = subprocess.run([sys.executable, __file__, "--child", mode, "--model", args.model,
                                      "--reps", str(args.reps)], env=env, capture_output=True, text=True)
                if out.returncode:
                    raise SystemExit(f"{mode} ({phase}) failed:\n{out.stderr[-3000:]}")
                res = json.loads(out.stdout.strip().splitlines()[-1])
                res["process_s"] = time.perf_counter() - tic
                results[(mode, phase)] = res
                print(f"{phase:4} {mode:5}: imports {res['import_s']:5.1f} s, engine build {res['build_s']:6.1f} s, "
                      f"generation {res['tokens_per_s']:6.0f} tokens/s (process {res['process_s']:.0f} s)", flush=True)
    print(f"\n== vLLM start-up vs generation ({args.model} fp32, CPU; {cpu_line()}) ==")
    base = results.get(("aot", "warm"))
    for mode in modes:
        cold, warm = results[(mode, "cold")], results[(mode, "warm")]
        demo = warm["build_s"] + DEMO_TOKENS / warm["tokens_per_s"]
        rel = f", tokens/s {warm['tokens_per_s'] / base['tokens_per_s']:.2f}x of aot" if base else ""
        print(f"{mode:5}: build cold {cold['build_s']:6.1f} s, warm {warm['build_s']:6.1f} s; generation "
              f"{warm['tokens_per_s']:.0f} tokens/s{rel}; warm build + make demo's ~{DEMO_TOKENS} tokens "
              f"{demo:.0f} s")


if __name__ == "__main__":
    main()
