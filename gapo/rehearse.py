"""`gapo-train --config X --rehearse`: the run X, two steps long, on the CPU, before it spends GPU hours.

The config is resolved exactly as the real run resolves it (presets, command-line overrides, `--resume`), the
real model's context budget is checked against its config.json, and the data loader reads a sample of the
real source. Then two training steps run with everything the config sets kept as it is, except what a CPU
cannot hold, which is scaled and listed in the report:

  kept    the algorithm (every switch), model dtype (bf16 stays bf16), gradient checkpointing, the old-log-prob
          pass (or engine log-probs), ZeRO stage, PPO epochs, optimizer steps per rollout batch, accumulation
          over micro-batches, group size k, rollout filters and masks, sampling temperature / top-p,
          learning-rate schedule and optimizer settings, reward type, KL, tracking (offline)
  scaled  the model -> a tiny one of the same family (`tiny-qwen2`, `tiny-qwen2-untied`, `tiny-llama`:
          2 layers, hidden 128, 4 heads / 2 KV heads, a 320-token vocabulary), ranks -> at most 2, prompts per
          step -> 2 ranks x one prompt per optimizer step (so each mini-batch holds one group per rank),
          micro-batches -> 2 per mini-batch (1 where the real run has 1), lengths -> 24 new tokens and 512 prompt
          tokens, steps -> 2 (a kept checkpoint, trainer.keep_steps, -> step 1: saved, and kept while step 2 is
          saved with keep_last 1), validation -> 2 problems x 2 samples of each benchmark that loads, vLLM's KV
          cache -> 0.25 GiB and no compile warm-up (rollout.compile=eager), reward workers -> 2, sleep mode off (the
          CPU refuses it)
  data    every record checked as the run checks it (the whole set when its sources are local files, the
          streamed sample from the hub), then a 16-problem sample of the valid ones; when the hub cannot be
          reached (offline, HF_HUB_OFFLINE=1), a stand-in of the same kind (the embedded arithmetic set, or
          data/example_code.jsonl), and the report says so; any other loading error fails the rehearsal, as it
          would fail the run

It ends with a report: the resolved method row, what was scaled, the first mini-batch's IS deviation
(max |log pi - log pi_old| where pi = pi_old; 0 exactly when the old-log-prob pass and the update agree),
skipped optimizer steps and the steps run. The rehearsal writes to `<output_dir>-rehearsal` (with --resume:
`<output_dir>-rehearsal-resumed`), which it clears on the next rehearsal, and never touches the real run's
directory.
"""

from __future__ import annotations

import json
import logging
import shutil
import textwrap
from dataclasses import dataclass
from pathlib import Path

from gapo import rundir
from gapo.config import CONFIGS_DIR, Config
from gapo.configfile import dump_config, resolve
from gapo.errors import ConfigError
from gapo.models import TINY, model_facts

log = logging.getLogger("gapo.rehearse")

STEPS, NEW_TOKENS, PROMPT_TOKENS, SAMPLE = 2, 24, 512, 16
MARKER = "REHEARSAL"  # a directory holding this file is a rehearsal's own, and may be cleared
EXAMPLE_CODE = CONFIGS_DIR.parent / "data" / "example_code.jsonl"


@dataclass
class Plan:
    config: Config  # what the rehearsal trains
    world: int
    nproc: int  # the real run's ranks
    scaled: list[str]  # "key: real -> rehearsal"
    method: str  # the resolved method, one line
    data_check: str = ""  # the records the rehearsal checked, and how many cannot be scored
    data_checked: bool = True  # False: the hub was unreachable and a stand-in set was trained on


def method_row(cfg: Config) -> str:
    a = cfg.algorithm
    return (f"{a.name}: {a.is_level} IS, {a.describe()}, std-norm {'on' if a.std_normalize else 'off'}, "
            f"focal {a.focal_gamma:g}, {a.loss_agg}, k = {cfg.rollout.group_size}")


