"""Run under torchrun by test_gpu_paths.py: the process group's timeout reaches every collective, and a run
directory that the ranks do not share is refused on every rank. Writes one JSON per rank."""

import sys
import time
from pathlib import Path

import torch.distributed as dist
from result import write_result

from gapo.errors import ConfigError
from gapo.distributed import init_distributed
from gapo.trainer.checkpoint import check_shared_filesystem


def main(out_path: str, tmp: str) -> None:
    rank = init_distributed(timeout_min=0.05).rank  # 3 s
    result = {}
    check_shared_filesystem(Path(tmp) / "shared")  # both ranks see it: nothing happens
    try:  # each rank its own directory: to the program, two filesystems
        check_shared_filesystem(Path(tmp) / f"rank{rank}")
        result["unshared"] = "accepted"
    except ConfigError as err:
        result["unshared"] = str(err)
    result["probe_left"] = sorted(p.name for p in Path(tmp).rglob(".gapo-shared-fs-*"))
    dist.barrier()
    if rank == 1:
        time.sleep(8)  # past the 3 s timeout: rank 0's barrier must give up, not wait DeepSpeed's 10 minutes
    tic = time.monotonic()
    try:
        dist.barrier()
        result["late_barrier"] = "returned"
    except RuntimeError as err:
        result["late_barrier"] = f"{type(err).__name__}: {str(err)[:200]}"
    result["waited_s"] = time.monotonic() - tic
    write_result(out_path, rank, result)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
