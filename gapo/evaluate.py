"""Evaluation: pass@k on benchmarks, per-problem solve rates for coverage, with the rollout engine.

The same `evaluate()` runs standalone (`gapo-eval`) and as validation inside training, so a number in
the training log and a number from gapo-eval on the saved checkpoint mean the same thing.

A benchmark is a name from BENCHMARKS (loaded from Hugging Face, or from `$GAPO_DATA_DIR/<file>` when
that file exists, e.g. GAPO_DATA_DIR=../shared/data), `arithmetic` (a held-out generated set disjoint
from the default training set), or `name=path` for any JSON/JSONL/parquet file with the math fields
problem/answer (or code fields problem/tests when the name is a code benchmark).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from tqdm import tqdm

from gapo.config import ConfigError, RewardConfig
from gapo.data import Problem, arithmetic_problems, build_prompt_ids, load_problems, stop_token_ids
from gapo.metrics import coverage, pass_at_k
from gapo.reward.registry import score_groups
from gapo.rollout.types import SamplingConfig

MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


@dataclass(frozen=True)
class Benchmark:
    hf_id: str  # Hugging Face dataset id (unverified from here: no hub access on our machines)
    split: str
    file: str  # the same set as a local file under $GAPO_DATA_DIR
    kind: str = "math"
    prompt_key: str = "problem"
    answer_key: str = "answer"


BENCHMARKS = {
    "aime24": Benchmark("HuggingFaceH4/aime_2024", "train", "math/aime24.json"),
    "aime25": Benchmark("yentinglin/aime_2025", "train", "math/aime25.json"),
    "amc": Benchmark("AI-MO/aimo-validation-amc", "train", "math/amc.json"),
    "math500": Benchmark("HuggingFaceH4/MATH-500", "test", "math/math500.json"),
    "minerva": Benchmark("math-ai/minervamath", "test", "math/minerva.json"),
    "olympiad_bench": Benchmark("Hothan/OlympiadBench", "train", "math/olympiad_bench.json"),
    "livecodebench": Benchmark("livecodebench/code_generation_lite", "test", "code/livecodebench.json", "code",
                               answer_key="tests"),
    "humaneval_plus": Benchmark("evalplus/humanevalplus", "test", "code/humaneval_plus.json", "code",
                                prompt_key="prompt", answer_key="test"),
    "leetcode": Benchmark("newfacade/LeetCodeDataset", "test", "code/leetcode.json", "code", answer_key="tests"),
    "codeforces": Benchmark("", "", "code/codeforces.json", "code", answer_key="tests"),
    "code_contests": Benchmark("deepmind/code_contests", "test", "code/code_contests.json", "code",
                               answer_key="tests"),
}


def load_benchmark(spec: str, limit: int | None = None, exclude: set[str] | None = None,
                   levels: list[str] | None = None, *, data_dir: str | Path | None = None
                   ) -> tuple[str, str, list[Problem]]:
    """(name, kind, problems) for `name`, `name=path` or `arithmetic` (problems of `levels`, held out from
    `exclude`, by default from the default training set). A named benchmark is read from `data_dir`
    (default: $GAPO_DATA_DIR) when its file is there, else from Hugging Face."""
    name, _, path = spec.partition("=")
    known = BENCHMARKS.get(name)
    kind = known.kind if known else "math"
    keys = {"prompt_key": known.prompt_key, "answer_key": known.answer_key} if known else {}
    if name == "arithmetic" and not path:
        if exclude is None:
            exclude = {p.question for p in arithmetic_problems(2000, seed=1234)}  # the default training set
        problems = arithmetic_problems(limit or 200, seed=4242, exclude=exclude, levels=levels)
    elif path:
        problems = load_problems(path, **keys)
    elif known:
        problems = _load_named(name, known, data_dir or os.environ.get("GAPO_DATA_DIR"), keys)
    else:
        raise ConfigError(f"unknown benchmark {name!r}: use one of {', '.join([*BENCHMARKS, 'arithmetic'])} "
                          "or name=path/to/file.jsonl")
    return name, kind, problems[:limit] if limit else problems


def _load_named(name: str, known: Benchmark, data_dir: str | Path | None, keys: dict) -> list[Problem]:
    """The local file under `data_dir` if it is there, else the Hugging Face dataset. When neither works the
    error names both places tried and both ways to provide the data, because "dataset not loadable" alone
    does not tell an offline user that a local file would have done."""
    local = Path(data_dir).expanduser() / known.file if data_dir else None
    if local is not None and local.is_file():
        return load_problems(str(local), **keys)
    tried_local = f"no file {local}" if local else f"GAPO_DATA_DIR is unset (so no local {known.file})"
    provide = (f"set GAPO_DATA_DIR to a directory holding {known.file}, or pass the file as {name}=PATH "
               "(JSON, JSONL or parquet)")
    if not known.hf_id:
        raise ConfigError(f"benchmark {name!r}: {tried_local}, and it has no Hugging Face dataset; {provide}")
    try:
        return load_problems(known.hf_id, split=known.split, **keys)
    except ConfigError as err:
        raise ConfigError(f"benchmark {name!r}: {tried_local}, and loading the Hugging Face dataset "
                          f"{known.hf_id!r} (split {known.split!r}) failed: {err}; {provide}") from None


@dataclass
class BenchResult:
    name: str
    n: int
    correct: list[int]  # per problem, out of n
    uids: list[str]
    statuses: dict[str, int]

    def pass_at(self) -> dict[int, float]:
        ks = [2**i for i in range(int(math.log2(self.n)) + 1)]
        return {k: sum(pass_at_k(self.n, c, k) for c in self.correct) / len(self.correct) for k in ks}


def evaluate(engine, tokenizer, benches: list[tuple[str, str, list[Problem]]], *, n: int, temperature: float,
             top_p: float, max_new_tokens: int, instruction: str | None, reward: RewardConfig, seed: int = 0,
             progress: bool = True) -> list[BenchResult]:
    """Every rank scores its share of each benchmark (problem i goes to rank i % world); results are gathered."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    sampling = SamplingConfig(n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                              stop_token_ids=stop_token_ids(tokenizer))
    out = []
    for name, kind, problems in tqdm(benches, desc="eval", disable=not progress or rank != 0):
        mine = list(range(rank, len(problems), world))
        instr = instruction if instruction is not None else (MATH_INSTRUCTION if kind == "math" else "")
        prompts = [build_prompt_ids(tokenizer, problems[i], instr) for i in mine]
        groups = engine.generate(prompts, sampling, seeds=[seed * 1_000_003 + i for i in mine]) if mine else []
        scored = score_groups(kind, [[x.text for x in g] for g in groups], [problems[i] for i in mine], reward)
        local = {i: [r.status for r in res] for i, res in zip(mine, scored, strict=True)}
        if world > 1:
            parts = [None] * world
            dist.all_gather_object(parts, local)
            local = {k: v for p in parts for k, v in p.items()}
        statuses: dict[str, int] = {}
        for s in (s for i in range(len(problems)) for s in local[i]):
            statuses[s] = statuses.get(s, 0) + 1
        out.append(BenchResult(name, n, [local[i].count("correct") for i in range(len(problems))],
                               [p.uid for p in problems], statuses))
    return out


