"""Weight sync, verified: after every optimizer step the trainer's weights go into the rollout engine, and a push
that delivers nothing, part of the weights or stale ones stops the run instead of looking like slow learning.

Three checks, from cheapest to strongest:
- versions: the engine is told the trainer step whose weights it holds, and vLLM stamps that version on every output;
  a step whose rollouts were sampled with another version than the previous step's (a skipped or failed push) stops.
- names: every tensor the trainer has must reach the engine, and every parameter of the engine's model must be
  loaded (vLLM only logs the ones a reload missed).
- content: the engine samples a fixed probe prompt and the trainer scores the same tokens; their mean |log-prob
  difference| must stay within rollout.push_tolerance. This checks what the engine computes with, not what its
  parameters hold: on CPU vLLM repacks linear weights for oneDNN and empties the parameters (so digests of them,
  vLLM's compute_weight_checksums, see nothing), and a probe is two tiny forwards on any device. Its limit: in bf16 a
  tensor left one step stale moves the probe by less than bf16's own engine/trainer noise; the names and versions
  still hold there, and a gross fault (zeroed, missing, another model's) is far above the tolerance. In bf16 the
  tolerance is calibrated on the process's first verified push (Probe), since engine and trainer kernels differ by
  an amount no fixed number fits on every model and device.

Between pushes, an alarm watches the step's sampler/trainer mismatch (logprob_mismatch/kl_k3): a jump above its
running median is what a silently failed sync looks like from the outside.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from gapo import console
from gapo.config import Config
from gapo.distributed import gather
from gapo.rollout.engine import Engine
from gapo.rollout.types import PushReceipt, Rollout, SamplingConfig
from gapo.trainer.actor import Actor
from gapo.trainer.logprobs import MicroBatch

PROBE_TEXT = "Verify the weights: the sampler must compute what the trainer computes."
PROBE_TOKENS = 16
PROBE_SEED = 1_203_2026
# Mean |engine - trainer| log-prob over the probe's tokens that a good push stays under. float32, measured on CPU:
# 2e-7 to 4e-7 on tiny-qwen2 and 9e-6 on SmolLM2-135M (the demo) after good pushes; one tensor of tiny-qwen2 left one
# step stale gave 5e-5 at lr 1e-4 and 5e-4 at lr 1e-3 (tests/test_sync.py). A stale tensor whose step moved log-probs
# by less than this passes the probe: the versions and names still hold, and the mismatch alarm watches the next step.
TOLERANCE = {"float32": 1e-4}
# bfloat16 has no fixed tolerance: the process's first verified push sets it to BF16_CALIBRATION x its probe
# difference, kept within [BF16_FLOOR, BF16_CEILING]; that first push must itself stay under BF16_CEILING. Measured
# on CPU (HF forwards, 16 tokens sampled at temperature 1 from the probe, 8 seeds): a bf16 forward differs from the
# fp32 one by 0.004-0.014 on tiny-qwen2 and 0.025-0.054 on SmolLM2-135M (so a fixed 5e-2 could stop a good run), while
# one zeroed or random tensor (a q_proj or down_proj) moved the probe by 0.18-2.2 and 0.35-2.1; vLLM CPU against the
# trainer with the same bf16 weights: 7e-6 to 8e-4 (tiny-qwen2). The floor is the former fixed limit, so calibration
# never tightens it. Against 64 tokens, a trimmed mean and greedy tokens, these 16 sampled tokens had no false alarm
# over 29 good pushes and caught as many faults (bench/push_probe.py, docs/PERFORMANCE.md §3).
BF16_CALIBRATION, BF16_FLOOR, BF16_CEILING = 10.0, 5e-2, 0.25
ALARM_FLOOR = {"float32": 1e-8, "bfloat16": 1e-3}  # logprob_mismatch/kl_k3 below this never alarms

log = logging.getLogger("gapo.sync")


class SyncError(RuntimeError):
    """The engine does not hold the trainer's weights: the run stops (exit 3) naming the tensor or the version."""


