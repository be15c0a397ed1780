"""Checkpoints that a crash cannot half-write, exact resume, and branching a run with another algorithm.

Layout of a run directory:

    <output_dir>/checkpoints/step_000600/
        ds/                 DeepSpeed engine state (model, optimizer, LR scheduler), one shard per rank; absent,
                            with the RNG states, in a weights-only checkpoint (trainer.save_only_model)
        hf/                 the policy as a Hugging Face model + tokenizer (gapo-eval, vLLM, transformers)
        trainer.json        step, sampler position, wandb id, parent run, world size (another one re-shards)
        rng_rank{r}.pt      python / numpy / torch (and CUDA, on GPU) RNG states of every rank
        config.yaml         the resolved config that wrote it
        manifest.json       every other file's size and CRC-32: resume checks the checkpoint is whole
    <output_dir>/checkpoints/latest      name of the newest complete checkpoint

Everything is written under `.tmp-step_000600` and renamed into place after every file is fsynced;
`latest` is replaced by rename too. A kill at any moment leaves the previous checkpoint loadable.
All ranks must share the filesystem (one node, or a shared mount on several).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import shutil
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from safetensors import SafetensorError
from torch import Tensor

from gapo import rundir
from gapo.config import Config
from gapo.configfile import dump_config, read_yaml, resolve
from gapo.distributed import gather, rank0_decides
from gapo.errors import ConfigError
from gapo.faults import injected
from gapo.trainer.reshard import RESHARD, reshard

log = logging.getLogger("gapo.checkpoint")



@dataclass
class TrainerState:
    step: int
    sampler: dict
    world_size: int
    wandb_id: str | None = None
    # Where this run branched from: {"run_dir", "step", "algorithm"} (the paper's step-600 intervention).
    parent: dict | None = None
    manifested: bool = False  # written with manifest.json (save sets it): then a missing manifest is damage
    # Split placement, rollout.max_staleness > 0: the steps after this one whose prompts were drawn and rollouts
    # sampled already; each rank's are in in_flight_name(rank), so that the resumed run trains on the same ones.
    in_flight: list[int] = field(default_factory=list)
    weights_only: bool = False  # trainer.save_only_model: hf/ without ds/ or RNG: evaluated, never resumed


def in_flight_name(rank: int) -> str:
    return f"in_flight_rank{rank}.pt"


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


# A failed write, as each writer raises it (see save).
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (a full disk): the previous ones are intact, the partial one removed."""


def _write_export(tmp: Path, actor, tokenizer, cfg: Config, state: TrainerState, state_dict: dict) -> str | None:
    """Rank 0's part of a checkpoint: the Hugging Face export, trainer.json, config.yaml, then the manifest of every
    file's size and checksum (written last, atomically: a checkpoint without one is incomplete). A write error's
    message, or None."""
    try:
        actor.module.save_pretrained(tmp / "hf", state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp / "hf")
        (tmp / rundir.STATE).write_text(json.dumps({**asdict(state), "manifested": True}, indent=1))
        (tmp / rundir.CONFIG).write_text(dump_config(cfg))
        _fsync_tree(tmp)
        _write_atomic(tmp / rundir.MANIFEST, json.dumps(manifest(tmp), indent=1))
    except WRITE_ERRORS as err:
        return f"rank 0: {err}"
    return None

