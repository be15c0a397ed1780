"""Test tiers, and where the real-data tests find the benchmark files (math/aime24.json, code/leetcode.json, ...: see
docs/testing.md), in one place.

A file such as `math/aime24.json` is looked up in this order:
  1. $GAPO_DATA_DIR (the same variable gapo-eval reads),
  2. <repo>/../shared/data (our CI's checkout layout),
  3. only when GAPO_TEST_HUB=1: the benchmark's public Hugging Face dataset, for the few files in HUB_COPIES.
When none has it, the test is skipped with a reason naming the file and the variable to set. A user's clone
has no ../shared, and `make test` must pass there; our CI sets GAPO_REQUIRE_DATA=1 so that a missing file
fails instead, and a real-data test can never be skipped there unnoticed.

The hub is opt-in because a download attempt is not cheap to rule out: behind a firewall that drops packets
each request waits for its timeout, and that would slow every `make test` on an offline machine.

Tiers (pyproject.toml registers the markers; --strict-markers makes a misspelled one a collection error):
- unmarked: unit tests, seconds each; `make test` runs them all.
- `e2e`: starts gapo-train, gapo-eval, gapo-sweep or a rehearsal in a subprocess (real vLLM, DeepSpeed, rewarders).
- `dist`: a torchrun check on several ranks.
- `smoke`: an e2e or dist test that `make test` runs anyway, so that the fast tier still exercises the real stack.
- `cluster`: runs jobs under a real SLURM (munged, slurmctld, slurmd started by the session fixture `slurm`,
  tests/slurm_cluster.py). Where SLURM cannot start (not root, packages missing) these tests skip with the reason;
  CI sets GAPO_REQUIRE_SLURM=1 (CI=true does the same), and there they fail instead.
`make test-all` (CI) runs every tier. A test that launches one of those programs without its marker fails at
once (`_guard_launches`), and one that uses the `torchrun` fixture without `dist` fails collection, so a slow
test cannot hide in the fast tier.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# --------------------------------------------------------------------------------------------------
# Tiers
# --------------------------------------------------------------------------------------------------
# What a command line must contain to count as a launch of the real stack: (needle, the marker it needs).
LAUNCHES = (("torch.distributed.run", "dist"), ("gapo-train", "e2e"), ("gapo-eval", "e2e"), ("gapo-sweep", "e2e"),
            ("check.sh", "e2e"),
            ("gapo.cli", "e2e"), ("gapo.study.sweep", "e2e"))
_current: list[pytest.Item] = []  # the test being set up, run or torn down
_real_popen_init = subprocess.Popen.__init__


def _guard_launches(self, args, *rest, **kwargs):
    """subprocess.Popen, refusing a launch of the real stack from a test that lacks its tier's marker."""
    words = [str(a) for a in (args if isinstance(args, list | tuple) else [args])]
    item = _current[-1] if _current else None
    if item is not None and not {"--help", "--print-config", "--print", "--budget"} & set(words):  # read configs only
        marks = {m.name for m in item.iter_markers()}
        for needle, marker in LAUNCHES:
            if any(needle in w for w in words) and marker not in marks and not (marker == "e2e" and
                                                                                 {"dist", "cluster"} & marks):
                raise pytest.fail.Exception(f"{item.nodeid} starts {needle} but is not marked @pytest.mark.{marker}: "
                                            "mark it (tests/conftest.py, Tiers), or `make test` would run it in the "
                                            "fast tier", pytrace=False)
    _real_popen_init(self, args, *rest, **kwargs)


subprocess.Popen.__init__ = _guard_launches


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current.append(item)
    try:
        return (yield)
    finally:
        _current.pop()


