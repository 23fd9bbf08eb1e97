"""The processes of ``benchmarks/bench_cluster.py``: synthetic generators and learner consumers (the parent's
side: ``benchmarks/cluster_watch.py``).

Every role runs in a process forked from the benchmark (``multiprocessing`` fork context), so it
inherits the parent's imported modules and the group template for free. A role talks to the parent
only through :class:`Channels`: live events and its final report go up ``reports`` as tuples::

    ("ready", role, index)                      set up (queue connected; subscriber started)
    ("ports", pub_port, snapshot_port)          learner 0: where its WeightPublisher listens
    ("pub", version, t_called, publish_s)       learner 0: publish() called at t_called (monotonic)
    ("ver", generator, version, t)              a subscriber's poll() returned that version at t
    ("gen", index, [t_done of each put], put_seconds)   a generator's final report
    ("learner", rank, [(t_got, t_put, nbytes)], steps)   a consumer's final report
    ("error", role, index, text)                a role failed

``time.monotonic`` is one clock for every process of a Linux host, so times compare across them.
torch is touched only by the weight roles (publisher, subscribers); the queue roles need numpy,
msgpack and redis only.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from typing import Any

from streamgrpo.transport.queue.redis_stream import QueueError, QueueFull, RedisQueue

NAMESPACE = "cluster"
MAX_MESSAGE_BYTES = 64 << 20


@dataclass
class Channels:
    """What the parent shares with every role (made from one fork context)."""

    reports: Any  # multiprocessing Queue of tuples (see the module docstring)
    go: Any  # Event: start working
    stop: Any  # Event: stop and report
    window_end: Any  # Value('d'): after this monotonic time generators stop putting, learner 0 stops publishing


@dataclass
class CellConfig:
    url: str
    max_pending: int
    per_rank: int  # groups per learner step on each rank
    commit_every: int  # steps between commits (a checkpoint)
    gen_rate: float  # groups/s per generator (0: as fast as the queue takes them)
    weights_mib: float  # 0: no weight fan-out
    weights_every_s: float
    subscribers: int  # generators 0..subscribers-1 run a WeightSubscriber
    fresh_depth: bool = False  # read the depth before every put (holds max_pending across producers)
    media_records: str = ""  # groups by reference: the records file whose folder the clips are in (decoded per group)
    pub_port: int = 0
    snapshot_port: int = 0


# ------------------------------------------------------------------------------------ weights
def weight_tensors(mib: float):
    """bfloat16 tensors totalling about ``mib`` MiB (views of one flat buffer, 4 MiB each)."""
    import torch

    n = max(1, int(mib * (1 << 20)) // 2)
    flat = torch.arange(n, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    step = 2 << 20  # elements: 4 MiB tensors
    return {f"layer{i // step}.weight": flat[i:i + step] for i in range(0, n, step)}


def _watch_versions(sub, idx: int, reports, done: threading.Event) -> None:
    """Report each version the subscriber's poll() returns, with the time it returned."""
    while not done.is_set():
        got = sub.poll(timeout_s=0.2)
        if got is not None:
            reports.put(("ver", idx, got[0], time.monotonic()))
            sub.mark_applied()


# ------------------------------------------------------------------------------------ roles
def generator_main(idx: int, cfg: CellConfig, template, ch: Channels) -> None:
    """Put copies of ``template`` (fresh group id, send time in ``meta["t_put"]``) until told to stop."""
    q = sub = watcher = None
    done = threading.Event()
    try:
        q = RedisQueue(cfg.url, namespace=NAMESPACE, consumer=f"gen-{idx}", max_pending=cfg.max_pending,
                       max_message_bytes=MAX_MESSAGE_BYTES)
        if idx < cfg.subscribers:
            from streamgrpo.transport.weights.subscriber import WeightSubscriber

            sub = WeightSubscriber("127.0.0.1", cfg.pub_port, cfg.snapshot_port)
            watcher = threading.Thread(target=_watch_versions, args=(sub, idx, ch.reports, done), daemon=True)
            watcher.start()
        ch.reports.put(("ready", "gen", idx))
        ch.go.wait()
        puts, put_s = _produce(idx, cfg, template, q, ch)
        ch.reports.put(("gen", idx, puts, put_s))
        ch.stop.wait()  # the subscriber keeps receiving until the last fan-out is done
    except Exception:
        ch.reports.put(("error", "gen", idx, traceback.format_exc()))
    finally:
        done.set()
        if watcher is not None:
            watcher.join(2.0)
        if sub is not None:
            sub.close()
        if q is not None:
            q.close()


