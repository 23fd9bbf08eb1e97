"""Same-host weights through shared memory (weights.transport=shm): real files, real flock, real kill -9.

A generator maps the learner's version file, verifies every chunk digest and reads the tensors in
place; the learner never rewrites a file a generator still holds; a rewritten or tampered file is
never handed out; files are cleaned up at close and after a learner killed with kill -9.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
from conftest import wait_weights_version as _wait_version
from weights_reference import build_version

from streamgrpo.config import WeightsConfig
from streamgrpo.transport.weights.codec import WeightsFormatError, chunk_digest, chunk_span
from streamgrpo.transport.weights.factory import publisher_from_config, subscriber_from_config
from streamgrpo.transport.weights.shm import (
    PREFIX,
    Announcement,
    ShmFile,
    ShmPool,
    decode_announcement,
    encode_announcement,
    read_version,
    sweep_stale,
)
from streamgrpo.transport.weights.shm_publisher import ShmPublisher
from streamgrpo.transport.weights.shm_subscriber import ShmSubscriber
from streamgrpo.transport.weights.subscriber import WeightSubscriber

WAIT_S = 30.0


def _tensors(seed: int, n: int = 40_000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(n, generator=g).to(torch.bfloat16), "b": torch.randn(33, 17, generator=g),
            "c": torch.randint(0, 100, (129,), generator=g, dtype=torch.int32)}


def _same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def _files(d) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith(PREFIX))


@pytest.fixture
def dirs(tmp_path):
    (tmp_path / "shm").mkdir()
    return tmp_path / "ipc", tmp_path / "shm"


def test_same_host_generator_reads_versions_from_shared_memory_and_tcp_ones_still_get_chunks(dirs):
    ipc, shm = dirs
    with ShmPublisher("127.0.0.1", 0, 0, chunk_mib=1 / 64, ipc_dir=ipc, shm_dir=shm) as pub:
        local = ShmSubscriber(ipc_dir=ipc, shm_dir=shm)
        remote = WeightSubscriber("127.0.0.1", pub.pub_port, pub.snapshot_port)
        try:
            pub.publish(1, _tensors(1))  # may reach a subscriber still connecting through the snapshot
            for sub in (local, remote):
                _wait_version(sub, 1)
                sub.mark_applied()
            for version in (2, 3):
                pub.publish(version, _tensors(version))
                for sub in (local, remote):
                    got_version, got = _wait_version(sub, version)
                    assert got_version == version and _same(got, _tensors(version))
                    sub.mark_applied()
            assert local.stats["from_shm"] >= 2 and local.stats["from_pub"] == 0
            assert local.stats["shm_early_chunks"] > 0  # chunks verified while the learner still wrote
            assert remote.stats.get("from_shm", 0) == 0 and remote.stats["from_pub"] >= 2
            assert _files(shm)  # the versions live there while the learner runs
        finally:
            local.close()
            remote.close()
    assert _files(shm) == []  # close() removes them


def test_a_version_a_generator_holds_never_changes(dirs):
    ipc, shm = dirs
    with ShmPublisher("127.0.0.1", 0, 0, chunk_mib=1 / 64, ipc_dir=ipc, shm_dir=shm, host_buffers=2) as pub:
        sub = ShmSubscriber(ipc_dir=ipc, shm_dir=shm)
        try:
            pub.publish(1, _tensors(1))
            _wait_version(sub, 1)
            sub.mark_applied()
            pub.publish(2, _tensors(2))
            version, held = _wait_version(sub, 2)  # held: the generator's verified copy, not applied yet
            assert version == 2 and sub.stats["from_shm"] >= 1
            for v in range(3, 9):  # many newer versions while the generator still holds version 2
                pub.publish(v, _tensors(v))
                assert pub.flush(WAIT_S)
            assert _same(held, _tensors(2))  # what it holds is its own copy, whatever the files hold now
            assert _wait_version(sub, 8)[0] == 8
            sub.mark_applied()
        finally:
            sub.close()


def _announce_for(f: ShmFile, version: int, tensors: dict) -> Announcement:
    meta, meta_bytes, buf_N = build_version(version, tensors, chunk_bytes=4096, src=7)
    f.stamp(7, version)
    f.tensor[: meta.nbytes].copy_(buf_N)
    digests = [chunk_digest(meta.algo, memoryview(buf_N.numpy())[s:e], meta_bytes if q == 0 else None)
               for q, (s, e) in enumerate(chunk_span(meta, i) for i in range(meta.n_chunks))]
    return decode_announcement(encode_announcement(meta_bytes, digests, str(f.path)), f.path.parent)


def _announce_payload(version: int):
    return build_version(version, _tensors(version), chunk_bytes=4096, src=7)[2].numpy()


def test_read_version_verifies_digests_and_refuses_a_file_being_rewritten(tmp_path):
    f = ShmFile(tmp_path / f"{PREFIX}{os.getpid()}-7-1", 1 << 20)
    try:
        a = _announce_for(f, 3, _tensors(3))
        done = read_version(a)
        assert done.meta.version == 3 and _same(done.tensors(), _tensors(3))
        f.tensor[: a.meta.nbytes].zero_()  # another same-user process rewrites the file after the check ...
        assert _same(done.tensors(), _tensors(3))  # ... and what the generator applies is still what it verified
        f.tensor[: a.meta.nbytes].copy_(torch.from_numpy(_announce_payload(3)))
        assert f.try_lock()  # the reader let go of its lock once its copy was verified: the learner may rewrite
        why = read_version(a)
        assert isinstance(why, str) and "being rewritten" in why
        f.unlock()
        f.tensor[100] ^= 0xFF  # a byte changed after the digests were taken
        why = read_version(a)
        assert isinstance(why, str) and "digest mismatch" in why
        f.tensor[100] ^= 0xFF
        f.stamp(7, 5)  # the learner took the file for version 5 after these digests were announced
        why = read_version(a)
        assert isinstance(why, str) and "now holds another version" in why
    finally:
        f.close()


def test_announcements_are_checked(tmp_path):
    f = ShmFile(tmp_path / f"{PREFIX}{os.getpid()}-7-1", 1 << 16)
    try:
        a = _announce_for(f, 1, {"x": torch.ones(10)})
        good = encode_announcement(a.meta_bytes, a.digests, a.path)
        assert decode_announcement(good, tmp_path).meta.version == 1
        with pytest.raises(WeightsFormatError, match="not a weights file"):
            decode_announcement(encode_announcement(a.meta_bytes, a.digests, "/etc/passwd"), tmp_path)
        with pytest.raises(WeightsFormatError, match="not a weights file"):
            decode_announcement(good, tmp_path / "elsewhere")
        with pytest.raises(WeightsFormatError, match="chunk digests"):
            decode_announcement(encode_announcement(a.meta_bytes, a.digests + [b"x"], a.path), tmp_path)
        with pytest.raises(WeightsFormatError):
            decode_announcement(b"\xc1garbage", tmp_path)
    finally:
        f.close()


def test_a_reader_killed_with_sigkill_blocks_nothing(tmp_path):
    f = ShmFile(tmp_path / f"{PREFIX}{os.getpid()}-7-1", 4096)
    try:
        f.unlock()
        reader = subprocess.Popen([sys.executable, "-c", (
            "import fcntl, os, sys, time\n"
            f"fd = os.open({str(f.path)!r}, os.O_RDONLY)\n"
            "fcntl.flock(fd, fcntl.LOCK_SH)\n"
            "print('locked', flush=True)\n"
            "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
        try:
            assert reader.stdout.readline().strip() == "locked"
            assert not f.try_lock()
            os.kill(reader.pid, signal.SIGKILL)
            reader.wait(10)
        finally:
            if reader.poll() is None:
                reader.kill()
                reader.wait(10)
        assert f.try_lock()
    finally:
        f.close()


def test_files_of_a_learner_killed_with_sigkill_are_swept_at_the_next_start(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(10)
    stale = tmp_path / f"{PREFIX}{dead.pid}-5-1"
    stale.write_bytes(b"x" * 100)
    mine = tmp_path / f"{PREFIX}{os.getpid()}-5-1"
    mine.write_bytes(b"y")
    assert sweep_stale(tmp_path) == 1
    assert not stale.exists() and mine.exists()
    pool = ShmPool(tmp_path, src=9, max_files=2)  # a new learner sweeps too, and keeps to its cap
    try:
        a = pool.take(1000)
        pool.give_back(a)
        a.unlock()
        assert pool.take(1000) is a  # reused when nobody reads it
    finally:
        pool.close()
    mine.unlink()


def test_config_selects_shared_memory(tmp_path):
    cfg = WeightsConfig(pub_port=0, snapshot_port=0, transport="shm", shm_dir=str(tmp_path))
    with publisher_from_config(cfg, tmp_path) as pub:
        assert pub._shm is not None and pub._shm.dir == tmp_path
        sub = subscriber_from_config(cfg, tmp_path)
        try:
            assert sub.shm_dir == str(tmp_path)
        finally:
            sub.close()
    from streamgrpo.transport.weights.shm import ShmUnavailable

    with pytest.raises(ShmUnavailable, match="not a directory"):
        ShmPublisher("127.0.0.1", 0, 0, shm_dir=tmp_path / "missing")


def test_a_reader_maps_each_learner_file_once_and_again_when_it_is_replaced(tmp_path):
    from streamgrpo.transport.weights.shm import Maps

    maps = Maps(keep=2)
    a = ShmFile(tmp_path / f"{PREFIX}{os.getpid()}-7-1", 4096)
    b = ShmFile(tmp_path / f"{PREFIX}{os.getpid()}-7-2", 4096)
    try:
        ino = os.stat(a.path).st_ino
        first = maps.get(str(a.path), ino, 4096)
        assert maps.get(str(a.path), ino, 4096) is first  # reused: no new mapping, no page faults
        a.tensor[0] = 7
        assert first[0] == 7  # the same pages the learner writes
        assert maps.get(str(a.path), ino + 1, 4096) is not first  # another file under that name
        maps.get(str(b.path), os.stat(b.path).st_ino, 4096)
        assert len(maps._maps) == 2
    finally:
        a.close()
        b.close()


def test_a_full_shared_memory_directory_is_a_one_line_error(tmp_path, monkeypatch):
    import errno

    from streamgrpo.transport.weights.shm import ShmUnavailable

    def no_room(fd, offset, length):  # what posix_fallocate says on a full tmpfs
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    with pytest.raises(ShmUnavailable, match=r"has no room for a 0\.00 GB version .*shm_size.*transport=ipc"):
        ShmFile(tmp_path / f"{PREFIX}{os.getpid()}-7-1", 4096)
    assert _files(tmp_path) == []  # nothing left behind


def test_early_hashes_count_only_for_the_version_they_were_taken_for(tmp_path):
    from streamgrpo.transport.weights.shm import EarlyHashes

    f = ShmFile(tmp_path / f"{PREFIX}{os.getpid()}-7-1", 1 << 20)
    try:
        a = _announce_for(f, 3, _tensors(3))
        early = EarlyHashes(tmp_path)
        early.begin(a.meta_bytes, a.path)
        for seq in range(a.meta.n_chunks):
            early.chunk(7, 3, seq)
        early.chunk(7, 2, 0)  # another version's chunk: ignored
        done = read_version(a, early=early)
        assert early.used == a.meta.n_chunks and _same(done.tensors(), _tensors(3))
        early.begin(a.meta_bytes, a.path)
        early.chunk(7, 3, 0)
        other = Announcement(a.meta, a.meta_bytes, a.digests, str(tmp_path / f"{PREFIX}{os.getpid()}-7-9"))
        assert early.take(other) == (None, {})  # named another file: not used
        f.tensor[10] ^= 0xFF  # bytes hashed early that changed are still caught (all digests are compared)
        early.begin(a.meta_bytes, a.path)
        early.chunk(7, 3, 0)
        why = read_version(a, early=early)
        assert isinstance(why, str) and "digest mismatch" in why
    finally:
        f.close()


def test_a_directory_too_small_for_the_versions_the_learner_may_keep_is_refused_at_the_first_version(tmp_path):
    """Checked against the directory's real free space before the first file is made: a folder that
    holds one version but not max_files of them would otherwise stop the learner mid-run."""
    from streamgrpo.transport.weights.shm import ShmPool, ShmUnavailable

    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    pool = ShmPool(tmp_path, src=7, max_files=3)
    try:
        with pytest.raises(ShmUnavailable) as err:
            pool.take(free // 2)  # one would fit, three cannot
        msg = str(err.value)
        assert "may keep 3 versions" in msg and "shm_size" in msg and "transport=ipc" in msg and "\n" not in msg
        assert _files(tmp_path) == []  # refused before anything was allocated
        f = pool.take(4096)  # a version that fits three times over is fine
        assert f.capacity >= 4096
    finally:
        pool.close()
