"""The cluster path under a real SLURM (the `cluster` tier; tests/slurm_cluster.py starts it): docs/cluster.md's
commands for experiments/tiny_cluster.yaml (two runs and a branch of the second, 2 ranks per job on gloo) from a
folder that stands for the clone's root, one run preempted by a job of a higher-priority partition, one reaching its
time limit, the evaluation as SLURM jobs (again from another folder), and the table, which must equal the one a local
`gapo-sweep --run` + `--eval` of the same manifest gives (fp32: the same numbers, preemptions or not).

One chain serves every test (module fixture): about 10 minutes on 2 cores. A requeued job waits 2 minutes before it
may start again (SLURM's own delay); the test lets it start at once (`scontrol update StartTime=now`), as an
administrator could, and gives the time-limited job its time back, which SLURM does by itself on a real requeue.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]

BIN = Path(sys.executable).parent
M = "tiny_cluster"
ENV_EXTRA = {"OMP_WAIT_POLICY": "PASSIVE", "WANDB_SILENT": "true", "HF_HUB_OFFLINE": "1"}


def _wait(what: str, done, timeout: float, slurm, poll: float = 1.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = done()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; queue: {slurm.squeue()}")


def _run(cmd: list[str], cwd: Path, env: dict, timeout: float = 900) -> str:
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(cmd)} (in {cwd}) exit {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def _submitted(stdout: str) -> dict[str, str]:
    """submit.sh's lines `gapo-sweep: <what>: job <id>[, after ...]` -> {what: id}."""
    return {m[1]: m[2] for m in re.finditer(r"^gapo-sweep: (.+?): job (\d+_\d+)", stdout, re.M)}


def _requeued(slurm, job_id: str) -> bool:
    j = slurm.job(job_id)
    return int(j["Restarts"]) >= 1 and j["JobState"] == "PENDING"


def _checkpoint(run: Path, step: int) -> bool:
    return (run / "checkpoints" / f"step_{step:06d}" / "trainer.json").is_file()


