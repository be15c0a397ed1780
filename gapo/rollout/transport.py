"""How the ranks of a split job reach each other: the Transport that gapo/rollout/split.py speaks its protocol over,
and its first implementation, a gloo bridge.

A transport carries two things between global ranks: messages (pickled objects, both ways) and weight versions (a
trainer's named tensors to its generator, streamed). Sends return at once, since both ends of a split job send
ahead of what they receive; the protocol calls `release` where it knows the peer has received every earlier send.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Protocol

from gapo.distributed import Placement
from gapo.errors import ConfigError

if TYPE_CHECKING:  # torch loads in a rank, not where gapo-train checks rollout.transport's name (before the imports)
    from torch import Tensor


class PeerGone(RuntimeError):
    """The other end stopped answering: a rank died."""


class Transport(Protocol):
    def send(self, msg: object, dst: int) -> None:
        """Queue `msg` for global rank `dst`; returns at once."""
        ...

    def recv(self, src: int | None = None) -> tuple[object, int]:
        """The next message from `src` (None: from whichever rank sends first), and its sender."""
        ...

    def send_weights(self, weights: Iterable[tuple[str, Tensor]], dst: int) -> None:
        """Stream one weight version to `dst` as `weights` yields it (HF names); `dst` takes it with recv_weights."""
        ...

    def recv_weights(self, src: int) -> Iterator[tuple[str, Tensor]]:
        """The next weight version from `src`, one tensor at a time; to be consumed to its end."""
        ...

    def release(self) -> None:
        """The peers have received everything this rank sent: free what the sends still hold."""
        ...


MSG, META, TENSOR = 1, 3, 5  # gloo tags; a pickled object's body follows its length on tag + 1


def _wait(work, peer: int, what: str) -> None:
    try:
        work.wait()
    except RuntimeError as err:  # gloo: connection closed / reset / timed out
        raise PeerGone(f"{what} global rank {peer} failed ({err}); that rank has likely died: see its lines in "
                       "train.log") from err


def transport_named(kind: str) -> type[Transport]:
    """rollout.transport's row of TRANSPORTS; a new transport is a class with the five methods above, built from the
    rank's Placement, and a row (here, or `register` in a config's plugin). gapo-train asks before any rank starts
    (config.py reads no module of gapo.rollout); the split loop builds the rank's with it."""
    if kind not in TRANSPORTS:
        raise ConfigError(f"rollout.transport={kind!r}: no such transport; gapo.rollout.transport.TRANSPORTS has "
                          f"{', '.join(TRANSPORTS)} (a plugin adds one with gapo.rollout.transport.register)")
    return TRANSPORTS[kind]


class GlooBridge:
    """A Transport over a gloo group of all T + G ranks, point to point only, on every device: on GPU the weights cross
    it through host memory (correct, slower than vLLM's NCCL weight transfer; GPU unverified here).

    A gloo send completes only when the peer posts the matching receive, and its is_completed() stays False until
    wait() is called (torch 2.13): a message send is kept, with its tensors, until `release`. Weights are the
    exception, being most of the memory: each tensor's send is waited for once the next one is on its way, so the
    sender holds at most two and the receiver one."""

    def __init__(self, placement: Placement):
        import torch.distributed as dist

        self.group = dist.ProcessGroupGloo(dist.PrefixStore("gapo-bridge/", placement.store), placement.global_rank,
                                           placement.trainers + placement.generators, placement.timeout)
        self.pending: list[tuple[object, int, Tensor]] = []  # (work, dst, the tensor it sends)

    def _send_obj(self, obj: object, dst: int, tag: int) -> None:
        import torch

        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        for t, tg in ((torch.tensor([data.numel()], dtype=torch.int64), tag), (data, tag + 1)):
            self.pending.append((self.group.send([t], dst, tg), dst, t))

    def _recv_obj(self, src: int | None, tag: int) -> tuple[object, int]:
        import torch

        n = torch.zeros(1, dtype=torch.int64)
        if src is None:
            work = self.group.recv_anysource([n], tag)
            _wait(work, -1, "receiving from")
            src = work.source_rank()
        else:
            _wait(self.group.recv([n], src, tag), src, "receiving from")
        data = torch.empty(int(n), dtype=torch.uint8)
        _wait(self.group.recv([data], src, tag + 1), src, "receiving from")
        return pickle.loads(data.numpy().tobytes()), src

    def send(self, msg: object, dst: int) -> None:
        self._send_obj(msg, dst, MSG)

    def recv(self, src: int | None = None) -> tuple[object, int]:
        return self._recv_obj(src, MSG)

    def send_weights(self, weights: Iterable[tuple[str, Tensor]], dst: int) -> None:
        before = None  # the previous tensor's send, and the tensor
        for name, tensor in weights:
            t = tensor.detach().to("cpu").contiguous()
            self._send_obj((name, tuple(t.shape), t.dtype), dst, META)
            now = (self.group.send([t], dst, TENSOR), t)
            if before is not None:
                _wait(before[0], dst, "sending to")
            before = now
        if before is not None:
            _wait(before[0], dst, "sending to")
        self._send_obj(None, dst, META)

    def recv_weights(self, src: int) -> Iterator[tuple[str, Tensor]]:
        import torch

        while (head := self._recv_obj(src, META)[0]) is not None:
            name, shape, dtype = head
            t = torch.empty(shape, dtype=dtype)
            _wait(self.group.recv([t], src, TENSOR), src, "receiving from")
            yield name, t

    def release(self) -> None:
        for work, dst, _ in self.pending:
            _wait(work, dst, "sending to")
        self.pending = []


TRANSPORTS: dict[str, type[Transport]] = {"gloo": GlooBridge}


def register(name: str, transport: type[Transport]) -> None:
    """Add a transport class, built from a rank's Placement, that `rollout.transport` can then name (a name taken by
    another transport is refused)."""
    if TRANSPORTS.get(name, transport) is not transport:
        raise ValueError(f"transport {name!r} exists already ({', '.join(TRANSPORTS)})")
    missing = [m for m in ("send", "recv", "send_weights", "recv_weights", "release") if not hasattr(transport, m)]
    if missing:
        raise ValueError(f"transport {name!r} lacks {', '.join(missing)} (gapo.rollout.transport.Transport)")
    TRANSPORTS[name] = transport
