"""The crash-loop breaker counts a learner's own deaths and never a kill from outside (issue 62 item 3).

A child process runs the learner's breaker (real redis-server) and dies in a step or in a read-ahead decode:
* crashed (SIGSEGV, as a decoder that segfaults on a file) while it decodes a group ahead: each start counts it, and
  after ``learner.crash_loop_starts`` starts the group is dead-lettered instead of read forever;
* ``kill -9`` from outside, four times, at the moment it marked a step: nothing is counted, nothing would be
  dead-lettered (before: an innocent group was dead-lettered after three);
* killed by the kernel's out-of-memory killer (a memory cgroup the test makes, where the machine allows it) in its
  step: counted.
The learner itself, killed -9 and crashed in a step holding a huge group: tests/integration/learner/intake/test_group_limits.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import uuid
from pathlib import Path

import pytest
import redis

from streamgrpo.learner.intake.crash_loop import CrashLoopBreaker
from streamgrpo.transport.queue.crash_marks import CrashMarks

CHILD = textwrap.dedent('''
    import sys, time
    from pathlib import Path
    from types import SimpleNamespace
    import numpy as np, redis
    from streamgrpo.config import DataConfig
    from streamgrpo.learner.intake.crash_loop import CrashLoopBreaker
    from streamgrpo.learner.intake.media import MediaResolver
    from streamgrpo.transport.queue.crash_marks import CrashMarks
    from streamgrpo.wire import MediaRef, ScoredGroup, Visual

    url, ns, gid, mode, crash_dir = sys.argv[1:6]
    breaker = CrashLoopBreaker(CrashMarks(redis.Redis.from_url(url), ns, "learner-0"), 3, crash_dir=Path(crash_dir))
    breaker.on_start()
    if mode == "decode":
        resolver = MediaResolver(DataConfig(train_path="/tmp/train.jsonl"), cache_mib=1)
        resolver.breaker = breaker

        def decoding(group):  # stands in for a decode that takes the learner down
            print("busy", flush=True)
            time.sleep(600)

        resolver._resolve = decoding
        v = Visual(kind="image", frames=None, ref=MediaRef(path="x.png", height=28, width=28, digest="sha256:0"))
        group = ScoredGroup(prompt_id="p", generator_id="g", policy_version=0, model_id="m",
                            prompt_ids=np.asarray([1], dtype=np.int32), visuals=[v], answer="a", completions=[],
                            group_id=gid)
        resolver.submit([SimpleNamespace(stream_id="1-0", group=group)])  # read-ahead: decoded in a media thread
    else:
        breaker.begin_step([gid])
        print("busy", flush=True)
        if mode == "oom":  # the step's memory grows until the kernel kills it
            held = []
            while True:
                held.append(bytearray(64 << 20))
                for i in range(0, len(held[-1]), 4096):
                    held[-1][i] = 1
    time.sleep(600)
''')


def _die(url: str, ns: str, gid: str, mode: str, crash_dir: Path, sig: int | None, cgroup: Path | None = None) -> int:
    """Run the child until it is busy with ``gid`` (``mode``: decode, step, oom), then send ``sig`` (None: let it
    die); returns its exit status."""
    env = dict(os.environ, PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1")
    argv = [sys.executable, "-c", CHILD, url, ns, gid, mode, str(crash_dir)]
    if cgroup is not None:  # join the cgroup before the interpreter starts: its counter is the witness's
        argv = ["sh", "-c", f'echo $$ > "{cgroup}/cgroup.procs" && exec "$@"', "sh", *argv]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    guard = threading.Timer(120.0, p.kill)  # never busy: fail instead of waiting forever
    guard.start()
    try:
        assert p.stdout.readline().strip() == "busy", "the child never reached the group"
        if sig is not None:
            os.kill(p.pid, sig)
        return p.wait(timeout=120)
    finally:
        guard.cancel()
        if p.poll() is None:
            p.kill()
            p.wait()


def _breaker(url: str, ns: str, crash_dir: Path) -> CrashLoopBreaker:
    return CrashLoopBreaker(CrashMarks(redis.Redis.from_url(url), ns, "learner-0"), 3, crash_dir=crash_dir)


def test_a_learner_that_crashes_while_it_decodes_a_group_ahead_counts_the_start_for_it(redis_server, redis_ns,
                                                                                      tmp_path):
    for start in (1, 2, 3):
        assert _die(redis_server.url, redis_ns, "poison", "decode", tmp_path, signal.SIGSEGV) == -signal.SIGSEGV
        assert "Segmentation fault" in (tmp_path / "learner-0.txt").read_text()  # its crash record
        breaker = _breaker(redis_server.url, redis_ns, tmp_path)
        assert breaker.on_start() == ["poison"]  # the death during read-ahead is counted...
        assert breaker.counts["poison"] == start
    assert "in 3 consecutive starts" in breaker.verdict("poison")  # ...so it is dead-lettered, not read forever
    assert breaker.marks.client.scard(breaker.marks.reading_key()) == 0
    assert _breaker(redis_server.url, redis_ns, tmp_path).on_start() == []


def test_four_kills_from_outside_at_the_moment_a_step_is_marked_count_nothing(redis_server, redis_ns, tmp_path,
                                                                               caplog):
    probe = _breaker(redis_server.url, redis_ns, tmp_path).witnessing
    if not probe.counters:
        pytest.skip("no out-of-memory counter is readable on this machine (cgroup memory.events, /proc/vmstat)")
    for _ in range(4):
        assert _die(redis_server.url, redis_ns, "innocent", "step", tmp_path, signal.SIGKILL) == -signal.SIGKILL
        breaker = _breaker(redis_server.url, redis_ns, tmp_path)
        assert breaker.on_start() == [] and breaker.verdict("innocent") is None, caplog.text
    assert "killed from outside" in caplog.text and "not counted against them" in caplog.text
    assert not breaker.marks.client.exists(breaker.marks.counts_key)


def _memory_cgroup(limit: int) -> Path | None:
    """A memory cgroup of its own with ``limit`` bytes (v1 or v2), or None where the machine does not allow it."""
    name = f"streamgrpo-test-{uuid.uuid4().hex[:8]}"
    for root, knob in ((Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"), (Path("/sys/fs/cgroup"), "memory.max")):
        path = root / name
        try:
            path.mkdir()
        except OSError:
            continue
        try:
            (path / knob).write_text(str(limit))
            return path
        except OSError:
            path.rmdir()
    return None


def test_a_learner_the_out_of_memory_killer_kills_in_its_step_counts_the_start(redis_server, redis_ns, tmp_path):
    cgroup = _memory_cgroup(1 << 30)
    if cgroup is None:
        pytest.skip("cannot make a memory cgroup here (needs root and a writable cgroup memory controller)")
    try:
        assert _die(redis_server.url, redis_ns, "hungry", "oom", tmp_path, None, cgroup) == -signal.SIGKILL
        breaker = _breaker(redis_server.url, redis_ns, tmp_path)
        assert breaker.on_start() == ["hungry"] and breaker.counts == {"hungry": 1}
    finally:
        cgroup.rmdir()
