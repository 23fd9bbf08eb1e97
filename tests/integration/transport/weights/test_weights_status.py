"""Issue 18: a generator that cannot get weights says why (real ZeroMQ sockets on loopback, real CURVE keys).

``WeightSubscriber.status()`` tells apart a refused client key, a failed handshake (wrong server key,
CURVE on one side only), a learner that is not there, and one that has published nothing yet;
``WeightsWatch`` (the generator's waiting loop) warns with that reason and gives up after
``weights.max_wait_s``. Waits are bounded generously; nothing here asserts on time.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import wait_weights_version as _version
from prometheus_client import REGISTRY

from streamgrpo.generator.weights_watch import WEIGHTS_UNAVAILABLE_EXIT, WeightsUnavailable, WeightsWatch
from streamgrpo.runtime.processes import free_port
from streamgrpo.transport.weights.base import WeightsState
from streamgrpo.transport.weights.keys import generate_keys
from streamgrpo.transport.weights.publisher import WeightPublisher
from tests.paths import REPO

WAIT_S = 30.0


def _state(sub, want: WeightsState, timeout: float = WAIT_S):
    """The subscriber's status once it reaches ``want`` (or an AssertionError showing the last one)."""
    end = time.monotonic() + timeout
    status = sub.status()
    while time.monotonic() < end:
        status = sub.status()
        if status.state is want:
            return status
        time.sleep(0.05)
    raise AssertionError(f"status never became {want.value}; last: {status}")


def _errors(kind: str) -> float:
    return REGISTRY.get_sample_value("streamgrpo_errors_total", {"kind": kind}) or 0.0


def _missing() -> float | None:
    return REGISTRY.get_sample_value("streamgrpo_weights_missing")


@pytest.fixture
def rogue_keys(curve_keys_dir, tmp_path):
    """A generator's keys dir with the learner's real server.key but a client key pair nobody listed."""
    generate_keys(tmp_path / "other", clients=1)
    rogue = tmp_path / "rogue"
    shutil.copytree(tmp_path / "other", rogue)
    shutil.copy(curve_keys_dir / "server.key", rogue / "server.key")
    (rogue / "server.key_secret").unlink()
    return rogue


@pytest.fixture
def curve_publisher(curve_keys_dir):
    pub = WeightPublisher("127.0.0.1", 0, 0, 1 / 64, str(curve_keys_dir))
    yield pub
    pub.close(timeout_s=1.0)


def _restart(pub: WeightPublisher, keys_dir) -> WeightPublisher:
    """Close ``pub`` and start a new learner on the same ports (rebinding until the old ones are free)."""
    ports = pub.pub_port, pub.snapshot_port
    pub.close(timeout_s=1.0)
    end = time.monotonic() + WAIT_S
    while True:
        try:
            return WeightPublisher("127.0.0.1", *ports, 1 / 64, str(keys_dir))
        except Exception:
            if time.monotonic() > end:
                raise
            time.sleep(0.1)


# ---------------------------------------------------------------------------------- status()
def test_unlisted_client_key_is_reported_as_refused(curve_publisher, rogue_keys, weight_subscriber_factory):
    pub = curve_publisher
    sub = weight_subscriber_factory(pub.pub_port, pub.snapshot_port, curve_keys_dir=str(rogue_keys),
                                    client_key="client-0")
    pub.publish(1, {"w": torch.ones(8)})
    status = _state(sub, WeightsState.AUTH_REFUSED)
    assert status.refused and status.version is None
    assert "refused this generator's CURVE key 'client-0'" in status.reason and "ZAP status 400" in status.reason
    both = _until_reason(sub, f":{pub.pub_port} (PUB) and tcp://127.0.0.1:{pub.snapshot_port} (snapshot)")
    assert both.startswith("the learner refused")  # both connections, once the second has been refused too
    assert sub.request_snapshot(1.0) is None  # and indeed no weights


def test_wrong_server_public_key_is_reported_as_a_failed_handshake(curve_publisher, curve_keys_dir, tmp_path,
                                                                   weight_subscriber_factory):
    pub = curve_publisher
    wrong = tmp_path / "wrong-server"
    shutil.copytree(curve_keys_dir, wrong)  # a listed client key, but another learner's server.key
    other = generate_keys(tmp_path / "another-learner", clients=0)
    (wrong / "server.key").unlink()
    shutil.copy(other.server_public, wrong / "server.key")
    sub = weight_subscriber_factory(pub.pub_port, pub.snapshot_port, curve_keys_dir=str(wrong), client_key="client-1")
    status = _state(sub, WeightsState.HANDSHAKE_FAILED)
    assert "CURVE handshake" in status.reason and "wrong learner public key" in status.reason
    assert "server.key" in status.reason