# --------------------------------------------------------------------------------------------------
# Side by side: `make test` and `make test-all` run two workers (pytest-xdist; issue 58)
# --------------------------------------------------------------------------------------------------
# A module's tests run on one worker, so that its module-scoped set-ups are built once, and modules that must not
# overlap, or that share a set-up (`once`), form one group:
GROUPS = {
    # the 1-rank tiny_cpu reference run (test_checkpoint.reference) that test_lora's runs are compared with
    "test_checkpoint": "checkpoints", "test_lora": "checkpoints",
    # sandboxed programs run as the user nobody, whose process limit (RLIMIT_NPROC: the fork-bomb test fills it) and
    # process list (test_sandbox's "nothing left behind") are the whole machine's
    **dict.fromkeys(("test_sandbox", "test_reward_code", "test_leetcode_harness", "test_reward_registry",
                     "test_paper_configs"), "sandbox"),
}
# The longest groups first (docs/PERFORMANCE.md §13, the --durations table), so that the other worker takes the short
# ones meanwhile instead of being left with one long group at the end; the rest in file order.
FIRST = ("test_cluster", "checkpoints", "sandbox", "test_split", "test_sweep", "test_engine", "test_gpu_check",
         "test_evaluate")


def group_of(nodeid: str) -> str:
    module = Path(nodeid.split("::", 1)[0]).stem
    return GROUPS.get(module, module)


def pytest_xdist_make_scheduler(config, log):
    """xdist's scheduler that hands out whole groups (GROUPS), in collection order. Not its xdist_group marks:
    under pytest 9 the node-id suffix they rely on no longer reaches the scheduler, and each test became a unit of
    its own (measured: test_cluster's 13-minute set-up built on both workers)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return ByGroup(config, log)


def pytest_collection_modifyitems(config, items):
    missing = [item.nodeid for item in items
               if "torchrun" in getattr(item, "fixturenames", ()) and item.get_closest_marker("dist") is None]
    if missing:
        raise pytest.UsageError("tests using the torchrun fixture must be marked @pytest.mark.dist: "
                                + ", ".join(missing))
    rank = {group: i for i, group in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(group_of(item.nodeid), len(FIRST)))  # stable: file order within a group

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A one-node SLURM (tests/slurm_cluster.py) for the session: started at first use, stopped by pid after.
    Skipped with the reason where it cannot start; failed instead under GAPO_REQUIRE_SLURM=1 or CI=true."""
    from slurm_cluster import Cluster, unavailable

    def cannot(reason: str):
        if os.environ.get("GAPO_REQUIRE_SLURM") == "1" or os.environ.get("CI") == "true":
            pytest.fail(f"GAPO_REQUIRE_SLURM=1 / CI=true: {reason}", pytrace=False)
        pytest.skip(reason)

    why = unavailable()
    if why:
        cannot(why)
    cluster = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except (RuntimeError, subprocess.CalledProcessError, OSError) as err:
        cluster.stop()
        cannot(f"SLURM did not start: {err}")
    yield cluster
    cluster.stop()

# Files whose public dataset should hold the same records with the fields the tests read (unverified here:
# our machines reach no hub). The other files are the rllm project's own layout (fields the public sets lack,
# such as leetcode's `solutions`, or no public id at all), so a hub copy would fail their assertions rather
# than test anything. The names are gapo-eval's, whose BENCHMARKS table holds the dataset ids.
HUB_COPIES = {"math/math500.json": "math500", "math/amc.json": "amc"}


def local_data_dirs() -> list[Path]:
    """The local places to look, in order: $GAPO_DATA_DIR when set, then <repo>/../shared/data."""
    env = os.environ.get("GAPO_DATA_DIR")
    return [*([Path(env).expanduser()] if env else []), REPO.parent / "shared" / "data"]


def _from_hub(relpath: str, cache: Path) -> tuple[Path | None, str]:
    """(the hub copy written as JSON under `cache`, or None; why not)."""
    if os.environ.get("GAPO_TEST_HUB") != "1":
        return None, "not tried without GAPO_TEST_HUB=1"
    if relpath not in HUB_COPIES:
        return None, "no public copy in this layout"
    import datasets

    from gapo.evaluation import BENCHMARKS

    bench = BENCHMARKS[HUB_COPIES[relpath]]
    try:
        records = list(datasets.load_dataset(bench.hf_id, split=bench.split))
    except Exception as err:  # offline, unknown id, no access: all mean "not available from the hub"
        return None, f"{bench.hf_id!r} failed: {type(err).__name__}: {str(err)[:200]}"
    out = cache / relpath
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records))
    return out, ""


@pytest.fixture(scope="session")
def data_dirs() -> list[Path]:
    """The local places shared_data looks in, present or not (the sandbox tests check it cannot see them)."""
    return local_data_dirs()


