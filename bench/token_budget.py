"""Micro-batches by token budget vs by count: padded tokens and training-forward time on one mini-batch.

    .venv/bin/python bench/token_budget.py [--rollouts 32] [--rows 8] [--budget 4096] [--reps 3]

Long-reasoning runs have a long tail of response lengths: with micro-batches of `--rows` rollouts in sampling
order, every row is padded to its micro-batch's longest. The budget packs longest first, as many rollouts per
micro-batch as rows x longest <= `--budget` (gapo.trainer.logprobs.micro_batch_rows). Response lengths are drawn
from a log-normal (median 300, clipped to 16..2,048 tokens, seed 0) after a 64-token prompt. A small random
Qwen2 (hidden 256, 4 layers, vocab 4,096, fp32) runs gapo's `response_logprobs` forward + backward over every
micro-batch of the mini-batch; the two packings alternate within each of `--reps` rounds and the medians are
printed with their ratio. The gradient is the same either way (tests/test_token_budget.py).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from _util import median

from gapo.trainer.logprobs import MicroBatch, micro_batch_rows, response_logprobs

PROMPT = 64


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rollouts", type=int, default=32)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                         attn_implementation="sdpa"))
    rng = np.random.default_rng(0)
    lens = np.clip(rng.lognormal(np.log(300), 0.9, args.rollouts), 16, 2048).astype(int).tolist()
    prompts = [rng.integers(3, 4096, PROMPT).tolist() for _ in lens]
    responses = [rng.integers(3, 4096, n).tolist() for n in lens]
    lengths = [PROMPT + n for n in lens]
    packings = {"count": micro_batch_rows(lengths, args.rows, None),
                "budget": micro_batch_rows(lengths, args.rows, args.budget)}
    batches = {k: [MicroBatch.pack([prompts[i] for i in b], [responses[i] for i in b], 0) for b in bins]
               for k, bins in packings.items()}
    times: dict[str, list[float]] = {k: [] for k in batches}
    for _ in range(args.reps):
        for name, mbs in batches.items():
            tic = time.perf_counter()
            for mb in mbs:
                lp, _ = response_logprobs(model.get_decoder(), model.get_output_embeddings(), mb, 1.0)
                (lp * mb.resp_mask).sum().backward()
            times[name].append(time.perf_counter() - tic)
    real = sum(lengths)
    print(f"{args.rollouts} rollouts, {real:,} real tokens (response lengths {min(lens)}..{max(lens)}, median "
          f"{int(np.median(lens))}); by count: {args.rows} rows; by budget: {args.budget:,} tokens")
    for name, mbs in batches.items():
        padded = sum(mb.input_ids.numel() for mb in mbs)
        print(f"  {name:<7} {len(mbs):3d} micro-batches, largest {max(mb.input_ids.numel() for mb in mbs):7,} "
              f"tokens, padded {padded:9,} ({padded / real:.2f}x real), forward+backward {median(times[name]):.2f} s")
    print(f"  time ratio count/budget: {median(times['count']) / median(times['budget']):.2f}")


if __name__ == "__main__":
    main()