def test_plaintext_generator_against_a_curve_learner_is_a_security_mismatch(curve_publisher,
                                                                            weight_subscriber_factory):
    sub = weight_subscriber_factory(curve_publisher.pub_port, curve_publisher.snapshot_port)
    _state(sub, WeightsState.HANDSHAKE_FAILED)
    reason = _until_reason(sub, "security mismatch")  # a first attempt may only see the learner hang up
    assert "the learner requires CURVE keys and this generator has none" in reason
    assert sub.status().state is WeightsState.HANDSHAKE_FAILED


def test_nothing_listening_is_reported_as_unreachable(weight_subscriber_factory):
    pub_port, snap_port = free_port(), free_port()
    sub = weight_subscriber_factory(pub_port, snap_port)
    status = _state(sub, WeightsState.UNREACHABLE)
    assert not status.refused and status.version is None
    reason = _until_reason(sub, f"tcp://127.0.0.1:{pub_port} (PUB) and tcp://127.0.0.1:{snap_port} (snapshot)")
    assert reason.startswith("cannot connect to ") and "connection refused" in reason
    assert "is the learner running" in reason


def test_right_keys_wait_for_a_first_version_then_are_ok(curve_publisher, curve_keys_dir, weight_subscriber_factory):
    pub = curve_publisher
    sub = weight_subscriber_factory(pub.pub_port, pub.snapshot_port, curve_keys_dir=str(curve_keys_dir),
                                    client_key="client-0")
    waiting = _state(sub, WeightsState.WAITING)
    assert waiting.reason.startswith("connected to the learner at ") and waiting.version is None
    reason = _until_reason(sub, "has not published")  # once the snapshot endpoint has answered "none"
    assert reason.endswith("it has not published a version yet") and sub.status().state is WeightsState.WAITING
    pub.publish(3, {"w": torch.arange(5.0)})
    version, got = _version(sub, 3)
    assert version == 3 and torch.equal(got["w"], torch.arange(5.0))
    ok = _state(sub, WeightsState.OK)
    assert ok.version == 3 and ok.reason.startswith("v3 received") and not ok.refused


def _until_reason(sub, text: str) -> str:
    end = time.monotonic() + WAIT_S
    while time.monotonic() < end:
        reason = sub.status().reason
        if text in reason:
            return reason
        time.sleep(0.05)
    raise AssertionError(f"reason never said {text!r}; last: {sub.status()}")


def test_refused_generator_gets_weights_once_the_learner_lists_its_key(curve_keys_dir, rogue_keys,
                                                                       weight_subscriber_factory):
    """libzmq never retries after an auth failure: the subscriber dials again by itself."""
    pub = WeightPublisher("127.0.0.1", 0, 0, 1 / 64, str(curve_keys_dir))
    try:
        sub = weight_subscriber_factory(pub.pub_port, pub.snapshot_port, curve_keys_dir=str(rogue_keys),
                                        client_key="client-0", redial_s=0.2)
        _state(sub, WeightsState.AUTH_REFUSED)
        shutil.copy(rogue_keys / "clients" / "client-0.key", curve_keys_dir / "clients" / "client-9.key")
        pub = _restart(pub, curve_keys_dir)  # the learner reads its authorised keys at start
        pub.publish(1, {"w": torch.full((4,), 7.0)})
        version, got = _version(sub, 1)
        assert version == 1 and torch.equal(got["w"], torch.full((4,), 7.0))
        assert _state(sub, WeightsState.OK).version == 1
    finally:
        pub.close(timeout_s=1.0)


# ------------------------------------------------------------------------- the generator's watch
class _Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_watch_warns_with_the_reason_every_period_then_gives_up(curve_publisher, rogue_keys, caplog,
                                                                weight_subscriber_factory):
    pub = curve_publisher
    sub = weight_subscriber_factory(pub.pub_port, pub.snapshot_port, curve_keys_dir=str(rogue_keys),
                                    client_key="client-0")
    _state(sub, WeightsState.AUTH_REFUSED)
    clock, before = _Clock(), _errors("weights_missing")
    watch = WeightsWatch(sub, warn_every_s=30.0, max_wait_s=100.0, name="generator-7", clock=clock)
    assert _missing() == 1.0
    with caplog.at_level(logging.WARNING, logger="streamgrpo.generator"):
        assert watch.check().state is WeightsState.AUTH_REFUSED  # the first check warns at once
        clock.t += 10.0
        assert watch.check() is None  # not due yet
        clock.t += 25.0
        assert watch.check().state is WeightsState.AUTH_REFUSED
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "streamgrpo.generator"]
    assert len(warnings) == 2 and watch.warnings == 2
    assert _errors("weights_missing") == before + 2
    for text in warnings:
        assert text.startswith("generator-7: no weights from the learner after ")
        assert "still generating with the initial weights" in text
        assert "auth_refused: the learner refused this generator's CURVE key 'client-0'" in text
    clock.t += 65.0  # 100 s after the watch started
    with pytest.raises(WeightsUnavailable) as err:
        watch.check()
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("generator-7: no weights from the learner in 100 s, giving up")
    assert "weights.max_wait_s=100" in msg and "refused this generator's CURVE key 'client-0'" in msg
    assert _missing() == 1.0


