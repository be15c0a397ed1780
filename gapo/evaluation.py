"""Evaluation: pass@k on benchmarks, per-problem solve rates for coverage, with the rollout engine. What validation
inside training and gapo-eval share, below both: the trainer and the study wing (gapo.study.eval, gapo-eval's
command line) stand on this module, so a number in the training log and a number from gapo-eval on the saved
checkpoint mean the same thing.

A benchmark spec is `name[@START:END][=path]`:
- `name` from BENCHMARKS (loaded from Hugging Face, or from `$GAPO_DATA_DIR/<file>` when that file exists,
  e.g. GAPO_DATA_DIR=../shared/data), or `arithmetic` (a held-out generated set disjoint from the default
  training set);
- `=path`: any JSON/JSONL/parquet file with the math fields problem/answer (code: problem/tests; ifeval:
  Google's key/prompt/instruction_id_list/kwargs), scored by the kind of `name`;
- `@START:END` (dates YYYY-MM-DD, either side may be empty): only the records whose `contest_date` lies in
  the window, both ends included and compared as LiveCodeBench's own --start_date/--end_date compare them
  (the end date at 00:00), so `livecodebench@2024-08-01:2025-02-01` is the problem set LiveCodeBench's runner
  evaluates for that window: the paper's LCB-v5 (Table 2).

A benchmark's kind is a row of the rewarder table (gapo.reward.registry.REWARDERS): it says how records are
checked and scored, which metrics the benchmark adds to pass@k, what is appended to its prompts, and whether
val/mean counts it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import zlib
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

from gapo.config import Config, DataConfig, RewardConfig
from gapo.data import Dropped, Problem, arithmetic_problems, build_prompt_ids, load_problems, stop_token_ids
from gapo.distributed import gather
from gapo.errors import ConfigError
from gapo.metrics import coverage, pass_at_k
from gapo.reward.registry import REWARDERS, check_problems, dropped_summary, rewarder, score_groups
from gapo.rollout.types import SamplingConfig

if TYPE_CHECKING:  # torch loads with the engine, not with the names' check (gapo-train's answers before the imports)
    from gapo.rollout.engine import Engine

log = logging.getLogger("gapo.evaluation")


@dataclass(frozen=True)
class Benchmark:
    hf_id: str  # Hugging Face dataset id (unverified from here: no hub access on our machines)
    split: str
    file: str  # the same set as a local file under $GAPO_DATA_DIR
    kind: str = "math"  # a key of the rewarder table (gapo.reward.registry.REWARDERS)
    prompt_key: str = "problem"
    answer_key: str = "answer"
    subset: str | None = None  # the hub dataset's configuration
    window: str | None = None  # "START:END" when the named set is already cut to that date window

    def __post_init__(self) -> None:
        if self.kind not in REWARDERS:
            raise ValueError(f"benchmark kind {self.kind!r} is not a kind of the rewarder table "
                             f"({', '.join(REWARDERS)})")


BENCHMARKS = {
    "aime24": Benchmark("HuggingFaceH4/aime_2024", "train", "math/aime24.json"),
    "aime25": Benchmark("yentinglin/aime_2025", "train", "math/aime25.json"),
    "amc": Benchmark("AI-MO/aimo-validation-amc", "train", "math/amc.json"),
    "math500": Benchmark("HuggingFaceH4/MATH-500", "test", "math/math500.json"),
    "minerva": Benchmark("math-ai/minervamath", "test", "math/minerva.json"),
    "olympiad_bench": Benchmark("Hothan/OlympiadBench", "train", "math/olympiad_bench.json"),
    # LiveCodeBench v5 as DeepCoder evaluated it (its lcbv5 test split: 2024-08-01..2025-02-01, tests decoded;
    # livecodebench/code_generation_lite keeps its private tests compressed and pickled).
    "livecodebench": Benchmark("agentica-org/DeepCoder-Preview-Dataset", "test", "code/livecodebench.json", "code",
                               answer_key="tests", subset="lcbv5", window="2024-08-01:2025-02-01"),
    "humaneval_plus": Benchmark("evalplus/humanevalplus", "test", "code/humaneval_plus.json", "code",
                                prompt_key="prompt", answer_key="test"),
    "leetcode": Benchmark("newfacade/LeetCodeDataset", "test", "code/leetcode.json", "code", answer_key="tests"),
    "codeforces": Benchmark("", "", "code/codeforces.json", "code", answer_key="tests"),
    "code_contests": Benchmark("deepmind/code_contests", "test", "code/code_contests.json", "code",
                               answer_key="tests"),
    # Google's 541 prompts (google-research/instruction_following_eval, data/input_data.jsonl).
    "ifeval": Benchmark("google/IFEval", "train", "ifeval/input_data.jsonl", "ifeval", prompt_key="prompt",
                        answer_key="instruction_id_list"),
}
# The record field a `@START:END` window filters on (LiveCodeBench's; also looked up inside `metadata`).
DATE_FIELD = "contest_date"


def load_benchmark(spec: str, limit: int | None = None, data: DataConfig | None = None, *,
                   data_dir: str | Path | None = None) -> Bench:
    """The benchmark of a spec `name[@START:END][=path]` or `arithmetic`: problems of the run's
    data.arithmetic_levels, held out from the arithmetic set its data config draws (`data`, default: the
    default config's), so validation and gapo-eval --run hold out the same problems. A named benchmark is read
    from `data_dir` (default: $GAPO_DATA_DIR) when its file is there, else from Hugging Face. Records its
    rewarder cannot score (an empty answer, tests that do not parse) are left out before `limit` applies, and
    listed with their reason. Nothing else is left out: see `context_length`."""
    name, _, path = spec.partition("=")
    name, at, window = name.partition("@")
    check_benchmarks([spec])
    bounds = parse_window(window, spec) if at else None  # a malformed window fails before any download
    known = BENCHMARKS.get(name)
    kind = known.kind if known else "math"
    keys = {"prompt_key": known.prompt_key, "answer_key": known.answer_key} if known else {}
    if name == "arithmetic" and not path:
        d = data or DataConfig()
        trained = arithmetic_problems(d.arithmetic_size, seed=d.arithmetic_seed, levels=d.arithmetic_levels)
        problems = arithmetic_problems(limit or 200, seed=4242, exclude={p.question for p in trained},
                                       levels=d.arithmetic_levels)
    elif path:
        problems = load_problems(path, **keys)
    elif known:
        problems = _load_named(name, known, data_dir or os.environ.get("GAPO_DATA_DIR"), keys)
    where = path or f"benchmark {name!r}"
    precut = bool(known and known.window and not path and bounds == parse_window(known.window, spec))
    if bounds and not (precut and all(record_date(p) is None for p in problems)):  # undated: cut already
        problems = in_window(problems, *bounds, where=where, spec=spec)
    problems = rewarder(kind).prepare(problems, where)
    total = len(problems)
    problems, dropped = check_problems(kind, problems, name)
    if dropped:
        log.warning("benchmark %s: left out %s; the rest is scored", name, dropped_summary(dropped, total))
    if not problems:
        raise ConfigError(f"{where}: no record can be scored ({dropped_summary(dropped, total)})")
    return Bench(name, kind, problems[:limit] if limit else problems, dropped)


def parse_window(window: str, spec: str) -> tuple[datetime | None, datetime | None]:
    """`START:END` -> (start, end) at 00:00 of each date; an empty side is open."""
    start_text, colon, end_text = window.partition(":")
    if not colon or not (start_text or end_text):
        raise ConfigError(f"benchmark {spec!r}: the window after '@' must be START:END with dates YYYY-MM-DD "
                          "(either side may be empty), e.g. livecodebench@2024-08-01:2025-02-01")
    bounds = []
    for side, text in (("start", start_text), ("end", end_text)):
        try:
            bounds.append(datetime.combine(date.fromisoformat(text), datetime.min.time()) if text else None)
        except ValueError:
            raise ConfigError(f"benchmark {spec!r}: window {side} {text!r} is not a date YYYY-MM-DD") from None
    start, end = bounds
    if start and end and start > end:
        raise ConfigError(f"benchmark {spec!r}: the window starts ({start_text}) after it ends ({end_text})")
    return start, end


def record_date(problem: Problem) -> datetime | None:
    """The problem's contest date as a naive UTC datetime, from its `contest_date` field or its metadata's
    (DeepCoder-style records keep extra fields in a `metadata` mapping or JSON string); None when absent."""
    value = problem.meta.get(DATE_FIELD)
    if value is None:
        meta = problem.meta.get("metadata")
        if isinstance(meta, str):
            try:
                meta = json.loads(meta)
            except json.JSONDecodeError:
                meta = None
        value = meta.get(DATE_FIELD) if isinstance(meta, dict) else None
    if value is None:
        return None
    if isinstance(value, datetime):
        got = value
    elif isinstance(value, date):
        got = datetime.combine(value, datetime.min.time())
    elif isinstance(value, str):
        try:
            got = datetime.fromisoformat(value.strip())
        except ValueError:
            raise ConfigError(f"problem {problem.uid}: {DATE_FIELD}={value!r} is not an ISO date or date-time"
                              ) from None
    else:
        raise ConfigError(f"problem {problem.uid}: {DATE_FIELD}={value!r} ({type(value).__name__}) is not a date")
    return got.astimezone(UTC).replace(tzinfo=None) if got.tzinfo else got


def in_window(problems: list[Problem], start: datetime | None, end: datetime | None, *, where: str,
              spec: str) -> list[Problem]:
    """The problems dated within [start, end]. Every record must carry its date: dropping undated ones would
    make a window look applied to a file it cannot be applied to."""
    dated = []
    for i, p in enumerate(problems):
        d = record_date(p)
        if d is None:
            raise ConfigError(
                f"{where}: item {i} (uid {p.uid}) has no field {DATE_FIELD!r} (nor metadata.{DATE_FIELD}; fields: "
                f"{', '.join(sorted(p.meta))}), so the window of {spec!r} cannot be applied. A file already cut to "
                "the window (DeepCoder's lcbv5 test split is 2024-08-01..2025-02-01) goes without it: "
                f"{spec.partition('@')[0]}=PATH")
        dated.append((d, p))
    kept = [p for d, p in dated if (start is None or start <= d) and (end is None or d <= end)]
    if not kept:
        lo, hi = min(d for d, _ in dated), max(d for d, _ in dated)
        raise ConfigError(f"{where}: no problem in the window of {spec!r} (the records are dated "
                          f"{lo.date()} to {hi.date()})")
    return kept


def check_benchmarks(specs: list[str]) -> None:
    """Each spec names a benchmark, arithmetic or a file (name=path), with a well-formed window: checked before any
    rank starts (gapo-train, gapo-sweep), because a misspelt name otherwise surfaces after the model has loaded."""
    for spec in specs:
        name, _, path = spec.partition("=")
        name, at, window = name.partition("@")
        if not path and name != "arithmetic" and name not in BENCHMARKS:
            raise ConfigError(f"unknown benchmark {name!r}: use one of {', '.join([*BENCHMARKS, 'arithmetic'])} "
                              "or name=path/to/file.jsonl")
        if path and not Path(path).expanduser().is_file():
            raise ConfigError(f"eval.benchmarks: {spec!r}: no file {path}; expected name=path/to/file.jsonl")
        if at:
            parse_window(window, spec)


def check_names(cfg: Config) -> None:
    """The names a run reads that config resolution cannot check, because their tables live with the code that uses
    them (its transport, rewarder and benchmarks; plugins have registered theirs by now): gapo-train and gapo-sweep
    check them before any rank loads a model, not after."""
    if cfg.rollout.placement == "split":
        from gapo.rollout.transport import transport_named

        transport_named(cfg.rollout.transport)
    if cfg.rollout.engine == "vllm":
        from gapo.rollout.vllm_compat import check_installed

        check_installed()  # a vLLM or Python outside gapo's range, named before any rank starts
    rewarder(cfg.data.type)
    check_benchmarks(cfg.eval.benchmarks)


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
        return load_problems(known.hf_id, split=known.split, subset=known.subset, **keys)
    except ConfigError as err:
        raise ConfigError(f"benchmark {name!r}: {tried_local}, and loading the Hugging Face dataset "
                          f"{known.hf_id!r} (split {known.split!r}) failed: {err}; {provide}") from None


@dataclass
class Bench:
    """A benchmark ready to evaluate: the problems that can be scored, and the records left out (with why)."""

    name: str
    kind: str  # its row of the rewarder table (gapo.reward.registry.REWARDERS): which rewarder scores it
    problems: list[Problem]
    dropped: list[Dropped] = field(default_factory=list)


@dataclass
class BenchResult:
    name: str
    n: int
    correct: list[int]  # per problem, out of n
    uids: list[str]
    statuses: dict[str, int]
    extra: dict[str, float] = field(default_factory=dict)  # the kind's own metrics (its row's; ifeval: accuracies)
    kind: str = "math"
    dropped: dict[str, int] = field(default_factory=dict)  # records left out before scoring, by reason

    def pass_at(self) -> dict[int, float]:
        ks = [2**i for i in range(int(math.log2(self.n)) + 1)]
        return {k: sum(pass_at_k(self.n, c, k) for c in self.correct) / len(self.correct) for k in ks}


def sample_seeds(seed: int, benches: list[Bench], n: int) -> list[list[int]]:
    """One vLLM request seed per problem of each benchmark, such that no two (problem, sample) pairs share a seed.

    vLLM seeds sample j of a request with seed + j, and its sampler's noise depends only on (seed, position,
    token): two requests whose seed ranges overlap draw identical noise for the overlapping samples (seeds
    seed * 1_000_003 + i would give sample j of problem i the noise of sample j - 1 of problem i + 1). So each
    request gets an aligned block of 2^ceil(log2 n) seeds, drawn from SeedSequence([seed, benchmark, problem])
    and moved to the next free block on a collision: the blocks, hence all seeds, are disjoint across the whole
    evaluation."""
    size = 1 << max(0, (n - 1).bit_length())
    blocks = (1 << 31) // size
    taken: set[int] = set()
    out = []
    for bench in benches:
        tag = zlib.crc32(bench.name.encode())
        row = []
        for i in range(len(bench.problems)):
            block = int(np.random.SeedSequence([seed, tag, i]).generate_state(1)[0]) % blocks
            while block in taken:
                block = (block + 1) % blocks
            taken.add(block)
            row.append(block * size)
        out.append(row)
    return out


def prompt_ids(bench: Bench, tokenizer, instruction: str | None, which: list[int] | None = None) -> list[list[int]]:
    """The chat-templated prompts of the bench's problems (`which`: their indices, default all) as they are
    sampled: `instruction` appended (None: the kind's own), except to a bare prompt (IFEval's), which is the
    instruction under test."""
    row = rewarder(bench.kind)
    instr = "" if row.bare_prompt else instruction if instruction is not None else row.instruction
    return [build_prompt_ids(tokenizer, bench.problems[i], instr)
            for i in (range(len(bench.problems)) if which is None else which)]


def context_length(benches: list[Bench], tokenizer, instruction: str | None, max_new_tokens: int,
                   positions: int | None) -> int:
    """The engine context an evaluation of `benches` needs: the longest prompt plus max_new_tokens, within the
    model's `positions` (a response that reaches them ends there, as truncated).

    No problem is left out for its length: a benchmark is the same problem set in validation and in gapo-eval,
    whatever data.max_prompt_tokens a run trained with, so the engine's context is sized to the benchmark
    instead. A prompt the model cannot hold at all is an error naming it."""
    longest, where = 0, ""
    for bench in benches:
        for p, ids in zip(bench.problems, prompt_ids(bench, tokenizer, instruction), strict=True):
            if len(ids) > longest:
                longest, where = len(ids), f"benchmark {bench.name!r}, problem {p.uid}"
    if positions is not None and longest >= positions:
        raise ConfigError(f"{where}: its prompt is {longest} tokens, and the model has {positions} positions "
                          "(max_position_embeddings): no room for a response. Leave the problem out of the "
                          "benchmark's file (name=PATH), or use a model with a longer context")
    return longest + max_new_tokens if positions is None else min(positions, longest + max_new_tokens)


def evaluate(engine: Engine, tokenizer, benches: list[Bench], *, n: int, temperature: float,
             top_p: float, max_new_tokens: int, instruction: str | None, reward: RewardConfig, seed: int = 0,
             progress: bool = True) -> list[BenchResult]:
    """Every rank scores its share of each benchmark (problem i goes to rank i % world); results are gathered."""
    import torch.distributed as dist

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    sampling = SamplingConfig(n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                              stop_token_ids=stop_token_ids(tokenizer))
    out = []
    all_seeds = sample_seeds(seed, benches, n)
    pairs = list(zip(benches, all_seeds, strict=True))
    for bench, seeds in tqdm(pairs, desc="eval", disable=not progress or rank != 0):
        name, kind, problems = bench.name, bench.kind, bench.problems
        mine = list(range(rank, len(problems), world))
        row = rewarder(kind)
        prompts = prompt_ids(bench, tokenizer, instruction, mine)
        groups = engine.generate(prompts, sampling, seeds=[seeds[i] for i in mine]) if mine else []
        texts, owned = [[x.text for x in g] for g in groups], [problems[i] for i in mine]
        local = dict(zip(mine, score_groups(kind, texts, owned, reward), strict=True))
        if world > 1:
            local = {k: v for p in gather(local) for k, v in p.items()}
        results = [local[i] for i in range(len(problems))]
        statuses: dict[str, int] = {}
        for s in (r.status for res in results for r in res):
            statuses[s] = statuses.get(s, 0) + 1
        out.append(BenchResult(name, n, [sum(r.status == "correct" for r in res) for res in results],
                               [p.uid for p in problems], statuses, row.metrics(results), kind,
                               dict(Counter(d.reason for d in bench.dropped))))
    return out


def averaged(results: list[BenchResult]) -> list[BenchResult]:
    """The benchmarks `val/mean` averages: those whose rewarder row counts in the mean (all but IFEval, the paper's
    out-of-domain probe, which its "Avg." column leaves out: Table 3)."""
    return [r for r in results if rewarder(r.kind).in_mean]


def summary(results: list[BenchResult], threshold: float = 0.05) -> dict[str, float]:
    """Flat metrics: val/<bench>/pass@k, val/<bench>/coverage, and the mean over benchmarks."""
    m: dict[str, float] = {}
    for r in results:
        for k, v in r.pass_at().items():
            m[f"val/{r.name}/pass@{k}"] = v
        m[f"val/{r.name}/coverage"] = coverage([c / r.n for c in r.correct], threshold)
        for k, v in r.extra.items():
            m[f"val/{r.name}/{k}"] = v
    mean_of = averaged(results)
    if mean_of:
        for k in mean_of[0].pass_at():
            m[f"val/mean/pass@{k}"] = sum(m[f"val/{r.name}/pass@{k}"] for r in mean_of) / len(mean_of)
    return m


def write_results(results: list[BenchResult], out: Path, meta: dict) -> None:
    """results.json and per_problem.jsonl, written beside `out` and renamed into place: a directory holding a
    results.json is complete (gapo-eval --run skips it, gapo-compare reads it)."""
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with open(tmp / "per_problem.jsonl", "w") as f:
        for r in results:
            for uid, c in zip(r.uids, r.correct, strict=True):
                f.write(json.dumps({"benchmark": r.name, "uid": uid, "correct": c, "n": r.n,
                                    "solve_rate": c / r.n}) + "\n")
    (tmp / "results.json").write_text(json.dumps({"meta": meta, "metrics": summary(results),
                                                  "statuses": {r.name: r.statuses for r in results},
                                                  "dropped": {r.name: r.dropped for r in results}}, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def checkpoint_weights(hf: Path):
    """(name, tensor) of a checkpoint's exported model, tied weights under each of their names (as the trainer
    streams them: vLLM's reload would otherwise keep the old tied head)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    for name, p in model.named_parameters(remove_duplicate=False):
        yield name, p.detach()

