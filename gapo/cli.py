"""Command-line entry points."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
import textwrap

from gapo import console, preflight, proc, rundir
from gapo.configfile import dump_config, field_descriptions, load_config
from gapo.distributed import free_port, share_cores
from gapo.errors import EXPLAINED, ConfigError, Exit
from gapo.evaluation import check_names

TRAIN_DESCRIPTION = f"""Train a policy with GAPO and its baselines.

Signals (SLURM): SIGTERM, what SLURM sends at a preemption (SIGKILL follows after the partition's GraceTime), and
SIGUSR1, what `sbatch --signal=USR1@300` sends 300 s before the time limit, both make every rank finish (or
abandon) its step, save, and exit {Exit.PREEMPTED}; `--resume auto` then goes on from that checkpoint. GraceTime and the
signal's lead must exceed trainer.preempt_deadline_s plus a save (docs/cluster.md)."""


def train_main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _train_parser().parse_intermixed_args(argv)  # overrides may stand before and after --resume
    # Messages of config resolution (e.g. which file switches a command-line preset replaced) reach the user.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    proc.die_with_parent()  # a rank, a rehearsal's run or a sweep's run: it ends with whoever started it
    first = "RANK" not in os.environ  # the command a person typed, not a rank that gapo.launch started
    try:
        cfg = load_config(args.config, args.overrides + ([f"trainer.resume_from={args.resume}"] if args.resume else []))
        _nproc(args)
        if first:  # before torch, vLLM and DeepSpeed load (seconds): a mistake is named at once, nothing written
            if args.print_config or args.plan is not None or args.rehearse:
                check_names(cfg)  # it only prints, or rehearses in a folder of its own
            else:
                preflight.check_start(cfg)
        trainers = _trainers(args, cfg, first)
    except ConfigError as err:
        print(f"gapo-train: {err}", file=sys.stderr)
        return Exit.CONFIG
    if args.print_config:
        return _print_config(cfg, trainers, args.nproc, args.nproc_given)
    if args.plan is not None:
        return _print_plans(cfg, trainers, args.plan)
    if args.rehearse:
        return _rehearse(cfg, args.nproc, args.verbose)
    if args.nproc > 1 and first:
        return _launch(argv, cfg, args.nproc)
    return _train_here(cfg, args.verbose)


def _train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gapo-train", description=TRAIN_DESCRIPTION,
                                epilog=_fields_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML file, or the name of a config shipped in configs/")
    p.add_argument("--print-config", action="store_true",
                   help="print the fully resolved config (fields described in comments) and exit")
    p.add_argument("--verbose", action="store_true",
                   help="show every library's output on the console (by default it goes to <output_dir>/train.log)")
    p.add_argument("--nproc", type=int, default=None,
                   help="local ranks to start (torchrun); default 1, and for --print-config and --plan the ranks the "
                        "config's own first-line command names")
    p.add_argument("--plan", metavar="GB[,GB...]", nargs="?", const="24,48,80",
                   help="print the memory plan per GPU for these GPU sizes (default 24,48,80) under each "
                        "trainer.offload option, which fit, and this config's own plan; then exit")
    p.add_argument("--resume", metavar="PATH|auto", help="a run directory (its latest checkpoint), a checkpoint "
                   "directory, or auto: the newest checkpoint of trainer.output_dir that verifies, else a fresh start")
    p.add_argument("--rehearse", action="store_true",
                   help="before a real run: resolve it exactly, check the model's context and the data, then train "
                        "2 steps on the CPU with a tiny model of the same family, the real settings otherwise kept "
                        "(lengths and batch sizes scaled; see gapo/rehearse.py), and print a report")
    p.add_argument("overrides", nargs="*", metavar="key.path=value", help="e.g. algorithm.name=gspo trainer.lr=2e-6")
    return p


def _nproc(args: argparse.Namespace) -> None:
    """Sets args.nproc: a plan without --nproc is for the ranks the config's first line names; otherwise 1."""
    args.nproc_given = args.nproc is not None
    if args.nproc is None and (args.print_config or args.plan is not None):
        args.nproc = written_for(args.config)
    if args.nproc is not None and args.nproc < 1:
        raise ConfigError(f"--nproc {args.nproc}: expected a number of ranks, at least 1")
    args.nproc = args.nproc or 1


def _trainers(args: argparse.Namespace, cfg, first: bool) -> int:
    """The training ranks of --nproc, checked against the batch before any rank starts (a batch that does not
    divide)."""
    trainers = args.nproc - cfg.rollout.generator_ranks
    if trainers < 1 and (args.print_config or args.plan is not None):
        raise ConfigError(f"rollout.generator_ranks={cfg.rollout.generator_ranks} of --nproc {args.nproc} leaves no "
                          "training rank; expected fewer generator ranks than --nproc")
    if trainers >= 1 and first:
        try:
            cfg.shape(trainers)
        except ConfigError as err:
            raise ConfigError(f"--nproc {args.nproc}: {err}") from None
    return trainers


def _print_config(cfg, trainers: int, nproc: int, given: bool) -> int:
    from gapo.memory import plan_text

    # The plan may build a built-in model first, and the libraries that loads print to stdout (DeepSpeed's
    # "Setting accelerator to CPU" on a fresh machine): stdout carries only the config, or it would not parse.
    with contextlib.redirect_stdout(sys.stderr):
        text, _ = plan_text(cfg, trainers, None)
    sys.stdout.write(dump_config(cfg, comments=True))
    # As YAML comments, so the output stays a config file.
    sys.stdout.write("".join(f"# {line}\n" for line in text.splitlines()))
    planned_for = "as given" if given else "the config's own command; --nproc N plans another"
    sys.stdout.write(f"# planned for --nproc {nproc} ({planned_for})\n")
    return Exit.OK


def _print_plans(cfg, trainers: int, plan: str) -> int:
    from gapo.memory import offload_table, plan_text

    try:
        sizes = [float(x) for x in plan.split(",")]
        if not all(0 < g < float("inf") for g in sizes):
            raise ValueError
    except ValueError:
        hint = f"; {plan} reads as a setting: put it before --plan, or give --plan its sizes" if "=" in plan else ""
        print(f"gapo-train: --plan {plan}: expected positive GPU sizes in GB separated by commas, e.g. 24,48{hint}",
              file=sys.stderr)
        return Exit.CONFIG
    with contextlib.redirect_stdout(sys.stderr):  # libraries that a built-in model loads print to stdout
        table = offload_table(cfg, trainers, sizes)
        own = [plan_text(cfg, trainers, g)[0] for g in sizes]
    print(table)
    for g, text in zip(sizes, own, strict=True):
        print(f"\nThis config on a {g:g} GB GPU:\n{text}")
    return Exit.OK


def _launch(argv: list[str], cfg, nproc: int) -> int:
    """This command again under torchrun (gapo.launch): one process per rank, each with its own engine and its share
    of the cores. A preemption signal is the ranks' (gapo.launch forwards it); Ctrl-C stops them (torchrun's)."""
    rest = [a for i, a in enumerate(argv) if a != "--nproc" and (i == 0 or argv[i - 1] != "--nproc")
            and not a.startswith("--nproc=")]
    cmd = [sys.executable, "-m", "gapo.launch", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "-m", "gapo.cli", *rest]
    child = subprocess.Popen(cmd)
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, lambda signum, frame: child.send_signal(signum))
    try:
        code = child.wait()
    except KeyboardInterrupt:  # Ctrl-C (gapo.launch had it too, from the terminal) or a SIGINT to this process alone
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the ranks' way out short
        if child.poll() is None:
            child.send_signal(signal.SIGINT)
        child.wait()
        code = Exit.INTERRUPTED
    if code in (Exit.OK, *EXPLAINED, Exit.PREEMPTED):
        return code
    if code == Exit.INTERRUPTED:
        return _stopped(cfg, "interrupted (Ctrl-C)", Exit.INTERRUPTED)
    return _stopped(cfg, f"stopped (exit {code})", Exit.FAILED)  # a rank died without a message


