"""The relay process (``streamgrpo relay --config F``): one per generator host.

It subscribes to the learner like a generator (TCP, with ``weights.curve_keys_dir`` and
``weights.delta``) and hands each version to the generators of its host (``weights.relay: true``)
through shared memory: a :class:`~.forward.RelayReceiver` receives every chunk straight into a file of
a :class:`~streamgrpo.transport.weights.shm_publisher.ShmPublisher` (ipc:// sockets in the relay's 0700
folder under ``weights.shm_dir``, no TCP; the version files beside it) and announces it at
once, so the host's generators copy and check it while the rest is still on the wire. The learner thus
sends each version once per host. The learner's meta record and digests travel unchanged: generators
check them end to end, late joiners get the relay's snapshot of the latest version, and a newer
version supersedes an older one exactly as on the learner's own channel.

A relay that dies is replaced: its lock file is free again, and the first generator that notices
(every 5 s) starts another (:mod:`.keeper`), which fetches the latest version from the learner's
snapshot endpoint. Meanwhile the generators keep generating with the version they hold (the learner's
staleness bound drops what becomes too old). A relay that has had no generator connected for
:data:`IDLE_EXIT_S` exits, so none outlives its run for long.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path

from streamgrpo.config import Config
from streamgrpo.config.roles import RelayConfig
from streamgrpo.metrics import start_metrics
from streamgrpo.relay.forward import RelayReceiver
from streamgrpo.relay.keeper import lock_path, take_lock
from streamgrpo.runtime import collector
from streamgrpo.runtime.processes import StopFlag
from streamgrpo.transport.weights.factory import relay_dir, relay_publisher_from_config

log = logging.getLogger("streamgrpo.relay")

IDLE_EXIT_S = 60.0
"""A relay with no generator connected this long (since its start, or its last one left) exits."""


def run_relay(cfg: Config | RelayConfig, *, stop: StopFlag | None = None, client_key: str | None = None,
              idle_exit_s: float = IDLE_EXIT_S) -> int:
    """Relay versions until a stop signal, or ``idle_exit_s`` without a generator. Exits 0 at once when
    another relay holds this host's lock. The loop sees the relay's sections only (:class:`RelayConfig`)."""
    cfg = RelayConfig.of(cfg)
    wc = cfg.weights
    lock = take_lock(wc)
    if lock is None:
        log.info("relay: another relay serves this host (%s is held); exiting", lock_path(wc))
        return 0
    stop = stop if stop is not None else StopFlag()
    key = client_key if wc.curve_keys_dir else None  # e.g. client-3: the key of the generator that started it
    upstream = local = server = None
    try:
        mcfg = cfg.metrics.model_copy(update={"port": wc.relay_metrics_port})  # not the generators' port
        server = start_metrics(mcfg, Path(cfg.run_dir), f"relay-{socket.gethostname()}",
                               hint="set weights.relay_metrics_port=0 (a free port)")
        local = relay_publisher_from_config(wc)
        upstream = RelayReceiver(local, wc.connect_host, wc.pub_port, wc.snapshot_port, wc.curve_keys_dir, key,
                                 delta=wc.delta)
        log.info("relay: %s:%d -> this host's generators through %s (shared memory in %s)%s", wc.connect_host,
                 wc.pub_port, relay_dir(wc), wc.shm_dir, ", deltas from the learner" if wc.delta else "")
        alone_since = time.monotonic()
        collector.started()  # set up: cyclic garbage collection from here on (paused by python -m streamgrpo)
        while not stop:
            time.sleep(0.5)
            if upstream.fatal:
                log.error("relay: %s", upstream.fatal)
                return 1
            if local.subscribers > 0:
                alone_since = time.monotonic()
            elif time.monotonic() - alone_since > idle_exit_s:
                log.info("relay: no generator for %.0f s; exiting", idle_exit_s)
                break
    finally:
        for part in (upstream, local, server):
            if part is not None:
                part.close()
        os.close(lock)
    return 0
