"""bench/gpu/check.sh, the script a first GPU runs, passes its CPU smoke run: the same code paths (the loop with the
DeepSpeed actor in bf16, the offloaded optimizer with the transformers engine, the LoRA gradient against PEFT's, the
NaN-step skip, vLLM's weight push, the engine freed, the one-GPU recipe) at toy size,
and one table in which every row that ran passes and every row that could not run on a CPU reads SKIP with its
reason. Its row logic, on its own and fast: a machine without a GPU gets the whole table, all SKIP, exit 0; a row
whose dependency is missing reads SKIP and never runs; a step that raises fails its rows, and the table is still
written."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.e2e  # not smoke: the sweep chain is the fast tier's pass through the real stack
def test_the_gpu_check_passes_its_cpu_smoke_run(tmp_path):
    r = subprocess.run(["bash", "bench/gpu/check.sh", "--cpu-smoke", "--out", str(tmp_path)], cwd=ROOT,
                       env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads((tmp_path / "check.json").read_text())
    status = {x["check"]: x["status"] for x in rows}
    assert status == {"CUDA device": "SKIP", "model shape": "INFO", "rl step throughput": "INFO",
                      "peak memory vs plan": "SKIP", "skipped steps": "PASS", "reward scoring errors": "PASS",
                      "first mini-batch IS deviation": "PASS", "bf16 push probe difference": "PASS",
                      "offloaded optimizer: 2 steps, hf engine": "PASS",
                      "offloaded optimizer: peak GPU memory vs plan": "SKIP",
                      "offloaded optimizer: peak host memory vs plan": "SKIP",
                      "LoRA gradient: merged forward under DeepSpeed vs plain torch": "PASS",
                      "LoRA gradient: DeepSpeed bf16 vs PEFT fp32": "PASS",
                      "NaN step skipped": "PASS", "vLLM generation, k = 8": "INFO",
                      "vLLM weight push into zeroed weights": "PASS",
                      "vLLM weight checksums after the push": "SKIP", "vLLM sleep / wake": "SKIP",
                      "vLLM engine freed": "PASS", "gapo-train end to end": "PASS",
                      "2-GPU start and ZeRO-3 gather into vLLM": "SKIP",
                      "one-GPU recipe: optimizer offload, train, push": "PASS",
                      "one-GPU recipe: sleep -> train -> wake -> push": "SKIP"}, rows
    assert all(x["value"] for x in rows if x["status"] == "SKIP")  # each says why it did not run
    seconds = json.loads((tmp_path / "seconds.json").read_text())
    assert list(seconds)[:4] == ["device_row", "model_step", "train_run", "one_gpu_run"], seconds  # vLLM first
    assert "== gapo GPU check ==" in r.stdout


@pytest.fixture
def check(monkeypatch):
    """bench/gpu/check.py as a module (it is run by path), with an empty table."""
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench/gpu/check.py")
    monkeypatch.syspath_prepend(str(ROOT / "bench/gpu"))
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", module)  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def declared(check) -> list[str]:
    return [name for step in check.STEPS for name, _ in step.rows]


def test_without_a_gpu_the_whole_table_is_written_every_row_skips_and_it_exits_0(check, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(check.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(check, "gpus_on_host", lambda: (0, ""))
    assert check.main(["--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "check.json").read_text())
    assert [x["check"] for x in rows] == declared(check)
    assert {x["status"] for x in rows} == {"SKIP"} and all(x["value"] for x in rows), rows  # each says why
    table = capsys.readouterr().out.split("== gapo GPU check ==")[1]
    assert all(name in table for name in declared(check))


def test_a_gpu_that_torch_cannot_see_fails_the_device_row(check, monkeypatch, tmp_path):
    """A CPU build of torch on a GPU host: not "nothing to check" (SKIP, exit 0) but a FAIL, exit 1."""
    monkeypatch.setattr(check.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(check, "gpus_on_host", lambda: (8, ""))
    assert check.main(["--out", str(tmp_path)]) == 1
    rows = json.loads((tmp_path / "check.json").read_text())
    assert rows[0]["check"] == "CUDA device" and rows[0]["status"] == "FAIL" and "8 GPU" in rows[0]["value"]
    assert {x["status"] for x in rows[1:]} == {"SKIP"}


def test_a_failing_nvidia_smi_is_no_proof_of_no_gpu(check, monkeypatch, tmp_path):
    """A driver that does not match its kernel module makes nvidia-smi exit non-zero and list nothing: FAIL, exit 1."""
    import subprocess

    monkeypatch.setattr(check.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a[0], 9, "", "Failed to initialize NVML: Driver/library version mismatch"))
    assert check.gpus_on_host() == (0, "nvidia-smi -L exited 9: Failed to initialize NVML: Driver/library version "
                                       "mismatch")
    assert check.main(["--out", str(tmp_path)]) == 1
    rows = json.loads((tmp_path / "check.json").read_text())
    assert rows[0]["status"] == "FAIL" and "version mismatch" in rows[0]["value"], rows[0]


def test_a_vllm_installed_but_broken_fails_rather_than_skips(check, monkeypatch):
    import importlib.util

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm fails ...
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    why = check.vllm_missing(cpu_smoke=True)  # ... though it is installed
    assert why.startswith("needs vLLM: vLLM is installed but not importable")
    assert [r[:2] for r in check.ROWS] == [("FAIL", "vLLM import")]


def test_a_step_that_raises_fails_its_unwritten_rows_and_the_next_step_runs(check):
    def broken(state):
        check.row("written", "1", "1", True)
        raise RuntimeError("CUDA out of memory")

    def silent(state):
        pass

    state = {"no_device": ""}
    check.run_step(check.Step(broken, (("written", "1"), ("unwritten", "2"))), state)
    check.run_step(check.Step(silent, (("forgotten", "3"),)), state)
    check.run_step(check.Step(lambda s: check.row("next", "x", "x", True), (("next", "x"),)), state)
    assert [r[:2] for r in check.ROWS] == [("PASS", "written"), ("FAIL", "unwritten"), ("FAIL", "forgotten"),
                                          ("PASS", "next")]
    assert check.ROWS[1][2] == "RuntimeError: CUDA out of memory" and check.ROWS[1][3] == "2"


def test_without_vllm_the_vllm_and_gapo_train_rows_skip_and_do_not_run(check, monkeypatch):
    """gapo-train runs configs/tiny_cpu.yaml with engine: vllm: without vLLM its rows read SKIP. (Had they run, the
    test tiers' launch guard would have failed this test: a gapo-train launch outside an e2e test.)"""
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm fails
    state = {"no_device": "", "cpu_smoke": True, "no_vllm": check.vllm_missing(cpu_smoke=True)}
    assert state["no_vllm"].startswith("needs vLLM")
    steps = [s for s in check.STEPS if s.run in (check.vllm_cycle, check.train_run, check.one_gpu_run)]
    assert len(steps) == 3
    for step in steps:
        check.run_step(step, state)
    assert [r[1] for r in check.ROWS] == [name for s in steps for name, _ in s.rows]
    assert {r[0] for r in check.ROWS} == {"SKIP"} and all("vLLM" in r[2] for r in check.ROWS)


def test_a_gpu_too_small_for_every_shape_skips_the_model_rows(check, monkeypatch, tmp_path):
    monkeypatch.setattr(check, "device_gib", lambda: 8.0)
    state = {"no_device": "", "cpu_smoke": False, "out": tmp_path}
    for step in [s for s in check.STEPS if s.run in (check.model_step, check.rl_step, check.nan_step)]:
        check.run_step(step, state)
    assert {r[0] for r in check.ROWS} == {"SKIP"} and all("8.0 GiB GPU" in r[2] for r in check.ROWS), check.ROWS
    assert not (tmp_path / "model").exists()


def test_steps_past_the_budget_skip_saying_so(check, tmp_path):
    state = {"no_device": "", "cpu_smoke": True, "out": tmp_path, "budget": 5.0, "t0": 0.0}  # long spent
    step = next(s for s in check.STEPS if s.run is check.rl_step)
    check.run_step(step, {**state, "model_dir": str(tmp_path)})
    assert {r[0] for r in check.ROWS} == {"SKIP"} and all("--budget of 5 s was spent" in r[2] for r in check.ROWS)


def test_the_model_is_sized_from_the_device():
    """A 24 GB GPU gets a shape whose plan fits it, not Qwen2.5-1.5B's ~33 GiB; a large one gets 1.5B."""
    sys.path.insert(0, str(ROOT / "bench/gpu"))
    import rl_steps

    for gib in (22.0, 44.4, 139.8):
        shape, plans = rl_steps.pick_shape(gib, prompts=8, new_tokens=512)
        assert shape is not None and plans[shape] <= rl_steps.HEADROOM * gib
        bigger = list(rl_steps.SHAPES)[:list(rl_steps.SHAPES).index(shape)]
        assert all(plans[b] > rl_steps.HEADROOM * gib for b in bigger)  # the largest that fits
    assert rl_steps.pick_shape(22.0, 8, 512)[0] != "Qwen2.5-1.5B"
    assert rl_steps.pick_shape(139.8, 8, 512)[0] == "Qwen2.5-1.5B"


def test_the_one_gpu_row_runs_the_recipe_settings(check, tmp_path):
    """The row's overrides come from configs/qwen_math_1gpu.yaml, and on tiny_cpu they give its path: the optimizer
    on the host (ZeRO-2 on one rank) and sleep mode on (off on the CPU, where vLLM refuses it)."""
    from gapo.configfile import load_config

    gpu = load_config("configs/tiny_cpu.yaml", check.recipe_overrides(check.RECIPE, sleep=True))
    assert gpu.trainer.offload.optimizer == "cpu" and gpu.zero_stage(1) == 2 and gpu.rollout.sleep_between_steps
    recipe = load_config(str(check.RECIPE))
    assert gpu.rollout.gpu_memory_utilization == recipe.rollout.gpu_memory_utilization
    cpu = load_config("configs/tiny_cpu.yaml", check.recipe_overrides(check.RECIPE, sleep=False))
    assert cpu.trainer.offload.optimizer == "cpu" and not cpu.rollout.sleep_between_steps
    other = tmp_path / "other.yaml"
    other.write_text("rollout:\n  group_size: 4\n")
    with pytest.raises(ValueError, match="other.yaml: no rollout.sleep_between_steps"):
        check.recipe_overrides(other, sleep=True)
