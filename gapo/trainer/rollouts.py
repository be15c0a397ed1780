"""A rank's rollouts, step by step, whatever the placement: the loop asks for a step's rollouts, and the queue draws
its prompts, has them sampled (by the rank's own engine, or by its generator: gapo/rollout/split.py) and keeps what
was requested ahead of the step, for the steps and for a checkpoint."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gapo.config import Config
from gapo.data import Sampler
from gapo.errors import ConfigError
from gapo.rollout.engine import Engine
from gapo.rollout.split import RemoteEngine
from gapo.rollout.types import Rollout, SamplingConfig
from gapo.trainer import checkpoint


def request_seed(seed: int, step: int, prompt_index: int) -> int:
    """One sampling seed per (run seed, step, prompt of the step): unique across ranks, repeatable on resume."""
    return int(np.random.SeedSequence([seed, step, prompt_index]).generate_state(1)[0] & 0x7FFFFFFF)


@dataclass
class Request:
    """One step's prompts on this rank, drawn when its rollouts are requested: at the step itself, or up to
    rollout.max_staleness steps ahead (split placement). `groups` is filled when the rollouts are collected; a
    checkpoint keeps the requests ahead of it with their rollouts, so that a resumed run trains on the very same."""

    problems: list[int]  # indices into the training set, one per group
    seeds: list[int]
    groups: list[list[Rollout]] | None = None
    wait_s: float = 0.0  # the trainer's time blocked on them
    generator_s: float = math.nan  # the generator's time sampling them, and idle before it (split)
    generator_idle_s: float = math.nan


def load_in_flight(ckpt: Path, rank: int, max_staleness: int) -> dict[int, Request]:
    """The requests a checkpoint holds of the steps after it, with their rollouts; refused when they were sampled
    with another rollout.max_staleness than `max_staleness` (the resumed run would train on other versions)."""
    in_flight: dict[int, Request] = torch.load(ckpt / checkpoint.in_flight_name(rank), weights_only=False)
    lags = {n - 1 - x.version for n, req in in_flight.items() for g in req.groups for x in g}
    if any(x.version != max(n - 1 - max_staleness, 0) for n, req in in_flight.items() for g in req.groups for x in g):
        raise ConfigError(f"{ckpt} holds rollouts sampled ahead with rollout.max_staleness={max(lags)}: resume it "
                          f"with that value, not {max_staleness}")
    return in_flight


class RolloutQueue:
    """This rank's requests by step. `take(step)` requests the steps up to rollout.max_staleness ahead that are not
    yet (drawing their prompts: the same global draw on every rank, each takes its contiguous shard) and returns the
    step's, with its rollouts: sampled now by a colocated engine, or waited for from the generator, which has had
    every request since it was made and answers in request order."""

    def __init__(self, engine: Engine, sampler: Sampler, prompt_ids: list[list[int]], sampling: SamplingConfig,
                 cfg: Config, rank: int, world: int, in_flight: dict[int, Request]):
        t, r = cfg.trainer, cfg.rollout
        self.engine, self.sampler, self.prompt_ids, self.sampling = engine, sampler, prompt_ids, sampling
        self.remote = engine if isinstance(engine, RemoteEngine) else None
        prompts = cfg.shape(world).prompts
        self.mine = range(rank * prompts, (rank + 1) * prompts)
        self.per_step, self.seed = r.prompts_per_step, t.seed
        self.staleness, self.last_step = r.max_staleness, t.total_steps
        self.sleep = r.sleep_between_steps  # (vLLM only, colocated only: the config refuses the others)
        self.requests = dict(in_flight)

    def requested(self, step: int) -> list[int]:
        """The steps from `step` on whose rollouts are requested already."""
        return sorted(n for n in self.requests if n >= step)

    def take(self, step: int) -> Request:
        for n in [n for n in self.requests if n < step]:
            del self.requests[n]
        for n in range(step, min(step + self.staleness, self.last_step) + 1):
            if n not in self.requests:
                self.requests[n] = self._request(n)
        req = self._collect(step)
        if self.sleep:
            self.engine.sleep()
        return req

    def ahead(self, step: int, steps: list[int] | None = None) -> dict[int, Request]:
        """The requests of `steps` (default: every step after `step`) with their rollouts, collected now in request
        order, for a checkpoint of `step`."""
        steps = sorted(n for n in self.requests if n > step) if steps is None else steps
        return {n: self._collect(n) for n in steps}

    def close(self, why: str) -> None:
        """The run ends (`why`: done | failed | preempted); a generator stops with it."""
        if self.remote:
            self.remote.close(why)

    def _request(self, step: int) -> Request:
        drawn = self.sampler.next(self.per_step)
        req = Request([drawn[j] for j in self.mine], [request_seed(self.seed, step, j) for j in self.mine])
        if self.remote:
            self.remote.submit(self._prompts(req), self.sampling, req.seeds)
        return req

    def _collect(self, step: int) -> Request:
        req = self.requests[step]
        if req.groups is not None:
            return req
        tic = time.perf_counter()
        if self.remote:
            served = self.remote.collect()
            req.groups, req.generator_s, req.generator_idle_s = served.groups, served.generate_s, served.idle_s
        else:
            req.groups = self.engine.generate(self._prompts(req), self.sampling, seeds=req.seeds)
        req.wait_s = time.perf_counter() - tic
        return req

    def _prompts(self, req: Request) -> list[list[int]]:
        return [self.prompt_ids[i] for i in req.problems]
