"""The training loop, top to bottom.

    sample prompts -> generate k rollouts each -> score -> group advantages -> old log-probs
    -> clipped updates (mini-batches x epochs) -> push weights into the engine -> metrics

Every training rank runs this same loop on its own shard of the step's prompts (groups never straddle ranks);
its rollouts come through a RolloutQueue (gapo/trainer/rollouts.py), from its own engine or from a split job's
generator rank. DeepSpeed averages gradients, and per-rollout statistics are gathered so that every metric is
computed exactly over the whole step.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import signal
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from tqdm import tqdm

from gapo import console, rundir
from gapo.algorithms import StepNorm
from gapo.config import Config
from gapo.data import Problem, Sampler, stop_token_ids
from gapo.distributed import Placement, gather, init_distributed
from gapo.errors import ConfigError
from gapo.evaluation import Bench, context_length, evaluate, load_benchmark, summary, write_results
from gapo.faults import injected
from gapo.memory import plan_text
from gapo.models import check_context_budget, resolve_model
from gapo.proc import stat_fields
from gapo.reward.registry import check_rewards, score_groups, training_set
from gapo.rollout import split
from gapo.rollout.engine import Engine, build_engine
from gapo.rollout.transport import PeerGone, Transport, transport_named
from gapo.rollout.types import SamplingConfig
from gapo.tracking import Tracker
from gapo.trainer import checkpoint, preempt, sync
from gapo.trainer.actor import Actor
from gapo.trainer.batch import StepBatch
from gapo.trainer.logprobs import MicroBatch, pack_step
from gapo.trainer.losses import (
    RolloutStats,
    clip_high,
    kl_penalty,
    policy_loss,
    rollout_weights,
)
from gapo.trainer.preempt import Preempted
from gapo.trainer.rollouts import Request, RolloutQueue, load_in_flight
from gapo.trainer.step_metrics import OldLogprobs, RankStep, Updates, mismatch_stats, step_metrics

log = logging.getLogger("gapo.train")


class TrainingDiverged(RuntimeError):
    """Too many optimizer steps in a row had a non-finite gradient: the run stops instead of idling."""


def process_age() -> float:
    """Seconds since this process started (Linux: /proc), for the first step's time/startup_s: imports, model,
    data, vLLM's compile and the actor, the wait before a run does anything."""
    ticks = int(stat_fields()[19])  # starttime, in clock ticks after boot
    with open("/proc/stat") as f:
        boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    return time.time() - (boot + ticks / os.sysconf("SC_CLK_TCK"))


@dataclass
class Setup:
    """What the step loop works with, built once before its first step (or restored from a checkpoint)."""

    cfg: Config  # as it runs: trainer.output_dir is the run's directory (a branch's own, when it branches)
    run_dir: Path
    first_step: int
    parent: dict | None  # the run this one branched from
    tokenizer: Any
    pad_id: int  # what pads a micro-batch: the tokenizer's pad token, else its end of sequence
    problems: list[Problem]
    prompt_ids: list[list[int]]
    sampler: Sampler
    benches: list[Bench]  # validation's benchmarks, each scored in full (as gapo-eval scores it)
    engine: Engine
    actor: Actor
    probe: sync.Probe  # what a verified push samples and scores (rollout.verify_push)
    tracker: Tracker | None  # rank 0 only
    wandb_id: str | None
    loaded: Path | None  # the checkpoint it went on from (its run's step-0 validation is logged already)
    rollouts: RolloutQueue  # this rank's requests by step, with those the checkpoint held of the steps after it


def engine_of(cfg: Config, model_dir: str, max_model_len: int, seed: int) -> Engine:
    r = cfg.rollout
    return build_engine(r.engine, model_dir, dtype=cfg.model.dtype, seed=seed, max_model_len=max_model_len,
                        gpu_memory_utilization=r.gpu_memory_utilization, kv_cache_gb=r.kv_cache_gb,
                        sleep_mode=r.sleep_between_steps, compile=r.compile)