@pytest.fixture(scope="module")
def chain(slurm, tmp_path_factory):
    clone = tmp_path_factory.mktemp("clone")  # stands for the clone's root: docs/cluster.md's relative paths
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    env = {**slurm.env, **ENV_EXTRA}
    runs = clone / "runs" / M
    out = {"clone": clone, "elsewhere": elsewhere, "runs": runs, "t0": time.monotonic()}

    # docs/cluster.md's two commands, from the clone's root.
    _run([str(BIN / "gapo-sweep"), M, "--slurm"], clone, env)
    ids = _submitted(_run(["bash", f"runs/{M}/slurm/submit.sh"], clone, env))
    out["ids"] = ids
    out["branch_dependency"] = slurm.job(ids["gapo_from_gspo seed 0"])["Dependency"]

    # Preemption: once gapo has saved, a job of the `urgent` partition needs its CPUs.
    _wait("gapo's first checkpoint", lambda: _checkpoint(runs / "gapo" / "seed0", 10), 600, slurm)
    slurm.run("sbatch", "-p", "urgent", f"--cpus-per-task={slurm.cpus}", "--output=/dev/null", "--wrap", "true")
    _wait("gapo's requeue after its preemption", lambda: _requeued(slurm, ids["gapo seed 0"]), 180, slurm)
    slurm.run("scontrol", "update", f"JobId={ids['gapo seed 0']}", "StartTime=now")

    # Time limit: once gspo has saved, its limit is cut to what it has run + 2 minutes, inside --signal=USR1@300.
    _wait("gspo's first checkpoint", lambda: _checkpoint(runs / "gspo" / "seed0", 10), 600, slurm)
    elapsed = slurm.job(ids["gspo seed 0"])["RunTime"].split(":")
    slurm.run("scontrol", "update", f"JobId={ids['gspo seed 0']}", f"TimeLimit={int(elapsed[-2]) + 2}")
    _wait("gspo's requeue at its time limit", lambda: _requeued(slurm, ids["gspo seed 0"]), 180, slurm)
    slurm.run("scontrol", "update", f"JobId={ids['gspo seed 0']}", "TimeLimit=30", "StartTime=now")

    _wait("every job to end", lambda: not slurm.squeue(), 1500, slurm, poll=3)
    out["states"] = {what: slurm.job(i) for what, i in ids.items()}
    out["chain_s"] = time.monotonic() - out["t0"]

    # The evaluation again, submitted from another folder, one result removed: that one is redone, the others
    # are skipped (what a requeued evaluation task does).
    redo = runs / "gapo_from_gspo" / "seed0" / "eval" / "tiny" / "step_000100"
    out["before"] = json.loads((redo / "results.json").read_text())["metrics"]
    _run([str(BIN / "gapo-sweep"), M, "--eval", "--slurm"], clone, env)
    shutil.rmtree(redo)
    out["eval_ids"] = _submitted(_run(["bash", str(runs / "slurm" / "submit_eval.sh")], elsewhere, env))
    _wait("the evaluation array to end", lambda: not slurm.squeue(), 600, slurm, poll=2)
    out["eval_states"] = {what: slurm.job(i) for what, i in out["eval_ids"].items()}
    out["after"] = json.loads((redo / "results.json").read_text())["metrics"]

    _run([str(BIN / "gapo-compare"), "table", M], clone, env, timeout=300)
    out["table"] = (runs / "compare" / "table.md").read_text()

    # The same manifest here, without SLURM.
    local = tmp_path_factory.mktemp("local")
    _run([str(BIN / "gapo-sweep"), M, "--run"], local, env, timeout=1200)
    _run([str(BIN / "gapo-sweep"), M, "--eval"], local, env)
    _run([str(BIN / "gapo-compare"), "table", M], local, env, timeout=300)
    out["local_table"] = (local / "runs" / M / "compare" / "table.md").read_text()
    out["local"] = local / "runs" / M
    print(f"cluster chain: {out['chain_s']:.0f} s under SLURM, {time.monotonic() - out['t0']:.0f} s in all")
    return out


def _log(chain, job_id: str) -> str:
    """A job's log where docs/cluster.md says: runs/<manifest>/slurm/logs/<job name>-<array job>_<task>.out."""
    job, task = job_id.split("_")
    found = list((chain["runs"] / "slurm" / "logs").glob(f"*-{job}_{task}.out"))
    assert len(found) == 1, (job_id, sorted(p.name for p in (chain["runs"] / "slurm" / "logs").iterdir()))
    return found[0].read_text()


def test_every_job_ends_well_with_its_log_where_the_readme_says(chain):
    assert set(chain["ids"]) == {"gapo seed 0", "gspo seed 0", "gapo_from_gspo seed 0", "evaluation of gapo seed 0",
                                 "evaluation of gspo seed 0", "evaluation of gapo_from_gspo seed 0"}
    for what, state in {**chain["states"], **chain["eval_states"]}.items():
        assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), (what, state)
        assert state["StdOut"].startswith(str(chain["runs"] / "slurm" / "logs") + "/"), state["StdOut"]
        assert Path(state["StdOut"]).is_file() and state["WorkDir"] == str(chain["clone"])
    for job_id in [*chain["ids"].values(), *chain["eval_ids"].values()]:
        assert "gapo-sweep: exit 0 at" in _log(chain, job_id)
    assert not (chain["runs"] / "slurm" / "runs").exists() and not any(chain["elsewhere"].iterdir())
    names = {s["JobName"] for s in chain["states"].values()}  # what squeue and sacct show
    assert names == {f"{M}-runs", f"{M}-gapo_from_gspo-seed0", f"{M}-eval"}


def _steps(run: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()
            if "reward/mean" in json.loads(x)]


