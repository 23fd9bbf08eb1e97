"""Probes of the weight channel as tests (issue 50 item 7), over real ZeroMQ sockets: a man in the middle
(XSUB to the learner's PUB, XPUB to the generator) corrupts a delta in transit, or lets a generator join
in the middle of a delta. Either way the generator never applies other weights than the learner's: the
delta is refused by its digest and the version is taken from the snapshot endpoint, and the next deltas
apply bit for bit."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import zmq
from conftest import wait_weights_version as _wait
from weight_updates import counter_value as _value
from weight_updates import same as _same
from weight_updates import small_update as _step

from streamgrpo import metrics as M
from streamgrpo.transport.weights.codec import TOPIC_DELTA, decode_header
from streamgrpo.transport.weights.publisher import WeightPublisher

WAIT_S = 60.0


class Middle:
    """Forwards the learner's PUB stream to subscribers of its own port, each data message through
    ``edit(frames) -> frames | None`` (None drops it); subscriptions go upstream untouched."""

    def __init__(self, pub_port: int, edit):
        self.edit, self.pub_port = edit, pub_port
        self.port = 0
        self._ready, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    def _run(self) -> None:
        ctx = zmq.Context()
        up, down = ctx.socket(zmq.XSUB), ctx.socket(zmq.XPUB)
        up.connect(f"tcp://127.0.0.1:{self.pub_port}")
        self.port = down.bind_to_random_port("tcp://127.0.0.1")
        self._ready.set()
        poller = zmq.Poller()
        poller.register(up, zmq.POLLIN)
        poller.register(down, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(50):
                    frames = sock.recv_multipart()
                    if sock is down:
                        up.send_multipart(frames)  # a subscription
                        continue
                    frames = self.edit(frames)
                    if frames is not None:
                        down.send_multipart(frames)
        finally:
            up.close(0)
            down.close(0)
            ctx.term()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _base(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": (torch.randn(300, 257, generator=g) * 0.02).to(torch.bfloat16), "f32": torch.randn(99, generator=g)}


@pytest.fixture
def delta_pub():
    pub = WeightPublisher("127.0.0.1", 0, 0, chunk_mib=1 / 64, delta_max_ratio=0.5)
    yield pub
    pub.close(timeout_s=1.0)


def _is_delta(frames) -> bool:
    return frames[0] == TOPIC_DELTA and len(frames) == 3


def test_a_delta_corrupted_in_transit_is_refused_by_its_digest_and_the_snapshot_taken(delta_pub,
                                                                                      weight_subscriber_factory):
    flipped: list[int] = []

    def corrupt_first_delta(frames):
        if _is_delta(frames) and not flipped:
            payload = bytearray(frames[2])
            payload[len(payload) // 2] ^= 0x01  # one bit, in the middle of the delta's first chunk
            flipped.append(decode_header(frames[1]).version)
            return [frames[0], frames[1], bytes(payload)]
        return frames

    mid = Middle(delta_pub.pub_port, corrupt_first_delta)
    try:
        sub = weight_subscriber_factory(mid.port, delta_pub.snapshot_port, delta=True, repair_delay_s=0.2)
        v = _base()
        delta_pub.publish(0, v)
        assert _same(_wait(sub, 0, WAIT_S)[1], v)
        sub.mark_applied()
        lost, errors = _value(M.WEIGHT_DELTAS, result="lost"), _value(M.ERRORS, kind="weights")
        snapshots = sub.stats["from_snapshot"]
        v1 = _step(v, 1)
        delta_pub.publish(1, v1)
        got = _wait(sub, 1, WAIT_S)
        assert flipped, "no delta went through the middle"
        assert got[0] == 1 and _same(got[1], v1)  # the learner's bytes, never the flipped ones
        sub.mark_applied()
        assert sub.stats["from_delta"] == 0 and sub.stats["from_snapshot"] == snapshots + 1
        assert sub.stats["discarded"] >= 1 and _value(M.WEIGHT_DELTAS, result="lost") == lost + 1
        assert _value(M.ERRORS, kind="weights") > errors
        v2 = _step(v1, 2)  # and the next delta, intact, applies to the snapshot's copy
        delta_pub.publish(2, v2)
        got = _wait(sub, 2, WAIT_S)
        assert got[0] == 2 and _same(got[1], v2) and sub.stats["from_delta"] == 1
    finally:
        mid.close()


def test_a_generator_that_joins_in_the_middle_of_a_delta_takes_the_snapshot_and_applies_the_next_ones(
        delta_pub, weight_subscriber_factory):
    """The middle passes nothing of the first delta before its second chunk (the generator connected
    while its first chunk was on the wire): the chunks it sees are ignored, the version comes from the
    snapshot, and later deltas apply bit for bit."""
    seen: dict[str, int] = {"skipped": 0, "tail": 0}
    first: list[int] = []

    def join_mid_delta(frames):
        if not _is_delta(frames):
            return frames if first else None  # nothing before the first delta reaches the late joiner
        h = decode_header(frames[1])
        if not first:
            first.append(h.version)
        if h.version == first[0]:
            if h.seq == 0:
                seen["skipped"] += 1
                return None
            seen["tail"] += 1
        return frames

    v = _base()
    delta_pub.publish(0, v)
    time.sleep(0.5)
    mid = Middle(delta_pub.pub_port, join_mid_delta)
    try:
        sub = weight_subscriber_factory(mid.port, delta_pub.snapshot_port, delta=True, repair_delay_s=0.2)
        time.sleep(0.5)  # subscribed through the middle (the slow joiner)
        v1 = _step(v, 1, every=5)  # a fifth of the words: a delta of several chunks
        delta_pub.publish(1, v1)
        got = _wait(sub, 1, WAIT_S)
        assert got[0] == 1 and _same(got[1], v1)
        sub.mark_applied()
        assert seen["skipped"] == 1 and seen["tail"] >= 1, seen  # it saw the delta's tail, not its head
        assert sub.stats["from_delta"] == 0 and sub.stats["from_snapshot"] >= 1
        for k in (2, 3):
            v1 = _step(v1, k)
            delta_pub.publish(k, v1)
            got = _wait(sub, k, WAIT_S)
            assert got[0] == k and _same(got[1], v1)
            sub.mark_applied()
        assert sub.stats["from_delta"] == 2
    finally:
        mid.close()


def test_a_relay_whose_shm_folder_is_full_stops_in_one_line_and_its_generators_apply_nothing_partial(
        delta_pub, tmp_path, short_tmp):
    """A full folder, root-free: the relay runs with a 64 KiB file-size limit (RLIMIT_FSIZE; a version here is
    ~155 KB), so reserving a version's file fails as on a full tmpfs. The relay says so in one line and exits 1;
    its generators keep what they hold (nothing partial); a relay with room serves them the version."""
    import os
    import resource
    import signal
    import subprocess
    import sys

    from streamgrpo.config import build_config
    from streamgrpo.transport.weights.factory import subscriber_from_config

    shm = short_tmp
    cfg = build_config({}, [f"run_dir={tmp_path / 'run'}", f"weights.pub_port={delta_pub.pub_port}",
                            f"weights.snapshot_port={delta_pub.snapshot_port}", "weights.delta=true",
                            f"weights.shm_dir={shm}", "weights.relay=true", "metrics.port=0"])
    path = tmp_path / "relay.yaml"
    path.write_text(cfg.to_yaml())
    argv = [sys.executable, "-m", "streamgrpo", "relay", "--config", str(path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), as ENOSPC would
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    v = _base()
    delta_pub.publish(0, v)
    full = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=small_files)
    sub = None
    try:
        deadline = time.monotonic() + WAIT_S
        while sub is None and time.monotonic() < deadline and full.poll() is None:
            try:
                sub = subscriber_from_config(cfg.weights, cfg.run_dir)  # once the relay's sockets exist
            except Exception:  # noqa: BLE001 - not there yet
                time.sleep(0.2)
        out, _ = full.communicate(timeout=WAIT_S)
        assert full.returncode == 1, out[-3000:]
        assert "Traceback" not in out, out[-3000:]
        errors = [line for line in out.splitlines() if "ERROR" in line]
        assert len(errors) == 1 and "has no room for a" in errors[0] and "shm_size" in errors[0], out[-3000:]
        if sub is not None:
            assert sub.poll(0.5) is None  # nothing partial was handed out
        roomy = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + WAIT_S
            while sub is None and time.monotonic() < deadline:
                try:
                    sub = subscriber_from_config(cfg.weights, cfg.run_dir)
                except Exception:  # noqa: BLE001 - not there yet
                    time.sleep(0.2)
            assert sub is not None
            got = _wait(sub, 0, WAIT_S)
            assert got[0] == 0 and _same(got[1], v)
        finally:
            roomy.send_signal(signal.SIGTERM)
            roomy.wait(30)
    finally:
        if sub is not None:
            sub.close()
        if full.poll() is None:
            full.kill()
            full.wait(10)
