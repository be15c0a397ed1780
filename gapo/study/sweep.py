"""gapo-sweep: a paper table or figure as one manifest, runs x seeds, and the commands that make it.

    gapo-sweep FILE --print        one fully resolved gapo-train command per line (any scheduler)
    gapo-sweep FILE --print trainer.lr=1e-6   key.path=value after the mode: a setting for every run (after each
                                   run's own), as on gapo-train's command line; output folders stay the manifest's
    gapo-sweep FILE --slurm        SLURM job arrays (runs; branches, each after its parent; each run's evaluation
                                   after it) and submit.sh, which submits them from any folder
    gapo-sweep FILE --eval --slurm the evaluation array alone and submit_eval.sh (evaluated checkpoints skipped)
    gapo-sweep FILE --run          the runs one after another here: finished ones skipped, interrupted ones resumed
    gapo-sweep FILE --rehearse     every distinct run of the file (seeds aside) rehearsed on the CPU, branches from
                                   their parent's rehearsed checkpoint
    gapo-sweep FILE --eval         gapo-eval --run on every run's checkpoints under the file's protocol (--list: print
                                   the gapo-eval commands instead)
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
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from gapo import rundir
from gapo.configfile import OVERRIDE, load_config
from gapo.errors import ConfigError, Exit
from gapo.proc import die_with_parent
from gapo.reward.types import signal_name
from gapo.study import slurm
from gapo.study.budget import budget, disk_shortfall
from gapo.study.manifest import (
    Job,
    Manifest,
    Task,
    check,
    check_folders,
    eval_commands,
    graph,
    jobs,
    load_manifest,
    local_command,
)


@dataclass(frozen=True)
class Backend:
    """A scheduler gapo-sweep writes the sweep's graph for, as `--NAME [DIR]`. `render(manifest, tasks, out_dir,
    workdir)` writes its files under out_dir (jobs start in workdir) and returns them, the one to run last. Its
    settings are the manifest's `NAME:` block, read by the module as `spec` (`Manifest.block`); `flags` are the
    spec's fields gapo-sweep also takes as --FLAG (no two schedulers share one); `check(manifest, jobs)` refuses, in
    every mode (a manifest holds for every scheduler it has a block for), before anything is printed or run, a sweep
    the scheduler could not carry out."""

    render: Callable[[Manifest, list[Task], Path, Path], list[Path]]
    help: str
    spec: type[BaseModel]
    flags: tuple[str, ...] = ()
    check: Callable[[Manifest, list[Job]], None] | None = None


# A second scheduler is a module (its spec, render and check) and one row here; manifest.py knows none.
BACKENDS = {
    "slurm": Backend(slurm.render, "write SLURM job arrays and submit.sh (with --eval: the evaluation's and "
                                   "submit_eval.sh)", slurm.SlurmSpec, slurm.FLAGS, slurm.check),
}


def known_blocks(m: Manifest) -> Manifest:
    """`m`, when each of its top-level keys beyond the manifest's fields is a block of a scheduler in BACKENDS (a
    misspelt field, `comparison:` for `compare:`, would otherwise be read as one and ignored)."""
    unknown = sorted(set(m.model_extra or {}) - set(BACKENDS))
    if unknown:
        raise ConfigError(f"manifest {m.name}: {unknown[0]}: not a manifest field ({', '.join(type(m).model_fields)}) "
                          f"nor a scheduler's block ({', '.join(BACKENDS)})")
    return m


def finished(j: Job) -> bool:
    """The run saved its last step (a complete checkpoint of trainer.total_steps); that the run in the folder is
    the job's own, check_folders has made sure of."""
    found = rundir.checkpoints(j.out)
    return bool(found) and max(found) >= load_config(j.config, j.args).trainer.total_steps


# ------------------------------------------------------------------------------------------------- actions


def print_commands(m: Manifest, js: list[Job]) -> None:
    for j in js:
        print(shlex.join(j.command(m.nproc)))


def run_local(m: Manifest, js: list[Job], nproc: int) -> int:
    """One run after another on this machine; a finished run is skipped and an interrupted one resumed, so the
    same command picks a sweep up where it stopped."""
    left = [j for j in js if not finished(j)]  # (a shared run that is not finished is trained here too)
    short = disk_shortfall(left, Path(left[0].out)) if left else None
    if short:
        print(f"gapo-sweep: warning: {short}", file=sys.stderr, flush=True)
    for i, j in enumerate(js, 1):
        where = f"[{i}/{len(js)}] {j.run.name} seed {j.seed}"
        if finished(j):
            print(f"gapo-sweep: {where}: finished, skipped ({j.out})", flush=True)
            continue
        resume = j.out if rundir.checkpoints(j.out) else None
        if resume is None and (j.out / rundir.METRICS).exists():
            print(f"gapo-sweep: {where}: {j.out} holds a run with no checkpoint to resume; remove it to start over",
                  file=sys.stderr)
            return Exit.CONFIG
        cmd = j.command(nproc, resume=resume)
        print(f"gapo-sweep: {where}: {'resuming' if resume else 'starting'}: {shlex.join(cmd)}", flush=True)
        code = run(cmd, where)
        if code:
            print(f"gapo-sweep: {where} failed (exit {code}); rerun the same command to resume", file=sys.stderr)
            return code
    return 0


def run(cmd: list[str], what: str) -> int:
    """A gapo command of the sweep, to its end: its exit code, one of gapo.errors.Exit's (a command killed by a
    signal is FAILED, said here: the sweep's own exit stays one a requeue script knows). A preemption's signal
    (SIGTERM, SIGUSR1) is the command's: the sweep hands it on and waits, so that the run saves and exits PREEMPTED
    (its processes die with the sweep, so the sweep must not die first); Ctrl-C reached the command too (one
    process group): the sweep waits for it."""
    child = subprocess.Popen(local_command(cmd))
    before = {sig: signal.signal(sig, lambda signum, frame: child.send_signal(signum))
              for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        while True:
            try:
                code = child.wait()
                break
            except KeyboardInterrupt:
                continue
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    if code < 0:
        print(f"gapo-sweep: {what}: killed by {signal_name(-code)}", file=sys.stderr, flush=True)
        return Exit.FAILED
    return code


def rehearse(m: Manifest, js: list[Job]) -> int:
    """Every distinct run once (its first seed), as `gapo-train --rehearse` would run it; a branch from its
    parent's rehearsed checkpoint (the kept step 1 of 2, see gapo/rehearse.py)."""
    done: dict[Path, Path] = {}  # a run's directory -> its rehearsal's (a shared branch's parent is named by its owner)
    for j in (j for j in js if j.seed == m.seeds[0]):
        resume = None
        if j.parent is not None:
            kept = rundir.checkpoints(done[j.parent.out])
            if not kept:
                print(f"gapo-sweep: the rehearsal of {j.parent.run.name} kept no checkpoint", file=sys.stderr)
                return 1
            resume = kept[min(kept)]
        cmd = j.command(m.nproc, rehearse=True, resume=resume)
        print(f"gapo-sweep: rehearsing {j.run.name}: {shlex.join(cmd)}", flush=True)
        code = run(cmd, f"the rehearsal of {j.run.name}")
        if code:
            return code
        done[j.out] = Path(f"{j.out}-rehearsal" + ("-resumed" if resume else ""))
    return 0


def evaluate_all(m: Manifest, js: list[Job], show: bool) -> int:
    for cmd in eval_commands(m, js, together=not show):
        if show:
            print(shlex.join(cmd))
            continue
        print(f"gapo-sweep: {shlex.join(cmd)}", flush=True)
        code = run(cmd, "the evaluation")
        if code:
            return code
    return 0


def main(argv: list[str] | None = None) -> int:
    die_with_parent()  # under a scheduler's or a person's kill, the runs it started go too
    p = parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    # key.path=value: a config setting for every run (not a DIR of --slurm, which takes an optional value)
    overrides = [a for a in argv if OVERRIDE.match(a)]
    args = p.parse_args([a for a in argv if not OVERRIDE.match(a)])
    scheduler = next((name for name in BACKENDS if getattr(args, name) is not None), None)
    if scheduler and (args.show or args.run or args.rehearse or args.budget):
        p.error(f"--{scheduler} goes alone or with --eval")
    if scheduler is None and not (args.show or args.run or args.rehearse or args.eval or args.budget):
        p.error(f"one of --print, {', '.join(f'--{name}' for name in BACKENDS)}, --run, --rehearse, --eval, --budget "
                "is required")
    try:
        m, js = resolved_jobs(args, scheduler, overrides)
        if scheduler:
            write_scheduler(m, js, args, scheduler)
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
        return Exit.CONFIG
    return 0


def parser() -> argparse.ArgumentParser:
    modes = " | ".join(["--print", "--run", "--rehearse", "--eval [--list]", "--budget",
                        *(f"--{name} [DIR] [--eval]" for name in BACKENDS)])
    p = argparse.ArgumentParser(prog="gapo-sweep", description=__doc__.split("\n\n")[0],
                                usage=f"%(prog)s MANIFEST ({modes}) [options] [key.path=value ...]",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n")[1])
    p.add_argument("manifest", help="experiments/NAME.yaml, or NAME")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--print", action="store_true", dest="show", help="print one gapo-train command per run x seed")
    what.add_argument("--run", action="store_true", help="run them here, one after another")
    what.add_argument("--rehearse", action="store_true", help="rehearse every distinct run on the CPU")
    what.add_argument("--eval", action="store_true", help="evaluate every run's checkpoints (with --list: print; "
                                                          "with --slurm: an evaluation job array)")
    what.add_argument("--budget", action="store_true", help="GPUs, memory plan, estimated GPU-hours and disk")
    where = p.add_mutually_exclusive_group()
    for name, backend in BACKENDS.items():
        where.add_argument(f"--{name}", nargs="?", const="", metavar="DIR", dest=name,
                           help=f"{backend.help}; default DIR: <output_root>/<manifest>/{name}")
    p.add_argument("--list", action="store_true", help="with --eval: print the gapo-eval commands instead")
    p.add_argument("--output-root", help="instead of the manifest's output_root (runs)")
    p.add_argument("--nproc", type=int, help="with --run: ranks per run here (default: the manifest's)")
    taken: dict[str, str] = {}
    for name, backend in BACKENDS.items():
        group = p.add_argument_group(f"with --{name}: over the manifest's {name}: block")
        for field in backend.flags:
            if field in taken:
                raise ValueError(f"gapo-sweep's BACKENDS: --{field.replace('_', '-')} is both {taken[field]}'s and "
                                 f"{name}'s: a scheduler's flags must be its own")
            taken[field] = name
            group.add_argument(f"--{field.replace('_', '-')}", metavar="VALUE", dest=f"{name}.{field}")
    return p


def resolved_jobs(args: argparse.Namespace, scheduler: str | None, overrides: list[str]) -> tuple[Manifest, list[Job]]:
    """The manifest with the command line's settings and scheduler flags, its jobs, each checked before anything is
    trained, evaluated or written (and a run folder already there, that it is the job's own)."""
    m = known_blocks(load_manifest(args.manifest))
    for name, b in BACKENDS.items():
        given = [f for f in b.flags if getattr(args, f"{name}.{f}") is not None]
        if given and name != scheduler:
            raise ConfigError(f"--{given[0].replace('_', '-')} goes with --{name}")
    ours = [o for o in overrides if o.split("=", 1)[0] in ("trainer.seed", "trainer.output_dir", "trainer.keep_steps")]
    if ours:
        raise ConfigError(f"{ours[0]}: gapo-sweep sets this per run and seed from the manifest (seeds:, its output "
                          "folders, the evaluated steps); change the manifest instead")
    if overrides:  # after each run's own, so that they win; the output folders stay the manifest's
        m = m.model_copy(update={"runs": [r if r.use else r.model_copy(update={"overrides": [*r.overrides, *overrides]})
                                          for r in m.runs]})
    js = jobs(m, args.output_root)
    check(m, js)
    for b in BACKENDS.values():
        if b.check:
            b.check(m, js)
    if args.run or args.eval or scheduler:  # what it trains, skips as finished or evaluates must be its own
        check_folders(js)
    return m, js


def write_scheduler(m: Manifest, js: list[Job], args: argparse.Namespace, scheduler: str) -> None:
    """The scheduler's job scripts (its block, with the command line's flags over it) and the command to submit."""
    given = {f: getattr(args, f"{scheduler}.{f}") for f in BACKENDS[scheduler].flags
             if getattr(args, f"{scheduler}.{f}") is not None}
    m = m.model_copy(update={scheduler: {**(m.model_extra or {}).get(scheduler, {}), **given}})
    m.block(scheduler, BACKENDS[scheduler].spec)  # a bad --flag value is named before anything is written
    out = Path(getattr(args, scheduler) or Path(args.output_root or m.output_root) / m.name / scheduler)
    for f in BACKENDS[scheduler].render(m, graph(m, js, train=not args.eval), out, Path.cwd()):
        print(f"gapo-sweep: wrote {f}")
    submit = f.relative_to(Path.cwd().resolve()) if f.is_relative_to(Path.cwd().resolve()) else f
    print(f"gapo-sweep: submit with: bash {submit}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    sys.exit(main())
