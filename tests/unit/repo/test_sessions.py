"""tests/sessions.py: a command's children die with it when its test's clock runs out (real processes)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.sessions import run_session


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet, where the machine's init does not, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_timeout_kills_the_grandchildren_that_ignore_sigterm(tmp_path):
    pidfile = tmp_path / "child.pid"
    child = ("import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
             f"open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(300)")
    parent = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(300)"
    with pytest.raises(subprocess.TimeoutExpired):
        run_session([sys.executable, "-c", parent], timeout=3)
    pid = int(pidfile.read_text())
    for _ in range(100):  # SIGKILL is delivered asynchronously
        if not _alive(pid):
            break
        time.sleep(0.05)
    assert not _alive(pid)


def test_a_command_that_ends_gives_its_output_and_code():
    out = run_session([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
                      timeout=60)
    assert (out.returncode, out.stdout, out.stderr) == (3, "out\n", "err\n")
