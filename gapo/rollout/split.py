"""Split placement (rollout.placement: split): some of the job's ranks only generate, the others only train.

    global ranks 0 .. T-1      trainers: the DeepSpeed actor, in a process group of their own (world T)
    global ranks T .. T+G-1    generators: one vLLM engine each, in a process group of their own (world G)
    the bridge                 a gloo group over all T+G ranks, point to point only

Trainer t is served by generator T + t % G; the trainers t < G lead their generator's weight push. Every message is
a pickled header (tag HEADER) from a trainer, answered on tag REPLY; weights follow a push header as tensors (tag
TENSOR) from the leader alone. A generator serves its trainers' messages as they arrive, each trainer's in order,
and applies a push only once every one of its trainers has sent that push's header: a trainer sends its requests
for later steps before its push, so every request sent before push n is sampled with the weights before it, on
every generator, whatever the timing. That makes bounded staleness exact: with rollout.max_staleness = k the
trainer keeps the requests of steps n .. n+k in flight while it trains step n, and their rollouts carry the
versions n-1-k .. n-1 that vLLM stamped on them.

The bridge is gloo on every device: on GPU the weights cross it through host memory (correct, slower than vLLM's
NCCL weight transfer, which is not wired in; GPU unverified here). A generator that dies ends its trainers' next
receive with its rank named; a trainer that ends (done, failed or preempted) tells its generator to stop.
"""

from __future__ import annotations

import logging
import pickle
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
from torch import Tensor

from gapo.rollout.types import PushReceipt, Rollout, SamplingConfig

log = logging.getLogger("gapo.split")

HEADER, BODY, REPLY, REPLY_BODY, TENSOR = 1, 2, 3, 4, 5


@dataclass(frozen=True)
class Placement:
    """This process's place in a split job (gapo.distributed.init_distributed builds it)."""

    global_rank: int
    trainers: int  # T
    generators: int  # G
    bridge: object  # torch.distributed.ProcessGroupGloo over all T + G ranks

    @property
    def is_generator(self) -> bool:
        return self.global_rank >= self.trainers

    def generator_of(self, trainer: int) -> int:
        return self.trainers + trainer % self.generators

    def trainers_of(self, generator: int) -> list[int]:
        return [t for t in range(self.trainers) if self.generator_of(t) == generator]


def connect(store, global_rank: int, trainers: int, generators: int, timeout: timedelta) -> Placement:
    import torch.distributed as dist

    bridge = dist.ProcessGroupGloo(dist.PrefixStore("gapo-bridge/", store), global_rank, trainers + generators,
                                   timeout)
    return Placement(global_rank, trainers, generators, bridge)


class PeerGone(RuntimeError):
    """The other end of the bridge stopped answering: a rank died."""


def _wait(work, peer: int, what: str) -> None:
    try:
        work.wait()
    except RuntimeError as err:  # gloo: connection closed / reset / timed out
        raise PeerGone(f"{what} global rank {peer} failed ({err}); that rank has likely died: see its lines in "
                       "train.log") from err


class Outbox:
    """Sends that return at once. A gloo send completes only when the peer posts the matching receive, so a trainer
    that waited on each request it sends ahead would block while its generator sends it the previous answer:
    both ends would be sending. The outbox keeps each send's tensors alive until it is done. A gloo send's
    is_completed() stays False until wait() is called (torch 2.13), so reap() frees nothing there: each side drains
    at a push receipt, when the protocol proves the peer has received every earlier send. Without that drain the
    leader kept every pushed weight tensor for the whole run (a 2 + 2 demo run was OOM-killed at step 7)."""

    def __init__(self, bridge):
        self.bridge = bridge
        self.pending: list[tuple[object, int, list[Tensor]]] = []

    def tensor(self, t: Tensor, dst: int, tag: int) -> None:
        self.pending.append((self.bridge.send([t], dst, tag), dst, [t]))
        self.reap()

    def obj(self, obj, dst: int, tag: int, body_tag: int) -> None:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        self.tensor(torch.tensor([data.numel()], dtype=torch.int64), dst, tag)
        self.tensor(data, dst, body_tag)

    def reap(self) -> None:
        """Forget the sends that are done; one that failed raises PeerGone."""
        done = [x[0].is_completed() for x in self.pending]
        for (work, dst, _), d in zip(self.pending, done, strict=True):
            if d:
                _wait(work, dst, "sending to")
        self.pending = [x for x, d in zip(self.pending, done, strict=True) if not d]

    def drain(self) -> None:
        for work, dst, _ in self.pending:
            _wait(work, dst, "sending to")
        self.pending = []


