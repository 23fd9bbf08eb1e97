"""The generator's safe point: apply the newest verified weight version between batches (or, with
``rollout.inflight_updates``, between decoding steps)."""

from __future__ import annotations

import logging
import time
from collections import deque

from streamgrpo import metrics as M

log = logging.getLogger("streamgrpo.generator")


class WeightApplier:
    """Safe point between batches: apply the newest verified weight version (or, for the staleness
    benchmark, the one ``demo.weight_apply_delay`` receipts behind it)."""

    def __init__(self, weights, load_weights, audit, delay: int, name: str):
        self.weights, self.load_weights, self.audit, self.delay, self.name = weights, load_weights, audit, delay, name
        self.pending: deque = deque()  # received versions not applied yet (delay > 0)
        self.snapped = False

    def snapshot(self, timeout_s: float) -> None:
        snap = self.weights.request_snapshot(timeout_s=timeout_s)
        if snap is not None:
            self.load_weights(snap[0], snap[1])
            self.weights.mark_applied()
            self.snapped = True

    def __call__(self, block_s: float = 0.0, not_below: int | None = None) -> None:
        """``not_below`` (in flight): a version numbered lower than that (a restarted learner rolled
        back) waits for the end of the batch, so a completion's token versions never go back."""
        got = self.weights.poll(timeout_s=block_s)
        while got is not None:
            self.pending.append(got)
            got = self.weights.poll(timeout_s=0.0)
        if len(self.pending) <= self.delay:
            return
        target = self.pending[-1 - self.delay]
        if not_below is not None and target[0] < not_below:
            return
        while self.pending and self.pending[0] is not target:
            self.pending.popleft()
        self.pending.popleft()
        t0 = time.perf_counter()
        self.load_weights(target[0], target[1])
        sync_s = None
        if self.delay == 0:
            sync_s = self.weights.mark_applied()  # publish-to-applied latency + policy_version{role="generator"}
        else:
            M.POLICY_VERSION.labels(role="generator").set(target[0])
        self.audit.write({"event": "applied", "version": target[0], "weight_sync_s": sync_s, "t": time.time()})
        log.info("%s: applied weights v%d (%.2fs)", self.name, target[0], time.perf_counter() - t0)
