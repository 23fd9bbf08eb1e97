"""``python -m streamgrpo.learner.ranks`` (how ``up`` and the Slurm job start several learner ranks): torchrun itself,
stopped by SIGTERM or ended by a failed rank in one line instead of a traceback (real torchrun, real ranks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from streamgrpo.runtime.processes import free_port
from tests.paths import REPO
from tests.sessions import run_session

ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
RANK = """
import os, sys, time
from pathlib import Path
rank = int(os.environ["RANK"])
Path(sys.argv[1], f"rank{rank}.pid").write_text(str(os.getpid()))
if rank == int(sys.argv[2]):
    sys.exit(3)
time.sleep(120)
"""


def _launch(tmp_path, fail_rank: int) -> list[str]:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    return [sys.executable, "-m", "streamgrpo.learner.ranks", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), "--monitor-interval", "0.5", str(script), str(tmp_path), str(fail_rank)]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_sigterm_stops_the_ranks_in_one_line_and_exits_143(tmp_path):
    proc = subprocess.Popen(_launch(tmp_path, fail_rank=-1), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"rank{r}.pid").exists() for r in (0, 1)):
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else ""
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "learner ranks: stopped by SIGTERM (torchrun stopped the ranks)" in err and "Traceback" not in err, err
    assert all(_gone(int((tmp_path / f"rank{r}.pid").read_text())) for r in (0, 1))


def test_a_failed_rank_is_one_line_with_its_exit_code(tmp_path):
    out = run_session(_launch(tmp_path, fail_rank=1), env=ENV, timeout=180)
    assert out.returncode == 3, out.stderr[-3000:]
    assert "learner ranks: rank 1 exited with code 3 (its own lines above say why)" in out.stderr, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "ChildFailedError" not in out.stderr, out.stderr[-3000:]
