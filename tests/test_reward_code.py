"""Code rewarder: extraction, test formats, output comparison, verdicts through the real sandbox, and
the LeetCode / code_contests / Codeforces data.

Real-data results, asserted below:
  * LeetCode (200 items): 199/200 reference solutions pass. The exception imports
    `sortedcontainers.SortedList` (LeetCode's judge ships that package; this environment does not:
    installing `sortedcontainers` would make it 200/200). Every broken variant (each Solution method's
    body replaced by `return None`) fails: 200/200.
  * code_contests: item 140 (squares and cubes, 138 stdin/stdout cases) passes with a short correct
    program and fails with an off-by-one one. Codeforces item 0 (min/max) likewise. Every item of both
    files parses into cases.
"""

from __future__ import annotations

import ast
import json
import logging
from pathlib import Path

import pytest
from conftest import fenced

import gapo.reward.code as code_module
from gapo.reward.code import (
    CodeRunner,
    default_runner,
    extract_code,
    outputs_match,
    parse_tests,
    values_match,
)
from gapo.reward.sandbox import CallCase, CheckCase, SandboxRun, StdioCase, run_program


@pytest.fixture(scope="module")
def runner():
    # Room for a loaded machine's slow start (3 s once timed out a correct program); one test waits it out (a loop).
    with CodeRunner(num_workers=2, timeout_s=8.0) as r:
        yield r


# --------------------------------------------------------------------------------------------------
# Extraction
# --------------------------------------------------------------------------------------------------
def test_extract_last_python_block() -> None:
    response = "```python\nprint(1)\n```\ntext\n```py\nprint(2)\n```\n```\nprint(3)\n```\n"
    assert extract_code(response) == "print(2)\n"


def test_extract_untagged_block_when_no_python_block() -> None:
    assert extract_code("```cpp\nint main(){}\n```\n```\nprint(3)\n```") == "print(3)\n"


def test_extract_ignores_other_languages_and_unterminated_fences() -> None:
    assert extract_code("```cpp\nint main(){}\n```") is None
    assert extract_code("```python\nprint(1)\n```\n```python\nprint(2)") == "print(1)\n"
    assert extract_code("no code at all") is None
    assert extract_code("```python\n\n```") is None


def test_extract_dedents_blocks_inside_lists() -> None:
    response = "1. Code:\n   ```Python\n   def f():\n       return 1\n   ```\n"
    assert extract_code(response) == "def f():\n    return 1\n"


# --------------------------------------------------------------------------------------------------
# Test formats
# --------------------------------------------------------------------------------------------------
def test_parse_codeforces_list_raw_and_parsed() -> None:
    raw = "[{'input': '1 2\\n', 'output': '3\\n'}, {'input': '5 5', 'output': '10'}]"
    suite = parse_tests(raw)
    assert suite.cases == (StdioCase("1 2\n"), StdioCase("5 5")) and suite.expected == ("3\n", "10")
    assert parse_tests(ast.literal_eval(raw)) == suite


def test_parse_code_contests_and_taco_stdio() -> None:
    suite = parse_tests({"inputs": ["1\n", ["2", "3"]], "outputs": ["a", ["b", "c"]]})
    assert suite.cases == (StdioCase("1\n"), StdioCase("2\n3")) and suite.expected == ("a", "b\nc")


def test_parse_taco_call_based() -> None:
    suite = parse_tests('{"inputs": [[1, 2], [[3], 4]], "outputs": [[3], 7], "fn_name": "add"}')
    assert suite.cases == (CallCase("add", [1, 2]), CallCase("add", [[3], 4]))
    assert suite.expected == ([3], 7) and suite.unwrap_single


def test_parse_apps_input_output_json() -> None:
    suite = parse_tests({"input_output": json.dumps({"inputs": ["x"], "outputs": ["y"]})})
    assert suite.cases == (StdioCase("x"),)


def test_parse_livecodebench_functional_and_stdin() -> None:
    tests = [
        {"input": "[1, 2, 3]\n4", "output": "10", "testtype": "functional", "metadata": {"func_name": "total"}},
        {"input": "[]\n0", "output": "0", "testtype": "functional", "metadata": '{"func_name": "total"}'},
    ]
    suite = parse_tests(tests)
    assert suite.cases == (CallCase("total", [[1, 2, 3], 4]), CallCase("total", [[], 0]))
    assert suite.expected == (10, 0)
    stdin = parse_tests([{"input": "3\n", "output": "9\n", "testtype": "stdin"}])
    assert stdin.cases == (StdioCase("3\n"),)