@pytest.mark.parametrize("run, signal", [("gapo", "SIGTERM"), ("gspo", "SIGUSR1")])
def test_a_preempted_and_a_time_limited_task_requeue_and_resume_from_their_own_checkpoint(chain, run, signal):
    """gapo was preempted (SIGTERM from SLURM, the urgent partition's job), gspo reached its time limit (SIGUSR1
    from --signal=USR1@300): each saved, exited 75, requeued itself and went on from its own newest checkpoint."""
    state = chain["states"][f"{run} seed 0"]
    log = _log(chain, chain["ids"][f"{run} seed 0"])
    assert int(state["Restarts"]) >= 1, state
    assert f"gapo.launch: {signal} received" in log and "saved after a signal (exit 75)" in log
    assert ", start 1 on " in log and ", start 2 on " in log  # both attempts in one log (--open-mode=append)
    resumed = re.search(rf"resume     auto: from runs/{M}/{run}/seed0/checkpoints/step_(\d+) \(step (\d+)\)", log)
    assert resumed and 10 <= int(resumed[2]) < 100, log[-3000:]
    assert _steps(chain["runs"] / run / "seed0") == list(range(1, 101))  # each step once, none lost


def test_the_branch_waits_for_its_own_parent(chain):
    """Two parents: the branch of the second waits for task 1 (gspo), not task 0, and starts after gspo ended."""
    runs_job = chain["ids"]["gspo seed 0"].split("_")[0]
    assert chain["branch_dependency"].startswith(f"afterok:{runs_job}_1"), chain["branch_dependency"]
    gspo_end = re.findall(r"gapo-sweep: exit 0 at (\S+)", _log(chain, chain["ids"]["gspo seed 0"]))[-1]
    branch = _log(chain, chain["ids"]["gapo_from_gspo seed 0"])
    branch_start = re.search(r", start 1 on \S+ at (\S+)", branch)[1]
    assert branch_start >= gspo_end  # ISO times of one clock
    assert f"runs/{M}/gspo/seed0/checkpoints/step_000050" in branch
    assert _steps(chain["runs"] / "gapo_from_gspo" / "seed0") == list(range(51, 101))


def test_the_evaluation_runs_as_jobs_and_skips_what_is_done(chain):
    """Each run's evaluation was a task of the evaluation array, after its training; submitted again from another
    folder, the tasks skip their evaluated checkpoints and redo the one removed, with the same numbers."""
    for what in ("gapo", "gspo"):
        log = _log(chain, chain["eval_ids"][f"evaluation of {what} seed 0"])
        assert "every requested step is evaluated already" in log, log[-2000:]
    assert chain["after"] == chain["before"]
    for run, steps in (("gapo", (50, 100)), ("gspo", (50, 100)), ("gapo_from_gspo", (100,))):
        for step in steps:
            assert (chain["runs"] / run / "seed0" / "eval" / "tiny" / f"step_{step:06d}" / "results.json").is_file()


def _rows(run: Path) -> list[dict]:
    """metrics.jsonl without timings: what a preemption and a resume must not change."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))} for r in rows]


def test_the_table_equals_the_local_chains(chain):
    """The table, and beneath it every step's metrics and every evaluation, equal those of `gapo-sweep --run` +
    `--eval` here (fp32): the preempted and the time-limited runs lost nothing and redid nothing differently."""
    assert "| GAPO |" in chain["table"] and "| GSPO |" in chain["table"] and "## Missing" not in chain["table"]
    assert chain["table"] == chain["local_table"]
    for run, steps in (("gapo", (50, 100)), ("gspo", (50, 100)), ("gapo_from_gspo", (100,))):
        ours, local = chain["runs"] / run / "seed0", chain["local"] / run / "seed0"
        assert _rows(ours) == _rows(local), run
        for step in steps:
            result = f"eval/tiny/step_{step:06d}/results.json"
            assert json.loads((ours / result).read_text())["metrics"] == \
                json.loads((local / result).read_text())["metrics"], (run, step)
