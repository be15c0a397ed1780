"""Verified weight sync (gapo/trainer/sync.py): what a push's receipt must show, the version check, the mismatch
alarm; and the three sync faults (a dropped tensor, a stale one, a skipped push) stopping real tiny runs (vLLM CPU
engine, DeepSpeed on gloo, 1 and 2 ranks) with a message naming the tensor or the version."""

import math

import pytest
import torch.distributed as dist

from gapo.rollout.types import PushReceipt, Rollout
from gapo.trainer import sync

SENT = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "lm_head.weight"]


def test_a_receipt_names_what_did_not_arrive_what_was_extra_and_what_stayed_unloaded():
    assert sync.receipt_problems(PushReceipt(list(SENT), []), SENT) == []
    [missing] = sync.receipt_problems(PushReceipt(SENT[:1] + SENT[2:], []), SENT)
    assert "1 of the trainer's 3 tensors never reached the engine: model.layers.0.self_attn.q_proj.weight" in missing
    [extra] = sync.receipt_problems(PushReceipt([*SENT, "model.bogus"], []), SENT)
    assert "model.bogus" in extra
    [unloaded] = sync.receipt_problems(PushReceipt(list(SENT), ["model.layers.0.self_attn.qkv_proj.weight"]), SENT)
    assert "left unloaded: model.layers.0.self_attn.qkv_proj.weight" in unloaded
    many = sync.receipt_problems(PushReceipt([], []), [f"t{i}" for i in range(9)])[0]
    assert many.endswith("t0, t1, t2, t3, t4 and 4 more")


@pytest.fixture
def one_rank(monkeypatch):
    """A world of one for the collective checks (gloo on a free port), taken down after."""
    from gapo.distributed import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def rollout(version: int) -> Rollout:
    return Rollout(prompt_ids=[1], response_ids=[2], logprobs=[-0.1], truncated=False, text="x", version=version)


def test_rollouts_from_another_weight_version_stop_the_step(one_rank):
    sync.check_versions([[rollout(4), rollout(4)]], expected=4, step=5)
    with pytest.raises(sync.SyncError, match=r"rank 0: rollouts of step 5 were sampled with weight version\(s\) "
                                             r"\[3\], expected 4"):
        sync.check_versions([[rollout(4), rollout(3)]], expected=4, step=5)


def test_the_mismatch_alarm_sounds_on_a_jump_over_its_running_median_and_floor():
    alarm = sync.MismatchAlarm(factor=10.0, floor=1e-8, warmup=3)
    assert [alarm.check(s, v) for s, v in enumerate([1e-12, 5e-9, 2e-12], 1)] == [None] * 3  # warming up
    assert alarm.check(4, 5e-9) is None  # 2,500x the median, but under the floor
    assert alarm.check(5, math.nan) is None and len(alarm.history) == 4  # no mismatch measured: no history
    message = alarm.check(6, 2e-6)
    assert message.startswith("step 6: the sampler/trainer log-prob mismatch jumped to kl_k3 2e-06")
    assert "weights in the sampler likely differ" in message
    assert alarm.check(7, 3e-9) is None  # back to normal


@pytest.mark.dist
@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("fault, needle", [
    ("drop", "never reached the engine: model.layers.1.mlp.down_proj.weight"),
    ("stale", "after the push of step 2 the sampler does not compute with the trainer's weights"),
    ("skip", r"rollouts of step 3 were sampled with weight version(s) [1], expected 2"),
])
def test_a_broken_weight_sync_stops_the_run_naming_the_tensor_or_the_version(torchrun, tmp_path, fault, needle,
                                                                              nproc):
    # lr 1e-3: one step of the tiny model moves the probe's log-probs by ~5e-4, beyond the fp32 tolerance (1e-4)
    results = torchrun("dist_sync_check.py", fault, str(tmp_path / "run"), "trainer.total_steps=3", "trainer.lr=1e-3",
                       nproc=nproc)
    for rank, res in enumerate(results):  # every rank stops (exit 3: a run that cannot go on), the message in the log
        assert res["code"] == 3, f"rank {rank} ended with {res['code']} after a {fault} fault"
        assert "failed verification" in res["log"] and needle in res["log"], res["log"][-3000:]


@pytest.mark.dist
def test_an_intact_sync_verifies_every_push(torchrun, tmp_path):
    """The control: the same run unbroken trains through, every push verified and timed."""
    import json

    [res, _] = torchrun("dist_sync_check.py", "none", str(tmp_path / "run"), "trainer.total_steps=3",
                        "trainer.log_rollouts=true", nproc=2)
    assert res["code"] == 0, res["log"][-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in rows if "sync/weight_version" in m]
    assert [m["sync/weight_version"] for m in steps] == [0.0, 1.0, 2.0]
    assert all(m["time/push_verify_s"] > 0 and m["sync/probe_logprob_diff"] < sync.TOLERANCE["float32"]
               for m in steps)
    versions = {r["step"]: r["version"] for r in map(json.loads, (tmp_path / "run" / "rollouts.jsonl").open())}
    assert versions == {1: 0, 2: 1, 3: 2}


def test_a_response_takes_the_one_version_vllm_stamped_on_it():
    from types import SimpleNamespace as Span

    from gapo.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)  # _sampled_with reads only the engine's current version
    engine.version = 7
    assert engine._sampled_with([Span(version="6", start=0, end=9)]) == 6
    assert engine._sampled_with(None) == 7 and engine._sampled_with([]) == 7  # nothing stamped: the current one
    with pytest.raises(RuntimeError, match=r"across weight versions \[5, 6\]"):
        engine._sampled_with([Span(version="5", start=0, end=3), Span(version="6", start=3, end=9)])
