"""Code rewarder: extract the program from a response, run it in the sandbox against the problem's tests.

Program extraction: the LAST complete fenced block tagged python/py/python3/py3 (any case); if there is
none, the last complete block with no language tag. Blocks tagged with another language are ignored (they
are not Python), and an unterminated final fence (a truncated response) is not a block. No block ->
status `no_answer`. The block is dedented, so fences inside markdown lists work.

Test formats (`tests` is the raw string, parsed with ast.literal_eval or, failing that, as JSON, never
eval; or the already-parsed object):
  * stdin/stdout: Codeforces `[{"input", "output"}, ...]`; code_contests and TACO/APPS
    `{"inputs": [...], "outputs": [...]}`; APPS' raw `{"input_output": "<json>"}`; LiveCodeBench items
    with `"testtype": "stdin"`; PrimeIntellect items with `"type": "stdin_stdout"`.
  * call-based: TACO/APPS with `fn_name` and PrimeIntellect items with `"type": "function_call"` (inputs
    are argument lists; an expected output wrapped in a one-element list also matches the bare value,
    TACO's convention); LiveCodeBench items with
    `"testtype": "functional"` and `metadata.func_name` (one JSON argument per input line). The function is
    a top-level function or a method of `class Solution`.
  * check(candidate) programs: LeetCode `{"functional": "<program that ends with check(Solution().m)>"}`
    and HumanEval+ `{"test": "<defines check(candidate)>", "entry_point": "name"}`. Call-based and check
    cases get the names DeepCoder's harness provides (sandbox_harness.PRELUDE: typing, collections, heapq, math,
    `xor`, ...; TreeNode, ListNode, tree_node, list_node, is_same_tree, is_same_list).

Comparison (done here, in the parent, never inside the sandbox):
  * stdout: line endings normalised, trailing whitespace of every line and trailing blank lines ignored;
    lines are then compared token by token (so runs of spaces do not matter). A token whose EXPECTED text
    is a float literal (has '.', 'e' or 'E', or is inf/nan) matches a number within 1e-6 absolute or relative
    error (the usual judge tolerance); integer and text tokens must match exactly.
  * call-based values: JSON values compared structurally (tuples returned by the program arrive as lists);
    bools only equal bools; two ints exactly; if either number is a float, within 1e-6 absolute or relative.
Problems that accept several correct outputs need a special checker, which these formats do not carry:
such a problem only rewards the stored output. Reward 1.0 only if every case passes; the run stops at the
first failing case. A case that runs out of
time (wall clock or CPU) gives status `timeout`; a failure of the sandbox itself gives `error` and is logged. So does
a program killed from outside (status "killed" from the sandbox: a signal that neither the program, nor its limits,
nor the harness sent, such as the OOM killer's SIGKILL well under the CPU limit): that is the host's fault, no
verdict on the program, so it is an `error` naming the signal, with the flag "host_fault" (counted in the step's
metrics as reward/host_fault_frac), never `wrong`.
`timeout_s` is the budget of ONE case (one execution of the program).
"""

from __future__ import annotations

import ast
import json
import logging
import math
import re
import textwrap
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from gapo.reward.sandbox import (
    GUARD_NAME,
    CallCase,
    Case,
    CaseOutcome,
    CheckCase,
    Limits,
    StdioCase,
    run_program,
)
from gapo.reward.types import FLAG_HOST_FAULT, FLAG_UNISOLATED, Rewarder, RewardResult, signal_name

if TYPE_CHECKING:
    from gapo.config import RewardConfig
    from gapo.data import Problem

logger = logging.getLogger("gapo.reward")

_SHOWN_CHARS = 120


# --------------------------------------------------------------------------------------------------
# Program extraction
# --------------------------------------------------------------------------------------------------
_FENCE_RE = re.compile(r"^[ \t]*```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)^[ \t]*```", re.DOTALL | re.MULTILINE)
_PYTHON_TAGS = {"python", "py", "python3", "py3"}


