"""The console of gapo-train and gapo-eval: library output and raw fd writes go to a log, a person's lines to the
console, results to stdout."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gapo.configfile import load_config
from gapo.console import run_header, step_line

ROOT = Path(__file__).resolve().parents[1]

# A training process in miniature: libraries log and write to fds 1 and 2 (also from a child process) before
# and after the run directory is known; gapo says a few lines over a progress bar.
SCRIPT = textwrap.dedent("""
    import logging, os, subprocess, sys, time
    from pathlib import Path
    from tqdm import tqdm
    from gapo import console

    logging.basicConfig(level=logging.INFO)
    run_dir, verbose, fail = Path(sys.argv[1]), sys.argv[2] == "1", sys.argv[3] == "1"
    if not verbose:
        Path(sys.argv[4]).write_text(str(console.capture()))
    logging.getLogger("transformers").warning("LIB-EARLY")
    os.write(2, b"RAW-EARLY\\n")
    console.attach(run_dir)
    logging.getLogger("vllm").info("LIB-INFO")
    os.write(1, b"RAW-FD1\\n")
    print("PRINTED")
    subprocess.run(["sh", "-c", "echo CHILD-OUT; echo CHILD-ERR >&2"], check=True)
    logging.getLogger("gapo.data").warning("GAPO-WARNS")
    for step in tqdm(range(1, 4), desc="steps", total=3, file=console.terminal(), mininterval=0):
        time.sleep(0.01)
        console.say(f"step {step}/3 STEP-LINE")
    console.result("RESULT-TABLE")
    if fail:
        raise RuntimeError("BOOM")
