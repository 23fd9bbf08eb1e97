"""The generator pods' shard from the pod ordinal and the StatefulSet's replicas (streamgrpo/commands/k8s_generator.py).

The pure core by value; the API read against a real HTTPS server on loopback that answers as the Kubernetes
API does (bearer token, a CA the pod trusts, RBAC's 403), the command end to end in a subprocess, and the
supervisor with real child processes whose shard count changes under them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from streamgrpo.cli import build_parser
from streamgrpo.commands.k8s_generator import (
    Api,
    K8sError,
    generator_argv,
    next_action,
    pod_identity,
    read_replicas,
    replicas_of,
    supervise,
)
from streamgrpo.runtime.processes import free_port
from tests.paths import REPO

TOKEN = "token-of-the-generator-service-account"
PATH = "/apis/apps/v1/namespaces/streamgrpo/statefulsets/streamgrpo-generator"


# ===================================================================================== pure core
def test_pod_identity():
    assert pod_identity("streamgrpo-generator-3") == ("streamgrpo-generator", 3)
    assert pod_identity("gen-12") == ("gen", 12)
    for bad in ("streamgrpo-generator", "generator-x", "", "-3", "Gen-1"):
        with pytest.raises(K8sError, match="is not <statefulset>-<ordinal>"):
            pod_identity(bad)


def test_replicas_of():
    assert replicas_of({"spec": {"replicas": 6}}) == 6
    assert replicas_of({"spec": {}}) == 1  # Kubernetes' default
    assert replicas_of({"spec": {"replicas": 0}}) == 0
    for bad in ("6", -1, True, None):
        with pytest.raises(K8sError, match="not a count"):
            replicas_of({"spec": {"replicas": bad}})


def test_generator_argv_parses_as_shard_k_of_n():
    argv = generator_argv(["--config", "/etc/streamgrpo/config.yaml", "--set", "rollout.num_generators=2"], 4, 6)
    assert argv == ["generator", "--config", "/etc/streamgrpo/config.yaml", "--set", "rollout.num_generators=2",
                    "--id", "4", "--set", "rollout.num_generators=6"]
    args = build_parser().parse_args(argv)
    assert args.id == 4 and args.overrides[-1] == "rollout.num_generators=6"  # the last --set wins
    with pytest.raises(K8sError, match="--id is the pod's ordinal"):
        generator_argv(["--config", "x", "--id", "1"], 0, 2)
    with pytest.raises(K8sError, match="--id is the pod's ordinal"):
        generator_argv(["--id=1"], 0, 2)
    with pytest.raises(K8sError, match="pod ordinal 4 is not below the StatefulSet's 4 replicas"):
        generator_argv([], 4, 4)


def test_shard_count_overrides_the_config(tmp_path):
    """The config's own rollout.num_generators (4) loses to the StatefulSet's count (6): generator 5 validates."""
    from streamgrpo.config import load_config

    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text("rollout:\n  num_generators: 4\n")
    args = build_parser().parse_args(generator_argv(["--config", str(cfg_path)], 5, 6))
    cfg = load_config(args.config, args.overrides)
    assert cfg.rollout.num_generators == 6 and 0 <= args.id < cfg.rollout.num_generators


def test_next_action():
    assert next_action(4, 4, 1) == "keep"
    assert next_action(4, None, 1) == "keep"  # the API did not answer: go on as before
    assert next_action(4, 6, 1) == "restart"  # scaled up: every shard changes
    assert next_action(6, 4, 1) == "restart"  # scaled down: the pods that stay take the others' share
    assert next_action(6, 4, 5) == "keep"  # this pod is being scaled away: the StatefulSet deletes it


# ============================================================================ an API that answers
@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """An HTTPS server on loopback answering as the Kubernetes API for one StatefulSet, and a service-account
    directory (token, ca.crt, namespace) as Kubernetes mounts it into the pod."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl not installed: no certificate for the stand-in Kubernetes API")
    d = tmp_path_factory.mktemp("k8s")
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem")],
                   check=True, capture_output=True, timeout=60)
    sa = d / "sa"
    sa.mkdir()
    shutil.copy(d / "cert.pem", sa / "ca.crt")
    (sa / "token").write_text(TOKEN + "\n")
    (sa / "namespace").write_text("streamgrpo")
    state = {"replicas": 6, "requests": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            state["requests"] += 1
            if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                return self._send(401, {"kind": "Status", "reason": "Unauthorized"})
            if self.path.startswith("/apis/apps/v1/namespaces/streamgrpo/statefulsets/") and self.path != PATH:
                return self._send(403, {"kind": "Status", "reason": "Forbidden"})  # the Role names one StatefulSet
            if self.path != PATH:
                return self._send(404, {"kind": "Status", "reason": "NotFound"})
            self._send(200, {"kind": "StatefulSet", "metadata": {"name": "streamgrpo-generator"},
                             "spec": {"replicas": state["replicas"]}})

        def _send(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(d / "cert.pem", d / "key.pem")
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(server.server_address[1])}
    try:
        yield {"env": env, "sa": sa, "state": state, "dir": d}
    finally:
        server.shutdown()
        server.server_close()


def test_read_replicas_through_the_api(cluster):
    api = Api(cluster["env"], cluster["sa"])
    assert api.namespace == "streamgrpo"
    cluster["state"]["replicas"] = 6
    assert read_replicas(api, "streamgrpo-generator") == 6
    cluster["state"]["replicas"] = 3
    assert read_replicas(api, "streamgrpo-generator") == 3
    with pytest.raises(K8sError, match=r"HTTP 403 Forbidden: give the pod's service account a Role"):
        read_replicas(api, "another-statefulset")
    api.token = "wrong"
    with pytest.raises(K8sError, match="HTTP 401"):
        read_replicas(api, "streamgrpo-generator")


def test_api_errors_are_one_line(cluster, tmp_path):
    with pytest.raises(K8sError, match="KUBERNETES_SERVICE_HOST is not set"):
        Api({}, cluster["sa"])
    with pytest.raises(K8sError, match="no service account credentials in"):
        Api(cluster["env"], tmp_path)
    closed = Api({"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(free_port())}, cluster["sa"])
    with pytest.raises(K8sError, match=r"did not answer GET .*statefulsets/streamgrpo-generator"):
        read_replicas(closed, "streamgrpo-generator")
    # a CA that did not sign the server's certificate: refused, not trusted
    other = tmp_path / "other"
    other.mkdir()
    for f in ("token", "namespace"):
        shutil.copy(cluster["sa"] / f, other / f)
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=x",
                    "-keyout", str(tmp_path / "k.pem"), "-out", str(other / "ca.crt")],
                   check=True, capture_output=True, timeout=60)
    with pytest.raises(K8sError, match="CERTIFICATE_VERIFY_FAILED"):
        read_replicas(Api(cluster["env"], other), "streamgrpo-generator")
    assert Api({"KUBERNETES_SERVICE_HOST": "fd00::1"}, cluster["sa"]).base == "https://[fd00::1]:443"


def run_main(cluster, pod_name: str, *argv: str, **env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    full.update(cluster["env"], POD_NAME=pod_name, STREAMGRPO_DRY_RUN="1", PYTHONPATH=str(REPO), **env)
    return subprocess.run([sys.executable, "-m", "streamgrpo.commands.k8s_generator",
                           "--service-account-dir", str(cluster["sa"]), *argv],
                          capture_output=True, text=True, timeout=60, env=full)


def test_main_runs_shard_k_of_the_statefulsets_replicas(cluster):
    """`kubectl scale --replicas=6`: the new pod 5 runs generator 5 of 6, not 5 of the config's 4."""
    cluster["state"]["replicas"] = 6
    out = run_main(cluster, "streamgrpo-generator-5", "--config", "/etc/streamgrpo/config.yaml")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:-1] == ["streamgrpo", "generator", "--config", "/etc/streamgrpo/config.yaml",
                                           "--id", "5", "--set", "rollout.num_generators=6"]
    # errors: one line, exit 2, no traceback
    for pod, expect in (("streamgrpo-generator-6", "pod ordinal 6 is not below the StatefulSet's 6 replicas"),
                        ("not-a-statefulset-pod", "is not <statefulset>-<ordinal>"),
                        ("forbidden-0", "HTTP 403 Forbidden")):
        out = run_main(cluster, pod, "--config", "x")
        assert out.returncode == 2 and out.stdout == "", out
        assert out.stderr.count("\n") == 1 and out.stderr.startswith("k8s_generator: ") and expect in out.stderr, out.stderr


# =================================================================================== supervisor
_CHILD = """
import signal, sys, time, pathlib
log = pathlib.Path(sys.argv[1])
n = sys.argv[2]
def stop(*_):
    with log.open("a") as f:
        f.write(f"stopped {n}\\n")
    sys.exit(int(sys.argv[3]))
signal.signal(signal.SIGTERM, stop)
with log.open("a") as f:
    f.write(f"started {n}\\n")
while True:
    time.sleep(0.05)
"""


def wait_for(predicate, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_supervisor_restarts_the_generator_when_the_replicas_change(tmp_path):
    """Real child processes: shard 1 of 4, the StatefulSet scaled to 6 (a poll fails once meanwhile: kept),
    stopped by SIGTERM and started as 1 of 6; a SIGTERM to the supervisor ends the child, whose code it returns."""
    log = tmp_path / "child.log"
    polled = {"value": 4, "fail": False}

    def poll():
        if polled["fail"]:
            polled["fail"] = False
            raise K8sError("Kubernetes API did not answer")
        return polled["value"]

    def start(n):
        return subprocess.Popen([sys.executable, "-c", _CHILD, str(log), str(n), "7"])

    def lines():
        return log.read_text().splitlines() if log.exists() else []

    # supervise installs its SIGTERM handler, which only the main thread can: it runs here, a thread drives
    def drive():
        try:
            wait_for(lambda: lines() == ["started 4"], "the first start")
            polled["fail"] = True
            wait_for(lambda: not polled["fail"], "the failing poll")
            polled["value"] = 6
            wait_for(lambda: lines() == ["started 4", "stopped 4", "started 6"], "the restart as 1 of 6")
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    rc = supervise(start, 4, 1, poll, poll_s=0.05, stop_grace_s=30)
    driver.join(timeout=60)
    assert lines() == ["started 4", "stopped 4", "started 6", "stopped 6"]
    assert rc == 7, "the supervisor exits with its generator's code"
    assert signal.getsignal(signal.SIGTERM) is before, "the handlers are restored"


def test_supervisor_returns_when_the_generator_ends(tmp_path):
    child = [sys.executable, "-c", "import sys; sys.exit(3)"]
    assert supervise(lambda n: subprocess.Popen(child), 2, 0, lambda: 2, poll_s=30) == 3
