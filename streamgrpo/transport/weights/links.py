"""Why a generator has no weights: ZeroMQ socket-monitor events of its two connections, summed up.

:class:`Links` watches the subscriber's SUB and snapshot DEALER sockets with ``get_monitor_socket``
and turns their events into a :class:`~.base.WeightsStatus`. What libzmq 4.3.5 (pyzmq 27)
reports to a connecting socket, observed on loopback against a real :class:`~.publisher.WeightPublisher`:

* client key not authorised (CURVE, ZAP refuses it): ``CONNECT_DELAYED, CONNECTED,
  HANDSHAKE_FAILED_AUTH (value: ZAP status 400), DISCONNECTED``, then nothing: libzmq never tries
  that endpoint again, not even once the learner lists the key and restarts;
* wrong server public key: ``CONNECTED, HANDSHAKE_FAILED_NO_DETAIL (value: EPIPE), DISCONNECTED,
  CONNECT_RETRIED`` over and over (the learner cannot decrypt our HELLO and hangs up). A peer that
  is not a ZeroMQ learner (a proxy that accepts and closes) looks the same;
* CURVE on one side only: ``HANDSHAKE_FAILED_PROTOCOL`` (value: ``ZMTP_MECHANISM_MISMATCH``),
  then, like an auth failure, no retry; sometimes the learner hangs up before the client has read
  its greeting, which reads ``HANDSHAKE_FAILED_NO_DETAIL`` (EPIPE) and is retried, until a
  ``PROTOCOL`` one comes;
* nothing listening (or no ipc socket file): ``CONNECT_DELAYED, CLOSED, CONNECT_RETRIED`` over and
  over, never ``CONNECTED``; a host name that does not resolve: ``CONNECT_RETRIED`` only; a host
  that drops packets: ``CONNECT_DELAYED`` and then silence until the OS gives up;
* right keys: ``CONNECTED, HANDSHAKE_SUCCEEDED``; the learner going away: ``DISCONNECTED``, then
  the nothing-listening pattern.

Since libzmq gives up on an endpoint after an auth or protocol failure, :meth:`Links.redial_due`
tells the receiver thread to disconnect and connect again every ``redial_s`` (a fixed learner is
then found without restarting the generator). The state of a connection is its last outcome: a
handshake failure stays until a handshake succeeds or a connection attempt is refused outright.
"""

from __future__ import annotations

import errno
import secrets
import threading
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from streamgrpo.transport.weights.base import WeightsState, WeightsStatus