def test_parse_check_programs_are_guarded() -> None:
    leet = parse_tests({"functional": "def check(candidate):\n    assert candidate(1) == 2\n\ncheck(Solution().f)"})
    [case] = leet.cases
    assert isinstance(case, CheckCase) and "check(__gapo_guard__(Solution().f))" in case.program
    human = parse_tests({"test": "def check(candidate):\n    assert candidate(1) == 2\n", "entry_point": "inc"})
    assert human.cases[0].entry_point == "inc"


@pytest.mark.parametrize(
    ("tests", "error", "message"),
    [
        ("not a literal {", ValueError, "tests: neither a Python literal nor JSON"),
        (42, TypeError, "tests: expected a str, dict or list"),
        ({"inputs": ["1"], "outputs": []}, ValueError, "1 inputs but 0 outputs"),
        ({"inputs": [], "outputs": []}, ValueError, "no test cases"),
        ({"foo": 1}, ValueError, "unrecognised dict with keys \\['foo'\\]"),
        ([{"input": "1"}], ValueError, r"tests\[0\]: expected a dict with 'input' and 'output'"),
        ([], ValueError, "empty list"),
        ({"functional": "def check(:"}, ValueError, r"tests\['functional'\]: the test program does not parse"),
        ({"test": "def check(c): pass", "entry_point": "not a name"}, ValueError, "entry_point"),
        ({"inputs": [[1]], "outputs": [1], "fn_name": "x y"}, ValueError, "fn_name"),
        ({"inputs": [{1, 2}], "outputs": [1], "fn_name": "f"}, ValueError, r"tests\['inputs'\]\[0\]"),
        ([{"input": "[1", "output": "1", "testtype": "functional", "metadata": {"func_name": "f"}}],
         ValueError, r"tests\[0\]\['input'\]: not JSON"),
        ({"inputs": [3], "outputs": ["1"]}, ValueError, r"tests\['inputs'\]\[0\]: expected a string"),
    ],
)
def test_bad_tests_raise_naming_the_field(tests, error, message) -> None:
    with pytest.raises(error, match=message):
        parse_tests(tests)


def test_bad_responses_raise_naming_the_item(runner: CodeRunner) -> None:
    with pytest.raises(TypeError, match=r"responses\[1\]"):
        runner.score(["x", None], {"inputs": ["1"], "outputs": ["1"]})
    with pytest.raises(ValueError, match=r"items\[0\]: tests: empty list"):
        runner.score(["x"], [])


def test_every_codeforces_and_code_contests_item_parses(shared_records) -> None:
    for name, count_key in (("code/codeforces.json", None), ("code/code_contests.json", "inputs")):
        for i, item in enumerate(shared_records(name)):
            suite = parse_tests(item["tests"])
            stored = item["tests"] if count_key is None else item["tests"][count_key]
            assert len(suite.cases) == len(stored) >= 1, (name, i)
            assert all(isinstance(c, StdioCase) for c in suite.cases)


# --------------------------------------------------------------------------------------------------
# Comparison rules
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("got", "expected", "match"),
    [
        ("1 2\n3\n", "1 2\n3", True),
        ("1 2  \r\n3\r\n\r\n", "1 2\n3\n", True),  # trailing spaces, CRLF, trailing blank lines
        ("1  2\n", "1 2\n", True),  # runs of spaces inside a line
        ("1 2\n", "1 2 3\n", False),
        ("1\n2\n", "1\n", False),
        ("\n1\n", "1\n", False),  # a leading blank line is a difference
        ("0.3333339\n", "0.333333\n", True),  # float expected: 1e-6 tolerance
        ("0.3334\n", "0.333333\n", False),
        ("1\n", "1.000000\n", True),
        ("1.0\n", "1\n", False),  # integer expected: exact
        ("100000000000000001\n", "100000000000000000\n", False),
        ("YES\n", "yes\n", False),
        ("nan\n", "nan\n", True),
    ],
)
def test_outputs_match(got: str, expected: str, match: bool) -> None:
    assert outputs_match(got, expected) is match


@pytest.mark.parametrize(
    ("got", "expected", "match"),
    [
        ([1, 2], [1, 2], True),
        ([1, 2], [2, 1], False),
        (1, True, False),
        (True, True, True),
        (0.1 + 0.2, 0.3, True),
        (3, 3.0000001, True),
        (3, 4, False),
        ({"a": [1.0]}, {"a": [1]}, True),
        ("1", 1, False),
        (None, [], False),
    ],
)
def test_values_match(got, expected, match: bool) -> None:
    assert values_match(got, expected) is match


