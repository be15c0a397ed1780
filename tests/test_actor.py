"""The DeepSpeed actor as the paper configs build it (bf16, ZeRO-3, several ranks): gradients accumulate and
travel in fp32, and a non-finite step never reaches the weights."""

import pytest


@pytest.mark.dist
@pytest.mark.parametrize("dtype, stage, nproc, ran_at, offload", [
    ("float32", 3, 1, 0, "none"),  # one rank: stage 0, where DeepSpeed itself would apply a NaN step
    ("bfloat16", 3, 1, 1, "none"),  # one rank in bf16: stage 1 (fp32 accumulation is refused at stage 0)
    ("bfloat16", 3, 2, 3, "none"),
    ("float32", 2, 2, 2, "none"),
    # trainer.offload (ZeRO-Offload on DeepSpeed's CPU accelerator): one rank runs the stage the offload needs
    ("float32", 3, 1, 2, "optimizer"),
    ("float32", 3, 2, 3, "params"),
])
def test_actor_accumulates_in_fp32_and_skips_a_nan_step(torchrun, dtype, stage, nproc, ran_at, offload):
    for res in torchrun("dist_actor_check.py", dtype, str(stage), offload, nproc=nproc):
        assert res["stage"] == ran_at
        assert res["offloaded"] == [offload != "none", offload == "params"]
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
        # ... and the learning-rate schedule stayed put on the skipped step, at every stage
        assert res["lr_end_True"] == res["lr_end_False"], res
        assert res["linear_restored"], "zero.Init's F.linear outlived the model's construction"
        assert res["ref_partitioned"] == (ran_at == 3)  # the KL reference loads as the actor does
        from gapo.memory import REDUCE_BUCKET

        assert res["reduce_bucket"] == REDUCE_BUCKET  # the buffer the memory plan counts


@pytest.mark.dist
def test_zero3_gathers_the_vocab_head_once_per_forward_and_once_per_backward(torchrun):
    """Six logit chunks used to mean six all-gathers of the (tied) head in forward and as many again when
    backward recomputes them (7 and 20 with the embedding's own, measured before the change)."""
    for res in torchrun("dist_head_gather_check.py", nproc=2):
        assert res["chunks"] == 6 and (res["forward"], res["total"]) == (1, 2), res


@pytest.mark.dist
def test_zero3s_prefetch_trace_settles_when_micro_batches_differ(torchrun):
    """Micro-batches of 8 and 24 response tokens (1 and 3 logit chunks) in turn: with the chunk count fixed for
    the run (3), every forward calls the same modules and DeepSpeed's trace is not invalidated after warm-up
    (with a count that follows each micro-batch it was invalidated at every change)."""
    for res in torchrun("dist_trace_check.py", nproc=2, timeout=300):
        assert res["chunks"] == 3
        assert [s for s in res["invalidations"] if s >= 2] == [], res
