"""Run under torchrun by test_engine.py: after an update and a weight push, does every rank's vLLM engine
score fixed sequences exactly like the ZeRO-3 trainer? Writes one JSON result per rank to argv[1]."""

import sys

import torch
from result import write_result

import gapo.trainer.logprobs as logprobs_mod
from gapo.configfile import resolve
from gapo.data import arithmetic_problems, build_prompt_ids
from gapo.distributed import init_distributed, leave_distributed
from gapo.models import resolve_model
from gapo.rollout.hf_engine import HFEngine
from gapo.rollout.vllm_engine import VLLMEngine
from gapo.trainer.actor import Actor
from gapo.trainer.logprobs import MicroBatch


def engine_logprobs(engine: VLLMEngine, seqs: list[list[int]]) -> list[list[float]]:
    from vllm import SamplingParams

    outs = engine.llm.generate([{"prompt_token_ids": s} for s in seqs],
                               SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0), use_tqdm=False)
    return [[o.prompt_logprobs[i][t].logprob for i, t in enumerate(s) if i > 0]
            for o, s in zip(outs, seqs, strict=True)]


def main(out_path: str) -> None:
    placement = init_distributed()
    rank, world = placement.rank, placement.world
    cfg = resolve({"model": {"path": "tiny-qwen2"}, "trainer": {"zero_stage": 3, "lr": 3e-3, "micro_batch_size": 4,
                                                              "ppo_mini_batch_size": 8},
                   # whole sequences are scored as responses here: the run's logit-chunk count must hold them
                   "rollout": {"prompts_per_step": 2, "group_size": 8, "max_new_tokens": 400}})
    model_dir = str(resolve_model("tiny-qwen2"))
    engine = VLLMEngine(model_dir, dtype="float32", seed=rank, max_model_len=1024, kv_cache_gb=0.25)
    logprobs_mod.LOGIT_CHUNK = 7  # chunks that split sequences (before the Actor fixes its chunk count)
    actor = Actor(cfg, model_dir)
    tok = engine.tokenizer
    # Prompts longer than one 128-token KV block, so a stale prefix cache would show.
    long_prefix = "Consider carefully. " * 12
    problems = arithmetic_problems(4, seed=7 + rank)
    seqs = [build_prompt_ids(tok, p, long_prefix) + tok(f"The answer is \\boxed{{{p.gold}}}.")["input_ids"]
            for p in problems]
    mb = MicroBatch.pack([s[:1] for s in seqs], [s[1:] for s in seqs], tok.pad_token_id)

    before = engine_logprobs(engine, seqs)  # cache the prefixes with the initial weights
    # One real update (different data per rank, so gradients are all-reduced for real).
    logp, _ = actor.deepspeed(mb, 1.0)
    actor.backward(-(logp * mb.resp_mask).sum() / mb.resp_mask.sum())
    with torch.no_grad():
        trainer = actor.deepspeed(mb, 1.0)[0]
    engine.push_weights(actor.gathered_weights(bucket_numel=20_000), version=1)  # tiny buckets: many gather rounds
    after = engine_logprobs(engine, seqs)

    hf = HFEngine(model_dir)
    hf.push_weights(actor.gathered_weights(), version=1)
    with torch.no_grad():
        h = hf.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits.float()
        hf_lp = torch.log_softmax(h, -1).gather(-1, mb.input_ids[:, 1:, None]).squeeze(-1)
    diffs = {"after": 0.0, "before": 0.0, "hf": 0.0}
    for i, s in enumerate(seqs):
        n = len(s) - 1
        t = trainer[i, :n]
        diffs["after"] = max(diffs["after"], float((t - torch.tensor(after[i])).abs().max()))
        diffs["before"] = max(diffs["before"], float((t - torch.tensor(before[i])).abs().max()))
        diffs["hf"] = max(diffs["hf"], float((t - hf_lp[i, :n]).abs().max()))
    write_result(out_path, rank, {"rank": rank, "world": world, **diffs})


if __name__ == "__main__":
    main(sys.argv[1])
    leave_distributed()
