"""A command with children (torchrun and its ranks) under a test's clock.

``subprocess.run(cmd, timeout=...)`` kills only the process it started: a torchrun launcher goes, its ranks stay,
and a rank blocked in a collective ignores SIGTERM, so after a test that timed out they hold the CPU for the rest of
the run. :func:`run_session` starts the command in a session of its own and, on timeout, kills that session's
process group (by its id, the command's PID) before raising ``TimeoutExpired`` as ``subprocess.run`` does.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence


def run_session(cmd: Sequence[str], *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)``, whose timeout also kills the
    command's children (every process of its new session)."""
    with subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                          **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(proc.args, timeout, out, err) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
