"""Problems in, token-id prompts out: loaders, the embedded arithmetic set, and a resumable sampler.

A `Problem` keeps the benchmark's gold field as stored (a string, a number, a list, or a code problem's
tests), because the rewarders know how to read each format and a loader that "normalised" it would lose
information (AMC's 142.0, OlympiadBench's answer lists).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gapo import arithmetic
from gapo.config import DataConfig, DataSource
from gapo.errors import ConfigError

log = logging.getLogger("gapo.data")


@dataclass(frozen=True)
class Problem:
    uid: str
    question: str
    gold: Any  # math: the answer field as stored; code: the tests field as stored
    meta: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Dropped:
    """A record left out before training or evaluation, and why (gapo.reward.registry.REASONS): one line of
    <output_dir>/dropped_records.jsonl."""

    source: str  # "train", or the benchmark's name
    uid: str
    reason: str
    detail: str


LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet")  # a data source with one of these is a file, else a hub dataset
_DEFAULT = DataConfig()  # the default training set: its size and seed are the config's


def load_problems(source: str, *, prompt_key: str = "problem", answer_key: str = "answer", split: str = "train",
                  subset: str | None = None, arithmetic_size: int = _DEFAULT.arithmetic_size,
                  arithmetic_seed: int = _DEFAULT.arithmetic_seed,
                  arithmetic_levels: list[str] | None = None, sample: int | None = None) -> list[Problem]:
    """JSON (a list of records), JSONL, parquet, a Hugging Face dataset name (`subset`: its configuration),
    or `arithmetic`. `sample`: only the first N records, streamed from the hub (a rehearsal checks the loader
    without the whole download).

    Two record fields beyond the prompt and answer keys are read, the way DeepCoder's data preparation
    reads them: a non-empty `starter_code` is shown under the question (LiveCodeBench's functional
    problems name their function only there), and `metadata.func_name` joins a list of tests that lacks
    it (the rewarder sees only the tests)."""
    if subset is not None and (source == "arithmetic" or Path(source).suffix in LOCAL_SUFFIXES):
        raise ConfigError(f"data source {source!r}: subset={subset!r} names a Hugging Face dataset configuration; "
                          "a local file or the arithmetic set has none")
    if source == "arithmetic":
        try:
            return arithmetic_problems(arithmetic_size, seed=arithmetic_seed, levels=arithmetic_levels)
        except ValueError as err:  # too many problems for the chosen levels, or an unknown level
            raise ConfigError(f"data.arithmetic_size={arithmetic_size}, data.arithmetic_levels={arithmetic_levels}: "
                              f"{err}") from None
    records, lines, where = _records(source, subset, split, sample)
    records = records[:sample] if sample else records
    if records and all(isinstance(r, dict) and answer_key not in r for r in records):
        raise ConfigError(f"{where}: no record has the field {answer_key!r} (fields: {', '.join(sorted(records[0]))}); "
                          "set data.answer_key")
    problems = []
    for i, rec in enumerate(records):
        at = f"line {lines[i]}" if lines else f"record {i + 1}"
        if not isinstance(rec, dict):
            raise ConfigError(f"{where}: {at} is a {type(rec).__name__}, expected a record (mapping)")
        if prompt_key not in rec:
            raise ConfigError(f"{where}: {at} has no field {prompt_key!r} (fields: {', '.join(sorted(rec))}); "
                              "set data.prompt_key")
        meta = {k: v for k, v in rec.items() if k not in (prompt_key, answer_key)}
        question, starter = str(rec[prompt_key]), rec.get("starter_code")
        if isinstance(starter, str) and starter.strip():
            question += ("\n\nComplete this starter code and give the whole solution in one ```python block:\n"
                         f"```python\n{starter.rstrip()}\n```")
        # A record without its answer is dropped before step 1 like one whose answer is null (the rewarder's check).
        problems.append(Problem(uid=str(rec.get("unique_id", rec.get("id", i))), question=question,
                                gold=_with_func_name(rec.get(answer_key), rec.get("metadata")), meta=meta))
    if not problems:
        raise ConfigError(f"{where}: no problems")
    return problems


def _records(source: str, subset: str | None, split: str, sample: int | None) -> tuple[list, list[int] | None, str]:
    """A local file's records (with each one's JSONL line) or a hub dataset's, and how a message names the source."""
    path = Path(source).expanduser()
    if path.suffix in LOCAL_SUFFIXES:
        if not path.is_file():
            raise ConfigError(f"data file {source!r} not found")
        return (*_read_file(path), str(path))
    import datasets

    try:
        if sample:
            records = list(datasets.load_dataset(source, subset, split=split, streaming=True).take(sample))
        else:
            records = list(datasets.load_dataset(source, subset, split=split))
    except Exception as err:  # the library raises many kinds; the user needs the name and the cause
        raise ConfigError(f"dataset {source!r}{f' (subset {subset!r})' if subset else ''}: not a "
                          ".json/.jsonl/.parquet file and not loadable by datasets.load_dataset "
                          f"({type(err).__name__}: {err})") from err
    return records, None, f"dataset {source!r}" + (f" subset {subset!r}" if subset else "")