# --------------------------------------------------------------------------------------------------
# Verdicts through the real sandbox
# --------------------------------------------------------------------------------------------------
STDIO_TESTS = {"inputs": ["1 2\n", "10 20\n", "-1 1\n"], "outputs": ["3\n", "30\n", "0\n"]}


def test_stdio_verdicts(runner: CodeRunner) -> None:
    responses = [
        fenced("a, b = map(int, input().split())\nprint(a + b)"),
        fenced("a, b = map(int, input().split())\nprint(a * b)"),
        fenced("import sys\nprint(sum(map(int, sys.stdin.read().split())))\nsys.exit(0)"),
        fenced("print(1/0)"),
        "I would just add them.",
        fenced("while True:\n    pass"),
    ]
    results = runner.score(responses, STDIO_TESTS)
    assert [r.status for r in results] == ["correct", "wrong", "correct", "wrong", "no_answer", "timeout"]
    assert [r.reward for r in results] == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert "ZeroDivisionError" in results[3].detail
    assert all(r.flags == () for r in results)  # isolated: no "unisolated" flag


def test_stops_at_the_first_failing_case(runner: CodeRunner, monkeypatch) -> None:
    """Case 2 fails; case 3 (which would sleep past the deadline) never runs: the sandbox reports two outcomes. Counted,
    not timed, so that a slow start on a loaded machine cannot fail it."""
    runs: list[SandboxRun] = []

    def recorded(*args, **kwargs) -> SandboxRun:
        runs.append(run_program(*args, **kwargs))
        return runs[-1]

    monkeypatch.setattr(code_module, "run_program", recorded)
    program = "import time\nn = int(input())\nif n == 3:\n    time.sleep(100)\nprint(n if n == 1 else -1)"
    [result] = runner.score([fenced(program)], {"inputs": ["1", "2", "3"], "outputs": ["1", "2", "3"]})
    assert result.status == "wrong" and result.detail.startswith("test 2/3")
    [run] = runs
    assert [o.status for o in run.outcomes] == ["ok", "ok"]


def test_call_based_taco_and_livecodebench(runner: CodeRunner) -> None:
    taco = {"inputs": [[1, 2], [5, 5]], "outputs": [[3], [10]], "fn_name": "add"}
    results = runner.score([fenced("def add(a, b):\n    return a + b"), fenced("def add(a, b):\n    return a - b"),
                            fenced("def plus(a, b):\n    return a + b")], taco)
    assert [r.status for r in results] == ["correct", "wrong", "wrong"]
    lcb = [{"input": "[1, 2, 3]\n2", "output": "[1, 2]", "testtype": "functional",
            "metadata": {"func_name": "firstK"}}]
    good = ("class Solution:\n    def firstK(self, nums: List[int], k: int) -> List[int]:\n"
            "        return tuple(nums[:k])")
    bad = "class Solution:\n    def firstK(self, nums, k):\n        return nums[-k:]"
    assert [r.status for r in runner.score([fenced(good), fenced(bad)], lcb)] == ["correct", "wrong"]


def test_humaneval_style_check(runner: CodeRunner) -> None:
    tests = {"test": "def check(candidate):\n    assert candidate([1, 2]) == 3\n    assert candidate([]) == 0\n",
             "entry_point": "total"}
    results = runner.score([fenced("def total(xs):\n    return sum(xs)"),
                            fenced("def total(xs):\n    return len(xs) + 1")], tests)
    assert [r.status for r in results] == ["correct", "wrong"]


def test_score_batch_and_entry_point_pool_reuse() -> None:
    groups = [([fenced("print(int(input()) * 2)")] * 2, {"inputs": ["4"], "outputs": ["8"]}),
              ([fenced("print('no')")], [{"input": "", "output": "yes"}])]
    first = default_runner(2, 4.0, 512).score_batch(groups)
    assert [[r.status for r in row] for row in first] == [["correct", "correct"], ["wrong"]]
    one = default_runner(2, 4.0, 512).score([fenced("print(5)")], "[{'input': '', 'output': '5'}]")
    assert [r.status for r in one] == ["correct"]
    assert default_runner(2, 4.0, 512) is default_runner(2, 4.0, 512)


