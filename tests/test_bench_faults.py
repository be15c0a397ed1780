"""bench/faults.py, the fault campaign: two fixed trials end as they must (the campaign's 30 draws are in
docs/testing.md). A preempted run resumed with `--resume auto` ends identical to the uninterrupted one; a sandboxed
program killed from outside is a named host fault, not a wrong answer."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.e2e
def test_two_fixed_trials_of_the_fault_campaign():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "faults.py"), "--trial", "train1:launcher:SIGTERM:12",
                        "--trial", "code:program:SIGKILL:1.0"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    lines = r.stdout.splitlines()
    trials = [x.split() for x in lines if x.strip()[:1].isdigit()]
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert [t[1:3] for t in trials] == [["train1:launcher:SIGTERM:12.0", "identical"],
                                        ["code:program:SIGKILL:1.0", "named"]], r.stdout
    assert all("SIGTERM to launcher" in x or "SIGKILL to program" in x for x in lines if x.strip()[:1].isdigit())
    assert "host_fault" in lines[[i for i, x in enumerate(lines) if "code:program" in x][0]]  # what names it
    assert lines[-1].startswith("identical 1, named 1 of 2 trials"), r.stdout
