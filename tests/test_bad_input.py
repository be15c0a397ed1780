"""Bad input to the five commands, as a user types it: each gets one clear line naming what is wrong and what is
expected, exit 2 (Exit.CONFIG), no traceback, and nothing half-written. In process (each command's main), so that
nothing starts an engine: every case fails before one would."""

import json
import sys
import tempfile
from pathlib import Path

import pytest

from gapo.cli import train_main
from gapo.errors import Exit
from gapo.study import compare, plot, sweep
from gapo.study import eval as gapo_eval

MANIFEST = """name: {name}
title: t
produces: p
config: tiny_cpu
nproc: 1
seeds: {seeds}
runs:
  - name: a
    {run}
eval:
  protocol: {{name: heldout, benchmarks: [arithmetic], n: 2, temperature: 1.0, max_new_tokens: 16}}
  steps: [3]
"""


def manifest(tmp_path, name="m", seeds="[0]", run="overrides: []"):
    path = tmp_path / f"{name}.yaml"
    path.write_text(MANIFEST.format(name=name, seeds=seeds, run=run))
    return str(path)


CASES = [
    # gapo-train: overrides whose value YAML cannot read, or of the wrong shape; names only the ranks would read
    ("train", ["--config", "tiny_cpu", "--print-config", "data.instruction=*think* step by step"],
     "override 'data.instruction=*think* step by step': the value is not valid YAML"),
    ("train", ["--config", "tiny_cpu", "--print-config", "trainer.lr=[1"], "override 'trainer.lr=[1': the value is"),
    ("train", ["--config", "tiny_cpu", "--print-config", "algorithm.name=[a]"], "algorithm.name: unknown algorithm"),
    ("train", ["--config", "tiny_cpu", "--print-config", "algorithm.clip=[a]"], "algorithm.clip: Input should be"),
    ("train", ["--config", "tiny_cpu", "--print-config", "data.type=nosuch"], "data.type='nosuch': no rewarder"),
    ("train", ["--config", "tiny_cpu", "--print-config", "eval.benchmarks=[nosuch]"], "unknown benchmark 'nosuch'"),
    ("train", ["--config", "tiny_cpu", "--print-config", "--nproc", "3"],
     "--nproc 3: rollout.prompts_per_step=4 must be divisible by the 3 ranks"),
    ("train", ["--config", "tiny_cpu", "--print-config", "--nproc", "-3"], "--nproc -3: expected a number of ranks"),
    ("train", ["--config", "tiny_cpu", "--plan", "0"], "--plan 0: expected positive GPU sizes"),
    ("train", ["--config", "tiny_cpu", "--plan", "trainer.lr=1e-6"], "reads as a setting: put it before --plan"),
    ("train", ["--config", "{tmp}/latin1.yaml", "--print-config"], "not UTF-8 text"),
    ("train", ["--config", "{tmp}/base5.yaml", "--print-config"], "base: expected the name or path of another"),
    ("train", ["--config", "tiny_cpu", "--print-config", "plugins=[{tmp}/bad_plugin.py]"],
     "plugins: {tmp}/bad_plugin.py: line 1: invalid syntax"),
    # gapo-eval: numbers out of range, a file in --out that is not its results
    ("eval", ["--model", "tiny-qwen2", "--benchmarks", "arithmetic", "--limit", "-1"],
     "argument --limit: expected at least 1, got -1"),
    ("eval", ["--model", "tiny-qwen2", "--benchmarks", "arithmetic", "--top-p", "0"], "expected more than 0"),
    ("eval", ["--model", "tiny-qwen2", "--benchmarks", "arithmetic", "--temperature", "inf"], "a finite number"),
    ("eval", ["--model", "tiny-qwen2", "--benchmarks", "arithmetic", "--out", "{tmp}/res"],
     "res/results.json: not a gapo-eval results file"),
    ("eval", ["--run", "{tmp}/run", "--benchmarks", "arithmetic"], "run/checkpoints/step_000002/config.yaml cannot be "
                                                                     "read as the run's config (FileNotFoundError"),
    # gapo-sweep: a manifest that uses itself, a repeated seed, a time SLURM would refuse, a file where a folder goes
    ("sweep", ["{self_use}", "--print"], "runs.a.use: self/a leads back to self (self -> self)"),
    ("sweep", ["{two_zeros}", "--print"], "seeds: [0, 0] repeats [0]; list each seed once"),
    ("sweep", ["table3-qwen", "--print"], "did you mean table3_qwen?"),
    ("sweep", ["{plain}", "--slurm", "{tmp}/sl", "--time", "abc"], "'abc' is not a SLURM time"),
    ("sweep", ["{plain}", "--slurm", "{tmp}/afile"], "afile: a file is in the way"),
    # gapo-compare and gapo-plot: nothing to tabulate; --out on a file
    ("compare", ["table", "{plain}", "--output-root", "{tmp}/none"], "no evaluation found under"),
    ("plot", ["{tmp}/run", "--out", "{tmp}/afile"], "--out {tmp}/afile: a file is in the way"),
    ("compare", ["band", "{tmp}/run", "--rules", "gapo:0.003/0.015", "gspo:0.003"],
     "rollouts.jsonl:2: not a rollout record of gapo-train's (no adv)"),
]
MAINS = {"train": train_main, "eval": gapo_eval.main, "sweep": sweep.main, "compare": compare.main, "plot": plot.main}


