"""Run under torchrun by test_token_budget.py: prompt sharing is agreed across ranks. Rank 0's micro-batch repeats
one prompt (it could share its KV cache), rank 1's does not: under ZeRO-3 the ranks must still run the same module
calls, so neither shares, and a forward + backward + step completes on both. When both repeat a prompt, both
share. Writes one JSON per rank."""

import sys

import torch
from result import write_result

from gapo.configfile import resolve
from gapo.distributed import init_distributed, leave_distributed
from gapo.models import resolve_model
from gapo.rollout.types import Rollout
from gapo.trainer.actor import Actor
from gapo.trainer.logprobs import pack_step


def rollouts(rank: int, repeat: bool) -> list[Rollout]:
    g = torch.Generator().manual_seed(rank)
    prompts = [torch.randint(3, 300, (6,), generator=g).tolist()] * 4 if repeat else \
        [torch.randint(3, 300, (6,), generator=g).tolist() for _ in range(4)]
    return [Rollout(p, torch.randint(3, 300, (5,), generator=g).tolist(), [-1.0] * 5, False, "") for p in prompts]


def main(out_path: str) -> None:
    rank = init_distributed().rank
    cfg = resolve({"model": {"path": "tiny-qwen2"}, "rollout": {"prompts_per_step": 2, "group_size": 4},
                   "trainer": {"zero_stage": 3, "micro_batch_size": 4, "ppo_mini_batch_size": 8, "lr": 1e-3}})
    actor = Actor(cfg, str(resolve_model("tiny-qwen2")))
    result = {}
    for case, repeat in (("mixed", rank == 0), ("both", True)):
        rs = rollouts(rank, repeat)
        n = len(rs)
        (mini,) = pack_step(rs, torch.ones(n), torch.ones(n, dtype=torch.long), torch.full((n,), 4),
                            torch.ones(n, dtype=torch.bool), mini=4, micro=4, max_tokens=None, pad_id=0,
                            share_prompts=True, device=actor.device)
        (mb,) = mini
        actor.deepspeed.set_gradient_accumulation_boundary(True)
        logp, _ = actor.deepspeed(mb, 1.0)
        actor.backward(-(logp * mb.resp_mask).sum() / 40.0)
        result[case] = {"shared": mb.shared is not None, "grad_norm": actor.grad_norm()}
    write_result(out_path, rank, result)


if __name__ == "__main__":
    main(sys.argv[1])
    leave_distributed()