EVENTS = (zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_DELAYED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CLOSED
          | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
          | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
_PROTOCOL_ERRORS = {getattr(zmq, n): n[len("PROTOCOL_ERROR_"):] for n in dir(zmq) if n.startswith("PROTOCOL_ERROR_")}
_ORDER = list(WeightsState)  # worst first

# outcomes of a connection's last attempt
UP, AUTH, HANDSHAKE, DOWN = "up", "auth", "handshake", "down"


class Link:
    """One connecting socket and what its monitor said last."""

    def __init__(self, name: str, sock: zmq.Socket, endpoint: str, now: float):
        self.name, self.sock, self.endpoint = name, sock, endpoint
        self.monitor = sock.get_monitor_socket(EVENTS, addr=f"inproc://weights-monitor-{secrets.randbits(62)}")
        self.outcome: str | None = None  # None: no attempt has ended yet
        self.value = 0  # the event's value (ZAP status, protocol error code, errno)
        self.since = now  # when the outcome last changed
        self.failed = 0  # refused / failed attempts since the last success
        self.closed = 0  # of which TCP/ipc connects that failed outright (a host name that does not resolve has none)
        self.was_up = False  # up once, and down since
        self.redial_at: float | None = None

    def on_event(self, event: int, value: int, now: float, redial_s: float) -> None:
        def become(outcome: str) -> None:
            if outcome != self.outcome:
                self.outcome, self.since = outcome, now
            self.value = value

        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            become(UP)
            self.failed, self.was_up, self.redial_at = 0, False, None
        elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            become(AUTH)
            self.failed += 1
            self.redial_at = now + redial_s  # libzmq does not retry after this
        elif event in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
            detail = self.value if self.outcome == HANDSHAKE and self.value in _PROTOCOL_ERRORS else None
            become(HANDSHAKE)
            if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and detail is not None:
                self.value = detail  # the peer hanging up first (a race) says less than the protocol error did
            self.failed += 1
            if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                self.redial_at = now + redial_s  # nor after this (NO_DETAIL is retried by libzmq itself)
        elif event == zmq.EVENT_DISCONNECTED:
            if self.outcome == UP:
                self.was_up = True
                become(DOWN)
        elif event == zmq.EVENT_CLOSED:  # a connection attempt failed (refused, no ipc socket file)
            self.failed += 1
            self.closed += 1
            become(DOWN)
        elif event == zmq.EVENT_CONNECT_RETRIED:
            self.redial_at = None  # libzmq is retrying by itself
            if self.outcome is None or (self.outcome == DOWN and not self.closed and not self.was_up):
                self.failed += 1  # a host name that does not resolve: retries, and no CLOSED ever comes
                become(DOWN)
        elif event in (zmq.EVENT_CONNECT_DELAYED, zmq.EVENT_CONNECTED):
            self.redial_at = None

    def drain(self, now: float, redial_s: float) -> None:
        while True:
            try:
                msg = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            self.on_event(msg["event"], msg["value"], now, redial_s)

    def redial(self) -> None:
        """Connect again (libzmq dropped the endpoint after an auth or protocol failure)."""
        self.redial_at = None
        try:
            self.sock.disconnect(self.endpoint)
        except zmq.ZMQError:
            pass
        self.sock.connect(self.endpoint)


class Links:
    """The subscriber's connections: monitor events in (receiver thread), a status out (any thread).

    ``curve``: this side uses CURVE keys; ``client``: which key (for the messages), e.g. ``client-3``.
    ``connect_grace_s``: how long a connection with no answer at all counts as connecting, not unreachable.
    """

    def __init__(self, socks: list[tuple[str, zmq.Socket, str]], *, curve: bool, client: str | None = None,
                 redial_s: float = 5.0, connect_grace_s: float = 5.0):
        now = time.monotonic()
        self.links = [Link(name, sock, ep, now) for name, sock, ep in socks]
        self.curve, self.client = curve, client
        self.redial_s, self.connect_grace_s = redial_s, connect_grace_s
        self.started = now
        self._lock = threading.Lock()

    @property
    def monitors(self) -> list[zmq.Socket]:
        return [link.monitor for link in self.links]

    def drain(self) -> None:
        """Read every pending monitor event (receiver thread)."""
        now = time.monotonic()
        with self._lock:
            for link in self.links:
                link.drain(now, self.redial_s)

    def redial_due(self) -> None:
        """Connect again where libzmq gave up and ``redial_s`` has passed (receiver thread)."""
        now = time.monotonic()
        for link in self.links:
            if link.redial_at is not None and now >= link.redial_at:
                link.redial()

    # -- the summary ------------------------------------------------------------------------------
    def status(self, version: int | None, learner_empty: bool = False) -> WeightsStatus:
        """The worst connection's state and a one-line reason; ``version``: newest version received;
        ``learner_empty``: the snapshot endpoint answered that nothing is published yet."""
        now = time.monotonic()
        with self._lock:
            per = [(self._state(link, now), link) for link in self.links]
            state = min((s for s, _ in per), key=_ORDER.index)
            worst = [link for s, link in per if s is state]
            if state is WeightsState.OK and version is None:
                state = WeightsState.WAITING
            reason = self._reason(state, worst, now, version, learner_empty)
        return WeightsStatus(state, reason, version)

    def _state(self, link: Link, now: float) -> WeightsState:
        if link.outcome == AUTH:
            return WeightsState.AUTH_REFUSED
        if link.outcome == HANDSHAKE:
            return WeightsState.HANDSHAKE_FAILED
        if link.outcome == DOWN:
            return WeightsState.UNREACHABLE
        if link.outcome is None:  # no attempt has ended: still connecting, or packets dropped
            return WeightsState.CONNECTING if now - self.started < self.connect_grace_s else WeightsState.UNREACHABLE
        return WeightsState.OK

    def _reason(self, state: WeightsState, links: list[Link], now: float, version: int | None,
                learner_empty: bool) -> str:
        where = " and ".join(f"{link.endpoint} ({link.name})" for link in links)
        link = next((lk for lk in links if lk.value in _PROTOCOL_ERRORS), links[0])  # the most telling one
        age = now - min(lk.since for lk in links)
        if state is WeightsState.AUTH_REFUSED:
            who = f"CURVE key {self.client!r}" if self.client else "CURVE key"
            return (f"the learner refused this generator's {who} at {where} (ZAP status {link.value}): its public "
                    f"key is not among the learner's authorised clients (weights.curve_keys_dir/clients/*.key)")
        if state is WeightsState.HANDSHAKE_FAILED:
            code = _PROTOCOL_ERRORS.get(link.value)
            if code == "ZMTP_MECHANISM_MISMATCH":
                sides = ("this generator uses CURVE keys and the learner does not" if self.curve
                         else "the learner requires CURVE keys and this generator has none")
                return f"security mismatch with {where}: {sides} (set weights.curve_keys_dir on both sides)"
            if code is not None:
                return f"handshake with {where} failed: ZeroMQ protocol error {code}"
            err = errno.errorcode.get(link.value, str(link.value))
            if self.curve:
                return (f"the CURVE handshake with {where} failed (peer hung up, {err}): wrong learner public key "
                        f"(weights.curve_keys_dir/server.key), or no streamgrpo learner at that address")
            return f"the handshake with {where} failed (peer hung up, {err}): no streamgrpo learner at that address?"
        if state is WeightsState.UNREACHABLE:
            fails = sum(lk.failed for lk in links)
            if any(lk.was_up for lk in links):
                return f"lost the connection to {where} {age:.0f} s ago; reconnecting ({fails} failed attempts)"
            if all(lk.outcome is None for lk in links):
                return (f"no answer from {where} for {age:.0f} s (host unreachable, or packets dropped on the way?); "
                        f"check weights.connect_host")
            why = ("connection refused or host unreachable" if any(lk.closed for lk in links)
                   else "the host name does not resolve?")
            hint = "are weights.connect_host/pub_port/snapshot_port right?"
            if link.endpoint.startswith("ipc://"):
                why, hint = "no socket file there", "does it share this host and run_dir (weights.transport=ipc)?"
            return (f"cannot connect to {where}: {why} ({fails} failed attempts in {now - self.started:.0f} s); "
                    f"is the learner running, and {hint}")
        if state is WeightsState.CONNECTING:
            return f"connecting to {where} ({age:.0f} s, no answer yet)"
        if state is WeightsState.WAITING:
            if learner_empty:
                return f"connected to the learner at {where}; it has not published a version yet"
            return f"connected to the learner at {where}; no version received yet"
        return f"v{version} received; connected to {where}"
