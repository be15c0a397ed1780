"""Run under torchrun by test_token_budget.py: a mini-batch's gradient is the same whether its rollouts are
packed by count or by token budget, and equals one plain torch backward over all of them. Rank 0 holds the
long rollouts, so by budget the ranks need different micro-batch counts and must agree on one. Writes one
JSON result per rank."""

import sys

import torch
import torch.distributed as dist
from result import write_result

from gapo.configfile import resolve
from gapo.distributed import init_distributed, leave_distributed
from gapo.models import resolve_model
from gapo.trainer.actor import Actor
from gapo.trainer.logprobs import MicroBatch, micro_batch_rows, response_logprobs

N = 16  # rollouts in the mini-batch, over all ranks
SPLITS = {"count_4": (4, None), "budget_48": (8, 48), "budget_120": (8, 120)}  # (max rows, token budget)


def main(out_path: str, stage: int) -> None:
    placement = init_distributed()
    rank, world = placement.rank, placement.world
    cfg = resolve({"model": {"path": "tiny-qwen2"}, "rollout": {"prompts_per_step": 2, "group_size": 8},
                   "trainer": {"zero_stage": stage, "micro_batch_size": 8, "ppo_mini_batch_size": 16,
                               "grad_clip": 1e9, "lr": 1e-30}})  # lr: the weights stay put between splits
    model_dir = str(resolve_model("tiny-qwen2"))
    actor = Actor(cfg, model_dir)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (5,), generator=g).tolist() for _ in range(N)]
    lens = [40 - 2 * i for i in range(N)]  # rank 0's shard is the long half
    responses = [torch.randint(3, 300, (n,), generator=g).tolist() for n in lens]
    tokens = float(sum(lens))  # the step-global normaliser
    mine = range(rank * N // world, (rank + 1) * N // world)
    lengths = [len(prompts[i]) + len(responses[i]) for i in mine]
    out = {}
    for name, (max_rows, budget) in SPLITS.items():
        local = len(micro_batch_rows(lengths, max_rows, budget))
        count = torch.tensor(local)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        bins = micro_batch_rows(lengths, max_rows, budget, int(count))
        padded = 0
        for j, b in enumerate(bins):
            mb = MicroBatch.pack([prompts[mine[i]] for i in b], [responses[mine[i]] for i in b], 0)
            padded += mb.input_ids.numel()
            actor.deepspeed.set_gradient_accumulation_boundary(j == len(bins) - 1)
            lp, _ = actor.deepspeed(mb, 1.0)
            actor.backward(-(lp * mb.resp_mask).sum() / tokens)
        out[name] = {"norm": actor.grad_norm(), "local_count": local, "count": len(bins), "padded": padded,
                     "rows": sorted(i for b in bins for i in b)}

    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    whole = MicroBatch.pack(prompts, responses, 0)
    (-(response_logprobs(ref.get_decoder(), ref.get_output_embeddings(), whole, 1.0)[0] * whole.resp_mask).sum()
     / tokens).backward()
    out["torch"] = float(torch.sqrt(sum((p.grad ** 2).sum() for p in ref.parameters())))
    dist.barrier()
    write_result(out_path, rank, out)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
    leave_distributed()
