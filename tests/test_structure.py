"""The package's shape, checked from the source: no import cycle among gapo's modules, the training loop a
leaf that only the CLI imports, the sandbox's host and harness in files of their own, and both rollout
engines satisfying the Engine protocol that the loop and gapo-eval are typed against.

Imports are read with ast, including those inside functions: a lazy import still ties two modules together.
"""

from __future__ import annotations

import ast
import inspect
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LOOP = "gapo.trainer.loop"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(tree: ast.AST, modules: set[str] | None = None) -> set[str]:
    """Every module an ast imports, anywhere in it. `from a.b import c` names a.b.c when that is one of
    `modules`, else a.b."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if modules is not None and sub in modules else node.module)
    return out


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports."""
    files = {module_name(p, package.parent): p for p in sorted(package.rglob("*.py"))}
    return {name: imported(ast.parse(path.read_text()), set(files)) & set(files) - {name}
            for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_find_cycle_finds_a_lazy_import_loop(tmp_path):
    """The checker itself: evaluate <-> loop, the loop this layout removed, with one side importing lazily."""
    pkg = tmp_path / "gapo"
    (pkg / "trainer").mkdir(parents=True)
    for init in (pkg / "__init__.py", pkg / "trainer" / "__init__.py"):
        init.write_text("")
    (pkg / "evaluate.py").write_text("def main():\n    from gapo.trainer.loop import build_engine\n")
    (pkg / "trainer" / "loop.py").write_text("from gapo.evaluate import evaluate\n")
    (pkg / "trainer" / "actor.py").write_text("from gapo.trainer import loop\n")
    graph = import_graph(pkg)
    assert graph["gapo.trainer.actor"] == {"gapo.trainer.loop"}
    assert find_cycle(graph) == ["gapo.evaluate", "gapo.trainer.loop", "gapo.evaluate"]
    (pkg / "evaluate.py").write_text("def main():\n    from gapo.rollout.engine import build_engine\n")
    assert find_cycle(import_graph(pkg)) is None


def test_no_import_cycle_in_gapo():
    graph = import_graph(REPO / "gapo")
    assert LOOP in graph and "gapo.study.eval" in graph and "gapo.evaluation" in graph
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_only_the_cli_imports_the_training_loop():
    """The loop is the recipe; the plumbing it uses lives in gapo.distributed, gapo.rollout.engine and
    gapo.trainer.checkpoint, so benches, tests and gapo-eval need not import it. A string naming the loop's
    module counts too (importlib, mock.patch)."""
    importers = []
    for path in sorted(p for d in ("gapo", "tests", "bench") for p in (REPO / d).rglob("*.py")):
        if path == Path(__file__).resolve():
            continue
        tree = ast.parse(path.read_text())
        modules = imported(tree, {LOOP})
        strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        if LOOP in modules or any(s == LOOP or s.startswith(LOOP + ".") for s in strings):
            importers.append(str(path.relative_to(REPO)))
    assert importers == ["gapo/cli.py"]


def test_nothing_below_the_trainer_imports_it():
    """The training system sits above evaluation, data, rewards, rollouts and the run directory: those import
    nothing of gapo.trainer (gapo-eval once reached into trainer.checkpoint for `find`, which lives in rundir)."""
    graph = import_graph(REPO / "gapo")
    above = {"gapo.cli", "gapo.rehearse", "gapo.launch"}  # gapo.launch: torchrun for gapo-train (its signals)
    offenders = {m: sorted(d for d in deps if d.startswith("gapo.trainer")) for m, deps in graph.items()
                 if not m.startswith("gapo.trainer") and m not in above}
    assert {m: d for m, d in offenders.items() if d} == {}


def test_process_groups_and_engines_sit_below_the_trainer():
    """gapo.distributed and gapo.rollout are what the trainer, gapo-eval and the benches stand on: they import nothing
    above them, and distributed nothing of the engines (init_distributed returns the placement; the split protocol
    and its transport build on it). Lazy imports count."""
    graph = import_graph(REPO / "gapo")
    above = ("gapo.trainer", "gapo.study", "gapo.cli", "gapo.launch", "gapo.rehearse")
    low = [m for m in graph if m == "gapo.distributed" or m.startswith("gapo.rollout")]
    assert {"gapo.distributed", "gapo.rollout.split", "gapo.rollout.transport"} <= set(low)
    offenders = {m: sorted(d for d in graph[m] if d.startswith(above)) for m in low}
    assert {m: d for m, d in offenders.items() if d} == {}
    assert sorted(d for d in graph["gapo.distributed"] if d.startswith("gapo.rollout")) == []


def test_the_training_system_does_not_stand_on_the_study_wing():
    """The trainer, the rollout engines and the rewarders are siblings of gapo.study, not its tenants: what validation
    and gapo-eval share lives in gapo.evaluation (below both), IFEval's scoring in gapo.reward. Lazy imports count."""
    graph = import_graph(REPO / "gapo")
    below = ("gapo.trainer", "gapo.rollout", "gapo.reward", "gapo.evaluation")
    offenders = {m: sorted(d for d in deps if d.startswith("gapo.study")) for m, deps in graph.items()
                 if m.startswith(below)}
    assert {m: d for m, d in offenders.items() if d} == {}
    assert "gapo.study.eval" not in graph[LOOP] and "gapo.evaluation" in graph[LOOP]  # the guard sees the loop


def test_no_module_imports_anothers_private_names():
    """A name with a leading underscore is its module's own; one that two modules need belongs in a shared module
    under a public name (gapo-compare once drew with gapo-plot's private helpers)."""
    found = []
    for path in sorted((REPO / "gapo").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gapo"):
                found += [f"{path.relative_to(REPO)}: {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_")]
    assert found == []


def test_configerror_is_imported_from_one_place():
    """gapo.errors defines it; every module, test and bench script imports it from there (it was 14 from gapo.config,
    14 from gapo.errors), so a reader finds one definition and a grep finds every raiser."""
    found = []
    for path in sorted(p for folder in ("gapo", "tests", "bench") for p in (REPO / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module != "gapo.errors" and "ConfigError" in {
                    a.name for a in node.names}:
                found.append(f"{path.relative_to(REPO)}: from {node.module}")
    assert found == []


def test_every_module_has_its_tests_named_in_the_tests_map():
    """tests/README.md maps each module of gapo/ to the files that test it (the test files are named for what they test,
    a module by several): a new module is not done until the map says where it is tested."""
    text = (REPO / "tests" / "README.md").read_text()
    import re

    mapped = {name.split("/")[-1] for name in re.findall(r"[\w/]+\.py", text)}
    missing = [str(p.relative_to(REPO)) for p in sorted((REPO / "gapo").rglob("*.py"))
               if p.name != "__init__.py" and p.name not in mapped]
    assert missing == [], f"tests/README.md does not name {missing}"


def test_sandbox_host_and_harness_are_separate_programs():
    """The harness runs by path as PID 1 inside the namespaces (python -I: no gapo on its path), so it imports
    the standard library only and ends in its entry point; the host is a plain module."""
    host_path, harness_path = REPO / "gapo/reward/sandbox.py", REPO / "gapo/reward/sandbox_harness.py"
    host, harness = ast.parse(host_path.read_text()), ast.parse(harness_path.read_text())

    def main_blocks(tree: ast.Module) -> list[ast.If]:
        return [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "__name__ == '__main__'"]

    assert main_blocks(host) == [] and "noqa: E402" not in host_path.read_text()
    blocks = main_blocks(harness)
    assert len(blocks) == 1 and blocks[0] is harness.body[-1], "the harness's entry point ends its file"
    assert ast.unparse(blocks[0].body[0]) == "main()"
    outside = {m for m in imported(harness) if m.split(".")[0] not in sys.stdlib_module_names}
    assert outside == set(), f"the harness imports {outside}"
    assert "gapo.reward.sandbox_harness" in imported(host, {"gapo.reward.sandbox_harness"})


@pytest.mark.parametrize("module, cls", [("gapo.rollout.hf_engine", "HFEngine"),
                                         ("gapo.rollout.vllm_engine", "VLLMEngine"),
                                         ("gapo.rollout.split", "RemoteEngine")])
def test_engines_satisfy_the_engine_protocol(module, cls):
    """Same methods, same parameter names, as the Protocol (vllm itself is imported only when an engine is built)."""
    import importlib

    from gapo.rollout.engine import Engine

    engine = getattr(importlib.import_module(module), cls)
    wanted = [name for name, f in vars(Engine).items() if inspect.isfunction(f) and not name.startswith("_")]
    assert wanted == ["generate", "push_weights", "sleep"]  # sleep: the rollout queue's (sleep_between_steps)
    for name in wanted:
        assert list(inspect.signature(getattr(engine, name)).parameters) == \
            list(inspect.signature(getattr(Engine, name)).parameters), f"{cls}.{name}"


def test_an_unmarked_test_cannot_start_the_real_stack():
    """The tier guard (tests/conftest.py): this test has no marker, so each launch is refused before it starts,
    naming the marker it needs; a command that only reads configs passes."""
    import subprocess

    with pytest.raises(pytest.fail.Exception, match=r"starts gapo.cli but is not marked @pytest.mark.e2e"):
        subprocess.Popen([sys.executable, "-m", "gapo.cli", "--config", "tiny_cpu"])
    with pytest.raises(pytest.fail.Exception, match=r"starts torch.distributed.run but is not marked .*mark.dist"):
        subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "x.py"])
    r = subprocess.run([sys.executable, "-m", "gapo.cli", "--config", "tiny_cpu", "--help"], capture_output=True,
                       text=True)
    assert r.returncode == 0 and r.stdout.startswith("usage: gapo-train")  # it ran: the guard let it through


def test_each_study_command_lives_in_the_module_named_for_it():
    """gapo-X is gapo/study/X.py: the command lines are found by name, and gapo/evaluation.py (what validation and
    gapo-eval share) is not mistaken for gapo-eval's command line (gapo/study/eval.py)."""
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    for command, target in scripts.items():
        if target.startswith("gapo.study."):
            assert target == f"gapo.study.{command.removeprefix('gapo-')}:main", (command, target)
    assert {"gapo-eval", "gapo-compare", "gapo-plot", "gapo-sweep"} <= set(scripts)


def test_the_architecture_page_names_every_module_and_only_those():
    """docs/architecture.md's block is the map a newcomer reads: each module of the package is on it (by path, or by
    file name under its folder's line), and each file it names exists."""
    import re

    block = (REPO / "docs" / "architecture.md").read_text().split("```")[1]
    files = [p for p in (REPO / "gapo").rglob("*.py") if p.name != "__init__.py"]
    missing = [str(p.relative_to(REPO)) for p in files if not re.search(rf"(?<![\w.]){re.escape(p.name)}\b", block)]
    assert not missing, f"docs/architecture.md does not name {missing}"
    gone = set(re.findall(r"(?<![\w.])(\w+\.py)\b", block)) - {p.name for p in files}
    assert not gone, f"docs/architecture.md names files that do not exist: {sorted(gone)}"