def summary(results: list[BenchResult], threshold: float = 0.05) -> dict[str, float]:
    """Flat metrics: val/<bench>/pass@k, val/<bench>/coverage, and the mean over benchmarks."""
    m: dict[str, float] = {}
    for r in results:
        for k, v in r.pass_at().items():
            m[f"val/{r.name}/pass@{k}"] = v
        m[f"val/{r.name}/coverage"] = coverage([c / r.n for c in r.correct], threshold)
    if results:
        for k in results[0].pass_at():
            m[f"val/mean/pass@{k}"] = sum(m[f"val/{r.name}/pass@{k}"] for r in results) / len(results)
    return m


def write_results(results: list[BenchResult], out: Path, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "metrics": summary(results),
                                                  "statuses": {r.name: r.statuses for r in results}}, indent=1))
    with open(out / "per_problem.jsonl", "w") as f:
        for r in results:
            for uid, c in zip(r.uids, r.correct, strict=True):
                f.write(json.dumps({"benchmark": r.name, "uid": uid, "correct": c, "n": r.n,
                                    "solve_rate": c / r.n}) + "\n")


def table(results: list[BenchResult]) -> str:
    ks = list(results[0].pass_at()) if results else []
    head = f"{'benchmark':<16}{'problems':>9}" + "".join(f"{'pass@' + str(k):>10}" for k in ks)
    rows = [head, "-" * len(head)]
    for r in results:
        rows.append(f"{r.name:<16}{len(r.correct):>9}" + "".join(f"{100 * v:>9.1f}%" for v in r.pass_at().values()))
    if len(results) > 1:
        mean = summary(results)
        rows.append(f"{'mean':<16}{'':>9}" + "".join(f"{100 * mean[f'val/mean/pass@{k}']:>9.1f}%" for k in ks))
    return "\n".join(rows)


def resolve_eval_model(path: str) -> Path:
    """An HF model directory, a gapo checkpoint (its hf/ export), or a run directory (its latest checkpoint)."""
    p = Path(path)
    if (p / "config.json").is_file():
        return p
    from gapo.trainer.checkpoint import find

    return find(p) / "hf"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gapo-eval", description="pass@k of a model on benchmarks (vLLM).")
    ap.add_argument("--model", required=True, help="HF model dir, gapo checkpoint dir, run dir, or a built-in name")
    ap.add_argument("--benchmarks", required=True, help="comma-separated names or name=path (see gapo.evaluate)")
    ap.add_argument("--n", type=int, default=16, help="samples per problem (pass@k for k = 1, 2, 4, ... <= n)")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=3072)
    ap.add_argument("--instruction", default=None, help="appended to each problem (default: by benchmark kind)")
    ap.add_argument("--limit", type=int, default=None, help="first N problems of each benchmark")
    ap.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2, help="reward worker processes")
    ap.add_argument("--out", default=None, help="directory for results.json and per_problem.jsonl")
    args = ap.parse_args(argv)
    try:
        from gapo.models import BUILTIN, resolve_model

        model_dir = resolve_model(args.model) if args.model in BUILTIN else resolve_eval_model(args.model)
        benches = [load_benchmark(s.strip(), args.limit) for s in args.benchmarks.split(",") if s.strip()]
    except ConfigError as err:
        print(f"gapo-eval: {err}", file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from transformers import AutoTokenizer

    from gapo.trainer.loop import build_engine, init_distributed

    init_distributed()
    max_pos = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings", 1 << 20)
    engine = build_engine(args.engine, str(model_dir), dtype=args.dtype, seed=args.seed,
                          max_model_len=min(max_pos, 4096 + args.max_new_tokens))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    results = evaluate(engine, tokenizer, benches, n=args.n, temperature=args.temperature, top_p=args.top_p,
                       max_new_tokens=args.max_new_tokens, instruction=args.instruction,
                       reward=RewardConfig(num_workers=args.workers), seed=args.seed)
    print(table(results))
    if args.out:
        write_results(results, Path(args.out), {**vars(args), "model": str(model_dir)})
        print(f"wrote {args.out}/results.json and per_problem.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
