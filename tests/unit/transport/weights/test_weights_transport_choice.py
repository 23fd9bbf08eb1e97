"""Which weight channel a subscriber opens: ``weights.transport`` ipc/shm are for the learner's own host; a
subscriber elsewhere (the Slurm evaluator on another node, a generator started by hand on another host with a
1-node recipe) takes TCP, since the sockets under a shared run_dir and the files in its own shm_dir are not
the learner's. Real ZeroMQ sockets, no learner needed (connecting is asynchronous)."""

from __future__ import annotations

import pytest

from streamgrpo.config import WeightsConfig
from streamgrpo.transport.weights.factory import learner_is_local, subscriber_from_config
from streamgrpo.transport.weights.shm_subscriber import ShmSubscriber

ELSEWHERE = "192.0.2.1"  # TEST-NET-1 (RFC 5737): never an address of this host


@pytest.mark.parametrize("host, local", [("127.0.0.1", True), ("localhost", True), ("0.0.0.0", True),
                                         (ELSEWHERE, False), ("no-such-host.invalid", False)])
def test_which_hosts_are_this_one(host, local):
    assert learner_is_local(host) is local


def _endpoints(sub) -> list[str]:
    return [link.endpoint for link in sub._links.links]


@pytest.mark.parametrize("transport", ["shm", "ipc"])
def test_a_subscriber_on_another_host_than_the_learner_takes_tcp(tmp_path, transport):
    wcfg = WeightsConfig(transport=transport, connect_host=ELSEWHERE, pub_port=45555, snapshot_port=45556,
                         shm_dir=str(tmp_path / "shm"))
    sub = subscriber_from_config(wcfg, tmp_path / "run")
    try:
        assert not isinstance(sub, ShmSubscriber)
        assert _endpoints(sub) == [f"tcp://{ELSEWHERE}:45555", f"tcp://{ELSEWHERE}:45556"]
    finally:
        sub.close()


def test_a_subscriber_on_the_learners_host_keeps_shared_memory(tmp_path):
    wcfg = WeightsConfig(transport="shm", connect_host="127.0.0.1", pub_port=45555, snapshot_port=45556,
                         shm_dir=str(tmp_path / "shm"))
    sub = subscriber_from_config(wcfg, tmp_path / "run")
    try:
        assert isinstance(sub, ShmSubscriber)
        assert all(ep.startswith(f"ipc://{tmp_path / 'run' / 'ipc'}") for ep in _endpoints(sub)), _endpoints(sub)
    finally:
        sub.close()


def test_a_relay_folder_too_long_for_a_socket_is_one_line_naming_the_setting(tmp_path):
    """A unix socket path holds 107 bytes: a deep ``weights.shm_dir`` was a ZMQError from inside zmq (and, in a
    process that went on, a half-made context); now a ConfigError before any socket is made."""
    from streamgrpo.config import ConfigError
    from streamgrpo.transport.weights.factory import relay_publisher_from_config

    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    wcfg = WeightsConfig(relay=True, connect_host="127.0.0.1", pub_port=45555, snapshot_port=45556, shm_dir=str(deep))
    for make in (lambda: subscriber_from_config(wcfg, tmp_path / "run"), lambda: relay_publisher_from_config(wcfg)):
        with pytest.raises(ConfigError) as err:
            make()
        line = str(err.value)
        assert "\n" not in line and "weights.shm_dir" in line and "over the 107" in line, line
