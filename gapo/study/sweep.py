"""gapo-sweep: a paper table or figure as one manifest, runs x seeds, and the commands that make it.

    gapo-sweep FILE --print        one fully resolved gapo-train command per line (any scheduler)
    gapo-sweep FILE --slurm        SLURM job arrays (runs; branches, each after its parent; each run's evaluation
                                   after it) and submit.sh, which submits them from any folder
    gapo-sweep FILE --eval --slurm the evaluation array alone and submit_eval.sh (evaluated checkpoints skipped)
    gapo-sweep FILE --run          the runs one after another here: finished ones skipped, interrupted ones resumed
    gapo-sweep FILE --rehearse     every distinct run of the file (seeds aside) rehearsed on the CPU, branches from
                                   their parent's rehearsed checkpoint
    gapo-sweep FILE --eval         gapo-eval --run on every run's checkpoints under the file's protocol (--print: list)
    gapo-sweep FILE --budget       GPUs, memory plan, estimated GPU-hours (training, evaluation) and checkpoint disk
    gapo-compare table FILE        then the table (markdown, CSV) and figures from the evaluations

A manifest (experiments/*.yaml) names a config, its runs (overrides, or a branch from another run's checkpoint),
the seeds, the evaluation protocol and the checkpoint steps it evaluates, and what gapo-compare builds. Each run
and seed writes to <output_root>/<manifest>/<run>/seed<seed>; the steps to evaluate and the branch points are kept
from pruning (trainer.keep_steps). See experiments/README.md for the format.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gapo import rundir
from gapo.config import Config, ConfigError, load_config, read_yaml

EXPERIMENTS_DIR = Path(__file__).resolve().parents[2] / "experiments"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class BranchFrom(_Strict):
    run: str = Field(description="The parent run (a name in runs).")
    step: int = Field(ge=1, description="Its checkpoint to branch from (kept from pruning by the sweep).")


class RunSpec(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="Directory name of the run.")
    label: str | None = Field(None, description="Its row or legend name (default: name).")
    config: str | None = Field(None, description="Its config, if not the manifest's.")
    overrides: list[str] = Field(default_factory=list, description="key.path=value, as on gapo-train's command line.")
    branch: BranchFrom | None = Field(None, alias="from", description="Start from another run's checkpoint.")
    use: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$",
                            description="MANIFEST/RUN: that manifest's run itself (its directory, command and "
                                        "checkpoints), trained once for both: Table 8 reuses Table 3's runs.")

    @model_validator(mode="after")
    def _use_alone(self) -> RunSpec:
        if self.use and (self.config or self.overrides or self.branch):
            raise ValueError(f"runs.{self.name}: `use` takes its settings from {self.use}; config, overrides and "
                             "from do not go with it")
        return self


class Protocol(_Strict):
    """An evaluation given in the manifest (the tiny CPU manifests); paper manifests name a config's protocol."""

    name: str
    benchmarks: list[str] = Field(min_length=1)
    n: int = Field(ge=1)
    temperature: float = Field(gt=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(gt=0)
    limit: int | None = Field(None, ge=1)


class EvalSpec(_Strict):
    protocol: str | Protocol = Field(description="A config whose eval.protocol is the table's (qwen_math, ...), or "
                                                 "one given here.")
    steps: list[int] = Field(min_length=1, description="Checkpoint steps to evaluate; the last one is the table's.")
    compile: Literal["auto", "cache", "aot", "eager"] = "auto"


class CompareSpec(_Strict):
    metrics: list[int] = Field(default_factory=lambda: [1], description="pass@k columns, e.g. [1, 256].")
    against: dict[str, list[str]] = Field(default_factory=dict, description="Table 7: a run -> the runs it is "
                                                                            "compared with (Welch's t-test).")
    figures: list[Literal["is_ratio_by_c", "clip_vs_c", "is_adv_corr", "training", "eval_over_steps", "coverage",
                          "vs_group_size",
                          "branch"]] = Field(default_factory=list)


class SlurmSpec(_Strict):
    """What `--slurm` asks the scheduler for. gapo-sweep's --partition, --account, --qos, --constraint, --time,
    --eval-time and --mem give the same over the manifest's."""

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


class Manifest(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    title: str
    produces: str = Field(description="The paper table or figure this reproduces, e.g. 'Table 3 (Qwen)'.")
    config: str
    nproc: int = Field(8, ge=1, description="GPUs (ranks) per run, on one node each unless nodes > 1.")
    nodes: int = Field(1, ge=1)
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2], min_length=1)
    output_root: str = "runs"
    runs: list[RunSpec] = Field(min_length=1)
    base: bool = Field(False, description="Evaluate the config's model before training too: the Base column of "
                                          "Tables 1 and 2, one evaluation (no seeds).")
    eval: EvalSpec
    compare: CompareSpec = Field(default_factory=CompareSpec)
    slurm: SlurmSpec = Field(default_factory=SlurmSpec)

    @model_validator(mode="after")
    def _runs(self) -> Manifest:
        names = [r.name for r in self.runs]
        if len(set(names)) != len(names):
            raise ValueError(f"runs: names repeat ({', '.join(sorted({n for n in names if names.count(n) > 1}))})")
        for r in self.runs:
            if r.branch and r.branch.run not in names:
                raise ValueError(f"runs.{r.name}.from.run: no run named {r.branch.run!r}")
            if r.branch and self.run(r.branch.run).branch:
                raise ValueError(f"runs.{r.name}.from.run: {r.branch.run} is itself a branch (one level only)")
        labels = {r.label or r.name for r in self.runs}
        for ours, theirs in self.compare.against.items():
            for x in [ours, *theirs]:
                if x not in labels:
                    raise ValueError(f"compare.against: {x!r} is not a run's label ({', '.join(sorted(labels))})")
        return self

    def run(self, name: str) -> RunSpec:
        return next(r for r in self.runs if r.name == name)

    @property
    def protocol_name(self) -> str:
        p = self.eval.protocol
        return p.name if isinstance(p, Protocol) else Path(p).stem


