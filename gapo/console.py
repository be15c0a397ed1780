"""What `gapo-train` and `gapo-eval` show a person, and a log file for everything else.

A training process hosts vLLM, DeepSpeed, transformers, torch and wandb, and they all talk: through Python
loggers, warnings, print(), and C/C++ code that writes straight to file descriptors 1 and 2, also from
child processes (vLLM's engine core, compile workers, wandb's service) that inherit them. Only moving fds
1 and 2 catches all of it, so `capture()` points them at a log file when a training process starts and
keeps a duplicate of the real stderr, the console, for the lines a person reads: the resolved run, the
progress bar, one aligned line per step, validation results, gapo's own warnings, errors (a traceback in
full) and where the outputs are. The log is a temporary file until the run directory is known (a branch
from a checkpoint names its own), then `attach()` moves it to <run_dir>/train.log. Without `capture()`
(`gapo-train --verbose`) everything stays on the console, as it comes. gapo-eval captures the same way; its
tables still go to the real stdout (`result()`), where a user may pipe them.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import TextIO

from tqdm import tqdm

from gapo.config import Config
from gapo.distributed import THREADS_WHY
from gapo.rundir import TRAIN_LOG

_console: TextIO | None = None  # the real stderr while fds 1 and 2 go to the log
_stdout: TextIO | None = None  # the real stdout meanwhile
_log: Path | None = None  # where fds 1 and 2 go now
_attached = False  # the log is <run_dir>/train.log (else a temporary file)
_failed = False  # an uncaught exception pointed the user at the log: keep it


def terminal() -> TextIO:
    """The console: the progress bar and every line of `say()` go here."""
    return _console or sys.stderr


def say(line: str) -> None:
    """A line for the person at the console (above the progress bar, which tqdm.write redraws below it);
    train.log gets it too."""
    tqdm.write(line, file=terminal())
    if _console is not None:
        print(line, flush=True)


def result(text: str) -> None:
    """Output a user may pipe or parse (gapo-eval's tables): the real stdout; the log gets it too."""
    print(text, file=_stdout or sys.stdout, flush=True)
    if _stdout is not None:
        print(text, flush=True)


def brief(text: str, limit: int = 160) -> str:
    """What a one-line message quotes of another message (a library's error): the first sentence of its first line,
    or its words up to `limit` characters followed by " ...", never cut inside a word."""
    lines = text.strip().splitlines()
    line = lines[0] if lines else ""
    end = line.find(". ")
    if 0 < end < limit:
        return line[:end + 1]
    if len(line) <= limit:
        return line
    cut = line.rfind(" ", 0, limit)
    return line[:cut if cut > 0 else limit] + " ..."


def error(text: str) -> None:
    """An error message: on the console (below the progress bar, which stops there), and in train.log."""
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()
    if _console is not None:
        print(text, file=sys.stderr, flush=True)
    print(text, file=terminal(), flush=True)


def capture(show_warnings: bool = True) -> Path:
    """From now on fds 1 and 2 of this process (and of the processes it starts) write to a log; returns its
    path. `show_warnings`: gapo's own warnings still reach the console (one rank is enough)."""
    global _console, _stdout, _log
    sys.stdout.flush()
    sys.stderr.flush()
    _console = os.fdopen(os.dup(2), "w", buffering=1)
    _stdout = os.fdopen(os.dup(1), "w", buffering=1)
    fd, path = tempfile.mkstemp(prefix="gapo-train-", suffix=".log")
    _redirect(fd)
    _log = Path(path)
    sys.excepthook = _excepthook
    atexit.register(_discard_unused_log)
    if show_warnings:
        echo = _Echo(logging.WARNING)
        echo.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logging.getLogger("gapo").addHandler(echo)
    return _log


def attach(run_dir: Path, name: str = TRAIN_LOG) -> Path | None:
    """Move the log to run_dir/name, appending (a resumed run goes on with its log); a no-op without
    `capture()`. Before the engine starts, so that its processes inherit the final fds."""
    global _log, _attached
    if _console is None or _attached:
        return _log
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / name
    _redirect(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644))
    early = _log.read_bytes()  # what the imports and the set-up wrote so far; one write, so ranks do not mix
    with open(target, "ab") as f:
        f.write(early)
    _log.unlink()
    _log, _attached = target, True
    return _log


