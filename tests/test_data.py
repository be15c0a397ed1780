"""Loaders, the embedded arithmetic set, prompt building and the resumable sampler."""

import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gapo.configfile import resolve
from gapo.data import Sampler, arithmetic_problems, load_problems, load_training_set, tokenize_problems
from gapo.errors import ConfigError
from gapo.models import resolve_model

RECORDS = [{"question": "1+1?", "solution": "2", "id": "a"}, {"question": "2+3?", "solution": 5, "id": "b"}]


@pytest.mark.parametrize("fmt", ["json", "jsonl", "parquet"])
def test_file_formats_with_field_mapping(tmp_path, fmt):
    path = tmp_path / f"d.{fmt}"
    if fmt == "json":
        path.write_text(json.dumps(RECORDS))
    elif fmt == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    else:
        pq.write_table(pa.Table.from_pylist([{**r, "solution": str(r["solution"])} for r in RECORDS]), path)
    probs = load_problems(str(path), prompt_key="question", answer_key="solution")
    golds = ["2", "5"] if fmt == "parquet" else ["2", 5]  # a parquet column has one type
    assert [(p.uid, p.question, p.gold) for p in probs] == [("a", "1+1?", golds[0]), ("b", "2+3?", golds[1])]


def test_shared_benchmarks_keep_gold_as_stored(shared_data):
    amc = load_problems(str(shared_data("math/amc.json")))
    assert len(amc) == 83 and isinstance(amc[0].gold, float)
    olymp = load_problems(str(shared_data("math/olympiad_bench.json")))
    assert isinstance(olymp[0].gold, list) and "is_multiple_answer" in olymp[0].meta
    code = load_problems(str(shared_data("code/leetcode.json")), answer_key="tests")
    assert len(code) == 200 and "functional" in code[0].gold  # the tests field as stored


def test_bad_data_names_file_item_and_field(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_problems(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "x", "answer": 1}\n{"problem": \n')
    with pytest.raises(ConfigError, match=r"bad.jsonl: line 2: not valid JSON"):
        load_problems(str(bad))
    obj = tmp_path / "obj.json"
    obj.write_text('{"problem": "x"}')
    with pytest.raises(ConfigError, match="expected a JSON list of records"):
        load_problems(str(obj))
    torn = tmp_path / "torn.parquet"  # a copy cut short
    torn.write_bytes(b"PAR1" + b"\0" * 40)
    with pytest.raises(ConfigError, match="torn.parquet: not a readable parquet file"):
        load_problems(str(torn))
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"problem": "caf\u00e9", "answer": 1}\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match="latin.jsonl: not UTF-8 text"):
        load_problems(str(latin))


def test_arithmetic_is_seeded_distinct_mixed_and_excludable():
    a, b = arithmetic_problems(300, seed=3), arithmetic_problems(300, seed=3)
    assert [p.question for p in a] == [p.question for p in b]
    assert len({p.question for p in a}) == 300
    assert {p.meta["level"] for p in a} == {"add_small", "add_2digit", "sub_2digit", "add_3digit", "mul_small",
                                            "mul_2digit"}
    for p in a[:50]:
        x, op, y = p.question.removeprefix("What is ").rstrip("?").split()
        assert int(p.gold) == eval(f"{int(x)} {op} {int(y)}")  # noqa: S307 - our own generated digits
    held = arithmetic_problems(100, seed=4, exclude={p.question for p in a})
    assert not {p.question for p in held} & {p.question for p in a}
    with pytest.raises(ValueError, match="add_tiny"):
        arithmetic_problems(10, levels=["add_tiny"])


def test_overlong_prompts_are_dropped_and_counted():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model("tiny-qwen2"))
    probs = arithmetic_problems(3, seed=1)
    long = probs[1].__class__(uid="long", question="x " * 500, gold="1")
    kept, ids, dropped = tokenize_problems(tok, [probs[0], long, probs[2]], "Be brief.", max_prompt_tokens=100)
    assert [p.uid for p in kept] == [probs[0].uid, probs[2].uid] and all(len(x) <= 100 for x in ids)
    assert [(d.uid, d.reason) for d in dropped] == [("long", "prompt too long")]
    assert "> data.max_prompt_tokens=100" in dropped[0].detail
    assert tok.decode(ids[0]).startswith("<|im_start|>user\nWhat is")


def test_sampler_epochs_and_exact_resume():
    s = Sampler(10, seed=5)
    first = [s.next(4) for _ in range(5)]  # crosses two epoch boundaries
    flat = [i for b in first for i in b]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))
    assert flat[:10] != flat[10:20]  # reshuffled per epoch
    r = Sampler(10, seed=5)
    r.next(4), r.next(4)
    state = r.state_dict()
    resumed = Sampler(10, seed=5)
    resumed.load_state_dict(state)
    assert [resumed.next(4) for _ in range(3)] == first[2:]
    s2 = Sampler(10, seed=5)
    for _ in range(5):  # exactly at an epoch boundary
        s2.next(2)
    assert s2.state_dict()["epoch"] == 1 and s2.state_dict()["pos"] == 0
    with pytest.raises(ValueError, match="sampler state is for 10 items"):
        Sampler(11, seed=5).load_state_dict(state)


