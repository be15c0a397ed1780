"""gapo-sweep --budget: what a sweep will cost, from its configs alone, before anything is submitted."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from gapo.config import Config
from gapo.configfile import load_config
from gapo.study.manifest import Job, Manifest, Protocol, load_manifest


def budget(m: Manifest, js: list[Job]) -> str:
    """GPUs, the memory plan's verdict, estimated GPU-hours of training and of evaluation, and the disk the kept
    checkpoints take, per run and in total, from the configs alone.

    Hours are FLOP estimates, not measurements (no GPU has run a paper config yet): per step, 2 P T for generation at
    GEN_MFU, 2 P T (old log-probs) + 6 P T epochs (updates) for training at TRAIN_MFU, with T the step's tokens
    at mean response length half of max_new_tokens, P the parameters, on H100-class bf16 (PEAK_FLOPS). An
    evaluation is generation only: every problem of the protocol's benchmarks (BENCHMARK_SIZES) x n samples, per
    evaluated checkpoint. Disk: a checkpoint holds the exported weights and DeepSpeed's state (the fp32 weights
    and Adam's two moments, and the bf16 weights in bf16 runs): CHECKPOINT_BYTES_PER_PARAM bytes per parameter; the
    exported weights only under trainer.save_only_model."""
    from gapo.memory import memory_plan, param_count
    from gapo.models import model_facts

    shared = sum(1 for j in js if j.shared)
    lines = [f"{m.title} ({m.produces}): {len(js)} runs of {m.nproc} GPU(s) x {m.nodes} node(s)"
             + (f", {shared} of them another manifest's (runs.use)" if shared else ""), ""]
    train_total = eval_total = disk_total = disk_weights_total = 0.0
    samples, new_tokens, unknown = _eval_samples(m)
    for j in js:
        cfg = load_config(j.config, j.args)
        facts = model_facts(cfg.model.path)
        if not facts:
            lines.append(f"  {j.run.name} seed {j.seed}: no config.json for {cfg.model.path}: no estimate")
            continue
        gpus = m.nproc * m.nodes
        plan = memory_plan(cfg, facts, gpus - cfg.rollout.generator_ranks)  # the training ranks' plan
        r, t = cfg.rollout, cfg.trainer
        tokens = r.prompts_per_step * r.group_size * (cfg.data.max_prompt_tokens / 2 + r.max_new_tokens / 2)
        p = param_count(facts)
        seconds = t.total_steps * (2 * p * tokens / GEN_MFU + (2 + 6 * t.ppo_epochs) * p * tokens / TRAIN_MFU) \
            / (PEAK_FLOPS * gpus)
        if j.parent is not None:
            seconds *= (t.total_steps - j.branch_step) / t.total_steps
        hours = seconds / 3600 * gpus
        evaluated = len(j.own_steps(m.eval.steps))
        if j.shared:  # trained (and kept) by its owner's sweep: count here only the evaluations the owner lacks
            owner = load_manifest(j.shared.split("/")[0])
            if owner.protocol_name == m.protocol_name:
                evaluated = len(set(j.own_steps(m.eval.steps)) - set(owner.eval.steps))
            eval_hours = evaluated * _eval_gpu_hours(param_count(facts), samples, cfg.data.max_prompt_tokens,
                                                     new_tokens)
            eval_total += eval_hours
            lines.append(f"  {j.run.name} seed {j.seed}: {j.shared}'s run, trained and kept by that sweep (counted "
                         f"there); ~{eval_hours:,.0f} GPU-hours evaluating {evaluated} checkpoint(s) it does not")
            continue
        eval_hours = evaluated * _eval_gpu_hours(p, samples, cfg.data.max_prompt_tokens, new_tokens)
        kept, whole = _kept_checkpoints(cfg, j)
        weight_bytes = p * (2 if cfg.model.dtype == "bfloat16" else 4)
        disk = kept * checkpoint_bytes(cfg, p)
        disk_weights = whole * checkpoint_bytes(cfg, p) + (kept - whole) * weight_bytes
        train_total, eval_total = train_total + hours, eval_total + eval_hours
        disk_total, disk_weights_total = disk_total + disk, disk_weights_total + disk_weights
        lines.append(f"  {j.run.name} seed {j.seed}: {gpus} GPUs, memory plan {plan.total / 2**30:.0f} of 80 GB "
                     f"({'fits' if plan.fits(80) else 'does NOT fit'}), ~{hours:,.0f} GPU-hours training, "
                     f"~{eval_hours:,.0f} evaluating {evaluated} checkpoint(s); {kept} kept checkpoints "
                     f"{disk / 1e9:,.0f} GB")
    if m.base and js:
        cfg = load_config(m.config)
        facts = model_facts(cfg.model.path)
        if facts:
            base_hours = _eval_gpu_hours(param_count(facts), samples, cfg.data.max_prompt_tokens, new_tokens)
            eval_total += base_hours
            lines.append(f"  base model: ~{base_hours:,.0f} GPU-hours evaluating it once")
    lines += ["", f"  training   ~{train_total:,.0f} GPU-hours",
              f"  evaluation ~{eval_total:,.0f} GPU-hours ({samples:,} samples per checkpoint"
              + (f"; {', '.join(unknown)} of unknown size, not counted" if unknown else "") + ")",
              f"  total      ~{train_total + eval_total:,.0f} GPU-hours (FLOP estimates at {GEN_MFU:.0%} MFU for "
              f"generation, {TRAIN_MFU:.0%} for training, H100 bf16; see gapo.study.budget)",
              f"  disk       {disk_total / 1e12:,.2f} TB for the kept checkpoints (with their optimizer state unless "
              "trainer.save_only_model)" + ("" if disk_weights_total == disk_total else
                                            f"; {disk_weights_total / 1e12:,.2f} TB if those kept only for evaluation "
                                            "held only their weights, the newest trainer.keep_last whole (not "
                                            "implemented: trainer.save_only_model=true makes every checkpoint weights "
                                            "only, which no run can resume)")]
    return "\n".join(lines)


# Problems per benchmark (the evaluation budget): the public sets' sizes. A benchmark not listed is counted as 0.
BENCHMARK_SIZES = {"aime24": 30, "aime25": 30, "amc": 83, "math500": 500, "minerva": 272, "olympiad_bench": 675,
                   "ifeval": 541, "humaneval_plus": 164, "arithmetic": 200}
CHECKPOINT_BYTES_PER_PARAM = 16  # exported weights + DeepSpeed's fp32 weights, Adam m and v (+ bf16 weights): ~16 B


def _eval_samples(m: Manifest) -> tuple[int, int, list[str]]:
    """For one evaluated checkpoint: the samples (problems x n), the protocol's max_new_tokens, and the
    benchmarks whose size is unknown."""
    p = m.eval.protocol
    if isinstance(p, Protocol):
        benchmarks, n, limit, new = p.benchmarks, p.n, p.limit, p.max_new_tokens
    else:
        proto = load_config(p).eval.protocol
        benchmarks, n, limit, new = proto.benchmarks, proto.n, None, proto.max_new_tokens
    total, unknown = 0, []
    for spec in benchmarks:
        name = re.split(r"[@=]", spec, maxsplit=1)[0]
        if name not in BENCHMARK_SIZES:
            unknown.append(name)
            continue
        size = BENCHMARK_SIZES[name]
        total += (min(size, limit) if limit else size) * n
    return total, new, unknown


def _eval_gpu_hours(params: int, samples: int, max_prompt_tokens: int, max_new_tokens: int) -> float:
    """One checkpoint's evaluation: `samples` responses, prompts and responses at half their budgets."""
    tokens = samples * (max_prompt_tokens / 2 + max_new_tokens / 2)
    return 2 * params * tokens / (PEAK_FLOPS * GEN_MFU) / 3600