def load_manifest(path: str | Path) -> Manifest:
    """A manifest file, or the name of one in experiments/."""
    p = Path(path)
    if not p.is_file():
        shipped = EXPERIMENTS_DIR / (p.name if p.suffix else f"{p.name}.yaml")
        if p.parent != Path(".") or not shipped.is_file():
            raise ConfigError(f"manifest {str(path)!r} not found (nor among the shipped ones in {EXPERIMENTS_DIR})")
        p = shipped
    try:
        raw = read_yaml(p.read_text())
        return Manifest.model_validate(raw)
    except yaml.YAMLError as err:
        raise ConfigError(f"{p}: not valid YAML: {err}") from None
    except ValidationError as err:
        lines = [(f"{'.'.join(str(x) for x in e['loc'])}: " if e["loc"] else "")
                 + e["msg"].removeprefix("Value error, ") for e in err.errors()]
        raise ConfigError(f"{p}: invalid manifest:\n  " + "\n  ".join(lines)) from None


@dataclass
class Job:
    """One run of one seed: its gapo-train command and where it writes."""

    run: RunSpec
    seed: int
    out: Path
    config: str
    args: list[str]  # after `gapo-train --config CONFIG --nproc N`, without --resume
    resume: Path | None  # a branch's parent checkpoint
    parent: Job | None
    shared: str | None = None  # MANIFEST/RUN whose run this is (RunSpec.use): its directory and command, not ours

    @property
    def label(self) -> str:
        return self.run.label or self.run.name

    def own_steps(self, steps: list[int]) -> list[int]:
        """Of the manifest's evaluated steps, those this run has a checkpoint of: a branch starts after its
        branch point, and its steps up to there are its parent's (the same weights: gapo.study.tables.results)."""
        return [s for s in steps if self.parent is None or s > self.run.branch.step]

    def command(self, nproc: int, *, rehearse: bool = False, resume: Path | None = None) -> list[str]:
        resume = resume or self.resume
        return ["gapo-train", "--config", self.config, "--nproc", str(nproc), *(["--rehearse"] if rehearse else []),
                *(["--resume", str(resume)] if resume else []), *self.args]

    def resolved(self) -> Config:
        """The config this job trains with: every command is checked before anything is printed or run."""
        return load_config(self.config, [*self.args, *([f"trainer.resume_from={self.resume}"] if self.resume else [])])


def jobs(m: Manifest, root: str | Path | None = None) -> list[Job]:
    """Every run x seed, parents before their branches; the kept steps are the evaluated ones and the branch
    points taken from this run."""
    base = Path(root or m.output_root) / m.name
    out: dict[tuple[str, int], Job] = {}
    for r in sorted(m.runs, key=lambda x: x.branch is not None):
        if r.use:
            for seed in m.seeds:
                out[(r.name, seed)] = _shared_job(r, seed, root)
            continue
        branch_points = sorted({b.branch.step for b in m.runs if b.branch and b.branch.run == r.name})
        keep = sorted(set(m.eval.steps) | set(branch_points))
        for seed in m.seeds:
            target = base / r.name / f"seed{seed}"
            parent = out[(r.branch.run, seed)] if r.branch else None
            resume = parent.out / rundir.CHECKPOINTS / rundir.step_name(r.branch.step) if parent else None
            args = [*r.overrides, f"trainer.seed={seed}", f"trainer.output_dir={target}",
                    f"trainer.keep_steps=[{','.join(map(str, keep))}]"]
            out[(r.name, seed)] = Job(r, seed, target, r.config or (parent.config if parent else m.config), args,
                                      resume, parent)
    return list(out.values())


