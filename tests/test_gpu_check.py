"""bench/gpu/check.sh, the script a first GPU runs, passes its CPU smoke run: the same code paths (the loop with the
DeepSpeed actor in bf16, the NaN-step skip, vLLM's weight push) at toy size, and one table in which every row that
ran passes and every row that could not run on a CPU reads SKIP with its reason."""

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
    status = {x["check"]: x["status"] for x in rows}
    assert status == {"rl step throughput": "INFO", "peak memory vs plan": "SKIP", "skipped steps": "PASS",
                      "first mini-batch IS deviation": "PASS", "NaN step skipped": "PASS",
                      "vLLM weight push into zeroed weights": "PASS", "vLLM weight checksums after the push": "SKIP",
                      "vLLM sleep / wake": "SKIP", "gapo-train end to end": "PASS",
                      "2-GPU start and ZeRO-3 gather into vLLM": "SKIP"}, rows
    assert all(x["value"] for x in rows if x["status"] == "SKIP")  # each says why it did not run
    assert "== gapo GPU check ==" in r.stdout


def test_a_check_that_did_not_run_reads_skip_and_a_failed_one_fails_the_script(monkeypatch):
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench/gpu/check.py")
    monkeypatch.syspath_prepend(str(ROOT / "bench/gpu"))
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm fails: the push row must not pass
    check.vllm_cycle("unused", cpu_smoke=True)
    check.row("a figure", "1 tok/s", "a figure", None)
    check.row("broken", "x", "y", False)
    assert [r[0] for r in check.ROWS] == ["SKIP", "INFO", "FAIL"]
