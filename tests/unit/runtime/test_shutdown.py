"""How processes end: `up` stops its children side by side (generators, then the learner), a process
that ignores SIGTERM is killed after the grace period, and `python -m streamgrpo` skips the cyclic
garbage collection at exit. Real processes, signalled by PID."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

CHILD = """
import json, signal, sys, time
from pathlib import Path
out, linger, polite = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "polite"
def on_term(*_):
    if not polite:
        return
    t = time.time()
    time.sleep(linger)  # finishing its unit of work
    out.write_text(json.dumps({"term": t, "exit": time.time()}))
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
out.with_suffix(".ready").write_text("1")
while True:
    time.sleep(0.05)
"""


def _start(tmp_path: Path, name: str, linger: float = 0.5, polite: bool = True) -> tuple[list[str], Path]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return [sys.executable, str(script), str(tmp_path / f"{name}.json"), str(linger),
            "polite" if polite else "stubborn"], tmp_path / f"{name}.json"


def _wait_ready(paths: list[Path]) -> None:
    deadline = time.monotonic() + 60
    while not all(p.with_suffix(".ready").exists() for p in paths):
        assert time.monotonic() < deadline, "the children did not start"
        time.sleep(0.02)


def test_stop_processes_signals_all_at_once_and_kills_one_that_ignores_sigterm(tmp_path):
    from streamgrpo.runtime.processes import stop_processes

    specs = [_start(tmp_path, "a"), _start(tmp_path, "b"), _start(tmp_path, "deaf", polite=False)]
    procs = [subprocess.Popen(argv) for argv, _ in specs]
    _wait_ready([p for _, p in specs])
    codes = stop_processes(procs, grace_s=3.0)
    assert codes == [0, 0, -9], codes  # the polite ones finished their work; the deaf one was killed
    a, b = (json.loads(p.read_text()) for _, p in specs[:2])
    # side by side: each got SIGTERM before the other had finished (one after the other: b's signal
    # would come after a's exit)
    assert max(a["term"], b["term"]) < min(a["exit"], b["exit"]), (a, b)
    assert not specs[2][1].exists()


def test_up_stops_its_generators_side_by_side_then_the_learner(tmp_path):
    """The learner is signalled once every generator has stopped (while it still reads, a generator
    blocked on a full queue gets its room), the generators together."""
    from streamgrpo.commands.up_children import Child, stop_children

    names = ["learner", "generator-0", "generator-1"]
    specs = {n: _start(tmp_path, n) for n in names}
    children = [Child(n, specs[n][0], tmp_path / f"{n}.log", {}) for n in names]
    _wait_ready([p for _, p in specs.values()])
    assert stop_children(children, grace_s=30.0) == [0, 0, 0]
    seen = {n: json.loads(specs[n][1].read_text()) for n in names}
    gens = [seen["generator-0"], seen["generator-1"]]
    assert max(g["term"] for g in gens) < min(g["exit"] for g in gens), gens  # side by side
    assert seen["learner"]["term"] >= max(g["exit"] for g in gens), seen  # the learner last
    assert all(c._fh.closed for c in children)


def test_python_m_streamgrpo_freezes_the_garbage_collector_at_exit():
    """After every other exit handler (they run last in, first out): the cyclic collection over what
    torch and transformers leave behind took seconds of each role's exit."""
    probe = ("import atexit, gc, runpy, sys\n"
             "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count() > 0))\n"
             "sys.argv = ['streamgrpo', 'config', 'show', '--config', 'demo']\n"
             "runpy.run_module('streamgrpo', run_name='__main__')\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "frozen at exit: True" in out.stdout, out.stdout[-500:]


def test_up_notices_the_learners_exit_at_once_not_at_its_next_status(tmp_path):
    """`up` shows its status every ``status_every_s`` and waits on the learner in between: the run ends
    when the learner does, not up to a status interval later."""
    import threading

    from streamgrpo.commands.up_children import Child
    from streamgrpo.commands.up_watch import Watch
    from streamgrpo.config import load_config

    gen_argv, gen_out = _start(tmp_path, "generator-0")
    learner = Child("learner", [sys.executable, "-c", "import time, sys; time.sleep(1); sys.exit(7)"],
                    tmp_path / "learner.log", {})
    gen = Child("generator-0", gen_argv, tmp_path / "generator-0.log", {})
    watch = Watch(load_config("demo"), {}, tmp_path / "metrics.jsonl")
    codes: list[int] = []
    t = threading.Thread(target=lambda: codes.append(watch.until_done([learner, gen], status_every_s=600.0)),
                         daemon=True)
    try:
        t.start()
        t.join(120.0)  # a sleep between statuses would end 600 s after the start
        assert not t.is_alive() and codes == [7], "up waited out its status interval after the learner exited"
    finally:
        gen.stop(grace_s=30.0)
        learner.stop()
        watch.close()


def test_a_process_still_there_after_sigkill_does_not_stop_the_others_from_being_stopped(caplog):
    """A child that is still tearing down 10 s after SIGKILL (a GPU context, say): the wait gives up with a
    warning and the next process is stopped all the same (pure logic: stand-ins for Popen)."""
    from streamgrpo.runtime.processes import stop_processes

    class Stuck:
        pid, returncode = 4242, None

        def __init__(self):
            self.signals, self.killed = [], False

        def poll(self):
            return None

        def send_signal(self, sig):
            self.signals.append(sig)

        def kill(self):
            self.killed = True

        def wait(self, timeout=None):
            raise subprocess.TimeoutExpired("stuck", timeout)

    class Polite(Stuck):
        pid = 4343

        def wait(self, timeout=None):
            self.returncode = 0
            return 0

    stuck, polite = Stuck(), Polite()
    with caplog.at_level("WARNING"):
        codes = stop_processes([stuck, polite], grace_s=0.0)
    assert codes == [None, 0] and stuck.killed and not polite.killed and polite.signals
    assert "still running 10s after SIGKILL" in caplog.text
