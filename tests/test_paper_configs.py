"""Every documented paper command resolves to the paper's row, and every shipped config rehearses.

The commands are read from where users read them: docs/paper.md's "Paper configs" table and the header of
each file in configs/. The expected rows are written here from the paper (Tables 1, 2, 3 and 8, §4.1), not
from the presets, so a preset, a config or a resolution rule that drifts from the paper fails here.
"""

import json
import logging
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from gapo.configfile import load_config, resolve
from gapo.models import check_context_budget

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# (IS level, clip rule, eps_lo, eps_hi (fixed) or eps_hi_max (adaptive), std-normalise, focal gamma, aggregation)
SEQ, TOK = "sequence", "token"
QWEN_SEQ = {  # Table 3, sequence-IS rows (Qwen2.5-Math-1.5B and Llama-3.2-3B-Instruct alike), Table 8
    "gapo": (SEQ, "adaptive", 3e-3, 5e-3, False, 0.0, "token_mean"),
    "gspo": (SEQ, "fixed", 3e-3, 3e-3, False, 0.0, "token_mean"),
    "gspo eps_hi=0.005": (SEQ, "fixed", 3e-3, 5e-3, False, 0.0, "token_mean"),
    "f_gspo": (SEQ, "fixed", 3e-3, 5e-3, False, 1.0, "token_mean"),
}
QWEN_TOK = {  # Table 3, token-IS rows
    "grpo": (TOK, "fixed", 0.2, 0.2, True, 0.0, "token_mean"),
    "f_grpo": (TOK, "fixed", 0.2, 0.2, True, 1.0, "token_mean"),
    "dr_grpo": (TOK, "fixed", 0.2, 0.28, False, 0.0, "seq_sum_constant"),
    "gapo_token": (TOK, "adaptive", 0.2, 0.28, False, 0.0, "token_mean"),
}
TABLE8 = {
    "gapo eps_hi_max=0.00525": (SEQ, "adaptive", 3e-3, 5.25e-3, False, 0.0, "token_mean"),
    "gspo eps_hi=0.00525": (SEQ, "fixed", 3e-3, 5.25e-3, False, 0.0, "token_mean"),
    "gapo eps_hi_max=0.007": (SEQ, "adaptive", 3e-3, 7e-3, False, 0.0, "token_mean"),
    "gspo eps_hi=0.007": (SEQ, "fixed", 3e-3, 7e-3, False, 0.0, "token_mean"),
}
PAPER = {
    "qwen_math": {**QWEN_SEQ, **QWEN_TOK, **TABLE8},
    "llama_math": {**QWEN_SEQ, "grpo": QWEN_TOK["grpo"], "f_grpo": QWEN_TOK["f_grpo"]},
    "r1_distill_math": {  # Table 1: all three at 7e-5 / 3e-4
        "gapo": (SEQ, "adaptive", 7e-5, 3e-4, False, 0.0, "token_mean"),
        "gspo eps_hi=0.0003": (SEQ, "fixed", 7e-5, 3e-4, False, 0.0, "token_mean"),
        "f_gspo": (SEQ, "fixed", 7e-5, 3e-4, False, 1.0, "token_mean"),
    },
    "deepcoder": {  # Table 2: token IS, [0.2, 0.28]; the DeepCoder reproduction at fixed 0.2/0.28
        "gapo_token": (TOK, "adaptive", 0.2, 0.28, False, 0.0, "token_mean"),
        "dapo": (TOK, "fixed", 0.2, 0.28, False, 0.0, "token_mean"),
    },
    "gspo_intervention": {  # §4.2.1: GSPO-asym, then GAPO from its checkpoint
        "gspo eps_hi=0.005": QWEN_SEQ["gspo eps_hi=0.005"],
        "gapo": QWEN_SEQ["gapo"],
    },
}
FILE_ALGO = {"qwen_math": "gapo", "llama_math": "gapo", "r1_distill_math": "gapo", "deepcoder": "gapo_token",
             "gspo_intervention": "gspo eps_hi=0.005"}


def key(config: str, overrides: list[str]) -> str:
    """'name eps=value ...' of a command: the file's own method when the command names none."""
    algo = dict(o.removeprefix("algorithm.").split("=", 1) for o in overrides if o.startswith("algorithm."))
    if "name" not in algo:
        base = FILE_ALGO[config].split()
        algo = {**dict(x.split("=") for x in base[1:]), **algo, "name": base[0]}
    return " ".join([algo.pop("name"), *(f"{k}={float(v):g}" for k, v in sorted(algo.items()))])


