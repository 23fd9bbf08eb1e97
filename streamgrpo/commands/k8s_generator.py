"""A generator pod of the Kubernetes StatefulSet (deploy/k8s/21-generators.yaml):
``python -m streamgrpo.commands.k8s_generator --config F [generator options]``.

The shard comes from the pod, not from the config: generator K is the pod's ordinal (pod
``streamgrpo-generator-3``: K = 3) of N = the StatefulSet's ``spec.replicas``, read from the Kubernetes
API with the pod's service account (a Role that may ``get`` that StatefulSet). It runs
``streamgrpo generator ... --id K --set rollout.num_generators=N``, so ``kubectl scale
statefulset/streamgrpo-generator --replicas=6`` just works: the new pods read 6. The running pods read
``spec.replicas`` again every ``--poll-s`` seconds; when N changed, each stops its generator (SIGTERM:
it finishes the batch and pushes its groups) and starts it again as shard K of the new N, so that the
shards cover the data once. A pod whose ordinal is past the new count is being scaled away: it keeps
running until the StatefulSet deletes it. SIGTERM to this process goes to the generator, and this
process exits with the generator's code.

Pure core (:func:`pod_identity`, :func:`replicas_of`, :func:`generator_argv`, :func:`next_action`), a thin
shell (:func:`read_replicas`: stdlib urllib with the in-cluster token and CA; :func:`supervise`; :func:`main`).
``STREAMGRPO_DRY_RUN=1`` prints the generator's command, one argument per line, instead of running it
(as the images' entrypoints do).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

log = logging.getLogger("streamgrpo.k8s_generator")

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
POLL_S = 60.0
STOP_GRACE_S = 110.0  # under the pod's terminationGracePeriodSeconds (120)


class K8sError(Exception):
    """A one-line reason this pod cannot tell its shard."""


# ======================================================================================== pure core
def pod_identity(pod_name: str) -> tuple[str, int]:
    """The StatefulSet and the ordinal of one of its pods: ``streamgrpo-generator-3`` -> (``streamgrpo-generator``, 3)."""
    m = re.fullmatch(r"([a-z0-9]([-a-z0-9]*[a-z0-9])?)-([0-9]+)", pod_name or "")
    if m is None:
        raise K8sError(f"pod name {pod_name!r} is not <statefulset>-<ordinal>: run this in a StatefulSet's pod "
                       "(POD_NAME from the downward API, or the pod's hostname)")
    return m.group(1), int(m.group(3))


def replicas_of(statefulset: dict) -> int:
    """``spec.replicas`` of a StatefulSet as the API returns it (Kubernetes' default: 1)."""
    replicas = (statefulset.get("spec") or {}).get("replicas", 1)
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
        raise K8sError(f"the StatefulSet's spec.replicas is {replicas!r}, not a count")
    return replicas


def generator_argv(args: Sequence[str], ordinal: int, replicas: int) -> list[str]:
    """``streamgrpo``'s argv for shard ``ordinal`` of ``replicas``: ``generator ARGS --id K --set
    rollout.num_generators=N`` (last, so they win over any ``--set`` in ARGS)."""
    for a in args:
        if a == "--id" or a.startswith("--id="):
            raise K8sError("--id is the pod's ordinal here: remove it from the container's args")
    if not 0 <= ordinal < replicas:
        raise K8sError(f"pod ordinal {ordinal} is not below the StatefulSet's {replicas} replicas: "
                       "the pod is being scaled away")
    return ["generator", *args, "--id", str(ordinal), "--set", f"rollout.num_generators={replicas}"]


def next_action(running: int, polled: int | None, ordinal: int) -> str:
    """What a running generator (shard ``ordinal`` of ``running``) does after a poll of ``spec.replicas``
    (None: the API did not answer): ``keep`` or ``restart`` (as shard ``ordinal`` of ``polled``). A pod past
    the new count keeps running: the StatefulSet deletes it."""
    if polled is None or polled == running or ordinal >= polled:
        return "keep"
    return "restart"


# ======================================================================================== thin shell
class Api:
    """The Kubernetes API as a pod reaches it: ``KUBERNETES_SERVICE_HOST``/``_PORT``, the service account's
    token and CA, and its namespace (the files Kubernetes mounts in ``SERVICE_ACCOUNT_DIR``)."""

    def __init__(self, env: dict[str, str], sa_dir: str | Path = SERVICE_ACCOUNT_DIR):
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise K8sError("KUBERNETES_SERVICE_HOST is not set: this runs in a Kubernetes pod")
        self.base = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        sa = Path(sa_dir)
        try:
            self.token = (sa / "token").read_text().strip()
            self.namespace = (sa / "namespace").read_text().strip()
            self.context = ssl.create_default_context(cafile=str(sa / "ca.crt"))
        except (OSError, ssl.SSLError) as exc:
            raise K8sError(f"no service account credentials in {sa} ({exc.__class__.__name__}: {exc}): "
                           "the pod needs automountServiceAccountToken") from None

    def get(self, path: str) -> dict:
        req = urllib.request.Request(self.base + path, headers={"Authorization": f"Bearer {self.token}",
                                                               "Accept": "application/json"})
        try:
            with urllib.request.urlopen(req, context=self.context, timeout=10) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            hint = (": give the pod's service account a Role that may get it (deploy/k8s/21-generators.yaml)"
                    if exc.code in (401, 403) else "")
            raise K8sError(f"Kubernetes API GET {path}: HTTP {exc.code} {exc.reason}{hint}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            raise K8sError(f"Kubernetes API at {self.base} did not answer GET {path}: {reason}") from None


def read_replicas(api: Api, statefulset: str) -> int:
    """``spec.replicas`` of ``statefulset`` in the pod's namespace."""
    return replicas_of(api.get(f"/apis/apps/v1/namespaces/{api.namespace}/statefulsets/{statefulset}"))


def supervise(start: Callable[[int], subprocess.Popen], replicas: int, ordinal: int,
              poll: Callable[[], int], *, poll_s: float = POLL_S, stop_grace_s: float = STOP_GRACE_S) -> int:
    """Run ``start(N)`` (the generator as shard ``ordinal`` of N); every ``poll_s`` read N again with ``poll``
    and restart the generator when it changed (:func:`next_action`). SIGTERM/SIGINT go to the generator;
    returns its exit code once it ends on its own or after such a signal."""
    state: dict = {"stopping": False, "child": None}

    def forward(signum, _frame):
        state["stopping"] = True
        if state["child"] is not None:
            state["child"].send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        state["child"] = start(replicas)
        if state["stopping"]:
            state["child"].terminate()
        while True:
            try:
                return state["child"].wait(timeout=None if state["stopping"] else poll_s)
            except subprocess.TimeoutExpired:
                pass
            try:
                polled = poll()
            except K8sError as exc:
                log.warning("%s; keeping %d generators", exc, replicas)
                polled = None
            if next_action(replicas, polled, ordinal) != "restart" or state["stopping"]:
                continue
            log.info("the StatefulSet has %d replicas, not %d: restarting generator %d as shard %d of %d",
                     polled, replicas, ordinal, ordinal, polled)
            child = state["child"]
            child.terminate()
            try:
                child.wait(timeout=stop_grace_s)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            if state["stopping"]:  # a SIGTERM came while it stopped: do not start another
                return child.returncode
            replicas = polled
            state["child"] = start(replicas)
            if state["stopping"]:  # a SIGTERM between the two: it went to the generator that had ended
                state["child"].terminate()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m streamgrpo.commands.k8s_generator", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument("--poll-s", type=float, default=POLL_S,
                   help="seconds between reads of the StatefulSet's replicas (0: never read again)")
    p.add_argument("--service-account-dir", default=SERVICE_ACCOUNT_DIR, help="token, ca.crt and namespace")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    opts, rest = build_parser().parse_known_args(argv)
    env = dict(os.environ)
    try:
        statefulset, ordinal = pod_identity(env.get("POD_NAME") or env.get("HOSTNAME") or socket.gethostname())
        api = Api(env, opts.service_account_dir)
        replicas = read_replicas(api, statefulset)
        args = generator_argv(rest, ordinal, replicas)
    except K8sError as exc:
        print(f"k8s_generator: {exc}", file=sys.stderr)
        return 2
    if env.get("STREAMGRPO_DRY_RUN") == "1":
        print("\n".join(["streamgrpo", *args]))
        return 0

    def start(n: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "streamgrpo", *generator_argv(rest, ordinal, n)]
        log.info("generator %d of %d: %s", ordinal, n, " ".join(cmd))
        return subprocess.Popen(cmd)

    if opts.poll_s <= 0:
        os.execv(sys.executable, [sys.executable, "-m", "streamgrpo", *args])
    return supervise(start, replicas, ordinal, lambda: read_replicas(api, statefulset), poll_s=opts.poll_s)


if __name__ == "__main__":
    sys.exit(main())