def test_hub_model_id_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="model.path: 'nobody-here/no-such-model' is not a local directory"):
        resolve_model("nobody-here/no-such-model")
    with pytest.raises(ConfigError, match="neither a directory nor a built-in"):
        resolve_model("/no/such/dir")


def test_shipped_example_file_loads_and_scores():
    from gapo.config import RewardConfig
    from gapo.reward.registry import score_groups

    probs = load_problems(str(Path(__file__).resolve().parents[1] / "data" / "example_math.jsonl"))
    assert len(probs) == 8 and probs[3].meta["unit"] == "cm^2"
    answers = [["\\boxed{12}"], ["\\boxed{-4}"], ["\\boxed{0.75}"], ["\\boxed{9 cm^2}"], ["\\boxed{4}"],
               ["\\boxed{2,3,5,7}"], ["\\boxed{12}"], ["\\boxed{(1,2]}"]]
    results = score_groups("math", answers, probs, RewardConfig())
    assert [g[0].status for g in results] == ["correct"] * 8


def test_too_many_arithmetic_problems_for_the_levels_is_a_config_error():
    from gapo.errors import ConfigError

    with pytest.raises(ConfigError, match=r"data.arithmetic_size=1500.*only 400 found"):
        load_problems("arithmetic", arithmetic_size=1500, arithmetic_levels=["add_small"])


# --- several training sources (DeepCoder's mix) and de-duplication ---------------------------------------
FIXTURES = Path(__file__).parent / "fixtures" / "deepcoder"
DEEPCODER_MIX = [{"source": str(FIXTURES / f"{name}.jsonl")} for name in ("primeintellect", "taco", "lcbv5")]


def test_sources_concatenate_in_order_with_unique_ids():
    d = resolve({"data": {"train": DEEPCODER_MIX, "type": "code", "answer_key": "tests"}}).data
    problems = load_training_set(d)
    assert [p.uid.split(":")[1] for p in problems] == ["primeintellect"] * 3 + ["taco"] * 2 + ["lcbv5"] * 3
    assert len({p.uid for p in problems}) == len(problems) == 8


def test_a_functional_livecodebench_problem_gets_its_function_name_and_starter_code():
    d = resolve({"data": {"train": DEEPCODER_MIX[2:], "answer_key": "tests"}}).data
    stdin, functional, _ = load_training_set(d)
    assert stdin.question.endswith("Print x squared.")  # empty starter code: the question as stored
    assert "```python\nclass Solution:\n    def maxGap(self, nums: List[int]) -> int:\n```" in functional.question
    assert all(t["metadata"] == {"func_name": "maxGap"} for t in functional.gold)


def test_per_source_keys_override_the_data_sections(tmp_path):
    renamed = [{"question": "q1", "expected": "1"}, {"question": "q2", "expected": "2"}]
    path = tmp_path / "renamed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in renamed))
    d = resolve({"data": {"train": [{"source": str(path), "prompt_key": "question", "answer_key": "expected"},
                                     {"source": "arithmetic"}], "arithmetic_size": 5}}).data
    problems = load_training_set(d)
    assert [p.question for p in problems[:2]] == ["q1", "q2"] and len(problems) == 7


@pytest.mark.parametrize("train, message", [
    ([], "data.train is an empty list"),
    ([{"source": "x.jsonl", "subst": "a"}], "subst"),
])
def test_bad_source_lists_are_config_errors(train, message):
    with pytest.raises(ConfigError, match=message):
        resolve({"data": {"train": train}})


def test_a_subset_on_a_local_file_is_refused_naming_both():
    d = resolve({"data": {"train": [{"source": DEEPCODER_MIX[0]["source"], "subset": "taco"}]}}).data
    with pytest.raises(ConfigError, match="subset='taco'.*local file"):
        load_training_set(d)


def test_dedup_keeps_the_first_of_each_normalised_question(tmp_path, caplog):
    rows = [{"problem": "What is 1+1?", "answer": "2"}, {"problem": "what  is 1+1?\n", "answer": "3"},
            {"problem": "What is 2+2?", "answer": "4"}, {"problem": "WHAT IS 2+2?", "answer": "4"}]
    path = tmp_path / "dup.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    d = resolve({"data": {"train": str(path), "dedup": True}}).data
    with caplog.at_level(logging.INFO, logger="gapo.data"):
        problems = load_training_set(d)
    assert [p.gold for p in problems] == ["2", "4"]
    assert "2 of 4 problems kept (2 repeats dropped)" in caplog.text
    assert len(load_training_set(d.model_copy(update={"dedup": False}))) == 4