@dataclass
class Probe:
    """A fixed prompt, sampled by the engine and scored by the trainer after a push.

    `tolerance` is a hard limit. Set by the user (rollout.push_tolerance) or in fp32 it never changes. In bf16 without
    one, `calibrating` is on until the first verified push: that push is held to BF16_CEILING only (a gross fault),
    and its difference then sets the limit for every later push (`check`). Why the first push and not a fixed
    number: the engine's and the trainer's bf16 kernels differ by an amount that depends on the model and the device
    (measured 5e-4 to 5e-2, see BF16_CALIBRATION), and the probe's fixed prompt and seed sample much the same tokens
    push after push, so a good push stays near the first one's difference while a broken tensor jumps far above it.
    """

    prompt_ids: list[int]
    sampling: SamplingConfig
    pad_id: int
    tolerance: float
    calibrating: bool = False
    source: str = "rollout.push_tolerance"  # where `tolerance` came from, for the message of a push that fails it

    @classmethod
    def of(cls, tokenizer, cfg: Config, pad_id: int) -> Probe:
        # top_p 1: the engine's processed log-probs are then log_softmax(logits / T), which the trainer recomputes.
        sampling = SamplingConfig(n=1, temperature=cfg.rollout.temperature, top_p=1.0, max_new_tokens=PROBE_TOKENS)
        ids = tokenizer(PROBE_TEXT)["input_ids"]
        if cfg.rollout.push_tolerance is not None:
            return cls(ids, sampling, pad_id, cfg.rollout.push_tolerance)
        if cfg.model.dtype == "bfloat16":
            return cls(ids, sampling, pad_id, BF16_CEILING, calibrating=True,
                       source="rollout.push_tolerance unset: bf16's limit for the first push, before calibration")
        return cls(ids, sampling, pad_id, TOLERANCE[cfg.model.dtype], source="rollout.push_tolerance unset: fp32's")

    def check(self, diff: float, version: int) -> str | None:
        """The problem with a push whose probe differed by `diff`, or None; a passing first bf16 push calibrates."""
        if not diff <= self.tolerance:
            return (f"the engine's log-probs of the probe differ from the trainer's by {diff:.3g} on average "
                    f"(limit {self.tolerance:.3g}, {self.source}): after the push of step {version} the sampler does "
                    "not compute with the trainer's weights")
        if self.calibrating:
            self.calibrating = False
            self.tolerance = min(BF16_CEILING, max(BF16_FLOOR, BF16_CALIBRATION * diff))
            self.source = (f"rollout.push_tolerance unset: calibrated on the push of step {version}, "
                           f"{BF16_CALIBRATION:g}x its {diff:.3g} within [{BF16_FLOOR:g}, {BF16_CEILING:g}]")
            log.info("bf16 push probe: limit %.3g for later pushes (%s; rollout.push_tolerance sets a fixed one)",
                     self.tolerance, self.source)
        return None


@dataclass
class Verified:
    """One push's cost and what its probe measured (nan when it was not verified)."""

    push_s: float
    verify_s: float = 0.0
    probe_diff: float = math.nan


def push(engine: Engine, actor: Actor, version: int, probe: Probe | None) -> Verified:
    """Gather the actor's weights into the engine as `version` (this rank's own, or its generator: split's leader
    sends, the other trainers drive the gather); with a probe, verify the push (collective: every training rank
    pushes and verifies, and all stop together when any rank's push failed)."""
    tic = time.perf_counter()
    receipt = engine.push_weights(actor.gathered_weights(), version)
    out = Verified(push_s=time.perf_counter() - tic)
    if probe is None:
        return out
    tic = time.perf_counter()
    problems = receipt_problems(receipt, actor.pushed_names())
    out.probe_diff = probe_diff(engine, actor, probe, version)  # every rank runs it: a ZeRO-3 forward is collective
    if not problems and (problem := probe.check(out.probe_diff, version)):
        problems.append(problem)
    stop_together(problems, f"the weight push of step {version}")
    out.verify_s = time.perf_counter() - tic
    return out


