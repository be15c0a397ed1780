"""Run under torchrun by test_engine.py: does the DeepSpeed actor accumulate gradients over micro-batches
and ranks exactly like one plain torch backward over all of them? Writes one JSON result per rank."""

import sys

import torch
import torch.distributed as dist
from result import write_result

from gapo.configfile import resolve
from gapo.distributed import init_distributed, leave_distributed
from gapo.models import resolve_model
from gapo.trainer.actor import Actor
from gapo.trainer.logprobs import MicroBatch, response_logprobs


def main(out_path: str, stage: int) -> None:
    placement = init_distributed()
    rank, world = placement.rank, placement.world
    cfg = resolve({"model": {"path": "tiny-qwen2"}, "trainer": {"zero_stage": stage, "micro_batch_size": 2,
                                                              "ppo_mini_batch_size": 8, "grad_clip": 1e9},
                   "rollout": {"prompts_per_step": 2, "group_size": 4}})
    model_dir = str(resolve_model("tiny-qwen2"))
    micro = 8 // world // 2
    actor = Actor(cfg, model_dir)
    g = torch.Generator().manual_seed(0)
    # Micro-batches 0 and 2 repeat one prompt (run once on a shared KV cache, two decoder calls per forward),
    # 1 and 3 have two different prompts; the torch reference runs every rollout whole.
    prompts = [[torch.randint(3, 300, (5,), generator=g).tolist()] * 2 if j % 2 == 0 else
               [torch.randint(3, 300, (5,), generator=g).tolist() for _ in range(2)] for j in range(4)]
    responses = [[torch.randint(3, 300, (6,), generator=g).tolist() for _ in range(2)] for _ in range(4)]
    mbs = [MicroBatch.pack(p, r, 0, share_prompts=True) for p, r in zip(prompts, responses, strict=True)]
    assert [mb.shared is not None for mb in mbs] == [True, False, True, False]
    plain = [MicroBatch.pack(p, r, 0) for p, r in zip(prompts, responses, strict=True)]
    mine = mbs[rank * micro:(rank + 1) * micro]
    tokens = sum(float(mb.resp_mask.sum()) for mb in mbs)  # the step-global normaliser
    for mb in mine:
        lp, _ = actor.deepspeed(mb, 1.0)
        actor.backward(-(lp * mb.resp_mask).sum() / tokens)
    ds_norm = actor.grad_norm()

    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    total = sum(-(response_logprobs(ref.get_decoder(), ref.get_output_embeddings(), mb, 1.0)[0] * mb.resp_mask).sum()
                for mb in plain) / tokens
    total.backward()
    ref_norm = float(torch.sqrt(sum((p.grad ** 2).sum() for p in ref.parameters())))
    last = ref.zero_grad() or -(response_logprobs(ref.get_decoder(), ref.get_output_embeddings(), plain[-1], 1.0)[0]
                                * plain[-1].resp_mask).sum() / tokens
    last.backward()
    last_norm = float(torch.sqrt(sum((p.grad ** 2).sum() for p in ref.parameters())))
    dist.barrier()
    write_result(out_path, rank, {"ds": ds_norm, "torch": ref_norm, "last_micro_only": last_norm})


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
    leave_distributed()
