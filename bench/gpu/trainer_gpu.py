"""Trainer on one GPU (prepared for an H200): tokens/s and MFU of gapo's update at Qwen2.5-1.5B shape, and
response log-prob memory at real size, each against bare transformers.

    PYTHONPATH=. python bench/gpu/trainer_gpu.py [--reps 5] [--micro 4 1024] [--micro-per-step 4]
    .venv/bin/python bench/gpu/trainer_gpu.py --cpu-smoke     # the same code path, toy size, on the CPU

Needs torch + transformers only: no DeepSpeed or vLLM (the actor's DeepSpeed wrapper is left out; what is
measured is gapo's `response_logprobs`, the model's forward in training). Random init, bf16 weights, sdpa
attention. Takes a couple of minutes; fails at once without CUDA (unless --cpu-smoke).

(a) Throughput: Qwen2.5-1.5B shape (hidden 1536, 28 layers, 12 heads, 2 kv heads, intermediate 8960, vocab
151,936, tied embeddings). One optimizer step = `--micro-per-step` micro-batches of `--micro` B x L tokens
(1/4 prompt, 3/4 response), each forward + backward of a policy-gradient loss, then grad clipping and AdamW
(bf16 params and states, no fp32 master copy). gapo: `response_logprobs` (vocab projection on response
tokens only, LOGIT_CHUNK at a time, checkpointed). Bare: `model(...).logits` over all positions, float,
log_softmax, gather. The two alternate, `--reps` rounds after a warm-up round; median step time. tokens/s
counts every token (prompt + response). MFU = 6 x params x tokens/s / 989e12, assuming the H200's dense
bf16 peak of 989 TFLOP/s (SXM spec sheet); params count the tied embedding once; attention's L^2 FLOPs
are left out.

(b) Memory: the same width and vocab with 2 layers (so the vocab projection dominates), 8 x 4,096 response
tokens after a 64-token prompt; peak `torch.cuda.max_memory_allocated` above the baseline (model and
inputs built) for gapo's forward (no_grad) and forward + backward, and the naive full log-softmax, whose
OutOfMemoryError is caught and reported (that is itself the finding). Figures are printed last.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import torch

from gapo.trainer import logprobs  # needs torch only: no deepspeed, vllm or pydantic on the device

QWEN_1_5B = dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151_936)
TOY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
           vocab_size=4096)
PEAK_FLOPS = 989e12
GIB = 2**30


def build(shape: dict, layers: int, dev: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(**{**shape, "num_hidden_layers": layers}, tie_word_embeddings=True,
                      max_position_embeddings=8192, use_cache=False)
    torch.manual_seed(0)
    with torch.device(dev):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")


def micro_batch(dev: str, vocab: int, batch: int, prompt: int, resp: int, seed: int) -> logprobs.MicroBatch:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(vocab, (prompt,), generator=g).tolist() for _ in range(batch)]
    responses = [torch.randint(vocab, (resp,), generator=g).tolist() for _ in range(batch)]
    return logprobs.MicroBatch.pack(prompts, responses, pad_id=0).to(torch.device(dev))


def gapo_logp(model, mb: logprobs.MicroBatch) -> torch.Tensor:
    return logprobs.response_logprobs(model.get_decoder(), model.get_output_embeddings(), mb, 1.0)[0]


def bare_logp(model, mb: logprobs.MicroBatch) -> torch.Tensor:
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits  # [B, L, V]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, mb.input_ids[:, 1:, None]).squeeze(-1)
    return logp[:, -mb.resp_mask.shape[1]:]  # every response has the same length here


def loss_of(logp: torch.Tensor, mb: logprobs.MicroBatch) -> torch.Tensor:
    adv = torch.linspace(-1, 1, logp.shape[0], device=logp.device)[:, None]
    return -(logp * mb.resp_mask * adv).sum() / mb.resp_mask.sum()


def sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def train_step(model, opt, mbs: list[logprobs.MicroBatch], logp_fn) -> None:
    for mb in mbs:
        loss_of(logp_fn(model, mb), mb).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def peak_above(dev: str, fn) -> float | str:
    """GiB allocated at the peak of fn() above what was allocated before it; 'OOM' if it ran out."""
    if dev != "cuda":
        fn()
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    try:
        fn()
        torch.cuda.synchronize()
    except torch.cuda.OutOfMemoryError:
        return "OOM"
    return (torch.cuda.max_memory_allocated() - base) / GIB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--micro", type=int, nargs=2, default=[4, 1024], metavar=("B", "L"), help="micro-batch shape")
    ap.add_argument("--micro-per-step", type=int, default=4)
    ap.add_argument("--mem", type=int, nargs=2, default=[8, 4096], metavar=("B", "T"),
                    help="rollouts and response tokens of the memory part")
    ap.add_argument("--cpu-smoke", action="store_true", help="toy model and sizes on the CPU: checks the code path")
    args = ap.parse_args()
    if args.cpu_smoke:
        dev, dtype, shape, layers = "cpu", torch.float32, TOY, TOY["num_hidden_layers"]
        args.reps, args.micro, args.micro_per_step, args.mem = 1, [2, 64], 2, [2, 96]
        logprobs.LOGIT_CHUNK = 40  # several chunks, one of them split across rollouts
    elif not torch.cuda.is_available():
        sys.exit("trainer_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False); "
                 "--cpu-smoke runs the code path on the CPU at toy size")
    else:
        dev, dtype, shape, layers = "cuda", torch.bfloat16, QWEN_1_5B, QWEN_1_5B["num_hidden_layers"]
    print(f"device {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}, torch {torch.__version__}", flush=True)

    # (a) throughput
    B, L = args.micro
    model = build(shape, layers, dev, dtype)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0, fused=dev == "cuda")
    mbs = [micro_batch(dev, shape["vocab_size"], B, L // 4, L - L // 4, seed) for seed in range(args.micro_per_step)]
    tokens = sum(int(mb.attention_mask.sum()) for mb in mbs)
    with torch.no_grad():  # the two ways compute the same log-probs
        diff = (gapo_logp(model, mbs[0]) - bare_logp(model, mbs[0]) * mbs[0].resp_mask).abs().max()
    print(f"gapo vs bare log-probs: max |diff| {float(diff):.2e}", flush=True)
    times: dict[str, list[float]] = {"gapo": [], "bare": []}
    for rep in range(args.reps + 1):  # the first round is warm-up
        for name, fn in (("gapo", gapo_logp), ("bare", bare_logp)):
            sync(dev)
            tic = time.perf_counter()
            train_step(model, opt, mbs, fn)
            sync(dev)
            dt = time.perf_counter() - tic
            if rep:
                times[name].append(dt)
            print(f"round {rep} {name}: {dt:.3f} s", flush=True)
    del model, opt, mbs
    if dev == "cuda":
        torch.cuda.empty_cache()

    # (b) log-prob memory
    MB, MT = args.mem
    model = build(shape, 2, dev, dtype)
    model_gib = sum(p.numel() * p.element_size() for p in model.parameters()) / GIB
    mb = micro_batch(dev, shape["vocab_size"], MB, 64, MT, seed=0)

    def fwd(logp_fn):
        with torch.no_grad():
            logp_fn(model, mb)

    def fwd_bwd(logp_fn):
        loss_of(logp_fn(model, mb), mb).backward()
        model.zero_grad(set_to_none=True)

    mem: dict[str, float | str] = {}
    for name, run, logp_fn in (("gapo fwd", fwd, gapo_logp), ("gapo fwd+bwd", fwd_bwd, gapo_logp),
                               ("naive fwd", fwd, bare_logp), ("naive fwd+bwd", fwd_bwd, bare_logp)):
        mem[name] = peak_above(dev, functools.partial(run, logp_fn))
        print(f"memory {name}: {mem[name] if isinstance(mem[name], str) else f'{mem[name]:.3f} GiB'}", flush=True)

    steps = {k: statistics.median(v) for k, v in times.items()}
    label = "toy CPU smoke" if args.cpu_smoke else "Qwen2.5-1.5B shape"
    print(f"\n== trainer on one GPU ({label}, {params / 1e9:.3f}B params, {dtype}, sdpa; "
          f"{args.micro_per_step} micro-batches of {B} x {L} tokens, 3/4 response) ==")
    for name, what in (("gapo", "gapo response_logprobs"), ("bare", "bare transformers full logits")):
        tps = tokens / steps[name]
        print(f"{what}, fwd+bwd+AdamW: {steps[name]:.3f} s/step, {tps:.0f} tokens/s, "
              f"MFU {6 * params * tps / PEAK_FLOPS:.1%} (6 x params x tokens/s / 989 TFLOP/s, H200 dense bf16)")
    print(f"gapo/bare step time {steps['gapo'] / steps['bare']:.3f}")
    chunk = logprobs.LOGIT_CHUNK * shape["vocab_size"] * 4 / GIB
    goal = 1.3 * (model_gib + chunk)
    print(f"\n== response log-prob memory (2 layers, hidden {shape['hidden_size']}, vocab {shape['vocab_size']}, "
          f"{dtype} weights; {MB} x {MT} response tokens) ==")
    print(f"model {model_gib:.3f} GiB; one chunk's fp32 logits {chunk:.3f} GiB; a [B, T, V] fp32 tensor would be "
          f"{MB * MT * shape['vocab_size'] * 4 / GIB:.2f} GiB")
    print(f"goal: model + peak <= 1.3 x (model + one chunk) = {goal:.3f} GiB")
    for k, v in mem.items():
        if isinstance(v, str):  # an out-of-memory is itself the finding; gapo's path running out misses its goal
            print(f"{k}: {v} (torch.cuda.OutOfMemoryError){' MISSES' if k.startswith('gapo') else ''}")
        elif v != v:  # NaN: no CUDA allocator to read (the CPU), so nothing measured and nothing judged
            print(f"{k}: SKIP (no CUDA allocator: peak memory is measured on a GPU only)")
        else:
            verdict = ("meets" if model_gib + v <= goal else "MISSES") if k.startswith("gapo") else ""
            print(f"{k}: peak {v:.3f} GiB above baseline, model + peak {model_gib + v:.3f} GiB {verdict}".rstrip())


if __name__ == "__main__":
    main()
