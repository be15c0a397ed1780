"""Run under torchrun by test_gpu_paths.py: a built-in model first needed by rank 1 of a process group (rank 0
does not ask for it) comes out whole. transformers 5 writes save_pretrained only on torch.distributed's rank 0,
so a build inside rank 1 wrote the tokenizer alone. Writes one JSON per rank."""

import os
import sys

import torch.distributed as dist
from result import write_result

from gapo.distributed import init_distributed, leave_distributed
from gapo.models import resolve_model


def main(out_path: str, cache: str) -> None:
    os.environ["GAPO_CACHE"] = cache  # a cache of its own: the model is built here, by rank 1
    rank = init_distributed().rank
    files = sorted(p.name for p in resolve_model("tiny-llama").iterdir()) if rank == 1 else []
    dist.barrier()
    write_result(out_path, rank, {"files": files})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    leave_distributed()