""")
CHATTER = ["LIB-EARLY", "RAW-EARLY", "LIB-INFO", "RAW-FD1", "PRINTED", "CHILD-OUT", "CHILD-ERR"]


def _run(tmp_path: Path, verbose: bool, fail: bool = False) -> tuple[subprocess.CompletedProcess, Path, Path]:
    run_dir, where = tmp_path / "run", tmp_path / "temp_log_path"
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(run_dir), str(int(verbose)), str(int(fail)), str(where)],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    return r, run_dir, where


def _screen(text: str) -> list[str]:
    """What a terminal shows for `text`: a carriage return goes back to column 0 and overwrites."""
    rows, col = [[]], 0
    for ch in text:
        if ch == "\n":
            rows.append([])
            col = 0
        elif ch == "\r":
            col = 0
        else:
            row = rows[-1]
            row[col:col + 1] = [ch]
            col += 1
    return ["".join(row).rstrip() for row in rows]


def test_library_output_goes_to_train_log_and_the_console_keeps_the_run(tmp_path):
    r, run_dir, where = _run(tmp_path, verbose=False)
    assert r.returncode == 0, r.stderr
    console = r.stdout + r.stderr
    for word in CHATTER:
        assert word not in console, (word, console)
    log = (run_dir / "train.log").read_text()
    for word in [*CHATTER, "GAPO-WARNS", "STEP-LINE", "RESULT-TABLE"]:
        assert word in log, (word, log)
    assert r.stdout == "RESULT-TABLE\n"  # a result (gapo-eval's tables) on the real stdout, where it can be piped
    assert not Path(where.read_text()).exists()  # the temporary log moved into the run directory
    # gapo's own warnings and the step lines reach the console, each on a line of its own above the bar
    screen = _screen(r.stderr)
    assert "WARNING gapo.data: GAPO-WARNS" in screen, screen
    assert [row for row in screen if "STEP-LINE" in row] == [f"step {i}/3 STEP-LINE" for i in (1, 2, 3)], screen
    assert any(row.startswith("steps: 100%") for row in screen), screen


def test_verbose_keeps_everything_on_the_console(tmp_path):
    r, run_dir, _ = _run(tmp_path, verbose=True)
    assert r.returncode == 0, r.stderr
    for word in [*CHATTER, "STEP-LINE"]:
        assert word in r.stdout + r.stderr, word
    assert "RESULT-TABLE" in r.stdout
    assert not (run_dir / "train.log").exists()


def test_an_error_reaches_the_console_in_full_and_names_the_log(tmp_path):
    r, run_dir, _ = _run(tmp_path, verbose=False, fail=True)
    assert r.returncode == 1
    assert "Traceback" in r.stderr and "RuntimeError: BOOM" in r.stderr, r.stderr
    assert f"full output: {run_dir / 'train.log'}" in r.stderr
    assert "RuntimeError: BOOM" in (run_dir / "train.log").read_text()
    assert "LIB-INFO" not in r.stderr


def test_a_run_that_stops_before_its_directory_leaves_no_temporary_log(tmp_path):
    script = ("import sys; from pathlib import Path; from gapo import console; "
              "Path(sys.argv[1]).write_text(str(console.capture())); print('CHATTER')")
    where = tmp_path / "where"
    r = subprocess.run([sys.executable, "-c", script, str(where)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "CHATTER" not in r.stdout, r.stderr
    assert not Path(where.read_text()).exists()


@pytest.mark.parametrize("total", [9, 12, 300])
def test_step_lines_are_aligned_columns(total):
    small = {"reward/mean": 0.0, "clip_frac": 0.0, "response/len_mean": 5.0, "time/generate_s": 1.0,
             "time/train_s": 2.0, "time/weight_push_s": 0.1}
    large = {"reward/mean": -0.875, "response/len_mean": 255.5, "time/generate_s": 123.4,  # no clip_frac: nan
             "time/train_s": 456.7, "time/weight_push_s": 12.34}
    lines = [step_line(1, total, small), step_line(total, total, large)]
    for word in ("reward", "clip", "len", "gen", "train", "push"):
        assert len({line.index(f" {word} ") for line in lines}) == 1, (word, lines)
    assert len({len(line) for line in lines}) == 1, lines


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_the_resolved_run_fits_in_a_few_lines(path):
    cfg = load_config(path, ["trainer.resume_from=runs/parent"])
    text = run_header(cfg, Path("runs/x"), world=2, threads=3)
    assert len(text.splitlines()) <= 7 and "runs/x  (from runs/parent)" in text, text
    assert "threads    3 per rank (" in text, text
    assert f"{cfg.algorithm.name}: {cfg.algorithm.is_level} IS" in text and "2 ranks, ZeRO stage 3" in text, text


def test_one_rank_says_what_runs():
    """One rank runs DeepSpeed unpartitioned (stage 0 in fp32, 1 in bf16), whatever trainer.zero_stage says."""
    fp32, bf16 = load_config("demo_cpu"), load_config("qwen_math")
    x = Path("runs/x")
    assert "1 rank, ZeRO stage 0 (one rank: nothing to partition)" in run_header(fp32, x, world=1, threads=1)
    assert "1 rank, ZeRO stage 1 (one rank: nothing to partition)" in run_header(bf16, x, world=1, threads=1)
    assert "8 ranks, ZeRO stage 3" in run_header(bf16, x, world=8, threads=1)


@pytest.mark.parametrize("env, ranks, threads, why", [
    ({}, 2, "CORES/2", "cores / 2 local ranks"),
    ({}, 1, "CORES", "cores / 1 local rank"),
    ({"SLURM_CPUS_PER_TASK": "1"}, 1, "1", "1 SLURM_CPUS_PER_TASK / 1 local rank"),
    ({"OMP_NUM_THREADS": "5"}, 2, "5", "OMP_NUM_THREADS set by the user"),
    ({}, 10_000, "1", "/ 10000 local ranks"),
])
def test_each_rank_gets_its_share_of_the_cores(monkeypatch, env, ranks, threads, why):
    """vLLM keeps torch at OMP_NUM_THREADS (1 when unset) and torchrun hands each rank 1: gapo.launch shares the
    cores out instead (issue 52 item 2); a user's OMP_NUM_THREADS wins."""
    from gapo.distributed import THREADS_WHY, share_cores

    # share_cores writes os.environ: a copy of it here, so that nothing leaks into later tests of this process
    monkeypatch.setattr(os, "environ", {**{k: v for k, v in os.environ.items()
                                           if k not in ("OMP_NUM_THREADS", THREADS_WHY, "SLURM_CPUS_PER_TASK")}, **env})
    cores = len(os.sched_getaffinity(0))
    share_cores(ranks)
    expect = {"CORES/2": str(max(1, cores // 2)), "CORES": str(cores)}.get(threads, threads)
    assert os.environ["OMP_NUM_THREADS"] == expect and why in os.environ[THREADS_WHY], os.environ[THREADS_WHY]


@pytest.mark.parametrize("argv, ranks", [
    (["--nproc_per_node", "4", "-m", "gapo.cli"], 4), (["--nproc-per-node=3"], 3), (["--nnodes", "2"], 1),
    (["--nproc_per_node", "gpu"], None), (["--nproc_per_node=0"], None),
])
def test_launch_reads_torchruns_local_rank_count(argv, ranks):
    from gapo.launch import local_ranks

    assert local_ranks(argv) == ranks


def test_a_quoted_error_is_cut_at_a_sentence_or_a_word_never_inside_one():
    """papercuts: gloo's error quoted mid-word on the dead-rank line, a rehearsal's benchmark reason cut at a width."""
    from gapo.console import brief

    gloo = ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:20633. This is "
            "typically caused by a remote process exiting.")
    assert brief(gloo) == ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                           "[127.0.0.1]:20633.")
    long = "Dataset 'math' (split 'train') failed: " + "data files could not be found anywhere " * 5
    cut = brief(long, 60)
    assert cut.endswith(" ...") and long.startswith(cut[:-4]) and len(cut) <= 64
    assert long[len(cut) - 4] == " "  # the word before the cut is whole
    assert brief("short\nsecond line") == "short" and brief("") == ""


@pytest.mark.e2e  # (gapo.cli in a subprocess: the tier guard's rule; it stops before any engine, in 3 s)
def test_a_training_process_sets_its_openmp_settings_before_torch_loads():
    """OpenMP reads OMP_WAIT_POLICY and OMP_NUM_THREADS once, when torch loads it: gapo-train's checks of names that
    load torch (a rewarder, a benchmark, a transport) come after it sets them, in a process that trains."""
    code = ("import sys\nimport gapo.cli as cli\n"
            "def shared(n):\n    print('torch' in sys.modules)\n    sys.exit(0)\n"
            "cli.share_cores = shared\n"
            "cli.train_main(['--config', 'tiny_cpu'])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stdout + r.stderr[-2000:]
