"""gapo-eval: pass@k of a model, or of a run's checkpoints, on benchmarks (vLLM). The command line, its --config (a
paper table's protocol) settings and its table; what it shares with validation inside training (benchmarks, sampling
seeds, pass@k over a benchmark, a checkpoint's weights) is gapo.evaluation, below the trainer and this wing alike.
Benchmark specs (`name[@START:END][=path]`) are described there.

`gapo-eval --config <config>` takes the benchmarks and sampling settings of a paper table from that
config's `eval.protocol` (see EvalConfig.Protocol), so the reported numbers do not depend on remembered flags.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import NamedTuple, get_args

import yaml
from pydantic import ValidationError

from gapo import console, rundir
from gapo.config import CompileMode, DataConfig, Dtype, EngineKind, RewardConfig
from gapo.configfile import OVERRIDE, load_config, read_yaml, upgrade
from gapo.errors import ConfigError, Exit
from gapo.evaluation import (
    Bench,
    BenchResult,
    averaged,
    checkpoint_weights,
    context_length,
    evaluate,
    load_benchmark,
    summary,
    write_results,
)
from gapo.proc import die_with_parent
from gapo.reward.ifeval import METRIC_NAMES


def table(results: list[BenchResult]) -> str:
    ks = list(results[0].pass_at()) if results else []
    head = f"{'benchmark':<16}{'problems':>9}" + "".join(f"{'pass@' + str(k):>10}" for k in ks)
    rows = [head, "-" * len(head)]
    for r in results:
        rows.append(f"{r.name:<16}{len(r.correct):>9}" + "".join(f"{100 * v:>9.1f}%" for v in r.pass_at().values()))
    if len(averaged(results)) > 1:
        mean = summary(results)
        label = "mean" if len(averaged(results)) == len(results) else "mean (no ifeval)"
        rows.append(f"{label:<16}{'':>9}" + "".join(f"{100 * mean[f'val/mean/pass@{k}']:>9.1f}%" for k in ks))
    for r in results:
        if r.dropped:
            rows.append(f"{r.name}: {sum(r.dropped.values())} record(s) left out, not scored: "
                        + ", ".join(f"{k} {v}" for k, v in r.dropped.items()))
    for r in results:
        if r.extra:
            parts = [f"{METRIC_NAMES.get(k, k)} {100 * v:.1f}%" for k, v in r.extra.items()]
            rows.append(f"{r.name}: {', '.join(parts)} (pass@1 = prompt-level strict)")
    return "\n".join(rows)


def resolve_eval_model(path: str) -> Path:
    """An HF model directory, a gapo checkpoint (its hf/ export), a run directory (its latest checkpoint), a
    built-in name or a Hugging Face hub id (the Base columns of Tables 1 and 2), downloaded once; a path that is
    none of these gets an error naming what was tried."""
    from gapo.models import BUILTIN, resolve_model

    p = Path(path).expanduser()
    if path in BUILTIN or (p / "config.json").is_file():
        return resolve_model(path)
    if p.exists():
        return rundir.find(p, "--model") / "hf"
    if path.count("/") == 1 and not path.startswith((".", "/", "~")):
        return resolve_model(path)  # a hub id: downloaded once, or an error naming the id and the cause
    raise ConfigError(f"--model {path}: no such directory, and not a built-in model ({', '.join(BUILTIN)}) or a "
                      "Hugging Face id (owner/name); expected an HF model directory, a gapo run or checkpoint "
                      "directory, a built-in name or a hub id")


# What gapo-eval uses for a setting that neither its command line nor a --config gives.
FALLBACK = {"n": 16, "temperature": 0.6, "top_p": 1.0, "max_new_tokens": 3072}
PROTOCOL_KEYS = ("benchmarks", "n", "temperature", "top_p", "max_new_tokens")


def apply_protocol(args: argparse.Namespace) -> str | None:
    """Fill each setting the command line left unset (None) from the `eval.protocol` of the config named by
    --config, else from FALLBACK; flags given explicitly win. Returns a line saying what came from where
    (None without --config)."""
    note = None
    overrides = getattr(args, "overrides", [])
    if overrides and not args.protocol:
        raise ConfigError(f"{overrides[0]}: a key.path=value setting applies to the --config it follows; give "
                          "--config NAME, or set gapo-eval's own flags (--n, --temperature, ...)")
    if args.protocol:
        p = load_config(args.protocol, overrides).eval.protocol
        if p is None:
            raise ConfigError(f"--config {args.protocol}: the config has no eval.protocol section (the paper configs "
                              "qwen_math, llama_math, r1_distill_math and deepcoder have one)")
        given = [k for k in PROTOCOL_KEYS if getattr(args, k) is not None]
        for k in PROTOCOL_KEYS:
            if getattr(args, k) is None:
                value = getattr(p, k)
                setattr(args, k, ",".join(value) if k == "benchmarks" else value)
        note = (f"protocol {args.protocol} ({p.table}): " + ", ".join(f"{k}={getattr(args, k)}" for k in PROTOCOL_KEYS)
                + (f"; from the command line: {', '.join(given)}" if given else ""))
    if args.benchmarks is None:
        raise ConfigError("give --benchmarks, or --config CONFIG to take them from a paper config")
    for k, v in FALLBACK.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return note


def _number(kind: type, lo: float, hi: float = math.inf, lo_open: bool = False):
    """An argparse type: a `kind` number within [lo, hi] ((lo, hi] with lo_open), checked before any engine starts."""
    def parse(text: str):
        try:
            x = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") \
                from None
        if not math.isfinite(x):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text}")
        if not (lo < x <= hi if lo_open else lo <= x <= hi):
            raise argparse.ArgumentTypeError(f"expected {'more than' if lo_open else 'at least'} {lo:g}"
                                             + (f" and at most {hi:g}" if hi < math.inf else "") + f", got {text}")
        return x
    return parse


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="gapo-eval", description="pass@k of a model on benchmarks (vLLM).",
        epilog="Each of --benchmarks, --n, --temperature, --top-p, --max-new-tokens comes from the flag when given, "
               "else from the --config config's eval.protocol (a paper table's settings), else from the default "
               "shown. Example: gapo-eval --model runs/qwen_math/gapo/seed0 --config qwen_math (Table 3). "
               "key.path=value words set the --config's fields as on gapo-train's command line (eval.protocol.n=64).")
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--run", metavar="RUN_DIR", nargs="+",
                       help="evaluate these runs' checkpoints (--steps), one after another under one engine (runs of "
                            "one model architecture), results in RUN_DIR/eval/NAME/step_N/, skipping steps done")
    which.add_argument("--model", help="HF model dir, gapo checkpoint or run dir, a built-in name, or a "
                                                   "Hugging Face hub id (e.g. Qwen/Qwen2.5-Math-1.5B)")
    ap.add_argument("--config", "--protocol", dest="protocol", default=None, metavar="CONFIG",
                    help="a config (name in configs/ or path), as gapo-train takes it, whose eval.protocol gives the "
                         "benchmarks and sampling of its paper table: qwen_math, llama_math (Table 3), "
                         "r1_distill_math (Table 1), deepcoder (Table 2); --protocol is its older spelling")
    ap.add_argument("--benchmarks", default=None,
                    help="comma-separated specs name[@START:END][=path] (see gapo.evaluation); default: the "
                         "protocol's")
    ap.add_argument("--n", type=_number(int, 1), default=None,
                    help=f"samples per problem (pass@k for k = 1, 2, 4, ... <= n); default: the protocol's, "
                         f"else {FALLBACK['n']}")
    ap.add_argument("--temperature", type=_number(float, 0), default=None,
                    help=f"default: the protocol's, else {FALLBACK['temperature']}")
    ap.add_argument("--top-p", type=_number(float, 0, 1, lo_open=True), default=None,
                    help=f"default: the protocol's, else {FALLBACK['top_p']}")
    ap.add_argument("--max-new-tokens", type=_number(int, 1), default=None,
                    help=f"default: the protocol's, else {FALLBACK['max_new_tokens']}")
    ap.add_argument("--instruction", default=None,
                    help="appended to each problem (default: by benchmark kind; never to IFEval's prompts)")
    ap.add_argument("--limit", type=_number(int, 1), default=None, help="first N problems of each benchmark")
    ap.add_argument("--engine", choices=get_args(EngineKind), default="vllm")
    ap.add_argument("--steps", default="last", help="with --run: comma-separated checkpoint steps, 'last' or 'all'")
    ap.add_argument("--name", default=None, help="with --run: the results' folder under eval/ (default: the --config "
                                                 "config's name, else 'custom')")
    ap.add_argument("--dtype", choices=get_args(Dtype), default=None,
                    help="default: the run's model.dtype with --run, else bfloat16")
    ap.add_argument("--compile", choices=get_args(CompileMode), default="auto",
                    help="vLLM's compile mode (rollout.compile)")
    ap.add_argument("--seed", type=int, default=None,
                    help="sampling seed (every problem's requests derive theirs from it); default: with --run each "
                         "run's own trainer.seed, so that runs of different seeds draw independent samples, as their "
                         "validation during training did; else 0")
    ap.add_argument("--workers", type=_number(int, 1), default=2, help="reward worker processes")
    ap.add_argument("--out", default=None, help="directory for results.json and per_problem.jsonl")
    ap.add_argument("--verbose", action="store_true",
                    help="show every library's output on the console (by default it goes to a log beside the results: "
                         "<run>/eval/NAME/eval.log, --out DIR's DIR.log; without --out, a temporary file that a "
                         "successful evaluation removes)")
    return ap


def main(argv: list[str] | None = None) -> int:
    die_with_parent()  # started by gapo-sweep --eval: it ends with the sweep
    argv = sys.argv[1:] if argv is None else list(argv)
    # key.path=value: settings of the --config (eval.protocol.n=8), taken out before the run folders are read
    args = parser().parse_args([a for a in argv if not OVERRIDE.match(a)])
    args.overrides = [a for a in argv if OVERRIDE.match(a)]
    try:
        note = apply_protocol(args)
        if note:
            print(f"gapo-eval: {note}", file=sys.stderr)
        if args.run:
            jobs = []
            for run in args.run:
                todo = run_jobs(args, Path(run))
                if not todo:
                    print(f"gapo-eval: {run}: every requested step is evaluated already", file=sys.stderr)
                jobs += todo
            if not jobs:
                return 0
        else:
            reward = RewardConfig(num_workers=args.workers)
            done = Path(args.out) / "results.json" if args.out else None
            if done and done.is_file() and rundir.read_results(done, "meta").get("settings") == \
                    settings(args, args.seed or 0, args.instruction, reward):
                print(f"gapo-eval: {done} holds this evaluation already", file=sys.stderr)
                return 0
            jobs = [Job(Path(args.out) if args.out else None, resolve_eval_model(args.model), args.seed or 0,
                        args.instruction, reward, None)]
        specs = [s.strip() for s in args.benchmarks.split(",") if s.strip()]
        benches: dict[str, list[Bench]] = {}  # runs of one data config score the same problems
        for job in jobs:
            if data_key(job) not in benches:
                benches[data_key(job)] = [load_benchmark(s, args.limit, job.data) for s in specs]
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        from transformers import AutoTokenizer

        model_dir = jobs[0].hf
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        positions = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings")
        context = max(context_length(benches[data_key(job)], tokenizer, job.instruction, args.max_new_tokens,
                                     positions) for job in jobs)
    except ConfigError as err:
        print(f"gapo-eval: {err}", file=sys.stderr)
        return Exit.CONFIG
    if not args.verbose:  # vLLM's and DeepSpeed's output to a log, as gapo-train's to train.log
        console.capture()
        # Beside the results, which replace their folder whole: --run's steps share one log, --out DIR gets DIR.log.
        if jobs[0].out is not None:
            out = jobs[0].out
            log = console.attach(out.parent, "eval.log" if args.run else f"{out.name}.log")
            console.say(f"gapo-eval: library output in {log}")
    from gapo.distributed import init_distributed, leave_distributed
    from gapo.rollout.engine import build_engine

    init_distributed()
    engine = build_engine(args.engine, str(model_dir), dtype=args.dtype or "bfloat16", seed=args.seed or 0,
                          max_model_len=context, compile=args.compile)
    for i, job in enumerate(jobs):
        if i:  # the next checkpoint of the run: its weights into the same engine, as training pushes them
            engine.push_weights(checkpoint_weights(job.hf), version=i)
        results = evaluate(engine, tokenizer, benches[data_key(job)], n=args.n, temperature=args.temperature,
                           top_p=args.top_p, max_new_tokens=args.max_new_tokens, instruction=job.instruction,
                           reward=job.reward, seed=job.seed)
        console.result(f"{job.hf}:\n{table(results)}" if args.run else table(results))
        if job.out is not None:
            write_results(results, job.out, {**vars(args), "seed": job.seed, "instruction": job.instruction,
                                             "model": str(job.hf),
                                             "settings": settings(args, job.seed, job.instruction, job.reward)})
            console.result(f"wrote {job.out}/results.json and per_problem.jsonl")
    leave_distributed()
    return 0


def settings(args: argparse.Namespace, seed: int, instruction: str | None, reward: RewardConfig) -> dict:
    """What makes two evaluations of one checkpoint the same: a rerun with these skips the step."""
    return {**{k: getattr(args, k) for k in ("benchmarks", "n", "temperature", "top_p", "max_new_tokens", "limit")},
            "instruction": instruction, "seed": seed, "reward": reward.model_dump(exclude={"num_workers"})}


class Job(NamedTuple):
    out: Path | None  # results directory
    hf: Path  # the model
    seed: int  # sampling seed
    instruction: str | None  # appended to each problem (None: the benchmark kind's)
    reward: RewardConfig
    data: DataConfig | None  # the run's: its arithmetic set is held out of the arithmetic benchmark


def data_key(job: Job) -> str:
    """Which benchmarks a job scores: those of its run's data config (the arithmetic set it holds out)."""
    return job.data.model_dump_json() if job.data else ""


