"""Run under torchrun by test_actor.py: ZeRO-3's prefetch trace over steps as the loop runs them, a no-grad
old-log-prob pass over two micro-batches, then their forwards + backwards, the micro-batches holding different
numbers of response tokens (across logit-chunk boundaries) from step to step. DeepSpeed invalidates its module
trace, and checks module orders across ranks again, whenever a forward calls modules in another sequence; with a
chunk count fixed for the run it must settle. (A forward-only pass follows a prefix of the forward + backward
trace, so it keeps a settled trace; only a step of one micro-batch per pass, alternating the two, never settles.)
Writes one JSON per rank."""

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

CHUNK = 8  # response tokens per logit chunk: 2 rows x 4 or 12 tokens = 1 or 3 chunks


def main(out_path: str) -> None:
    rank = init_distributed().rank
    logprobs_module.LOGIT_CHUNK = CHUNK
    cfg = resolve({"model": {"path": "tiny-qwen2"}, "rollout": {"prompts_per_step": 2, "group_size": 2,
                                                              "max_new_tokens": 12},
                   "trainer": {"zero_stage": 3, "micro_batch_size": 2, "ppo_mini_batch_size": 4}})
    actor = Actor(cfg, str(resolve_model("tiny-qwen2")))
    invalidations = []
    original = PartitionedParameterCoordinator._invalidate_trace

    def counting(self):
        invalidations.append(step)
        return original(self)

    PartitionedParameterCoordinator._invalidate_trace = counting
    g = torch.Generator().manual_seed(rank)
    for step in range(8):
        new = 12 if step % 2 else 4  # alternately 3 and 1 chunks' worth of response tokens
        mbs = [MicroBatch.pack([torch.randint(3, 300, (5,), generator=g).tolist() for _ in range(2)],
                               [torch.randint(3, 300, (new,), generator=g).tolist() for _ in range(2)], 0)
               for _ in range(2)]
        # As the loop runs a step: the old-log-prob pass over its micro-batches (no grad, forwards only, a prefix of
        # the trace), then the updates (forward + backward).
        actor.deepspeed.train()
        with torch.no_grad():
            for mb in mbs:
                actor.deepspeed(mb, 1.0, entropy=True)
        for i, mb in enumerate(mbs):
            actor.deepspeed.set_gradient_accumulation_boundary(i == len(mbs) - 1)
            lp, _ = actor.deepspeed(mb, 1.0)
            actor.backward(-(lp * mb.resp_mask).sum() / 24.0)
    write_result(out_path, rank, {"invalidations": invalidations, "chunks": actor.deepspeed.module.n_chunks})


if __name__ == "__main__":
    main(sys.argv[1])
    leave_distributed()
