"""`make install` the way a user's laptop runs it: no pip or uv configuration of this machine, only the project's
declared sources (PyPI, and the PyTorch CPU index for torch), then one training step in the venv it made.

Our machines' pip configuration adds a local folder that holds torch 2.13.0+cpu; with it, an install that names no
PyTorch index still works here and nowhere else. So this test switches every pip and uv configuration off and
stands the PyTorch index in with a local server laid out as download.pytorch.org/whl/cpu is, holding the one torch
wheel this machine has, at an address given the way a user gives a mirror's (TORCH_INDEX). The server's log shows
what came from it; PyPI serves the rest through uv's cache, which keys every file by the index it came from.
"""

from __future__ import annotations

import hashlib
import http.server
import os
import re
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def locked_torch() -> tuple[str, str]:
    text = (REPO / "requirements" / "cpu.lock").read_text()
    m = re.search(r"^torch==(\S+) \\\n\s+--hash=sha256:(\w+)", text, re.M)
    assert m, "requirements/cpu.lock pins no torch"
    return m[1], m[2]


def torch_wheel(version: str, sha256: str) -> Path:
    """The locked torch file from this machine's folder (PIP_FIND_LINKS): the only thing the test takes from it."""
    for folder in os.environ.get("PIP_FIND_LINKS", "").split():
        for wheel in Path(folder).glob(f"torch-{version}-cp311-*.whl"):
            if hashlib.sha256(wheel.read_bytes()).hexdigest() == sha256:
                return wheel
    reason = f"no torch-{version} wheel with the lock's sha256 in PIP_FIND_LINKS to stand the PyTorch index in with"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true: {reason}", pytrace=False)
    pytest.skip(reason)


class Log(http.server.SimpleHTTPRequestHandler):
    served: list[tuple[str, int]] = []

    def log_request(self, code="-", size="-"):
        self.served.append((self.path, int(code)))


@pytest.fixture
def torch_index(tmp_path):
    """download.pytorch.org/whl/cpu's layout (PEP 503: /whl/cpu/torch/ links the wheels beside it), on loopback."""
    version, sha256 = locked_torch()
    wheel = torch_wheel(version, sha256)
    root = tmp_path / "index"
    (root / "whl" / "cpu" / "torch").mkdir(parents=True)
    os.symlink(wheel, root / "whl" / "cpu" / wheel.name)
    href = wheel.name.replace("+", "%2B")
    (root / "whl" / "cpu" / "torch" / "index.html").write_text(
        f'<!DOCTYPE html><html><body><a href="../{href}#sha256={sha256}">{wheel.name}</a></body></html>\n')
    Log.served = []
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), lambda *a, **k: Log(*a, directory=str(root), **k))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/whl/cpu", href, Log.served
    server.shutdown()


def user_env(home: Path, torch_index: str) -> dict[str, str]:
    """This machine's environment less every pip and uv setting, and less this venv and uv on PATH: a user's shell."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_", "VIRTUAL_ENV"))}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep)
                                  if not (Path(p) / "uv").exists() and not (Path(p) / "gapo-train").exists())
    env.update(PIP_CONFIG_FILE=os.devnull,  # pip reads no configuration file at all (/etc/pip.conf, /etc/xdg/pip)
               UV_NO_CONFIG="1",  # nor uv (uv.toml anywhere)
               TORCH_INDEX=torch_index, HOME=str(home))
    for cache in ("uv", "pip"):  # warm caches, as on a user's second install; uv keys files by their source
        if (Path.home() / ".cache" / cache).is_dir():
            (home / ".cache").mkdir(exist_ok=True)
            os.symlink(Path.home() / ".cache" / cache, home / ".cache" / cache)
    return env


@pytest.mark.e2e
def test_make_install_from_declared_sources_trains_a_step(tmp_path, torch_index):
    index, wheel_href, served = torch_index
    clone = tmp_path / "gapo"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split()
    for name in files:
        if (REPO / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, clone / name)
    (tmp_path / "home").mkdir()
    env = user_env(tmp_path / "home", index)

    r = subprocess.run(["make", "install"], cwd=clone, env=env, capture_output=True, text=True, timeout=900)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert f"torch {locked_torch()[0]} from {index}; the rest from https://pypi.org/simple" in out, out[-2000:]
    assert "--find-links" not in out and "/opt/" not in out, "the install used a folder of this machine's"
    assert (f"/whl/cpu/{wheel_href}", 200) in served, f"torch did not come from the stand-in index: {served}"
    assert {path for path, code in served if code == 200} <= {"/whl/cpu/torch/", f"/whl/cpu/{wheel_href}"}

    venv = clone / ".venv" / "bin"
    r = subprocess.run([venv / "python", "-c", "import gapo, vllm, deepspeed, torch; print(torch.__version__)"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.split()[-1] == locked_torch()[0], r.stdout + r.stderr[-3000:]
    run = tmp_path / "run"
    r = subprocess.run([venv / "gapo-train", "--config", "tiny_cpu", "trainer.total_steps=1",
                        f"trainer.output_dir={run}"], cwd=clone, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert (run / "metrics.jsonl").read_text().count('"step": 1') == 1, (r.stdout + r.stderr)[-2000:]