def disk_shortfall(js: list[Job], root: Path) -> str | None:
    """What `gapo-sweep --run` says before its first run when the checkpoints its unfinished runs keep exceed the free
    space under `root` (each run still checks, at its start, for room for its next checkpoint; a warning, not a
    refusal: space can be freed while the sweep runs). None when they fit."""
    from gapo.memory import param_count
    from gapo.models import model_facts

    need = 0
    for j in js:
        cfg = load_config(j.config, j.args)
        facts = model_facts(cfg.model.path)
        if facts:
            need += _kept_checkpoints(cfg, j)[0] * checkpoint_bytes(cfg, param_count(facts))
    where = next(p for p in (root, *root.parents) if p.exists())
    free = shutil.disk_usage(where).free
    if need <= free:
        return None
    return (f"the {len(js)} run(s) left keep about {need / 1e9:,.1f} GB of checkpoints and {free / 1e9:,.1f} GB are "
            f"free under {where}: a run stops at its start when its next checkpoint cannot fit (free space, lower "
            "trainer.keep_last, set trainer.save_only_model=true where no run is resumed, or move --output-root)")


def checkpoint_bytes(cfg: Config, params: int) -> int:
    """One checkpoint on disk: the exported weights, with DeepSpeed's state unless trainer.save_only_model."""
    if cfg.trainer.save_only_model:
        return params * (2 if cfg.model.dtype == "bfloat16" else 4)
    return CHECKPOINT_BYTES_PER_PARAM * params


def _kept_checkpoints(cfg: Config, j: Job) -> tuple[int, int]:
    """(checkpoints left on disk at the end of the run, of which the newest trainer.keep_last)."""
    t = cfg.trainer
    first = j.branch_step + 1 if j.branch_step is not None else 1
    saved = sorted({s for s in range(first, t.total_steps + 1) if t.save_every and s % t.save_every == 0}
                   | {t.total_steps})
    newest = set(saved[-t.keep_last:])
    kept = {s for s in saved if s in t.keep_steps or (t.keep_every and s % t.keep_every == 0)} | newest
    return len(kept), len(newest)


PEAK_FLOPS = 989e12  # H100 SXM dense bf16
GEN_MFU, TRAIN_MFU = 0.05, 0.35  # assumptions: decoding is memory-bound; training at a typical ZeRO-3 MFU
