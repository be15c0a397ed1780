"""A sweep manifest (experiments/*.yaml), its runs x seeds as jobs, and the sweep as a graph of tasks.

The graph (`graph`) is what a scheduler is given: each task's command, what it asks for and the tasks it waits
for. A scheduler module renders it (gapo.study.slurm) and gapo-sweep's backend table names it, so this file
knows no scheduler.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gapo import rundir
from gapo.config import CompileMode, Config, EvalProtocol
from gapo.configfile import load_config, read_yaml, resolve
from gapo.errors import ConfigError, did_you_mean

S = TypeVar("S", bound=BaseModel)
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


class Protocol(EvalProtocol):
    """An evaluation given in the manifest (the tiny CPU manifests); paper manifests name a config's protocol."""

    name: str
    limit: int | None = Field(None, ge=1)


class EvalSpec(_Strict):
    protocol: str | Protocol = Field(description="A config whose eval.protocol is the table's (qwen_math, ...), or "
                                                 "one given here.")
    steps: list[int] = Field(min_length=1, description="Checkpoint steps to evaluate; the last one is the table's.")
    compile: CompileMode = "auto"


class CompareSpec(_Strict):
    metrics: list[int] = Field(default_factory=lambda: [1], description="pass@k columns, e.g. [1, 256].")
    against: dict[str, list[str]] = Field(default_factory=dict, description="Table 7: a run -> the runs it is "
                                                                            "compared with, paired by seed.")
    figures: list[Literal["is_ratio_by_c", "clip_vs_c", "is_adv_corr", "training", "eval_over_steps", "coverage",
                          "vs_group_size",
                          "branch"]] = Field(default_factory=list)


class Manifest(_Strict):
    """Any other top-level key is a scheduler's block (`slurm:`), a mapping this file does not read: the scheduler's
    module validates it (`block`) and gapo-sweep refuses a key no scheduler in its table reads."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
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

    @model_validator(mode="after")
    def _runs(self) -> Manifest:
        for key, value in (self.model_extra or {}).items():
            if not isinstance(value, dict):
                raise ValueError(f"{key}: not a manifest field ({', '.join(type(self).model_fields)}); a "
                                 f"scheduler's block ({key}: with its settings beneath) is a mapping")
        if len(set(self.seeds)) != len(self.seeds):  # a repeated seed would be one run counted twice
            raise ValueError(f"seeds: {self.seeds} repeats {sorted({s for s in self.seeds if self.seeds.count(s) > 1})}"
                             "; list each seed once")
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

    def block(self, scheduler: str, spec: type[S]) -> S:
        """The `scheduler:` block read as that scheduler's spec (its defaults where the manifest has none)."""
        try:
            return spec.model_validate((self.model_extra or {}).get(scheduler, {}))
        except ValidationError as err:
            e = err.errors()[0]
            where = ".".join(str(x) for x in (scheduler, *e["loc"]))
            raise ConfigError(f"manifest {self.name}: {where}: {e['msg']}") from None

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
            shipped = sorted(f.stem for f in EXPERIMENTS_DIR.glob("*.yaml"))
            raise ConfigError(f"manifest {str(path)!r} not found (nor among the shipped ones in {EXPERIMENTS_DIR})"
                              f"{did_you_mean(p.stem, shipped)}")
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
    branch_step: int | None = None  # where it branches from its parent (its own RunSpec's, or a shared run's owner's)

    @property
    def label(self) -> str:
        return self.run.label or self.run.name

    def own_steps(self, steps: list[int]) -> list[int]:
        """Of the manifest's evaluated steps, those this run has a checkpoint of: a branch starts after its
        branch point, and its steps up to there are its parent's (the same weights: gapo.study.tables.results)."""
        return [s for s in steps if self.branch_step is None or s > self.branch_step]

    def command(self, nproc: int, *, rehearse: bool = False, resume: Path | None = None) -> list[str]:
        resume = resume or self.resume
        return ["gapo-train", "--config", self.config, "--nproc", str(nproc), *(["--rehearse"] if rehearse else []),
                *(["--resume", str(resume)] if resume else []), *self.args]

    def resolved(self) -> Config:
        """The config this job trains with: every command is checked before anything is printed or run."""
        return load_config(self.config, [*self.args, *([f"trainer.resume_from={self.resume}"] if self.resume else [])])


