"""Split placement (rollout.placement: split, gapo/rollout/split.py): generator ranks sample while trainer ranks train.

The protocol is checked in-process (three threads, a stand-in engine that stamps the weight version it samples with)
over each transport: a real gloo bridge, and a toy one of queues that shows the protocol asks nothing more of one.
The whole job with the real stack (vLLM + DeepSpeed ZeRO-3 on gloo, 1 generator and 2 trainers): synchronous split
equals colocated metric for metric, one step of staleness resumes exactly after a preemption, a dead generator is
named."""

import json
import os
import pickle
import queue
import signal
import subprocess
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_checkpoint import ENV, ROOT, _pids_of, _rollouts, _wait_for_step, assert_same_steps, cmd, metrics, run

from gapo.configfile import load_config
from gapo.data import Sampler
from gapo.distributed import Placement
from gapo.errors import ConfigError
from gapo.rollout import split
from gapo.rollout.transport import GlooBridge
from gapo.rollout.types import PushReceipt, Rollout, SamplingConfig
from gapo.trainer.rollouts import RolloutQueue

SPLIT = ["rollout.placement=split", "rollout.generator_ranks=1"]


# --- config ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, needle", [
    (["rollout.placement=split"], "rollout.placement=split needs rollout.generator_ranks >= 1"),
    (["rollout.max_staleness=1"], "need rollout.placement=split"),
    ([*SPLIT, "rollout.max_staleness=1", "rollout.use_engine_logprobs=true"],
     "rollout.max_staleness=1 needs rollout.use_engine_logprobs=false"),
])
def test_split_settings_that_cannot_work_are_refused(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace("+", r"\+").replace(".", r"\.")):
        load_config(ROOT / "configs" / "tiny_cpu.yaml", overrides)


def test_each_trainer_has_one_generator_and_the_first_ones_lead():
    p = Placement(rank=0, world=3, global_rank=0, trainers=3, generators=2)
    assert [p.generator_of(t) for t in range(3)] == [3, 4, 3]
    assert p.trainers_of(3) == [0, 2] and p.trainers_of(4) == [1]
    assert not p.is_generator and Placement(0, 2, 3, 3, 2).is_generator


# --- the protocol, in-process, over each transport ---------------------------------------------------------------

class InProcess:
    """A toy Transport between threads: one message queue per rank (a receive from one sender sets the others' aside,
    as gloo matches by sender), and one weight queue per rank that holds a single tensor, so that weights stream."""

    def __init__(self, hub: dict, rank: int):
        self.hub, self.rank, self.aside = hub, rank, []

    def _queue(self, kind: str, rank: int) -> queue.Queue:
        return self.hub.setdefault((kind, rank), queue.Queue(maxsize=1 if kind == "weights" else 0))

    def send(self, msg, dst):
        self._queue("messages", dst).put((pickle.dumps(msg), self.rank))

    def recv(self, src=None):
        for i, (data, sender) in enumerate(self.aside):
            if src in (None, sender):
                del self.aside[i]
                return pickle.loads(data), sender
        while True:
            data, sender = self._queue("messages", self.rank).get(timeout=20)
            if src in (None, sender):
                return pickle.loads(data), sender
            self.aside.append((data, sender))

    def send_weights(self, weights, dst):
        for name, t in weights:
            self._queue("weights", dst).put((self.rank, name, t.clone()), timeout=20)
        self._queue("weights", dst).put((self.rank, None, None), timeout=20)

    def recv_weights(self, src):
        while True:
            sender, name, t = self._queue("weights", self.rank).get(timeout=20)
            assert sender == src, f"weights from {sender}, expected {src}"
            if name is None:
                return
            yield name, t

    def release(self):
        pass


class StampingEngine:
    """Samples nothing: each 'rollout' carries the weight version the engine held when the request was served."""

    def __init__(self, events: list):
        self.version, self.pushed, self.events = 0, [], events

    def generate(self, prompts, sampling, seeds):
        time.sleep(0.05)  # long enough for the trainers' messages to queue up behind it
        pairs = zip(prompts, seeds, strict=True)
        return [[Rollout(p, [s], [0.0], False, str(s), version=self.version)] for p, s in pairs]

    def push_weights(self, weights, version):
        got = []
        for name, t in weights:
            self.events.append(f"loaded {name}")
            got.append((name, float(t.sum())))
        self.pushed.append((version, got))
        self.version = version
        return PushReceipt(received=[n for n, _ in got], unloaded=[])


def gloo(store, r, trainers):
    return GlooBridge(Placement(r, 0, r, trainers, 1, store, timedelta(seconds=20)))


