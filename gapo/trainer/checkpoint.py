"""Checkpoints that a crash cannot half-write, exact resume, and branching a run with another algorithm.

Layout of a run directory:

    <output_dir>/checkpoints/step_000600/
        ds/                 DeepSpeed engine state (model, optimizer, LR scheduler), one shard per rank
        hf/                 the policy as a Hugging Face model + tokenizer (gapo-eval, vLLM, transformers)
        trainer.json        step, sampler position, wandb id, parent run, world size
        rng_rank{r}.pt      python / numpy / torch (and CUDA, on GPU) RNG states of every rank
        config.yaml         the resolved config that wrote it
    <output_dir>/checkpoints/latest      name of the newest complete checkpoint

Everything is written under `.tmp-step_000600` and renamed into place after every file is fsynced;
`latest` is replaced by rename too. A kill at any moment leaves the previous checkpoint loadable.
All ranks must share the filesystem (one node, or a shared mount on several).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import yaml

from gapo import rundir
from gapo.config import Config, ConfigError, dump_config, resolve
from gapo.distributed import gather

log = logging.getLogger("gapo.checkpoint")

# What may differ between a checkpoint's config and the run that resumes it. Anything else (the model,
# the data, group size, batch shapes, optimizer settings held in the optimizer state) is refused.
MAY_CHANGE = ("algorithm.", "trainer.resume_from", "trainer.total_steps", "trainer.output_dir", "trainer.save_every",
              "trainer.keep_last", "trainer.keep_steps", "trainer.keep_every", "trainer.eval_every",
              "trainer.log_rollouts", "tracking.", "reward.", "eval.", "rollout.engine", "rollout.compile",
              "rollout.kv_cache_gb", "rollout.gpu_memory_utilization", "rollout.sleep_between_steps")


@dataclass
class TrainerState:
    step: int
    sampler: dict
    world_size: int
    wandb_id: str | None = None
    # Where this run branched from: {"run_dir", "step", "algorithm"} (the paper's step-600 intervention).
    parent: dict | None = None


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    for d in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
        fd = os.open(d, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save(actor, tokenizer, cfg: Config, state: TrainerState, run_dir: Path) -> Path:
    """Collective: every rank calls it. Returns the checkpoint directory."""
    rank = dist.get_rank()
    root = run_dir / rundir.CHECKPOINTS
    name = rundir.step_name(state.step)
    tmp, final = root / f".tmp-{name}", root / name
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)  # left by a crash during an earlier attempt at this step
        tmp.mkdir(parents=True)
    dist.barrier()
    actor.engine.save_checkpoint(str(tmp / "ds"), tag="state", save_latest=False)
    torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
    # Collective under ZeRO-3 (full tensors on rank 0 only); keys lose the Policy wrapper's "lm." prefix.
    full = actor.engine._zero3_consolidated_16bit_state_dict() if actor.zero_stage == 3 \
        else actor.engine.module.state_dict()
    state_dict = {k.removeprefix("lm."): v for k, v in (full or {}).items()}
    if rank == 0:
        actor.module.save_pretrained(tmp / "hf", state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp / "hf")
        (tmp / rundir.STATE).write_text(json.dumps(asdict(state), indent=1))
        (tmp / rundir.CONFIG).write_text(dump_config(cfg))
    dist.barrier()
    if rank == 0:
        _fsync_tree(tmp)
        if os.environ.get("GAPO_FAULT") == f"kill_before_rename:{state.step}":  # fault injection (crash tests)
            os.kill(os.getpid(), 9)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_atomic(root / rundir.LATEST, name)
        _prune(root, cfg.trainer.keep_last, cfg.trainer.keep_steps, cfg.trainer.keep_every)
    dist.barrier()
    return final


def check_shared_filesystem(run_dir: Path) -> None:
    """Collective. Checkpoints are written by every rank into one directory and read back by every rank, so all
    ranks must see the same filesystem at run_dir (one node, or a shared mount on several): rank 0 writes a probe,
    every rank looks for it, and a rank that cannot see it stops the run on every rank, named, before any
    training time is spent."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 1:
        return
    probe = gather(f".gapo-shared-fs-{os.getpid()}-{random.getrandbits(32):08x}" if rank == 0 else None)[0]
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_atomic(run_dir / probe, "written by rank 0; every rank must see it\n")
    dist.barrier()
    seen = gather((run_dir / probe).is_file())
    dist.barrier()
    if rank == 0:
        (run_dir / probe).unlink(missing_ok=True)
    blind = [r for r, ok in enumerate(seen) if not ok]
    if blind:
        raise ConfigError(f"trainer.output_dir={run_dir}: rank(s) {', '.join(map(str, blind))} cannot see a file "
                          "rank 0 wrote there. Checkpoints need one filesystem shared by all ranks (on several nodes: "
                          "a shared mount such as NFS or Lustre); point trainer.output_dir at one")


def _prune(root: Path, keep: int, keep_steps: list[int] = (), keep_every: int = 0) -> None:
    """Remove complete checkpoints beyond the newest `keep`, except the steps named in `keep_steps` and the
    multiples of `keep_every` (an intervention's branch point, the steps a table evaluates)."""
    done = sorted((int(p.name[5:]), p) for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit())
    for step, old in done[:-keep]:
        if step not in keep_steps and not (keep_every and step % keep_every == 0):
            shutil.rmtree(old)


