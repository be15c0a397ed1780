"""Run under torchrun by test_sync.py: a tiny gapo-train run (its command line, on each rank) whose weight sync is
broken on purpose, one way per run, by patching the trainer from outside (no fault switches in gapo itself). Writes each
rank's exit code and the run's train.log, where the console's messages go too.

Faults: drop (one tensor never leaves the trainer), stale (one tensor is pushed with its value from the first push,
one step old at the second), skip (the push after step 2 never happens)."""

import sys
from pathlib import Path

from result import write_result

from gapo.cli import train_main
from gapo.distributed import leave_distributed
from gapo.trainer import actor, sync

TENSOR = "model.layers.1.mlp.down_proj.weight"


def inject(fault: str) -> None:
    gathered = actor.Actor.gathered_weights
    if fault == "drop":
        def dropping(self, *args, **kwargs):
            yield from ((name, t) for name, t in gathered(self, *args, **kwargs) if name != TENSOR)

        actor.Actor.gathered_weights = dropping
    elif fault == "stale":
        first = {}

        def stale(self, *args, **kwargs):
            for name, t in gathered(self, *args, **kwargs):
                yield name, first.setdefault(name, t.clone()) if name == TENSOR else t

        actor.Actor.gathered_weights = stale
    elif fault == "skip":
        push = sync.push

        def skipping(engine, actor_, version, probe):
            return sync.Verified(push_s=0.0) if version == 2 else push(engine, actor_, version, probe)

        sync.push = skipping
    else:
        assert fault == "none", fault


def main(out_path: str, fault: str, run_dir: str, *overrides: str) -> None:
    import torch.distributed as dist

    inject(fault)
    code = train_main(["--config", "configs/tiny_cpu.yaml", f"trainer.output_dir={run_dir}", "tracking.mode=disabled",
                       *overrides])
    write_result(out_path, dist.get_rank(), {"code": code, "log": (Path(run_dir) / "train.log").read_text()})
    if code == 0:
        leave_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:])
