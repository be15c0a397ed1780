"""bench/_util.py: what the bench scripts' figures rest on (the memory peak of a command's process tree, and which
arms a rerun may report without running them again)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import _util  # noqa: E402  (bench/ is run by path, not a package)


def test_the_peak_counts_what_the_command_allocates():
    code = "import time\nx = bytearray(300 * 2**20)\nx[::4096] = b'1' * len(x[::4096])\ntime.sleep(1.5)\n"
    out, peak = _util.run_sampled([sys.executable, "-c", code + "print('done')"], interval_s=0.1)
    assert out.strip() == "done" and 0.29 < peak < 0.6, peak  # the 300 MiB touched, plus the interpreter


def test_a_command_that_fails_is_not_measured():
    with pytest.raises(RuntimeError, match="exited with 3"):
        _util.run_sampled([sys.executable, "-c", "import sys; sys.exit(3)"])


def test_a_finished_arm_is_reused_only_for_the_same_command(tmp_path, capsys):
    done, cmd = tmp_path / "bench_result.json", ["gapo-train", "--config", "demo_cpu.yaml", "trainer.lr=1e-5"]
    assert _util.cached_arm(done, cmd) is None  # nothing yet
    _util.save_arm(done, cmd, {"step_s": 2.0})
    assert _util.cached_arm(done, cmd) == {"step_s": 2.0}
    assert "(reused: " in capsys.readouterr().out
    assert _util.cached_arm(done, [*cmd[:-1], "trainer.lr=1e-4"]) is None  # another --lora-lr: run it again
    assert "from another command or code: running the arm again" in capsys.readouterr().out
    done.write_text('{"command": ')  # cut short while being written: a miss, not a traceback
    assert _util.cached_arm(done, cmd) is None