def run_jobs(args: argparse.Namespace, run: Path) -> list[Job]:
    """Each requested checkpoint of a run still to evaluate, in step order. The prompt's instruction and the
    rewarder's settings (reward.math_last_number_fallback, ...) are the run's own, as its validation during training
    used them, unless --instruction is given: a run is scored the way it was trained to answer."""
    found = rundir.checkpoints(run)
    if not found:
        raise ConfigError(f"--run {run}: no complete checkpoint in {run / rundir.CHECKPOINTS}")
    if args.steps == "all":
        steps = sorted(found)
    elif args.steps == "last":
        steps = [max(found)]
    else:
        try:
            steps = sorted({int(x) for x in args.steps.split(",")})
        except ValueError:
            raise ConfigError(f"--steps {args.steps!r}: expected comma-separated steps, 'last' or 'all'") from None
        missing = [x for x in steps if x not in found]
        if missing:
            raise ConfigError(f"--run {run}: no checkpoint of step {', '.join(map(str, missing))} (kept: "
                              f"{', '.join(map(str, sorted(found)))}; trainer.keep_steps / keep_every keep a step "
                              "from pruning)")
    where = found[steps[0]] / rundir.CONFIG
    try:
        saved = read_yaml(where.read_text())
        dtype, run_seed = saved["model"]["dtype"], int(saved["trainer"]["seed"])
        upgrade(saved)  # a run trained by an earlier gapo
    except (OSError, ValueError, TypeError, KeyError, yaml.YAMLError) as err:
        raise ConfigError(f"--run {run}: {where} cannot be read as the run's config ({type(err).__name__}: {err}); "
                          "a checkpoint that gapo-train wrote has it") from None
    if args.dtype is None:
        args.dtype = dtype
    seed = args.seed if args.seed is not None else run_seed
    instruction = args.instruction if args.instruction is not None else (
        (saved.get("eval") or {}).get("instruction") or (saved.get("data") or {}).get("instruction"))
    try:
        reward = RewardConfig(**{**(saved.get("reward") or {}), "num_workers": args.workers})
        data = DataConfig.model_validate(saved.get("data") or {})
    except ValidationError as err:
        raise ConfigError(f"{where}: its reward or data section does not load: {err}") from None
    name = args.name or (Path(args.protocol).stem if args.protocol else "custom")
    jobs = []
    for step in steps:
        out = run / rundir.EVAL / name / rundir.step_name(step)
        done = out / "results.json"
        if done.is_file():
            had = rundir.read_results(done, "meta").get("settings")
            if had == settings(args, seed, instruction, reward):
                continue
            raise ConfigError(f"{done} was evaluated with other settings ({had}); give --name to keep both, or "
                              "remove it to evaluate again")
        jobs.append(Job(out, found[step] / "hf", seed, instruction, reward, data))
    return jobs




if __name__ == "__main__":
    sys.exit(main())