def _with_func_name(tests: Any, metadata: Any) -> Any:
    """LiveCodeBench keeps a functional problem's function name in the record's metadata, not in its tests."""
    if isinstance(metadata, str):
        try:
            metadata = json.loads(metadata)
        except json.JSONDecodeError:
            return tests
    if not isinstance(metadata, dict) or not metadata.get("func_name"):
        return tests
    parsed = tests
    if isinstance(tests, str):
        try:
            parsed = json.loads(tests)
        except json.JSONDecodeError:
            return tests
    if not isinstance(parsed, list) or not all(isinstance(t, dict) for t in parsed):
        return tests
    return [t if t.get("metadata") else {**t, "metadata": metadata} for t in parsed]


def load_training_set(d: DataConfig, sample: int | None = None, local_only: bool = False) -> list[Problem]:
    """data.train's problems: one source, or several concatenated in order (ids prefixed with the source's
    position, so they stay unique), then de-duplicated when data.dedup asks for it. `local_only`: the files and the
    arithmetic set, not the hub's datasets (gapo-train reads those before torch loads, to name a bad record early)."""
    sources = [DataSource(source=d.train)] if isinstance(d.train, str) else d.train
    problems: list[Problem] = []
    for i, s in enumerate(sources):
        if local_only and not (s.source == "arithmetic" or Path(s.source).suffix in LOCAL_SUFFIXES):
            continue
        got = load_problems(s.source, subset=s.subset, split=s.split or d.split,
                            prompt_key=s.prompt_key or d.prompt_key, answer_key=s.answer_key or d.answer_key,
                            arithmetic_size=d.arithmetic_size, arithmetic_seed=d.arithmetic_seed,
                            arithmetic_levels=d.arithmetic_levels, sample=sample)
        if len(sources) > 1:
            label = s.subset or Path(s.source).stem
            log.info("data.train[%d] %s%s: %d problems", i, s.source, f" ({s.subset})" if s.subset else "", len(got))
            got = [Problem(f"{i}:{label}:{p.uid}", p.question, p.gold, p.meta) for p in got]
        problems += got
    return deduplicate(problems) if d.dedup else problems


def deduplicate(problems: list[Problem]) -> list[Problem]:
    """The first of each question, compared case- and whitespace-insensitively (DeepScaleR's 40,315 problems
    hold repeats across its sources)."""
    seen: set[str] = set()
    kept = []
    for p in problems:
        key = " ".join(p.question.lower().split())
        if key not in seen:
            seen.add(key)
            kept.append(p)
    log.info("data.dedup: %d of %d problems kept (%d repeats dropped)", len(kept), len(problems),
             len(problems) - len(kept))
    return kept