def _shared_job(r: RunSpec, seed: int, root: str | Path | None) -> Job:
    """The job of another manifest's run (RunSpec.use), under this manifest's name and label for its table."""
    owner_name, run_name = r.use.split("/")
    owner = load_manifest(owner_name)
    if run_name not in {x.name for x in owner.runs}:
        raise ConfigError(f"runs.{r.name}.use: {owner_name} has no run {run_name!r} "
                          f"({', '.join(x.name for x in owner.runs)})")
    if seed not in owner.seeds:
        raise ConfigError(f"runs.{r.name}.use: {owner_name} runs seeds {owner.seeds}, not {seed}")
    theirs = next(j for j in jobs(owner, root) if j.run.name == run_name and j.seed == seed)
    return Job(r, seed, theirs.out, theirs.config, theirs.args, theirs.resume, theirs.parent, shared=r.use)


def check(m: Manifest, js: list[Job]) -> None:
    """Resolve every command (a typo fails here, not hours into a sweep); output directories must be distinct."""
    seen: dict[str, Job] = {}
    for j in js:
        try:
            cfg = j.resolved()
        except ConfigError as err:
            raise ConfigError(f"run {j.run.name} seed {j.seed}: {err}") from None
        final = cfg.trainer.total_steps
        if max(m.eval.steps) > final:
            raise ConfigError(f"eval.steps: {max(m.eval.steps)} is past run {j.run.name}'s trainer.total_steps={final}")
        if cfg.trainer.preempt_deadline_s >= m.slurm.signal_lead_s:
            raise ConfigError(f"slurm.signal_lead_s={m.slurm.signal_lead_s} must exceed run {j.run.name}'s "
                              f"trainer.preempt_deadline_s={cfg.trainer.preempt_deadline_s:g} by the time a save "
                              "takes: the signal before the time limit would come too late to save")
        if j.shared:  # its owner's sweep keeps its checkpoints: the ones we evaluate or branch from must be among them
            t = cfg.trainer
            need = set(j.own_steps(m.eval.steps)) | {b.branch.step for b in m.runs
                                                     if b.branch and b.branch.run == j.run.name}
            kept = set(t.keep_steps) | {t.total_steps} | ({s for s in need if s % t.keep_every == 0}
                                                          if t.keep_every else set())
            if need - kept:
                raise ConfigError(f"runs.{j.run.name}.use: {j.shared} keeps no checkpoint of step "
                                  f"{', '.join(map(str, sorted(need - kept)))} (it keeps {sorted(kept)}); add the "
                                  f"step to {j.shared.split('/')[0]}'s eval.steps")
        if cfg.trainer.output_dir in seen:
            raise ConfigError(f"runs {seen[cfg.trainer.output_dir].run.name} and {j.run.name} share "
                              f"{cfg.trainer.output_dir}")
        seen[cfg.trainer.output_dir] = j


def finished(j: Job) -> bool:
    """The run saved its last step (a complete checkpoint of trainer.total_steps)."""
    found = rundir.checkpoints(j.out)
    return bool(found) and max(found) >= load_config(j.config, j.args).trainer.total_steps


# ------------------------------------------------------------------------------------------------- actions


def print_commands(m: Manifest, js: list[Job]) -> None:
    for j in js:
        print(shlex.join(j.command(m.nproc)))


def run_local(m: Manifest, js: list[Job], nproc: int) -> int:
    """One run after another on this machine; a finished run is skipped and an interrupted one resumed, so the
    same command picks a sweep up where it stopped."""
    for i, j in enumerate(js, 1):
        where = f"[{i}/{len(js)}] {j.run.name} seed {j.seed}"
        if finished(j):
            print(f"gapo-sweep: {where}: finished, skipped ({j.out})", flush=True)
            continue
        resume = j.out if rundir.checkpoints(j.out) else None
        if resume is None and (j.out / rundir.METRICS).exists():
            print(f"gapo-sweep: {where}: {j.out} holds a run with no checkpoint to resume; remove it to start over",
                  file=sys.stderr)
            return 2
        cmd = j.command(nproc, resume=resume)
        print(f"gapo-sweep: {where}: {'resuming' if resume else 'starting'}: {shlex.join(cmd)}", flush=True)
        code = subprocess.call(_local(cmd))
        if code:
            print(f"gapo-sweep: {where} failed (exit {code}); rerun the same command to resume", file=sys.stderr)
            return code
    return 0


