"""The offline kit: what a GPU node without a package index needs beside its own Python and CUDA torch, as parts.

    python bench/gpu/kit.py pack bench/gpu/node-cuda-image.txt --python 3.12 --split 60   # here, with PyPI
    python3 bench/gpu/kit.py install                                                    # on the node, offline

`pack` reads the node's package list (`python3 -m pip list --format=freeze` there), picks the vLLM built for the
node's torch (gapo/rollout/vllm_compat.py's table), and resolves gapo's dependencies with that vLLM the way pip on
the node would: in a stand-in node, a venv of the node's Python version here whose site-packages hold the node's
packages as metadata alone, so that pip keeps them (torch above all) and lists only what the node lacks. It downloads
those wheels for the node's Python and platform, builds DeepSpeed's (it ships as a source archive; pure Python, its
CUDA ops compile on use), and writes .whl/: the wheels, manifest.json (each file's sha256 and size, the versions
chosen, what was left out and why) and, with --split N, the wheels as a tar in parts of at most N MiB (the tar's
and each part's sha256 in the manifest; the loose wheels are then removed).

`install` needs only the node's python3 and pip: it joins the parts, checks every part and every wheel against the
manifest (a flipped byte is named with its part or wheel), installs them with `pip install --no-index --no-deps
--target`, and prints what it installed. Left out on purpose: GPU kernels that vLLM imports only for features gapo
does not use (GAPO_PATH says how that is measured).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MiB = 2**20
# gapo's path through vLLM and its own modules: the kit carries what importing these loads (GAPO_PATH, measured by
# importing them here with the node's vLLM's Python files beside this checkout's torch), and leaves out what vLLM
# declares but loads only for features gapo does not use: its optional GPU kernels (flashinfer, cutlass-dsl, tilelang,
# quack, tokenspeed-triton: each imported lazily when a model or backend asks for it), the API server's extras, and
# the compilers' toolchains. check.sh's first row imports the same modules on the node.
GAPO_PATH = ["vllm", "vllm.entrypoints.llm", "vllm.engine.arg_utils", "vllm.v1.engine.llm_engine",
             "vllm.v1.engine.core",
             "vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner", "vllm.model_executor.models.qwen2",
             "vllm.model_executor.models.llama", "vllm.v1.attention.backends.flash_attn", "vllm.v1.sample.sampler",
             "vllm.lora.request", "vllm.device_allocator.cumem", "gapo.cli", "gapo.trainer.actor", "gapo.trainer.sync",
             "gapo.trainer.checkpoint", "gapo.trainer.rollouts",
             "gapo.rollout.vllm_engine", "gapo.reward.math", "gapo.reward.code", "gapo.reward.ifeval", "gapo.tracking",
             "gapo.data", "gapo.study.eval", "deepspeed", "deepspeed.runtime.zero"]
PROBE = """
import importlib, json, sys
for m in sys.argv[1:]:
    importlib.import_module(m)
print("MODULES " + json.dumps(sorted({n.split(".")[0] for n in list(sys.modules)})))
"""
PLATFORM_TAGS = [f"manylinux_2_{g}_x86_64" for g in range(39, 16, -1)] + ["manylinux2014_x86_64", "linux_x86_64"]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MiB), b""):
            h.update(block)
    return h.hexdigest()


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_node(path: Path) -> dict[str, str | None]:
    """name -> version (None: present, version not known) from a `pip list --format=freeze` file."""
    node: dict[str, str | None] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#")[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)(?:==(\S+))?", line)
        if not m:
            sys.exit(f"kit.py: {path}:{n}: expected `name==version` (pip list --format=freeze), got {line!r}")
        node[canonical(m[1])] = m[2]
    if not node.get("torch"):
        sys.exit(f"kit.py: {path} lists no torch with its version: gapo installs onto the node's torch")
    return node


def compat():
    """gapo/rollout/vllm_compat.py by its path: it needs nothing installed."""
    spec = importlib.util.spec_from_file_location("vllm_compat", ROOT / "gapo" / "rollout" / "vllm_compat.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stand_in_node(python: str, node: dict[str, str | None], where: Path) -> Path:
    """A venv of the node's Python whose site-packages hold the node's packages as metadata only: pip then keeps them
    as the node's pip would. Packages listed without a version are left out (their version decides nothing here)."""
    subprocess.run([python, "-m", "venv", str(where)], check=True)
    [site] = where.glob("lib/python3.*/site-packages")
    for name, version in node.items():
        if version:
            info = site / f"{name.replace('-', '_')}-{version}.dist-info"
            info.mkdir()
            (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
            (info / "INSTALLER").write_text("node\n")
            (info / "RECORD").write_text("")
    return where / "bin" / "python"


def gapo_requirements() -> list[str]:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [r for r in project["dependencies"] if not r.startswith("torch")]


def top_level(wheel: Path) -> set[str]:
    """The import names a wheel installs (its RECORD's first path parts)."""
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        return {n.split("/")[0].removesuffix(".py") for n in z.namelist()
                if not n.split("/")[0].endswith((".dist-info", ".data"))}


def imported_on_gapos_path(vllm_wheel: Path, tmp: Path) -> set[str]:
    """The top-level modules that importing GAPO_PATH loads, with `vllm_wheel`'s Python files first on the path."""
    import zipfile

    layer = tmp / "layer"
    with zipfile.ZipFile(vllm_wheel) as z:
        z.extractall(layer, [n for n in z.namelist() if n.endswith(".py") or ".dist-info/" in n])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(layer), str(ROOT)])}
    r = subprocess.run([sys.executable, "-c", PROBE, *GAPO_PATH], cwd=tmp, env=env, capture_output=True, text=True,
                       timeout=600)
    lines = [x for x in r.stdout.splitlines() if x.startswith("MODULES ")]
    if r.returncode or not lines:
        sys.exit(f"kit.py: importing gapo's path with {vllm_wheel.name}'s Python files failed:\n{r.stderr[-3000:]}")
    return set(json.loads(lines[-1][len("MODULES "):]))


