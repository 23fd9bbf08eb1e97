"""The generator's safe point: apply the newest verified weight version between batches (or, with
``rollout.inflight_updates``, between decoding steps)."""

from __future__ import annotations

import logging
import time
from collections import deque

log = logging.getLogger("streamgrpo.generator")


class WeightApplier:
    """Safe point between batches: apply the newest verified weight version. (A subclass may pick
    another received version: the staleness benchmark's lag, ``recipes/demo/lag.py``.)"""

    def __init__(self, weights, load_weights, audit, name: str):
        self.weights, self.load_weights, self.audit, self.name = weights, load_weights, audit, name
        self.pending: deque = deque()  # received versions not applied yet
        self.snapped = False

    def snapshot(self, timeout_s: float) -> None:
        snap = self.weights.request_snapshot(timeout_s=timeout_s)
        if snap is not None:
            self.load_weights(snap[0], snap[1])
            self.weights.mark_applied()
            self.snapped = True

    def pick(self):
        """The received ``(version, tensors)`` to apply now, or None: the newest."""
        return self.pending[-1] if self.pending else None

    def applied(self, version: int) -> float | None:
        """After applying ``version``: the publish-to-applied latency and ``policy_version{role="generator"}``."""
        return self.weights.mark_applied()

    def __call__(self, block_s: float = 0.0, not_below: int | None = None) -> None:
        """``not_below`` (in flight): a version numbered lower than that (a restarted learner rolled
        back) waits for the end of the batch, so a completion's token versions never go back."""
        got = self.weights.poll(timeout_s=block_s)
        while got is not None:
            self.pending.append(got)
            got = self.weights.poll(timeout_s=0.0)
        target = self.pick()
        if target is None or (not_below is not None and target[0] < not_below):
            return
        while self.pending and self.pending[0] is not target:
            self.pending.popleft()
        self.pending.popleft()
        t0 = time.perf_counter()
        self.load_weights(target[0], target[1])
        sync_s = self.applied(target[0])
        self.audit.write({"event": "applied", "version": target[0], "weight_sync_s": sync_s, "t": time.time()})
        log.info("%s: applied weights v%d (%.2fs)", self.name, target[0], time.perf_counter() - t0)