def plan(cfg: Config, nproc: int) -> Plan:
    """The rehearsal of `cfg` (fully resolved) for a real run on `nproc` ranks."""
    r, t, d, ev = cfg.rollout, cfg.trainer, cfg.data, cfg.eval
    tree = cfg.model_dump(mode="json")
    scaled: list[str] = []

    def scale(key: str, value) -> None:
        section, name = key.split(".")
        old = tree[section][name]
        if old != value:
            tree[section][name] = value
            scaled.append(f"{key}: {old} -> {value}")

    facts = model_facts(cfg.model.path) or {}
    family, tie = facts.get("model_type"), facts.get("tie_word_embeddings", True)
    tiny = next((n for n, shape in TINY.items() if shape == (family, tie)), None)
    if tiny is None:
        tiny = "tiny-qwen2"
        log.warning("no tiny stand-in for %s (model_type %s, tied %s): rehearsing with %s", cfg.model.path,
                    family, tie, tiny)
    shape = ", ".join(f"{k} {facts[k]}" for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                                  "num_key_value_heads", "vocab_size") if k in facts)
    if tiny != cfg.model.path:
        scale("model.path", tiny)
        scaled[-1] += f" ({shape} -> 2, 128, 4, 2, 320)" if shape else ""
    world = min(nproc, 2)
    if world != nproc:
        scaled.append(f"ranks: {nproc} -> {world}")
    real = cfg.shape(nproc)
    scale("rollout.prompts_per_step", world * real.minis)  # optimizer steps per epoch: kept
    scale("trainer.ppo_mini_batch_size", world * r.group_size)
    scale("trainer.micro_batch_size", r.group_size // 2 if real.micro_per_mini > 1 and r.group_size % 2 == 0
          else r.group_size)
    scale("rollout.max_new_tokens", min(r.max_new_tokens, NEW_TOKENS))
    scale("eval.max_new_tokens", min(ev.max_new_tokens, NEW_TOKENS))
    scale("data.max_prompt_tokens", min(d.max_prompt_tokens, PROMPT_TOKENS))
    if t.max_tokens_per_micro_batch:  # as many longest rollouts per micro-batch as the real budget holds
        longest = tree["data"]["max_prompt_tokens"] + tree["rollout"]["max_new_tokens"]
        per = t.max_tokens_per_micro_batch // (d.max_prompt_tokens + r.max_new_tokens)
        scale("trainer.max_tokens_per_micro_batch", per * longest)
    start = 0
    if t.resume_from:  # two steps past the checkpoint (a resumed run counts on from its step)
        from gapo.trainer import checkpoint

        start = checkpoint.read(rundir.find(t.resume_from))[0].step
    scale("trainer.total_steps", start + STEPS)
    # A checkpoint that must survive pruning (an intervention's branch point) is rehearsed as step 1 of 2: saved,
    # then kept while step 2 is saved with keep_last 1, as the real one must be.
    kept = [start + 1] if t.keep_steps else []
    scale("trainer.save_every", 1 if kept else 0)
    scale("trainer.keep_steps", kept)
    scale("trainer.keep_every", 0)
    scale("trainer.eval_every", 0)
    scale("trainer.keep_last", 1)
    scale("reward.num_workers", min(cfg.reward.num_workers, 2))
    scale("rollout.kv_cache_gb", 0.25)
    scale("rollout.compile", "eager")  # vLLM's compile warm-up would take most of a rehearsal's minute
    scale("rollout.sleep_between_steps", False)
    if cfg.tracking.mode == "online":
        scale("tracking.mode", "offline")
    tree["tracking"]["tags"] = [*cfg.tracking.tags, "rehearsal"]
    scale("eval.n", min(ev.n, 2))
    scale("eval.limit", 2)
    scale("trainer.output_dir", f"{t.output_dir}-rehearsal" + ("-resumed" if t.resume_from else ""))
    return Plan(config=resolve(tree), world=world, nproc=nproc, scaled=scaled, method=method_row(cfg))


def _data_sample(cfg: Config, run_dir: Path, p: Plan) -> dict:
    """Check the real loader, and every record it can reach (the whole set when its sources are local, the
    streamed sample from the hub) the way the run checks them; the data section the rehearsal trains on."""
    from gapo.data import load_training_set
    from gapo.reward.registry import check_problems, dropped_summary

    d, scaled = cfg.data, p.scaled
    shown = d.train if isinstance(d.train, str) else " + ".join(x.subset or x.source for x in d.train)
    try:
        problems = load_training_set(d.model_copy(update={"arithmetic_size": min(d.arithmetic_size, 300)}),
                                     sample=SAMPLE)
    except ConfigError as err:
        if not isinstance(err.__cause__, ConnectionError):  # a broken source fails the rehearsal, as it would the run
            raise
        stand_in = {"math": {"train": "arithmetic", "arithmetic_levels": ["add_small"], "arithmetic_size": 300},
                    "code": {"train": str(EXAMPLE_CODE), "prompt_key": "problem", "answer_key": "tests",
                             "split": "train"}}.get(d.type)
        if stand_in is None:  # a kind with no stand-in set (ifeval, or one registered by a user): say what failed
            raise
        scaled.append(f"data.train: {shown} -> {stand_in['train']} (loader NOT checked, hub unreachable: {err})")
        p.data_checked = False
        p.data_check = (f"NOT checked: {shown} could not be reached ({err}); the rehearsal trained on a stand-in "
                        "set, so rehearse again where the data can be read")
        return stand_in
    sources = [d.train] if isinstance(d.train, str) else [x.source for x in d.train]
    local = all(x == "arithmetic" or Path(x).suffix in (".json", ".jsonl", ".parquet") for x in sources)
    everything = load_training_set(d) if local else problems
    valid, dropped = check_problems(d.type, everything, "train")
    p.data_check = (f"{'all' if local else 'the streamed sample of'} {len(everything)} records checked: "
                    + (f"{dropped_summary(dropped, len(everything))} cannot be scored, dropped by the run"
                       f"{' (data.on_invalid=error: the run refuses them)' if d.on_invalid == 'error' else ''}"
                       if dropped else "every one can be scored"))
    if dropped and d.on_invalid == "error":
        raise ConfigError(f"data.train: {dropped_summary(dropped, len(everything))} cannot be scored "
                          f"(data.on_invalid=error): {'; '.join(f'{x.uid}: {x.reason}' for x in dropped[:5])}")
    problems = valid[:SAMPLE]
    sample = run_dir / "data_sample.jsonl"
    with sample.open("w") as f:
        for x in problems:
            meta = {k: v for k, v in x.meta.items() if k != "starter_code"}  # already under the question
            f.write(json.dumps({**meta, "id": x.uid, "problem": x.question, "answer": x.gold}, default=str) + "\n")
    scaled.append(f"data.train: {shown} -> its first {len(problems)} problems ({sample.name}; loader checked)")
    return {"train": str(sample), "prompt_key": "problem", "answer_key": "answer", "split": "train"}