def save(actor, tokenizer, cfg: Config, state: TrainerState, run_dir: Path, in_flight: dict | None = None) -> Path:
    """Collective: every rank calls it. Returns the checkpoint directory. `state.weights_only`: hf/, trainer.json and
    config.yaml only (trainer.save_only_model).

    Refuses before writing when the disk has less room than the checkpoint needs (its predecessor's size, or an
    estimate from the parameter count); a write that fails anyway on any rank (ENOSPC arrives as OSError from our
    writes, as RuntimeError from torch.save inside DeepSpeed, as SafetensorError from the export) removes the
    partial directory on every rank's word and stops the run with the path and the bytes needed."""
    rank = dist.get_rank()
    root = run_dir / rundir.CHECKPOINTS
    name = rundir.step_name(state.step)
    tmp, final = root / f".tmp-{name}", root / name
    failure = None
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)  # left by a crash during an earlier attempt at this step
        tmp.mkdir(parents=True)
        failure = _room_for(root, _expected_bytes(root, actor, state.weights_only))
    if (failure := gather(failure)[0]) is not None:
        _abandon(tmp, rank)
        raise CheckpointError(failure)
    try:
        if injected("enospc") == str(state.step) and rank == dist.get_world_size() - 1:  # (gapo.faults)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))
        if injected("fill") == str(state.step) and rank == 0:
            _fill(root)  # the disk fills up after the room check: the real writers below meet a real ENOSPC
        if not state.weights_only:  # each rank's own state (a weights-only checkpoint's weights are gathered below)
            # With LoRA the frozen base weights are left out (they are model.path's): adapters and optimizer state.
            actor.deepspeed.save_checkpoint(str(tmp / "ds"), tag="state", save_latest=False,
                                         exclude_frozen_parameters=cfg.model.lora is not None)
            torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
            if state.in_flight:
                torch.save(in_flight, tmp / in_flight_name(rank))
    except WRITE_ERRORS as err:
        failure = f"rank {rank}: {err}"
    state_dict = _export_state_dict(actor, rank)  # (collective)
    if rank == 0 and failure is None:
        failure = _write_export(tmp, actor, tokenizer, cfg, state, state_dict)
    failures = [f for f in gather(failure) if f]
    if failures:
        _abandon(tmp, rank)
        need = _expected_bytes(root, actor, state.weights_only)
        raise CheckpointError(f"checkpoint of step {state.step} could not be written to {tmp} ({'; '.join(failures)}); "
                              f"it needs about {need / 2**30:.2f} GiB, {shutil.disk_usage(root).free / 2**30:.2f} GiB "
                              "are free. The partial checkpoint was removed; the earlier ones are intact")
    if rank == 0:
        if injected("kill_before_rename") == str(state.step):  # (gapo.faults: the crash tests)
            os.kill(os.getpid(), 9)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_atomic(root / rundir.LATEST, name)
        _prune(root, cfg.trainer.keep_last, cfg.trainer.keep_steps, cfg.trainer.keep_every)
    dist.barrier()
    return final


def _export_state_dict(actor, rank: int) -> dict[str, Tensor]:
    """The policy's full weights under the Hugging Face names, for hf/ (rank 0's; collective under ZeRO-3). With
    LoRA they are the merged weights the rollout engine gets (Actor.gathered_weights), so gapo-eval and vLLM load hf/ as
    a plain model."""
    if actor.cfg.model.lora is not None:
        keep = set(actor.pushed_names(unique=True))  # a tied weight once, as without LoRA
        merged = {name: t.detach().cpu().clone() for name, t in actor.gathered_weights() if name in keep}
        return merged if rank == 0 else {}
    # Collective under ZeRO-3 (full tensors on rank 0 only); keys lose the Policy wrapper's "lm." prefix.
    full = actor.deepspeed._zero3_consolidated_16bit_state_dict() if actor.zero_stage == 3 \
        else actor.deepspeed.module.state_dict()
    return {k.removeprefix("lm."): v for k, v in (full or {}).items()}


