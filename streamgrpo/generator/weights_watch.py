"""A generator without weights is loud: warnings with the reason, then a clean exit (code 3)."""

from __future__ import annotations

import logging
import time

from streamgrpo import metrics as M

log = logging.getLogger("streamgrpo.generator")


WEIGHTS_UNAVAILABLE_EXIT = 3  # no version from the learner within weights.max_wait_s


class WeightsUnavailable(RuntimeError):
    """No version arrived from the learner within ``weights.max_wait_s`` (the message says why)."""


class WeightsWatch:
    """Makes a generator without weights loud; call :meth:`check` at every safe point (between batches).

    While ``client`` has never returned a version: a WARNING with :meth:`~.WeightSyncClient.status`'s
    reason every ``warn_every_s`` (the first at the first check), each counted in
    ``streamgrpo_errors_total{kind="weights_missing"}``, with ``streamgrpo_weights_missing`` at 1; and
    :class:`WeightsUnavailable` once ``max_wait_s`` (counted from construction; 0 or None: never) has
    passed. Once a version has arrived it never gives up, but still warns every ``warn_every_s`` while
    the learner refuses the connection (key no longer authorised, keys changed), counted as
    ``kind="weights_refused"``.
    """

    def __init__(self, client, *, warn_every_s: float = 30.0, max_wait_s: float | None = 600.0,
                 name: str = "generator", clock=time.monotonic):
        self.client, self.warn_every_s, self.max_wait_s, self.name = client, warn_every_s, max_wait_s or None, name
        self._clock = clock
        self.started = clock()
        self.received = False
        self.warnings = 0
        self._last_warn: float | None = None
        M.WEIGHTS_MISSING.set(1)

    @classmethod
    def from_config(cls, client, wcfg, name: str = "generator") -> WeightsWatch:
        """From a :class:`streamgrpo.config.WeightsConfig`."""
        return cls(client, warn_every_s=wcfg.warn_every_s, max_wait_s=wcfg.max_wait_s, name=name)

    def _due(self, now: float) -> bool:
        return self._last_warn is None or now - self._last_warn >= self.warn_every_s

    def check(self):
        """Warn if due; raise :class:`WeightsUnavailable` past the bound. Returns the status it looked at, if any."""
        now = self._clock()
        if self.client.version is not None:
            if not self.received:
                self.received, self._last_warn = True, None
                M.WEIGHTS_MISSING.set(0)
                if self.warnings:
                    log.info("%s: weights arrived from the learner after %.0f s (v%d)", self.name, now - self.started,
                             self.client.version)
            if not self._due(now):
                return None
            status = self.client.status()
            if status.refused:
                self._warn(now, "weights_refused", "%s: the learner refuses the weight channel; staying at v%d: %s",
                           self.name, self.client.version, status)
            return status
        waited = now - self.started
        if self.max_wait_s is not None and waited >= self.max_wait_s:
            raise WeightsUnavailable(f"{self.name}: no weights from the learner in {waited:.0f} s, giving up "
                                     f"(weights.max_wait_s={self.max_wait_s:g}): {self.client.status()}")
        if not self._due(now):
            return None
        status = self.client.status()
        self._warn(now, "weights_missing", "%s: no weights from the learner after %.0f s (still generating with the "
                   "initial weights, v0): %s", self.name, waited, status)
        return status

    def _warn(self, now: float, kind: str, msg: str, *args) -> None:
        self._last_warn = now
        self.warnings += 1
        M.ERRORS.labels(kind=kind).inc()
        log.warning(msg, *args)
