"""The sweep's graph (gapo.study.manifest.graph) as SLURM job arrays and the script that submits them.

Training tasks with nothing to wait for form one array (the runs); those that wait for a parent form a second
(the branches), each task submitted alone with its dependency; the evaluations form a third. The manifest's
`slurm:` block (gapo-sweep's --partition, --time, ... over it) says what each array asks SLURM for.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gapo.errors import ConfigError, out_folder
from gapo.study.manifest import Job, Manifest, Task, local_command

# SLURM's time formats (sbatch --time): M, M:S, H:M:S, D-H, D-H:M, D-H:M:S, or unlimited (-1, infinite)
SLURM_TIME = re.compile(r"(\d+-)?\d+(:\d+){0,2}|-1|unlimited|infinite", re.IGNORECASE)


class SlurmSpec(BaseModel):
    """The manifest's `slurm:` block: what `--slurm` asks the scheduler for. gapo-sweep's --partition, --account,
    --qos, --constraint, --time, --eval-time and --mem (FLAGS) give the same over the manifest's."""

    model_config = ConfigDict(extra="forbid")
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    time: str | None = Field(None, description="A training task's time limit (SLURM's format, e.g. 2-00:00:00); at "
                                               "it the task saves and requeues itself. Default: the partition's.")
    eval_time: str | None = Field(None, description="An evaluation task's time limit. Default: the partition's.")
    mem: str | None = Field(None, description="Memory per node (SLURM's format, e.g. 500G). Default: the "
                                              "cluster's.")
    gpus_per_node: int | None = Field(None, ge=0, description="Default: nproc, one GPU per rank; 0 for a CPU run "
                                                              "(no GPU asked for).")
    cpus_per_task: int | None = Field(None, ge=1, description="CPUs per node for its ranks, their engines and the "
                                                              "reward workers. Default: 4 per rank.")
    signal_lead_s: int = Field(300, ge=1, description="SIGUSR1 this many seconds before the time limit "
                                                      "(--signal=USR1@N); must exceed every run's "
                                                      "trainer.preempt_deadline_s by the time a save takes.")

    @field_validator("time", "eval_time")
    @classmethod
    def _slurm_time(cls, value: str | None) -> str | None:
        if value is not None and not SLURM_TIME.fullmatch(value):  # sbatch would refuse it only at submission
            raise ValueError(f"{value!r} is not a SLURM time: expected minutes, H:M:S or D-H:M:S (e.g. 2-00:00:00), "
                             "or unlimited")
        return value


FLAGS = ("partition", "account", "qos", "constraint", "time", "eval_time", "mem")  # gapo-sweep --FLAG over the block


def check(m: Manifest, js: list[Job]) -> None:
    """A run that cannot save before its time limit's signal fails here, not at the limit."""
    lead = m.block("slurm", SlurmSpec).signal_lead_s
    for j in js:
        deadline = j.resolved().trainer.preempt_deadline_s
        if deadline >= lead:
            raise ConfigError(f"slurm.signal_lead_s={lead} must exceed run {j.run.name}'s "
                              f"trainer.preempt_deadline_s={deadline:g} by the time a save takes: the signal before "
                              "the time limit would come too late to save")


LOGS = "logs"  # in the slurm folder: every job's output, <job name>-<array job id>_<task>.out, appended to on requeue


