"""Split placement (rollout.placement: split): some of the job's ranks only generate, the others only train.

    global ranks 0 .. T-1      trainers: the DeepSpeed actor, in a process group of their own (world T)
    global ranks T .. T+G-1    generators: one vLLM engine each, in a process group of their own (world G)
    the transport              messages and weight versions between them (gapo/rollout/transport.py)

Trainer t is served by generator T + t % G; the trainers t < G lead their generator's weight push. Every message is a
trainer's (hello, generate, push, stop), answered in order; a push's weights follow its header from the leader
alone. A generator serves its trainers' messages as they arrive, each trainer's in order, and takes a push's weights
only once every one of its trainers has sent that push's header: a trainer sends its requests for later steps before
its push, so every request sent before push n is sampled with the weights before it, on every generator, whatever
the timing. That makes bounded staleness exact: with rollout.max_staleness = k the trainer keeps the requests of steps
n .. n+k in flight while it trains step n, and their rollouts carry the versions n-1-k .. n-1 that vLLM stamped on
them. The weights stream from the leader's gather into the generator's engine, a tensor at a time.

A generator that dies ends its trainers' next receive with its rank named (PeerGone); a trainer that ends (done,
failed or preempted) tells its generator to stop.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from gapo.distributed import Placement
from gapo.rollout.engine import Engine
from gapo.rollout.transport import Transport
from gapo.rollout.types import PushReceipt, Rollout, SamplingConfig


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

    def __init__(self, placement: Placement, link: Transport):
        self.link = link
        self.generator = placement.generator_of(placement.global_rank)
        self.leader = placement.global_rank < placement.generators
        self.outstanding: deque[int] = deque()  # ids of submitted requests not yet answered
        self.ready: deque[Served] = deque()  # answers received ahead of their collect
        self.next_id = 0
        self.closed = False

    def hello(self, model_dir: str, run_dir: str, max_model_len: int) -> None:
        if self.leader:
            self.link.send({"kind": "hello", "model_dir": model_dir, "run_dir": run_dir,
                            "max_model_len": max_model_len}, self.generator)

    def submit(self, prompts: list[list[int]], sampling: SamplingConfig, seeds: list[int]) -> int:
        self.link.send({"kind": "generate", "id": self.next_id, "prompts": prompts, "sampling": sampling,
                        "seeds": seeds}, self.generator)
        self.outstanding.append(self.next_id)
        self.next_id += 1
        return self.next_id - 1

    def _reply(self) -> Served | PushReceipt:
        reply, _ = self.link.recv(self.generator)
        if isinstance(reply, Served):
            want = self.outstanding.popleft() if self.outstanding else None
            if reply.id != want:
                raise RuntimeError(f"generator {self.generator} answered request {reply.id} where request {want}'s "
                                   "rollouts were due")
        elif not isinstance(reply, PushReceipt):
            raise RuntimeError(f"generator {self.generator} sent {reply!r:.200}")
        return reply

    def _served(self) -> Served:
        reply = self._reply()
        if not isinstance(reply, Served):
            raise RuntimeError(f"generator {self.generator} sent a push receipt where rollouts were due")
        return reply

    def collect(self) -> Served:
        """The oldest request's answer (waiting for it when it has not come yet)."""
        return self.ready.popleft() if self.ready else self._served()

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, seeds: list[int]) -> list[list[Rollout]]:
        """Synchronous: answered after any request still in flight, whose answers are kept for `collect`."""
        mine = self.submit(prompts, sampling, seeds)
        while (reply := self._served()).id != mine:
            self.ready.append(reply)
        return reply.groups

    def sleep(self) -> None:
        raise RuntimeError("a split job's generator keeps its engine awake (rollout.sleep_between_steps has no use "
                           "with rollout.placement=split)")

    def push_weights(self, weights: Iterable[tuple[str, Tensor]], version: int) -> PushReceipt:
        """The leader streams the gathered weights to the generator; the other trainers only drive the collective
        gather (the iterator) and wait for the same receipt. The header goes first: the generator counts it before
        it takes the tensors. No request of this rank is sent before the receipt: none can be sampled with the
        weights before this push."""
        self.link.send({"kind": "push", "version": version}, self.generator)
        if self.leader:
            self.link.send_weights(weights, self.generator)
        else:
            for _ in weights:
                pass
        while isinstance(reply := self._reply(), Served):
            self.ready.append(reply)
        # The generator loaded this push, so it has received every send of this rank (nothing goes out between the
        # header and the receipt).
        self.link.release()
        return reply

    def close(self, why: str) -> None:
        """Tell the generator this trainer is done (`why`: done | failed | preempted); once."""
        if not self.closed:
            self.closed = True
            self.link.send({"kind": "stop", "why": why}, self.generator)
            self.link.release()


def serve(placement: Placement, link: Transport, build_engine: Callable[[str, int], Engine]) -> str:
    """A generator rank's whole life: wait for its leader's hello, build the engine (`build_engine(model_dir,
    max_model_len)`, after the run directory is known so that its output goes to the run's log), then answer until
    every trainer it serves has stopped. Returns why they stopped (done | failed | preempted)."""
    from gapo import console

    me = placement.global_rank
    mine = placement.trainers_of(me)
    leader = min(mine)
    hello, _ = link.recv(leader)
    if hello.get("kind") != "hello":
        raise RuntimeError(f"generator {me}: trainer {leader}'s first message was {hello.get('kind')!r}, not hello")
    console.attach(Path(hello["run_dir"]))
    engine = build_engine(hello["model_dir"], hello["max_model_len"])
    headers: dict[int, set[int]] = {}  # push version -> the trainers whose header has come
    stopped: dict[int, str] = {}
    last = time.perf_counter()
    while len(stopped) < len(mine):
        msg, src = link.recv()
        if src not in mine:
            raise RuntimeError(f"generator {me} got a message from trainer {src}, which it does not serve")
        kind = msg["kind"]
        if kind == "generate":
            idle = time.perf_counter() - last
            tic = time.perf_counter()
            groups = engine.generate(msg["prompts"], msg["sampling"], msg["seeds"])
            link.send(Served(msg["id"], groups, idle, time.perf_counter() - tic), src)
            last = time.perf_counter()
        elif kind == "push":
            v = msg["version"]
            headers.setdefault(v, set()).add(src)
            if headers[v] == set(mine):
                del headers[v]
                receipt = engine.push_weights(link.recv_weights(leader), v)
                for t in mine:
                    link.send(receipt, t)
                # Each trainer reads every answer up to its receipt now (RemoteEngine.push_weights).
                link.release()
                last = time.perf_counter()
        elif kind == "stop":
            stopped[src] = msg["why"]
        else:
            raise RuntimeError(f"generator {me}: unknown message {kind!r} from trainer {src}")
    whys = set(stopped.values())
    if whys == {"done"}:  # (after a failure a trainer may never take its last answers: no wait for them)
        link.release()
    return "done" if whys == {"done"} else "preempted" if "preempted" in whys else "failed"
