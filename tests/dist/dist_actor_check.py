"""Run under torchrun by test_actor.py: the DeepSpeed actor as a paper config builds it.

For a given dtype and ZeRO stage it reports (one JSON per rank): the built engine's gradient-accumulation
and communication dtypes, and whether an optimizer step with a NaN loss was skipped without touching the
weights or the optimizer state (good, NaN, good must end where good, good ends)."""

import sys

import torch
import torch.distributed as dist
from result import write_result

from gapo.configfile import resolve
from gapo.distributed import init_distributed, leave_distributed
from gapo.models import resolve_model
from gapo.trainer.actor import Actor
from gapo.trainer.logprobs import MicroBatch

LINEAR = torch.nn.functional.linear  # before any zero.Init: it must be this again once the actor is built


def batches(seed: int, rank: int) -> list[MicroBatch]:
    g = torch.Generator().manual_seed(seed * 10 + rank)
    return [MicroBatch.pack([torch.randint(3, 300, (5,), generator=g).tolist() for _ in range(2)],
                            [torch.randint(3, 300, (6,), generator=g).tolist() for _ in range(2)], 0)
            for _ in range(2)]


def step(actor: Actor, mbs: list[MicroBatch], poison: bool) -> bool:
    applied = None
    for mb in mbs:
        lp, _ = actor.deepspeed(mb, 1.0)
        loss = -(lp * mb.resp_mask).sum() / 24.0
        applied = actor.backward(loss * float("nan") if poison else loss)
    return applied


def weights(actor: Actor) -> dict[str, torch.Tensor]:
    return {name: t.detach().float().clone() for name, t in actor.gathered_weights()}


def main(out_path: str, dtype: str, stage: int, offload: str = "none") -> None:
    placement = init_distributed()
    rank, world = placement.rank, placement.world
    # A schedule that moves at every optimizer step, so that a skipped step advancing it would show.
    cfg = resolve({"model": {"path": "tiny-qwen2", "dtype": dtype},
                   "trainer": {"zero_stage": stage, "micro_batch_size": 2, "ppo_mini_batch_size": 4 * world,
                               "lr": 1e-3, "lr_schedule": "cosine", "total_steps": 6, "warmup_steps": 1,
                               "offload": {"optimizer": "cpu" if offload != "none" else "none",
                                           "params": "cpu" if offload == "params" else "none"}},
                   "rollout": {"prompts_per_step": world, "group_size": 4},
                   "algorithm": {"kl_coef": 0.1}})  # a reference copy too: it loads as the actor does
    model_dir = str(resolve_model("tiny-qwen2"))
    result = {}
    ends = []
    for poison in (False, True):
        actor = Actor(cfg, model_dir)
        model_dtype, accum_dtype = actor.deepspeed.get_data_types()
        result.update(stage=actor.zero_stage, model_dtype=str(model_dtype), accum_dtype=str(accum_dtype),
                      comm_dtype=str(actor.deepspeed.communication_data_type))
        applied = [step(actor, batches(0, rank), False)]
        if poison:
            before = weights(actor)
            applied.append(step(actor, batches(1, rank), True))
            result["nan_step_grad_norm"] = actor.grad_norm()
            result["untouched"] = all(torch.equal(before[k], v) for k, v in weights(actor).items())
        applied.append(step(actor, batches(2, rank), False))
        result[f"applied_{poison}"] = applied
        ends.append(weights(actor))
        result[f"lr_end_{poison}"] = actor.lr()
        result["linear_restored"] = torch.nn.functional.linear is LINEAR
        result["ref_partitioned"] = all(hasattr(p, "ds_id") for p in actor.reference.module.parameters())
        result["reduce_bucket"] = actor.deepspeed.zero_reduce_bucket_size()
        ds = actor.deepspeed
        result["offloaded"] = [bool(ds.zero_offload_optimizer()), bool(ds.zero_offload_param())]
    result["same_end"] = all(torch.equal(ends[0][k], ends[1][k]) for k in ends[0])
    dist.barrier()
    write_result(out_path, rank, result)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), *sys.argv[4:])
    leave_distributed()
