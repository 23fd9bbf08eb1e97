"""Weights across hosts over real ZeroMQ sockets, real shared-memory files and real processes:
versions as lossless deltas (applied bit for bit, a missed base or a tampered result repaired from the
snapshot, old whole-version subscribers still served), and a relay per host (its generators receive
every version through shared memory while the learner sends it once; a relay killed with -9 is
replaced by a generator's keeper)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import wait_weights_version as _wait
from weight_updates import counter_value as _value
from weight_updates import same as _same
from weight_updates import small_update as _step

from streamgrpo import metrics as M
from streamgrpo.config import build_config
from streamgrpo.transport.weights.publisher import WeightPublisher

WAIT_S = 60.0


def _base(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": (torch.randn(300, 257, generator=g) * 0.02).to(torch.bfloat16),
            "norm": torch.ones(257, dtype=torch.bfloat16), "f32": torch.randn(99, generator=g)}


@pytest.fixture
def delta_pub():
    pub = WeightPublisher("127.0.0.1", 0, 0, chunk_mib=1 / 64, delta_max_ratio=0.5)
    yield pub
    pub.close(timeout_s=1.0)


def test_versions_travel_as_deltas_and_apply_bit_for_bit(delta_pub, weight_subscriber_factory):
    sub = weight_subscriber_factory(delta_pub.pub_port, delta_pub.snapshot_port, delta=True)
    v = _base()
    delta_pub.publish(0, v)
    assert _same(_wait(sub, 0, WAIT_S)[1], v)
    sub.mark_applied()
    applied = _value(M.WEIGHT_DELTAS, result="applied")
    for k in range(1, 4):
        v = _step(v, k)
        delta_pub.publish(k, v)
        got = _wait(sub, k, WAIT_S)
        assert got[0] == k and _same(got[1], v)  # bit for bit
        sub.mark_applied()
    # the last chunk can reach the subscriber before the sender thread counts the version: flush first
    assert delta_pub.flush(WAIT_S)
    assert delta_pub.deltas_sent == 3 and sub.stats["from_delta"] == 3 and sub.stats["discarded"] == 0
    assert _value(M.WEIGHT_DELTAS, result="applied") == applied + 3
    assert 0 < M.WEIGHT_DELTA_RATIO._value.get() < 0.1
    # a version that changes everything goes out whole
    fresh, whole = _base(seed=9), sub.stats["from_pub"] + sub.stats["from_snapshot"]
    delta_pub.publish(4, fresh)
    assert _same(_wait(sub, 4, WAIT_S)[1], fresh) and delta_pub.flush(WAIT_S) and delta_pub.deltas_sent == 3
    assert sub.stats["from_pub"] + sub.stats["from_snapshot"] == whole + 1 and sub.stats["from_delta"] == 3


def test_a_subscriber_without_the_base_fetches_the_snapshot_and_a_tampered_result_is_repaired(
        delta_pub, weight_subscriber_factory):
    sub = weight_subscriber_factory(delta_pub.pub_port, delta_pub.snapshot_port, delta=True)
    v0 = _base()
    delta_pub.publish(0, v0)
    _wait(sub, 0, WAIT_S)
    sub.mark_applied()
    sub._base = None  # as if it had missed the version the next delta applies to
    snapshots = sub.stats["from_snapshot"]
    v1 = _step(v0, 1)
    delta_pub.publish(1, v1)
    assert _same(_wait(sub, 1, WAIT_S)[1], v1)
    sub.mark_applied()
    assert sub.stats["delta_no_base"] == 1 and sub.stats["from_snapshot"] == snapshots + 1
    assert sub.stats["from_delta"] == 0
    # tampered: a byte of the base that the next delta does not touch; the full digests catch it
    key, base = sub._base
    assert key[1] == 1
    base[base.size - 3] ^= 0xFF
    errors = _value(M.ERRORS, kind="weights")
    v2 = _step(v1, 2)
    delta_pub.publish(2, v2)
    assert _same(_wait(sub, 2, WAIT_S)[1], v2)  # never the tampered bytes: the snapshot's
    assert _value(M.ERRORS, kind="weights") > errors and sub.stats["from_delta"] == 0
    assert _value(M.WEIGHT_DELTAS, result="corrupt") >= 1


def test_a_whole_version_subscriber_is_still_served_by_a_delta_publisher(delta_pub, weight_subscriber_factory):
    old = weight_subscriber_factory(delta_pub.pub_port, delta_pub.snapshot_port)  # delta=False: as before
    v = _base()
    delta_pub.publish(0, v)
    _wait(old, 0, WAIT_S)
    old.mark_applied()
    for k in (1, 2):
        v = _step(v, k)
        delta_pub.publish(k, v)
        assert _same(_wait(old, k, WAIT_S)[1], v)  # announced by the heartbeat, fetched as a snapshot
        old.mark_applied()
    assert delta_pub.flush(WAIT_S) and delta_pub.deltas_sent == 2 and old.stats["from_snapshot"] >= 2


# ------------------------------------------------------------------------------------- relay
def _relay_cfg(tmp_path, pub: WeightPublisher, shm):

    return build_config({}, [f"run_dir={tmp_path / 'run'}", f"weights.pub_port={pub.pub_port}",
                             f"weights.snapshot_port={pub.snapshot_port}", "weights.delta=true",
                             f"weights.shm_dir={shm}", "weights.relay=true", "metrics.port=0"])


def _relay_subscribers(cfg, n: int):
    from streamgrpo.transport.weights.factory import subscriber_from_config

    return [subscriber_from_config(cfg.weights, cfg.run_dir) for _ in range(n)]


def _until(pred, what: str, timeout: float = WAIT_S) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_relays_generators_receive_every_version_and_the_learner_sends_it_once(delta_pub, tmp_path, short_tmp):
    import threading

    from streamgrpo.relay.loop import run_relay
    from streamgrpo.runtime.processes import StopFlag

    shm = short_tmp
    cfg = _relay_cfg(tmp_path, delta_pub, shm)
    stop = StopFlag(install=False)
    relay = threading.Thread(target=run_relay, args=(cfg,), kwargs={"stop": stop}, daemon=True)
    relay.start()
    subs = _relay_subscribers(cfg, 3)
    try:
        v = _base()
        for k in range(4):
            delta_pub.publish(k, v)
            for s in subs:
                got = _wait(s, k, WAIT_S)
                assert got[0] == k and _same(got[1], v)
                s.mark_applied()
            v = _step(v, k + 1)
        assert delta_pub.subscribers == 1  # only the relay talks to the learner: one copy per host
        assert delta_pub.flush(WAIT_S) and delta_pub.deltas_sent == 3  # and after the first version, deltas
        assert all(s.stats.get("from_shm", 0) + s.stats["from_snapshot"] >= 4 for s in subs)
    finally:
        stop.set()
        relay.join(10)
        for s in subs:
            s.close()
    assert not relay.is_alive()


def test_a_relay_killed_with_sigkill_is_replaced_by_a_generators_keeper(delta_pub, tmp_path, short_tmp):
    from streamgrpo.relay.keeper import RelayKeeper, relay_running

    shm = short_tmp
    cfg = _relay_cfg(tmp_path, delta_pub, shm)
    keeper = RelayKeeper(cfg, cfg.run_dir, "generator-0", every_s=0.0)
    assert keeper.check() and keeper.started == 1  # none ran: this generator started one
    _until(lambda: relay_running(cfg.weights), "the relay to take its lock")
    assert not keeper.check()  # one runs: nothing more started
    second = subprocess.run([sys.executable, "-m", "streamgrpo", "relay", "--config", str(_config_file(cfg, tmp_path))],
                            capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert second.returncode == 0 and "another relay serves this host" in second.stderr
    (sub,) = _relay_subscribers(cfg, 1)
    try:
        v = _base()
        delta_pub.publish(0, v)
        assert _same(_wait(sub, 0, WAIT_S)[1], v)
        sub.mark_applied()
        os.kill(_relay_pid(cfg), signal.SIGKILL)
        _until(lambda: not relay_running(cfg.weights), "the killed relay's lock to go")
        assert keeper.check() and keeper.started == 2  # noticed and replaced
        _until(lambda: relay_running(cfg.weights), "the new relay")
        for k in (1, 2):
            v = _step(v, k)
            delta_pub.publish(k, v)
            got = _wait(sub, k, WAIT_S)
            assert got[0] == k and _same(got[1], v)
            sub.mark_applied()
    finally:
        sub.close()
        if relay_running(cfg.weights):
            os.kill(_relay_pid(cfg), signal.SIGTERM)
            _until(lambda: not relay_running(cfg.weights), "the relay to stop", 30)


def _relay_pid(cfg) -> int:
    """The PID in the relay's lock file once it names a live ``streamgrpo relay`` (never this process)."""
    from streamgrpo.relay.keeper import lock_path

    def named() -> int | None:
        text = lock_path(cfg.weights).read_text().strip()
        if not text.isdigit() or int(text) == os.getpid():
            return None
        try:
            return int(text) if b"relay" in Path(f"/proc/{text}/cmdline").read_bytes() else None
        except OSError:
            return None

    _until(lambda: named() is not None, "the relay's PID in its lock file")
    return named()