def in_process(hub, r, trainers):  # noqa: ARG001 - a transport factory's signature
    return InProcess(hub, r)


TRANSPORTS = pytest.mark.parametrize("transport", [gloo, in_process], ids=["gloo", "in_process"])


def _bridge_job(transport, trainer_body, trainers: int = 2) -> tuple[dict, StampingEngine, str, list]:
    """Run `trainer_body(engine: RemoteEngine, trainer: int, events: list) -> result` on `trainers` threads and
    split.serve on one more, over `transport`; returns the results by trainer, the generator's engine, why it stopped
    and the events both sides logged."""
    shared = dist.HashStore() if transport is gloo else {}
    world, events = trainers + 1, []
    engine, results, errors, why = StampingEngine(events), {}, [], []

    def rank(r):
        try:
            placement = Placement(r, 0, r, trainers, 1)
            link = transport(shared, r, trainers)
            if placement.is_generator:
                why.append(split.serve(placement, link, lambda model_dir, max_len: engine))
                return
            remote = split.RemoteEngine(placement, link)
            remote.hello("model", "/nonexistent/run", 64)
            results[r] = trainer_body(remote, r, events)
            remote.close("done")
        except BaseException as err:  # noqa: BLE001 (re-raised below, in the test's thread)
            errors.append(err)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "the bridge hung"
    return results, engine, why[0], events


SAMPLING = SamplingConfig(n=1, temperature=1.0, top_p=1.0, max_new_tokens=4, stop_token_ids=[])


@TRANSPORTS
def test_requests_sent_ahead_keep_their_weights_and_answers_keep_their_order(transport):
    """Each trainer sends steps 1 and 2 before training step 1 (max_staleness 1), pushes, sends step 3, evaluates
    (a synchronous generate that overtakes nothing), then collects 2 and 3. Step 2 was sent before push 1, so it is
    sampled with version 0 on every timing; step 3 and the evaluation come after it, with version 1. Trainer 1 pushes
    late: the generator takes the leader's weights only once trainer 1's header has arrived, and trainer 0's step-3
    request cannot overtake the push."""

    def body(remote, t, events):
        a = remote.submit([[t, 1]], SAMPLING, [10 + t])
        b = remote.submit([[t, 2]], SAMPLING, [20 + t])
        first = remote.collect()
        if t == 1:
            time.sleep(0.3)
        weights = iter([("w", torch.full((3,), 2.0)), ("v", torch.ones(2))])
        receipt = remote.push_weights(weights, 1)
        held = len(getattr(remote.link, "pending", []))  # the gloo bridge frees every send at the receipt
        c = remote.submit([[t, 3]], SAMPLING, [30 + t])
        evaluated = remote.generate([[t, 9]], SAMPLING, [90 + t])
        second, third = remote.collect(), remote.collect()
        assert [first.id, second.id, third.id] == [a, b, c]
        return ([g[0].version for x in (first, second, third) for g in x.groups], evaluated[0][0].version,
                [g[0].text for x in (first, second, third) for g in x.groups], receipt.received, held)

    results, engine, why, _ = _bridge_job(transport, body)
    assert why == "done"
    for t in (0, 1):
        versions, eval_version, texts, received, held = results[t]
        assert held == 0
        assert versions == [0, 0, 1] and eval_version == 1
        assert texts == [str(10 + t), str(20 + t), str(30 + t)]  # each trainer got its own answers, in order
        assert received == ["w", "v"]  # the same receipt on the leader and the other trainer
    assert engine.pushed == [(1, [("w", 6.0), ("v", 2.0)])]  # once, with the leader's tensors


@TRANSPORTS
def test_weights_stream_into_the_engine_as_the_leader_gathers_them(transport):
    """The generator loads a tensor while the leader is still gathering later ones: it never holds the whole model."""

    def body(remote, t, events):
        def gathered():
            for i in range(6):
                events.append(f"gathered w{i}")
                yield f"w{i}", torch.full((4,), float(i))

        return remote.push_weights(gathered(), 1).received

    results, engine, _, events = _bridge_job(transport, body, trainers=1)
    assert results[0] == [f"w{i}" for i in range(6)]
    assert events.index("loaded w0") < events.index("gathered w3"), events


@TRANSPORTS
def test_a_generator_stops_failed_when_a_trainer_failed(transport):
    def body(remote, t, events):
        remote.generate([[t]], SAMPLING, [t])
        if t == 1:
            remote.close("failed")
        return None

    _, _, why, _ = _bridge_job(transport, body)
    assert why == "failed"


