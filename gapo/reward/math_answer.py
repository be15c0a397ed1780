"""Reading a math answer out of a response, and a benchmark's gold answer into what math-verify compares: plain
string work, no math-verify and no processes (gapo/reward/math.py verifies in its worker pool).

Answer extraction (done in the parent, plain string scanning):
  1. The content of the LAST `\\boxed{...}`, `\\fbox{...}` or `\\framebox{...}` in the response, with
     nested braces balanced (escaped `\\{`/`\\}` do not count); also `\\boxed 5` without braces.
     A last box that is never closed (a truncated response) counts as no box; earlier boxes are
     intermediate results and are not used, except for a multiple-answer problem (OlympiadBench's
     `is_multiple_answer`), where the boxes of the final sentence together are the answer: "The integers
     are \\boxed{-2} and \\boxed{1}." reads as the set {-2, 1}, as "\\boxed{-2, 1}" does. Models write
     both; reading only the last box would score a complete answer wrong. The sentence ends at a full
     stop or a line break, so a boxed intermediate result in an earlier sentence is still not read.
  2. Fallback when there is no box: the text after the LAST "answer is" / "answer:" phrase (any case,
     e.g. "The final answer is $3$.", "**Answer:** 42"), up to the end of its math delimiters or of the
     sentence. By default there is no "last number in the text" fallback: it rewards responses that ignore
     the requested format and matches stray numbers by accident. reward.math_last_number_fallback turns one
     on (with_last_number, below) for a small model that rarely boxes, such as the CPU demo's.
  3. Nothing found -> status `no_answer`.

Gold answers (the benchmark's answer field as stored):
  * str: `$` signs are dropped (OlympiadBench writes "$69$,$84$"), and so are escaped currency signs
    (MATH500's "\\$32,\\!348"); comma-separated values parse as a set, so a multiple-answer problem needs
    all of them, in any order.
  * int/float: 142.0 (AMC stores floats) becomes "142"; non-integral floats use repr.
  * list: ALTERNATIVE spellings of one answer, matching any one is correct. That is what the lists in
    the shared data mean: Minerva stores e.g. ['4.4e7', '4.4 \\times 10^7'], OlympiadBench always a
    single element. `MathGold.from_record` reads a record's `unit` and `is_multiple_answer`; a
    multiple-answer record with several list elements is joined into one set that must be matched whole.
  * Scientific notation such as "4.5e33" (Minerva) is rewritten to `4.5\\times10^{33}` on both sides,
    otherwise it would parse as 4.5*e*33.
  * Units: math-verify already drops `\\text{..}`/`\\mathrm{..}` units and `^\\circ`; when a unit is given
    (OlympiadBench's `unit` field, or the `unit=` argument) a trailing occurrence of it, bare or wrapped,
    is also stripped from the answer, which handles bare words ("45 minutes") and percent signs.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

# --------------------------------------------------------------------------------------------------
# Answer extraction
# --------------------------------------------------------------------------------------------------
_BOX_RE = re.compile(r"\\(?:boxed|fbox|framebox)(?![A-Za-z])")
_PHRASE_RE = re.compile(r"answer\s*(?:is\b|:)\s*:?", re.IGNORECASE)
_MATH_DELIMS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))
_SENTENCE_END_RE = re.compile(r"\.(?:\s|$)")


def extract_answer(response: str, multiple: bool = False) -> str | None:
    """The final answer of a response by the rules in the module docstring, or None. `multiple` (a problem
    whose answer is several values): every box of the final sentence, joined as one set."""
    boxed = _last_boxed(response, multiple)
    if boxed is not None:
        return boxed
    return _answer_phrase(response)


def _last_boxed(text: str, multiple: bool = False) -> str | None:
    matches = list(_BOX_RE.finditer(text))
    if not matches:
        return None
    content = _box_argument(text, matches[-1].end())
    if content is None or not content.strip():
        return None
    parts = [content.strip()]
    if multiple:
        # Earlier boxes join while only words separate them from the next ("are \boxed{-2} and \boxed{1}."):
        # a full stop or a line break ends the final sentence, and the boxes before it are intermediate results.
        for prev, nxt in zip(reversed(matches[:-1]), reversed(matches[1:]), strict=True):
            earlier = _box_argument(text, prev.end())
            if earlier is None or not earlier.strip():
                break
            between = text[prev.end() : nxt.start()].replace(earlier, "", 1)  # the words after the earlier box
            if "\n" in between or _SENTENCE_END_RE.search(between):
                break
            parts.insert(0, earlier.strip())
    return ", ".join(parts)


def _box_argument(text: str, i: int) -> str | None:
    """The brace group starting at text[i] (after optional spaces and a [..] option), or a bare token."""
    j = i
    while j < len(text) and text[j].isspace():
        j += 1
    if j < len(text) and text[j] == "[":  # \framebox[width]{...}
        close = text.find("]", j)
        if close < 0:
            return None
        j = close + 1
        while j < len(text) and text[j].isspace():
            j += 1
    if j >= len(text):
        return None
    if text[j] != "{":
        if j == i:  # "\boxedx" is not a box; "\boxed 5" is
            return None
        token = re.match(r"[^\s$]+", text[j:])
        return token.group(0) if token else None
    depth = 0
    k = j
    while k < len(text):
        c = text[k]
        if c == "\\":
            k += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[j + 1 : k]
        k += 1
    return None


def _answer_phrase(text: str) -> str | None:
    matches = list(_PHRASE_RE.finditer(text))
    if not matches:
        return None
    rest = text[matches[-1].end() :].split("\n", 1)[0].strip().strip("*").strip()
    for opening, closing in _MATH_DELIMS:
        if rest.startswith(opening):
            end = rest.find(closing, len(opening))
            if end > 0:
                rest = rest[len(opening) : end]
            break
    else:
        end = _SENTENCE_END_RE.search(rest)
        if end:
            rest = rest[: end.start()]
    rest = rest.strip().rstrip(".;,").strip()
    return rest or None


# --------------------------------------------------------------------------------------------------
# Gold answers
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MathGold:
    """A normalised gold answer: alternative spellings (any one matching is correct) and an optional unit."""

    answers: tuple[str, ...]
    unit: str | None = None
    multiple: bool = False  # several values make the answer (OlympiadBench's is_multiple_answer): see extract_answer

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> MathGold:
        """Gold of a benchmark record, honouring OlympiadBench's `unit` and `is_multiple_answer` fields."""
        if "answer" not in record:
            raise ValueError(f"math record has no 'answer' field (keys: {sorted(record)})")
        answer = record["answer"]
        unit = record.get("unit") or None
        if record.get("is_multiple_answer"):
            if isinstance(answer, list) and len(answer) > 1:
                return cls((", ".join(_gold_text(a, f"answer[{i}]") for i, a in enumerate(answer)),), unit, True)
            return MathGold(normalize_gold(answer, unit=unit).answers, unit, True)
        return normalize_gold(answer, unit=unit)