def extract_code(response: str) -> str | None:
    """The program in a response by the rules in the module docstring, or None."""
    python_blocks, untagged_blocks = [], []
    for match in _FENCE_RE.finditer(response):
        tag, body = match.group(1).lower(), textwrap.dedent(match.group(2))
        if tag in _PYTHON_TAGS:
            python_blocks.append(body)
        elif not tag:
            untagged_blocks.append(body)
    blocks = python_blocks or untagged_blocks
    if not blocks or not blocks[-1].strip():
        return None
    return blocks[-1]


# --------------------------------------------------------------------------------------------------
# Test formats
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TestSuite:
    """A problem's tests in one shape: the sandbox cases and, per case, what the parent expects back
    (expected stdout text, expected JSON value, or None for check programs, which judge themselves)."""

    cases: tuple[Case, ...]
    expected: tuple[Any, ...]
    unwrap_single: bool = False  # TACO call-based: [x] also matches x


def parse_tests(tests: Any) -> TestSuite:
    """A problem's `tests` field as stored (string or parsed) -> TestSuite; bad input raises, naming the item."""
    if isinstance(tests, bytes):
        tests = tests.decode()
    if isinstance(tests, str):
        tests = _literal(tests, "tests")
    if isinstance(tests, dict):
        return _from_dict(tests)
    if isinstance(tests, list | tuple):
        return _from_list(list(tests))
    raise TypeError(f"tests: expected a str, dict or list, got {type(tests).__name__}")


def _literal(text: str, where: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as literal_error:
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise ValueError(f"{where}: neither a Python literal nor JSON ({literal_error})") from None


def _from_dict(tests: dict) -> TestSuite:
    if "functional" in tests:
        program = _check_program(tests["functional"], "tests['functional']")
        return TestSuite((CheckCase(program),), (None,))
    if "test" in tests and "entry_point" in tests:
        program = _check_program(tests["test"], "tests['test']")
        entry = tests["entry_point"]
        if not isinstance(entry, str) or not entry.isidentifier():
            raise ValueError(f"tests['entry_point']: expected a function name, got {entry!r}")
        return TestSuite((CheckCase(program, entry),), (None,))
    if "input_output" in tests:
        return _from_dict(_literal(tests["input_output"], "tests['input_output']")
                          if isinstance(tests["input_output"], str) else tests["input_output"])
    if "inputs" in tests and "outputs" in tests:
        inputs, outputs = tests["inputs"], tests["outputs"]
        if not isinstance(inputs, list) or not isinstance(outputs, list):
            raise ValueError("tests['inputs'] and tests['outputs'] must be lists")
        if len(inputs) != len(outputs):
            raise ValueError(f"tests: {len(inputs)} inputs but {len(outputs)} outputs")
        if not inputs:
            raise ValueError("tests: no test cases")
        fn_name = tests.get("fn_name")
        if fn_name:
            cases = tuple(_call_case(fn_name, x, f"tests['inputs'][{i}]") for i, x in enumerate(inputs))
            return TestSuite(cases, tuple(outputs), unwrap_single=True)
        cases = tuple(StdioCase(_text(x, f"tests['inputs'][{i}]")) for i, x in enumerate(inputs))
        return TestSuite(cases, tuple(_text(y, f"tests['outputs'][{i}]") for i, y in enumerate(outputs)))
    raise ValueError(
        f"tests: unrecognised dict with keys {sorted(tests)}; expected 'functional', 'test'+'entry_point', "
        "'inputs'+'outputs' or 'input_output'"
    )


def _from_list(tests: list) -> TestSuite:
    if not tests:
        raise ValueError("tests: empty list")
    cases: list[Case] = []
    expected: list[Any] = []
    wrapped = False
    for i, item in enumerate(tests):
        where = f"tests[{i}]"
        if not isinstance(item, dict) or "input" not in item or "output" not in item:
            raise ValueError(f"{where}: expected a dict with 'input' and 'output'")
        if item.get("type") == "function_call":  # PrimeIntellect: TACO's call-based convention, [x] matches x
            cases.append(_call_case(item.get("fn_name"), item["input"], f"{where}['input']"))
            expected.append(item["output"])
            wrapped = True
        elif item.get("testtype", "stdin") == "functional":
            metadata = item.get("metadata") or {}
            if isinstance(metadata, str):
                metadata = _literal(metadata, f"{where}['metadata']")
            fn_name = item.get("fn_name") or metadata.get("func_name")
            if not fn_name:
                raise ValueError(f"{where}: functional test without metadata.func_name")
            raw = item["input"]
            args = [_json_arg(line, f"{where}['input']") for line in raw.split("\n")] if isinstance(raw, str) else raw
            cases.append(_call_case(fn_name, args, f"{where}['input']"))
            out = item["output"]
            expected.append(_json_arg(out, f"{where}['output']") if isinstance(out, str) else out)
        else:
            cases.append(StdioCase(_text(item["input"], f"{where}['input']")))
            expected.append(_text(item["output"], f"{where}['output']"))
    return TestSuite(tuple(cases), tuple(expected), unwrap_single=wrapped)


def _call_case(fn_name: Any, args: Any, where: str) -> CallCase:
    if not isinstance(fn_name, str) or not fn_name.isidentifier():
        raise ValueError(f"fn_name: expected a function name, got {fn_name!r}")
    if isinstance(args, str):
        args = [_json_arg(line, where) for line in args.split("\n") if line.strip()]
    if not isinstance(args, list | tuple):
        raise ValueError(f"{where}: call-based input must be a list of arguments, got {type(args).__name__}")
    try:
        json.dumps(list(args))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: arguments are not plain JSON data ({exc})") from None
    return CallCase(fn_name, list(args))


def _json_arg(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc}): {text[:80]!r}") from None