def paper_page_commands() -> list[tuple[str, list[str]]]:
    section = (ROOT / "docs" / "paper.md").read_text().split("## Paper configs", 1)[1].split("\n## ", 1)[0]
    out = []
    for cmd in re.findall(r"`(gapo-train --config [^`]+)`", section):
        words = shlex.split(cmd)
        out.append((words[2], [w for w in words if "=" in w and not w.startswith("--")]))
    return out


def header_commands() -> list[tuple[str, list[str]]]:
    """The file's own command plus every alternative line `#   algorithm.x=y ... | algorithm.x=y ...`."""
    out = []
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        if path.stem not in PAPER:
            continue
        header = [line[1:].strip() for line in path.read_text().splitlines() if line.startswith("#")]
        for line in header:
            if "gapo-train" in line:
                words = line.split("(")[0].split()
                out.append((path.stem, [w for w in words if w.startswith("algorithm.")]))
            elif line.startswith("algorithm."):
                for alt in line.split(" | "):
                    assert all(w.startswith("algorithm.") and "=" in w for w in alt.split()), (path.name, alt)
                    out.append((path.stem, alt.split()))
    return out


def resolved(config: str, overrides: list[str]) -> tuple:
    a = load_config(config, overrides).algorithm
    return (a.is_level, a.clip, a.eps_lo, a.eps_hi_max if a.clip == "adaptive" else a.eps_hi, a.std_normalize,
            a.focal_gamma, a.loss_agg)


DOCUMENTED = sorted(set((c, tuple(o)) for c, o in paper_page_commands() + header_commands()))


@pytest.mark.parametrize("config, overrides", DOCUMENTED, ids=[f"{c} {' '.join(o)}" for c, o in DOCUMENTED])
def test_documented_command_resolves_to_the_papers_row(config, overrides):
    row = PAPER[config].get(key(config, list(overrides)))
    assert row is not None, f"{config} {overrides}: documented, but no paper row says what it should be"
    got = resolved(config, list(overrides))
    assert got[:2] + got[4:] == row[:2] + row[4:]
    assert got[2:4] == pytest.approx(row[2:4], rel=1e-12)


def test_every_paper_row_is_documented_in_readme_and_headers():
    for where in (paper_page_commands(), header_commands()):
        found = {(c, key(c, o)) for c, o in where}
        missing = {(c, k) for c, rows in PAPER.items() for k in rows} - found
        assert not missing, missing


def test_a_command_line_preset_drops_the_files_method_but_keeps_its_widths(caplog):
    caplog.set_level(logging.INFO, "gapo.config")
    a = load_config("gspo_intervention", ["algorithm.name=grpo"]).algorithm  # the file pins eps_hi=5e-3
    assert (a.eps_lo, a.eps_hi, a.std_normalize) == (0.2, 0.2, True)
    assert "algorithm.eps_hi" in caplog.text  # the user is told what was not used
    a = load_config("r1_distill_math", ["algorithm.name=gspo"]).algorithm  # R1's sequence widths stay
    assert (a.eps_lo, a.eps_hi) == (7e-5, 7e-5)
    # Naming the file's own algorithm keeps the file's switches; explicit command-line switches always win.
    assert load_config("gspo_intervention", ["algorithm.name=gspo"]).algorithm.eps_hi == 5e-3
    assert load_config("qwen_math", ["algorithm.name=gspo", "algorithm.eps_lo=1e-3"]).algorithm.eps_hi == 1e-3


@pytest.mark.parametrize("config", sorted(p.stem for p in (ROOT / "configs").glob("*.yaml")))
def test_every_config_fits_its_models_context(config):
    cfg = load_config(config)
    assert check_context_budget(cfg, cfg.model.path) is not None  # the model's limit is known and respected


def test_a_prompt_and_response_budget_past_the_model_is_refused_naming_both_keys():
    cfg = load_config("qwen_math", ["data.max_prompt_tokens=1024"])  # the file's old value: 1024 + 3092 > 4096
    with pytest.raises(Exception, match=r"data.max_prompt_tokens=1024 \+ rollout.max_new_tokens=3092 = 4116.*4096"):
        check_context_budget(cfg, cfg.model.path)


# --- rehearsals: every shipped config, as its header runs it, plus the step-600 intervention ---------------
ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "WANDB_SILENT": "true", "HF_HUB_OFFLINE": "1"}
NPROC = {"demo_cpu": 1, "tiny_cpu": 1}  # the CPU configs run on one rank; the paper's on 8 (rehearsed on 2)


