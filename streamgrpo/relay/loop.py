"""The relay process (``streamgrpo relay --config F``): one per generator host.

It subscribes to the learner like a generator (TCP, with ``weights.curve_keys_dir`` and
``weights.delta``) and hands each version to the generators of its host (``weights.relay: true``)
through shared memory: a :class:`~.forward.RelayReceiver` receives every chunk straight into a file of
a :class:`~streamgrpo.transport.weights.shm_publisher.ShmPublisher` on the host's loopback
(``weights.relay_pub_port``/``relay_snapshot_port``, files in ``weights.shm_dir``) and announces it at
once, so the host's generators copy and check it while the rest is still on the wire. The learner thus
sends each version once per host. The learner's meta record and digests travel unchanged: generators
check them end to end, late joiners get the relay's snapshot of the latest version, and a newer
version supersedes an older one exactly as on the learner's own channel.

A relay that dies is replaced: its lock file is free again, and the first generator that notices
(every 5 s) starts another (:mod:`.keeper`), which fetches the latest version from the learner's
snapshot endpoint. Meanwhile the generators keep generating with the version they hold (the learner's
staleness bound drops what becomes too old).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from streamgrpo.config import Config
from streamgrpo.runtime import StopFlag, start_metrics

log = logging.getLogger("streamgrpo.relay")


def run_relay(cfg: Config, *, stop: StopFlag | None = None, client_key: str | None = None) -> int:
    """Relay versions until a stop signal. Exits 0 at once when another relay holds this host's lock."""
    from streamgrpo.relay.forward import RelayReceiver
    from streamgrpo.relay.keeper import lock_path, take_lock
    from streamgrpo.transport.weights.factory import relay_publisher_from_config

    wc = cfg.weights
    lock = take_lock(wc)
    if lock is None:
        log.info("relay: another relay serves this host (%s is held); exiting", lock_path(wc))
        return 0
    stop = stop if stop is not None else StopFlag()
    key = client_key if wc.curve_keys_dir else None  # e.g. client-3: the key of the generator that started it
    upstream = local = server = None
    try:
        server = start_metrics(cfg.metrics, Path(cfg.run_dir), "relay")
        local = relay_publisher_from_config(wc)
        upstream = RelayReceiver(local, wc.connect_host, wc.pub_port, wc.snapshot_port, wc.curve_keys_dir, key,
                                 delta=wc.delta)
        log.info("relay: %s:%d -> generators on 127.0.0.1:%d (shared memory in %s)%s", wc.connect_host, wc.pub_port,
                 wc.relay_pub_port, wc.shm_dir, ", deltas from the learner" if wc.delta else "")
        while not stop:
            time.sleep(0.5)
    finally:
        for part in (upstream, local, server):
            if part is not None:
                part.close()
        os.close(lock)
    return 0
