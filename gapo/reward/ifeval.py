"""IFEval (Zhou et al. 2023), the paper's out-of-domain probe (Table 3): does RL on math keep the model's
instruction following?

The instruction checkers are Google's (google-research/instruction_following_eval), as the PyPI package
`if-verifiable` ships them: its registry is the reference's 25 instruction types with the reference's
checking code. We use only the checkers; the scoring of n samples per prompt and the aggregation are here,
because the package's helper skips instruction ids it does not know (a silent gap in the score) and strips
reasoning blocks (the reference scores the response as written).

Scoring, with n samples per prompt:
- a sample *passes* when it follows every instruction of its prompt, strictly (the response as written).
  That is the status "correct" that pass@k counts, so pass@1 is the prompt-level strict accuracy averaged
  over the n samples (the headline number), and pass@k the chance that one of k samples follows them all;
- instruction-level accuracy is the share of (sample, instruction) pairs followed, over all such pairs;
- "loose" (Google's rule for preambles and markdown emphasis) counts an instruction as followed when the
  response or one of its variants (first line dropped, last line dropped, both, and each of these with
  every `*` removed) follows it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gapo.data import Problem
from gapo.errors import ConfigError
from gapo.reward.types import RewardResult

if TYPE_CHECKING:
    from gapo.config import RewardConfig

log = logging.getLogger("gapo.reward.ifeval")

# Per-problem counts that ranks gather and sum; the metrics are ratios of their totals.
COUNT_KEYS = ("samples", "prompt_strict", "prompt_loose", "instructions", "inst_strict", "inst_loose")
METRICS = {  # metric -> (numerator, denominator) among COUNT_KEYS
    "prompt_strict": ("prompt_strict", "samples"),
    "inst_strict": ("inst_strict", "instructions"),
    "prompt_loose": ("prompt_loose", "samples"),
    "inst_loose": ("inst_loose", "instructions"),
}
METRIC_NAMES = {"prompt_strict": "prompt-level strict", "inst_strict": "instruction-level strict",
                "prompt_loose": "prompt-level loose", "inst_loose": "instruction-level loose"}

_registry: dict[str, type] | None = None


def registry() -> dict[str, type]:
    """Instruction id -> checker class. langdetect (three checkers detect the response's language) samples
    at random; seeding it makes a rescore of the same responses give the same number."""
    global _registry
    if _registry is None:
        import langdetect
        from if_verifiable.ifeval.instructions_registry import INSTRUCTION_DICT

        langdetect.DetectorFactory.seed = 0
        _registry = dict(INSTRUCTION_DICT)
    return _registry


def require_sentence_splitter() -> None:
    """Two checkers (number_sentences, capital_word_frequency) split text with NLTK's English Punkt model,
    which is data, not code: it is not installed with the package. Checked before any generation, since
    without it the scoring would fail only after hours of sampling."""
    import nltk

    try:
        nltk.data.find("tokenizers/punkt_tab/english/")
    except LookupError:
        raise ConfigError("ifeval: NLTK's English sentence splitter (punkt_tab) is not installed; IFEval's "
                          "number_sentences and capital_word_frequency checkers need it. Install it once with "
                          "`python -m nltk.downloader punkt_tab` (or put an nltk_data directory holding "
                          "tokenizers/punkt_tab on $NLTK_DATA)") from None


def _kwargs(problem: Problem) -> list[dict]:
    """The record's kwargs, one mapping per instruction, without the None values that the Hugging Face copy
    fills in for keys another instruction type uses (the checkers read None as "choose at random")."""
    raw = problem.meta.get("kwargs")
    if isinstance(raw, str):
        raw = json.loads(raw)
    return [{k: v for k, v in (kw or {}).items() if v is not None} for kw in raw]


def _checker(instruction_id: str, kwargs: dict, prompt: str):
    checker = registry()[instruction_id](instruction_id)
    checker.build_description(**kwargs)
    args = checker.get_instruction_args()
    if args and "prompt" in args:  # as the reference does: a checker that wants the prompt is given it
        checker.build_description(prompt=prompt)
    return checker


def prepare(problems: list[Problem], where: str) -> list[Problem]:
    """Google's records (key, prompt, instruction_id_list, kwargs) checked against the registry and each
    instruction's arguments built once, so a bad record fails here, before generation; the uid is the
    record's `key`."""
    known = registry()
    out = []
    for i, p in enumerate(problems):
        item = f"{where}: item {i} (key {p.meta.get('key', '?')})"
        ids = p.gold
        if not isinstance(ids, list) or not ids or not all(isinstance(x, str) for x in ids):
            raise ConfigError(f"{item}: instruction_id_list must be a non-empty list of instruction ids, got {ids!r}")
        if "kwargs" not in p.meta:
            raise ConfigError(f"{item}: no field 'kwargs' (one mapping of arguments per instruction)")
        try:
            kwargs = _kwargs(p)
        except (TypeError, AttributeError, json.JSONDecodeError) as err:
            raise ConfigError(f"{item}: kwargs must be a list of mappings ({type(err).__name__}: {err})") from None
        if len(kwargs) != len(ids):
            raise ConfigError(f"{item}: {len(ids)} instruction ids but {len(kwargs)} kwargs entries")
        for iid, kw in zip(ids, kwargs, strict=True):
            if iid not in known:
                raise ConfigError(f"{item}: unknown instruction id {iid!r} (the registry of if-verifiable "
                                  f"has {len(known)}: {', '.join(sorted(known))})")
            try:
                _checker(iid, kw, p.question)
            except (TypeError, ValueError) as err:
                raise ConfigError(f"{item}: instruction {iid!r} does not take kwargs {kw!r} ({err})") from None
        uid = str(p.meta["key"]) if p.meta.get("key") is not None else p.uid
        out.append(Problem(uid, p.question, list(ids), p.meta))
    return out


def loose_variants(response: str) -> list[str]:
    """The response and the variants Google's loose rule also accepts (see the module docstring)."""
    lines = response.split("\n")
    cut = [response, "\n".join(lines[1:]).strip(), "\n".join(lines[:-1]).strip(), "\n".join(lines[1:-1]).strip()]
    return cut + [x.replace("*", "") for x in cut]


@dataclass(frozen=True)
class IFEvalResult(RewardResult):
    """One response's reward result (status "correct" when every instruction is followed strictly, "error" when a
    checker raised: that instruction counts as not followed) with its per-instruction verdicts, strict and loose,
    which the benchmark's accuracies (`metrics`) are counted from."""

    strict: tuple[bool, ...] = ()
    loose: tuple[bool, ...] = ()


def score(response: str, problem: Problem) -> IFEvalResult:
    variants = [v for v in loose_variants(response) if v.strip()]
    strict, loose, errors = [], [], []
    for iid, kw in zip(problem.gold, _kwargs(problem), strict=True):
        checker = _checker(iid, kw, problem.question)
        try:
            ok = bool(response.strip()) and bool(checker.check_following(response))
            ok_loose = ok or any(checker.check_following(v) for v in variants)
        except Exception as err:  # a checker crashing on one odd response must not lose the whole evaluation
            errors.append(f"{iid}: {type(err).__name__}: {err}")
            ok = ok_loose = False
        strict.append(ok)
        loose.append(ok_loose)
    status = "error" if errors else "correct" if all(strict) else "wrong"
    return IFEvalResult(1.0 if status == "correct" else 0.0, status, "; ".join(errors)[:300], (), tuple(strict),
                        tuple(loose))


def score_records(groups: list[list[str]], problems: list[Problem], cfg: RewardConfig | None = None
                  ) -> list[list[IFEvalResult]]:
    """The rewarder table's scorer: every response against its prompt's instructions (no workers, no settings)."""
    out = [[score(r, p) for r in g] for g, p in zip(groups, problems, strict=True)]
    errors = [s.detail for g in out for s in g if s.status == "error"]
    if errors:
        log.warning("ifeval: %d responses made a checker raise (scored as not followed); first: %s",
                    len(errors), errors[0])
    return out


def prepare_benchmark(problems: list[Problem], where: str) -> list[Problem]:
    """The rewarder table's load step: the sentence splitter checked, then the records (`prepare`)."""
    require_sentence_splitter()
    return prepare(problems, where)


def counts(scores: list[IFEvalResult]) -> dict[str, int]:
    """One problem's counts (COUNT_KEYS) over its samples."""
    return {"samples": len(scores),
            "prompt_strict": sum(all(s.strict) for s in scores),
            "prompt_loose": sum(all(s.loose) for s in scores),
            "instructions": sum(len(s.strict) for s in scores),
            "inst_strict": sum(sum(s.strict) for s in scores),
            "inst_loose": sum(sum(s.loose) for s in scores)}


def metrics(per_problem: Iterable[list[IFEvalResult]]) -> dict[str, float]:
    """The rewarder table's metrics: prompt- and instruction-level accuracy, strict and loose, over all samples of
    all problems (each problem's results in a list)."""
    total = dict.fromkeys(COUNT_KEYS, 0)
    for results in per_problem:
        for k, v in counts(results).items():
            total[k] += v
    return {m: total[num] / total[den] if total[den] else 0.0 for m, (num, den) in METRICS.items()}