def setup(cfg: Config, rank: int, world: int, remote: split.RemoteEngine | None) -> Setup:
    """Resume or branch, memory plan, model, data, engine (`remote`: a split job's generator), actor and tracker, in
    this order (the engine reseeds the global RNGs when it is built, so the order is part of a run's determinism)."""
    # Resume / branch (may name another run directory): decided before anything is built.
    start = checkpoint.resume_or_branch(cfg, world, rank)
    run_dir = start.run_dir
    cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"output_dir": str(run_dir)})})
    t, r, d, ev = cfg.trainer, cfg.rollout, cfg.data, cfg.eval
    console.attach(run_dir)  # before the engine starts, so that its processes write to this run's train.log
    if rank == 0:
        console.say(console.run_header(cfg, run_dir, world, torch.get_num_threads()))
        if t.resume_from == rundir.AUTO:
            found = f"from {start.ckpt} (step {start.state.step})" if start.ckpt else "no checkpoint yet, a fresh start"
            console.say(f"resume     auto: {found}")
    # Memory plan: from config.json alone, so a run that cannot fit stops before anything loads (or downloads); again
    # below where validation's benchmarks need a longer engine context than the training data.
    check_plan(cfg, world, rank, None)
    checkpoint.check_shared_filesystem(run_dir)

    # Model and data. Every rank resolves: a file lock in gapo.models lets one process per filesystem build or
    # download while the others wait on it, with no barrier that a long download could time out.
    model_dir = str(resolve_model(cfg.model.path))
    positions = check_context_budget(cfg, cfg.model.path)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    problems, prompt_ids, benches = load_data(cfg, tokenizer, rank)
    sampler = Sampler(len(problems), seed=t.seed)

    # Engine (after init_distributed: vLLM joins the world group), then the actor. Split: the generator ranks build
    # theirs (serve_rollouts) once this rank's leader has told them the run's directory, while the actor loads here.
    budget = d.max_prompt_tokens + max(r.max_new_tokens, ev.max_new_tokens)
    max_model_len = max(budget, context_length(benches, tokenizer, ev.instruction, ev.max_new_tokens, positions))
    if max_model_len > budget:
        check_plan(cfg, world, rank, max_model_len)  # a benchmark's longest prompt sets the engine's context
    if remote is not None:  # its generator builds the engine meanwhile (and is stopped with this rank, if it fails)
        remote.hello(model_dir, str(run_dir), max_model_len)
    resharding = start.state is not None and start.state.world_size != world
    in_flight = rollouts_ahead(start, cfg, rank, resharding)
    engine = remote if remote is not None else engine_of(cfg, model_dir, max_model_len, seed=t.seed + rank)
    actor = Actor(cfg, model_dir, load_universal=resharding)
    checkpoint.check_room(actor, run_dir)  # before any step is spent that a full disk would lose
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    probe = sync.Probe.of(tokenizer, cfg, pad_id)
    if start.ckpt is not None:  # model, optimizer, scheduler, this rank's RNG states
        checkpoint.load(actor, start.ckpt, start.state.world_size, run_dir)
        sampler.load_state_dict(start.state.sampler)
        sync.push(engine, actor, start.state.step, probe if r.verify_push != "off" else None)

    tracker = start_tracker(cfg, start, rank)
    wandb_id = gather(tracker.wandb_id if tracker else None)[0]
    sampling = SamplingConfig(n=r.group_size, temperature=r.temperature, top_p=r.top_p,
                              max_new_tokens=r.max_new_tokens, stop_token_ids=stop_token_ids(tokenizer))
    rollouts = RolloutQueue(engine, sampler, prompt_ids, sampling, cfg, rank, world, in_flight)
    return Setup(cfg=cfg, run_dir=run_dir, first_step=start.state.step + 1 if start.state else 1, parent=start.parent,
                 tokenizer=tokenizer, pad_id=pad_id, problems=problems, prompt_ids=prompt_ids, sampler=sampler,
                 benches=benches, engine=engine, actor=actor, probe=probe, tracker=tracker, wandb_id=wandb_id,
                 loaded=start.ckpt, rollouts=rollouts)


