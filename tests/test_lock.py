"""requirements/cpu.lock against what asks for it: pyproject.toml (dependencies, extras cpu and dev),
requirements/cpu.in and requirements/cpu-overrides.txt (Makefile, `make lock`).

The lock is what `make install` and CI install, so a pyproject edit that the lock does not follow would go unnoticed
until a user installs from pyproject alone. The check needs no network: the lock is a valid resolution when every
requirement of pyproject and cpu.in is pinned at a version it allows, and the pins are closed under the dependencies
that the installed packages declare (this venv is the lock's, which the first test confirms).
"""

from __future__ import annotations

import importlib.metadata as md
import re
import tomllib
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements" / "cpu.lock"
# The platform the lock is written for (Makefile: --python-version 3.11.7 --python-platform x86_64-manylinux_2_28).
TARGET = {**default_environment(), "python_version": "3.11", "python_full_version": "3.11.7",
          "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
          "implementation_name": "cpython", "platform_python_implementation": "CPython"}


def pins(lock_text: str) -> dict[str, Version]:
    return {canonicalize_name(m[1]): Version(m[2])
            for m in re.finditer(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", lock_text, re.M)}


def requirement_lines(text: str) -> list[str]:
    return [line.split("#")[0].strip() for line in text.splitlines() if line.split("#")[0].strip()]


def roots(pyproject_text: str, cpu_in_text: str) -> list[Requirement]:
    project = tomllib.loads(pyproject_text)["project"]
    extras = project["optional-dependencies"]
    return [Requirement(r) for r in project["dependencies"] + extras["cpu"] + extras["dev"]
            + requirement_lines(cpu_in_text)]


def overridden(overrides_text: str) -> set[str]:
    """Names the overrides remove (a marker that never holds): the lock leaves them out on purpose."""
    return {canonicalize_name(Requirement(r).name) for r in requirement_lines(overrides_text)}


def applies(req: Requirement, extra: str = "") -> bool:
    return req.marker is None or req.marker.evaluate({**TARGET, "extra": extra})


def disagreements(pyproject_text: str, cpu_in_text: str, lock_text: str) -> list[str]:
    """What pyproject.toml or cpu.in asks for that the lock does not pin, or pins at a version it excludes."""
    locked = pins(lock_text)
    found = []
    for req in roots(pyproject_text, cpu_in_text):
        if not applies(req):
            continue
        version = locked.get(canonicalize_name(req.name))
        if version is None:
            found.append(f"{req}: not in the lock")
        elif not req.specifier.contains(version, prereleases=True):
            found.append(f"{req}: the lock pins {version}")
    return found


def read(name: str) -> str:
    return (REPO / name).read_text()


def test_this_venv_is_the_lock():
    """The closure check below reads the installed packages' metadata; it speaks for the lock only if they are it."""
    wrong = {name: (str(v), md.version(name)) for name, v in pins(LOCK.read_text()).items()
             if Version(md.version(name)) != v}
    assert not wrong, f"installed versions differ from requirements/cpu.lock (make install): {wrong}"


def test_pyproject_and_the_lock_agree():
    found = disagreements(read("pyproject.toml"), read("requirements/cpu.in"), LOCK.read_text())
    assert not found, "requirements/cpu.lock does not follow pyproject.toml: run `make lock`\n" + "\n".join(found)


@pytest.mark.parametrize("edit, named", [
    (lambda t: t.replace('"pyyaml",', '"pyyaml",\n    "polars>=1",'), "polars>=1: not in the lock"),
    (lambda t: t.replace('"deepspeed==0.19.8"', '"deepspeed==0.19.9"'), "deepspeed==0.19.9: the lock pins 0.19.8"),
    (lambda t: t.replace('dev = ["pip",', 'dev = ["pip", "hypothesis",'), "hypothesis: not in the lock"),
])
def test_a_pyproject_edit_without_make_lock_is_caught(edit, named):
    pyproject = read("pyproject.toml")
    assert edit(pyproject) != pyproject, "the edit no longer applies to pyproject.toml: update this test"
    assert named in disagreements(edit(pyproject), read("requirements/cpu.in"), LOCK.read_text())


def closure_problems(lock_text: str) -> list[str]:
    """Every dependency the locked packages declare for the target platform pinned at a version it allows, except
    what the overrides remove; every pin reachable from pyproject.toml or cpu.in (a stale pin installs a package that
    nothing asks for)."""
    locked = pins(lock_text)
    gone = overridden(read("requirements/cpu-overrides.txt"))
    todo = [(r, "") for r in roots(read("pyproject.toml"), read("requirements/cpu.in"))]
    reached: set[tuple[str, str]] = set()
    found = []
    while todo:
        req, extra = todo.pop()
        name = canonicalize_name(req.name)
        if not applies(req, extra) or name in gone:
            continue
        if name not in locked:
            found.append(f"{req}: not in the lock")
            continue
        if not req.specifier.contains(locked[name], prereleases=True):
            found.append(f"{req}: the lock pins {locked[name]}")
        for want in {""} | set(req.extras):
            if (name, want) not in reached:
                reached.add((name, want))
                todo += [(Requirement(r), want) for r in md.requires(name) or []]
    found += [f"{name}: pinned, asked for by nothing" for name in sorted(set(locked) - {n for n, _ in reached})]
    found += [f"{name}: removed by the overrides, pinned all the same" for name in sorted(gone & set(locked))]
    return found


def test_the_lock_is_closed_and_holds_nothing_stale():
    found = closure_problems(LOCK.read_text())
    assert not found, "requirements/cpu.lock is not a whole resolution (make lock):\n" + "\n".join(found)


def test_a_lock_missing_a_dependency_or_holding_an_extra_pin_is_caught():
    lock = LOCK.read_text()
    without_hjson = re.sub(r"^hjson==.*?(?=^\S)", "", lock, flags=re.M | re.S)
    assert "hjson" in " ".join(closure_problems(without_hjson)), "deepspeed needs hjson: its removal must be named"
    assert "polars: pinned, asked for by nothing" in closure_problems(lock + "polars==1.0.0\n")