def _read_file(path: Path) -> tuple[list, list[int] | None]:
    """The file's records, and for JSONL each one's 1-based line (blank lines skipped), so that a message names the
    line an editor shows."""
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist(), None
        except pa.ArrowException as err:  # a truncated or foreign file: named, not a traceback into pyarrow
            raise ConfigError(f"{path}: not a readable parquet file ({err})") from None
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start}); expected JSON or JSONL "
                          "records") from None
    if path.suffix == ".jsonl":
        out, lines = [], []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ConfigError(f"{path}: line {n}: not valid JSON ({err.msg})") from None
                lines.append(n)
        return out, lines
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from None
    if not isinstance(data, list):
        raise ConfigError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
    return data, None


def arithmetic_problems(n: int, seed: int = _DEFAULT.arithmetic_seed, exclude: set[str] | None = None,
                        levels: list[str] | None = None) -> list[Problem]:
    """The embedded arithmetic set (gapo/arithmetic.py) as problems; `exclude` keeps a held-out set disjoint
    from training."""
    return [Problem(uid=f"arith-{seed}-{i}", question=q, gold=answer, meta={"level": level})
            for i, (q, answer, level) in enumerate(arithmetic.draw(n, seed, exclude, levels))]


# --------------------------------------------------------------------------------------------------
# Prompts and sampling
# --------------------------------------------------------------------------------------------------
def build_prompt_ids(tokenizer, problem: Problem, instruction: str) -> list[int]:
    text = f"{problem.question}\n{instruction}" if instruction else problem.question
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """The tokenizer's EOS and the chat template's end-of-turn token (<|im_end|>, <|eot_id|>, ...).

    The end of turn is read off the template itself: a rendered assistant reply is followed by it. A base
    model's generation config often stops only at <|endoftext|>, and a response that runs past its turn
    puts text after the answer that a last-\\boxed{} extraction would read.
    """
    ids = {tokenizer.eos_token_id} - {None}
    marker = "gapo-end-of-turn-probe"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "1 + 1?"},
                                              {"role": "assistant", "content": marker}], tokenize=False)
    except (ValueError, TypeError, AttributeError) as err:  # no template, or one that renders no assistant turn
        log.warning("no end-of-turn token from the chat template (%s); stopping at EOS only", err)
        return tuple(sorted(ids))
    if marker in text:
        after = tokenizer(text.split(marker, 1)[1], add_special_tokens=False)["input_ids"]
        special = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
        if after and after[0] in special:
            ids.add(after[0])
    return tuple(sorted(ids))


def tokenize_problems(tokenizer, problems: list[Problem], instruction: str, max_prompt_tokens: int,
                      source: str = "train") -> tuple[list[Problem], list[list[int]], list[Dropped]]:
    """Chat-templated prompt ids; prompts over `max_prompt_tokens` are dropped (the engine's context is sized for
    them: a longer one would stop the run mid-way) and returned as such."""
    kept, ids, dropped = [], [], []
    for p in problems:
        x = build_prompt_ids(tokenizer, p, instruction)
        if len(x) <= max_prompt_tokens:
            kept.append(p)
            ids.append(x)
        else:
            dropped.append(Dropped(source, p.uid, "prompt too long",
                                   f"{len(x)} tokens > data.max_prompt_tokens={max_prompt_tokens}"))
    if not kept:
        raise ConfigError(f"{source}: every prompt is longer than data.max_prompt_tokens={max_prompt_tokens}")
    return kept, ids, dropped


class Sampler:
    """Shuffled epochs over n items, deterministic in the seed; state is (epoch, position) so a resumed
    run draws exactly the batches the uninterrupted run would have, epoch boundaries included."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self.epoch, self.pos = 0, 0

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n)

    def next(self, size: int) -> list[int]:
        out: list[int] = []
        while len(out) < size:
            order = self._order(self.epoch)
            take = min(size - len(out), self.n - self.pos)
            out.extend(int(i) for i in order[self.pos:self.pos + take])
            self.pos += take
            if self.pos == self.n:
                self.epoch, self.pos = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "n": self.n, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["n"] != self.n or state["seed"] != self.seed:
            raise ValueError(f"sampler state is for {state['n']} items / seed {state['seed']}, "
                             f"this run has {self.n} items / seed {self.seed}")
        self.epoch, self.pos = state["epoch"], state["pos"]
