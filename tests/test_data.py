"""Loaders, the embedded arithmetic set, prompt building and the resumable sampler."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gapo.config import ConfigError
from gapo.data import Sampler, arithmetic_problems, load_problems, tokenize_problems
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
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: not valid JSON"):
        load_problems(str(bad))
    obj = tmp_path / "obj.json"
    obj.write_text('{"problem": "x"}')
    with pytest.raises(ConfigError, match="expected a JSON list of records"):
        load_problems(str(obj))


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


def test_overlong_prompts_are_dropped_and_counted(caplog):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model("tiny-qwen2"))
    probs = arithmetic_problems(3, seed=1)
    long = probs[1].__class__(uid="long", question="x " * 500, gold="1")
    kept, ids = tokenize_problems(tok, [probs[0], long, probs[2]], "Be brief.", max_prompt_tokens=100)
    assert [p.uid for p in kept] == [probs[0].uid, probs[2].uid] and all(len(x) <= 100 for x in ids)
    assert "dropped 1 of 3 prompts" in caplog.text
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
    from gapo.config import ConfigError

    with pytest.raises(ConfigError, match=r"data.arithmetic_size=1500.*only 400 found"):
        load_problems("arithmetic", arithmetic_size=1500, arithmetic_levels=["add_small"])