def needed_by_gapo(items: list[dict], python: str) -> set[str]:
    """What gapo's own dependencies (all but vLLM) need, transitively, among the resolution's packages: gapo imports
    several of them lazily (math-verify in its workers, wandb when tracking starts), which an import probe misses."""
    from packaging.requirements import Requirement

    declared = {canonical(i["metadata"]["name"]): i["metadata"].get("requires_dist") or [] for i in items}
    env = {"python_version": python, "python_full_version": python + ".0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython"}
    todo, seen = [(Requirement(r), "") for r in gapo_requirements()], set()
    while todo:
        req, extra = todo.pop()
        name = canonical(req.name)
        if (req.marker and not req.marker.evaluate({**env, "extra": extra})) or (name, extra) in seen:
            continue
        seen.add((name, extra))
        todo += [(Requirement(r), e) for r in declared.get(name, []) for e in {"", *req.extras}]
    return {name for name, _ in seen}


def quiet_pip_env() -> dict[str, str]:
    """pip as it is on a machine with no configuration of its own (the kit must not depend on ours)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def pack(node_file: Path, python: str, out: Path, split_mib: int | None) -> dict:
    node = read_node(node_file)
    vllm_compat = compat()
    vllm = vllm_compat.vllm_for(node["torch"])
    if vllm is None:
        sys.exit(f"kit.py: the node's torch {node['torch']} has no vLLM release gapo runs on: {vllm_compat.table()}")
    version = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], check=True,
                             capture_output=True, text=True).stdout.strip()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # DeepSpeed's wheel, built with this checkout's environment (its setup.py imports torch).
        deepspeed = next(r for r in gapo_requirements() if r.startswith("deepspeed"))
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                        str(tmp / "built"), deepspeed], check=True, env=quiet_pip_env())
        node_python = stand_in_node(python, node, tmp / "node")
        report = tmp / "report.json"
        subprocess.run([node_python, "-m", "pip", "install", "-q", "--dry-run", "--report", str(report),
                        "--prefer-binary", "--find-links", str(tmp / "built"), *gapo_requirements(),
                        f"vllm=={vllm}"], check=True, env=quiet_pip_env())
        items = json.loads(report.read_text())["install"]
        chosen = {canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in items}
        kept = [n for n in ("torch", "torchvision", "torchaudio", "transformers") if node.get(n)]
        if set(kept) & set(chosen):
            sys.exit(f"kit.py: the resolution would replace the node's {sorted(set(kept) & set(chosen))}")
        # Wheels as PyPI has them; a package published as a source archive alone is built here (pure Python).
        carried = [i for i in items if canonical(i["metadata"]["name"]) not in {*node, "deepspeed"}]
        pins: dict[bool, list[str]] = {True: [], False: []}
        for i in carried:
            pins[i["download_info"]["url"].endswith(".whl")].append(f"{i['metadata']['name']}=={i['metadata']['version']}")
        platforms = [a for tag in PLATFORM_TAGS for a in ("--platform", tag)]
        shutil.copy2(report, out / "resolution.json")  # pip's report: what the node lacks, and from where
        if pins[True]:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                            "--python-version", version, "--implementation", "cp", *platforms, "-d", str(out),
                            *pins[True]], check=True, env=quiet_pip_env())
        if pins[False]:
            subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp / "built"),
                            *pins[False]], check=True, env=quiet_pip_env())
        for wheel in (tmp / "built").glob("*.whl"):
            if not wheel.name.endswith("-py3-none-any.whl"):
                sys.exit(f"kit.py: {wheel.name} built here is not pure Python: it would not run on the node")
            shutil.copy2(wheel, out / wheel.name)
        [vllm_wheel] = out.glob(f"vllm-{vllm}-*.whl")
        imported = imported_on_gapos_path(vllm_wheel, tmp)
        needed = needed_by_gapo(items, version) | {"vllm"}
    left_out = {}
    for wheel in sorted(out.glob("*.whl")):
        name = canonical(wheel.name.split("-")[0])
        if name not in needed and not top_level(wheel) & imported:
            size = wheel.stat().st_size / MiB
            left_out[name] = f"{chosen.get(name, '?')}, {size:.1f} MiB: vLLM's, not imported on gapo's path"
            wheel.unlink()
    present = sorted(n for n in set(chosen) & set(node))
    wheels = sorted(out.glob("*.whl"))
    manifest = {"python": version, "torch": node["torch"], "vllm": vllm, "node": node_file.name,
                "wheels": [{"file": w.name, "sha256": sha256(w), "bytes": w.stat().st_size} for w in wheels],
                "left_out": left_out,
                "on_the_node_at_a_version_not_read": present}
    if split_mib:
        buffer = out / "kit.tar"
        with tarfile.open(buffer, "w") as tar:
            for w in wheels:
                tar.add(w, arcname=w.name)
        manifest["tar"] = {"sha256": sha256(buffer), "bytes": buffer.stat().st_size, "parts": []}
        with open(buffer, "rb") as f:
            for i, block in enumerate(iter(lambda: f.read(split_mib * MiB), b"")):
                part = out / f"kit.tar.part{i:02d}"
                part.write_bytes(block)
                manifest["tar"]["parts"].append({"file": part.name, "sha256": hashlib.sha256(block).hexdigest(),
                                                 "bytes": len(block)})
        buffer.unlink()
        for w in wheels:
            w.unlink()
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def install(kit: Path, target: Path) -> list[str]:
    """Join, verify, install; returns 'name version' of each wheel installed. Exits 2 naming what does not verify."""
    manifest = json.loads((kit / "manifest.json").read_text())
    if "tar" in manifest:
        joined = io.BytesIO()
        for part in manifest["tar"]["parts"]:
            path = kit / part["file"]
            if not path.is_file():
                sys.exit(f"kit.py: {path} is missing ({len(manifest['tar']['parts'])} parts in the manifest)")
            data = path.read_bytes()
            if hashlib.sha256(data).hexdigest() != part["sha256"]:
                sys.exit(f"kit.py: {part['file']} does not match the manifest's sha256: copy that part again")
            joined.write(data)
        joined.seek(0)
        with tarfile.open(fileobj=joined) as tar:
            tar.extractall(kit, filter="data")
    for wheel in manifest["wheels"]:
        path = kit / wheel["file"]
        if not path.is_file() or sha256(path) != wheel["sha256"]:
            sys.exit(f"kit.py: {wheel['file']} is missing or does not match the manifest's sha256")
    files = [str(kit / w["file"]) for w in manifest["wheels"]]
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--upgrade", "--target", str(target), *files], check=True, env=quiet_pip_env())
    return [" ".join(w["file"].split("-")[:2]) for w in manifest["wheels"]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("pack", help="here: the wheels a node lacks, a manifest, parts")
    a.add_argument("node", type=Path, help="the node's `python3 -m pip list --format=freeze`")
    a.add_argument("--python", default="python3.12", help="an interpreter of the node's Python version, here")
    a.add_argument("--out", type=Path, default=ROOT / ".whl")
    a.add_argument("--split", type=int, metavar="MIB", help="parts of at most MIB MiB")
    b = sub.add_parser("install", help="on the node: join, verify, install into a folder")
    b.add_argument("--dir", type=Path, default=ROOT / ".whl")
    b.add_argument("--target", type=Path, default=Path("/tmp/site"))
    args = p.parse_args(argv)
    if args.command == "pack":
        m = pack(args.node, args.python, args.out, args.split)
        size = sum(w["bytes"] for w in m["wheels"]) / MiB
        parts = len(m["tar"]["parts"]) if "tar" in m else 0
        split = f": {parts} parts of at most {args.split} MiB" if parts else ""
        print(f"{len(m['wheels'])} wheels, {size:.0f} MiB, for Python {m['python']} with torch {m['torch']} and "
              f"vLLM {m['vllm']}{split} in {args.out}")
        for name, why in m["left_out"].items():
            print(f"  left out {name} {why}")
    else:
        for line in install(args.dir, args.target):
            print("installed", line)
        print(f"into {args.target}: PYTHONPATH={args.target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