@pytest.fixture(scope="session")
def shared_data(tmp_path_factory) -> Callable[[str], Path]:
    """`shared_data("math/aime24.json")` -> the file's path, or the test is skipped (failed under
    GAPO_REQUIRE_DATA=1) with the places tried. Hub results, found or not, are remembered for the session."""
    hub: dict[str, tuple[Path | None, str]] = {}

    def find(relpath: str) -> Path:
        for d in local_data_dirs():
            if (d / relpath).is_file():
                return d / relpath
        if relpath not in hub:
            hub[relpath] = _from_hub(relpath, tmp_path_factory.getbasetemp() / "hub-data")
        path, why = hub[relpath]
        if path is not None:
            return path
        tried = " or ".join(str(d / relpath) for d in local_data_dirs())
        reason = (f"benchmark file {relpath} not found (tried {tried}; Hugging Face: {why}); "
                  f"set GAPO_DATA_DIR to a directory holding {relpath} (docs/testing.md)")
        if os.environ.get("GAPO_REQUIRE_DATA") == "1":
            pytest.fail(f"GAPO_REQUIRE_DATA=1: {reason}", pytrace=False)
        pytest.skip(reason)

    return find


@pytest.fixture(scope="session")
def shared_records(shared_data) -> Callable[[str], list]:
    """`shared_records("code/leetcode.json")` -> the file's records (a JSON list), found as by shared_data."""
    return lambda relpath: json.loads(shared_data(relpath).read_text())


@pytest.fixture(scope="session")
def once(tmp_path_factory) -> Callable[[str, Callable[[Path], Any]], Any]:
    """`once(key, make)` -> make(a fresh folder), called the first time `key` is asked for in the session; later
    calls return its result (or raise its error again) without making it anew. For a set-up that tests in several
    files share, such as a gapo-train run that they only read (test_checkpoint.reference): each gapo-train start
    costs about 20 s on a 2-core CI machine (issue 46)."""
    made: dict[str, tuple[Any, BaseException | None]] = {}

    def get(key: str, make: Callable[[Path], Any]) -> Any:
        if key not in made:
            try:
                made[key] = (make(tmp_path_factory.mktemp(re.sub(r"[^\w.-]+", "_", key)[:60])), None)
            except Exception as err:  # a failed set-up (an assert included) fails every test that shares it
                made[key] = (None, err)
        result, error = made[key]
        if error is not None:
            raise error
        return result

    return get


# --------------------------------------------------------------------------------------------------
# Helpers shared by several test files
# --------------------------------------------------------------------------------------------------
# For subprocesses: OpenMP threads that spin while waiting would starve the other ranks on a small machine.
ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "WANDB_SILENT": "true"}


def fenced(program: str, tag: str = "python") -> str:
    """A response that gives `program` in a fenced code block, with prose around it as a model writes."""
    return f"Here is my solution.\n```{tag}\n{program}\n```\nDone."


def run_torchrun(script: str, out_dir: Path, *args: str, nproc: int, timeout: int = 300) -> list[dict]:
    """tests/dist/<script> under torchrun from the repository root, with an output path in `out_dir` before the given
    arguments; each rank's JSON result (the script writes <out>.<rank>). A failed run fails the test with the end of
    its stderr. No --master_port: on one node torchrun then rendezvouses on a port the OS gives it (localhost:0), so
tests that run side by side (pytest -n) never meet."""
    out = out_dir / Path(script).stem
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                        f"tests/dist/{script}", str(out), *args], cwd=REPO, env=ENV, capture_output=True, text=True,
                       timeout=timeout)
    # whether a failed rank had written its result tells a fault in the work from one on the way out
    written = [rank for rank in range(nproc) if Path(f"{out}.{rank}").exists()]
    assert r.returncode == 0, f"exit {r.returncode}; ranks that wrote their result: {written}\n{r.stderr[-4000:]}"
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(nproc)]


@pytest.fixture
def torchrun(tmp_path) -> Callable[..., list[dict]]:
    """`torchrun("dist_grad_check.py", "3", nproc=2)`: run_torchrun with the test's own folder."""
    return lambda script, *args, nproc, timeout=300: run_torchrun(script, tmp_path, *args, nproc=nproc,
                                                                  timeout=timeout)
