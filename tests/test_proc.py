"""gapo/proc.py: /proc/<pid>/stat read in one place, a command name with spaces and parentheses included."""

import os
import subprocess
import sys

from gapo.proc import processes, stat_fields


def test_fields_after_a_command_name_with_spaces_and_parentheses(tmp_path):
    odd = tmp_path / "a b) (c"
    odd.symlink_to(sys.executable)
    child = subprocess.Popen([str(odd), "-c", "import time; time.sleep(30)"])
    try:
        fields = stat_fields(child.pid)
        # alive: running, sleeping, or in disk sleep while it loads (seen on a loaded machine); fields[1] is the
        # parent pid only when the name's ") (" was not taken for the end of the name
        assert fields[0] in "RSD" and int(fields[1]) == os.getpid()
        assert child.pid in {pid for pid, f in processes() if int(f[1]) == os.getpid()}
    finally:
        child.kill()
        child.wait()
    assert stat_fields(child.pid) is None  # ended and reaped
    assert int(stat_fields()[1]) == os.getppid()