def normalize_gold(gold: Any, unit: str | None = None) -> MathGold:
    """Gold as stored (str, number, list of alternatives, or MathGold) -> MathGold; bad input raises."""
    if isinstance(gold, MathGold):
        return gold if unit is None else MathGold(gold.answers, unit)
    if unit is not None and not isinstance(unit, str):
        raise TypeError(f"unit: expected str or None, got {type(unit).__name__}")
    if isinstance(gold, list | tuple):
        if not gold:
            raise ValueError("gold: empty list")
        return MathGold(tuple(_gold_text(g, f"gold[{i}]") for i, g in enumerate(gold)), unit or None)
    return MathGold((_gold_text(gold, "gold"),), unit or None)


def _gold_text(value: Any, where: str) -> str:
    if isinstance(value, bool):
        raise TypeError(f"{where}: a bool is not a math answer ({value!r})")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where}: non-finite number {value!r}")
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, str):
        text = _strip_dollars(value).strip()
        if not text:
            raise ValueError(f"{where}: empty answer string {value!r}")
        return text
    raise TypeError(f"{where}: expected str, int, float or list, got {type(value).__name__}")


def _strip_dollars(text: str) -> str:
    """Math delimiters and currency signs carry no value: "$69$,$84$" -> "69,84", "\\$18.90" -> "18.90"."""
    return text.replace("\\$", "").replace("$", "")


_SCI_RE = re.compile(r"(?<![\w.\\])(\d+(?:\.\d*)?|\.\d+)[eE]([+-]?\d+)(?![\w.])")


def as_boxed_latex(answer: str, unit: str | None) -> str:
    """The text handed to math-verify's parser, for gold and prediction alike (so both parse the same way)."""
    text = _strip_dollars(answer).strip()
    text = re.sub(r"(\d)\.$", r"\1", text)  # "\boxed{3.}": a sentence's full stop inside the box
    text = _SCI_RE.sub(r"\1\\times10^{\2}", text)
    if unit:
        text = _strip_unit(text, unit)
    return "\\boxed{" + text + "}"


def _unit_variants(unit: str) -> list[str]:
    u = unit.replace("$", "").strip()
    variants = {u}
    if u in ("%", "\\%"):
        variants |= {"%", "\\%"}
    if "circ" in u:
        variants |= {"^{\\circ}", "^\\circ", "\\circ", "°"}
    return sorted((v for v in variants if v), key=len, reverse=True)


def _strip_unit(text: str, unit: str) -> str:
    for v in _unit_variants(unit):
        word = re.escape(v) + ("s?" if v.isalpha() else "")
        pattern = (
            r"(?:\\[,;: !]|~|\s)*(?:\\(?:text|mathrm|textrm|mbox|rm)\s*\{\s*~?\s*" + word + r"\s*\}|" + word + r")\s*$"
        )
        stripped = re.sub(pattern, "", text)
        if stripped != text and stripped.strip():
            return stripped.strip()
    return text


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def with_last_number(response: str) -> str:
    """`reward.math_last_number_fallback`: a response with no boxed answer is scored on its last number.
    Off by default (it rewards ignoring the requested format); on for the CPU demo, whose 135M model
    rarely writes \\boxed{} at first and would otherwise see almost no reward."""
    if extract_answer(response) is not None:
        return response
    numbers = _NUMBER.findall(response)
    return f"{response}\n\\boxed{{{numbers[-1]}}}" if numbers else response
