"""A one-node SLURM of the test session's own, for the `cluster` tier (tests/conftest.py, fixture `slurm`).

munged, slurmctld and slurmd run as root with everything in one temporary folder: their own munge key and socket,
slurm.conf (free ports, StateSaveLocation, spool, logs, pid files), so that nothing is shared with a SLURM the
machine may run, or with another test session. The node is this machine as `slurmd -C` describes it; no cgroup
plugin (a VM without systemd's cgroup delegation has none). Two partitions make preemption real: `batch` (the
default, PreemptMode=REQUEUE with a short GraceTime) and `urgent`, of a higher PriorityTier, whose jobs preempt
batch's. Accounting (slurmdbd) is off: job states come from `scontrol show job`, kept a day (MinJobAge).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from gapo.proc import stat_fields

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "sinfo", "scancel", "munge")
GRACE_S = 60  # batch's GraceTime: SIGTERM, then SIGKILL this much later (the tiny runs save in about a second)


def unavailable() -> str | None:
    """Why a SLURM cannot start here, or None."""
    if os.geteuid() != 0:
        return "the cluster tier starts munged, slurmctld and slurmd as root; this user is not root"
    missing = [b for b in (*DAEMONS, *CLIENTS) if shutil.which(b) is None and not Path(f"/usr/sbin/{b}").exists()]
    if missing:
        return f"{', '.join(missing)} not installed (Debian: apt-get install -y slurm-wlm munge)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _exe(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class Cluster:
    """The running daemons, and the environment (SLURM_CONF) under which sbatch & co. talk to them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    # ------------------------------------------------------------------------------------------ start / stop
    def start(self, timeout: float = 60) -> None:
        r = self.root
        for d in ("state", "spool", "log"):
            (r / d).mkdir(parents=True, exist_ok=True)
        r.chmod(0o700)  # munged refuses a key or socket in a folder others can write
        (r / "munge.key").write_bytes(os.urandom(1024))
        (r / "munge.key").chmod(0o600)
        self._call([_exe("munged"), "--force", f"--socket={r / 'munge.sock'}", f"--key-file={r / 'munge.key'}",
                    f"--log-file={r / 'log' / 'munged.log'}", f"--pid-file={r / 'munged.pid'}",
                    f"--seed-file={r / 'munged.seed'}"])
        node = subprocess.run([_exe("slurmd"), "-C"], capture_output=True, text=True, check=True).stdout
        node_line = node.splitlines()[0]  # NodeName=<host> CPUs=... RealMemory=...
        host = node_line.split()[0].removeprefix("NodeName=")
        self.cpus = int(next(w for w in node_line.split() if w.startswith("CPUs=")).removeprefix("CPUs="))
        self.conf.write_text(f"""ClusterName=gapotest
SlurmctldHost={host}
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={r / 'munge.sock'}
CredType=cred/munge
StateSaveLocation={r / 'state'}
SlurmdSpoolDir={r / 'spool'}
SlurmctldPidFile={r / 'slurmctld.pid'}
SlurmdPidFile={r / 'slurmd.pid'}
SlurmctldLogFile={r / 'log' / 'slurmctld.log'}
SlurmdLogFile={r / 'log' / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
MinJobAge=86400
KillWait=10
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
{node_line} State=UNKNOWN
PartitionName=batch Nodes=ALL Default=YES State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime={GRACE_S}
PartitionName=urgent Nodes=ALL State=UP PriorityTier=2 PreemptMode=OFF
""")
        self._call([_exe("slurmctld"), "-f", str(self.conf)])
        self._call([_exe("slurmd"), "-f", str(self.conf)])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True)
            if state.stdout.strip() == "idle":
                return
            time.sleep(1)
        raise RuntimeError(f"the SLURM node is not idle {timeout:.0f} s after start (sinfo: "
                           f"{state.stdout.strip() or state.stderr.strip()}); see {r / 'log'}")

    def _call(self, cmd: list[str]) -> None:
        r = subprocess.run(cmd, env=self.env, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed (exit {r.returncode}): {r.stderr.strip()[-2000:]}")

    def stop(self) -> None:
        """Cancel what is left, then stop the daemons by their pids (slurmd, slurmctld, munged)."""
        subprocess.run(["scancel", "--user", "root"], env=self.env, capture_output=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.squeue():
            time.sleep(1)
        for name in ("slurmd", "slurmctld", "munged"):
            pidfile = self.root / f"{name}.pid"
            if not pidfile.is_file():
                continue
            pid = int(pidfile.read_text().split()[0])
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:  # it is gone already: nothing to stop
                continue
            for _ in range(100):
                if not Path(f"/proc/{pid}").exists() or "Z" in _proc_state(pid):
                    break
                time.sleep(0.1)
            else:
                os.kill(pid, signal.SIGKILL)

    # ------------------------------------------------------------------------------------------ queries
    def run(self, *cmd: str, cwd: str | Path | None = None) -> str:
        r = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, cwd=cwd)
        if r.returncode:
            raise AssertionError(f"{' '.join(cmd)} failed (exit {r.returncode}): {r.stdout[-2000:]}"
                                 f"{r.stderr[-2000:]}")
        return r.stdout

    def squeue(self) -> list[str]:
        """The jobs not yet ended, as JOBID STATE lines."""
        return self.run("squeue", "-h", "-o", "%i %T").split("\n")[:-1]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, Dependency, ExitCode, StdOut, ...)."""
        out = self.run("scontrol", "-o", "show", "job", job_id)
        fields = {}
        for word in out.split():
            key, _, value = word.partition("=")
            fields.setdefault(key, value)
        return fields


def _proc_state(pid: int) -> str:
    fields = stat_fields(pid)
    return fields[0] if fields else "Z"  # ended meanwhile
