"""Run under torchrun by test_actor.py: how many times ZeRO-3 all-gathers the vocabulary head's weight in one
training forward + backward whose response tokens span many logit chunks. Writes one JSON result per rank."""

import sys

import torch
from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
from result import write_result

import gapo.trainer.logprobs as logprobs_module
from gapo.configfile import resolve
from gapo.distributed import init_distributed, leave_distributed
from gapo.models import resolve_model
from gapo.trainer.actor import Actor
from gapo.trainer.logprobs import MicroBatch

CHUNK = 4  # response tokens per logit chunk: 2 rollouts x 12 tokens = 6 chunks


def main(out_path: str) -> None:
    rank = init_distributed().rank
    logprobs_module.LOGIT_CHUNK = CHUNK
    cfg = resolve({"model": {"path": "tiny-qwen2"}, "rollout": {"prompts_per_step": 2, "group_size": 2},
                   "trainer": {"zero_stage": 3, "micro_batch_size": 2, "ppo_mini_batch_size": 4}})
    actor = Actor(cfg, str(resolve_model("tiny-qwen2")))
    head = actor.module.get_output_embeddings().weight
    gathers = {"head": 0}
    original = PartitionedParameterCoordinator._PartitionedParameterCoordinator__all_gather_params

    def counting(self, params, forward):
        gathers["head"] += sum(p.ds_id == head.ds_id for p in params)
        return original(self, params, forward)

    PartitionedParameterCoordinator._PartitionedParameterCoordinator__all_gather_params = counting
    g = torch.Generator().manual_seed(rank)
    mb = MicroBatch.pack([torch.randint(3, 300, (5,), generator=g).tolist() for _ in range(2)],
                         [torch.randint(3, 300, (12,), generator=g).tolist() for _ in range(2)], 0)
    lp, _ = actor.deepspeed(mb, 1.0)
    forward = gathers["head"]
    actor.backward(-(lp * mb.resp_mask).sum() / 48.0)
    write_result(out_path, rank, {"forward": forward, "total": gathers["head"], "chunks": 24 // CHUNK,
                   "grad_norm": actor.grad_norm()})


if __name__ == "__main__":
    main(sys.argv[1])
    leave_distributed()
