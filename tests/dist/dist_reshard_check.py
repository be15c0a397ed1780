"""Run under torchrun by test_checkpoint.py: a checkpoint loaded on another number of ranks holds the state that
was saved. Two phases, each its own launch:

    save DIR DTYPE          two optimizer steps, a checkpoint of step 2 in DIR, then the state dump and one more step
    load DIR DTYPE SAVED    the step-2 checkpoint (written by SAVED ranks) loaded here, the state dump, one more step

The state dump (rank 0 writes DIR/<phase>.pt) is every parameter's full fp32 master weight and Adam moments,
the learning rate, the schedule's position and DeepSpeed's step counter, gathered from whatever ZeRO stage runs.
The extra step trains on the same global batch at either world size (every rank takes its slice of one list), so
its result shows whether the moments and the step count were also used right, up to float summation order."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from result import write_result
from transformers import AutoTokenizer

from gapo.configfile import resolve
from gapo.distributed import init_distributed, leave_distributed
from gapo.models import resolve_model
from gapo.trainer import checkpoint
from gapo.trainer.actor import Actor
from gapo.trainer.logprobs import MicroBatch

ROWS = 4  # rollouts of the global batch; one optimizer step over all of them


def step(actor: Actor, seed: int, rank: int, world: int) -> None:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 300, (5,), generator=g).tolist() for _ in range(ROWS)]
    responses = [torch.randint(3, 300, (6,), generator=g).tolist() for _ in range(ROWS)]
    share = ROWS // world
    mine = slice(rank * share, (rank + 1) * share)
    micro = 2
    for i in range(mine.start, mine.stop, micro):
        mb = MicroBatch.pack(prompts[i:i + micro], responses[i:i + micro], 0)
        lp, _ = actor.deepspeed(mb, 1.0)
        assert actor.backward(-(lp * mb.resp_mask).sum() / (ROWS * 6)) in (None, True)


def state(actor: Actor) -> dict:
    """Collective at stages 1-3 (the full tensors are gathered from the partitions)."""
    out = {}
    for name, p in actor.deepspeed.module.named_parameters():
        if actor.zero_stage == 0:
            opt = actor.deepspeed.optimizer.state[p]
            out[name] = [p.detach().float().clone(), opt["exp_avg"].clone(), opt["exp_avg_sq"].clone()]
        else:
            out[name] = [safe_get_full_fp32_param(p).clone(), safe_get_full_optimizer_state(p, "exp_avg").clone(),
                         safe_get_full_optimizer_state(p, "exp_avg_sq").clone()]
    return {"params": out, "lr": actor.lr(), "last_epoch": actor.scheduler.last_epoch,
            "global_steps": actor.deepspeed.global_steps}


def main(out: str, phase: str, root: str, dtype: str, saved: int | None = None) -> None:
    placement = init_distributed()
    rank, world = placement.rank, placement.world
    root = Path(root)
    # A schedule that moves at every optimizer step: a schedule restored at the wrong position shows in the lr.
    cfg = resolve({"model": {"path": "tiny-qwen2", "dtype": dtype},
                   "trainer": {"zero_stage": 3, "micro_batch_size": 2, "ppo_mini_batch_size": ROWS, "lr": 1e-3,
                               "lr_schedule": "cosine", "total_steps": 8, "warmup_steps": 1,
                               "output_dir": str(root / "run")},
                   "rollout": {"prompts_per_step": 2, "group_size": 2}})
    model_dir = str(resolve_model("tiny-qwen2"))
    ckpt = root / "run" / "checkpoints" / "step_000002"
    actor = Actor(cfg, model_dir, load_universal=phase == "load" and saved != world)
    if phase == "save":
        step(actor, 1, rank, world)
        step(actor, 2, rank, world)
        checkpoint.save(actor, AutoTokenizer.from_pretrained(model_dir), cfg, checkpoint.TrainerState(
            step=2, sampler={"epoch": 0, "pos": 0, "n": 1, "seed": 0}, world_size=world), root / "run")
    else:
        checkpoint.load(actor, ckpt, saved, root / "run")
    dump = state(actor)
    step(actor, 3, rank, world)
    dump["next"] = {name: t[0] for name, t in state(actor)["params"].items()}
    dump.update(stage=actor.zero_stage, world=world, reshard_left=(root / "run" / checkpoint.RESHARD).exists())
    dist.barrier()
    if rank == 0:
        torch.save(dump, root / f"{phase}.pt")
    write_result(out, rank, {"stage": actor.zero_stage})


if __name__ == "__main__":
    main(*sys.argv[1:5], *(int(x) for x in sys.argv[5:]))
    leave_distributed()
