"""The DeepSpeed actor as the paper configs build it (bf16, ZeRO-3, several ranks): gradients accumulate and
travel in fp32, and a non-finite step never reaches the weights."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}


@pytest.mark.parametrize("dtype, stage, nproc, ran_at", [
    ("float32", 3, 1, 0),  # one rank: stage 0, where DeepSpeed itself would apply a NaN step
    ("bfloat16", 3, 1, 1),  # one rank in bf16: stage 1 (fp32 accumulation is refused at stage 0)
    ("bfloat16", 3, 2, 3),
    ("float32", 2, 2, 2),
])
def test_actor_accumulates_in_fp32_and_skips_a_nan_step(tmp_path, dtype, stage, nproc, ran_at):
    out = tmp_path / "actor"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                        "tests/dist_actor_check.py", str(out), dtype, str(stage)], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    for rank in range(nproc):
        res = json.loads(Path(f"{out}.{rank}").read_text())
        assert res["stage"] == ran_at
        if dtype == "bfloat16":
            assert (res["model_dtype"], res["accum_dtype"], res["comm_dtype"]) == (
                "torch.bfloat16", "torch.float32", "torch.float32")
        assert res["applied_False"] == [True, True]
        assert res["applied_True"] == [True, False, True]
        assert res["nan_step_grad_norm"] != res["nan_step_grad_norm"] or res["nan_step_grad_norm"] == float("inf")
        assert res["untouched"], "the NaN step changed the weights"
        # good, NaN, good ends exactly where good, good does: the optimizer state (Adam moments, step count)
        # did not see the NaN step either
        assert res["same_end"]


def test_zero3_gathers_the_vocab_head_once_per_forward_and_once_per_backward(tmp_path):
    """Six logit chunks used to mean six all-gathers of the (tied) head in forward and as many again when
    backward recomputes them (7 and 20 with the embedding's own, measured before the change)."""
    out = tmp_path / "gathers"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        "tests/dist_head_gather_check.py", str(out)], cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    for rank in range(2):
        res = json.loads(Path(f"{out}.{rank}").read_text())
        assert res["chunks"] == 6 and (res["forward"], res["total"]) == (1, 2), res
