"""Groups into the queue: one round trip per batch under backpressure, a group the wire contract
refuses skipped alone, each sent group counted and audited."""

from __future__ import annotations

import logging
import time

import numpy as np

from streamgrpo import metrics as M
from streamgrpo.runtime.processes import StopFlag
from streamgrpo.transport.queue.redis_stream import QueueFull
from streamgrpo.wire import WireError

log = logging.getLogger("streamgrpo.generator")


def send_groups(queue, groups: list, stop: StopFlag, name: str, audit, tick=None,
                grace_s: float = 10.0) -> tuple[int, bool]:
    """Put a batch's groups in one round trip (see :func:`put_groups`; ``grace_s``: its wait for room after
    a stop request, ``rollout.stop_grace_s``), count and audit them; returns ``(groups sent, gave up)``. If
    the wire contract refuses a group, the batch goes group by group so that only that one is skipped;
    one a stop gave up on ends the batch."""
    t_put = time.perf_counter()
    sent = put_groups(queue, groups, stop, name, grace_s, tick=tick) if groups else True
    if sent is False:
        return 0, True
    if sent is True:
        return _produced(groups, audit, (time.perf_counter() - t_put) / max(1, len(groups))), False
    done = 0
    for group in groups:
        t_put = time.perf_counter()
        sent = put_groups(queue, [group], stop, name, grace_s, tick=tick)
        if sent is False:
            return done, True
        if sent is None:
            M.GROUPS_DROPPED.labels(reason="invalid").inc()
            continue  # refused by the wire contract (logged)
        done += _produced([group], audit, time.perf_counter() - t_put)
    return done, False


def _produced(groups: list, audit, put_s: float) -> int:
    for group in groups:
        M.GROUPS.labels(event="produced").inc()
        M.TOKENS.labels(role="generator").inc(sum(len(c.token_ids) for c in group.completions))
        audit.write({"event": "produced", "group_id": group.group_id, "version": group.policy_version,
                     "reward": float(np.mean([c.reward for c in group.completions])), "t": time.time(),
                     "put_s": round(put_s, 4),
                     **({"source": [group.source.num_shards, group.source.shard, group.source.epoch,
                                    group.source.position]} if group.source is not None else {})})
    return len(groups)


def put_groups(queue, groups: list, stop: StopFlag, name: str, grace_s: float = 10.0, tick=None) -> bool | None:
    """Put ``groups`` (one round trip: ``put_many``) under backpressure, waking every second to
    notice SIGTERM (and to call ``tick``, e.g. a :meth:`WeightsWatch.check`); after a stop request
    they get ``grace_s`` more seconds to find room, then they are given up (logged, False). If the
    wire contract refuses a group, nothing is sent and None is returned (a single group's refusal
    is logged here; the caller counts it)."""

    stopped_at = None
    while True:
        try:
            queue.put_many(groups, timeout_s=1.0)
            return True
        except WireError as exc:  # e.g. a non-finite log-prob: the caller retries group by group
            if len(groups) == 1:
                log.error("%s: group %s (%s) not sent: %s", name, groups[0].group_id, groups[0].prompt_id, exc)
            return None
        except QueueFull:
            if tick is not None:
                tick()
            if stop:
                stopped_at = stopped_at or time.monotonic()
                if time.monotonic() - stopped_at >= grace_s:
                    log.warning("%s: queue still full at shutdown: %d group(s) not delivered (%s)", name,
                                len(groups), ", ".join(g.group_id for g in groups))
                    return False