def _fill(root: Path) -> None:
    """Fault injection: takes all but 4 KiB of the filesystem's free space (only a small one's, such as the tmpfs
    of the disk tests), as another job writing there would."""
    free = shutil.disk_usage(root).free
    if free > 2**30:
        raise RuntimeError(f"GAPO_FAULT=fill fills only a small filesystem; {root} has {free / 2**30:.1f} GiB free")
    fd = os.open(root / ".ballast", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.posix_fallocate(fd, 0, max(free - 4096, 1))
    finally:
        os.close(fd)


def _expected_bytes(root: Path, actor, weights_only: bool) -> int:
    """The newest complete checkpoint's size when it is of the same kind (whole or weights only), else an estimate:
    the 16/32-bit export, plus for a whole one the DeepSpeed state (weights, fp32 master and Adam moments: 16 bytes a
    parameter in bf16, 12 in fp32; with LoRA the adapters' only)."""
    done = rundir.checkpoints(root.parent)
    if done:
        newest = done[max(done)]
        if (newest / "ds").is_dir() != weights_only:
            return sum(p.stat().st_size for p in newest.rglob("*") if p.is_file())
    return _estimate(actor, weights_only)


def whole_over_weights(actor) -> float:
    """How many times a whole checkpoint's bytes a weights-only one's are (estimated): under trainer.save_only_model
    the saves a run times are weights-only, a preemption's is whole, and its deadline must expect that one."""
    return _estimate(actor, weights_only=False) / _estimate(actor, weights_only=True)


def _estimate(actor, weights_only: bool) -> int:
    params = sum(getattr(p, "ds_numel", p.numel()) for p in actor.module.parameters())
    trained = 0 if weights_only else sum(getattr(p, "ds_numel", p.numel()) for p in actor.module.parameters()
                                         if p.requires_grad)
    bf16 = actor.cfg.model.dtype == "bfloat16"
    return trained * (2 + 4 + 4 + 4 if bf16 else 4 + 4 + 4) + params * (2 if bf16 else 4)


def _room_for(root: Path, need: int, stopped: str = "the run stopped before writing, the earlier checkpoints are "
                                                     "intact") -> str | None:
    free = shutil.disk_usage(root).free
    if free < 1.1 * need:
        return (f"no room for a checkpoint in {root}: it needs about {need / 2**30:.2f} GiB (+10 %), "
                f"{free / 2**30:.2f} GiB are free. Free space, lower trainer.keep_last, or move trainer.output_dir; "
                f"{stopped}")
    return None


def check_room(actor, run_dir: Path) -> None:
    """Collective, once the actor is built: a disk that cannot hold the run's next checkpoint stops it now rather than
    at its first save, which for a run that saves only at its end (a sweep's) would lose every step it trained."""
    root = run_dir / rundir.CHECKPOINTS
    failure = None
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        # whole even under trainer.save_only_model: a preemption's checkpoint is
        failure = _room_for(root, _expected_bytes(root, actor, weights_only=False), "the run stopped before training")
    if (failure := gather(failure)[0]) is not None:
        raise CheckpointError(failure)


def _abandon(tmp: Path, rank: int) -> None:
    """Collective: the partial checkpoint goes (rank 0 removes it once every rank has stopped writing)."""
    dist.barrier()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()


def manifest(ckpt: Path) -> dict[str, dict[str, int]]:
    """Every file of a checkpoint (but the manifest) with its size and CRC-32 (zlib's: about 1 GB/s)."""
    out = {}
    for path in sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != rundir.MANIFEST):
        crc = 0
        with open(path, "rb") as f:
            while block := f.read(1 << 24):
                crc = zlib.crc32(block, crc)
        out[str(path.relative_to(ckpt))] = {"bytes": path.stat().st_size, "crc32": crc}
    return out


def verify(ckpt: Path) -> None:
    """A checkpoint is whole: every file its manifest lists is there, of its size and checksum. Names the file
    and the checkpoint otherwise (a node that died mid-copy, half an rsync). Checkpoints written before the
    manifest existed are taken as they are, with a warning."""
    listed = ckpt / rundir.MANIFEST
    if not listed.is_file():
        try:
            manifested = json.loads((ckpt / rundir.STATE).read_text()).get("manifested", False)
        except (OSError, ValueError) as err:
            raise ConfigError(f"checkpoint {ckpt}: no {rundir.MANIFEST}, and cannot read {rundir.STATE} ({err}); the "
                              "checkpoint is incomplete or damaged") from None
        if manifested:
            raise ConfigError(f"checkpoint {ckpt}: {rundir.MANIFEST} is missing; the checkpoint is incomplete or "
                              "damaged")
        log.warning("checkpoint %s has no %s (written by an earlier gapo): not verified", ckpt, rundir.MANIFEST)
        return
    try:
        want = json.loads(listed.read_text())
        if not isinstance(want, dict):
            raise ValueError(f"expected a mapping of files, got {type(want).__name__}")
    except (OSError, ValueError) as err:  # written last, by rename: a damaged one is a damaged checkpoint
        raise ConfigError(f"checkpoint {ckpt}: cannot read its {rundir.MANIFEST} ({err}); the checkpoint is "
                          "incomplete or damaged") from None
    got = manifest(ckpt)
    for rel, meta in want.items():
        have = got.get(rel)
        if have is None:
            raise ConfigError(f"checkpoint {ckpt}: {rel} is missing; the checkpoint is incomplete or damaged")
        if have["bytes"] != meta["bytes"]:
            raise ConfigError(f"checkpoint {ckpt}: {rel} is truncated or padded ({have['bytes']} bytes, the manifest "
                              f"says {meta['bytes']}); the checkpoint is incomplete or damaged")
        if have["crc32"] != meta["crc32"]:
            raise ConfigError(f"checkpoint {ckpt}: {rel} is corrupt (its checksum differs from the manifest's)")


