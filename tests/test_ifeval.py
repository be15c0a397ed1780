"""IFEval scoring on hand-made responses: every instruction type of the checker registry followed and violated,
strict vs loose, prompt- vs instruction-level aggregation with n samples, Google's file format, and the
plumbing through evaluate() (no model: a stand-in engine returns the responses)."""

import json
from types import SimpleNamespace

import pytest

from gapo.data import Problem
from gapo.errors import ConfigError
from gapo.evaluation import Bench, BenchResult, evaluate, load_benchmark, summary
from gapo.reward import ifeval


def fake_punkt(root):
    """An nltk_data tree with an English Punkt model that has learnt nothing (no abbreviations): it splits on
    sentence punctuation, which is all these hand-made sentences need. The real model is data the tests cannot
    download (see ifeval.require_sentence_splitter)."""
    d = root / "tokenizers" / "punkt_tab" / "english"
    d.mkdir(parents=True)
    for name in ("collocations.tab", "sent_starters.txt", "abbrev_types.txt", "ortho_context.tab"):
        (d / name).write_text("")
    return root


@pytest.fixture(autouse=True)
def punkt(tmp_path_factory, monkeypatch):
    import nltk

    monkeypatch.setattr(nltk.data, "path", [str(fake_punkt(tmp_path_factory.mktemp("nltk_data")))])


