"""The test helpers themselves: a process a test starts does not outlive it."""
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import run_process

# A launcher that starts a worker in a session of its own (as torchrun starts its ranks), prints the worker's
# pid and returns at once; the worker holds the launcher's stdout and sleeps.
LAUNCHER = """
import subprocess, sys
w = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print(w.pid, flush=True)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the processes through /proc")
def test_a_worker_in_its_own_session_is_killed_with_the_command():
    # Returns when the launcher does (waiting for the worker's stdout to close would pass the timeout and raise).
    proc = run_process([sys.executable, "-c", LAUNCHER], timeout=60)
    assert proc.returncode == 0
    pid = int(proc.stdout.split()[0])
    for _ in range(100):
        if not _alive(pid):
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail(f"the worker (pid {pid}, its own session) outlived run_process")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the processes through /proc")
def test_a_command_past_its_timeout_is_killed_and_raises():
    with pytest.raises(subprocess.TimeoutExpired):
        run_process([sys.executable, "-c", LAUNCHER + "\nimport time; time.sleep(600)"], timeout=3)