def jobs(m: Manifest, root: str | Path | None = None, _using: tuple[str, ...] = ()) -> list[Job]:
    """Every run x seed, parents before their branches; the kept steps are the evaluated ones and the branch
    points taken from this run. `_using`: the manifests whose `use:` led here (a chain that comes back is refused)."""
    base = Path(root or m.output_root) / m.name
    out: dict[tuple[str, int], Job] = {}
    for r in sorted(m.runs, key=lambda x: x.branch is not None):
        if r.use:
            for seed in m.seeds:
                out[(r.name, seed)] = _shared_job(r, seed, root, (*_using, m.name))
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
                                      resume, parent, branch_step=r.branch.step if r.branch else None)
    js = list(out.values())
    for i, j in enumerate(js):  # a shared branch: its parent's training must come first in this sweep too
        if j.shared and j.parent is not None and j.parent.out not in {x.out for x in js[:i]}:
            owner = j.shared.split("/")[0]
            raise ConfigError(f"runs.{j.run.name}.use: {j.shared} branches from {owner}'s run "
                              f"{j.parent.run.name} at step {j.branch_step}, which this manifest does not train "
                              f"before it: add {{name: ..., use: {owner}/{j.parent.run.name}}} (or the run {owner} "
                              "uses for it) above it in runs")
    return js


def _shared_job(r: RunSpec, seed: int, root: str | Path | None, using: tuple[str, ...]) -> Job:
    """The job of another manifest's run (RunSpec.use), under this manifest's name and label for its table."""
    owner_name, run_name = r.use.split("/")
    if owner_name in using:
        raise ConfigError(f"runs.{r.name}.use: {r.use} leads back to {owner_name} ({' -> '.join([*using, owner_name])})"
                          "; a run is trained by one manifest and used by others")
    owner = load_manifest(owner_name)
    if owner.name in using:  # (a manifest whose name: differs from its file's)
        raise ConfigError(f"runs.{r.name}.use: {r.use} leads back to {owner.name} ({' -> '.join([*using, owner.name])})"
                          "; a run is trained by one manifest and used by others")
    if run_name not in {x.name for x in owner.runs}:
        raise ConfigError(f"runs.{r.name}.use: {owner_name} has no run {run_name!r} "
                          f"({', '.join(x.name for x in owner.runs)})")
    if seed not in owner.seeds:
        raise ConfigError(f"runs.{r.name}.use: {owner_name} runs seeds {owner.seeds}, not {seed}")
    theirs = next(j for j in jobs(owner, root, using) if j.run.name == run_name and j.seed == seed)
    return Job(r, seed, theirs.out, theirs.config, theirs.args, theirs.resume, theirs.parent, shared=r.use,
               branch_step=theirs.branch_step)


def check(m: Manifest, js: list[Job]) -> None:
    """Resolve every command (a typo fails here, not hours into a sweep); output directories must be distinct."""
    seen: dict[str, Job] = {}
    for j in js:
        try:
            cfg = j.resolved()
        except ConfigError as err:
            raise ConfigError(f"run {j.run.name} seed {j.seed}: {err}") from None
        from gapo.evaluation import check_names

        try:
            check_names(cfg)  # before any job starts, not after its model has loaded
        except ConfigError as err:
            raise ConfigError(f"run {j.run.name} seed {j.seed}: {err}") from None
        if cfg.trainer.save_only_model and any(b.branch and b.branch.run == j.run.name for b in m.runs):
            raise ConfigError(f"run {j.run.name}: trainer.save_only_model=true, but run(s) "
                              f"{', '.join(b.name for b in m.runs if b.branch and b.branch.run == j.run.name)} "
                              "branch from its checkpoint, which would hold only weights (not resumable)")
        final = cfg.trainer.total_steps
        if max(m.eval.steps) > final:
            raise ConfigError(f"eval.steps: {max(m.eval.steps)} is past run {j.run.name}'s trainer.total_steps={final}")
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


# Keys a run folder's config.yaml may hold otherwise than its job's and still be that job's run: where it is
# (paths to its folder and the checkpoint it started from), how it is watched (tracking), and what a resume may
# change from start to start (gapo.rundir.MAY_CHANGE: steps, kept checkpoints, the engine, ...), but not
# algorithm.*: a resume with another algorithm branches into a folder of its own, so within a folder it never changes.
NOT_THE_RUN = ("trainer.output_dir", "trainer.resume_from", "tracking.")