# instruction id -> (kwargs, a response that follows it, one that violates it)
CASES = {
    "change_case:capital_word_frequency": ({"capital_frequency": 3, "capital_relation": "at least"},
                                           "THE QUICK BROWN fox jumps.", "The QUICK brown fox jumps."),
    "change_case:english_capital": ({}, "THIS IS AN ENGLISH SENTENCE WRITTEN ENTIRELY IN CAPITAL LETTERS, AS ASKED.",
                                    "This is an English sentence with some capital letters."),
    "change_case:english_lowercase": ({}, "this is an english sentence written entirely in lowercase letters.",
                                      "This is an English sentence with Capital letters."),
    "combination:repeat_prompt": ({"prompt_to_repeat": "Write a haiku about rain."},
                                  "Write a haiku about rain. Drops tap the window.", "Drops tap the window."),
    "combination:two_responses": ({}, "Rain is wet.\n******\nRain is cold.", "Rain is wet."),
    "detectable_content:number_placeholders": ({"num_placeholders": 2}, "Dear [name], we meet at [address].",
                                               "Dear [name], we meet at noon."),
    "detectable_content:postscript": ({"postscript_marker": "P.S."}, "See you soon.\nP.S. Bring an umbrella.",
                                      "See you soon. Bring an umbrella."),
    "detectable_format:constrained_response": ({}, "My answer is yes.", "Yes, certainly."),
    "detectable_format:json_format": ({}, '```json\n{"answer": 4}\n```', "answer: 4"),
    "detectable_format:multiple_sections": ({"section_spliter": "Section", "num_sections": 2},
                                            "Section 1\nThe start.\nSection 2\nThe end.", "Section 1\nAll of it."),
    "detectable_format:number_bullet_lists": ({"num_bullets": 2}, "* one\n* two", "* one\n* two\n* three"),
    "detectable_format:number_highlighted_sections": ({"num_highlights": 2}, "A *first* and a *second* part.",
                                                      "Only *one* part."),
    "detectable_format:title": ({}, "<<Rain at Night>>\nIt rained.", "Rain at Night\nIt rained."),
    "keywords:existence": ({"keywords": ["apple", "river"]}, "An apple fell into the river.",
                           "An apple fell into the sea."),
    "keywords:forbidden_words": ({"forbidden_words": ["cat"]}, "The dog sat.", "The cat sat."),
    "keywords:frequency": ({"keyword": "rain", "frequency": 2, "relation": "at least"},
                           "Rain, more rain.", "Rain, then sun."),
    "keywords:letter_frequency": ({"letter": "z", "let_frequency": 2, "let_relation": "less than"},
                                  "A lazy dog.", "Zigzag buzz."),
    "language:response_language": ({"language": "fr"},
                                   "Le chat dort sur le canapé pendant que la pluie tombe doucement sur la ville.",
                                   "The cat sleeps on the sofa while the rain falls gently on the city."),
    "length_constraints:nth_paragraph_first_word": ({"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "however"},
                                                    "It rained.\n\nHowever, the sun came out.",
                                                    "It rained.\n\nThen the sun came out."),
    "length_constraints:number_paragraphs": ({"num_paragraphs": 2}, "It rained.\n***\nIt stopped.",
                                             "It rained.\n***\nIt stopped.\n***\nIt rained again."),
    "length_constraints:number_sentences": ({"num_sentences": 3, "relation": "less than"},
                                            "It rained. It stopped.", "It rained. It stopped. It rained. It stopped."),
    "length_constraints:number_words": ({"num_words": 5, "relation": "at least"}, "one two three four five six",
                                        "one two"),
    "punctuation:no_comma": ({}, "No commas here.", "Commas, here."),
    "startend:end_checker": ({"end_phrase": "Any other questions?"}, "Done. Any other questions?",
                             "Any other questions? Done."),
    "startend:quotation": ({}, '"Wrapped in quotes."', "Not wrapped."),
}


def problem(ids: list[str], kwargs: list[dict], prompt: str = "Write a haiku about rain.", key: int = 1) -> Problem:
    return Problem(str(key), prompt, ids, {"key": key, "kwargs": kwargs})


def test_every_instruction_type_of_the_registry_has_a_case():
    """A registry that gains a type fails here instead of going untested; a case for a type the registry lacks
    would test nothing."""
    assert set(CASES) == set(ifeval.registry())
    assert len(CASES) == 25  # google-research/instruction_following_eval registers 25 types


@pytest.mark.parametrize("iid", sorted(CASES))
def test_checker_follows_and_violates(iid):
    kwargs, good, bad = CASES[iid]
    p = problem([iid], [kwargs])
    followed, violated = ifeval.score(good, p), ifeval.score(bad, p)
    assert (followed.status, followed.strict) == ("correct", (True,)), followed
    assert (violated.status, violated.strict) == ("wrong", (False,)), violated


def test_loose_accepts_a_preamble_line_and_markdown_emphasis_strict_does_not():
    quoted = problem(["startend:quotation"], [{}])
    s = ifeval.score('Sure, here it is:\n"Wrapped in quotes."', quoted)
    assert (s.status, s.strict, s.loose) == ("wrong", (False,), (True,))
    ending = problem(["startend:end_checker"], [{"end_phrase": "Any other questions?"}])
    s = ifeval.score("Done. **Any other questions?**", ending)
    assert (s.strict, s.loose) == ((False,), (True,))
    assert ifeval.score("   ", quoted).loose == (False,)  # an empty response follows nothing, even loosely


def test_hugging_face_none_filled_kwargs_are_the_reference_kwargs():
    hf = {"num_highlights": None, "keywords": None, "relation": "less than", "num_sentences": 3, "language": None}
    p = problem(["length_constraints:number_sentences"], [hf])
    assert ifeval.score("One. Two.", p).strict == (True,) and ifeval.score("One. Two. Three.", p).strict == (False,)


def test_a_checker_that_raises_scores_as_error_not_as_a_crash(monkeypatch):
    cls = ifeval.registry()["punctuation:no_comma"]

    def boom(self, value):
        raise RuntimeError("odd response")

    monkeypatch.setattr(cls, "check_following", boom)
    s = ifeval.score("text", problem(["punctuation:no_comma", "startend:quotation"], [{}, {}]))
    assert s.status == "error" and s.strict == (False, False) and "odd response" in s.detail


# Two prompts, two samples each; strict / loose per instruction worked out by hand:
#   P1 [no_comma, quotation]: '"No commas."' (T,T | T,T); '"Commas, here."' (F,T | F,T)
#   P2 [quotation]:           '"x"' (T | T);               'Sure:\n"x"' (F | T: its first line dropped)
P1 = problem(["punctuation:no_comma", "startend:quotation"], [{}, {}], "Answer in quotes, no commas.", key=11)
P2 = problem(["startend:quotation"], [{}], "Answer in quotes.", key=12)
RESPONSES = [['"No commas."', '"Commas, here."'], ['"x"', 'Sure:\n"x"']]
EXPECTED = {"prompt_strict": 2 / 4, "inst_strict": 4 / 6, "prompt_loose": 3 / 4, "inst_loose": 5 / 6}


def test_prompt_level_and_instruction_level_aggregation():
    scored = ifeval.score_records(RESPONSES, [P1, P2])
    assert ifeval.counts(scored[0]) == {"samples": 2, "prompt_strict": 1, "prompt_loose": 1, "instructions": 4,
                                        "inst_strict": 3, "inst_loose": 3}
    assert ifeval.metrics(scored) == pytest.approx(EXPECTED)
    # a sample passes when it follows all its instructions strictly: pass@1 is prompt-level strict accuracy
    r = BenchResult("ifeval", 2, [sum(s.status == "correct" for s in g) for g in scored], ["11", "12"], {})
    assert r.pass_at() == pytest.approx({1: 0.5, 2: 1.0})


class EchoTokenizer:
    """Characters as token ids: what the stand-in engine receives can be read back."""

    eos_token_id = 0

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        text = "".join(m["content"] for m in messages if m["role"] == "user")  # no end-of-turn token to find
        return [ord(c) for c in text] if tokenize else text


class ScriptedEngine:
    """Returns the scripted responses of each prompt, and keeps the prompts it was given."""

    def __init__(self, script: dict[str, list[str]]):
        self.script, self.prompts = script, []

    def generate(self, prompts, sampling, seeds):
        texts = ["".join(map(chr, p)) for p in prompts]
        self.prompts += texts
        return [[SimpleNamespace(text=t) for t in self.script[x][: sampling.n]] for x in texts]


def test_evaluate_scores_ifeval_without_the_math_instruction():
    engine = ScriptedEngine({P1.question: RESPONSES[0], P2.question: RESPONSES[1]})
    from gapo.config import RewardConfig

    [res] = evaluate(engine, EchoTokenizer(), [Bench("ifeval", "ifeval", [P1, P2])], n=2, temperature=1.0, top_p=1.0,
                     max_new_tokens=16, instruction="Let's think step by step.", reward=RewardConfig(), progress=False)
    assert engine.prompts == [P1.question, P2.question]  # not even an explicit instruction is appended
    assert (res.kind, res.correct, res.statuses) == ("ifeval", [1, 1], {"correct": 2, "wrong": 2})
    m = summary([res])
    assert m["val/ifeval/pass@1"] == m["val/ifeval/prompt_strict"] == 0.5
    assert {k: m[f"val/ifeval/{k}"] for k in EXPECTED} == pytest.approx(EXPECTED)
    assert "val/mean/pass@1" not in m  # IFEval is out of domain: not in the paper's average


def test_evaluate_leaves_ifeval_out_of_the_mean():
    math = BenchResult("amc", 2, [2, 0], ["a", "b"], {})
    ife = BenchResult("ifeval", 2, [0, 0], ["c", "d"], {}, {"prompt_strict": 0.0}, "ifeval")
    assert summary([math, ife])["val/mean/pass@1"] == 0.5


GOOGLE_RECORDS = [  # Google's data/input_data.jsonl layout (hand-made records)
    {"key": 1000, "prompt": "Write a short note without commas.", "instruction_id_list": ["punctuation:no_comma"],
     "kwargs": [{}]},
    {"key": 1001, "prompt": "Describe rain in at least 3 sentences, wrapped in double quotes.",
     "instruction_id_list": ["length_constraints:number_sentences", "startend:quotation"],
     "kwargs": [{"relation": "at least", "num_sentences": 3}, {}]},
]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_loads_googles_jsonl_by_path_and_by_name(tmp_path, monkeypatch):
    f = write_jsonl(tmp_path / "input_data.jsonl", GOOGLE_RECORDS)
    b = load_benchmark(f"ifeval={f}")
    name, kind, probs = b.name, b.kind, b.problems
    assert (name, kind, [p.uid for p in probs]) == ("ifeval", "ifeval", ["1000", "1001"])
    assert (probs[1].question, probs[1].gold) == (GOOGLE_RECORDS[1]["prompt"], GOOGLE_RECORDS[1]["instruction_id_list"])
    assert ifeval.score('"It rains. It pours. It stops."', probs[1]).status == "correct"

    (tmp_path / "ifeval").mkdir()
    write_jsonl(tmp_path / "ifeval" / "input_data.jsonl", GOOGLE_RECORDS)
    monkeypatch.setenv("GAPO_DATA_DIR", str(tmp_path))
    assert [p.uid for p in load_benchmark("ifeval", limit=1).problems] == ["1000"]


@pytest.mark.parametrize("record, message", [
    ({"instruction_id_list": ["punctuation:no_semicolon"], "kwargs": [{}]}, "unknown instruction id 'punctuation:no_"),
    ({"instruction_id_list": ["punctuation:no_comma", "startend:quotation"], "kwargs": [{}]},
     "2 instruction ids but 1 kwargs entries"),
    ({"instruction_id_list": ["startend:quotation"], "kwargs": [{"num_words": 3}]}, "does not take kwargs"),
    ({"instruction_id_list": ["keywords:frequency"], "kwargs": [{"keyword": "a", "frequency": 2, "relation": "most"}]},
     "does not take kwargs"),
    ({"instruction_id_list": []}, "instruction_id_list must be a non-empty list"),
    ({"instruction_id_list": ["startend:quotation"]}, "no field 'kwargs'"),
])
def test_a_bad_record_is_refused_at_load_naming_the_item(tmp_path, record, message):
    f = write_jsonl(tmp_path / "bad.jsonl", [GOOGLE_RECORDS[0], {"key": 7, "prompt": "p", **record}])
    with pytest.raises(ConfigError, match="item 1 \\(key 7\\)") as err:
        load_benchmark(f"ifeval={f}")
    assert message in str(err.value)


def test_missing_sentence_splitter_is_reported_before_generation(tmp_path, monkeypatch):
    import nltk

    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])
    f = write_jsonl(tmp_path / "input_data.jsonl", GOOGLE_RECORDS)
    with pytest.raises(ConfigError, match=r"punkt_tab.*python -m nltk.downloader punkt_tab"):
        load_benchmark(f"ifeval={f}")
