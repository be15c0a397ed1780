"""Trainer overhead: tokens/s of gapo's update step vs a bare transformers forward + backward + AdamW.

    .venv/bin/python bench/trainer_overhead.py [--reps 3]

The same 64 rollouts (real SmolLM2 chat prompts, random responses of 8-64 tokens), split the same way
(two optimizer steps of 32, micro-batches of 8), in one process. Bare: `model(...).logits` over the whole
sequence, log-softmax, gather, a policy-gradient loss, backward, AdamW. gapo: `Actor` (DeepSpeed, one rank,
so stage 0: see Actor) with the GSPO loss, as the training loop calls it, on the plain layout (every
rollout run whole: the overhead proper) and with shared prompts (each group's prompt run once: what
`trainer.share_prompts`, on by default, saves). All alternate, `--reps` times; medians are reported.
Figures are printed last.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import replace

import torch
from _util import median

from gapo.algorithms import StepNorm
from gapo.configfile import resolve
from gapo.data import arithmetic_problems, build_prompt_ids
from gapo.distributed import init_distributed
from gapo.models import resolve_model
from gapo.trainer.actor import Actor
from gapo.trainer.logprobs import MicroBatch
from gapo.trainer.losses import policy_loss

ROLLOUTS, MINI, MICRO = 64, 32, 8


def make_rollouts(tok, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(0)
    problems = arithmetic_problems(ROLLOUTS // 8, seed=7)
    prompts = [build_prompt_ids(tok, p, "Put the final answer in \\boxed{}.") for p in problems for _ in range(8)]
    responses = [[rng.randrange(vocab) for _ in range(rng.randint(8, 64))] for _ in prompts]
    return prompts, responses


def bare_step(model, opt, mbs: list[MicroBatch], adv: torch.Tensor) -> None:
    for m0 in range(0, len(mbs), MINI // MICRO):
        group = mbs[m0:m0 + MINI // MICRO]
        n_tok = sum(float(mb.resp_mask.sum()) for mb in group)
        for mb in group:
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits  # [B, L, V]
            logp_all = torch.log_softmax(logits.float(), -1)
            pos = mb.resp_pos
            logp = logp_all.gather(1, pos[..., None].expand(-1, -1, logp_all.shape[-1])).gather(
                -1, mb.resp_ids[..., None]).squeeze(-1)  # [B, T]
            loss = -(logp * mb.resp_mask * adv[:mb.resp_mask.shape[0], None]).sum() / n_tok
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)


def gapo_step(actor: Actor, mbs: list[MicroBatch], adv: torch.Tensor) -> None:
    a = actor.cfg.algorithm
    for m0 in range(0, len(mbs), MINI // MICRO):
        group = mbs[m0:m0 + MINI // MICRO]
        norm = StepNorm(tokens=sum(float(mb.resp_mask.sum()) for mb in group), seqs=float(MINI))
        for mb in group:
            logp, _ = actor.deepspeed(mb, 1.0)
            B = mb.resp_mask.shape[0]
            ones = torch.ones(B)
            loss, _ = policy_loss(logp, replace(mb, old_logp=logp.detach(), adv=adv[:B], c=ones, k=8 * ones), norm, a)
            actor.backward(loss)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-shared", action="store_true", help="skip the shared-prompt runs")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    init_distributed()
    model_dir = str(resolve_model("smollm2-135m"))
    tok = AutoTokenizer.from_pretrained(model_dir)
    bare = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    bare.config.use_cache = False
    opt = torch.optim.AdamW(bare.parameters(), lr=1e-6, weight_decay=0.0)
    prompts, responses = make_rollouts(tok, bare.config.vocab_size)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    mbs = [MicroBatch.pack(prompts[i:i + MICRO], responses[i:i + MICRO], pad) for i in range(0, ROLLOUTS, MICRO)]
    shared = [MicroBatch.pack(prompts[i:i + MICRO], responses[i:i + MICRO], pad, share_prompts=True)
              for i in range(0, ROLLOUTS, MICRO)]
    tokens = sum(int(mb.attention_mask.sum()) for mb in mbs)
    adv = torch.randn(MICRO, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    cfg = resolve({"algorithm": {"name": "gspo"},
                   "trainer": {"lr": 1e-6, "micro_batch_size": MICRO, "ppo_mini_batch_size": MINI}})
    actor = Actor(cfg, model_dir)
    actor.deepspeed.train()
    runs = {"bare": None, "gapo Actor": (actor, mbs)}
    if not args.no_shared:
        runs["gapo Actor, shared prompts"] = (actor, shared)
    times: dict[str, list[float]] = {name: [] for name in runs}
    print(f"torch threads {torch.get_num_threads()}, {tokens} tokens per step "
          f"({sum(int(mb.resp_mask.sum()) for mb in mbs)} response)", flush=True)
    for rep in range(args.reps + 1):  # the first round is warm-up
        for name in times:
            tic = time.perf_counter()
            if name == "bare":
                bare_step(bare, opt, mbs, adv)
            else:
                gapo_step(*runs[name], adv)
            dt = time.perf_counter() - tic
            if rep:
                times[name].append(dt)
            print(f"round {rep} {name}: {dt:.2f} s", flush=True)
    b = median(times["bare"])
    print("\n== trainer overhead (SmolLM2-135M fp32 CPU, one rank; 64 rollouts, 2 optimizer steps) ==")
    print(f"bare transformers fwd+bwd+AdamW: {b:.2f} s/step, {tokens / b:.0f} tokens/s")
    for name in list(runs)[1:]:
        g = median(times[name])
        print(f"{name}: {g:.2f} s/step, {tokens / g:.0f} tokens/s, time vs bare {g / b - 1:+.1%}"
              + ("" if "shared" in name else "   (goal <= +10%)"))


if __name__ == "__main__":
    main()