def _text(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(value)  # TACO sometimes stores the lines
    raise ValueError(f"{where}: expected a string, got {type(value).__name__}")


def _check_program(program: Any, where: str) -> str:
    """The test program with every top-level `check(x)` turned into `check(__gapo_guard__(x))`, so the
    values the solution returns to the asserts must be plain data (see sandbox)."""
    if not isinstance(program, str) or not program.strip():
        raise ValueError(f"{where}: expected a non-empty test program")
    try:
        tree = ast.parse(program)
    except SyntaxError as exc:
        raise ValueError(f"{where}: the test program does not parse ({exc})") from None
    for node in tree.body:
        call = node.value if isinstance(node, ast.Expr) else None
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "check":
            call.args = [ast.Call(ast.Name(GUARD_NAME, ast.Load()), [arg], []) for arg in call.args]
    return ast.unparse(ast.fix_missing_locations(tree))


# --------------------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------------------
_TOLERANCE = 1e-6


def outputs_match(got: str, expected: str) -> bool:
    """Judge-style stdout comparison (rules in the module docstring)."""
    got_lines, expected_lines = _lines(got), _lines(expected)
    if len(got_lines) != len(expected_lines):
        return False
    for g, e in zip(got_lines, expected_lines, strict=True):
        if g == e:
            continue
        g_tokens, e_tokens = g.split(), e.split()
        if len(g_tokens) != len(e_tokens):
            return False
        if not all(a == b or _float_tokens_close(a, b) for a, b in zip(g_tokens, e_tokens, strict=True)):
            return False
    return True


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _float_tokens_close(got: str, expected: str) -> bool:
    if not any(c in expected for c in ".eE") and expected.lower().lstrip("+-") not in ("inf", "nan"):
        return False
    try:
        g, e = float(got), float(expected)
    except ValueError:
        return False
    return _close(g, e)


def _close(g: float, e: float) -> bool:
    if math.isnan(e) or math.isnan(g):
        return math.isnan(e) and math.isnan(g)
    return g == e or abs(g - e) <= _TOLERANCE * max(1.0, abs(e))


def values_match(got: Any, expected: Any) -> bool:
    """Structural comparison of call-based results (rules in the module docstring)."""
    if isinstance(got, bool) or isinstance(expected, bool):
        return type(got) is type(expected) and got == expected
    if isinstance(got, int | float) and isinstance(expected, int | float):
        if isinstance(got, int) and isinstance(expected, int):
            return got == expected
        return _close(float(got), float(expected))
    if isinstance(got, list | tuple) and isinstance(expected, list | tuple):
        return len(got) == len(expected) and all(values_match(a, b) for a, b in zip(got, expected, strict=True))
    if isinstance(got, dict) and isinstance(expected, dict):
        return got.keys() == expected.keys() and all(values_match(got[k], expected[k]) for k in got)
    return type(got) is type(expected) and got == expected


def _case_verdict(suite: TestSuite, index: int, outcome: CaseOutcome) -> str | None:
    """None if the case passed, else a short reason."""
    if outcome.status == "killed":
        return (f"the program was killed by {signal_name(-(outcome.exit_code or 0))} from outside the sandbox "
                "(not its own limits): a host fault, no verdict")
    if outcome.status != "ok":
        reason = {"timeout": "time limit exceeded", "output_limit": "output limit exceeded"}.get(outcome.status)
        if reason is None:
            last = outcome.stderr.strip().splitlines()[-1:] or [f"exit code {outcome.exit_code}"]
            reason = f"runtime error or failed check: {last[0][:_SHOWN_CHARS]}"
        return reason
    case, expected = suite.cases[index], suite.expected[index]
    if isinstance(case, StdioCase):
        if outputs_match(outcome.stdout or "", expected):
            return None
        return f"wrong output: got {(outcome.stdout or '')[:_SHOWN_CHARS]!r}, expected {expected[:_SHOWN_CHARS]!r}"
    if isinstance(case, CallCase):
        try:
            got = json.loads(outcome.value or "")
        except json.JSONDecodeError:
            return "the return value did not arrive as JSON"
        if values_match(got, expected):
            return None
        if suite.unwrap_single and isinstance(expected, list) and len(expected) == 1 and values_match(got, expected[0]):
            return None
        return f"wrong value: got {str(got)[:_SHOWN_CHARS]}, expected {str(expected)[:_SHOWN_CHARS]}"
    return None  # a check case with status "ok" delivered the harness nonce


# --------------------------------------------------------------------------------------------------
# The runner (a persistent thread pool; the work happens in sandbox processes)
# --------------------------------------------------------------------------------------------------
class CodeRunner(Rewarder):
    """Scores code responses with at most `num_workers` sandboxes running at once. Reuse one instance:
    its thread pool persists across calls. `score` takes one group (k responses and the problem's tests, any
    format in the module docstring), `score_batch` many at once."""

    gold_name = "tests"

    def __init__(self, num_workers: int = 2, timeout_s: float = 10.0, memory_mb: int = 1024,
                 isolation: str = "auto") -> None:
        super().__init__(num_workers)
        self.limits = Limits(wall_s=float(timeout_s), memory_mb=int(memory_mb))
        self.isolation = isolation
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def parse_gold(self, tests: Any) -> TestSuite:
        return parse_tests(tests)

    def score_groups(self, groups: list[Sequence[str]], suites: list[TestSuite]) -> list[list[RewardResult]]:
        pool = self._executor()
        futures = [[pool.submit(self._score_one, response, suite) for response in responses]
                   for responses, suite in zip(groups, suites, strict=True)]
        return [[future.result() for future in row] for row in futures]

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
                self._pool = None

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.num_workers, thread_name_prefix="gapo-code-reward")
            return self._pool

    def _score_one(self, response: str, suite: TestSuite) -> RewardResult:
        program = extract_code(response)
        if program is None:
            return RewardResult.of("no_answer", "no fenced python code block")
        try:
            return self._run_suite(program, suite)
        except Exception as exc:  # a rewarder bug must cost one sample, not the training run
            logger.exception("code reward error for program %r", program[:_SHOWN_CHARS])
            return RewardResult.of("error", f"rewarder exception: {type(exc).__name__}: {exc}")

    def _run_suite(self, program: str, suite: TestSuite) -> RewardResult:
        failures: dict[int, str] = {}

        def stop_after(index: int, outcome: CaseOutcome) -> bool:
            reason = _case_verdict(suite, index, outcome)
            if reason is not None:
                failures[index] = reason
            return reason is not None

        run = run_program(program, suite.cases, self._limits_for(suite), stop_after=stop_after,
                          isolation=self.isolation)
        flags = () if run.isolated else (FLAG_UNISOLATED,)
        if failures:
            index, reason = next(iter(failures.items()))
            if run.outcomes[index].status == "killed":
                logger.warning("code reward error on test %d: %s", index + 1, reason)
                return RewardResult.of("error", f"test {index + 1}/{len(suite.cases)}: {reason}",
                                       (*flags, FLAG_HOST_FAULT))
            status = "timeout" if run.outcomes[index].status == "timeout" else "wrong"
            if status == "timeout":
                logger.info("code reward timeout on test %d of program %r", index, program[:_SHOWN_CHARS])
            return RewardResult.of(status, f"test {index + 1}/{len(suite.cases)}: {reason}", flags)
        if run.error is not None or len(run.outcomes) != len(suite.cases):
            logger.warning("code reward sandbox error (%s) for program %r", run.error, program[:_SHOWN_CHARS])
            return RewardResult.of("error", f"sandbox failure: {run.error}",
                                   (*flags, FLAG_HOST_FAULT) if run.host_fault else flags)
        return RewardResult.of("correct", f"passed {len(suite.cases)}/{len(suite.cases)} tests", flags)

    def _limits_for(self, suite: TestSuite) -> Limits:
        """Allow output a few times the largest expected one, so big correct outputs are never cut."""
        longest = max((len(e) for e in suite.expected if isinstance(e, str)), default=0)
        cap = max(self.limits.max_output_bytes, 4 * longest + 65536)
        if cap == self.limits.max_output_bytes:
            return self.limits
        return replace(self.limits, max_output_bytes=cap)