def _benchmarks(cfg: Config, scaled: list[str]) -> list[str]:
    from gapo.evaluation import load_benchmark

    kept = []
    for spec in cfg.eval.benchmarks:
        try:
            load_benchmark(spec, 2, cfg.data)
            kept.append(spec)
        except ConfigError as err:
            # In full, on its own line: the reason's end (the library's error, what to set) is what a user acts on.
            scaled.append(f"eval.benchmarks: {spec} left out, because:\n" + textwrap.indent(str(err), "      "))
    return kept


def prepare(cfg: Config, nproc: int) -> tuple[Plan, Path]:
    """Plan the rehearsal, check data and benchmarks, and write its config into a clean run directory."""
    p = plan(cfg, nproc)
    run_dir = Path(p.config.trainer.output_dir)
    if run_dir.exists():
        if not (run_dir / MARKER).is_file():
            raise ConfigError(f"{run_dir} exists and is not a rehearsal's directory; move it or set "
                              "trainer.output_dir")
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / MARKER).write_text("written by gapo-train --rehearse; cleared by the next rehearsal\n")
    tree = p.config.model_dump(mode="json")
    tree["data"].update(_data_sample(cfg, run_dir, p))
    tree["eval"]["benchmarks"] = _benchmarks(cfg, p.scaled)
    p.config = resolve(tree)
    (run_dir / rundir.REHEARSAL_CONFIG).write_text(dump_config(p.config))
    return p, run_dir


def report(p: Plan, cfg: Config, run_dir: Path, context_limit: int | None) -> tuple[str, bool]:
    """The report (markdown) and whether the rehearsal passed."""
    path = run_dir / rundir.METRICS
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []
    train = [x for x in rows if "reward/mean" in x]
    dev = max((x["first_minibatch/max_abs_log_ratio"] for x in train), default=float("nan"))
    skipped = sum(int(x["skipped_steps"]) for x in train)
    d, r = cfg.data, cfg.rollout
    ok = len(train) == STEPS and skipped == 0 and (dev == 0.0 or r.use_engine_logprobs)
    # Data the hub could not serve was never read: the steps may pass, the rehearsal does not say PASSED.
    verdict = "FAILED" if not ok else "PASSED" if p.data_checked else "STEPS PASSED, DATA NOT CHECKED"
    limit = (f"{d.max_prompt_tokens} prompt + {r.max_new_tokens} new tokens within the model's {context_limit} "
             "positions" if context_limit else "the model's config.json does not state its positions")
    lines = [f"# Rehearsal: {verdict}", "",
             f"- method: {p.method}",
             f"- context: {limit}",
             f"- data: {p.data_check}",
             f"- steps run: {len(train)} of {STEPS}, on {p.world} rank{'s' if p.world > 1 else ''}"
             + (f" (the config's --nproc: {p.nproc} -> {p.world} for the rehearsal)" if p.nproc != p.world else "")
             + f", {cfg.model.dtype}, gradient checkpointing {'on' if cfg.model.gradient_checkpointing else 'off'}, "
             f"ZeRO stage {p.config.zero_stage(p.world)}",
             f"- first mini-batch IS deviation (max |log pi - log pi_old|, must be 0"
             f"{'' if not r.use_engine_logprobs else '; engine log-probs: the engine/trainer mismatch'}): {dev:g}",
             f"- skipped optimizer steps: {skipped}",
             "- reward per step: " + ", ".join(f"{x['reward/mean']:.3f}" for x in train),
             "- scaled for the CPU:", *[f"  - {s}" for s in p.scaled],
             f"- run directory: {run_dir} (its config: {rundir.REHEARSAL_CONFIG})"]
    return "\n".join(lines) + "\n", ok