def check_plan(cfg: Config, world: int, rank: int, max_model_len: int | None) -> None:
    """The memory plan, written to the run directory; on a GPU too small for it, a ConfigError naming what to set."""
    device_gb = (torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30
                 if torch.cuda.is_available() else None)
    plan, fits = plan_text(cfg, world, device_gb, max_model_len)
    if device_gb and not fits and cfg.trainer.check_memory:  # GPU only; unverified here
        engine = ("" if cfg.rollout.placement == "split"
                  else ", lower rollout.gpu_memory_utilization or turn on rollout.sleep_between_steps")
        raise ConfigError(f"{plan}\nThe run does not fit this GPU: set trainer.max_tokens_per_micro_batch"
                          f"{engine} (or start anyway with trainer.check_memory=false: the plan is an estimate)")
    if rank == 0:
        run_dir = Path(cfg.trainer.output_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / rundir.MEMORY_PLAN).write_text(plan + "\n")
        if device_gb:
            log.info("%s", plan)


def load_data(cfg: Config, tokenizer, rank: int) -> tuple[list[Problem], list[list[int]], list[Bench]]:
    """The training problems and their prompts, and validation's benchmarks; rank 0 lists the records left out."""
    problems, prompt_ids, dropped = training_set(cfg.data, tokenizer)
    benches = [load_benchmark(spec, cfg.eval.limit, cfg.data) for spec in cfg.eval.benchmarks]
    dropped += [x for b in benches for x in b.dropped]
    if rank == 0 and dropped:
        run_dir = Path(cfg.trainer.output_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(run_dir / rundir.DROPPED, "w") as f:
            f.writelines(json.dumps(asdict(x)) + "\n" for x in dropped)
        console.say(f"dropped    {len(dropped)} records before training: {run_dir / rundir.DROPPED}")
    return problems, prompt_ids, benches


def rollouts_ahead(start: checkpoint.Start, cfg: Config, rank: int, resharding: bool) -> dict[int, Request]:
    """Rollouts the checkpoint holds, sampled ahead of it: only the same placement, ranks and staleness train on
    them. Checked before this rank's engine and actor load, so that a wrong resume fails in seconds."""
    if start.state is None or not start.state.in_flight:
        return {}
    if resharding or cfg.rollout.placement != "split":
        raise ConfigError(f"{start.ckpt} holds the rollouts of steps {start.state.in_flight}, sampled ahead "
                          f"(rollout.max_staleness) on {start.state.world_size} training ranks: resume it with "
                          "rollout.placement=split on as many training ranks")
    return load_in_flight(start.ckpt, rank, cfg.rollout.max_staleness)


def start_tracker(cfg: Config, start: checkpoint.Start, rank: int) -> Tracker | None:
    """Rank 0's: the same wandb run (and the log cut back to the checkpoint) when the run goes on; a new one, linking
    its parent, when it branches or starts."""
    if rank != 0:
        return None
    going_on = start.state is not None and not start.branched
    if going_on:
        checkpoint.truncate_metrics(start.run_dir, start.state.step)
    return Tracker(cfg, start.run_dir, wandb_id=start.state.wandb_id if going_on else None, parent=start.parent)


def train(cfg: Config) -> Path | None:
    preempt.install()  # SIGTERM / SIGUSR1: stop at the next safe point, save, exit PREEMPTED
    placement = init_distributed(cfg.trainer.collective_timeout_min, cfg.rollout.generator_ranks)
    link = transport_named(cfg.rollout.transport)(placement) if placement.generators else None
    if placement.is_generator:
        serve_rollouts(cfg, placement, link)
        return None
    rank, world = placement.rank, placement.world
    cfg.shape(world)  # a batch that does not split on these ranks stops here, before anything loads
    random.seed(cfg.trainer.seed + rank)
    np.random.seed(cfg.trainer.seed + rank)
    torch.manual_seed(cfg.trainer.seed + rank)
    s = setup(cfg, rank, world, split.RemoteEngine(placement, link) if link else None)
    try:
        run_dir = steps(s, rank, world)
    except BaseException as err:  # a split job's generators stop with it, and say why
        try:
            s.rollouts.close("preempted" if isinstance(err, Preempted) else "failed")
        except PeerGone as gone:  # the generator is gone already: the original error is the news
            log.warning("could not tell the generator to stop: %s", gone)
        raise
    return run_dir


def serve_rollouts(cfg: Config, placement: Placement, link: Transport) -> None:
    """A generator rank (split placement): sample for the trainers until they stop."""
    why = split.serve(placement, link, lambda model_dir, max_model_len: engine_of(
        cfg, model_dir, max_model_len, seed=cfg.trainer.seed + placement.global_rank))
    if why == "preempted":
        raise Preempted(f"generator rank {placement.global_rank}: the trainers were preempted")
    if why == "failed":
        raise PeerGone(f"generator rank {placement.global_rank}: the trainers stopped after a failure (their "
                       "message says which)")


@dataclass
class Going:
    """What the step loop carries from one step to the next."""

    done_verifying: bool  # no more pushes to verify: never, or only the first (setup's, when it resumed)
    alarm: sync.MismatchAlarm
    loaded_here: bool  # its first step starts from this run's own checkpoint: abandoning that step saves nothing
    save_scale: float  # a preemption's save is whole: its time over a weights-only save's (trainer.save_only_model)
    skipped_in_a_row: int = 0
    last_rest_s: float = 0.0  # the previous step's time after scoring, and its checkpoint's: the deadline check
    last_save_s: float = 0.0
    val_history: list[tuple[int, dict | None]] = field(default_factory=list)  # rank 0's summaries

    @classmethod
    def of(cls, s: Setup) -> Going:
        r, run_dir = s.cfg.rollout, s.run_dir
        return cls(done_verifying=r.verify_push == "off" or (r.verify_push == "first" and s.loaded is not None),
                   alarm=sync.MismatchAlarm(r.mismatch_alarm.factor, r.mismatch_alarm.floor
                                            or sync.ALARM_FLOOR[s.cfg.model.dtype], r.mismatch_alarm.warmup),
                   loaded_here=s.loaded is not None and s.loaded.parent.resolve() == (
                       run_dir / rundir.CHECKPOINTS).resolve(),
                   save_scale=checkpoint.whole_over_weights(s.actor) if s.cfg.trainer.save_only_model else 1.0)


def steps(s: Setup, rank: int, world: int) -> Path:
    """The step loop, from the setup's first step to trainer.total_steps."""
    t, r = s.cfg.trainer, s.cfg.rollout
    go = Going.of(s)
    if s.benches and s.first_step == 1 and s.loaded is None:
        go.val_history.append((0, validate(s, 0, rank)))
    # Logged with the first step: process start to it (the step-0 validation included), and the branch's parent.
    first = {"time/startup_s": process_age(), **({"branch/parent_step": s.parent["step"]} if s.parent else {})}
    for step in tqdm(range(s.first_step, t.total_steps + 1), desc="steps", disable=rank != 0,
                     initial=s.first_step - 1, total=t.total_steps, file=console.terminal()):
        timings: dict[str, float] = {}
        step_tic = time.perf_counter()
        # This step redone on resume, if it is abandoned: the sampler, RNG and requests as the previous step left them.
        start = preempt.StepStart(step, s.sampler.state_dict(), checkpoint.rng_state(), s.rollouts.requested(step))
        if injected("signal") == str(step) and rank == 0:  # (gapo.faults: the preemption tests)
            os.kill(os.getpid(), signal.SIGTERM)
        # --- 1-2. prompts -> rollouts -> rewards, advantages, the rollouts the loss takes: the step's batch ---------
        req, batch = sample_and_score(s, step, timings)
        preempt.abandon_if_late(start, go.last_rest_s + go.last_save_s, t.preempt_deadline_s, s.actor.device,
                                s.sampler, None if step == s.first_step and go.loaded_here else
                                partial(save, s, world, preempted=True), s.run_dir / rundir.CHECKPOINTS)
        rest_tic = time.perf_counter()
        # --- 3-4. micro-batches and old log-probs, then the updates ------------------------------------------------
        minis, old, up = learn(s, batch, step, world, go, timings)
        # --- 5. weight push: gather (collective), stream into the engine, verify (gapo/trainer/sync.py) ------------
        pushed = sync.push(s.engine, s.actor, step, None if go.done_verifying else s.probe)
        go.done_verifying = go.done_verifying or r.verify_push == "first"
        timings["weight_push"], timings["push_verify"] = pushed.push_s, pushed.verify_s
        # --- 6. metrics over all ranks, validation ------------------------------------------------------------------
        metrics = log_step(s, step, rank, batch, old, up, minis, timings, req, pushed,
                           first if step == s.first_step else {}, step_tic)
        go.alarm.sound(step, metrics.get("logprob_mismatch/kl_k3", math.nan), r.mismatch_alarm.mode)
        if s.benches and ((t.eval_every and step % t.eval_every == 0) or step == t.total_steps):
            go.val_history.append((step, validate(s, step, rank)))
        # --- 7. checkpoint (collective), and a preemption's stop -----------------------------------------------------
        since = preempt.agreed(s.actor.device)
        go.last_rest_s = time.perf_counter() - rest_tic
        if (t.save_every and step % t.save_every == 0) or step == t.total_steps or since is not None:
            tic = time.perf_counter()
            save(s, world, step, preempted=since is not None)
            go.last_save_s = (time.perf_counter() - tic) * go.save_scale
        preempt.stop_if_signalled(since, step, t.total_steps, s.run_dir / rundir.CHECKPOINTS)
    finish(s, go)
    return s.run_dir


def sample_and_score(s: Setup, step: int, timings: dict[str, float]) -> tuple[Request, StepBatch]:
    """This step's rollouts (requested now, or up to rollout.max_staleness steps ago under split placement), scored,
    with their advantages and the rollouts the loss takes."""
    cfg, r = s.cfg, s.cfg.rollout
    req = s.rollouts.take(step)
    problems, groups = [s.problems[i] for i in req.problems], req.groups
    timings["generate"] = req.wait_s
    # Sampled with the weights of step n-1-max_staleness (the previous step's when synchronous), never others.
    version = max(step - 1 - r.max_staleness, 0)
    sync.check_versions(groups, expected=version, step=step)
    tic = time.perf_counter()
    results = score_groups(cfg.data.type, [[x.text for x in g] for g in groups], problems, cfg.reward)
    timings["reward"] = time.perf_counter() - tic
    batch = StepBatch.scored(step, version, problems, groups, results, cfg)
    check_rewards(batch.flat_results, cfg.reward.max_error_frac, step, s.actor.device)
    return req, batch


def learn(s: Setup, batch: StepBatch, step: int, world: int, go: Going, timings: dict[str, float]
          ) -> tuple[list[list[MicroBatch]], OldLogprobs, Updates]:
    """Micro-batches, their old log-probs (and entropy, the engine/trainer mismatch), then epochs x mini-batches of
    optimizer steps."""
    cfg, t = s.cfg, s.cfg.trainer
    shape = cfg.shape(world)
    # Sharing prompts needs the KV cache, which transformers drops under gradient checkpointing in training;
    # both passes over a micro-batch must take the same path (see actor._decode), so it is decided here.
    share_prompts = t.share_prompts and not cfg.model.gradient_checkpointing
    tic = time.perf_counter()
    minis = pack_step(batch.rollouts, batch.adv.adv, batch.adv.c, batch.adv.k, batch.keep, mini=shape.mini,
                      micro=shape.micro, max_tokens=t.max_tokens_per_micro_batch, pad_id=s.pad_id,
                      share_prompts=share_prompts, device=s.actor.device)
    old = old_logprobs(s.actor, [mb for mini in minis for mb in mini], cfg)
    timings["old_logprob"] = time.perf_counter() - tic
    tic = time.perf_counter()
    up = update(s.actor, minis, cfg, step, s.run_dir, go.skipped_in_a_row)
    go.skipped_in_a_row = up.skipped_in_a_row
    timings["train"] = time.perf_counter() - tic
    return minis, old, up


def log_step(s: Setup, step: int, rank: int, batch: StepBatch, old: OldLogprobs, up: Updates,
             minis: list[list[MicroBatch]], timings: dict[str, float], req: Request, pushed: sync.Verified,
             first: dict, step_tic: float) -> dict[str, float]:
    """The step's metrics gathered from every rank; rank 0 logs them (and the rollouts) and prints the step's line.
    `first`: the first step's startup keys; `step_tic`: when the step began."""
    cfg, t = s.cfg, s.cfg.trainer
    records = rollout_records(batch, rank, clip_high(batch.adv.c, batch.adv.k, cfg.algorithm), up.stats,
                              up.stat_rows, up.off_policy) if t.log_rollouts else None
    parts = gather(RankStep.of(batch, old, up, minis, timings, records))
    if rank != 0:
        return {}
    metrics = {**logged_metrics(parts, batch, cfg, up, s.actor.lr(), req, pushed), **first}
    # Everything the step cost on rank 0 (phases + packing, metric gathering), before validation/saving.
    metrics["time/step_wall_s"] = time.perf_counter() - step_tic
    s.tracker.log(step, metrics)
    if t.log_rollouts:
        s.tracker.log_rollouts([rec for p in parts for rec in p.records])
    console.say(console.step_line(step, t.total_steps, metrics))
    return metrics


def save(s: Setup, world: int, step: int, ahead: list[int] | None = None, preempted: bool = False) -> None:
    """Checkpoint `step` (collective); the requests of the steps after it (`ahead`, default all) go in with their
    rollouts. A preemption's checkpoint is whole under trainer.save_only_model too: the requeued job resumes it."""
    weights_only = s.cfg.trainer.save_only_model and not preempted
    in_flight = {} if weights_only else s.rollouts.ahead(step, ahead)
    checkpoint.save(s.actor, s.tokenizer, s.cfg, checkpoint.TrainerState(
        step=step, sampler=s.sampler.state_dict(), world_size=world, wandb_id=s.wandb_id, parent=s.parent,
        in_flight=sorted(in_flight), weights_only=weights_only), s.run_dir, in_flight=in_flight)


def finish(s: Setup, go: Going) -> None:
    """After the last step: the generators told (split), the held-out result said, the tracker closed."""
    s.rollouts.close("done")
    if s.tracker:
        if len(go.val_history) > 1:
            (s0, m0), (s1, m1) = go.val_history[0], go.val_history[-1]
            console.say(f"held-out pass@1: {m0['val/mean/pass@1']:.3f} at step {s0} -> {m1['val/mean/pass@1']:.3f} "
                        f"at step {s1}  ({', '.join(b.name for b in s.benches)}; n={s.cfg.eval.n})")
        s.tracker.finish()
    dist.barrier()


def validate(s: Setup, step: int, rank: int) -> dict | None:
    """Same code path as gapo-eval; per-problem solve rates go to val/step_N.jsonl for coverage plots. Returns rank
    0's summary (None elsewhere)."""
    ev = s.cfg.eval
    results = evaluate(s.engine, s.tokenizer, s.benches, n=ev.n, temperature=ev.temperature, top_p=ev.top_p,
                       max_new_tokens=ev.max_new_tokens, reward=s.cfg.reward, instruction=ev.instruction,
                       seed=s.cfg.trainer.seed, progress=False)
    if rank != 0:
        return None
    m = summary(results, ev.coverage_threshold)
    s.tracker.log(step, m)
    write_results(results, s.run_dir / rundir.VAL / rundir.step_name(step), {"step": step})
    console.say(f"validation at step {step}: " + ", ".join(f"{k} {v:.3f}" for k, v in m.items()
                                                              if k.startswith("val/mean/")))
    return m


def logged_metrics(parts: list[RankStep], batch: StepBatch, cfg: Config, up: Updates, lr: float, req: Request,
                   pushed: sync.Verified) -> dict[str, float]:
    """Rank 0: the step's numbers over every rank's part, and what rank 0 alone measured (its generator, its probe)."""
    a = cfg.algorithm
    metrics = step_metrics(parts, a.is_level, up.grad_norm, lr, a.correct_threshold,
                           correction=a.rollout_correction.mode != "off")
    metrics["sync/weight_version"] = float(batch.version)  # what this step's rollouts were sampled with
    metrics["rollout/staleness"] = float(batch.step - 1 - batch.version)  # steps behind the on-policy weights
    if math.isfinite(req.generator_s):  # split: the generator's time sampling these rollouts, and idle before them
        metrics["time/generator_s"], metrics["time/generator_idle_s"] = req.generator_s, req.generator_idle_s
    if math.isfinite(pushed.probe_diff):
        metrics["sync/probe_logprob_diff"] = pushed.probe_diff  # rank 0's engine after this step's push
    return metrics


def old_logprobs(actor: Actor, mbs: list[MicroBatch], cfg: Config) -> OldLogprobs:
    """Fills each micro-batch's old_logp (and ref_logp with a KL penalty) without gradient: the trainer's
    recomputation, or the engine's own log-probs with rollout.use_engine_logprobs. With a rollout correction,
    also its weights (rollout_w), and the tokens it masks leave the loss (loss_mask): the step's normaliser is
    counted after this, so they leave it too. Entropy and the KL to the reference stay over every response token:
    they describe the policy, not the loss."""
    r, a = cfg.rollout, cfg.algorithm
    rc = a.rollout_correction
    out = OldLogprobs(0.0, 0.0, [], [])
    actor.deepspeed.train()  # one mode for both passes: the update must recompute exactly these old log-probs
    with torch.no_grad():
        for mb in mbs:
            m = mb.resp_mask.bool()
            if r.use_engine_logprobs:  # no trainer pass: old = engine; mismatch comes from the first update
                mb.old_logp = mb.engine_logp
                out.entropy_sum -= float(mb.old_logp[m].sum())
            else:
                mb.old_logp, ent = actor.deepspeed(mb, r.temperature, entropy=True)
                out.mismatch.append((mb.old_logp - mb.engine_logp)[m].cpu())
                out.entropy_sum += float(ent[m].sum())
                w = keep = None
                if rc.mode != "off":
                    w, keep = rollout_weights(mb.old_logp, mb.engine_logp, mb.resp_mask, rc)
                    mb.rollout_w = w
                out.per_rollout.append(mismatch_stats(mb.old_logp, mb.engine_logp, mb.resp_mask, mb.c, w, keep,
                                                      rc.cap if rc.mode == "truncate" else math.inf))
                if keep is not None:
                    mb.loss_mask = mb.resp_mask * keep
            if a.kl_coef > 0:
                mb.ref_logp = actor.reference(mb, r.temperature)[0]
                out.kl_ref_sum += float(kl_penalty(mb.old_logp, mb.ref_logp, mb.resp_mask, StepNorm(1.0, 1.0)))
    return out


def update(actor: Actor, minis: list[list[MicroBatch]], cfg: Config, step: int, run_dir: Path,
           skipped_in_a_row: int) -> Updates:
    """Epochs x mini-batches of clipped updates, each one optimizer step normalised by its global token count."""
    t, r, a = cfg.trainer, cfg.rollout, cfg.algorithm
    out = Updates([], [], [], [], [], float("nan"), 0, skipped_in_a_row)
    grad_norms: list[float] = []
    for epoch in range(t.ppo_epochs):
        for mini in minis:
            on_policy = epoch == 0 and mini is minis[0]  # still the weights that sampled: the IS ratio must be 1
            tokens = torch.tensor([sum(float(mb.in_loss.sum()) for mb in mini),
                                   sum(float(mb.in_loss.any(-1).sum()) for mb in mini)], device=actor.device)
            dist.all_reduce(tokens)  # the normaliser is the whole optimizer step's, over all ranks
            norm = StepNorm(tokens=max(float(tokens[0]), 1.0), seqs=max(float(tokens[1]), 1.0),
                            constant=a.loss_constant)
            for i, mb in enumerate(mini):
                actor.deepspeed.set_gradient_accumulation_boundary(i == len(mini) - 1)  # counts differ per mini-batch
                logp, _ = actor.deepspeed(mb, r.temperature)
                if on_policy:
                    dev = (logp.detach() - mb.old_logp)[mb.resp_mask.bool()].cpu()
                    out.first_dev.append(dev.abs())
                    if r.use_engine_logprobs:
                        out.mismatch.append(dev)
                loss, st = policy_loss(logp, mb, norm, a)
                applied = actor.backward(loss)
                out.stats.append(st)
                out.stat_rows.append(mb.index)
                out.off_policy.append(torch.full((len(mb.index),), not on_policy))
            if applied:
                grad_norms.append(actor.grad_norm())
                out.skipped_in_a_row = 0
                continue
            out.skipped += 1
            out.skipped_in_a_row += 1
            if dist.get_rank() == 0:
                log.warning("step %d: optimizer step skipped (gradient norm %s, last loss %s); weights and "
                            "optimizer state untouched", step, actor.grad_norm(), float(loss))
            if out.skipped_in_a_row >= t.max_skipped_steps:
                raise TrainingDiverged(
                    f"step {step}: {out.skipped_in_a_row} optimizer steps in a row had a non-finite gradient norm "
                    f"(trainer.max_skipped_steps={t.max_skipped_steps}); the weights are those of the last "
                    f"good step. Lower trainer.lr, check model.dtype, or resume from a checkpoint in {run_dir}")
    out.grad_norm = float(np.mean(grad_norms)) if grad_norms else float("nan")
    return out


def rollout_records(batch: StepBatch, rank: int, eps_hi: Tensor, stats: list[RolloutStats],
                    stat_rows: list[Tensor], off_policy: list[Tensor]) -> list[dict]:
    """One JSON record per rollout: what was sampled, how it scored, and every update's IS ratio and clip
    decision for it (in update order), so a reader can audit the clipping of any single rollout. `off_policy`
    marks the updates after the step's first optimizer step: only those can clip, so only those count as
    decisions (gapo-compare band)."""
    rollouts, results, ga = batch.rollouts, batch.flat_results, batch.adv
    updates: list[list[dict]] = [[] for _ in rollouts]
    for st, rows, off in zip(stats, stat_rows, off_policy, strict=True):  # per micro-batch, epochs in order
        for b, j in enumerate(rows.tolist()):
            updates[j].append({"is_ratio": float(torch.exp(st.seq_log_ratio[b])),
                               "clip_hi_tokens": int(st.clip_hi_tokens[b]),
                               "clip_lo_tokens": int(st.clip_lo_tokens[b]), "off_policy": bool(off[b])})
    k = len(batch.groups[0])
    return [{"step": batch.step, "rank": rank, "problem": batch.problems[i // k].uid, "text": x.text,
             "reward": res.reward, "status": res.status, "detail": res.detail, "c": int(ga.c[i]), "k": int(ga.k[i]),
             "adv": float(ga.adv[i]), "eps_hi": float(eps_hi[i]), "len": len(x.response_ids),
             "truncated": x.truncated, "version": x.version, "updates": updates[i]}
            for i, (x, res) in enumerate(zip(rollouts, results, strict=True))]
