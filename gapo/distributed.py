"""Process-group plumbing: what training, gapo-eval, the benches and the distributed tests all set up the
same way; where this process sits in the job (Placement); what all ranks agree on. torch is imported on use:
gapo-train's launcher process (free_port, then torchrun) never loads it."""

from __future__ import annotations

import importlib
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from gapo.errors import ConfigError


def free_port() -> int:
    """A TCP port nothing listens on now, for a rendezvous on this machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


THREADS_WHY = "GAPO_THREADS_WHY"  # how share_cores chose OMP_NUM_THREADS, for the run header


def share_cores(local_ranks: int) -> None:
    """Give each of this node's `local_ranks` ranks its share of the cores as OMP_NUM_THREADS, unless the user set it.

    Why: vLLM freezes torch's thread count when it is built in-process, at 1 unless OMP_NUM_THREADS says otherwise,
    and torchrun hands every rank OMP_NUM_THREADS=1; the trainer shares that count, so an offloaded optimizer step
    would run on one core of a node that has 8-16 per GPU (docs/PERFORMANCE.md §12). The cores are this process's
    (its CPU affinity), or SLURM_CPUS_PER_TASK where that is fewer (a job step without CPU binding sees the node)."""
    if "OMP_NUM_THREADS" in os.environ:
        os.environ.setdefault(THREADS_WHY, "OMP_NUM_THREADS set by the user")
        return
    cores, where = len(os.sched_getaffinity(0)), "cores"
    slurm = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if slurm.isdigit() and 0 < int(slurm) < cores:
        cores, where = int(slurm), "SLURM_CPUS_PER_TASK"
    os.environ["OMP_NUM_THREADS"] = str(max(1, cores // local_ranks))
    os.environ[THREADS_WHY] = f"{cores} {where} / {local_ranks} local rank{'s' if local_ranks > 1 else ''}"


@dataclass(frozen=True)
class Placement:
    """Where this process sits in the job, as init_distributed set it up.

    Colocated: one world, every rank trains and samples (generators 0). Split (rollout.placement: split): the job's
    first `trainers` ranks train in a world of their own, its last `generators` ranks sample in another, and the
    job's store is where a bridge between the two meets (gapo.rollout.transport). Trainer t is served by generator
    trainers + t % generators."""

    rank: int  # in this process's own world
    world: int
    global_rank: int  # in the whole job
    trainers: int
    generators: int = 0
    store: Any = None  # torch.distributed.Store, split only: the rendezvous both worlds used
    timeout: timedelta = timedelta(minutes=60)

    @property
    def is_generator(self) -> bool:
        return self.global_rank >= self.trainers

    def generator_of(self, trainer: int) -> int:
        return self.trainers + trainer % self.generators

    def trainers_of(self, generator: int) -> list[int]:
        return [t for t in range(self.trainers) if self.generator_of(t) == generator]


def init_distributed(timeout_min: float = 60.0, generators: int = 0) -> Placement:
    """torchrun sets RANK/WORLD_SIZE/MASTER_*; a plain `gapo-train` is a world of one on a free port.

    `timeout_min` bounds every collective (trainer.collective_timeout_min): ranks wait in one while another still
    generates, scores, evaluates or saves, and DeepSpeed's default (10 minutes) is shorter than a long-context
    step; past it NCCL's watchdog ends the job.

    With `generators` > 0 (split placement) the job's last `generators` ranks form a world of their own, as do the
    others; the placement's rank and world are those of this process's own world, and RANK/WORLD_SIZE are rewritten
    to match, since DeepSpeed and vLLM's external launcher read them."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    import deepspeed
    import torch

    if torch.cuda.is_available():
        # Before anything touches a GPU: DeepSpeed binds the NCCL group to cuda:LOCAL_RANK, but an object collective
        # (all_gather_object, the first one a run makes) stages its tensor on the *current* device, cuda:0 unless
        # set, and NCCL refuses a tensor on another device than the group's: ranks 1.. would fail at their first
        # collective. One GPU cannot show it (GPU only; unverified here, bench/gpu/check.sh's 2-GPU row).
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        # DeepSpeed JIT-compiles a shared-memory all-reduce for CPU *inference* on every fresh machine (~66 s);
        # training never uses it, and without it DeepSpeed falls back to torch.distributed.
        # (importlib: the attribute deepspeed.comm.torch is the torch module, re-exported.)
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None

    timeout = timedelta(minutes=timeout_min)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    placement = Placement(rank, world, rank, world, timeout=timeout)
    if generators:
        placement = _init_split(rank, world, generators, timeout, "nccl" if torch.cuda.is_available() else "gloo")
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo", timeout=timeout)
    return placement