def receipt_problems(receipt: PushReceipt, sent: list[str]) -> list[str]:
    """What a push's receipt shows went wrong, named: tensors sent but not received, received but not sent, and
    engine parameters left unloaded."""
    got = set(receipt.received)
    out = []
    if missing := [name for name in sent if name not in got]:
        out.append(f"{len(missing)} of the trainer's {len(sent)} tensors never reached the engine: {_names(missing)}")
    if extra := sorted(got - set(sent)):
        out.append(f"the engine received tensors the trainer does not have: {_names(extra)}")
    if receipt.unloaded:
        out.append(f"the engine's model has parameters the push left unloaded: {_names(receipt.unloaded)}")
    return out


def _names(names: list[str], at_most: int = 5) -> str:
    more = f" and {len(names) - at_most} more" if len(names) > at_most else ""
    return ", ".join(names[:at_most]) + more


@torch.no_grad()
def probe_diff(engine: Engine, actor: Actor, probe: Probe, version: int) -> float:
    """Mean |engine - trainer| log-prob over the probe's sampled tokens, the engine's answer checked for `version`."""
    [[r]] = engine.generate([probe.prompt_ids], probe.sampling, seeds=[PROBE_SEED])
    if r.version != version:
        return math.inf
    mb = MicroBatch.pack([r.prompt_ids], [r.response_ids], probe.pad_id, engine_logp=[r.logprobs]).to(actor.device)
    logp, _ = actor.deepspeed(mb, probe.sampling.temperature)
    mask = mb.resp_mask.bool()
    return float((logp - mb.engine_logp)[mask].abs().mean())


def check_versions(groups: list[list[Rollout]], expected: int, step: int) -> None:
    """Every rollout of the step must come from the weights of step `expected` (synchronous training: the previous
    step's; rollout.max_staleness steps before that when split); collective, so that every rank stops together."""
    found = sorted({x.version for g in groups for x in g} - {expected})
    problems = [f"rollouts of step {step} were sampled with weight version(s) {found}, expected {expected} (the "
                "previous step's, less rollout.max_staleness): a weight push was skipped or did not reach the "
                "engine"] if found else []
    stop_together(problems, f"step {step}")


def stop_together(problems: list[str], what: str) -> None:
    """Raise SyncError on every rank when any rank found a problem, naming the ranks (collective)."""
    everyone = gather(problems)
    lines = [f"rank {rank}: {p}" for rank, ps in enumerate(everyone) for p in ps]
    if lines:
        raise SyncError(f"{what} failed verification:\n  " + "\n  ".join(lines))


@dataclass
class MismatchAlarm:
    """logprob_mismatch/kl_k3 against the running median of the steps before it (rank 0 keeps the history)."""

    factor: float
    floor: float
    warmup: int
    history: list[float] = field(default_factory=list)

    def check(self, step: int, kl_k3: float) -> str | None:
        """A message when this step's mismatch jumped; the value joins the history either way."""
        if not math.isfinite(kl_k3):
            return None
        median = statistics.median(self.history) if len(self.history) >= self.warmup else None
        self.history.append(kl_k3)
        if median is None or kl_k3 <= self.floor or kl_k3 <= self.factor * median:
            return None
        return (f"step {step}: the sampler/trainer log-prob mismatch jumped to kl_k3 {kl_k3:.3g}, above "
                f"{self.factor:g}x its running median {median:.3g}: the weights in the sampler likely differ from the "
                "trainer's (a partial or stale weight push); rollout.mismatch_alarm sets what this does")

    def sound(self, step: int, kl_k3: float, mode: str) -> None:
        """Collective unless `mode` is off: rank 0 checks its `kl_k3` (the other ranks' is not looked at) and its
        verdict holds on every rank: mode stop raises SyncError on all of them, warn says it on rank 0."""
        if mode == "off":
            return
        jumped = gather(self.check(step, kl_k3) if dist.get_rank() == 0 else None)[0]
        if jumped and mode == "stop":
            raise SyncError(jumped)
        if jumped and dist.get_rank() == 0:
            log.warning("%s", jumped)
            console.say(f"warning: {jumped}")