def render(m: Manifest, tasks: list[Task], out_dir: Path, workdir: Path) -> list[Path]:
    """The job-array scripts and submit.sh, which submits them from any folder: a task that depends on others
    waits for theirs (afterok: <array job>_<task>). A graph of evaluations alone gives the evaluation array and
    submit_eval.sh instead, so that the sweep's submit.sh stays. Paths in the commands are relative to `workdir`,
    which every job starts in (--chdir)."""
    workdir = workdir.resolve()
    out_dir = out_folder((workdir / out_dir).resolve(), "--slurm")
    runs = [t for t in tasks if t.kind == "train" and not t.depends_on]
    branches = [t for t in tasks if t.kind == "train" and t.depends_on]
    evals = [t for t in tasks if t.kind == "eval"]
    if not evals:
        raise ConfigError(f"{m.name}: no run has a checkpoint of its own in eval.steps: nothing to evaluate")
    ev = _eval_script(m, evals, out_dir / f"{m.name}.eval.sbatch", workdir)
    if not runs and not branches:
        waiting = [t.name for t in evals if t.depends_on]
        if waiting:
            raise ConfigError(f"slurm: {', '.join(waiting)} wait for training the graph does not hold")
        lines = _submit_head(m, out_dir, "the evaluation array (checkpoints evaluated already are skipped)")
        lines += [f"EVAL=$(submit {shlex.quote(str(ev))})"]
        lines += [f'echo "gapo-sweep: {t.name}: job ${{EVAL}}_{k}"' for k, t in enumerate(evals)]
        return [ev, _write_submit(out_dir / "submit_eval.sh", lines, out_dir)]

    # each task's array script and index, for the commands that submit a task again after it failed unsaved
    where = {t.name: (out_dir / f"{m.name}.runs.sbatch", i, "") for i, t in enumerate(runs)}
    where |= {t.name: (out_dir / f"{m.name}.branches.sbatch", i, f" --job-name={_branch_name(m, t)}")
              for i, t in enumerate(branches)}
    where |= {t.name: (out_dir / f"{m.name}.eval.sbatch", i, "") for i, t in enumerate(evals)}
    again = {t.name: _submit_again(t, tasks, where) for t in [*runs, *branches]}
    written = [_train_script(m, runs, out_dir / f"{m.name}.runs.sbatch", workdir, "runs", again)]
    if branches:
        written.append(_train_script(m, branches, out_dir / f"{m.name}.branches.sbatch", workdir, "branches", again))
    written.append(ev)
    job_of = {t.name: f"${{RUNS}}_{i}" for i, t in enumerate(runs)}  # each task's <array job>_<task>

    def after(t: Task) -> str:
        missing = [d for d in t.depends_on if d not in job_of]
        if missing:
            raise ConfigError(f"slurm: {t.name} waits for {', '.join(missing)}, not submitted before it")
        return ":".join(job_of[d] for d in t.depends_on)

    lines = _submit_head(m, out_dir, "the runs, each branch after its parent's task, each evaluation after its run")
    lines += [f"RUNS=$(submit {shlex.quote(str(written[0]))})"]
    lines += [f'echo "gapo-sweep: {t.name}: job ${{RUNS}}_{i}"' for i, t in enumerate(runs)]
    for i, t in enumerate(branches):
        lines += [f"B{i}=$(submit --array={i} --job-name={_branch_name(m, t)} "
                  f"--dependency=afterok:{after(t)} --kill-on-invalid-dep=yes {shlex.quote(str(written[1]))})",
                  f'echo "gapo-sweep: {t.name}: job ${{B{i}}}_{i}, after {after(t)}"']
        job_of[t.name] = f"${{B{i}}}_{i}"
    for k, t in enumerate(evals):
        wait = f" --dependency=afterok:{after(t)} --kill-on-invalid-dep=yes" if t.depends_on else ""
        lines += [f"E{k}=$(submit --array={k}{wait} {shlex.quote(str(ev))})",
                  f'echo "gapo-sweep: {t.name}: job ${{E{k}}}_{k}"']
    return [*written, _write_submit(out_dir / "submit.sh", lines, out_dir)]


def _branch_name(m: Manifest, t: Task) -> str:
    return f"{m.name}-{t.job.run.name}-seed{t.job.seed}"


def _submit_again(task: Task, tasks: list[Task], where: dict[str, tuple[Path, int, str]]) -> str:
    """The commands that submit `task` again and, each after what it waits for, every task that waits for it (a
    training task that failed unsaved is not requeued, and SLURM cancels those: --kill-on-invalid-dep). A task that
    also waits for one not submitted again says so in a comment: that one's job id is not known here."""
    again = [task.name]
    while grown := [t.name for t in tasks if t.name not in again and any(d in again for d in t.depends_on)]:
        again += grown  # whatever order the graph lists them in, a task comes after the ones it waits for
    job, lines = {name: f"J{n}" for n, name in enumerate(again)}, []
    for name in again:
        t = next(x for x in tasks if x.name == name)
        after = ":".join(f"${{{job[d]}}}_{where[d][1]}" for d in t.depends_on if d in job)
        wait = f" --dependency=afterok:{after} --kill-on-invalid-dep=yes" if after else ""
        script, index, named = where[name]
        others = [d for d in t.depends_on if d not in job]
        lines += [f"# {name} also waits for {', '.join(others)}: add afterok:<its job>_<task> if it has not "
                  "finished"] if others else []
        lines.append(f"{job[name]}=$(sbatch --parsable --array={index}{named}{wait} {shlex.quote(str(script))}); "
                     f"{job[name]}=${{{job[name]}%%;*}}  # {name}")
    return "\n".join(lines)