def recv_obj(bridge, src: int | None, tag: int, body_tag: int) -> tuple[object, int]:
    """The next object on `tag` from `src` (None: from whichever rank sends first), and its sender."""
    n = torch.zeros(1, dtype=torch.int64)
    if src is None:
        work = bridge.recv_anysource([n], tag)
        _wait(work, -1, "receiving from")
        src = work.source_rank()
    else:
        _wait(bridge.recv([n], src, tag), src, "receiving from")
    data = torch.empty(int(n), dtype=torch.uint8)
    _wait(bridge.recv([data], src, body_tag), src, "receiving from")
    return pickle.loads(data.numpy().tobytes()), src


@dataclass
class Served:
    """A generator's answer to one request: the groups, and what the wait and the sampling cost it."""

    id: int  # the request's, in the order its trainer submitted them
    groups: list[list[Rollout]]
    idle_s: float  # the generator's time between its previous piece of work and this request
    generate_s: float


class RemoteEngine:
    """The Engine protocol on a trainer rank (gapo.rollout.engine): its generator samples, its leader pushes.

    `submit` sends a request and returns at once; `collect` returns the oldest submitted request's answer; `generate`
    is both (evaluation, the push probe). The generator answers each trainer in the order of its messages, so an
    answer to a request sent ahead can arrive while this rank waits for another reply: it is kept for `collect`."""

    def __init__(self, placement: Placement, trainer: int):
        self.p = placement
        self.out = Outbox(placement.bridge)
        self.generator = placement.generator_of(trainer)
        self.leader = trainer < placement.generators
        self.outstanding: deque[int] = deque()  # ids of submitted requests not yet answered
        self.ready: deque[Served] = deque()  # answers received ahead of their collect
        self.next_id = 0
        self.closed = False

    def _send(self, msg: dict) -> None:
        self.out.obj(msg, self.generator, HEADER, BODY)

    def hello(self, model_dir: str, run_dir: str, max_model_len: int) -> None:
        if self.leader:
            self._send({"kind": "hello", "model_dir": model_dir, "run_dir": run_dir, "max_model_len": max_model_len})

    def submit(self, prompts: list[list[int]], sampling: SamplingConfig, seeds: list[int]) -> int:
        self._send({"kind": "generate", "id": self.next_id, "prompts": prompts, "sampling": sampling, "seeds": seeds})
        self.outstanding.append(self.next_id)
        self.next_id += 1
        return self.next_id - 1

    def _reply(self) -> Served | PushReceipt:
        reply, _ = recv_obj(self.p.bridge, self.generator, REPLY, REPLY_BODY)
        if isinstance(reply, Served):
            want = self.outstanding.popleft() if self.outstanding else None
            if reply.id != want:
                raise RuntimeError(f"generator {self.generator} answered request {reply.id} where request {want}'s "
                                   "rollouts were due")
        elif not isinstance(reply, PushReceipt):
            raise RuntimeError(f"generator {self.generator} sent {reply!r:.200}")
        return reply

    def collect(self) -> Served:
        """The oldest request's answer (waiting for it when it has not come yet)."""
        if self.ready:
            return self.ready.popleft()
        reply = self._reply()
        if not isinstance(reply, Served):
            raise RuntimeError(f"generator {self.generator} sent a push receipt where rollouts were due")
        return reply

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, seeds: list[int]) -> list[list[Rollout]]:
        """Synchronous: answered after any request still in flight, whose answers are kept for `collect`."""
        mine = self.submit(prompts, sampling, seeds)
        while True:
            reply = self._reply()
            if not isinstance(reply, Served):
                raise RuntimeError(f"generator {self.generator} sent a push receipt where rollouts were due")
            if reply.id == mine:
                return reply.groups
            self.ready.append(reply)

    def push_weights(self, weights: Iterable[tuple[str, Tensor]], version: int) -> PushReceipt:
        """The leader streams the gathered weights to the generator; the other trainers only drive the collective
        gather (the iterator) and wait for the same receipt. The header goes first: the generator counts it before
        it takes the tensors. No request of this rank is sent before the receipt: none can be sampled with the
        weights before this push."""
        self._send({"kind": "push", "version": version, "leader": self.leader})
        for name, tensor in weights:
            if self.leader:
                t = tensor.detach().to("cpu").contiguous()
                self.out.obj((name, tuple(t.shape), t.dtype), self.generator, TENSOR, TENSOR + 10)
                self.out.tensor(t, self.generator, TENSOR + 20)
        if self.leader:
            self.out.obj(None, self.generator, TENSOR, TENSOR + 10)
        while isinstance(reply := self._reply(), Served):
            self.ready.append(reply)
        # The generator loaded this push, so it has received every send of this rank (nothing goes out between the
        # header and the receipt): the waits return at once and free the pushed tensors.
        self.out.drain()
        return reply

    def sleep(self) -> None:
        raise RuntimeError("rollout.sleep_between_steps has no use with rollout.placement=split: the engines have "
                           "their own ranks")

    def close(self, why: str) -> None:
        """Tell the generator this trainer is done (`why`: done | failed | preempted); once."""
        if not self.closed:
            self.closed = True
            self._send({"kind": "stop", "why": why})
            self.out.drain()


