"""Generation throughput: gapo's vLLM engine vs transformers `generate` on the same model and prompts.

    .venv/bin/python bench/generation.py [--reps 3] [--max-new-tokens 64]

SmolLM2-135M-Instruct in fp32 on the CPU, 8 arithmetic chat prompts, k = 8 samples each, at most 64 new
tokens, temperature 1, one process. Two comparisons, each side alternating with the other, `--reps` rounds
after a warm-up round, medians reported:

- engines: gapo's own `VLLMEngine.generate` vs `HFEngine.generate` (one `generate` call per prompt, its k
  samples batched, as gapo uses it). Samples stop at EOS, so the two sides generate different numbers of
  tokens; each is credited with the tokens it returned (HF also computes padding after a sample's EOS).
- fixed length: EOS ignored, so both generate exactly 64 tokens per sample. gapo's engines cannot ignore
  EOS, so this calls what they wrap directly, with their settings otherwise: vLLM's `LLM.generate` with
  `SamplingParams(ignore_eos=True, logprobs=0)` and HF `model.generate(min_new_tokens=64, output_logits=True)`
  with all 64 samples in one left-padded batch (as TRL calls it; HF's best case on this work).

Figures: generated tokens/s of each side and the ratio vLLM/HF, printed last.
"""

from __future__ import annotations

import argparse
import time

import torch
from _util import cpu_line, median

from gapo.data import arithmetic_problems, build_prompt_ids
from gapo.distributed import init_distributed
from gapo.models import resolve_model
from gapo.rollout.engine import build_engine
from gapo.rollout.hf_engine import HFEngine
from gapo.rollout.types import SamplingConfig

K = 8


def vllm_fixed(engine, prompts: list[list[int]], seeds: list[int], new: int) -> int:
    from vllm import SamplingParams

    params = [SamplingParams(n=K, temperature=1.0, max_tokens=new, ignore_eos=True, seed=s, logprobs=0) for s in seeds]
    outs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return sum(len(c.token_ids) for o in outs for c in o.outputs)


@torch.no_grad()
def hf_fixed(engine: HFEngine, prompts: list[list[int]], seeds: list[int], new: int) -> int:
    """All 64 samples in one `generate` call (prompts left-padded), as TRL batches them: HF's best case."""
    width = max(len(p) for p in prompts)
    pad = engine.tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    att = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(seeds[0])
    out = engine.model.generate(ids, attention_mask=att, do_sample=True, temperature=1.0, top_k=0,
                                min_new_tokens=new, max_new_tokens=new, num_return_sequences=K,
                                output_logits=True, return_dict_in_generate=True, pad_token_id=pad)
    return out.sequences[:, width:].numel()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64, help="smaller for a quick check (the run takes ~10 min)")
    args = ap.parse_args()
    new = args.max_new_tokens

    init_distributed()
    model_dir = str(resolve_model("smollm2-135m"))
    vllm = build_engine("vllm", model_dir, dtype="float32", seed=0, max_model_len=192)
    hf = HFEngine(model_dir)
    problems = arithmetic_problems(8, seed=7, levels=["add_small", "add_2digit", "sub_2digit", "mul_small"])
    prompts = [build_prompt_ids(hf.tokenizer, p, "Put the final answer in \\boxed{}.") for p in problems]
    sampling = SamplingConfig(n=K, temperature=1.0, top_p=1.0, max_new_tokens=new)

    def engine_run(engine, seeds: list[int]) -> int:
        return sum(len(r.response_ids) for g in engine.generate(prompts, sampling, seeds) for r in g)

    sides = {"engine vllm": lambda s: engine_run(vllm, s), "engine hf": lambda s: engine_run(hf, s),
             "fixed vllm": lambda s: vllm_fixed(vllm, prompts, s, new),
             "fixed hf": lambda s: hf_fixed(hf, prompts, s, new)}
    rates: dict[str, list[float]] = {name: [] for name in sides}
    tokens: dict[str, list[int]] = {name: [] for name in sides}
    print(f"torch threads {torch.get_num_threads()}, prompt lengths {[len(p) for p in prompts]}", flush=True)
    for rep in range(args.reps + 1):  # the first round is warm-up
        seeds = [1000 * rep + i for i in range(len(prompts))]
        for name, run in sides.items():
            tic = time.perf_counter()
            n = run(seeds)
            dt = time.perf_counter() - tic
            if rep:
                rates[name].append(n / dt)
                tokens[name].append(n)
            print(f"round {rep} {name}: {n} tokens in {dt:.2f} s, {n / dt:.0f} tokens/s", flush=True)
    print(f"\n== generation: vLLM vs transformers generate (SmolLM2-135M fp32 CPU, 8 prompts x {K}, "
          f"<= {new} new tokens, temperature 1) ==\n{cpu_line()}")
    for variant in ("engine", "fixed"):
        v, h = median(rates[f"{variant} vllm"]), median(rates[f"{variant} hf"])
        label = ("gapo's engines (stop at EOS; HFEngine: one generate call per prompt)" if variant == "engine" else
                 f"EOS ignored ({new} tokens per sample; HF: all samples in one batched generate call)")
        per_round = [a / b for a, b in zip(rates[f"{variant} vllm"], rates[f"{variant} hf"], strict=True)]
        print(f"{label}: vLLM {v:.0f} tokens/s ({median(tokens[f'{variant} vllm']):.0f} tokens), "
              f"HF {h:.0f} tokens/s ({median(tokens[f'{variant} hf']):.0f} tokens), ratio vLLM/HF {v / h:.2f} "
              f"(per round {min(per_round):.2f}-{max(per_round):.2f}, {len(per_round)} rounds)   (goal >= 3)")


if __name__ == "__main__":
    main()
