"""The crash-loop breaker covers read-ahead: a learner killed with -9 while a media thread decodes a group
(outside any step) counts that start for the group, so a file that kills the learner while it is decoded
is dead-lettered crash_loop after learner.crash_loop_starts starts instead of crash-looping it forever.
Real redis-server, a real process killed with -9 while it decodes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from types import SimpleNamespace

import redis

from streamgrpo.learner.crash_loop import CrashLoopBreaker

CHILD = textwrap.dedent('''
    import sys, time
    from types import SimpleNamespace
    import numpy as np, redis
    from streamgrpo.config import DataConfig
    from streamgrpo.learner.crash_loop import CrashLoopBreaker
    from streamgrpo.learner.media import MediaResolver
    from streamgrpo.wire import MediaRef, ScoredGroup, Visual

    url, ns, gid = sys.argv[1:4]
    breaker = CrashLoopBreaker(SimpleNamespace(client=redis.Redis.from_url(url), namespace=ns,
                                               consumer="learner-0"), 3)
    breaker.on_start()
    resolver = MediaResolver(DataConfig(train_path="/tmp/train.jsonl"), cache_mib=1)
    resolver.breaker = breaker

    def decoding(group):  # stands in for a decode that takes the learner down (an out-of-memory kill)
        print("decoding", flush=True)
        time.sleep(600)

    resolver._resolve = decoding
    v = Visual(kind="image", frames=None, ref=MediaRef(path="x.png", height=28, width=28, digest="sha256:0"))
    group = ScoredGroup(prompt_id="p", generator_id="g", policy_version=0, model_id="m",
                        prompt_ids=np.asarray([1], dtype=np.int32), visuals=[v], answer="a", completions=[],
                        group_id=gid)
    resolver.submit([SimpleNamespace(stream_id="1-0", group=group)])  # read-ahead: decoded in a media thread
    time.sleep(600)
''')


def _kill_while_decoding(url: str, ns: str, gid: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    p = subprocess.Popen([sys.executable, "-c", CHILD, url, ns, gid], stdout=subprocess.PIPE, text=True, env=env)
    guard = threading.Timer(60.0, p.kill)  # never marked as decoding: fail instead of waiting forever
    guard.start()
    try:
        assert p.stdout.readline().strip() == "decoding", "the child never reached the decode"
    finally:
        guard.cancel()
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=60)


def test_a_learner_killed_while_it_decodes_a_group_ahead_counts_the_start_for_it(redis_server, redis_ns):
    client = redis.Redis.from_url(redis_server.url)
    queue = SimpleNamespace(client=client, namespace=redis_ns, consumer="learner-0")
    for start in (1, 2, 3):
        _kill_while_decoding(redis_server.url, redis_ns, "poison")
        breaker = CrashLoopBreaker(queue, 3)
        assert breaker.on_start() == ["poison"]  # the death during read-ahead is counted...
        assert breaker.counts["poison"] == start
    assert "in 3 consecutive starts" in breaker.verdict("poison")  # ...so it is dead-lettered, not read forever
    assert client.scard(breaker.reading_key) == 0 and CrashLoopBreaker(queue, 3).on_start() == []