def _train_here(cfg, verbose: bool) -> int:
    """Train in this process: a single rank, or one of gapo.launch's ranks."""
    from gapo.trainer import preempt

    preempt.install()  # SIGTERM / SIGUSR1 during the imports below: kept for the first safe point, not a death
    # OpenMP threads spin-wait by default, which slows vLLM's CPU generation ~6x when two runtimes share cores.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    share_cores(1)  # a single rank: every core (under gapo.launch each rank's share is set already)
    rank0 = os.environ.get("RANK", "0") == "0"
    if not verbose:
        console.capture(show_warnings=rank0)  # before the libraries load: what they print goes to train.log
    from gapo.reward.registry import RewardsFailed
    from gapo.reward.types import RewarderUnavailable
    from gapo.rollout.transport import PeerGone
    from gapo.trainer.checkpoint import CheckpointError
    from gapo.trainer.loop import TrainingDiverged, train
    from gapo.trainer.preempt import Preempted
    from gapo.trainer.sync import SyncError

    try:
        run_dir = train(cfg)
    except ConfigError as err:  # bad model path, data file or field: a message, not a traceback
        console.error(f"gapo-train: {err}{console.failed_start()}")
        return Exit.CONFIG
    except (TrainingDiverged, RewardsFailed, RewarderUnavailable, CheckpointError, SyncError) as err:
        console.error(f"gapo-train: {err}{console.failed_start()}")
        return Exit.STOPPED
    except PeerGone as err:  # split placement: the other side of the bridge died or failed first, and says why
        console.error(f"gapo-train: {err}")
        return Exit.FAILED
    except Preempted as err:
        # Every rank has saved (the save ends in a barrier). The first rank to exit makes torchrun SIGTERM the
        # others, and Python drops its handlers while it shuts down: ignore the signal so each exits PREEMPTED.
        for sig in preempt.SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        if rank0:
            console.say(f"gapo-train: {err}")
        return Exit.PREEMPTED
    except KeyboardInterrupt:  # Ctrl-C: one line (the launcher's, under torchrun), not the step's traceback
        return Exit.INTERRUPTED if "RANK" in os.environ else _stopped(cfg, "interrupted (Ctrl-C)", Exit.INTERRUPTED)
    if rank0:
        console.say(console.outputs(run_dir))
    return Exit.OK  # (a generator rank of a split job returns no run_dir: its trainers report the run)