def rehearse(config: str, out: Path, *args: str) -> tuple[subprocess.CompletedProcess, str]:
    cmd = [str(BIN / "gapo-train"), "--config", config, "--nproc", str(NPROC.get(config, 8)), "--rehearse",
           f"trainer.output_dir={out}", *args]
    r = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    return r, f"{' '.join(cmd)}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


def train_rows(run: Path) -> list[dict]:
    return [x for x in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in x]


@pytest.fixture(scope="module")
def rehearsed(tmp_path_factory) -> Callable[[str], tuple[subprocess.CompletedProcess, str, Path]]:
    """rehearsed(config) -> (result, log, output_dir) of `config`'s rehearsal as shipped, rehearsed once for the
    module: test_intervention_branch_... branches from the gspo_intervention one that test_every_config_rehearses
    checks (one rehearsal fewer, ~25 s on 2 cores; issue 46)."""
    root, done = tmp_path_factory.mktemp("rehearsals"), {}

    def get(config: str):
        if config not in done:
            done[config] = (*rehearse(config, root / config), root / config)
        return done[config]

    return get


@pytest.mark.e2e
@pytest.mark.parametrize("config", sorted(p.stem for p in (ROOT / "configs").glob("*.yaml")))
def test_every_config_rehearses(config, rehearsed):
    r, log, out = rehearsed(config)
    local = load_config(config).data.train == "arithmetic"
    # Offline (HF_HUB_OFFLINE), a hub dataset is not read: the report must not say PASSED (a cached copy would be)
    assert r.returncode == 0 and ("# Rehearsal: PASSED" in r.stdout if local else
                                  "# Rehearsal: PASSED" in r.stdout and "- data: NOT checked" not in r.stdout or
                                  "# Rehearsal: STEPS PASSED, DATA NOT CHECKED" in r.stdout
                                  and "- data: NOT checked" in r.stdout), log
    run = Path(f"{out}-rehearsal")
    cfg, used = load_config(config), load_config(run / "rehearsal_config.yaml")
    # What the config sets is what ran: algorithm, precision, checkpointing, old-log-prob pass, stage, epochs.
    assert used.algorithm == cfg.algorithm
    assert (used.model.dtype, used.model.gradient_checkpointing, used.rollout.use_engine_logprobs,
            used.trainer.zero_stage, used.trainer.ppo_epochs) == (
        cfg.model.dtype, cfg.model.gradient_checkpointing, cfg.rollout.use_engine_logprobs,
        cfg.trainer.zero_stage, cfg.trainer.ppo_epochs)
    rows = train_rows(run)
    assert [x["step"] for x in rows] == [1, 2]
    if not cfg.rollout.use_engine_logprobs:  # on-policy: the first mini-batch's IS ratio is exactly 1
        assert all(x["first_minibatch/max_abs_log_ratio"] == 0.0 for x in rows)
    assert all(x["skipped_steps"] == 0 for x in rows)
    assert (run / "checkpoints").is_dir() and (run / "rehearsal.md").is_file()
    assert "peak per GPU" in (run / "memory_plan.txt").read_text()  # every run logs its plan


