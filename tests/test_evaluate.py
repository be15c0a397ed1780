"""gapo-eval end to end on two benchmark files, validation during training, and gapo-plot on real runs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gapo.data import arithmetic_problems
from gapo.evaluation import BenchResult, summary
from gapo.metrics import pass_at_k
from gapo.study.eval import resolve_eval_model

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "WANDB_SILENT": "true"}


@pytest.fixture(scope="module")
def small_sums(tmp_path_factory) -> Path:
    """Problems the tiny model (warm-started on small sums) solves now and then."""
    f = tmp_path_factory.mktemp("data") / "sums.jsonl"
    f.write_text("".join(json.dumps({"problem": p.question, "answer": p.gold, "id": p.uid}) + "\n"
                         for p in arithmetic_problems(8, seed=31, levels=["add_small"])))
    return f


def test_summary_pass_at_k_and_coverage():
    r = BenchResult("b", n=4, correct=[0, 1, 4, 2], uids=list("wxyz"), statuses={})
    m = summary([r, BenchResult("c", 4, [4], ["u"], {})], threshold=0.3)
    assert m["val/b/pass@1"] == pytest.approx((0 + 1 + 4 + 2) / 16)
    assert m["val/b/pass@2"] == pytest.approx(sum(pass_at_k(4, c, 2) for c in [0, 1, 4, 2]) / 4)
    assert m["val/b/coverage"] == 2 and m["val/c/pass@4"] == 1.0
    assert m["val/mean/pass@1"] == pytest.approx((7 / 16 + 1) / 2)


def test_model_path_resolution(tmp_path):
    hf = tmp_path / "run" / "checkpoints" / "step_000002" / "hf"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text("{}")
    (hf.parent / "trainer.json").write_text("{}")
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step_000002")
    assert resolve_eval_model(str(tmp_path / "run")) == hf
    assert resolve_eval_model(str(hf.parent)) == hf
    assert resolve_eval_model(str(hf)) == hf


def test_a_benchmark_file_with_bad_rows_scores_the_rest_and_says_how_many(tmp_path):
    """Rows no rewarder can score are left out with their reason before --limit applies; a file of nothing but
    such rows is an error naming the file."""
    from gapo.errors import ConfigError
    from gapo.evaluation import load_benchmark

    f = tmp_path / "sums.jsonl"
    rows = [{"problem": "1 + 1?", "answer": ""}, {"problem": "2 + 2?", "answer": None},
            {"problem": "   ", "answer": "3"}, {"problem": "3 + 4?", "answer": "7"},
            {"problem": "5 + 5?", "answer": 10}]
    f.write_text("".join(json.dumps(x) + "\n" for x in rows))
    b = load_benchmark(f"sums={f}", limit=1)
    assert [p.question for p in b.problems] == ["3 + 4?"]
    assert sorted(d.reason for d in b.dropped) == ["empty answer", "empty prompt", "no answer"]
    f.write_text("".join(json.dumps(x) + "\n" for x in rows[:2]))
    with pytest.raises(ConfigError, match=f"{f}: no record can be scored"):
        load_benchmark(f"sums={f}")


@pytest.mark.e2e
def test_gapo_eval_end_to_end_on_two_benchmark_files(tmp_path, small_sums, shared_data):
    math500 = shared_data("math/math500.json")  # first: a skip must come before the engine starts
    out = tmp_path / "eval"
    ifeval = tmp_path / "input_data.jsonl"  # Google's layout; scored by IFEval's checkers, never as math
    records = [(1, "Say hi without commas.", ["punctuation:no_comma"], [{}]),
               (2, "Say hi in under 50 words.", ["length_constraints:number_words"],
                [{"num_words": 50, "relation": "less than"}])]
    ifeval.write_text("".join(json.dumps({"key": k, "prompt": p, "instruction_id_list": ids, "kwargs": kw}) + "\n"
                              for k, p, ids, kw in records))
    punkt = tmp_path / "nltk_data" / "tokenizers" / "punkt_tab" / "english"  # an untrained stand-in for the model
    punkt.mkdir(parents=True)
    for name in ("collocations.tab", "sent_starters.txt", "abbrev_types.txt", "ortho_context.tab"):
        (punkt / name).write_text("")
    sums = tmp_path / "sums.jsonl"  # two records no rewarder can score come first: left out, the rest scored
    bad = [{"problem": "1 + 1?", "answer": ""}, {"problem": "2 + 2?", "answer": None}]
    sums.write_text("".join(json.dumps(x) + "\n" for x in bad) + small_sums.read_text())
    r = subprocess.run([str(BIN / "gapo-eval"), "--model", "tiny-qwen2", "--benchmarks",
                        f"math500={math500},sums={sums},ifeval={ifeval}", "--limit", "8", "--n", "8",
                        "--temperature", "1.0", "--max-new-tokens", "24", "--dtype", "float32", "--out", str(out)],
                       cwd=ROOT, env={**ENV, "NLTK_DATA": str(tmp_path / "nltk_data")}, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "pass@8" in r.stdout and "sums" in r.stdout and "mean (no ifeval)" in r.stdout
    assert "ifeval: prompt-level strict" in r.stdout
    assert "sums: 2 record(s) left out, not scored: empty answer 1, no answer 1" in r.stdout
    # the console is gapo's (papercut 8): vLLM's and DeepSpeed's INFO lines are in the log it names
    log = out.with_name(f"{out.name}.log")
    assert f"gapo-eval: library output in {log}" in r.stderr and "INFO" not in r.stderr, r.stderr
    assert "INFO" in log.read_text() and "pass@8" in log.read_text()
    assert json.loads((out / "results.json").read_text())["dropped"]["sums"] == {"empty answer": 1, "no answer": 1}
    res = json.loads((out / "results.json").read_text())["metrics"]
    rows = [json.loads(x) for x in (out / "per_problem.jsonl").read_text().splitlines()]
    assert {x["benchmark"] for x in rows} == {"math500", "sums", "ifeval"} and len(rows) == 18
    assert res["val/ifeval/prompt_strict"] == res["val/ifeval/pass@1"]
    assert 0 <= res["val/ifeval/inst_strict"] <= res["val/ifeval/inst_loose"] <= 1
    assert res["val/mean/pass@1"] == pytest.approx((res["val/math500/pass@1"] + res["val/sums/pass@1"]) / 2)
    rows = [x for x in rows if x["benchmark"] != "ifeval"]
    for bench in ("math500", "sums"):
        mine = [x for x in rows if x["benchmark"] == bench]
        assert res[f"val/{bench}/pass@1"] == pytest.approx(sum(x["correct"] for x in mine) / (8 * len(mine)))
        ks = [res[f"val/{bench}/pass@{k}"] for k in (1, 2, 4, 8)]
        assert ks == sorted(ks)
    assert res["val/sums/pass@8"] > 0  # the tiny model does solve some small sums


@pytest.mark.e2e
def test_gapo_eval_rejects_unknown_benchmark():
    r = subprocess.run([str(BIN / "gapo-eval"), "--model", "tiny-qwen2", "--benchmarks", "chess"], cwd=ROOT,
                       env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "unknown benchmark 'chess'" in r.stderr


@pytest.fixture
def hub_fails(monkeypatch):
    """The Hugging Face load fails at once, as it does offline; calls are counted."""
    import datasets

    calls = []

    def load_dataset(name, *args, **kwargs):  # any configuration / split arguments
        calls.append(name)
        raise ConnectionError("no network in this test")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def test_named_benchmark_nowhere_names_the_file_the_dataset_and_the_fixes(tmp_path, monkeypatch, hub_fails, capsys):
    from gapo.errors import ConfigError
    from gapo.evaluation import load_benchmark
    from gapo.study.eval import main

    monkeypatch.setenv("GAPO_DATA_DIR", str(tmp_path))
    with pytest.raises(ConfigError) as err:
        load_benchmark("aime24")
    msg = str(err.value)
    for part in (f"no file {tmp_path / 'math' / 'aime24.json'}", "'HuggingFaceH4/aime_2024'", "ConnectionError",
                 "set GAPO_DATA_DIR to a directory holding math/aime24.json", "aime24=PATH"):
        assert part in msg, (part, msg)
    assert hub_fails == ["HuggingFaceH4/aime_2024"]

    monkeypatch.delenv("GAPO_DATA_DIR")
    with pytest.raises(ConfigError, match=r"GAPO_DATA_DIR is unset \(so no local math/aime24.json\)"):
        load_benchmark("aime24")
    with pytest.raises(ConfigError, match="'codeforces': GAPO_DATA_DIR is unset .* no Hugging Face dataset; .*"
                                          "codeforces=PATH"):
        load_benchmark("codeforces")

    model = tmp_path / "model"  # gapo-eval reports it before building anything
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert main(["--model", str(model), "--benchmarks", "aime24"]) == 2
    assert "gapo-eval: benchmark 'aime24': GAPO_DATA_DIR is unset" in capsys.readouterr().err


def test_named_benchmark_from_gapo_data_dir_needs_no_hub(tmp_path, monkeypatch, hub_fails):
    from gapo.evaluation import load_benchmark

    (tmp_path / "math").mkdir()
    (tmp_path / "math" / "amc.json").write_text(json.dumps([{"problem": "1+1?", "answer": 2.0}]))
    monkeypatch.setenv("GAPO_DATA_DIR", str(tmp_path))
    b = load_benchmark("amc")
    name, kind, probs = b.name, b.kind, b.problems
    assert (name, kind, [(p.question, p.gold) for p in probs]) == ("amc", "math", [("1+1?", 2.0)])
    assert load_benchmark("amc", data_dir=tmp_path).problems == probs and hub_fails == []


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, small_sums):
    base = tmp_path_factory.mktemp("val")
    for algo in ("gapo", "gspo"):
        r = subprocess.run([str(BIN / "gapo-train"), "--config", "configs/tiny_cpu.yaml", f"algorithm.name={algo}",
                            f"trainer.output_dir={base / algo}", "trainer.total_steps=3", "trainer.eval_every=2",
                            f"eval.benchmarks=[sums={small_sums}]", "eval.n=4", "tracking.mode=disabled"],
                           cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-4000:]
    return base / "gapo", base / "gspo"


@pytest.mark.e2e
def test_validation_during_training(two_runs):
    run = two_runs[0]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    val_steps = [x["step"] for x in rows if "val/mean/pass@1" in x]
    assert val_steps == [0, 2, 3]  # before training, every eval_every, and at the end
    row = next(x for x in rows if x["step"] == 2 and "val/sums/pass@4" in x)
    assert 0 <= row["val/sums/pass@1"] <= row["val/sums/pass@4"] <= 1 and "val/sums/coverage" in row
    per = [json.loads(x) for x in (run / "val" / "step_000002" / "per_problem.jsonl").read_text().splitlines()]
    assert len(per) == 8 and all(x["n"] == 4 for x in per)


@pytest.mark.e2e
def test_validation_and_gapo_eval_score_the_same_problems(tmp_path, small_sums):
    """A benchmark is one problem set wherever it is scored: a prompt longer than data.max_prompt_tokens is
    scored, not dropped by validation alone, and the held-out arithmetic set avoids the run's own arithmetic
    set (its levels, size and seed) in gapo-eval --run as in validation."""
    long = tmp_path / "long.jsonl"
    rows = [json.loads(x) for x in small_sums.read_text().splitlines()][:3]
    rows[1]["problem"] = "Add these: " + " + ".join(["1"] * 100) + "?"  # over tiny_cpu's 128 prompt tokens
    long.write_text("".join(json.dumps(x) + "\n" for x in rows))
    run, specs = tmp_path / "run", f"long={long},arithmetic"
    r = subprocess.run([str(BIN / "gapo-train"), "--config", "configs/tiny_cpu.yaml", f"trainer.output_dir={run}",
                        "trainer.total_steps=1", f"eval.benchmarks=[{specs}]", "eval.limit=6", "eval.n=2",
                        "eval.max_new_tokens=8", "tracking.mode=disabled"],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    r = subprocess.run([str(BIN / "gapo-eval"), "--run", str(run), "--benchmarks", specs, "--limit", "6", "--n", "2",
                        "--max-new-tokens", "8"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]

    def problems(results: Path) -> list[tuple[str, str]]:
        return [(x["benchmark"], x["uid"]) for x in map(json.loads, (results / "per_problem.jsonl").open())]

    validated = problems(run / "val" / "step_000001")
    assert validated == problems(run / "eval" / "custom" / "step_000001")
    assert (run / "eval" / "custom" / "eval.log").is_file() and "INFO" not in r.stderr, r.stderr
    assert [u for b, u in validated if b == "long"] == [x["id"] for x in rows]
    assert len([u for b, u in validated if b == "arithmetic"]) == 6


@pytest.mark.e2e
def test_plots_from_two_real_runs(two_runs, tmp_path):
    from gapo.study.figures import load_run
    from gapo.study.plot import build_figures, main

    out = tmp_path / "plots"
    assert main([str(two_runs[0]), str(two_runs[1]), "--out", str(out)]) == 0
    for name in ("clip_by_c.png", "is_adv_corr.png", "val_pass.png", "coverage.png", "training.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert name in (out / "index.md").read_text()
    figs = build_figures([load_run(two_runs[0]), load_run(two_runs[1])])
    for name in ("is_adv_corr.png", "val_pass.png", "training.png"):
        for ax in figs[name].axes:
            lines = [ln for ln in ax.get_lines() if not ln.get_label().startswith("_")]
            if lines:
                assert len(lines) == 2, (name, ax.get_title())


def test_arithmetic_benchmark_is_held_out_from_training_and_follows_its_levels():
    from gapo.config import DataConfig
    from gapo.evaluation import load_benchmark

    train = {p.question for p in arithmetic_problems(300, seed=1, levels=["add_small"])}
    data = DataConfig(arithmetic_size=300, arithmetic_seed=1, arithmetic_levels=["add_small"])
    b = load_benchmark("arithmetic", 60, data)
    name, kind, probs = b.name, b.kind, b.problems
    assert (name, kind, len(probs)) == ("arithmetic", "math", 60)
    assert all(p.meta["level"] == "add_small" for p in probs) and not {p.question for p in probs} & train


# --- date windows (LiveCodeBench v5 = 2024-08-01..2025-02-01, paper Table 2) ------------------------------------
# One stdin case: a record the code rewarder can score (one with "[]" tests is left out as "no test cases").
ONE_CASE = json.dumps([{"input": "1\n", "output": "1\n"}])
DATED = ["2024-07-31T23:59:00", "2024-08-01T00:00:00", "2025-01-31T12:00:00", "2025-02-01T00:00:00",
         "2025-02-01T10:00:00", "2025-03-01"]


@pytest.fixture
def lcb_file(tmp_path) -> Path:
    f = tmp_path / "lcb.jsonl"
    f.write_text("".join(json.dumps({"id": d, "problem": f"p{i}", "tests": ONE_CASE, "contest_date": d}) + "\n"
                         for i, d in enumerate(DATED)))
    return f


def test_window_keeps_both_ends_as_livecodebench_does(lcb_file):
    from gapo.evaluation import load_benchmark

    b = load_benchmark(f"livecodebench@2024-08-01:2025-02-01={lcb_file}")
    name, kind, probs = b.name, b.kind, b.problems
    # inclusive at both ends, the end date at 00:00 (LiveCodeBench's --start_date/--end_date comparison)
    assert (name, kind, [p.uid for p in probs]) == (
        "livecodebench", "code", ["2024-08-01T00:00:00", "2025-01-31T12:00:00", "2025-02-01T00:00:00"])
    assert [p.uid for p in load_benchmark(f"livecodebench@2025-02-01:={lcb_file}").problems] == DATED[3:]
    assert [p.uid for p in load_benchmark(f"livecodebench@:2024-08-01={lcb_file}").problems] == DATED[:2]
    assert len(load_benchmark(f"livecodebench@2024-08-01:2025-02-01={lcb_file}", limit=2).problems) == 2  # limit after


def test_window_reads_a_date_inside_metadata_and_aware_times(tmp_path):
    from gapo.evaluation import load_benchmark

    f = tmp_path / "dc.json"
    f.write_text(json.dumps([
        {"problem": "a", "tests": ONE_CASE, "metadata": json.dumps({"contest_date": "2024-09-01T00:00:00"})},
        {"problem": "b", "tests": ONE_CASE, "metadata": {"contest_date": "2024-01-01"}},
        {"problem": "c", "tests": ONE_CASE, "contest_date": "2025-02-01T01:00:00+02:00"},  # 2025-01-31T23:00 UTC
    ]))
    assert [p.question for p in load_benchmark(f"livecodebench@2024-08-01:2025-02-01={f}").problems] == ["a", "c"]


@pytest.mark.parametrize("window, message", [
    ("2024-08-01", "must be START:END"),
    (":", "must be START:END"),
    ("2024-13-01:2025-02-01", "window start '2024-13-01' is not a date YYYY-MM-DD"),
    ("2024-08-01:Feb 2025", "window end 'Feb 2025' is not a date"),
    ("2025-02-01:2024-08-01", r"starts \(2025-02-01\) after it ends \(2024-08-01\)"),
    ("2030-01-01:2031-01-01", "no problem in the window .* dated 2024-07-31 to 2025-03-01"),
])
def test_bad_windows_are_refused_naming_the_spec(lcb_file, window, message):
    from gapo.errors import ConfigError
    from gapo.evaluation import load_benchmark

    with pytest.raises(ConfigError, match=message) as err:
        load_benchmark(f"livecodebench@{window}={lcb_file}")
    assert "livecodebench@" in str(err.value)


def test_window_on_records_without_a_date_names_the_field_and_the_way_out(tmp_path):
    from gapo.errors import ConfigError
    from gapo.evaluation import load_benchmark

    f = tmp_path / "lcbv5_test.json"
    f.write_text(json.dumps([{"problem": "a", "tests": ONE_CASE, "metadata": "{}"}]))
    with pytest.raises(ConfigError) as err:
        load_benchmark(f"livecodebench@2024-08-01:2025-02-01={f}")
    for part in (str(f), "item 0", "no field 'contest_date'", "metadata.contest_date", "livecodebench=PATH"):
        assert part in str(err.value), (part, str(err.value))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"problem": "a", "tests": ONE_CASE, "contest_date": "last week"}]))
    with pytest.raises(ConfigError, match="contest_date='last week' is not an ISO date"):
        load_benchmark(f"livecodebench@2024-08-01:2025-02-01={bad}")
    with pytest.raises(ConfigError, match="unknown benchmark 'chess'"):
        load_benchmark("chess@2024-08-01:2025-02-01")


def test_deepcoder_validates_and_reports_on_the_lcb_v5_window():
    from gapo.configfile import load_config

    ev = load_config("deepcoder").eval
    assert ev.benchmarks[0] == ev.protocol.benchmarks[0] == "livecodebench@2024-08-01:2025-02-01"


def test_named_livecodebench_is_deepcoders_v5_cut_and_its_own_window_needs_no_dates(tmp_path, monkeypatch):
    """By name, livecodebench is DeepCoder's lcbv5 test split, already 2024-08-01..2025-02-01 and undated:
    the v5 window keeps it whole, another window cannot be applied to it."""
    import datasets

    from gapo.errors import ConfigError
    from gapo.evaluation import load_benchmark

    records = [{"problem": x, "tests": ONE_CASE, "metadata": "{}"} for x in ("a", "b")]
    asked = []

    def load_dataset(name, subset=None, *, split, **kwargs):
        asked.append((name, subset, split))
        return records

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.delenv("GAPO_DATA_DIR", raising=False)
    assert len(load_benchmark("livecodebench@2024-08-01:2025-02-01").problems) == 2
    assert asked == [("agentica-org/DeepCoder-Preview-Dataset", "lcbv5", "test")]
    with pytest.raises(ConfigError, match="no field 'contest_date'"):
        load_benchmark("livecodebench@2024-09-01:2025-02-01")
    local = tmp_path / "code"
    local.mkdir()
    (local / "livecodebench.json").write_text(json.dumps(records[:1]))
    assert len(load_benchmark("livecodebench@2024-08-01:2025-02-01", data_dir=tmp_path).problems) == 1


def test_evaluation_seeds_never_share_a_sample():
    """vLLM seeds sample j of a request with seed + j; with n = 256 on a few benchmarks, every (problem, sample)
    pair must get a seed of its own (the old seed * 1_000_003 + i shared 255 of 256 with the next problem)."""
    from gapo.data import Problem
    from gapo.evaluation import Bench, sample_seeds

    benches = [Bench(name, "math", [Problem(str(i), "q", "1") for i in range(count)])
               for name, count in (("aime24", 30), ("math500", 500), ("amc", 83))]
    for n in (1, 3, 16, 256):
        seeds = sample_seeds(0, benches, n)
        every = [s + j for row in seeds for s in row for j in range(n)]
        assert len(every) == len(set(every)) == 613 * n
        assert all(0 <= s and s + n <= 2**31 for row in seeds for s in row)
    assert sample_seeds(0, benches, 16) == sample_seeds(0, benches, 16)  # repeatable
    assert sample_seeds(0, benches, 16) != sample_seeds(1, benches, 16)


def test_gapo_eval_model_accepts_a_hub_id_and_names_what_failed(monkeypatch, tmp_path):
    """The Base columns of Tables 1 and 2 evaluate a hub model: its id is downloaded (here the download fails, as
    offline), and a path that is nothing gapo-eval knows says what it tried."""
    import huggingface_hub

    from gapo.errors import ConfigError

    asked = []

    def offline(repo_id, **kwargs):
        asked.append(repo_id)
        raise ConnectionError("no network in this test")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    monkeypatch.setenv("GAPO_CACHE", str(tmp_path))
    with pytest.raises(ConfigError, match="'Qwen/Qwen2.5-Math-1.5B' is not a local directory, and downloading it "
                                          "from the Hugging Face hub failed .*no network"):
        resolve_eval_model("Qwen/Qwen2.5-Math-1.5B")
    assert asked == ["Qwen/Qwen2.5-Math-1.5B"]
    with pytest.raises(ConfigError, match=r"--model \./nowhere/at/all: no such directory, and not a built-in"):
        resolve_eval_model("./nowhere/at/all")


def test_each_run_is_evaluated_with_its_own_seed_unless_one_is_given(tmp_path):
    """Runs of different seeds draw independent evaluation samples by default (their validation did too), so that
    seeds of one method do not share their sampling noise; --seed pins one for all, and is part of the settings a
    finished evaluation is matched against."""
    import yaml

    from gapo import rundir
    from gapo.study.eval import parser, run_jobs

    runs = {}
    for seed in (0, 3):
        ckpt = tmp_path / f"seed{seed}" / rundir.CHECKPOINTS / "step_000002"
        ckpt.mkdir(parents=True)
        (ckpt / rundir.STATE).write_text("{}")
        (ckpt / rundir.CONFIG).write_text(yaml.safe_dump({"model": {"dtype": "float32"}, "trainer": {"seed": seed}}))
        runs[seed] = tmp_path / f"seed{seed}"
    default = parser().parse_args(["--run", str(runs[0]), str(runs[3]), "--benchmarks", "arithmetic"])
    assert [job[2] for r in runs.values() for job in run_jobs(default, r)] == [0, 3]
    pinned = parser().parse_args(["--run", str(runs[3]), "--benchmarks", "arithmetic", "--seed", "7"])
    assert [job[2] for job in run_jobs(pinned, runs[3])] == [7]


def test_a_run_is_scored_with_its_own_instruction_and_rewarder_settings(tmp_path):
    """The demo trains with its own instruction and reward.math_last_number_fallback; evaluated with the benchmark's
    default prompt and a strict rewarder its step-8 checkpoint scored 0.25 % where its validation during training
    (same weights) gave 27.5 %. A run is evaluated as it was validated, unless --instruction says otherwise."""
    import yaml

    from gapo import rundir
    from gapo.errors import ConfigError
    from gapo.study.eval import parser, run_jobs

    ckpt = tmp_path / "run" / rundir.CHECKPOINTS / "step_000002"
    ckpt.mkdir(parents=True)
    (ckpt / rundir.STATE).write_text("{}")
    (ckpt / rundir.CONFIG).write_text(yaml.safe_dump({
        "model": {"dtype": "float32"}, "trainer": {"seed": 0}, "data": {"instruction": "Box it."},
        "eval": {"instruction": "Box it."}, "reward": {"math_last_number_fallback": True}}))
    [job] = run_jobs(parser().parse_args(["--run", str(tmp_path / "run"), "--benchmarks", "arithmetic"]),
                     tmp_path / "run")
    assert job.instruction == "Box it." and job.reward.math_last_number_fallback and job.reward.num_workers == 2
    [job] = run_jobs(parser().parse_args(["--run", str(tmp_path / "run"), "--benchmarks", "arithmetic",
                                          "--instruction", "Answer."]), tmp_path / "run")
    assert job.instruction == "Answer."
    # A result evaluated under other settings (the old default prompt) is not taken for this one.
    out = tmp_path / "run" / rundir.EVAL / "custom" / "step_000002"
    out.mkdir(parents=True)
    (out / "results.json").write_text(json.dumps({"meta": {"settings": {"instruction": None}}}))
    with pytest.raises(ConfigError, match="was evaluated with other settings"):
        run_jobs(parser().parse_args(["--run", str(tmp_path / "run"), "--benchmarks", "arithmetic"]), tmp_path / "run")


def test_a_run_trained_by_an_earlier_gapo_is_evaluated_and_resolves(tmp_path):
    """A run folder from before reward.modules became the top-level plugins (b97f3cd) still evaluates (gapo-eval read
    its saved reward section as is, and stopped with a pydantic traceback) and resolves for a resume, its modules
    now plugins; a reward section that does not load is named with its file."""
    import yaml

    from gapo import rundir
    from gapo.configfile import resolve
    from gapo.errors import ConfigError
    from gapo.study.eval import parser, run_jobs

    ckpt = tmp_path / "run" / rundir.CHECKPOINTS / "step_000002"
    ckpt.mkdir(parents=True)
    (ckpt / rundir.STATE).write_text("{}")
    old = {"model": {"dtype": "float32"}, "trainer": {"seed": 0},
           "reward": {"math_last_number_fallback": True, "modules": []}}
    (ckpt / rundir.CONFIG).write_text(yaml.safe_dump(old))
    [job] = run_jobs(parser().parse_args(["--run", str(tmp_path / "run"), "--benchmarks", "arithmetic"]),
                     tmp_path / "run")
    assert job.reward.math_last_number_fallback
    plugin = tmp_path / "my_rewarder.py"
    plugin.write_text("")
    cfg = resolve({**old, "reward": {"modules": [str(plugin)]}, "plugins": [str(plugin)]})
    assert cfg.plugins == [str(plugin)] and "modules" not in cfg.reward.model_dump()  # once, not twice
    (ckpt / rundir.CONFIG).write_text(yaml.safe_dump({**old, "reward": {"math_timeout_s": "soon"}}))
    with pytest.raises(ConfigError, match=rf"{ckpt / rundir.CONFIG}: its reward or data section does not load"):
        run_jobs(parser().parse_args(["--run", str(tmp_path / "run"), "--benchmarks", "arithmetic"]), tmp_path / "run")


def test_gapo_eval_and_a_manifest_offer_the_configs_engine_choices():
    """--engine, --dtype and --compile of gapo-eval, and a sweep manifest's eval.compile, accept what the training
    config accepts: a mode added to the config reaches them."""
    from typing import get_args

    from gapo.config import ModelConfig, RolloutConfig
    from gapo.study.eval import parser
    from gapo.study.manifest import EvalSpec

    choices = {a.dest: list(a.choices) for a in parser()._actions if a.choices}
    config = {"engine": RolloutConfig, "dtype": ModelConfig, "compile": RolloutConfig}
    for flag, section in config.items():
        assert choices[flag] == list(get_args(section.model_fields[flag].annotation)), flag
    assert get_args(EvalSpec.model_fields["compile"].annotation) == tuple(choices["compile"])


def test_the_engine_context_holds_every_prompt_of_a_benchmark_as_it_is_sampled():
    """No problem is left out for its length (validation and gapo-eval score the same set): the context grows to the
    longest prompt, counted with the instruction appended as it is sampled (never to a bare IFEval prompt), and a
    prompt with no room for a response is an error naming the benchmark and the problem."""
    from gapo.data import Problem
    from gapo.errors import ConfigError
    from gapo.evaluation import Bench, context_length

    class Words:  # one token per word, no template
        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            return list(range(len(messages[0]["content"].split())))

    bench = Bench("b", "math", [Problem("short", "1 + 1?", "2"), Problem("long", " ".join(["x"] * 300), "1")])
    assert context_length([bench], Words(), "Box it.", 64, None) == 302 + 64
    assert context_length([bench], Words(), "Box it.", 64, 320) == 320  # a response ends at the model's positions
    bare = Bench("i", "ifeval", [Problem("1", " ".join(["x"] * 310), ["punctuation:no_comma"])])
    assert context_length([bench, bare], Words(), "Box it.", 8, None) == 310 + 8
    with pytest.raises(ConfigError, match="benchmark 'b', problem long: its prompt is 302 tokens, and the model has "
                                          "302 positions"):
        context_length([bench], Words(), "Box it.", 64, 302)
