"""Where a learner starts in a run directory: resume, refuse, or set the previous run aside; and the
log rewind a resume does (pure file logic, no model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from streamgrpo.config import ConfigError, load_config
from streamgrpo.learner.checkpoint.resume import start_point
from streamgrpo.learner.distributed import DistInfo
from streamgrpo.runtime.jsonl import rewind_jsonl


def _run_with_checkpoints(tmp_path):
    run = tmp_path / "run"
    for step in (4, 8):
        (run / "checkpoints" / f"step-{step:06d}").mkdir(parents=True)
    (run / "checkpoints" / "step-000012.tmp").mkdir()  # a crash while writing: not a checkpoint
    (run / "audit").mkdir()
    (run / "audit" / "learner.jsonl").write_text("{}\n")
    (run / "audit" / "generator-0.jsonl").write_text("{}\n")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    return run


def _cfg(run, *sets):
    return load_config("demo", [f"run_dir={run}", *sets])


def test_resume_picks_the_newest_complete_checkpoint(tmp_path):
    run = _run_with_checkpoints(tmp_path)
    assert start_point(_cfg(run, "learner.resume=true").learner, run, DistInfo()) == run / "checkpoints" / "step-000008"
    assert start_point(_cfg(tmp_path / "empty", "learner.resume=true").learner, tmp_path / "empty", DistInfo()) is None


def test_a_fresh_start_over_checkpoints_is_refused_with_one_clear_line(tmp_path):
    run = _run_with_checkpoints(tmp_path)
    with pytest.raises(ConfigError) as info:
        start_point(_cfg(run).learner, run, DistInfo())
    assert "step-000008" in str(info.value) and "--resume" in str(info.value) and "--fresh" in str(info.value)
    assert (run / "checkpoints" / "step-000008").is_dir()  # nothing touched
    with pytest.raises(ConfigError, match="pick one"):
        start_point(_cfg(run, "learner.resume=true", "learner.fresh=true").learner, run, DistInfo())


def test_fresh_moves_the_previous_learner_outputs_aside(tmp_path):
    run = _run_with_checkpoints(tmp_path)
    assert start_point(_cfg(run, "learner.fresh=true").learner, run, DistInfo()) is None
    (moved,) = (run / "previous").iterdir()
    assert sorted(p.name for p in (moved / "checkpoints").iterdir()) == ["step-000004", "step-000008", "step-000012.tmp"]
    assert (moved / "metrics.jsonl").is_file() and (moved / "audit" / "learner.jsonl").is_file()
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()
    assert (run / "audit" / "generator-0.jsonl").is_file()  # generators' logs are theirs


def test_a_second_up_in_the_same_run_dir_moves_the_whole_previous_run_aside(tmp_path):
    """`make demo` twice: `up`'s list names audit/learner*.jsonl and audit/ both; the folder moves once, whole."""
    from streamgrpo.commands.up import up_outputs
    from streamgrpo.runtime.run_dir import archive_previous

    run = _run_with_checkpoints(tmp_path)
    for name in ("summary.json", "reward.png", "redis/appendonlydir/x.aof", "audit/generator-1.jsonl"):
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text("x")
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file())
    moved = archive_previous(run, up_outputs(_cfg(run)))
    after = sorted(str(p.relative_to(moved)) for p in moved.rglob("*") if p.is_file())
    assert after == [p for p in before if not p.startswith("logs/")] and "audit/learner.jsonl" in after
    assert not (run / "audit").exists() and not (run / "checkpoints").exists() and not (run / "redis").exists()
    assert archive_previous(run, up_outputs(_cfg(run))) is None  # nothing left to move: a third run starts as clean