def rehearse(m: Manifest, js: list[Job]) -> int:
    """Every distinct run once (its first seed), as `gapo-train --rehearse` would run it; a branch from its
    parent's rehearsed checkpoint (the kept step 1 of 2, see gapo/rehearse.py)."""
    done: dict[str, Path] = {}
    for j in (j for j in js if j.seed == m.seeds[0]):
        resume = None
        if j.parent is not None:
            kept = rundir.checkpoints(done[j.parent.run.name])
            if not kept:
                print(f"gapo-sweep: the rehearsal of {j.parent.run.name} kept no checkpoint", file=sys.stderr)
                return 1
            resume = kept[min(kept)]
        cmd = j.command(m.nproc, rehearse=True, resume=resume)
        print(f"gapo-sweep: rehearsing {j.run.name}: {shlex.join(cmd)}", flush=True)
        code = subprocess.call(_local(cmd))
        if code:
            return code
        done[j.run.name] = Path(f"{j.out}-rehearsal" + ("-resumed" if resume else ""))
    return 0


def eval_commands(m: Manifest, js: list[Job], together: bool = False) -> list[list[str]]:
    """gapo-eval commands: one per run (to spread over a cluster), or `together`, one for all runs (one engine
    start, each checkpoint's weights pushed into it: what a single machine should do)."""
    p = m.eval.protocol
    if isinstance(p, Protocol):
        spec = ["--benchmarks", ",".join(p.benchmarks), "--n", str(p.n), "--temperature", str(p.temperature),
                "--top-p", str(p.top_p), "--max-new-tokens", str(p.max_new_tokens),
                *(["--limit", str(p.limit)] if p.limit else []), "--name", p.name]
    else:
        spec = ["--protocol", p]
    own = [(tuple(j.own_steps(m.eval.steps)), j) for j in js]
    groups: dict[tuple[int, ...], list[Job]] = {}  # together: runs with the same steps share a command (an engine)
    for steps, j in own:
        if steps:
            groups.setdefault(steps, []).append(j)
    pairs = list(groups.items()) if together else [(steps, [j]) for steps, j in own if steps]
    cmds = [["gapo-eval", "--run", *(str(j.out) for j in g), "--steps", ",".join(map(str, steps)), *spec,
             "--compile", m.eval.compile] for steps, g in pairs]
    if m.base:
        model = load_config(m.config).model
        cmds.append(["gapo-eval", "--model", model.path, *spec, "--dtype", model.dtype, "--compile", m.eval.compile,
                     "--out", str(base_results(m, js))])
    return cmds


def base_results(m: Manifest, js: list[Job]) -> Path:
    """Where the Base row's evaluation goes: next to the runs, under the manifest's directory."""
    return js[0].out.parent.parent / "base" / rundir.EVAL / m.protocol_name


def evaluate_all(m: Manifest, js: list[Job], show: bool) -> int:
    for cmd in eval_commands(m, js, together=not show):
        if show:
            print(shlex.join(cmd))
            continue
        print(f"gapo-sweep: {shlex.join(cmd)}", flush=True)
        code = subprocess.call(_local(cmd))
        if code:
            return code
    return 0


LOGS = "logs"  # in the slurm folder: every job's output, <job name>-<array job id>_<task>.out, appended to on requeue


def slurm_spec(m: Manifest, **given: str | None) -> SlurmSpec:
    """The manifest's `slurm:` block with what gapo-sweep's command line gives (--partition, --time, ...) over it."""
    return m.slurm.model_copy(update={k: v for k, v in given.items() if v is not None})


def _directives(spec: SlurmSpec, m: Manifest, *, name: str, tasks: int, nodes: int, time: str | None,
                signal: str, workdir: Path, logs: Path) -> str:
    """The #SBATCH lines every script shares. --chdir and an absolute --output make the script independent of the
    folder it is submitted from; --open-mode=append keeps the earlier attempts' lines in a requeued task's log."""
    gpus = m.nproc if spec.gpus_per_node is None else spec.gpus_per_node
    cpus = spec.cpus_per_task or 4 * m.nproc
    opts = [f"--job-name={name}", f"--array=0-{tasks - 1}", f"--nodes={nodes}", "--ntasks-per-node=1",
            *([f"--gpus-per-node={gpus}"] if gpus else []), f"--cpus-per-task={cpus}",
            *(f"--{flag}={value}" for flag, value in [("time", time), ("partition", spec.partition),
                                                      ("account", spec.account), ("qos", spec.qos),
                                                      ("constraint", spec.constraint), ("mem", spec.mem)] if value),
            "--requeue", f"--signal={signal}", f"--chdir={workdir}", f"--output={logs}/%x-%A_%a.out",
            "--open-mode=append"]
    return "\n".join(f"#SBATCH {o}" for o in opts)


def _bash_array(name: str, items: list[str]) -> str:
    return f"{name}=(\n" + "\n".join(f"  {shlex.quote(x)}" for x in items) + "\n)"


