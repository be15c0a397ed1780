"""The files of a run directory (trainer.output_dir), named once, and finding a run's checkpoints: the loop and
the tracker write them; checkpoint, rehearse, gapo-eval, gapo-plot and gapo-compare read them.

    <output_dir>/
        config.yaml         the resolved config of the latest start
        metrics.jsonl       one JSON line per step and per validation: what gapo-plot and gapo-compare read
        rollouts.jsonl      every rollout with its clip decisions (trainer.log_rollouts)
        memory_plan.txt     the memory plan the run was checked against
        train.log           what the console leaves out
        dropped_records.jsonl   the training and validation records left out before step 1, with why
        val/step_N/         validation results at step N (gapo-eval's results.json and per_problem.jsonl)
        eval/P/step_N/      gapo-eval --run: checkpoint N under the protocol P (a paper table's settings)
        checkpoints/        step_N/ (see gapo/trainer/checkpoint.py) and `latest`, the newest complete one
        rehearsal_config.yaml, rehearsal.md     a rehearsal's config and report (gapo-train --rehearse)
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from gapo.errors import ConfigError

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
ROLLOUTS = "rollouts.jsonl"
MEMORY_PLAN = "memory_plan.txt"
TRAIN_LOG = "train.log"
DROPPED = "dropped_records.jsonl"
VAL = "val"
EVAL = "eval"
CHECKPOINTS = "checkpoints"
LATEST = "latest"  # inside CHECKPOINTS: the name of the newest complete checkpoint
STATE = "trainer.json"  # inside a checkpoint: what makes a directory one
MANIFEST = "manifest.json"  # inside a checkpoint: its files' sizes and checksums
REHEARSAL_CONFIG = "rehearsal_config.yaml"
REHEARSAL_REPORT = "rehearsal.md"
AUTO = "auto"  # trainer.resume_from / --resume: the run's newest checkpoint that verifies, or a fresh start


# What may differ between a checkpoint's config and the run that resumes it. Anything else (the model,
# the data, group size, batch shapes, optimizer settings held in the optimizer state) is refused.
MAY_CHANGE = ("algorithm.", "trainer.resume_from", "trainer.total_steps", "trainer.output_dir", "trainer.save_every",
              "trainer.keep_last", "trainer.keep_steps", "trainer.keep_every", "trainer.save_only_model",
              "trainer.eval_every", "trainer.log_rollouts", "trainer.max_skipped_steps", "trainer.preempt_deadline_s",
              "trainer.collective_timeout_min", "trainer.check_memory", "tracking.", "reward.", "eval.",
              "rollout.engine", "rollout.compile", "rollout.kv_cache_gb", "rollout.gpu_memory_utilization",
              "rollout.sleep_between_steps", "rollout.verify_push", "rollout.push_tolerance", "rollout.mismatch_alarm",
              # (a checkpoint holding rollouts sampled ahead is refused by gapo.trainer.loop.setup unless split
              # placement on as many training ranks, with the same rollout.max_staleness, resumes it)
              "rollout.placement", "rollout.generator_ranks", "rollout.max_staleness", "rollout.transport")


def step_name(step: int) -> str:
    """step_000600: the directory of step 600, under checkpoints/, val/ and eval/P/."""
    return f"step_{step:06d}"


def is_checkpoint(path: Path) -> bool:
    return (path / STATE).is_file()


def run_of(path: str | Path) -> Path:
    """The run directory of a checkpoint directory, or the path itself (a run directory)."""
    p = Path(path)
    return p.parent.parent if is_checkpoint(p) or p.parent.name == CHECKPOINTS else p


def checkpoints(run_dir: str | Path) -> dict[int, Path]:
    """The run's complete checkpoints by step (a half-written one is still named .tmp-step_N)."""
    root = Path(run_dir) / CHECKPOINTS
    found = {}
    for p in sorted(root.glob("step_*")) if root.is_dir() else []:
        if is_checkpoint(p) and p.name[5:].isdigit():
            found[int(p.name[5:])] = p
    return found


def find(path: str | Path, flag: str = "--resume") -> Path:
    """A run directory (-> its latest complete checkpoint) or a checkpoint directory. `flag`: what named it, for the
    message (gapo-train's --resume, gapo-eval's --model)."""
    p = Path(path)
    if is_checkpoint(p):
        return p
    latest = p / CHECKPOINTS / LATEST
    if latest.is_file():
        ckpt = p / CHECKPOINTS / latest.read_text().strip()
        if not is_checkpoint(ckpt):
            raise ConfigError(f"{flag} {path}: {latest} names {ckpt.name}, which is missing or incomplete")
        return ckpt
    auto = (" (`--resume auto` goes on from trainer.output_dir's newest checkpoint, or starts fresh when it has none)"
            if flag == "--resume" else "")
    if (p / CHECKPOINTS).is_dir() or (p / METRICS).is_file() or (p / CONFIG).is_file():
        raise ConfigError(f"{flag} {path}: a run with no complete checkpoint yet (one is saved every "
                          f"trainer.save_every steps and after the last){auto}")
    raise ConfigError(f"{flag} {path}: not a run directory with checkpoints, nor a checkpoint directory "
                      f"(one holding {STATE}){auto}")


def refuse_taken(run_dir: Path) -> None:
    """A fresh run (or a new branch) never writes into a folder that already holds a run's log or checkpoints."""
    if (run_dir / METRICS).exists() or (run_dir / CHECKPOINTS).exists():
        raise ConfigError(f"trainer.output_dir={run_dir} already holds a run: continue it with --resume {run_dir} (or "
                          "--resume auto), or choose another output_dir")


def per_c(metric: str, c: int) -> str:
    """metrics.jsonl's key for `metric` over the groups with c correct (clip_frac/c3): the trainer's step metrics
    write these keys, gapo-plot and gapo-compare find them with logged_cs."""
    return f"{metric}/c{c}"


def logged_cs(metric: str, keys: Iterable[str]) -> list[int]:
    """The c of every per_c(metric, c) among `keys`, in order."""
    prefix = per_c(metric, 0)[:-1]
    return sorted({int(k[len(prefix):]) for k in keys if k.startswith(prefix) and k[len(prefix):].isdigit()})


def read_results(path: Path, part: str) -> dict:
    """`part` ("meta" or "metrics") of an evaluation's results.json (gapo.evaluation writes both); a file there that is
    not one is the user's to move or remove, said as a ConfigError rather than a traceback."""
    try:
        got = json.loads(path.read_text())
        if not isinstance(got, dict) or not isinstance(got.get(part), dict):
            raise ValueError(f"no {part} mapping")
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path}: not a gapo-eval results file ({type(err).__name__}: {err}); move or remove it "
                          "(gapo-eval writes it again)") from None
    return got[part]