def read(ckpt: Path) -> tuple[TrainerState, Config]:
    try:
        state = TrainerState(**json.loads((ckpt / rundir.STATE).read_text()))
        saved = resolve(yaml.safe_load((ckpt / rundir.CONFIG).read_text()))
    except (OSError, ValueError, TypeError) as err:
        raise ConfigError(f"checkpoint {ckpt}: cannot read trainer.json / config.yaml ({err})") from None
    for must in ["ds/state", "hf/config.json"]:
        if not (ckpt / must).exists():
            raise ConfigError(f"checkpoint {ckpt}: {must} is missing; the checkpoint is incomplete or damaged")
    return state, saved


def check_compatible(saved: Config, cfg: Config, state: TrainerState, world: int) -> list[str]:
    """Keys that differ from the checkpoint's config; refuses the ones that cannot change safely."""

    def flat(tree: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in tree.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    a, b = flat(saved.model_dump(mode="json")), flat(cfg.model_dump(mode="json"))
    changed = sorted(k for k in a if a[k] != b.get(k))
    bad = [k for k in changed if not k.startswith(MAY_CHANGE)]
    if bad:
        detail = ", ".join(f"{k}: {a[k]!r} -> {b[k]!r}" for k in bad)
        raise ConfigError(f"cannot resume with a different {detail}; only algorithm.*, tracking.*, reward.*, the "
                          "rollout engine settings and trainer.total_steps/output_dir/save_every/keep_last/"
                          "eval_every/log_rollouts may change")
    if world != state.world_size:
        raise ConfigError(f"checkpoint was written by {state.world_size} ranks, this run has {world}: the ZeRO "
                          "partitions cannot be re-sharded on resume; resume with the same --nproc")
    return changed


class Start(NamedTuple):
    """How a run begins: fresh (ckpt None), going on from its own checkpoint, or branching from another run's."""

    run_dir: Path  # where this run writes: trainer.output_dir, or a branch's own directory next to its parent
    ckpt: Path | None
    state: TrainerState | None
    parent: dict | None  # the run branched from: a new branch's, or the one its own checkpoint records
    branched: bool  # a new run (new directory, new wandb run) starting from `ckpt`


def resume_or_branch(cfg: Config, world: int, rank: int) -> Start:
    """Decided before anything is built, so that a bad checkpoint fails in seconds. Changing the algorithm
    while resuming into the parent's own directory branches: the run goes to a new directory next to the
    parent, whose log stays as it was. A fresh run or a branch refuses a directory that already holds a run."""
    run_dir = Path(cfg.trainer.output_dir)
    ckpt, state, parent, branched = None, None, None, False
    if cfg.trainer.resume_from:
        ckpt = rundir.find(cfg.trainer.resume_from)
        state, saved = read(ckpt)
        changed = check_compatible(saved, cfg, state, world)
        parent_dir = rundir.run_of(ckpt)
        if any(k.startswith("algorithm.") for k in changed) and run_dir.resolve() == parent_dir.resolve():
            run_dir = Path(f"{parent_dir}-{cfg.algorithm.name}-from-step{state.step}")
        branched = run_dir.resolve() != parent_dir.resolve()
        parent = {"run_dir": str(parent_dir), "step": state.step, "algorithm": saved.algorithm.name,
                  "wandb_id": state.wandb_id} if branched else state.parent
        if rank == 0:
            log.info("resuming from %s (step %d)%s; changed: %s", ckpt, state.step,
                     f", branching into {run_dir}" if branched else "", ", ".join(changed) or "-")
    if (state is None or branched) and ((run_dir / rundir.METRICS).exists() or (run_dir / rundir.CHECKPOINTS).exists()):
        raise ConfigError(f"trainer.output_dir={run_dir} already holds a run: continue it with --resume {run_dir}, "
                          "or choose another output_dir")
    return Start(run_dir, ckpt, state, parent, branched)


def load(actor, ckpt: Path) -> None:
    """Collective. Restores engine state (model, optimizer, scheduler) and this rank's RNG states."""
    rank = dist.get_rank()
    path, _ = actor.engine.load_checkpoint(str(ckpt / "ds"), tag="state", load_optimizer_states=True,
                                          load_lr_scheduler_states=True)
    if path is None:
        raise ConfigError(f"checkpoint {ckpt}: DeepSpeed could not load {ckpt / 'ds'}")
    rng_file = ckpt / f"rng_rank{rank}.pt"
    if not rng_file.is_file():
        raise ConfigError(f"checkpoint {ckpt}: {rng_file.name} is missing")
    set_rng_state(torch.load(rng_file, weights_only=False))


def rng_state() -> dict:
    """Every generator a step draws from. On GPU that includes the CUDA generators (dropout, a sampling
    fallback, anything seeded through torch.manual_seed), one state per visible device."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """The inverse of rng_state. A checkpoint without CUDA states (written on CPU) leaves the CUDA generators
    as seeded; one written with a different number of visible devices cannot be mapped device to device,
    so those are left as seeded too, with a warning."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is None:
        return
    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if devices != len(cuda):
        log.warning("checkpoint holds CUDA RNG states for %d devices, this process sees %d: CUDA generators "
                    "keep their seeded state", len(cuda), devices)
        return
    torch.cuda.set_rng_state_all(cuda)


def truncate_metrics(run_dir: Path, step: int) -> None:
    """Drop lines logged after `step` by the interrupted attempt, so the log reads as one straight run."""
    f = run_dir / rundir.METRICS
    if f.is_file():
        keep = [line for line in f.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        _write_atomic(f, "".join(line + "\n" for line in keep))
    r = run_dir / rundir.ROLLOUTS
    if r.is_file():
        keep = [line for line in r.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        _write_atomic(r, "".join(line + "\n" for line in keep))
