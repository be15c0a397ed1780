"""A process's life as Linux shows it: /proc/<pid>/stat, read in one place, and the parent-death signal that ties each
process of a run to the one that started it. The command name (field 2) of a stat may hold spaces and parentheses, so
the fields are the words after its last ")": index 0 is the state (field 3), 1 the parent's pid, 19 the start time in
clock ticks after boot (field 22)."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path


def stat_fields(pid: int | str = "self") -> list[str] | None:
    """The stat fields of `pid` from its state on, or None when the process has ended."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:  # ended meanwhile, or hidden from us (hidepid)
        return None


def processes() -> Iterator[tuple[int, list[str]]]:
    """(pid, stat fields) of every process alive while it is read."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = stat_fields(stat.parent.name)
        if fields is not None:
            yield int(stat.parent.name), fields


# The pid of the gapo process that started this one, set by each gapo process for the children it starts (and
# inherited by the children that vLLM, torchrun or multiprocessing start on its behalf, whose parent it also is).
# The gapo process that started this one, as `me()` names it, set by each gapo process for the children it starts (and
# inherited by the children that vLLM, torchrun or multiprocessing start on its behalf, whose parent it also is).
PARENT = "GAPO_PARENT_PID"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def me() -> str:
    """This process as PARENT names it: host, pid and start time (a pid alone may be reused, or another machine's when
    an environment travels with a job)."""
    return f"{socket.gethostname()}:{os.getpid()}:{stat_fields()[19]}"


def die_with_parent() -> None:
    """This process is killed the moment the gapo process that started it dies, however it dies (SIGKILL included,
    which no handler sees), and the processes it starts are told to do the same.

    A run is a tree: gapo-sweep > gapo-train > gapo.launch (torchrun) > ranks > math workers, sandboxes, vLLM's
    engine. Without this, killing one node (a scheduler's SIGKILL, an OOM kill) leaves the nodes below it running:
    ranks that go on writing the run folder a resume is about to use, and ports still bound. Linux's parent-death
    signal (prctl PR_SET_PDEATHSIG) is the kernel's own notice; it is set here, in the child, because torchrun and
    multiprocessing start processes gapo does not spawn itself; the gapo process above is looked for in case it died
    before the signal was set (a wrapper between the two, `srun` or `timeout`, is the parent the signal watches). A
    process started by a person (no PARENT in its environment, or another machine's) keeps its own life; it only
    tells its children. Called by every entry point, and when gapo is imported in a process a gapo process started
    (gapo/__init__.py): a rank is tied to torchrun before its seconds of imports, not after."""
    parent, mine = os.environ.get(PARENT, ""), me()
    if parent == mine:  # done already (on importing gapo; the entry point asks again)
        return
    host, _, rest = parent.partition(":")
    pid, _, start = rest.partition(":")
    if host == socket.gethostname() and pid.isdigit() and sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        above = stat_fields(pid)
        gone = above is None or above[0] in "ZX" or above[19] != start
        if os.getppid() != int(pid) and gone:  # it died before the line above: no signal will come
            os.kill(os.getpid(), signal.SIGKILL)
    os.environ[PARENT] = mine
