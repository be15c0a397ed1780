"""torchrun for gapo-train's ranks, made preemption-safe: `python -m gapo.launch <torchrun's arguments>`.

torchrun handles SIGTERM by signalling its workers and killing them 30 seconds later, and dies of SIGUSR1, whose
default action is to terminate: either would cut a rank's final checkpoint short. Here both signals are forwarded
to the workers (each rank finishes its step, saves and exits with gapo.errors.Exit.PREEMPTED, see
gapo.trainer.preempt) and torchrun waits for them; when a rank exited with PREEMPTED (and any other did too, or was
stopped by torchrun on its way out), so does this launcher, so that a requeue script sees one code. Everything else
is torchrun's own (`python -m torch.distributed.run`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys

from gapo.distributed import share_cores
from gapo.errors import EXPLAINED, Exit
from gapo.proc import die_with_parent, processes
from gapo.trainer.preempt import SIGNALS


def _children() -> list[int]:
    """The processes whose parent is this one (torchrun's workers), from /proc."""
    me = os.getpid()
    return [pid for pid, fields in processes() if int(fields[1]) == me]


_received: set[int] = set()  # the preemption signals this launcher has handed on


def _forward(signum, frame) -> None:  # noqa: ARG001 - signal's signature
    if signum not in _received:  # say once which signal came (a SLURM log then tells preemption from time limit)
        os.write(2, f"gapo.launch: {signal.Signals(signum).name} received: handed to the ranks, which save and "
                    f"exit {Exit.PREEMPTED}\n".encode())
    _received.add(signum)
    for pid in _children():
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            os.kill(pid, signum)


STOPPED = {-signal.SIGTERM, -signal.SIGKILL}  # how torchrun stops the other ranks once one has exited


def exit_code(codes: set[int], received: set[int] = frozenset()) -> int | None:
    """This launcher's exit from the failed ranks' exit codes, or None when a rank died (the caller says which).

    A rank exits PREEMPTED only after the collective save's final barrier, so the checkpoint is whole even when
    torchrun stopped a slower rank on its way out; likewise a rank that exited EXPLAINED has said why on the console,
    and its code is the run's. Ranks killed by a preemption signal this launcher `received` and handed on (it came
    before a rank installed its handler, while it was starting) lost nothing since their last checkpoint: that is
    PREEMPTED too, so that the job requeues instead of failing."""
    for code in (Exit.PREEMPTED, Exit.INTERRUPTED, *sorted(EXPLAINED)):
        if code in codes and codes <= {code} | STOPPED:
            return code
    if received and codes <= {-s for s in received} | STOPPED | {Exit.PREEMPTED}:
        return Exit.PREEMPTED
    return None


TORCHRUN_DEFAULT_RANKS = 1  # --nproc_per_node when not given


def local_ranks(argv: list[str]) -> int | None:
    """torchrun's --nproc_per_node, in either spelling; None for 'gpu', 'auto' and the like, whose count this
    process cannot know before torchrun does (torchrun then hands each rank one thread, as before)."""
    for i, a in enumerate(argv):
        flag, _, value = a.partition("=")
        if flag in ("--nproc_per_node", "--nproc-per-node"):
            value = value or (argv[i + 1] if i + 1 < len(argv) else "")
            return int(value) if value.isdigit() and int(value) > 0 else None
    return TORCHRUN_DEFAULT_RANKS


def main() -> int:
    # SIGTERM stays ours. torchrun writes its --signals-to-handle (default: SIGTERM too) over the environment
    # variable TORCHELASTIC_SIGNALS_TO_HANDLE, so the flag it is.
    sys.argv[1:1] = ["--signals-to-handle", "SIGINT,SIGHUP,SIGQUIT"]
    die_with_parent()  # and torchrun's ranks with this process (gapo.cli), so a killed launcher leaves nothing
    ranks = local_ranks(sys.argv[1:])
    if ranks is not None:
        share_cores(ranks)  # before torchrun, which would hand every rank one thread
    for sig in SIGNALS:
        signal.signal(sig, _forward)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    # Its lines on stopping the other ranks and on each failed one: said below in gapo's words, once per rank.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)

    try:
        torchrun()
    except ChildFailedError as err:
        code = exit_code({f.exitcode for f in err.failures.values()}, _received)
        if code is not None:
            return code
        for rank, f in sorted(err.failures.items()):
            how = f"died: killed by {signal.Signals(-f.exitcode).name}" if f.exitcode < 0 else f"exited {f.exitcode}"
            print(f"gapo-train: rank {rank} (pid {f.pid}) {how}; the other ranks were stopped",
                  file=sys.stderr, flush=True)
        return Exit.FAILED
    return Exit.OK


if __name__ == "__main__":
    sys.exit(main())