def test_watch_without_a_bound_waits_forever_and_names_an_absent_learner(weight_subscriber_factory, caplog):
    sub = weight_subscriber_factory(free_port(), free_port())
    _state(sub, WeightsState.UNREACHABLE)
    clock = _Clock()
    watch = WeightsWatch(sub, warn_every_s=30.0, max_wait_s=0, name="generator-0", clock=clock)
    with caplog.at_level(logging.WARNING, logger="streamgrpo.generator"):
        for _ in range(4):
            assert watch.check().state is WeightsState.UNREACHABLE
            clock.t += 10_000.0
    assert watch.warnings == 4
    assert all("cannot connect to tcp://127.0.0.1:" in r.getMessage() for r in caplog.records
               if r.name == "streamgrpo.generator")


def test_watch_is_quiet_once_weights_arrived_but_warns_when_the_key_is_revoked(curve_keys_dir, caplog,
                                                                                weight_subscriber_factory):
    pub = WeightPublisher("127.0.0.1", 0, 0, 1 / 64, str(curve_keys_dir))
    try:
        sub = weight_subscriber_factory(pub.pub_port, pub.snapshot_port, curve_keys_dir=str(curve_keys_dir),
                                        client_key="client-1")
        clock = _Clock()
        watch = WeightsWatch(sub, warn_every_s=30.0, max_wait_s=50.0, name="generator-1", clock=clock)
        pub.publish(1, {"w": torch.ones(3)})
        _version(sub, 1)
        sub.mark_applied()
        _state(sub, WeightsState.OK)  # both connections up (the version may come over PUB before the other is)
        clock.t += 1000.0  # far past max_wait_s: a generator that got weights never gives up
        with caplog.at_level(logging.WARNING, logger="streamgrpo.generator"):
            assert watch.check().state is WeightsState.OK
            assert watch.received and _missing() == 0.0 and watch.warnings == 0

            (curve_keys_dir / "clients" / "client-1.key").unlink()  # revoked; the learner restarts
            refused_before = _errors("weights_refused")
            pub = _restart(pub, curve_keys_dir)
            _state(sub, WeightsState.AUTH_REFUSED)
            clock.t += 30.0
            assert watch.check().state is WeightsState.AUTH_REFUSED
        assert watch.warnings == 1 and _errors("weights_refused") == refused_before + 1
        (text,) = [r.getMessage() for r in caplog.records if r.name == "streamgrpo.generator"]
        assert text.startswith("generator-1: the learner refuses the weight channel; staying at v1: auth_refused")
    finally:
        pub.close(timeout_s=1.0)


# --------------------------------------------------------------------------- the real generator
@pytest.mark.slow
def test_generator_with_an_unlisted_key_warns_keeps_generating_and_exits_3(
        tiny_model_dir, demo_data_dir, redis_server, redis_ns, curve_publisher, rogue_keys, tmp_path):
    from streamgrpo.config import load_config

    pub = curve_publisher
    pub.publish(0, {"w": torch.ones(2)})  # a learner that is up and publishing: this generator must not get it
    run = tmp_path / "run"
    cfg = load_config("demo", [
        f"run_dir={run}", f"model.name_or_path={tiny_model_dir}", "demo.tiny_model=false",
        f"data.train_path={Path(demo_data_dir) / 'train.jsonl'}", "demo.make_data=false",
        "rollout.num_generators=1", "rollout.num_generations=2", "rollout.max_completion_length=2",
        "rollout.prompts_per_batch=1", f"queue.url={redis_server.url}", f"queue.namespace={redis_ns}",
        f"weights.pub_port={pub.pub_port}", f"weights.snapshot_port={pub.snapshot_port}",
        f"weights.curve_keys_dir={rogue_keys}", "queue.max_pending=2", "weights.warn_every_s=1", "weights.max_wait_s=15",
    ])
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(cfg.to_yaml())
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "streamgrpo", "generator", "--config", str(run / "config.yaml"),
                           "--id", "0"], env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == WEIGHTS_UNAVAILABLE_EXIT, out[-4000:]
    warnings = [line for line in out.splitlines() if " WARNING streamgrpo.generator: " in line]
    assert warnings and all("no weights from the learner" in w for w in warnings), out[-4000:]
    assert any("refused this generator's CURVE key 'client-0'" in w for w in warnings), out[-4000:]
    errors = [line for line in out.splitlines() if " ERROR streamgrpo.generator: " in line]
    assert len(errors) == 1 and "giving up (weights.max_wait_s=15)" in errors[0], out[-4000:]
    assert "auth_refused" in errors[0]
    import json

    audit = [json.loads(line) for line in (run / "audit" / "generator-0.jsonl").read_text().splitlines()]
    produced = [a for a in audit if a["event"] == "produced"]
    assert produced and {a["version"] for a in produced} == {0}  # kept generating with the initial weights
