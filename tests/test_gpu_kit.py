"""bench/gpu/kit.py end to end against a stand-in for our test GPU node (bench/gpu/node-cuda-image.txt: Python 3.12,
torch 2.11.0+cu130, no index): the GPU profile resolves there keeping the node's torch and choosing vLLM 0.26.0, the
wheels it lacks are packed into parts of at most 60 MiB, a flipped byte is named, and the node's Python installs
the rest into a folder offline. `import vllm, deepspeed` needs the node's CUDA torch and its other packages, which a
stand-in holds as metadata only: here their installed versions are checked, on the node check.sh imports them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / "bench" / "gpu" / "kit.py"


def python312() -> str:
    for candidate in [*Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"), Path("/usr/bin/python3.12")]:
        if candidate.is_file():
            return str(candidate)
    reason = "no Python 3.12 here to stand the GPU node's Python in with"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.mark.e2e
def test_the_kit_packs_splits_verifies_and_installs_for_the_test_node(tmp_path):
    python = python312()
    kit = tmp_path / "kit"
    r = subprocess.run([sys.executable, KIT, "pack", ROOT / "bench" / "gpu" / "node-cuda-image.txt", "--python",
                        python, "--out", kit, "--split", "60"], capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    manifest = json.loads((kit / "manifest.json").read_text())
    chosen = {i["metadata"]["name"].lower(): i["metadata"]["version"]
              for i in json.loads((kit / "resolution.json").read_text())["install"]}
    # The dry run on the node's Python 3.12 keeps its torch 2.11 and selects vLLM 0.26.
    assert (manifest["python"], manifest["vllm"], chosen["vllm"]) == ("3.12", "0.26.0", "0.26.0")
    assert not {"torch", "torchvision", "torchaudio", "transformers"} & set(chosen), "a second torch was resolved"
    parts = manifest["tar"]["parts"]
    assert 1 <= len(parts) <= 6 and all(p["bytes"] <= 60 * 2**20 for p in parts), parts
    assert {"deepspeed", "hjson", "math_verify", "pydantic", "vllm"} <= {w["file"].split("-")[0].lower()
                                                                       for w in manifest["wheels"]}
    assert "tokenspeed-triton" in manifest["left_out"] and "nvidia-cutlass-dsl-libs-cu13" in manifest["left_out"]
    assert not list(kit.glob("*.whl")), "the loose wheels stay beside the parts"

    # A flipped byte in one part is named, and nothing is installed.
    part = kit / parts[3]["file"]
    good = part.read_bytes()
    part.write_bytes(good[:1000] + bytes([good[1000] ^ 1]) + good[1001:])
    target = tmp_path / "site"
    r = subprocess.run([python, KIT, "install", "--dir", kit, "--target", target], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode != 0 and f"{parts[3]['file']} does not match the manifest's sha256" in r.stderr, r.stderr
    assert not target.exists()
    part.write_bytes(good)

    r = subprocess.run([python, KIT, "install", "--dir", kit, "--target", target], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "installed vllm 0.26.0" in r.stdout and "installed deepspeed 0.19.8" in r.stdout, r.stdout
    probe = ("import importlib.metadata as md, gapo, hjson; "
             "print(md.version('vllm'), md.version('deepspeed'), md.version('math-verify'))")
    r = subprocess.run([python, "-I", "-c", f"import sys; sys.path[:0] = {[str(target), str(ROOT)]!r}; {probe}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["0.26.0", "0.19.8", "0.9.0"], r.stdout + r.stderr
