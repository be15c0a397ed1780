"""The error a user fixes: raised by config resolution, loaders, checkpoints and the run directory alike, and
printed by the entry points as a message (exit 2) instead of a traceback; and gapo-train's exit codes."""

import difflib
import os
import tempfile
from collections.abc import Iterable
from enum import IntEnum
from pathlib import Path


class ConfigError(ValueError):
    """A configuration the user must fix; the message names the key, file or item, the value and what is
    allowed."""


class Exit(IntEnum):
    """gapo-train's exit codes: its ranks', gapo.launch's (one code for the job) and the command's, which a requeue
    script tests for."""

    OK = 0
    FAILED = 1  # a rank died or failed without a message of its own
    CONFIG = 2  # a ConfigError: the message says what to fix
    STOPPED = 3  # the run cannot go on (diverged; rewards, a checkpoint or the weight sync failed): a message says why
    PREEMPTED = 75  # EX_TEMPFAIL: every rank saved after SIGTERM / SIGUSR1; requeue, and --resume auto goes on
    INTERRUPTED = 130  # Ctrl-C (SIGINT), the shell's code for it: the last checkpoint is named, --resume auto goes on


def out_folder(path: Path, what: str) -> Path:
    """`path` made ready as a folder to write into (`what`: the flag or key that named it, for the message): a file
    already there, or a parent that is one, is the user's to move, said as a ConfigError rather than a traceback."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ConfigError(f"{what} {path}: a file is in the way (there or above it); expected a folder to write "
                          "into, or a path not taken yet") from None
    return path


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """"; did you mean X?" for a misspelt name (a config, a manifest, a key) when a known one is close, else "":
    a typo costs the user one look, not a search through a listing."""
    close = difflib.get_close_matches(name, list(known), n=2, cutoff=0.75)
    return f"; did you mean {' or '.join(close)}?" if close else ""


def check_writable(path: Path, what: str) -> None:
    """`path` can be made a folder to write into, tried without leaving anything behind (a folder made and removed in
    its nearest existing parent): the test that tells, also for root, a read-only mount or /proc, where the mode bits
    do not. `what`: the flag or key that named it."""
    above = path.absolute()
    while not above.exists():
        above = above.parent
    if not above.is_dir():
        raise ConfigError(f"{what} {path}: a file is in the way ({above}); expected a folder to write into, or a path "
                          "not taken yet")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".gapo-probe-", dir=above))
    except OSError as err:
        raise ConfigError(f"{what} {path}: cannot write into {above} ({err.strerror}); choose a folder you can write "
                          "into") from None


# The failures gapo-train has said why on the console: a launcher passes them on and adds nothing.
EXPLAINED = frozenset({Exit.CONFIG, Exit.STOPPED})