@dataclass
class _Pending:
    """A push the generator has heard of from some of its trainers."""

    headers: set[int] = field(default_factory=set)
    weights: list[tuple[str, Tensor]] | None = None  # the leader's tensors, once received


def serve(placement: Placement, build_engine) -> str:
    """A generator rank's whole life: wait for its leader's hello, build the engine (`build_engine(model_dir,
    max_model_len)`, after the run directory is known so that its output goes to the run's log), then answer until
    every trainer it serves has stopped. Returns why they stopped (done | failed | preempted)."""
    from gapo import console

    me, bridge = placement.global_rank, placement.bridge
    out = Outbox(bridge)
    mine = placement.trainers_of(me)
    leader = min(mine)
    hello, _ = recv_obj(bridge, leader, HEADER, BODY)
    if hello.get("kind") != "hello":
        raise RuntimeError(f"generator {me}: trainer {leader}'s first message was {hello.get('kind')!r}, not hello")
    console.attach(Path(hello["run_dir"]))
    engine = build_engine(hello["model_dir"], hello["max_model_len"])
    pushes: dict[int, _Pending] = {}
    stopped: dict[int, str] = {}
    last = time.perf_counter()

    def tensors_from_leader() -> Iterator[tuple[str, Tensor]]:
        while True:
            head, _ = recv_obj(bridge, leader, TENSOR, TENSOR + 10)
            if head is None:
                return
            name, shape, dtype = head
            t = torch.empty(shape, dtype=dtype)
            _wait(bridge.recv([t], leader, TENSOR + 20), leader, "receiving from")
            yield name, t

    while len(stopped) < len(mine):
        msg, src = recv_obj(bridge, None, HEADER, BODY)
        if src not in mine:
            raise RuntimeError(f"generator {me} got a message from trainer {src}, which it does not serve")
        kind = msg["kind"]
        if kind == "generate":
            idle = time.perf_counter() - last
            tic = time.perf_counter()
            groups = engine.generate(msg["prompts"], msg["sampling"], msg["seeds"])
            served = Served(msg["id"], groups, idle, time.perf_counter() - tic)
            out.obj(served, src, REPLY, REPLY_BODY)
            last = time.perf_counter()
        elif kind == "push":
            v = msg["version"]
            pending = pushes.setdefault(v, _Pending())
            pending.headers.add(src)
            if msg["leader"]:
                pending.weights = list(tensors_from_leader())  # held until every trainer's header has arrived
            if pending.headers == set(mine) and pending.weights is not None:
                receipt = engine.push_weights(iter(pending.weights), v)
                del pushes[v]
                for t in mine:
                    out.obj(receipt, t, REPLY, REPLY_BODY)
                # Each trainer reads every answer up to its receipt now (RemoteEngine.push_weights): the waits end
                # as it does, and free the answers sent so far.
                out.drain()
                last = time.perf_counter()
        elif kind == "stop":
            stopped[src] = msg["why"]
        else:
            raise RuntimeError(f"generator {me}: unknown message {kind!r} from trainer {src}")
    whys = set(stopped.values())
    if whys == {"done"}:  # (after a failure a trainer may never take its last answers: no wait for them)
        out.drain()
    return "done" if whys == {"done"} else "preempted" if "preempted" in whys else "failed"