@pytest.mark.parametrize("command, argv, said", CASES, ids=[f"{c}-{i}" for i, (c, *_) in enumerate(CASES)])
def test_bad_input_is_one_clear_line_and_exit_2(command, argv, said, tmp_path, capsys):
    (tmp_path / "latin1.yaml").write_bytes("model: {path: caf\u00e9}\n".encode("latin-1"))
    (tmp_path / "base5.yaml").write_text("base: 5\n")
    (tmp_path / "res").mkdir()
    (tmp_path / "res" / "results.json").write_text("[]")
    (tmp_path / "afile").write_text("")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    (run / "config.yaml").write_text("trainer: {seed: 0}\n")
    (run / "rollouts.jsonl").write_text(json.dumps({"step": 1, "adv": 0.5, "updates": []}) + "\n"
                                        + json.dumps({"step": 1, "updates": []}) + "\n\n")
    (tmp_path / "bad_plugin.py").write_text("def (:\n")
    (run / "checkpoints" / "step_000002").mkdir(parents=True)  # a checkpoint whose config.yaml was lost
    (run / "checkpoints" / "step_000002" / "trainer.json").write_text("{}")
    paths = {"tmp": str(tmp_path), "self_use": manifest(tmp_path, "self", run="use: self/a"),
             "two_zeros": manifest(tmp_path, "zeros", seeds="[0, 0]"), "plain": manifest(tmp_path)}
    argv = [a.format(**paths) for a in argv]
    try:
        code = MAINS[command](argv)
    except SystemExit as stop:  # argparse's own errors (a flag's type) exit 2 from inside parse_args
        code = stop.code
    err = capsys.readouterr().err
    assert code == Exit.CONFIG and said.format(**paths) in err and "Traceback" not in err, (code, err)
    said_lines = [x for x in err.strip().splitlines() if not x.startswith(("usage:", " "))]  # (argparse's usage)
    assert len(said_lines) <= 3, err  # a message, not a dump
    assert not (tmp_path / "none").exists() and not (tmp_path / "sl").exists()  # nothing half-written


def test_every_time_sbatch_takes_is_taken():
    from gapo.study.slurm import SlurmSpec

    for t in ("90", "90:30", "1:00:00", "2-0", "2-12:00", "2-00:00:00", "-1", "Unlimited", "INFINITE"):
        assert SlurmSpec(time=t, eval_time=t).time == t


# --------------------------------------------------------------------------------------------------
# The mistakes a new user makes with gapo-train, answered before the heavy imports (bench/mistakes.py times them)
# --------------------------------------------------------------------------------------------------
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import mistakes  # noqa: E402  (bench/ is run by path, not a package)

with tempfile.TemporaryDirectory() as _tmp:  # the cases' names, for the ids
    NAMES = [m.name for m in mistakes.mistakes(Path(_tmp))]


@pytest.mark.parametrize("i", range(len(NAMES)), ids=NAMES)
def test_a_mistake_is_named_before_torch_loads_with_exit_2_and_nothing_written(i, tmp_path):
    """In a fresh process, as typed: exit 2, the message, no traceback, and none of torch, vLLM, DeepSpeed or
    transformers loaded by then (what made these answers take 5-12 s; bench/mistakes.py prints the seconds, under 1 s
    on a Zen 3); the run's folder not made, no file added anywhere under the test's folder."""
    m = mistakes.mistakes(tmp_path)[i]
    before = sorted(tmp_path.rglob("*"))
    got, err, _ = mistakes.answer(m, tmp_path)
    assert got.get("code") == Exit.CONFIG and m.said in err and "Traceback" not in err, (got, err)
    assert got["loaded"] == [], f"loaded before the answer: {got['loaded']}"
    assert sorted(tmp_path.rglob("*")) == before and not (tmp_path / "out").exists()