def _init_split(rank: int, world: int, generators: int, timeout: timedelta, backend: str) -> Placement:
    """Two worlds on torchrun's own store (TCPStore at MASTER_ADDR:MASTER_PORT, held by its agent): each world's keys
    under a prefix of its own, so that both can have a rank 0."""
    import torch.distributed as dist

    trainers = world - generators
    if trainers < generators:
        raise ValueError(f"rollout.generator_ranks={generators} of {world} ranks leaves {trainers} training ranks; "
                         "each generator needs at least one (set it to at most half the ranks)")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    generator = rank >= trainers
    own_rank, own_world = (rank - trainers, generators) if generator else (rank, trainers)
    dist.init_process_group(backend, store=dist.PrefixStore("gapo-generators/" if generator else "gapo-trainers/",
                                                            store), rank=own_rank, world_size=own_world,
                            timeout=timeout)
    os.environ.update(RANK=str(own_rank), WORLD_SIZE=str(own_world), GAPO_GLOBAL_RANK=str(rank))
    return Placement(own_rank, own_world, rank, trainers, generators, store, timeout)


_AT_LEAVE: list[Callable[[], None]] = []


def at_leave(close: Callable[[], None]) -> None:
    """Run `close` in leave_distributed(), after the final barrier and before the group is destroyed: an in-process
    vLLM engine's shutdown destroys its own groups and then the world group; run later (its finaliser at interpreter
    exit), it would meet destroyed groups and print "Invalid process group specified" tracebacks at the end of a
    successful multi-rank run."""
    _AT_LEAVE.append(close)


def leave_early(close: Callable[[], None]) -> None:
    """Run an at_leave `close` now and drop it from the list, for a process that frees an engine and goes on
    (bench/gpu/check.py, before it starts gapo-train on the same GPU): the list's reference alone keeps a vLLM
    engine and its GPU memory alive until the process leaves."""
    try:
        _AT_LEAVE.remove(close)
    except ValueError:
        raise ValueError(f"leave_early: {close!r} is not registered with at_leave (run already?)") from None
    close()


def leave_distributed() -> None:
    """The end of a run that went well: wait for every rank, then take the process group down.

    Left to interpreter exit, gloo's worker threads can be destroyed while still joinable, and the rank aborts
    with "terminate called without an active exception" (exit -6) after its work is done; NCCL likewise asks for an
    explicit destroy on a normal exit. A garbage collection comes first: a rank still aborted after its work in 5 of
    48 runs of tests/dist/dist_share_check.py without it, 0 of 48 with it (most likely what a DeepSpeed engine in a
    reference cycle holds of the group, freed only at interpreter teardown). Called where a process ends, never
    inside train(): a caller that goes on in the same process (bench/gpu/check.py) would meet DeepSpeed's cached
    handles to the destroyed groups. Runs that fail take no part: a peer may be gone, and the barrier would wait
    for it."""
    import gc

    import torch.distributed as dist

    if dist.is_initialized():
        gc.collect()
        dist.barrier()
        while _AT_LEAVE:
            _AT_LEAVE.pop()()
        if dist.is_initialized():  # (a vLLM engine's shutdown has destroyed it already)
            dist.destroy_process_group()


def gather(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank (collective)."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def rank0_decides(work, rank: int):
    """`work()` done once, by rank 0 (reading and checksumming a checkpoint), its result or its ConfigError shared
    with every rank, so that all ranks go on, or stop, together. Without a process group, done here."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return work()
    result, error = None, None
    if rank == 0:
        try:
            result = work()
        except ConfigError as err:
            error = str(err)
    result, error = gather((result, error))[0]
    if error:
        raise ConfigError(error)
    return result


def agree(values: list, device, op: str = "max") -> list:
    """Every rank's `values` reduced element-wise (max or min), the same list on every rank: what all ranks go on
    with when each counted or decided something alone (collective; without a group of several ranks, `values`)."""
    import torch
    import torch.distributed as dist

    if op not in ("max", "min"):
        raise ValueError(f"agree: op must be max or min, not {op!r}")
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return list(values)
    dtype = torch.float64 if any(isinstance(v, float) for v in values) else torch.int64
    t = torch.tensor(values, dtype=dtype, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN)
    return t.tolist()
