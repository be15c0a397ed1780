"""bench/gpu/check.sh, the script a first GPU runs, passes its CPU smoke run: the same code paths (the loop with the
DeepSpeed actor in bf16, the NaN-step skip, vLLM's weight push) at toy size, and one table of PASS rows."""

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.e2e
@pytest.mark.smoke
def test_the_gpu_check_passes_its_cpu_smoke_run(tmp_path):
    r = subprocess.run(["bash", "bench/gpu/check.sh", "--cpu-smoke", "--out", str(tmp_path)], cwd=ROOT,
                       env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads((tmp_path / "check.json").read_text())
    assert [x["check"] for x in rows] == ["rl step throughput", "skipped steps", "first mini-batch IS deviation",
                                          "NaN step skipped", "vLLM weight push"]
    assert all(x["ok"] for x in rows), rows
    assert "== gapo GPU check ==" in r.stdout
