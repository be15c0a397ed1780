"""Log-prob memory: peak memory of response log-probs at Qwen2.5's vocab (151,936), gapo's chunked way vs the
naive full log-softmax.

    .venv/bin/python bench/logprob_memory.py [--batch 8] [--resp-len 4096] [--naive-batch 1] [--reps 1]

A tiny random Qwen2 (hidden 64, 2 layers, 2 heads, tied embeddings, fp32, sdpa attention), so that the vocab
projection dominates; `--batch` rollouts of a 16-token prompt and `--resp-len` response tokens. Every case
runs in a fresh child process (`--case`), which builds the model and inputs, takes its RSS as the baseline,
runs the case and reports its `ru_maxrss` (exact peak RSS) minus that baseline; so peaks never contaminate
each other. Cases:

- gapo_fwd / gapo_bwd: `response_logprobs(decoder, head, mb, 1.0)` under no_grad / with grad + backward.
- naive_fwd / naive_bwd: `model(...).logits` over the whole sequence [B, L, V], log_softmax, gather. At 8 x
  4,096 x 151,936 one such fp32 tensor is ~18.5 GiB and would not fit a 24 GiB machine, so this runs at
  `--naive-batch` rollouts (everything it holds scales with B: extrapolate linearly).
- decoder_bwd / chunk_fwd / chunk_bwd: diagnostics that split gapo's peak: the decoder alone (forward +
  backward of the hidden states' sum), and one LOGIT_CHUNK of the vocab projection alone (gapo's
  `_token_logp`, checkpointed like in training for chunk_bwd).

Cases alternate within each of `--reps` rounds; medians are reported. Figures are printed last.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import psutil
import torch
from _util import median

from gapo.trainer import logprobs

VOCAB, PROMPT = 151_936, 16
CASES = ("gapo_fwd", "gapo_bwd", "naive_fwd", "naive_bwd", "decoder_bwd", "chunk_fwd", "chunk_bwd")
GIB = 2**30


def build(batch: int, resp_len: int):
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True,
                      max_position_embeddings=PROMPT + resp_len, use_cache=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(VOCAB, (PROMPT,), generator=g).tolist() for _ in range(batch)]
    responses = [torch.randint(VOCAB, (resp_len,), generator=g).tolist() for _ in range(batch)]
    return model, logprobs.MicroBatch.pack(prompts, responses, pad_id=0)


def run_case(case: str, model, mb: logprobs.MicroBatch) -> None:
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    if case == "gapo_fwd":
        with torch.no_grad():
            logprobs.response_logprobs(decoder, head, mb, 1.0)
    elif case == "gapo_bwd":
        logp, _ = logprobs.response_logprobs(decoder, head, mb, 1.0)
        (logp * mb.resp_mask).sum().backward()
    elif case.startswith("naive"):
        with torch.set_grad_enabled(case == "naive_bwd"):
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits  # [B, L, V]
            logp = torch.log_softmax(logits.float(), -1).gather(-1, mb.input_ids[:, 1:, None]).squeeze(-1)
            if case == "naive_bwd":
                (logp[:, PROMPT - 1:] * mb.resp_mask).sum().backward()
    elif case == "decoder_bwd":
        decoder(input_ids=mb.input_ids, attention_mask=mb.attention_mask).last_hidden_state.sum().backward()
    else:  # one chunk of the vocab projection, as response_logprobs runs it
        h = torch.randn(logprobs.LOGIT_CHUNK, model.config.hidden_size, requires_grad=case == "chunk_bwd")
        t = torch.randint(VOCAB, (logprobs.LOGIT_CHUNK,))
        if case == "chunk_fwd":
            with torch.no_grad():
                logprobs._token_logp(head, h, t, 1.0)
        else:
            torch.utils.checkpoint.checkpoint(logprobs._token_logp, head, h, t, 1.0,
                                              use_reentrant=False).sum().backward()


def child(case: str, batch: int, resp_len: int) -> None:
    model, mb = build(batch, resp_len)
    base = psutil.Process().memory_info().rss
    tic = time.perf_counter()
    run_case(case, model, mb)
    dt = time.perf_counter() - tic
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"above": (peak - base) / GIB, "total": peak / GIB, "base": base / GIB, "s": dt,
                      "model": model_bytes / GIB}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--resp-len", type=int, default=4096)
    ap.add_argument("--naive-batch", type=int, default=1, help="rollouts for the naive cases")
    ap.add_argument("--reps", type=int, default=1, help="rounds (memory peaks vary little)")
    ap.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    ap.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # run one case, in this (child) process
    args = ap.parse_args()
    if args.case:
        child(args.case, args.naive_batch if args.case.startswith("naive") else args.batch, args.resp_len)
        return
    res: dict[str, list[dict]] = {c: [] for c in args.cases}
    for rep in range(args.reps):
        for case in args.cases:
            cmd = [sys.executable, __file__, "--case", case, "--batch", str(args.batch), "--resp-len",
                   str(args.resp_len), "--naive-batch", str(args.naive_batch)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(f"{case} exited with {r.returncode}:\n{r.stderr[-3000:]}")
            res[case].append(json.loads(r.stdout.strip().splitlines()[-1]))
            x = res[case][-1]
            print(f"round {rep} {case}: peak {x['above']:.3f} GiB above baseline ({x['base']:.2f}), "
                  f"{x['total']:.2f} GiB total, {x['s']:.1f} s", flush=True)

    def fig(case: str, key: str = "above") -> float:
        return median([x[key] for x in res[case]])

    model = next(iter(res.values()))[0]["model"]
    chunk = logprobs.LOGIT_CHUNK * VOCAB * 4 / GIB
    full = args.batch * args.resp_len * VOCAB * 4 / GIB
    goal = 1.3 * (model + chunk)
    print(f"\n== response log-prob memory (tiny Qwen2, hidden 64, vocab {VOCAB}, fp32 CPU; {args.batch} x "
          f"{args.resp_len} response tokens) ==")
    print(f"model {model:.3f} GiB; one chunk's logits ({logprobs.LOGIT_CHUNK} x {VOCAB} fp32) {chunk:.3f} GiB; "
          f"a [B, T, V] fp32 tensor would be {full:.2f} GiB")
    print(f"goal: model + peak above baseline <= 1.3 x (model + one chunk) = {goal:.3f} GiB")
    for case in ("gapo_fwd", "gapo_bwd"):
        if case in res:
            p = fig(case)
            print(f"gapo {case[5:]}: peak {p:.3f} GiB above baseline ({fig(case, 'total'):.2f} GiB total); "
                  f"model + peak {model + p:.3f} GiB = {(model + p) / goal * 1.3:.2f} x (model + chunk), "
                  f"{'meets' if model + p <= goal else 'MISSES'} the goal; {full / (model + p):.1f}x below [B,T,V]")
    if "gapo_bwd" in res and "decoder_bwd" in res:
        # A backward also holds the decoder's activations, which any trainer keeps whatever its log-prob code;
        # what the log-prob computation itself adds is the rest.
        own = fig("gapo_bwd") - fig("decoder_bwd")
        verdict = "meets" if model + own <= goal else "MISSES"
        print(f"gapo bwd minus the decoder's own fwd+bwd ({fig('decoder_bwd'):.3f} GiB): {own:.3f} GiB; "
              f"model + that = {(model + own) / (model + chunk):.2f} x (model + chunk), {verdict} the goal")
    for case in ("naive_fwd", "naive_bwd"):
        if case in res:
            p = fig(case)
            print(f"naive {case[6:]} at B={args.naive_batch}: peak {p:.3f} GiB above baseline; extrapolated to "
                  f"B={args.batch}: {p * args.batch / args.naive_batch:.2f} GiB")
    for case, what in (("decoder_bwd", "decoder alone fwd+bwd (B x L activations, attention)"),
                       ("chunk_fwd", "one chunk alone, fwd"), ("chunk_bwd", "one chunk alone, checkpointed fwd+bwd")):
        if case in res:
            print(f"diagnostic, {what}: {fig(case):.3f} GiB = {fig(case) / chunk:.2f} chunks")


if __name__ == "__main__":
    main()
