"""The rewarder table is the one place a new kind of reward goes (gapo/reward/registry.py, REWARDERS): a toy fourth
kind, registered from outside the package, trains a tiny run end to end with no file of gapo edited."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gapo.config import DataConfig
from gapo.reward.registry import REWARDERS, rewarder, training_set

ROOT = Path(__file__).resolve().parents[1]

TOY = '''
"""A toy rewarder: a response is "correct" when it has an even number of characters."""
from gapo.reward.types import RewardResult


def score_records(groups, problems, cfg):
    return [[RewardResult.of("correct" if len(r) % 2 == 0 else "wrong", f"{len(r)} characters") for r in g]
            for g in groups]


def check_record(problem):
    return ("empty answer", "the toy wants an answer") if not str(problem.gold).strip() else None
'''

# What a user's launcher does: one row added to the table, then gapo-train's own entry point.
LAUNCHER = '''
import sys

import toy_rewarder
from gapo.cli import train_main
from gapo.distributed import leave_distributed
from gapo.reward.registry import REWARDERS, RewardKind

REWARDERS["parity"] = RewardKind(score=toy_rewarder.score_records, check=toy_rewarder.check_record)
code = train_main(sys.argv[1:])
if code == 0:
    leave_distributed()
sys.exit(code)
'''


def test_the_table_names_the_shipped_kinds_and_refuses_others():
    assert list(REWARDERS) == ["math", "code", "ifeval"]
    with pytest.raises(ValueError, match=r"data.type='parity': no rewarder .* has math, code, ifeval"):
        rewarder("parity")
    with pytest.raises(ValueError, match="data.type='parity'"):  # before the training set is even read
        training_set(DataConfig(type="parity", train="/nonexistent.jsonl"), tokenizer=None)


@pytest.mark.e2e
def test_a_fourth_rewarder_trains_a_tiny_run_through_the_table(tmp_path):
    (tmp_path / "toy_rewarder.py").write_text(textwrap.dedent(TOY))
    (tmp_path / "launch_toy.py").write_text(textwrap.dedent(LAUNCHER))
    out = tmp_path / "run"
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "WANDB_SILENT": "true",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, str(tmp_path / "launch_toy.py"), "--config", "configs/tiny_cpu.yaml",
                        "data.type=parity", f"trainer.output_dir={out}", "trainer.total_steps=2",
                        "trainer.log_rollouts=true", "tracking.mode=disabled"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    rollouts = [json.loads(x) for x in (out / "rollouts.jsonl").read_text().splitlines()]
    assert {x["step"] for x in rollouts} == {1, 2} and len(rollouts) == 2 * 4 * 8
    for x in rollouts:  # every reward is the toy's verdict on the logged text
        assert (x["reward"], x["status"]) == ((1.0, "correct") if len(x["text"]) % 2 == 0 else (0.0, "wrong")), x
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if "reward/mean" in x]
    for m in steps:
        mine = [x["reward"] for x in rollouts if x["step"] == m["step"]]
        assert m["reward/mean"] == pytest.approx(sum(mine) / len(mine))