# --------------------------------------------------------------------------------------------------
# The rewarder table's row (gapo.reward.registry.REWARDERS["code"])
# --------------------------------------------------------------------------------------------------
def default_runner(num_workers: int = 2, timeout_s: float = 10.0, memory_mb: int = 1024) -> CodeRunner:
    """The shared runner for these settings, created on first use and kept for the life of the process."""
    return CodeRunner.shared(num_workers, float(timeout_s), int(memory_mb))


def check_record(problem: Problem) -> tuple[str, str] | None:
    """(reason, detail) when the record's tests do not parse into a suite with at least one case, else None."""
    if problem.gold is None:
        return "tests unparseable", "the tests field is null"
    try:
        suite = parse_tests(problem.gold)
    except (TypeError, ValueError, SyntaxError, RecursionError, MemoryError) as err:
        return ("no test cases" if "no test cases" in str(err) or "empty list" in str(err)
                else "tests unparseable"), str(err)[:300]
    return None if suite.cases else ("no test cases", "the test suite holds no case")


def score_records(groups: list[list[str]], problems: list[Problem], cfg: RewardConfig) -> list[list[RewardResult]]:
    """Each group of responses against its record's tests, all groups in one batch on the shared sandbox runner."""
    runner = default_runner(cfg.num_workers, cfg.code_timeout_s, cfg.code_memory_mb)
    return runner.score_batch([(g, p.gold) for g, p in zip(groups, problems, strict=True)])