def settings_differ(saved: Config, ours: Config) -> dict[str, tuple[Any, Any]]:
    """The keys that define a run on which a run folder's saved config and a job's disagree: key -> (saved, ours)."""
    free = (*NOT_THE_RUN, *(k for k in rundir.MAY_CHANGE if k != "algorithm."))
    a, b = _flat(saved.model_dump(mode="json")), _flat(ours.model_dump(mode="json"))
    return {k: (a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys())
            if not k.startswith(free) and a.get(k) != b.get(k)}


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def check_folders(js: list[Job]) -> None:
    """A run already in a job's folder must be that job's: gapo-sweep would skip it as finished (or resume it) and
    gapo-compare would label it with the manifest's settings, whatever it was trained with (issue 67: `gapo-train
    --config tiny_cpu` once wrote where the tiny_cpu sweep's gapo seed 0 goes). Called before anything is trained,
    evaluated or tabled."""
    for j in js:
        path = j.out / rundir.CONFIG
        if not path.is_file():
            continue
        way_out = f"give another --output-root, or move {j.out} away (the sweep then trains this run there)"
        try:
            saved = resolve(read_yaml(path.read_text()))
        except (OSError, ValueError, yaml.YAMLError) as err:  # (a ConfigError is a ValueError)
            raise ConfigError(f"run {j.run.name} seed {j.seed}: {path} does not read as a run's config "
                              f"({type(err).__name__}: {err}); {way_out}") from None
        differ = settings_differ(saved, j.resolved())
        if differ:
            said = "; ".join(f"{k} {a!r} there, {b!r} in this job" for k, (a, b) in differ.items())
            raise ConfigError(f"run {j.run.name} seed {j.seed}: {j.out} holds a run trained with other settings "
                              f"({said}), not this job's; {way_out}")


def eval_commands(m: Manifest, js: list[Job], together: bool = False) -> list[list[str]]:
    """gapo-eval commands: one per run (to spread over a cluster), or `together`, one for all runs (one engine
    start, each checkpoint's weights pushed into it: what a single machine should do). Runs with nothing of their
    own to evaluate are left out; the base model's command, when the manifest asks for it, comes last."""
    p = m.eval.protocol
    if isinstance(p, Protocol):
        spec = ["--benchmarks", ",".join(p.benchmarks), "--n", str(p.n), "--temperature", str(p.temperature),
                "--top-p", str(p.top_p), "--max-new-tokens", str(p.max_new_tokens),
                *(["--limit", str(p.limit)] if p.limit else []), "--name", p.name]
    else:
        spec = ["--config", p]
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


def local_command(cmd: list[str]) -> list[str]:
    """A gapo command run with this interpreter's environment (the venv's entry points): a job started by a
    scheduler has no activated venv."""
    exe = Path(sys.executable).parent / cmd[0]
    return [str(exe) if exe.exists() else cmd[0], *cmd[1:]]


# ------------------------------------------------------------------------------------------------- the job graph


@dataclass(frozen=True)
class Resources:
    """What one task asks for: `nodes` nodes of `nproc` ranks each (a GPU per rank, unless the scheduler's block
    says otherwise, e.g. slurm.gpus_per_node: 0 for a CPU run)."""

    nodes: int
    nproc: int


@dataclass(frozen=True)
class Task:
    """One node of the sweep's graph. `argv` is the whole work, run once from a fresh start; a scheduler that
    restarts a preempted task reads `job` (its output directory and a branch's parent checkpoint) to resume it
    instead. `depends_on` names tasks that must succeed first."""

    name: str  # unique in the graph: "gspo seed 0", "evaluation of gspo seed 0", "evaluation of base model"
    kind: Literal["train", "eval"]
    argv: tuple[str, ...]
    resources: Resources
    depends_on: tuple[str, ...] = ()
    job: Job | None = None  # the run it trains or evaluates; None: the base model's evaluation


def graph(m: Manifest, js: list[Job], *, train: bool = True) -> list[Task]:
    """The sweep for a scheduler: each run x seed's training (a branch after its parent's), then one evaluation
    per run (after its training) and the base model's (after nothing). `train=False`: the evaluations alone, after
    nothing, for runs that are trained already."""
    tasks: list[Task] = []
    trained: dict[Path, str] = {}  # a run's output directory -> its training task
    for j in js if train else []:
        after = (trained[j.parent.out],) if j.parent is not None else ()  # jobs() puts parents first
        tasks.append(Task(f"{j.run.name} seed {j.seed}", "train", tuple(j.command(m.nproc)),
                          Resources(m.nodes, m.nproc), after, j))
        trained[j.out] = tasks[-1].name
    evaluated: list[Job | None] = [j for j in js if j.own_steps(m.eval.steps)] + ([None] if m.base else [])
    for j, cmd in zip(evaluated, eval_commands(m, js), strict=True):
        what = f"{j.run.name} seed {j.seed}" if j else "base model"
        tasks.append(Task(f"evaluation of {what}", "eval", tuple(cmd), Resources(1, m.nproc),
                          (trained[j.out],) if j and train else (), j))
    return tasks