@pytest.mark.e2e
def test_intervention_branch_rehearses_from_a_rehearsed_checkpoint(rehearsed):
    r, log, out = rehearsed("gspo_intervention")  # the parent, as test_every_config_rehearses checks it
    assert r.returncode == 0, log
    ckpt = sorted(Path(f"{out}-rehearsal", "checkpoints").glob("step_*"))[-1]  # step 2 (step 1 is kept too)
    r, log = rehearse("gspo_intervention", out, "--resume", str(ckpt), "algorithm.name=gapo")
    assert r.returncode == 0 and "# Rehearsal: " in r.stdout and "FAILED" not in r.stdout, log
    branch = Path(f"{out}-rehearsal-resumed")
    cfg = load_config(branch / "config.yaml")
    assert (cfg.algorithm.name, cfg.algorithm.clip, cfg.algorithm.eps_lo, cfg.algorithm.eps_hi_max) == (
        "gapo", "adaptive", 3e-3, 5e-3)
    rows = [json.loads(x) for x in (branch / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["branch/parent_step"] == 2 and [x["step"] for x in train_rows(branch)] == [3, 4]


@pytest.mark.e2e
def test_deepcoder_rehearses_on_its_three_source_formats(tmp_path):
    """The DeepCoder config as shipped, its three sources swapped for local files in each source's format: they
    load, concatenate, and every rollout is scored by the sandbox (no parse or rewarder errors)."""
    fixtures = ROOT / "tests" / "fixtures" / "deepcoder"
    sources = ", ".join(f"{{source: {fixtures / name}.jsonl}}" for name in ("primeintellect", "taco", "lcbv5"))
    r, log = rehearse("deepcoder", tmp_path / "dc", f"data.train=[{sources}]")
    assert r.returncode == 0 and "# Rehearsal: PASSED" in r.stdout, log
    run = tmp_path / "dc-rehearsal"
    sample = [json.loads(x) for x in (run / "data_sample.jsonl").read_text().splitlines()]
    assert [x["id"].split(":")[1] for x in sample] == ["primeintellect"] * 3 + ["taco"] * 2 + ["lcbv5"] * 3
    for row in train_rows(run):
        fracs = [row[f"reward/{s}_frac"] for s in ("correct", "wrong", "no_answer", "timeout", "error")]
        assert row["reward/error_frac"] == 0.0 and sum(fracs) == pytest.approx(1.0), row
    # The tiny model writes no code, so score what the rehearsal trained on with the reference solutions: the
    # problems survived the round trip (function names, starter code) and the sandbox passes every one.
    from gapo.data import load_problems
    from gapo.reward.code import default_runner

    runner = default_runner()
    for p in load_problems(str(run / "data_sample.jsonl")):
        assert [r.reward for r in runner.score([f"```python\n{p.meta['solutions'][0]}```"], p.gold)] == [1.0], p.uid


@pytest.mark.parametrize("config", PAPER)
def test_print_config_shows_the_memory_plan_and_stays_a_config(config, capsys):
    from gapo.cli import train_main

    assert train_main(["--config", config, "--nproc", "8", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^#   peak per GPU +[\d.]+  of 80.0 GB: fits$", out, re.M), out[-1500:]
    assert "8 ranks" in out
    assert resolve(yaml.safe_load(out)) == load_config(config)  # the plan is comments: the YAML is unchanged


def test_the_rehearsal_checks_every_local_record_and_refuses_them_with_on_invalid_error(tmp_path):
    """Before training anything, the rehearsal reads the whole local training file and counts what the run would
    drop, by reason; with data.on_invalid=error it fails as the run would, naming the records."""
    from gapo.errors import ConfigError
    from gapo.rehearse import prepare

    f = tmp_path / "train.jsonl"
    rows = [{"problem": "1 + 1?", "answer": ""}, {"problem": "2 + 2?", "answer": None},
            *({"problem": f"{i} + 1?", "answer": str(i + 1)} for i in range(20))]
    f.write_text("".join(json.dumps(x) + "\n" for x in rows))
    cfg = load_config("tiny_cpu", [f"data.train={f}", f"trainer.output_dir={tmp_path / 'run'}"])
    p, run_dir = prepare(cfg, 1)
    assert p.data_check == ("all 22 records checked: 2 of 22 records (empty answer: 1, no answer: 1) cannot be "
                            "scored, dropped by the run")
    sample = [json.loads(x) for x in (run_dir / "data_sample.jsonl").read_text().splitlines()]
    assert sample and all(x["answer"] for x in sample)
    cfg = load_config("tiny_cpu", [f"data.train={f}", "data.on_invalid=error", f"trainer.output_dir={tmp_path / 'x'}"])
    with pytest.raises(ConfigError, match=r"data.train: 2 of 22 records .* cannot be scored \(data.on_invalid=error\)"):
        prepare(cfg, 1)



def test_a_benchmark_the_rehearsal_leaves_out_keeps_its_whole_reason(monkeypatch, tmp_path):
    """The end of the reason (what is missing, what to set) is what a user acts on, so no cut may reach it."""
    from gapo.errors import ConfigError
    from gapo.evaluation import load_benchmark
    from gapo.rehearse import _benchmarks

    monkeypatch.setenv("GAPO_DATA_DIR", str(tmp_path))  # empty: codeforces has no local file, and no hub dataset
    cfg = load_config("deepcoder", ["eval.benchmarks=[codeforces]"])
    with pytest.raises(ConfigError) as err:
        load_benchmark("codeforces", 2, cfg.data)
    scaled: list[str] = []
    assert _benchmarks(cfg, scaled) == []
    line = next(s for s in scaled if s.startswith("eval.benchmarks: codeforces"))
    assert line.split("\n") == ["eval.benchmarks: codeforces left out, because:", f"      {err.value}"]
    assert "set GAPO_DATA_DIR" in line and len(str(err.value)) > 160  # longer than a one-line quote would keep