def run_header(cfg: Config, run_dir: Path, world: int, threads: int) -> str:
    """The resolved run in a few lines (`--print-config` has every field); `threads`: torch's, as the engine left
    them (gapo.distributed.share_cores)."""
    m, d, a, r, t, ev = cfg.model, cfg.data, cfg.algorithm, cfg.rollout, cfg.trainer, cfg.eval
    train = d.train if isinstance(d.train, str) else ", ".join(f"{s.source}:{s.subset}" if s.subset else s.source
                                                                for s in d.train)
    lines = [f"run        {run_dir}" + (f"  (from {t.resume_from})" if t.resume_from else ""),
             f"model      {m.path} ({m.dtype}), {r.engine} rollouts, {_ranks(cfg, world)}",
             f"algorithm  {a.name}: {a.is_level} IS, {a.describe()}, {a.loss_agg}",
             f"data       {train} ({d.type}): {t.total_steps} steps x {r.prompts_per_step} prompts x "
             f"{r.group_size} rollouts, lr {t.lr:g}"]
    if ev.benchmarks:
        every = f"every {t.eval_every} steps, " if t.eval_every else ""
        lines.append(f"validation {', '.join(ev.benchmarks)} (n={ev.n}): {every}before the first and after the "
                     "last step")
    lines.append(f"threads    {threads} per rank ({os.environ.get(THREADS_WHY, 'as the process found them')})")
    lines.append(f"log        {_log if _console else 'this console (--verbose)'}")
    return "\n".join(lines)


def _ranks(cfg: Config, world: int) -> str:
    stage = cfg.zero_stage(world)
    if world == 1:
        return f"1 rank, ZeRO stage {stage} (one rank: nothing to partition)"
    return f"{world} ranks, ZeRO stage {stage}"


def failed_start() -> str:
    """Where the output of a start that stopped with a message went: kept, so that the run directory is not
    mistaken for a half-made run (its train.log is the failure's)."""
    return f"\n(log of this failed start: {_log})" if _console is not None and _attached else ""


def step_line(step: int, total: int, m: dict[str, float]) -> str:
    """One step's line, in fixed-width columns so that the steps read as a table."""
    return (f"step {step:>{len(str(total))}}/{total}  reward {m['reward/mean']:6.3f}  "
            f"clip {m.get('clip_frac', float('nan')):5.3f}  len {m['response/len_mean']:6.1f}  "
            f"gen {m['time/generate_s']:6.1f}s  train {m['time/train_s']:6.1f}s  push {m['time/weight_push_s']:5.2f}s")


def outputs(run_dir: Path) -> str:
    """Where a finished run's files are, and the command that plots them."""
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in run_dir.iterdir())
    return f"outputs    {run_dir}: {', '.join(names)}\nplots      gapo-plot {run_dir}"


class _Echo(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        tqdm.write(self.format(record), file=terminal())


def _redirect(fd: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


# What gloo raises on a rank whose peer died: the launcher then names the dead rank and where to resume.
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def _excepthook(kind, value, tb) -> None:
    global _failed
    _failed = True
    text = "".join(traceback.format_exception(kind, value, tb)).rstrip()
    if _console is not None and any(p in str(value) for p in _PEER_GONE):  # a consequence: one line, not 150
        print(text, file=sys.stderr, flush=True)  # the traceback to the log only
        error(f"gapo-train: rank {os.environ.get('RANK', '0')} lost another rank ({kind.__name__}: "
              f"{brief(str(value))}); its traceback is in {_log}")
    else:
        error(text + f"\n(the run's full output: {_log})")


def _discard_unused_log() -> None:
    """A run that stopped with a message before its directory was known leaves no temporary log behind."""
    if _log is not None and not _attached and not _failed:
        _log.unlink(missing_ok=True)