def _train_script(m: Manifest, stage: list[Job], path: Path, spec: SlurmSpec, workdir: Path, kind: str) -> Path:
    """A job-array script, one task per run x seed of `stage`."""
    python = shlex.quote(sys.executable)
    path.write_text(f"""#!/bin/bash
# {m.title} ({m.produces}): {kind}, one array task per run x seed. Submitted by submit.sh (next to this file);
# see the README, "Running on a cluster". Signals: at a preemption SLURM sends SIGTERM (SIGKILL after the
# partition's GraceTime); --signal=USR1@N sends SIGUSR1 N seconds before the time limit. Either way each rank
# finishes (or abandons) its step, saves and exits 75; the task then requeues itself and starts again from its
# newest checkpoint (--resume auto). --requeue brings it back after a node failure too.
{_directives(spec, m, name=f"{m.name}-{kind}", tasks=len(stage), nodes=m.nodes, time=spec.time,
             signal=f"USR1@{spec.signal_lead_s}", workdir=workdir, logs=path.parent / LOGS)}
set -euo pipefail
PY=${{GAPO_PYTHON:-{python}}}
# Each task's gapo-train arguments (torchrun sets the ranks: no --nproc), its output and a branch's parent checkpoint.
{_bash_array("ARGS", [shlex.join(["--config", j.config, *j.args]) for j in stage])}
{_bash_array("OUTS", [str(j.out) for j in stage])}
{_bash_array("FROM", [str(j.resume or "") for j in stage])}
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
  --nproc_per_node {m.nproc} --rdzv_backend c10d --rdzv_endpoint "$HEAD:$PORT" -m gapo.cli "$@" "${{RESUME[@]}}" \\
  || code=$?
if [ "$code" -eq 75 ]; then  # saved after a signal: again, later, from that checkpoint
  echo "gapo-sweep: saved after a signal (exit 75) at $(date -Is): requeued"
  scontrol requeue "$SLURM_JOB_ID"
fi
echo "gapo-sweep: exit $code at $(date -Is)"
exit "$code"
""")
    return path


