"""What several bench scripts share: run a command while sampling its memory, and summarise repetitions.

Timings on shared 2-core machines are noisy, so every figure is a ratio of two things measured in the same
run, alternating, with the median over repetitions.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import threading
import time
import zlib
from pathlib import Path

import psutil


def pss(pid: int) -> int:
    """Bytes of PSS from the kernel's own sum (smaps_rollup): cheap enough to sample while timing
    (psutil's memory_full_info parses the whole smaps and took ~30 % of a core on vLLM's mappings)."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))


def run_sampled(cmd: list[str], *, env: dict | None = None, cwd: str | None = None,
                interval_s: float = 0.5) -> tuple[str, float]:
    """Run `cmd` to completion; return its stdout and the peak memory of its whole process tree in GiB
    (children included: gapo's reward workers count against gapo). Fails loudly with its stderr tail.

    Memory is the sum of PSS (proportional set size), not RSS: forked workers share the parent's pages
    copy-on-write, and summing their RSS would count those pages once per process."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak, read = 0, 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak, read
        while not done.is_set():
            total = 0
            try:
                tree = [proc.pid, *(p.pid for p in psutil.Process(proc.pid).children(recursive=True))]
            except psutil.Error:  # the command has exited
                tree = []
            for pid in tree:
                try:
                    total += pss(pid)
                    read += 1
                except OSError:  # that process exited between listing and reading: the others still count
                    pass
            peak = max(peak, total)
            time.sleep(interval_s)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{err[-3000:]}")
    if not read:  # a peak of 0 GiB would read as a measurement
        raise RuntimeError(f"{' '.join(cmd)}: no memory sample could be read (/proc/PID/smaps_rollup)")
    return out, peak / 2**30


def cached_arm(done: Path, cmd: list[str]) -> dict | None:
    """A finished arm's result from an earlier run with the same --work, only if that run was this very command on
    this very code (a changed --lora-lr, step count or code runs the arm again); the console says which it is."""
    key = {"command": cmd, "code": _code_version()}
    if done.exists():
        try:
            saved = json.loads(done.read_text())
        except (OSError, ValueError):  # cut short by a crash while writing: a miss
            saved = {}
        if {k: saved.get(k) for k in key} == key and "result" in saved:
            print(f"(reused: {done}, the same command on the same code, {key['code']})", flush=True)
            return saved["result"]
        print(f"({done} is from another command or code: running the arm again)", flush=True)
    return None


def save_arm(done: Path, cmd: list[str], result: dict) -> None:
    tmp = done.with_suffix(".tmp")
    tmp.write_text(json.dumps({"command": cmd, "code": _code_version(), "result": result}))
    tmp.replace(done)  # whole or absent


def _code_version() -> str:
    """HEAD, and a hash of the uncommitted changes to what a run executes (gapo/, bench/, configs/), so that two
    different edits never share a key and a figure written under docs/ changes none."""
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout

    diff = git("diff", "HEAD", "--", "gapo", "bench", "configs")
    return git("rev-parse", "HEAD").strip() + (f"+{zlib.crc32(diff.encode()):08x}" if diff else "")


def cpu_line() -> str:
    """The CPU a figure was measured on: lscpu says only "AMD EPYC" on our machines, which differ 3-4x, so the
    family/model numbers and AVX-512 come from /proc/cpuinfo."""
    info: dict[str, str] = {}
    flags: set[str] = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            key, value = key.strip(), value.strip()
            if key == "flags":
                flags = set(value.split())
            elif key in ("model name", "cpu family", "model") and key not in info:
                info[key] = value
    import os

    return (f"CPU: {info.get('model name', '?')}, cpu family {info.get('cpu family', '?')}, model "
            f"{info.get('model', '?')}, {'AVX-512' if 'avx512f' in flags else 'no AVX-512'}, {os.cpu_count()} cores")


def median(xs: list[float]) -> float:
    return statistics.median(xs)