# --- the rollout queue: one for both placements -----------------------------------------------------------------

def _queue_run(engine, staleness: int) -> tuple[list, dict, list]:
    """Steps 1-3 through a RolloutQueue around `engine`, a checkpoint's view after step 1, and what was requested."""
    overrides = [*SPLIT, f"rollout.max_staleness={staleness}"] if staleness else []
    cfg = load_config(ROOT / "configs" / "tiny_cpu.yaml", ["trainer.total_steps=3", *overrides])
    queue_ = RolloutQueue(engine, Sampler(16, seed=0), [[i] for i in range(16)], SAMPLING, cfg, 0, 1, {})
    taken, ahead, requested = [], {}, []
    for step in (1, 2, 3):
        requested.append(queue_.requested(step))
        taken.append(queue_.take(step))
        if step == 1:
            ahead = queue_.ahead(1)
    queue_.close("done")
    return taken, ahead, requested


def test_the_rollout_queue_serves_colocated_and_split_alike():
    """Synchronous, the same prompts, seeds and rollouts come from the rank's own engine and from a generator; one step
    stale, step n+1 is requested with step n and sampled with the weights before it, and a checkpoint of step 1 holds
    step 2's request with its rollouts."""
    local, _, _ = _queue_run(StampingEngine([]), 0)
    results, _, _, _ = _bridge_job(in_process, lambda remote, t, events: _queue_run(remote, 0), trainers=1)
    remote = results[0][0]
    assert [(r.problems, r.seeds, r.groups) for r in local] == [(r.problems, r.seeds, r.groups) for r in remote]
    assert len({tuple(r.seeds) for r in local}) == 3 and all(r.generator_s >= 0 for r in remote)

    results, _, _, _ = _bridge_job(in_process, lambda remote, t, events: _queue_run(remote, 1), trainers=1)
    taken, ahead, requested = results[0]
    assert requested == [[], [2], [3]]
    assert list(ahead) == [2] and ahead[2] is taken[1] and ahead[2].groups is not None
    assert [r.problems for r in taken] == [r.problems for r in local]  # drawn in the same order


# --- the whole job -----------------------------------------------------------------------------------------------

@pytest.mark.e2e
def test_synchronous_split_equals_colocated_over_gloo_and_over_a_transport_from_a_plugin(tmp_path):
    """max_staleness 0: the trainers' requests and seeds are the colocated run's, each served as its own batch, so
    1 generator + 2 trainers must log what 2 colocated ranks log (fp32), and sample the same rollouts: over the gloo
    bridge, and over a second transport that rollout.transport names from a plugin (every message and tensor a key in
    the rendezvous store, tests/fixtures/store_transport.py), which every rank then speaks."""
    run(tmp_path / "c", "trainer.total_steps=3", nproc=2)
    a = metrics(tmp_path / "c")
    for name, extra in [("gloo", []), ("store", ["plugins=[tests/fixtures/store_transport.py]",
                                                 "rollout.transport=store"])]:
        run(tmp_path / name, "trainer.total_steps=3", *SPLIT, *extra, nproc=3)
        log = (tmp_path / name / "train.log").read_text()  # every rank's output
        assert [f"store transport: global rank {g}" in log for g in range(3)] == [name == "store"] * 3, log[-3000:]
        b = metrics(tmp_path / name)
        assert_same_steps(a, b, [1, 2, 3])
        assert all(b[s]["rollout/staleness"] == 0 and b[s]["sync/weight_version"] == s - 1 for s in b)
        for s in (1, 2, 3):
            assert _rollouts(tmp_path / "c", s) == _rollouts(tmp_path / name, s)
        assert "time/generator_s" in json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])


