"""The loop's view of the rewarders: a step's groups scored in one batch, by dataset type."""

import json

import pytest

from gapo.config import RewardConfig
from gapo.data import Problem
from gapo.reward.math_answer import with_last_number
from gapo.reward.registry import score_groups


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


# --- records that cannot be scored: found before step 1, not at a random step (issue 27) ------------------------
BAD_MATH = [  # (answer as stored, reason)
    ("", "empty answer"),
    ("   ", "empty answer"),
    (None, "no answer"),
    (["7", ""], "empty answer"),
    ([], "empty answer"),
    ({"value": 3}, "unsupported answer"),
    (True, "unsupported answer"),
]
BAD_CODE = [  # (tests as stored, reason)
    ("this is {not json", "tests unparseable"),
    ('{"inputs": [], "outputs": []}', "no test cases"),
    ("[]", "no test cases"),
    (None, "tests unparseable"),
]


@pytest.mark.parametrize("gold, reason", BAD_MATH)
def test_math_records_the_rewarder_cannot_score_are_named(gold, reason):
    from gapo.reward.registry import invalid_reason

    assert invalid_reason("math", Problem("p", "What is 2 + 5?", gold))[0] == reason


@pytest.mark.parametrize("tests, reason", BAD_CODE)
def test_code_records_the_rewarder_cannot_score_are_named(tests, reason):
    from gapo.reward.registry import invalid_reason

    assert invalid_reason("code", Problem("p", "Print 1.", tests))[0] == reason


def test_check_problems_keeps_the_scoreable_ones_in_order():
    from gapo.reward.registry import check_problems, dropped_summary

    probs = [Problem("a", "q1", "1"), Problem("b", "q2", ""), Problem("c", "   ", "3"), Problem("d", "q4", 4.0),
             Problem("e", "q5", None)]
    kept, dropped = check_problems("math", probs, "train")
    assert [p.uid for p in kept] == ["a", "d"]
    assert [(d.source, d.uid, d.reason) for d in dropped] == [
        ("train", "b", "empty answer"), ("train", "c", "empty prompt"), ("train", "e", "no answer")]
    assert dropped_summary(dropped, 5) == "3 of 5 records (empty answer: 1, empty prompt: 1, no answer: 1)"
    good = '{"inputs": ["1\\n"], "outputs": ["1\\n"]}'
    assert check_problems("code", [Problem("x", "Echo.", good)], "lcb")[1] == []


def test_one_failing_group_costs_only_its_own_rollouts(monkeypatch, caplog):
    """A rewarder failure inside a step (here injected for problem "b") is retried group by group: the other
    groups are scored for real, the failing one gets status error, logged with its problem id."""
    monkeypatch.setenv("GAPO_FAULT", "score_raise:b")
    probs = [Problem("a", "q", "4"), Problem("b", "q", "5"), Problem("c", "q", "6")]
    groups = [["\\boxed{4}", "\\boxed{3}"], ["\\boxed{5}", "\\boxed{5}"], ["\\boxed{6}", "no idea"]]
    res = score_groups("math", groups, probs, RewardConfig())
    assert [[r.status for r in g] for g in res] == [["correct", "wrong"], ["error", "error"], ["correct", "no_answer"]]
    assert "injected rewarder failure" in res[1][0].detail
    assert "problem b: scoring raised RuntimeError" in caplog.text


def test_training_set_drops_or_refuses_bad_records(tmp_path):
    from transformers import AutoTokenizer

    from gapo.config import DataConfig
    from gapo.errors import ConfigError
    from gapo.models import resolve_model
    from gapo.reward.registry import training_set

    f = tmp_path / "mixed.jsonl"
    rows = [{"id": "ok1", "problem": "What is 1 + 1?", "answer": "2"}, {"id": "empty", "problem": "1+2?", "answer": ""},
            {"id": "null", "problem": "1+3?", "answer": None}, {"id": "ok2", "problem": "What is 2 + 2?", "answer": 4}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = AutoTokenizer.from_pretrained(resolve_model("tiny-qwen2"))
    problems, ids, dropped = training_set(DataConfig(train=str(f)), tok)
    assert [p.uid for p in problems] == ["ok1", "ok2"] and len(ids) == 2
    assert [(d.uid, d.reason) for d in dropped] == [("empty", "empty answer"), ("null", "no answer")]
    with pytest.raises(ConfigError, match=r"data.train: 2 of 4 records .* \(data.on_invalid=error\): empty: empty "
                                          r"answer .*; null: no answer"):
        training_set(DataConfig(train=str(f), on_invalid="error"), tok)
    f.write_text(json.dumps({"problem": "q", "answer": ""}) + "\n")
    with pytest.raises(ConfigError, match="no record can be scored: 1 of 1 records"):
        training_set(DataConfig(train=str(f)), tok)


def test_too_many_errored_rollouts_stop_the_step(monkeypatch):
    """Defence in depth has a floor: up to reward.max_error_frac of a step's rollouts may fail to score (their
    groups get no gradient); more means a broken rewarder, and the run stops rather than train on nothing."""
    import torch

    from gapo.reward.registry import RewardsFailed, check_rewards
    from gapo.reward.types import RewardResult

    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t: None)  # one rank: the sum is its own count
    ok, bad = RewardResult(reward=1.0, status="correct"), RewardResult(reward=0.0, status="error")
    check_rewards([bad] * 2 + [ok] * 6, 0.25, 3, torch.device("cpu"))  # 2 of 8 = the share allowed
    with pytest.raises(RewardsFailed, match=r"step 3: 3 of 8 rollouts could not be scored .*max_error_frac=0.25"):
        check_rewards([bad] * 3 + [ok] * 5, 0.25, 3, torch.device("cpu"))
