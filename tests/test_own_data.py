"""docs/own-data.md, word for word: its files written from its blocks, its commands run in an empty folder, and the
run it ends with trained with the reader's model folder, problems and rewarder."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "own-data.md"


def blocks(text: str) -> list[tuple[str, str, str]]:
    """(language, title, body) of each fenced block, in order."""
    return [(m[1], m[2] or "", m[3]) for m in re.finditer(r'^```(\w+)(?: title="([^"]+)")?\n(.*?)^```$', text,
                                                        flags=re.M | re.S)]


@pytest.mark.e2e
def test_the_guide_runs_as_written(tmp_path):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "WANDB_SILENT": "true",
           "OMP_WAIT_POLICY": "PASSIVE"}
    steps = blocks(GUIDE.read_text())
    assert [lang for lang, _, _ in steps] == ["json", "python", "bash", "bash"], steps
    for _, title, body in steps:
        if title:
            (tmp_path / title).write_text(body)
        else:
            r = subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=tmp_path, env=env, capture_output=True,
                               text=True, timeout=600)
            assert r.returncode == 0, (body, r.stderr[-4000:])
    run = tmp_path / "runs" / "mine"
    saved = (run / "config.yaml").read_text()
    assert "my-model" in saved and "my_problems.jsonl" in saved and "last_number" in saved
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    records = [json.loads(x) for x in (run / "rollouts.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 4 * 8 and len({r["problem"] for r in records}) >= 4  # 2 steps of 4 prompts x 8
    # every response went through the reader's rewarder: its statuses only, its detail where it found a number
    assert {r["status"] for r in records} <= {"correct", "wrong", "no_answer"}
    said = [r for r in records if r["status"] != "no_answer"]
    assert all(re.fullmatch(r"said -?\d+, expected \d+", r["detail"]) for r in said)


def test_a_plugin_that_is_missing_or_takes_a_used_name_is_refused_and_a_file_is_saved_absolute(tmp_path,
                                                                                                monkeypatch):
    from gapo.configfile import load_plugins, resolve
    from gapo.errors import ConfigError
    from gapo.reward import registry

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"plugins: nope.py: no such file"):
        load_plugins(["nope.py"])
    with pytest.raises(ConfigError, match=r"plugins: no_such_module_here: not importable"):
        load_plugins(["no_such_module_here"])
    with pytest.raises(ConfigError, match=r"plugins: expected a list"):
        resolve({"plugins": "x.py"})
    (tmp_path / "clash.py").write_text("from gapo.reward.registry import RewardKind, register\n"
                                       "register('math', RewardKind(score=lambda g, p, c: []))\n")
    with pytest.raises(ConfigError, match=r"plugins: clash.py: register\('math', ...\): the rewarder table has a row"):
        load_plugins(["clash.py"])
    assert registry.REWARDERS["math"].score.__module__ == "gapo.reward.math"
    (tmp_path / "fine.py").write_text("import sys\nsys.modules[__name__].loaded = getattr(sys, 'gapo_t', 0)\n")
    cfg = resolve({"plugins": ["fine.py"]})
    assert cfg.plugins == [str(tmp_path / "fine.py")]