@pytest.mark.e2e
def test_one_step_stale_preempted_then_resumed_is_the_uninterrupted_run(tmp_path):
    """max_staleness 1: step n trains on rollouts of the weights of step n-2 (step 1 and 2 on the initial ones). A
    preemption at step 3 saves it with step 4's rollouts, already sampled; the resumed run trains on those, so it logs
    the uninterrupted run's steps. A colocated resume of that checkpoint is refused, naming what it holds."""
    stale = [*SPLIT, "rollout.max_staleness=1"]
    run(tmp_path / "u", *stale, nproc=3)
    ref = metrics(tmp_path / "u")
    assert [ref[s]["sync/weight_version"] for s in (1, 2, 3, 4)] == [0, 0, 1, 2]
    assert [ref[s]["rollout/staleness"] for s in (1, 2, 3, 4)] == [0, 1, 1, 1]

    out = tmp_path / "p"
    r = run(out, *stale, nproc=3, env={**ENV, "GAPO_FAULT": "signal:3"}, ok=False)
    assert r.returncode == 75, r.stderr[-3000:]
    saved = out / "checkpoints" / "step_000003"
    assert json.loads((saved / "trainer.json").read_text())["in_flight"] == [4]
    for args, nproc, needle in [((), 2, "holds the rollouts of steps [4]"),
                                 ((*SPLIT, "rollout.max_staleness=2"), 3, "with rollout.max_staleness=1: resume")]:
        refused = run(tmp_path / "x", *args, nproc=nproc, resume=saved, ok=False)
        assert refused.returncode == 2 and needle in refused.stderr, refused.stderr[-3000:]
    run(out, *stale, "--resume", "auto", nproc=3)
    assert_same_steps(ref, metrics(out), [1, 2, 3, 4])
    assert _rollouts(tmp_path / "u", 4) == _rollouts(out, 4)


@pytest.mark.e2e
def test_a_dead_generator_ends_the_run_at_once_saying_which(tmp_path):
    out = tmp_path / "d"
    proc = subprocess.Popen(cmd(out, "trainer.total_steps=40", *SPLIT, "rollout.max_staleness=1", nproc=3),
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    _wait_for_step(out, 3, proc)
    pids = _pids_of(out)
    assert sorted(pids) == [0, 1, 2], pids
    tic = time.time()
    os.kill(pids[2], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert time.time() - tic < 60 and proc.returncode not in (0, 75)
    assert f"rank 2 (pid {pids[2]}) died: killed by SIGKILL" in err, err[-3000:]
    assert f"the last checkpoint is {out / 'checkpoints' / 'step_000002'}" in err
    assert Path(out / "checkpoints" / "step_000002" / "in_flight_rank0.pt").is_file()


def test_rollout_transport_names_a_row_of_the_transport_table(capsys):
    """rollout.transport chooses the split job's Transport (gapo.rollout.transport.TRANSPORTS): gapo-train refuses a
    name no row has before any rank starts, naming the rows; a colocated run has none to choose; a plugin's row is
    one to choose; each row has the protocol's methods."""
    from gapo.cli import train_main
    from gapo.errors import Exit
    from gapo.rollout.transport import TRANSPORTS, Transport, register, transport_named

    tiny = str(ROOT / "configs" / "tiny_cpu.yaml")
    assert train_main(["--config", tiny, "--plan", "24", *SPLIT, "rollout.transport=nope"]) == Exit.CONFIG
    assert "rollout.transport='nope': no such transport; gapo.rollout.transport.TRANSPORTS has gloo" in \
        capsys.readouterr().err
    with pytest.raises(ConfigError, match="rollout.transport='gloo2' needs rollout.placement=split"):
        load_config(tiny, ["rollout.transport=gloo2"])
    plugin = Path(__file__).parent / "fixtures" / "store_transport.py"
    cfg = load_config(tiny, [*SPLIT, f"plugins=[{plugin}]", "rollout.transport=store"])
    assert transport_named(cfg.rollout.transport) is TRANSPORTS["store"] and TRANSPORTS["store"].__name__ == \
        "StoreTransport"
    with pytest.raises(ValueError, match="transport 'store' exists already"):
        register("store", GlooBridge)
    with pytest.raises(ValueError, match="lacks send_weights, recv_weights, release"):
        register("half", type("Half", (), {"send": None, "recv": None}))
    methods = {m for m in vars(Transport) if not m.startswith("_")}
    assert methods == {"send", "recv", "send_weights", "recv_weights", "release"}
    for cls in TRANSPORTS.values():
        assert all(callable(getattr(cls, m, None)) for m in methods), cls


def test_a_split_run_over_another_transport_resumes_colocated_or_over_gloo():
    """The transport carries rollouts and weights, no training state: a checkpoint of a run over the plugin's
    transport resumes colocated (where there is no transport) or split over gloo."""
    from types import SimpleNamespace

    from gapo.trainer.checkpoint import check_compatible

    tiny, plugin = ROOT / "configs" / "tiny_cpu.yaml", Path(__file__).parent / "fixtures" / "store_transport.py"
    saved = load_config(tiny, [*SPLIT, f"plugins=[{plugin}]", "rollout.transport=store"])
    for now in ([f"plugins=[{plugin}]"], [*SPLIT, f"plugins=[{plugin}]"]):
        assert "rollout.transport" in check_compatible(saved, load_config(tiny, now), SimpleNamespace(world_size=2), 2)