def _stopped(cfg, how: str, code: int) -> int:
    """Where a run that stopped without a message of its own can go on from."""
    found = rundir.checkpoints(cfg.trainer.output_dir)
    where = f"the last checkpoint is {found[max(found)]}" if found else "it saved no checkpoint yet"
    console.error(f"gapo-train: the run {how}; {where}: `--resume auto` goes on from the newest that verifies")
    return code


# What a user sets first, listed before the long tail in --help.
FIRST_FIELDS = ("model.path", "data.train", "algorithm.name", "trainer.lr", "rollout.group_size",
                "rollout.prompts_per_step", "data.max_prompt_tokens", "rollout.max_new_tokens", "rollout.temperature",
                "trainer.total_steps", "trainer.seed", "trainer.output_dir")


def written_for(config: str) -> int:
    """The --nproc of the command a config opens with (every shipped config's first line: `# gapo-train --config
    ... --nproc 8`), 1 when it names none or the file cannot be read (load_config has said why already)."""
    from gapo.configfile import find_config_file

    try:
        first = find_config_file(config).read_text().split("\n", 1)[0]
    except (ConfigError, OSError):
        first = ""
    words = first.split("(", 1)[0].split()  # the command, not the note after it ("add --nproc 2 for two ranks")
    at = words.index("--nproc") + 1 if "--nproc" in words else len(words)
    return int(words[at]) if at < len(words) and words[at].isdigit() else 1


def _fields_help() -> str:
    """The described config fields, for --help: the ones a user sets first, then the rest in the schema's order."""
    described = dict(field_descriptions())
    lines = ["config fields, set in the YAML file or on the command line as section.field=value",
             "(--print-config shows them all, with their values). The ones set first:"]

    def add(name: str, text: str) -> None:
        lines.append(f"  {name}")
        lines.extend(textwrap.wrap(text, 100, initial_indent=" " * 6, subsequent_indent=" " * 6))

    for name in FIRST_FIELDS:
        add(name, described.get(name, ""))
    lines.append("The others:")
    for name, text in described.items():
        if name not in FIRST_FIELDS:
            add(name, text)
    return "\n".join(lines)


def _rehearse(cfg, nproc: int, verbose: bool) -> int:
    """Check the real run's budget and data, train its scaled copy in a child gapo-train, report."""
    from gapo import rehearse
    from gapo.models import check_context_budget

    try:
        limit = check_context_budget(cfg, cfg.model.path)
        plan, run_dir = rehearse.prepare(cfg, nproc)
    except ConfigError as err:
        print(f"gapo-train --rehearse: {err}", file=sys.stderr)
        return Exit.CONFIG
    code = subprocess.call([sys.executable, "-m", "gapo.cli", "--config", str(run_dir / rundir.REHEARSAL_CONFIG),
                            "--nproc", str(plan.world), *(["--verbose"] if verbose else [])])
    text, ok = rehearse.report(plan, cfg, run_dir, limit)
    (run_dir / rundir.REHEARSAL_REPORT).write_text(text)
    print(text)
    return code or (Exit.OK if ok else Exit.FAILED)


if __name__ == "__main__":  # a rank under torchrun (gapo.launch), or a rehearsal's run
    code = train_main()
    if code == Exit.OK:  # the process ends here; train() leaves the group up for callers that go on (bench/gpu/)
        from gapo.distributed import leave_distributed

        leave_distributed()
    sys.exit(code)