def _produce(idx: int, cfg: CellConfig, template, q: RedisQueue, ch: Channels) -> tuple[list[float], float]:
    """Put until the window ends (or a stop); returns (the time each put returned, seconds spent in put)."""
    puts: list[float] = []
    put_s, gid, stop = 0.0, f"gen-{idx}", ch.stop
    interval = 1.0 / cfg.gen_rate if cfg.gen_rate > 0 else 0.0
    next_t = time.monotonic() + interval * random.Random(idx).random()  # generators out of phase
    while not stop.is_set() and time.monotonic() < ch.window_end.value:
        if interval:
            pause = next_t - time.monotonic()
            if pause > 0:
                stop.wait(pause)
            next_t += interval
        t = time.monotonic()
        g = dataclasses.replace(template, group_id=uuid.uuid4().hex, generator_id=gid, meta={"t_put": t})
        try:
            if cfg.fresh_depth:
                q.depth()  # put() then waits on this depth, not on its own count since its last read
            q.put(g, timeout_s=0.5)
        except QueueFull:
            continue  # backpressure: try again (or stop)
        puts.append(time.monotonic())
        put_s += puts[-1] - t
    return puts, put_s


def consumer_main(rank: int, cfg: CellConfig, ch: Channels) -> None:
    """A learner rank without a model: get its share of a step, commit, (rank 0) publish weights."""
    q = pub = None
    try:
        q = RedisQueue(cfg.url, namespace=NAMESPACE, consumer=f"learner-{rank}", max_pending=cfg.max_pending,
                       max_message_bytes=MAX_MESSAGE_BYTES)
        tensors = None
        if rank == 0 and cfg.weights_mib > 0:
            import torch

            from streamgrpo.transport.weights.publisher import WeightPublisher

            pub = WeightPublisher("127.0.0.1", 0, 0)
            tensors = weight_tensors(cfg.weights_mib)
            t = time.monotonic()
            pub.publish(0, tensors, dtype=torch.bfloat16)  # version 0: late joiners take it from the snapshot port
            ch.reports.put(("pub", 0, t, time.monotonic() - t))
            ch.reports.put(("ports", pub.pub_port, pub.snapshot_port))
        ch.reports.put(("ready", "learner", rank))
        ch.go.wait()
        got, steps = _consume(q, cfg, ch, pub, tensors)
        ch.reports.put(("learner", rank, got, steps))
    except Exception:
        ch.reports.put(("error", "learner", rank, traceback.format_exc()))
    finally:
        if pub is not None:
            pub.close(timeout_s=2.0)
        if q is not None:
            q.close()


def _resolver(cfg: CellConfig):
    """Groups by reference: the learner's resolver, cache off (every group's frames decoded and checked)."""
    if not cfg.media_records:
        return None
    from streamgrpo.config import DataConfig
    from streamgrpo.learner.intake.media import MediaResolver

    return MediaResolver(DataConfig(train_path=cfg.media_records), cache_mib=0)


def _consume(q: RedisQueue, cfg: CellConfig, ch: Channels, pub, tensors) -> tuple[list, int]:
    got: list[tuple[float, float, int]] = []
    media = _resolver(cfg)
    uncommitted: list[tuple[str, str]] = []
    steps, version, last_pub = 0, 0, time.monotonic()
    while not ch.stop.is_set():
        n = 0
        while n < cfg.per_rank and not ch.stop.is_set():  # this rank's share of a step
            try:
                deliveries = q.get(cfg.per_rank - n, timeout_s=0.5)
            except QueueError:
                if ch.stop.is_set():
                    break
                raise
            if media is not None:
                for d in deliveries:  # a real learner decodes in a thread behind its step; here it is all it does
                    media.resolve(d.group)
            t = time.monotonic()
            got += [(t, float(d.group.meta.get("t_put", t)), d.nbytes) for d in deliveries]
            uncommitted += [(d.stream_id, d.group.group_id) for d in deliveries]
            n += len(deliveries)
            del deliveries
        now = time.monotonic()
        steps += 1
        if steps % cfg.commit_every == 0 and uncommitted:  # the checkpoint is on disk: commit its groups
            q.commit(uncommitted)
            uncommitted.clear()
        if pub is not None and now < ch.window_end.value and now - last_pub >= cfg.weights_every_s:
            import torch

            version += 1
            last_pub = time.monotonic()
            pub.publish(version, tensors, dtype=torch.bfloat16)
            ch.reports.put(("pub", version, last_pub, time.monotonic() - last_pub))
    if uncommitted:
        q.commit(uncommitted)
    return got, steps