def _submit_head(m: Manifest, out_dir: Path, what: str) -> list[str]:
    return ["#!/bin/bash", f"# Submits {m.name}: {what}. Runs from any folder (the paths are absolute).",
            "set -euo pipefail", f"mkdir -p {shlex.quote(str(out_dir / LOGS))}  # SLURM opens each log there",
            "submit() { local out; out=$(sbatch --parsable \"$@\"); echo \"${out%%;*}\"; }  # the job id"]


def _write_submit(path: Path, lines: list[str], out_dir: Path) -> Path:
    path.write_text("\n".join([*lines, f'echo "gapo-sweep: logs in {out_dir / LOGS}/"']) + "\n")
    return path


def _directives(spec: SlurmSpec, stage: list[Task], *, name: str, time: str | None, signal: str, workdir: Path,
                logs: Path) -> str:
    """The #SBATCH lines every script shares: one array task per task of `stage`, all asking for what its first
    asks (an array's tasks are alike). --chdir and an absolute --output make the script independent of the folder
    it is submitted from; --open-mode=append keeps the earlier attempts' lines in a requeued task's log."""
    res = stage[0].resources
    gpus = res.nproc if spec.gpus_per_node is None else spec.gpus_per_node
    cpus = spec.cpus_per_task or 4 * res.nproc
    opts = [f"--job-name={name}", f"--array=0-{len(stage) - 1}", f"--nodes={res.nodes}", "--ntasks-per-node=1",
            *([f"--gpus-per-node={gpus}"] if gpus else []), f"--cpus-per-task={cpus}",
            *(f"--{flag}={value}" for flag, value in [("time", time), ("partition", spec.partition),
                                                      ("account", spec.account), ("qos", spec.qos),
                                                      ("constraint", spec.constraint), ("mem", spec.mem)] if value),
            "--requeue", f"--signal={signal}", f"--chdir={workdir}", f"--output={logs}/%x-%A_%a.out",
            "--open-mode=append"]
    return "\n".join(f"#SBATCH {o}" for o in opts)


def _bash_array(name: str, items: list[str]) -> str:
    return f"{name}=(\n" + "\n".join(f"  {shlex.quote(x)}" for x in items) + "\n)"


