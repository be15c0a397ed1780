"""gapo/proc.py: /proc/<pid>/stat read in one place, a command name with spaces and parentheses included; a run's
processes die with the one that started them."""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gapo.errors import Exit
from gapo.proc import processes, stat_fields


def test_fields_after_a_command_name_with_spaces_and_parentheses(tmp_path):
    odd = tmp_path / "a b) (c"
    odd.symlink_to(sys.executable)
    child = subprocess.Popen([str(odd), "-c", "import time; time.sleep(30)"])
    try:
        fields = stat_fields(child.pid)
        # alive: running, sleeping, or in disk sleep while it loads (seen on a loaded machine); fields[1] is the
        # parent pid only when the name's ") (" was not taken for the end of the name
        assert fields[0] in "RSD" and int(fields[1]) == os.getpid()
        assert child.pid in {pid for pid, f in processes() if int(f[1]) == os.getpid()}
    finally:
        child.kill()
        child.wait()
    assert stat_fields(child.pid) is None  # ended and reaped
    assert int(stat_fields()[1]) == os.getppid()


# --------------------------------------------------------------------------------------------------
# A run's processes die with the one that started them (gapo.proc.die_with_parent; issue 67 item 3)
# --------------------------------------------------------------------------------------------------
BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]


def tagged(tag: str) -> dict[int, str]:
    """pid -> command line of every live process whose environment holds GAPO_TEST_TAG=tag: the whole tree a test
    started, wherever a dead parent's children were re-parented (a zombie's environment reads empty)."""
    found = {}
    for pid, _ in processes():
        try:
            if f"GAPO_TEST_TAG={tag}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # ended meanwhile
            continue
    return found


def listening(port: int) -> bool:
    """A TCP socket on `port` in LISTEN state (/proc/net/tcp, state 0A)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                return True
    return False


def wait_for(tag: str, ready: Callable[[dict[int, str]], bool], root: subprocess.Popen, timeout: float = 240) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tree = tagged(tag)
        if ready(tree):
            return tree
        assert root.poll() is None, f"the run ended before the fault (exit {root.returncode})"
        time.sleep(0.2)
    raise AssertionError(f"the tree never got ready: {tree}")


RANK, MATH_WORKER = "-u -m gapo.cli", "-P -c import signal"  # a rank under torchrun; a math-verify worker


@pytest.mark.e2e
@pytest.mark.parametrize("victim", ["launcher", "torchrun", "sweep"])
def test_a_killed_parent_leaves_nothing_of_the_run_a_second_later(tmp_path, victim):
    """SIGKILL, which no handler sees, to the launcher, to torchrun or to the sweep driver while the run's processes
    below it are up: a second later no process of the run is alive and torchrun's rendezvous port is closed. Before,
    the ranks (sessions of their own) went on for 3.5-5.5 s and saved another step into the folder a resume uses.
    The torchrun case waits for the deepest tree (the ranks' math workers); the others for the first rank."""
    tag = f"{victim}-{os.getpid()}"
    env = {**os.environ, "GAPO_TEST_TAG": tag, "OMP_WAIT_POLICY": "PASSIVE", "WANDB_SILENT": "true"}
    env.pop("GAPO_PARENT_PID", None)  # started as a person would start it
    if victim == "sweep":
        cmd = [str(BIN / "gapo-sweep"), "tiny_cpu", "--run", "--output-root", str(tmp_path)]
        ready = lambda tree: any(MATH_WORKER in c for c in tree.values())  # noqa: E731 - its one rank scores
    else:
        cmd = [str(BIN / "gapo-train"), "--config", "tiny_cpu", "--nproc", "2", f"trainer.output_dir={tmp_path}",
               "tracking.mode=disabled"]
        need = 2 if victim == "torchrun" else 0
        ready = lambda tree: (sum(RANK in c for c in tree.values()) == 2  # noqa: E731
                              and sum(MATH_WORKER in c for c in tree.values()) >= need)
    root = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        tree = wait_for(tag, ready, root)
        port = next((int(c.split("--master_port ")[1].split()[0]) for c in tree.values() if "--master_port" in c), None)
        target = root.pid if victim != "torchrun" else next(p for p, c in tree.items() if "-m gapo.launch" in c)
        os.kill(target, signal.SIGKILL)
        time.sleep(1.0)
        left = tagged(tag)
        if victim == "torchrun":  # the launcher outlives its child, says where to resume and exits with a listed code
            assert set(left) <= {root.pid}, left
            assert root.wait(timeout=30) == Exit.FAILED
            assert "`--resume auto` goes on" in root.stderr.read()
        else:
            assert left == {}, left
        assert port is None or not listening(port), f"port {port} still bound"
    finally:
        for pid in tagged(tag):
            os.kill(pid, signal.SIGKILL)
        root.kill()
        root.wait()
