"""The relay process (``streamgrpo relay --config F``): one per generator host.

It subscribes to the learner like a generator (TCP, with ``weights.curve_keys_dir`` and
``weights.delta``), and re-publishes each complete, digest-checked version unchanged, with its version
number, through shared memory (:class:`~streamgrpo.transport.weights.shm_publisher.ShmPublisher` on
the host's loopback, ``weights.relay_pub_port``/``relay_snapshot_port``) to the generators of its host
(``weights.relay: true``). The learner thus sends each version once per host. What a relay's
generators see is the shared-memory channel: late joiners get the relay's snapshot, digests are
checked again on the host, and a newer version supersedes one not yet sent.

A relay that dies is replaced: its lock file is free again, and the first generator that notices
(every 5 s) starts another (:mod:`.keeper`); the new relay starts a new lineage (publisher id), so its
generators take its first version whatever their own. Meanwhile they keep generating with the version
they hold (the learner's staleness bound drops what becomes too old). When the learner restarts (a new
publisher id upstream), the relay starts a new lineage too, so versions that restart lower still go out.
"""

from __future__ import annotations

import logging
from pathlib import Path

from streamgrpo import metrics as M
from streamgrpo.config import Config
from streamgrpo.runtime import StopFlag, start_metrics

log = logging.getLogger("streamgrpo.relay")


def run_relay(cfg: Config, *, stop: StopFlag | None = None, client_key: str | None = None,
              max_versions: int | None = None) -> int:
    """Relay versions until a stop signal (or ``max_versions`` versions, for tests). Exits 0 at once when
    another relay holds this host's lock."""
    import os

    from streamgrpo.relay.keeper import lock_path, take_lock
    from streamgrpo.transport.weights.factory import relay_publisher_from_config, upstream_from_config

    wc = cfg.weights
    lock = take_lock(wc)
    if lock is None:
        log.info("relay: another relay serves this host (%s is held); exiting", lock_path(wc))
        return 0
    stop = stop if stop is not None else StopFlag()
    run_dir = Path(cfg.run_dir)
    key = client_key or ("client-relay" if wc.curve_keys_dir else None)
    upstream = local = server = None
    relayed = 0
    try:
        server = start_metrics(cfg.metrics, run_dir, "relay")
        local = relay_publisher_from_config(wc)
        upstream = upstream_from_config(wc, key)
        log.info("relay: %s:%d -> generators on 127.0.0.1:%d (shared memory in %s)%s", wc.connect_host, wc.pub_port,
                 wc.relay_pub_port, wc.shm_dir, ", deltas from the learner" if wc.delta else "")
        lineage = None
        while not stop and (max_versions is None or relayed < max_versions):
            got = upstream.poll(timeout_s=1.0)
            if got is None:
                continue
            version, tensors = got
            src = upstream.source
            if lineage is not None and src != lineage:
                local.new_lineage()  # the learner restarted: its versions may restart lower
                log.info("relay: the learner restarted (new publisher id); a new lineage from v%d", version)
            lineage = src
            local.publish(version, tensors)  # copied into a shared-memory file before it returns
            upstream.mark_applied()
            M.RELAY_VERSIONS.inc()
            relayed += 1
            log.debug("relay: v%d out to %d subscriber(s)", version, local.subscribers)
    finally:
        for part in (upstream, local, server):
            if part is not None:
                part.close()
        os.close(lock)
    return 0
