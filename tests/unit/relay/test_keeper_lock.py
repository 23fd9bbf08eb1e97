"""The relay's lock file (streamgrpo/relay/keeper.py): a probe never writes it, and a relay starting while
a generator probes does not take the probe for another relay."""

from __future__ import annotations

import fcntl
import os
import threading

from streamgrpo.config import build_config
from streamgrpo.relay.keeper import lock_path, relay_running, take_lock


def _wcfg(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    return build_config({}, [f"run_dir={tmp_path / 'run'}", f"weights.shm_dir={shm}", "weights.relay=true"]).weights


def test_a_probe_writes_nothing_and_sees_the_relay_until_it_lets_go(tmp_path):
    wc = _wcfg(tmp_path)
    assert not relay_running(wc)  # nothing there yet
    fd = take_lock(wc)
    assert fd is not None and lock_path(wc).read_text() == f"{os.getpid()}\n"
    try:
        assert relay_running(wc) and relay_running(wc)
        assert take_lock(wc, wait_s=0.0) is None  # a second relay leaves
    finally:
        os.close(fd)
    assert not relay_running(wc)
    lock_path(wc).write_text("12345\n")  # the last relay's PID stays: probes leave the file alone
    assert not relay_running(wc) and lock_path(wc).read_text() == "12345\n"


def test_a_relay_starting_during_a_probe_waits_it_out(tmp_path):
    wc = _wcfg(tmp_path)
    os.close(take_lock(wc))  # the file exists, nobody holds it
    probe = os.open(lock_path(wc), os.O_RDONLY)
    fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a generator's probe, caught in the act
    let_go = threading.Timer(0.3, os.close, args=(probe,))
    let_go.start()
    try:
        fd = take_lock(wc, wait_s=30.0)
    finally:
        let_go.join()
    assert fd is not None  # not "another relay serves this host"
    os.close(fd)