def _config_file(cfg, tmp_path):
    path = tmp_path / "relay.yaml"
    path.write_text(cfg.to_yaml())
    return path


def test_a_relay_without_generators_exits_and_a_folder_open_to_others_is_refused(delta_pub, tmp_path,
                                                                                short_tmp):
    from streamgrpo.config import ConfigError
    from streamgrpo.relay.keeper import RelayKeeper, relay_running
    from streamgrpo.relay.loop import run_relay
    from streamgrpo.transport.weights.factory import relay_dir

    shm = short_tmp
    cfg = _relay_cfg(tmp_path, delta_pub, shm)
    assert run_relay(cfg, idle_exit_s=1.0) == 0  # nobody connected: it leaves on its own
    assert not relay_running(cfg.weights) and relay_dir(cfg.weights).stat().st_mode & 0o777 == 0o700
    other = _relay_cfg(tmp_path, delta_pub, shm)
    other.weights.pub_port = delta_pub.pub_port + 1  # another learner: another relay folder
    assert relay_dir(other.weights) != relay_dir(cfg.weights)
    relay_dir(other.weights).mkdir(mode=0o755)
    relay_dir(other.weights).chmod(0o755)
    with pytest.raises(ConfigError, match="open to others") as err:
        RelayKeeper(other, other.run_dir, "generator-0").check()
    assert "\n" not in str(err.value)


def test_a_keeper_backs_off_when_its_relays_keep_dying(tmp_path):
    from streamgrpo.relay.keeper import RelayKeeper

    shm = tmp_path / "shm"  # (no socket here: tmp_path's length does not matter)
    shm.mkdir()
    cfg = build_config({}, [f"run_dir={tmp_path / 'run'}", f"weights.shm_dir={shm}", "weights.relay=true"])
    now = [0.0]
    keeper = RelayKeeper(cfg, cfg.run_dir, "generator-0", every_s=5.0, clock=lambda: now[0])
    starts = []
    keeper.start = lambda: (starts.append(now[0]), setattr(keeper, "started", keeper.started + 1))  # no process
    for t in range(0, 200):  # no relay ever holds the lock: each one "died" at once
        now[0] = float(t)
        keeper.check()
    assert starts == [0.0, 5.0, 15.0, 35.0, 75.0, 155.0]  # 5 s, then doubling