def test_rewind_drops_rows_after_the_step_and_a_torn_line(tmp_path):
    p = tmp_path / "m.jsonl"
    rows = [{"step": 1}, {"event": "dropped", "group_id": "x"}, {"step": 2}, {"step": 3}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "tor')
    assert rewind_jsonl(p, 2) == 2
    assert [json.loads(line) for line in p.read_text().splitlines()] == rows[:3]
    assert rewind_jsonl(p, 2) == 0 and rewind_jsonl(tmp_path / "none.jsonl", 2) == 0


def test_up_writes_no_redis_password_to_disk(tmp_path):
    """`streamgrpo up` hands queue.url to its children in the environment, not in config.yaml."""
    from streamgrpo.commands.up import _write_child_config
    from streamgrpo.config import load_config

    cfg = load_config("demo", [f"run_dir={tmp_path}", "queue.url=redis://:s3cret-pw@127.0.0.1:6390/0"])
    env: dict[str, str] = {}
    path = _write_child_config(cfg, tmp_path, env)
    assert "s3cret-pw" not in path.read_text() and env["STREAMGRPO_REDIS_URL"] == "redis://:s3cret-pw@127.0.0.1:6390/0"
    child = load_config(str(path))
    assert child.queue.url is None and child.weights.pub_port > 0 and child.weights.snapshot_port > 0
    assert cfg.queue.url  # the caller's config keeps it


def test_one_run_directory_has_one_owner_until_it_dies(tmp_path):
    """A second lock on a run directory is refused in one line naming the holder's pid; the lock goes
    with its process, kill -9 included."""
    import os
    import signal
    import subprocess
    import sys

    from streamgrpo.runtime.run_dir import RunDirBusy, RunLock

    first = RunLock(tmp_path, "up", "`streamgrpo up`")
    with pytest.raises(RunDirBusy) as err:
        RunLock(tmp_path, "up", "`streamgrpo up`")
    assert str(err.value) == (f"{tmp_path} is in use by another `streamgrpo up` (pid {os.getpid()}): stop it "
                              "first, or use another run directory")
    RunLock(tmp_path, "learner", "learner").close()  # another owner name is another lock
    first.close()
    code = ("import sys, time; from streamgrpo.runtime.run_dir import RunLock; RunLock(sys.argv[1], 'up', 'up'); "
            "print('locked', flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirBusy, match=f"pid {holder.pid}"):
            RunLock(tmp_path, "up", "up")
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(10)
        RunLock(tmp_path, "up", "up").close()  # the kernel dropped the dead holder's lock
    finally:
        if holder.poll() is None:
            holder.kill()


def test_a_clean_close_removes_the_lock_file_and_a_waiter_on_the_removed_file_locks_again(tmp_path):
    """No ``learner.lock``/``up.lock`` stays after a clean exit; a process that opened the file just
    before the owner removed it takes the lock of the file at the path, not of the removed one."""
    import fcntl
    import os

    from streamgrpo.runtime.run_dir import RunDirBusy, RunLock, _names

    lock = RunLock(tmp_path, "learner", "learner")
    path = tmp_path / "learner.lock"
    assert path.read_text() == str(os.getpid())
    early = os.open(path, os.O_RDWR)  # opened before the owner's close: the race a waiter can lose
    lock.close()
    assert not path.exists()
    lock.close()  # twice is harmless
    fcntl.flock(early, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the removed file's lock is free ...
    assert not _names(early, path)  # ... and RunLock sees that it no longer names the path
    second = RunLock(tmp_path, "learner", "learner")  # a new file, not the removed inode
    assert _names(second._fd, path)
    with pytest.raises(RunDirBusy):
        RunLock(tmp_path, "learner", "learner")
    os.close(early)
    second.close()
    assert list(tmp_path.iterdir()) == []


def test_a_child_that_dies_with_its_parent_gets_sigterm_when_the_parent_is_killed(tmp_path):
    """PR_SET_PDEATHSIG: `up` killed with -9 still stops its children (they get SIGTERM and exit)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    child_py, parent_py, mark = tmp_path / "child.py", tmp_path / "parent.py", tmp_path / "child-got"
    child_py.write_text(
        "import signal, sys, time\n"
        "def term(*_):\n"
        "    open(sys.argv[1], 'w').write('term')\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, term)\n"
        "open(sys.argv[1] + '.ready', 'w').close()\n"
        "time.sleep(600)\n")
    parent_py.write_text(
        "import subprocess, sys, time\n"
        "from streamgrpo.runtime.processes import die_with_parent\n"
        "c = subprocess.Popen([sys.executable, sys.argv[1], sys.argv[2]], preexec_fn=die_with_parent)\n"
        "print(c.pid, flush=True)\n"
        "time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, str(parent_py), str(child_py), str(mark)], stdout=subprocess.PIPE,
                              text=True)
    child = int(parent.stdout.readline())
    ready = Path(str(mark) + ".ready")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not ready.exists():  # the child has installed its handler (a loaded box:
        time.sleep(0.05)                                        # 1 s was not always enough)
    assert ready.exists()
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(10)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not (mark.exists() and mark.read_text()):  # made, then written
        time.sleep(0.1)
    try:
        assert mark.read_text() == "term"  # SIGTERM, not a kill: the child could finish its step
    finally:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