def _eval_script(m: Manifest, cmds: list[list[str]], names: list[str], path: Path, spec: SlurmSpec,
                 workdir: Path) -> Path:
    """A job-array script, one task per gapo-eval command (a run's checkpoints, or the base model)."""
    path.write_text(f"""#!/bin/bash
# {m.title} ({m.produces}): the evaluation, one array task per run (its kept checkpoints under the manifest's
# protocol) and the base model when the manifest asks. gapo-eval skips a checkpoint whose results.json exists
# (written last, by rename), so a task requeued at a preemption or near its time limit (SIGUSR1 to this shell,
# --signal=B:USR1@{spec.signal_lead_s}) goes on with the checkpoints left.
{_directives(spec, m, name=f"{m.name}-eval", tasks=len(cmds), nodes=1, time=spec.eval_time,
             signal=f"B:USR1@{spec.signal_lead_s}", workdir=workdir, logs=path.parent / LOGS)}
set -euo pipefail
{_bash_array("CMDS", [shlex.join(_local(c)) for c in cmds])}
{_bash_array("NAMES", names)}
i=$SLURM_ARRAY_TASK_ID
echo "gapo-sweep: evaluation task $i: ${{NAMES[$i]}}, start $((${{SLURM_RESTART_COUNT:-0}} + 1))" \
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


def _eval_tasks(m: Manifest, js: list[Job]) -> tuple[list[list[str]], list[str], list[Job | None]]:
    """The evaluation array's commands, a name for each, and the training job each waits for (None: the base)."""
    cmds = eval_commands(m, js)
    evaluated: list[Job | None] = [j for j in js if j.own_steps(m.eval.steps)]
    if m.base:
        evaluated.append(None)
    names = [f"{j.run.name} seed {j.seed}" if j else "base model" for j in evaluated]
    return cmds, names, evaluated


def slurm(m: Manifest, js: list[Job], out_dir: Path, spec: SlurmSpec | None = None, *,
          workdir: Path | None = None) -> list[Path]:
    """The training job arrays (the runs, then the branches), the evaluation array, and submit.sh, which submits
    all of them from any folder: each branch task after its own parent's task, each run's evaluation after its
    training (afterok: <array job>_<task>). Paths in the commands are relative to `workdir` (default: here), which
    every job starts in (--chdir)."""
    spec = spec or m.slurm
    workdir = (workdir or Path.cwd()).resolve()
    out_dir = (workdir / out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    parents = [j for j in js if j.parent is None]
    branches = [j for j in js if j.parent is not None]
    runs = _train_script(m, parents, out_dir / f"{m.name}.runs.sbatch", spec, workdir, "runs")
    written = [runs]
    if branches:
        written.append(_train_script(m, branches, out_dir / f"{m.name}.branches.sbatch", spec, workdir, "branches"))
    cmds, names, waits = _eval_tasks(m, js)
    ev = _eval_script(m, cmds, names, out_dir / f"{m.name}.eval.sbatch", spec, workdir)
    written.append(ev)

    task = {id(j): f"${{RUNS}}_{i}" for i, j in enumerate(parents)}  # the training task of each job
    lines = _submit_head(m, out_dir, "the runs, each branch after its parent's task, each evaluation after its run")
    lines += [f"RUNS=$(submit {shlex.quote(str(runs))})"]
    lines += [f'echo "gapo-sweep: {j.run.name} seed {j.seed}: job ${{RUNS}}_{i}"' for i, j in enumerate(parents)]
    for i, j in enumerate(branches):
        parent = task[id(j.parent)]
        lines += [f"B{i}=$(submit --array={i} --job-name={m.name}-{j.run.name}-seed{j.seed} "
                  f"--dependency=afterok:{parent} {shlex.quote(str(written[1]))})",
                  f'echo "gapo-sweep: {j.run.name} seed {j.seed}: job ${{B{i}}}_{i}, after {parent}"']
        task[id(j)] = f"${{B{i}}}_{i}"
    for k, (name, j) in enumerate(zip(names, waits, strict=True)):
        after = f" --dependency=afterok:{task[id(j)]}" if j is not None else ""
        lines += [f"E{k}=$(submit --array={k}{after} {shlex.quote(str(ev))})",
                  f'echo "gapo-sweep: evaluation of {name}: job ${{E{k}}}_{k}"']
    lines += [f'echo "gapo-sweep: logs in {out_dir / LOGS}/"']
    submit = out_dir / "submit.sh"
    submit.write_text("\n".join(lines) + "\n")
    return [*written, submit]


def slurm_eval(m: Manifest, js: list[Job], out_dir: Path, spec: SlurmSpec | None = None, *,
               workdir: Path | None = None) -> list[Path]:
    """The evaluation array alone and submit_eval.sh (no dependencies: the runs are trained): for `--eval
    --slurm`, e.g. after adding steps to eval.steps. Checkpoints evaluated already are skipped."""
    spec = spec or m.slurm
    workdir = (workdir or Path.cwd()).resolve()
    out_dir = (workdir / out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    cmds, names, _ = _eval_tasks(m, js)
    ev = _eval_script(m, cmds, names, out_dir / f"{m.name}.eval.sbatch", spec, workdir)
    lines = _submit_head(m, out_dir, "the evaluation array (checkpoints evaluated already are skipped)")
    lines += [f"EVAL=$(submit {shlex.quote(str(ev))})"]
    lines += [f'echo "gapo-sweep: evaluation of {name}: job ${{EVAL}}_{k}"' for k, name in enumerate(names)]
    lines += [f'echo "gapo-sweep: logs in {out_dir / LOGS}/"']
    submit = out_dir / "submit_eval.sh"
    submit.write_text("\n".join(lines) + "\n")
    return [ev, submit]


def _submit_head(m: Manifest, out_dir: Path, what: str) -> list[str]:
    return ["#!/bin/bash", f"# Submits {m.name}: {what}. Runs from any folder (the paths are absolute).",
            "set -euo pipefail", f"mkdir -p {shlex.quote(str(out_dir / LOGS))}  # SLURM opens each log there",
            "submit() { local out; out=$(sbatch --parsable \"$@\"); echo \"${out%%;*}\"; }  # the job id"]


def budget(m: Manifest, js: list[Job]) -> str:
    """GPUs, the memory plan's verdict, estimated GPU-hours of training and of evaluation, and the disk the kept
    checkpoints take, per run and in total, from the configs alone.

    Hours are FLOP estimates, not measurements (no GPU has run gapo yet): per step, 2 P T for generation at
    GEN_MFU, 2 P T (old log-probs) + 6 P T epochs (updates) for training at TRAIN_MFU, with T the step's tokens
    at mean response length half of max_new_tokens, P the parameters, on H100-class bf16 (PEAK_FLOPS). An
    evaluation is generation only: every problem of the protocol's benchmarks (BENCHMARK_SIZES) x n samples, per
    evaluated checkpoint. Disk: a checkpoint holds the exported weights and DeepSpeed's state (the fp32 weights
    and Adam's two moments, and the bf16 weights in bf16 runs): CHECKPOINT_BYTES_PER_PARAM bytes per parameter."""
    from gapo.memory import memory_plan, param_count
    from gapo.models import model_facts

    shared = sum(1 for j in js if j.shared)
    lines = [f"{m.title} ({m.produces}): {len(js)} runs of {m.nproc} GPU(s) x {m.nodes} node(s)"
             + (f", {shared} of them another manifest's (runs.use)" if shared else ""), ""]
    train_total = eval_total = disk_total = disk_weights_total = 0.0
    samples, new_tokens, unknown = _eval_samples(m)
    for j in js:
        cfg = load_config(j.config, j.args)
        facts = model_facts(cfg.model.path)
        if not facts:
            lines.append(f"  {j.run.name} seed {j.seed}: no config.json for {cfg.model.path}: no estimate")
            continue
        gpus = m.nproc * m.nodes
        plan = memory_plan(cfg, facts, gpus - cfg.rollout.generator_ranks)  # the training ranks' plan
        r, t = cfg.rollout, cfg.trainer
        tokens = r.prompts_per_step * r.group_size * (cfg.data.max_prompt_tokens / 2 + r.max_new_tokens / 2)
        p = param_count(facts)
        seconds = t.total_steps * (2 * p * tokens / GEN_MFU + (2 + 6 * t.ppo_epochs) * p * tokens / TRAIN_MFU) \
            / (PEAK_FLOPS * gpus)
        if j.parent is not None:
            seconds *= (t.total_steps - j.run.branch.step) / t.total_steps
        hours = seconds / 3600 * gpus
        evaluated = len(j.own_steps(m.eval.steps))
        if j.shared:  # trained (and kept) by its owner's sweep: count here only the evaluations the owner lacks
            owner = load_manifest(j.shared.split("/")[0])
            if owner.protocol_name == m.protocol_name:
                evaluated = len(set(j.own_steps(m.eval.steps)) - set(owner.eval.steps))
            eval_hours = evaluated * _eval_gpu_hours(param_count(facts), samples, cfg.data.max_prompt_tokens,
                                                     new_tokens)
            eval_total += eval_hours
            lines.append(f"  {j.run.name} seed {j.seed}: {j.shared}'s run, trained and kept by that sweep (counted "
                         f"there); ~{eval_hours:,.0f} GPU-hours evaluating {evaluated} checkpoint(s) it does not")
            continue
        eval_hours = evaluated * _eval_gpu_hours(p, samples, cfg.data.max_prompt_tokens, new_tokens)
        kept, whole = _kept_checkpoints(cfg, j)
        weight_bytes = p * (2 if cfg.model.dtype == "bfloat16" else 4)
        disk = kept * CHECKPOINT_BYTES_PER_PARAM * p
        disk_weights = whole * CHECKPOINT_BYTES_PER_PARAM * p + (kept - whole) * weight_bytes
        train_total, eval_total = train_total + hours, eval_total + eval_hours
        disk_total, disk_weights_total = disk_total + disk, disk_weights_total + disk_weights
        lines.append(f"  {j.run.name} seed {j.seed}: {gpus} GPUs, memory plan {plan.total / 2**30:.0f} of 80 GB "
                     f"({'fits' if plan.fits(80) else 'does NOT fit'}), ~{hours:,.0f} GPU-hours training, "
                     f"~{eval_hours:,.0f} evaluating {evaluated} checkpoint(s); {kept} kept checkpoints "
                     f"{disk / 1e9:,.0f} GB")
    if m.base and js:
        cfg = load_config(m.config)
        facts = model_facts(cfg.model.path)
        if facts:
            base_hours = _eval_gpu_hours(param_count(facts), samples, cfg.data.max_prompt_tokens, new_tokens)
            eval_total += base_hours
            lines.append(f"  base model: ~{base_hours:,.0f} GPU-hours evaluating it once")
    lines += ["", f"  training   ~{train_total:,.0f} GPU-hours",
              f"  evaluation ~{eval_total:,.0f} GPU-hours ({samples:,} samples per checkpoint"
              + (f"; {', '.join(unknown)} of unknown size, not counted" if unknown else "") + ")",
              f"  total      ~{train_total + eval_total:,.0f} GPU-hours (FLOP estimates at {GEN_MFU:.0%} MFU for "
              f"generation, {TRAIN_MFU:.0%} for training, H100 bf16; see gapo.study.sweep.budget)",
              f"  disk       {disk_total / 1e12:,.2f} TB for the kept checkpoints with their optimizer state; "
              f"{disk_weights_total / 1e12:,.2f} TB if those kept only for evaluation held only their weights "
              "(the newest trainer.keep_last whole; not implemented yet: gapo keeps every checkpoint whole)"]
    return "\n".join(lines)


# Problems per benchmark (the evaluation budget): the public sets' sizes. A benchmark not listed is counted as 0.
BENCHMARK_SIZES = {"aime24": 30, "aime25": 30, "amc": 83, "math500": 500, "minerva": 272, "olympiad_bench": 675,
                   "ifeval": 541, "humaneval_plus": 164, "arithmetic": 200}
CHECKPOINT_BYTES_PER_PARAM = 16  # exported weights + DeepSpeed's fp32 weights, Adam m and v (+ bf16 weights): ~16 B


def _eval_samples(m: Manifest) -> tuple[int, int, list[str]]:
    """For one evaluated checkpoint: the samples (problems x n), the protocol's max_new_tokens, and the
    benchmarks whose size is unknown."""
    p = m.eval.protocol
    if isinstance(p, Protocol):
        benchmarks, n, limit, new = p.benchmarks, p.n, p.limit, p.max_new_tokens
    else:
        proto = load_config(p).eval.protocol
        benchmarks, n, limit, new = proto.benchmarks, proto.n, None, proto.max_new_tokens
    total, unknown = 0, []
    for spec in benchmarks:
        name = re.split(r"[@=]", spec, maxsplit=1)[0]
        if name not in BENCHMARK_SIZES:
            unknown.append(name)
            continue
        size = BENCHMARK_SIZES[name]
        total += (min(size, limit) if limit else size) * n
    return total, new, unknown


def _eval_gpu_hours(params: int, samples: int, max_prompt_tokens: int, max_new_tokens: int) -> float:
    """One checkpoint's evaluation: `samples` responses, prompts and responses at half their budgets."""
    tokens = samples * (max_prompt_tokens / 2 + max_new_tokens / 2)
    return 2 * params * tokens / (PEAK_FLOPS * GEN_MFU) / 3600


def _kept_checkpoints(cfg: Config, j: Job) -> tuple[int, int]:
    """(checkpoints left on disk at the end of the run, of which the newest trainer.keep_last)."""
    t = cfg.trainer
    first = j.run.branch.step + 1 if j.parent is not None else 1
    saved = sorted({s for s in range(first, t.total_steps + 1) if t.save_every and s % t.save_every == 0}
                   | {t.total_steps})
    newest = set(saved[-t.keep_last:])
    kept = {s for s in saved if s in t.keep_steps or (t.keep_every and s % t.keep_every == 0)} | newest
    return len(kept), len(newest)


PEAK_FLOPS = 989e12  # H100 SXM dense bf16
GEN_MFU, TRAIN_MFU = 0.05, 0.35  # assumptions: decoding is memory-bound; training at a typical ZeRO-3 MFU


def _local(cmd: list[str]) -> list[str]:
    """A gapo command run with this interpreter's environment (the venv's entry points)."""
    exe = Path(sys.executable).parent / cmd[0]
    return [str(exe) if exe.exists() else cmd[0], *cmd[1:]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gapo-sweep", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n")[1])
    p.add_argument("manifest", help="experiments/NAME.yaml, or NAME")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--print", action="store_true", dest="show", help="print one gapo-train command per run x seed")
    what.add_argument("--run", action="store_true", help="run them here, one after another")
    what.add_argument("--rehearse", action="store_true", help="rehearse every distinct run on the CPU")
    what.add_argument("--eval", action="store_true", help="evaluate every run's checkpoints (with --list: print; "
                                                          "with --slurm: an evaluation job array)")
    what.add_argument("--budget", action="store_true", help="GPUs, memory plan, estimated GPU-hours and disk")
    p.add_argument("--slurm", nargs="?", const="", metavar="DIR",
                   help="write SLURM job arrays and submit.sh (with --eval: the evaluation's and submit_eval.sh); "
                        "default DIR: <output_root>/<manifest>/slurm")
    p.add_argument("--list", action="store_true", help="with --eval: print the gapo-eval commands instead")
    p.add_argument("--output-root", help="instead of the manifest's output_root (runs)")
    p.add_argument("--nproc", type=int, help="with --run: ranks per run here (default: the manifest's)")
    sched = p.add_argument_group("with --slurm: over the manifest's slurm: block")
    for flag in ("partition", "account", "qos", "constraint", "time", "eval-time", "mem"):
        sched.add_argument(f"--{flag}", metavar="VALUE")
    args = p.parse_args(argv)
    if args.slurm is not None and (args.show or args.run or args.rehearse or args.budget):
        p.error("--slurm goes alone or with --eval")
    if args.slurm is None and not (args.show or args.run or args.rehearse or args.eval or args.budget):
        p.error("one of --print, --slurm, --run, --rehearse, --eval, --budget is required")
    try:
        m = load_manifest(args.manifest)
        js = jobs(m, args.output_root)
        check(m, js)
        if args.slurm is not None:
            out = Path(args.slurm) if args.slurm else Path(args.output_root or m.output_root) / m.name / "slurm"
            spec = slurm_spec(m, partition=args.partition, account=args.account, qos=args.qos,
                              constraint=args.constraint, time=args.time, eval_time=args.eval_time, mem=args.mem)
            for f in (slurm_eval if args.eval else slurm)(m, js, out, spec):
                print(f"gapo-sweep: wrote {f}")
            submit = f.relative_to(Path.cwd().resolve()) if f.is_relative_to(Path.cwd().resolve()) else f
            print(f"gapo-sweep: submit with: bash {submit}")
        elif args.show:
            print_commands(m, js)
        elif args.run:
            return run_local(m, js, args.nproc or m.nproc)
        elif args.rehearse:
            return rehearse(m, js)
        elif args.eval:
            return evaluate_all(m, js, args.list)
        else:
            print(budget(m, js))
    except ConfigError as err:
        print(f"gapo-sweep: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    sys.exit(main())
