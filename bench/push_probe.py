"""The bf16 push probe's false alarms over many good pushes, and what it catches of six faults, for candidate probes
(gapo/trainer/sync.py; issue 52 item 4).

    .venv/bin/python bench/push_probe.py [--model smollm2-135m] [--pushes 60] [--lr 1e-4]

The probe: after a push the engine samples the fixed probe prompt, the trainer scores the same tokens, and the mean
|engine - trainer| log-prob must stay under a limit that bf16 sets from the first verified push (10x its difference,
within [0.05, 0.25]). The worry: one low-probability token among 16 sampled at temperature 1 carries a large kernel
difference and a good push crosses the limit. Stand-ins, on the CPU: the trainer is an fp32 forward, the engine a
bf16 forward of the same weights (bf16 against fp32 is the largest engine/trainer gap measured, 0.025-0.054 on
SmolLM2-135M; vLLM CPU against a bf16 trainer differs by 1e-4 and could never cross the 0.05 floor). A GPU's kernels
differ by another amount: these rates are the CPU stand-in's, unverified on a GPU.

Good pushes: --pushes steps of an Adam-like update (each weight moves by lr x a random sign, cumulated), pushed in
bf16. Faults, each on one tensor of a push after calibration, over several tensors: zeroed, random (same std), one
step stale at 100x the step (a real step at lr 1e-4 hides under bf16's rounding), swapped with another layer's,
doubled, sign-flipped. Candidates:
- sampled16: 16 tokens sampled at temperature 1 (today's probe), mean |diff|;
- sampled64: 64 such tokens;
- trimmed16: the 16 sampled, the largest 2 differences dropped before the mean;
- greedy16: 16 greedy tokens, scored at the sampling temperature (no rare tokens by construction).
Prints the CPU, then per candidate: the first push's difference and limit, the false-alarm rate, the largest later
push's difference over the limit, and the detection rate per fault.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from _util import cpu_line

from gapo.trainer.sync import BF16_CALIBRATION, BF16_CEILING, BF16_FLOOR, PROBE_SEED, PROBE_TEXT

CANDIDATES = ("sampled16", "sampled64", "trimmed16", "greedy16")
FAULTS = ("zeroed", "random", "stale x100", "swapped", "doubled", "sign-flipped")


def limit_of(first: float) -> float:
    return min(BF16_CEILING, max(BF16_FLOOR, BF16_CALIBRATION * first))


@torch.no_grad()
def logprobs(model, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Log-probs (temperature 1) of ids[start:] under `model`, in float64 for the comparison."""
    logits = model(ids[None]).logits[0, start - 1:-1].double()
    return torch.log_softmax(logits, -1).gather(1, ids[start:, None])[:, 0]


@torch.no_grad()
def continuation(engine, prompt: torch.Tensor, n: int, greedy: bool) -> torch.Tensor:
    """n tokens from the engine: sampled at temperature 1 with the probe's fixed seed, or greedy."""
    g = torch.Generator().manual_seed(PROBE_SEED)
    ids, past = prompt, None
    out = engine(ids[None], use_cache=True)
    for _ in range(n):
        logits = out.logits[0, -1].float()
        nxt = logits.argmax() if greedy else torch.multinomial(torch.softmax(logits, -1), 1, generator=g)[0]
        ids = torch.cat([ids, nxt.view(1)])
        past = out.past_key_values
        out = engine(nxt.view(1, 1), past_key_values=past, use_cache=True)
    return ids


def probe(trainer, engine, prompt: torch.Tensor) -> dict[str, float]:
    """Each candidate's difference for one push."""
    start = len(prompt)
    sampled = continuation(engine, prompt, 64, greedy=False)
    greedy = continuation(engine, prompt, 16, greedy=True)
    diff_s = (logprobs(engine, sampled, start) - logprobs(trainer, sampled, start)).abs()
    diff_g = (logprobs(engine, greedy, start) - logprobs(trainer, greedy, start)).abs()
    return {"sampled16": float(diff_s[:16].mean()), "sampled64": float(diff_s.mean()),
            "trimmed16": float(diff_s[:16].sort().values[:14].mean()), "greedy16": float(diff_g.mean())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--pushes", type=int, default=60)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--tensors", type=int, default=4, help="tensors each fault is put on")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gapo.models import resolve_model

    print(cpu_line(), flush=True)
    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = torch.tensor(tok(PROBE_TEXT)["input_ids"])
    g = torch.Generator().manual_seed(0)
    tic = time.perf_counter()

    def engine_of(model) -> torch.nn.Module:
        return copy.deepcopy(model).to(torch.bfloat16).eval()

    diffs: list[dict[str, float]] = []
    step = {}
    for _ in range(args.pushes):
        with torch.no_grad():
            for name, p in trainer.named_parameters():
                step[name] = args.lr * torch.randint(0, 2, p.shape, generator=g).mul_(2).sub_(1).float()
                p.add_(step[name])
        diffs.append(probe(trainer, engine_of(trainer), prompt))
    print(f"{args.pushes} good pushes of {args.model} (lr {args.lr:g}) in {time.perf_counter() - tic:.0f} s")

    names = [n for n, p in trainer.named_parameters() if p.ndim == 2 and "embed" not in n]
    chosen = [names[i * (len(names) - 1) // max(1, args.tensors - 1)] for i in range(args.tensors)]
    params = dict(trainer.named_parameters())
    caught = {c: {f: 0 for f in FAULTS} for c in CANDIDATES}
    for name in chosen:
        partner = next(n for n in names if n != name and params[n].shape == params[name].shape)
        for fault in FAULTS:
            engine = engine_of(trainer)
            w = dict(engine.named_parameters())[name]
            with torch.no_grad():
                if fault == "zeroed":
                    w.zero_()
                elif fault == "random":
                    w.copy_(torch.randn(w.shape, generator=g) * float(params[name].std()))
                elif fault == "stale x100":
                    w.copy_(params[name] - 100 * step[name])
                elif fault == "swapped":
                    w.copy_(params[partner])
                elif fault == "doubled":
                    w.mul_(2)
                else:
                    w.neg_()
            d = probe(trainer, engine, prompt)
            for c in CANDIDATES:
                caught[c][fault] += d[c] > limit_of(diffs[0][c])

    print(f"\nbf16 engine stand-in against an fp32 trainer; limit = {BF16_CALIBRATION:g}x the first push's difference "
          f"within [{BF16_FLOOR:g}, {BF16_CEILING:g}]; faults on {len(chosen)} tensors ({', '.join(chosen)})")
    print(f"{'probe':<10} {'first':>7} {'limit':>6} {'later: median':>14} {'max':>7} {'false alarms':>13}  "
          + "  ".join(f"{f:>12}" for f in FAULTS))
    for c in CANDIDATES:
        first, later = diffs[0][c], sorted(d[c] for d in diffs[1:])
        limit = limit_of(first)
        alarms = sum(x > limit for x in later)
        print(f"{c:<10} {first:7.4f} {limit:6.3f} {later[len(later) // 2]:14.4f} {later[-1]:7.4f} "
              f"{alarms:>5} of {len(later):<5}  " + "  ".join(f"{caught[c][f]:>6} of {len(chosen):<3}" for f in FAULTS))


if __name__ == "__main__":
    main()