def newest_valid(run_dir: Path) -> Path | None:
    """`--resume auto`: the newest checkpoint of the run that verifies and can be resumed, falling back past damaged
    and weights-only ones (each said with a warning: a requeued trainer.save_only_model run goes on from its last
    preemption's whole checkpoint); None when there is none (a fresh start)."""
    for step, ckpt in sorted(rundir.checkpoints(run_dir).items(), reverse=True):
        try:
            verify(ckpt)
        except ConfigError as err:
            log.warning("--resume auto: skipping step %d: %s", step, err)
            continue
        if json.loads((ckpt / rundir.STATE).read_text()).get("weights_only"):
            log.warning("--resume auto: skipping step %d: it holds only the policy's weights "
                        "(trainer.save_only_model)", step)
            continue
        return ckpt
    return None


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
    seen = gather((run_dir / probe).is_file())  # collective: every rank has looked once it returns
    if rank == 0:
        (run_dir / probe).unlink(missing_ok=True)
    dist.barrier()  # and the probe is gone on every rank's return, whatever it lists next
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
        saved = resolve(read_yaml((ckpt / rundir.CONFIG).read_text()))
    except (OSError, ValueError, TypeError) as err:
        raise ConfigError(f"checkpoint {ckpt}: cannot read trainer.json / config.yaml ({err})") from None
    if state.weights_only:
        raise ConfigError(f"checkpoint {ckpt} holds only the policy's weights (written with trainer.save_only_model="
                          f"true): it cannot be resumed. gapo-eval evaluates it; model.path={ckpt / 'hf'} starts a new "
                          "run from its weights")
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
    bad = [k for k in changed if not k.startswith(rundir.MAY_CHANGE)]
    if bad:
        detail = ", ".join(f"{k}: {a[k]!r} -> {b[k]!r}" for k in bad)
        may = ", ".join(f"{k}*" if k.endswith(".") else k for k in rundir.MAY_CHANGE)
        raise ConfigError(f"cannot resume with a different {detail}; only these may change: {may}")
    if world != state.world_size:
        log.warning("checkpoint was written by %d ranks, this run has %d: its ZeRO shards are re-cut through "
                    "DeepSpeed's universal checkpoint (docs/REFERENCE.md, 'Resuming on another number of GPUs')",
                    state.world_size, world)
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
    auto = cfg.trainer.resume_from == rundir.AUTO
    if auto:
        ckpt = rank0_decides(lambda: newest_valid(run_dir), rank)
        if ckpt is None and rundir.checkpoints(run_dir):
            raise ConfigError(f"--resume auto: {run_dir} holds checkpoints but none of them verifies and holds more "
                              "than weights (see the warnings above); resume one by name, or move the run away to "
                              "start over")
        if rank == 0:
            log.info("--resume auto: %s", f"going on from {ckpt}" if ckpt else
                     f"no checkpoint in {run_dir}: a fresh start")
    elif cfg.trainer.resume_from:
        ckpt = rundir.find(cfg.trainer.resume_from)
        rank0_decides(lambda: verify(ckpt), rank)
    if ckpt is not None:
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
    if auto and state is None and (run_dir / rundir.METRICS).exists():  # died before its first checkpoint
        log.warning("--resume auto: %s has no checkpoint; its %s and %s are started over", run_dir, rundir.METRICS,
                    rundir.ROLLOUTS)
        if rank == 0:
            (run_dir / rundir.METRICS).unlink()
            (run_dir / rundir.ROLLOUTS).unlink(missing_ok=True)  # appended to: its old lines would repeat steps
    elif state is None or branched:
        rundir.refuse_taken(run_dir)
    return Start(run_dir, ckpt, state, parent, branched)


def load(actor, ckpt: Path, saved_world: int, run_dir: Path) -> None:
    """Collective. Restores the DeepSpeed state (model, optimizer, scheduler) and this rank's RNG states. A checkpoint
    written by another number of ranks is re-cut first (reshard); rank r then takes rank r mod N's RNG states."""
    rank, world = dist.get_rank(), dist.get_world_size()
    lora = actor.cfg.model.lora is not None
    if saved_world == world:
        # A LoRA checkpoint holds the adapters only (save: exclude_frozen_parameters); the frozen base weights
        # are already in place, loaded from model.path, so the module's state is loaded non-strictly.
        path, _ = actor.deepspeed.load_checkpoint(str(ckpt / "ds"), tag="state", load_optimizer_states=True,
                                              load_lr_scheduler_states=True, load_module_strict=not lora)
        if path is None:
            raise ConfigError(f"checkpoint {ckpt}: DeepSpeed could not load {ckpt / 'ds'}")
    elif lora:
        raise ConfigError(f"checkpoint {ckpt}: a LoRA checkpoint written by {saved_world} ranks cannot be resumed on "
                          f"{world} (re-cutting adapter-only checkpoints is not built); resume it with "
                          f"--nproc {saved_world}")
    else:
        reshard(actor, ckpt, saved_world, read(ckpt)[1].zero_stage(saved_world), run_dir / RESHARD)
    rng_file = ckpt / f"rng_rank{rank % saved_world}.pt"
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