def test_a_rewarder_failure_is_an_error_not_a_wrong_answer(runner: CodeRunner, monkeypatch, caplog) -> None:
    """Stand-in for a sandbox that cannot start (the real failure modes are covered in test_sandbox.py)."""

    def broken_sandbox(*args, **kwargs):
        raise OSError("unshare: cannot create namespace")

    monkeypatch.setattr(code_module, "run_program", broken_sandbox)
    with caplog.at_level(logging.ERROR, logger="gapo.reward"):
        [result] = runner.score([fenced("print(1)")], [{"input": "", "output": "1"}])
    assert result.status == "error" and "unshare" in result.detail
    assert any("code reward error" in r.getMessage() for r in caplog.records)


def test_unisolated_fallback_is_flagged(caplog) -> None:
    with CodeRunner(num_workers=1, timeout_s=3.0, isolation="none") as fallback:
        with caplog.at_level(logging.WARNING, logger="gapo.reward"):
            [result] = fallback.score([fenced("print(int(input()) + 1)")], {"inputs": ["1"], "outputs": ["2"]})
    assert result.status == "correct" and result.flags == ("unisolated",)


# --------------------------------------------------------------------------------------------------
# Real data
# --------------------------------------------------------------------------------------------------
def _break_solution(source: str) -> str:
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "Solution":
            for method in node.body:
                if isinstance(method, ast.FunctionDef):
                    method.body = [ast.Return(ast.Constant(None))]
    return ast.unparse(ast.fix_missing_locations(tree))


def test_leetcode_reference_solutions_pass_and_broken_ones_fail(shared_records) -> None:
    items = shared_records("code/leetcode.json")
    with CodeRunner(num_workers=2, timeout_s=10.0) as r:
        good = [row[0] for row in r.score_batch([([fenced(x["solutions"])], x["tests"]) for x in items])]
        broken = [row[0] for row in r.score_batch([([fenced(_break_solution(x["solutions"]))], x["tests"])
                                                   for x in items])]
    failures = {i: res for i, res in enumerate(good) if res.status != "correct"}
    print(f"LeetCode reference pass rate: {len(items) - len(failures)}/{len(items)}")
    # The one known exception needs the sortedcontainers package (see module docstring).
    assert all("sortedcontainers" in items[i]["solutions"] and "sortedcontainers" in res.detail
               for i, res in failures.items()), failures
    assert len(failures) <= 1
    assert [i for i, res in enumerate(broken) if res.status != "wrong"] == []


CUBES = """\
from math import isqrt

def iroot(n, k):
    r = int(round(n ** (1.0 / k)))
    while r ** k > n:
        r -= 1
    while (r + 1) ** k <= n:
        r += 1
    return r

t = int(input())
for _ in range(t):
    n = int(input())
    print(isqrt(n) + iroot(n, 3) - iroot(n, 6){off})
"""

MIN_MAX = """\
t = int(input())
for _ in range(t):
    x, y = map(int, input().split())
    print({pair})
"""


def test_code_contests_and_codeforces_items_with_short_solutions(runner: CodeRunner, shared_records) -> None:
    contests = shared_records("code/code_contests.json")[140]
    assert "squares" in contests["problem"] and len(contests["tests"]["inputs"]) == 138
    results = runner.score([fenced(CUBES.format(off="")), fenced(CUBES.format(off=" + 1"))], contests["tests"])
    assert [r.status for r in results] == ["correct", "wrong"]
    assert results[0].detail == "passed 138/138 tests"
    codeforces = shared_records("code/codeforces.json")[0]
    results = runner.score([fenced(MIN_MAX.format(pair="min(x, y), max(x, y)")),
                            fenced(MIN_MAX.format(pair="max(x, y), min(x, y)"))],
                           json.dumps(codeforces["tests"]))
    assert [r.status for r in results] == ["correct", "wrong"]


@pytest.mark.parametrize("source", ["primeintellect", "taco", "lcbv5"])
def test_deepcoder_sources_reference_solutions_pass_and_broken_ones_fail(runner: CodeRunner, source) -> None:
    """Each of DeepCoder's three training formats, loaded as training loads it (the function name and starter
    code of LiveCodeBench's functional problems come from the record), through the real sandbox."""
    from gapo.data import load_problems

    path = Path(__file__).parent / "fixtures" / "deepcoder" / f"{source}.jsonl"
    problems = load_problems(str(path), answer_key="tests")
    for p in problems:
        good = runner.score([fenced(p.meta["solutions"][0])], p.gold)
        assert [r.reward for r in good] == [1.0], (p.question, good)
        broken = p.meta["solutions"][0].replace("return ", "return 1 + ").replace("print(", "print(1, ")
        assert broken != p.meta["solutions"][0]
        assert [r.reward for r in runner.score([fenced(broken)], p.gold)] == [0.0], p.question
