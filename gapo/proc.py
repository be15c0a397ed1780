"""Linux's /proc/<pid>/stat, read in one place. The command name (field 2) may hold spaces and parentheses, so the
fields are the words after its last ")": index 0 is the state (field 3), 1 the parent's pid, 19 the start time in
clock ticks after boot (field 22)."""

from __future__ import annotations

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
