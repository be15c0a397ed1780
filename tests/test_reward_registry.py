"""The loop's view of the rewarders: a step's groups scored in one batch, by dataset type."""

import json

import pytest

from gapo.config import RewardConfig
from gapo.data import Problem
from gapo.reward.registry import score_groups, with_last_number


def test_last_number_fallback_only_without_a_box():
    assert with_last_number("12 + 17 = 29.").endswith("\\boxed{29}")
    assert with_last_number("so -3.5 it is") .endswith("\\boxed{-3.5}")
    assert with_last_number("The answer is \\boxed{4}, not 5") == "The answer is \\boxed{4}, not 5"
    assert with_last_number("no digits here") == "no digits here"


def test_math_groups_use_record_metadata_and_fallback_switch():
    probs = [Problem("a", "q", ["45"], {"unit": "minutes"}), Problem("b", "q", 142.0)]
    groups = [["It takes \\boxed{45 minutes}.", "\\boxed{44}"], ["so 142", "\\boxed{142}"]]
    strict = score_groups("math", groups, probs, RewardConfig())
    assert [[r.status for r in g] for g in strict] == [["correct", "wrong"], ["no_answer", "correct"]]
    lenient = score_groups("math", groups, probs, RewardConfig(math_last_number_fallback=True))
    assert [[r.reward for r in g] for g in lenient] == [[1.0, 0.0], [1.0, 1.0]]


def test_code_groups_run_in_the_sandbox(shared_data):
    item = json.loads(shared_data("code/leetcode.json").read_text())[0]
    prob = Problem("lc0", item["problem"], item["tests"])
    good = f"```python\n{item['solutions']}\n```"
    (res,) = score_groups("code", [[good, "```python\nprint(1)\n```"]], [prob], RewardConfig(code_timeout_s=10))
    assert [r.status for r in res][0] == "correct" and res[1].reward == 0.0


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="data.type='chess'"):
        score_groups("chess", [["x"]], [Problem("a", "q", "1")], RewardConfig())
