"""Run under torchrun by test_engine.py: a model whose EOS is <|endoftext|> (a base model's generation config)
but whose chat turns end with <|im_end|>. Writes the response token ids sampled by vLLM with and without
the stop tokens that gapo derives from the chat template, and how many frames torch.compile saw meanwhile; and, from
the same engine (one build), rollouts sampled at top_p 1.0 and 0.9 with their engine log-probs (issue 52: vLLM's
processed log-probs are renormalised over the nucleus)."""

import sys

from result import write_result
from torch._dynamo.utils import counters
from transformers import AutoTokenizer

from gapo.config import MATH_INSTRUCTION
from gapo.data import arithmetic_problems, build_prompt_ids, stop_token_ids
from gapo.distributed import init_distributed, leave_distributed
from gapo.rollout.types import SamplingConfig
from gapo.rollout.vllm_engine import VLLMEngine


def main(out_path: str, model_dir: str) -> None:
    init_distributed()
    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = VLLMEngine(model_dir, dtype="float32", seed=0, max_model_len=256, kv_cache_gb=0.25, compile="eager")
    prompts = [build_prompt_ids(tok, p, MATH_INSTRUCTION)
               for p in arithmetic_problems(4, seed=7, levels=["add_small"])]
    out = {"stop_ids": list(stop_token_ids(tok)), "im_end": tok.convert_tokens_to_ids("<|im_end|>")}
    for name, stops in (("with", stop_token_ids(tok)), ("without", ())):
        groups = engine.generate(prompts, SamplingConfig(n=4, temperature=1.0, top_p=1.0, max_new_tokens=40,
                                                         stop_token_ids=stops), seeds=[1, 2, 3, 4])
        out[name] = [[x.response_ids, x.text] for g in groups for x in g]
    out["frames_compiled"] = counters["frames"]["total"]  # compile="eager": none, vLLM's sampler included
    for top_p in (1.0, 0.9):
        groups = engine.generate(prompts, SamplingConfig(n=4, temperature=1.0, top_p=top_p, max_new_tokens=24,
                                                         stop_token_ids=stop_token_ids(tok)), seeds=[5, 6, 7, 8])
        out[f"top_p {top_p}"] = [[x.prompt_ids, x.response_ids, x.logprobs] for g in groups for x in g]
    write_result(out_path, 0, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    leave_distributed()