def _train_script(m: Manifest, stage: list[Task], path: Path, workdir: Path, kind: str, again: dict[str, str]) -> Path:
    """A job-array script, one task per run x seed of `stage`. It launches gapo-train under torchrun itself (not
    the task's argv), to resume a requeued task from its own newest checkpoint or a branch from its parent's."""
    spec, python = m.block("slurm", SlurmSpec), shlex.quote(sys.executable)
    js, nproc = [t.job for t in stage], stage[0].resources.nproc
    path.write_text(f"""#!/bin/bash
# {m.title} ({m.produces}): {kind}, one array task per run x seed. Submitted by submit.sh (next to this file);
# see docs/cluster.md. Signals: at a preemption SLURM sends SIGTERM (SIGKILL after the
# partition's GraceTime); --signal=USR1@N sends SIGUSR1 N seconds before the time limit. Either way each rank
# finishes (or abandons) its step, saves and exits 75; the task then requeues itself and starts again from its
# newest checkpoint (--resume auto). --requeue brings it back after a node failure too.
{_directives(spec, stage, name=f"{m.name}-{kind}", time=spec.time, signal=f"USR1@{spec.signal_lead_s}",
             workdir=workdir, logs=path.parent / LOGS)}
set -euo pipefail
PY=${{GAPO_PYTHON:-{python}}}
# Each task's gapo-train arguments (torchrun sets the ranks: no --nproc), its output and a branch's parent checkpoint.
{_bash_array("ARGS", [shlex.join(["--config", j.config, *j.args]) for j in js])}
{_bash_array("OUTS", [str(j.out) for j in js])}
{_bash_array("FROM", [str(j.resume or "") for j in js])}
# What submits a task again, and the tasks that wait for it, when it fails unsaved (printed, never run from here).
{_bash_array("AGAIN", [again[t.name] for t in stage])}
i=$SLURM_ARRAY_TASK_ID
OUT=${{OUTS[$i]}}
echo "gapo-sweep: task $i: $OUT, start $((${{SLURM_RESTART_COUNT:-0}} + 1)) on $(hostname) at $(date -Is)"
RESUME=(--resume auto)  # its own newest checkpoint that verifies, or a fresh start
if [ -n "${{FROM[$i]}}" ] && [ ! -f "$OUT/checkpoints/latest" ]; then
  # A branch with no checkpoint of its own starts from its parent's; one stopped before its first save (a
  # requeue) starts over, as --resume auto does for a run that is no branch.
  if [ -e "$OUT/metrics.jsonl" ] || [ -e "$OUT/checkpoints" ]; then
    echo "gapo-sweep: $OUT holds no checkpoint of its own (stopped before its first save): starting over"
    rm -rf "$OUT/checkpoints" "$OUT/metrics.jsonl" "$OUT/rollouts.jsonl"
  fi
  RESUME=(--resume "${{FROM[$i]}}")
fi
eval "set -- ${{ARGS[$i]}}"
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# torchrun's rendezvous on a port free on this node (the batch script runs on the job's first node, HEAD), so
# that two jobs sharing a node never meet.
PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
# The signals are the ranks' (gapo.launch hands them on); this shell only waits for the save.
trap 'echo "gapo-sweep: SIGTERM at $(date -Is): the ranks save"' TERM
trap 'echo "gapo-sweep: SIGUSR1 at $(date -Is): the ranks save"' USR1
code=0
# srun does not inherit --cpus-per-task from sbatch (SLURM >= 22.05): give it, or every rank shares one CPU.
srun --cpus-per-task="$SLURM_CPUS_PER_TASK" "$PY" -m gapo.launch --nnodes "$SLURM_NNODES" \\
  --nproc_per_node {nproc} --rdzv_backend c10d --rdzv_endpoint "$HEAD:$PORT" -m gapo.cli "$@" "${{RESUME[@]}}" \\
  || code=$?
if [ "$code" -eq 75 ]; then  # saved after a signal: again, later, from that checkpoint
  echo "gapo-sweep: saved after a signal (exit 75) at $(date -Is): requeued"
  scontrol requeue "$SLURM_JOB_ID" || {{ echo "gapo-sweep: the requeue failed; these commands submit this task" \\
    "again and, after it, the tasks that wait for it:"; echo "${{AGAIN[$i]}}"; }}
elif [ "$code" -ne 0 ]; then  # a crash, or a kill the ranks could not save at (e.g. scancel --full): no requeue
  echo "gapo-sweep: stopped unsaved (exit $code) at $(date -Is): not requeued; SLURM cancels the tasks that wait" \\
    "for this one (--kill-on-invalid-dep). Once the cause is fixed, these commands submit it again (it resumes" \\
    "from its newest checkpoint that verifies) and, after it, the tasks that wait for it:"
  echo "${{AGAIN[$i]}}"
fi
echo "gapo-sweep: exit $code at $(date -Is)"
exit "$code"
""")
    return path


def _eval_script(m: Manifest, stage: list[Task], path: Path, workdir: Path) -> Path:
    """A job-array script, one task per evaluation (a run's checkpoints, or the base model)."""
    spec = m.block("slurm", SlurmSpec)
    path.write_text(f"""#!/bin/bash
# {m.title} ({m.produces}): the evaluation, one array task per run (its kept checkpoints under the manifest's
# protocol) and the base model when the manifest asks. gapo-eval skips a checkpoint whose results.json exists
# (written last, by rename), so a task requeued at a preemption or near its time limit (SIGUSR1 to this shell,
# --signal=B:USR1@{spec.signal_lead_s}) goes on with the checkpoints left.
{_directives(spec, stage, name=f"{m.name}-eval", time=spec.eval_time, signal=f"B:USR1@{spec.signal_lead_s}",
             workdir=workdir, logs=path.parent / LOGS)}
set -euo pipefail
{_bash_array("CMDS", [shlex.join(local_command(list(t.argv))) for t in stage])}
{_bash_array("NAMES", [t.name for t in stage])}
i=$SLURM_ARRAY_TASK_ID
echo "gapo-sweep: task $i: ${{NAMES[$i]}}, start $((${{SLURM_RESTART_COUNT:-0}} + 1))" \
  "on $(hostname) at $(date -Is)"
eval "set -- ${{CMDS[$i]}}"
trap 'echo "gapo-sweep: SIGUSR1 at $(date -Is), the time limit is near: requeued"
      scontrol requeue "$SLURM_JOB_ID"' USR1
code=0
srun --cpus-per-task="$SLURM_CPUS_PER_TASK" "$@" &
wait $! || code=$?
echo "gapo-sweep: exit $code at $(date -Is)"
exit "$code"
""")
    return path
