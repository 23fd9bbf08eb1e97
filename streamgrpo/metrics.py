"""Prometheus metrics shared by every streamgrpo process (what they mean: docs/design.md, "Metrics").

Import the metric objects from here; never create a second metric with one of these names. Each
process calls :func:`serve` once to expose ``/metrics`` and ``/healthz``. Labels are low
cardinality by construction: ``fn`` (reward function), ``role`` (learner/generator), ``event``,
``reason``, ``side``, ``stat``, ``kind``, ``outcome``.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from streamgrpo.config import ConfigError
from streamgrpo.runtime.jsonl import write_json

log = logging.getLogger(__name__)

_UNIT = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
_SECONDS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

# No negative bucket bound: prometheus_client drops a histogram's `_sum` when its first bound is
# negative, and the dashboard's mean reward is rate(_sum)/rate(_count). Negative rewards count in le=0.
REWARD = Histogram(
    "streamgrpo_reward", "Reward per completion, by function (fn=total is the weighted sum)", ["fn"],
    buckets=(*_UNIT, 1.5, 2.0, 5.0),
)
KL = Gauge("streamgrpo_kl", "Mean k3 KL to the reference model in the last step")
LOSS = Gauge("streamgrpo_loss", "Loss of the last optimizer step")
GRAD_NORM = Gauge("streamgrpo_grad_norm", "Gradient norm before clipping, last step")
ENTROPY = Gauge("streamgrpo_entropy", "Mean token entropy of the policy on trained completions, last step")
CLIP_FRACTION = Gauge("streamgrpo_clip_fraction", "Fraction of tokens clipped, by side (low/high/total)", ["side"])
IMPORTANCE_RATIO = Gauge("streamgrpo_importance_ratio", "Importance ratio statistics of the last step", ["stat"])
OFF_POLICY = Gauge(
    "streamgrpo_off_policy",
    "Off-policy health of the last step: ess (effective sample size fraction of the importance weights), "
    "kl_behaviour (KL(behaviour || current), k3), is_masked_frac (tokens masked by loss.is_mask)",
    ["stat"],
)
POLICY_VERSION = Gauge("streamgrpo_policy_version", "Policy version held by this process", ["role"])
STALENESS = Histogram(
    "streamgrpo_staleness_steps", "Learner version minus group version at training time",
    buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
)
QUEUE_DEPTH = Gauge("streamgrpo_queue_depth", "Groups in the stream not yet acknowledged by the learner")
GROUPS = Counter("streamgrpo_groups", "Groups by event (produced, consumed, trained)", ["event"])
GROUPS_DROPPED = Counter(
    "streamgrpo_groups_dropped",
    "Groups dropped, by reason (stale, rolled_back, mismatch, duplicate, malformed, invalid, poison, nan_loss, "
    "media_missing, media_outside, media_mismatch, size_mismatch)",
    ["reason"],
)
TOKENS = Counter("streamgrpo_tokens", "Completion tokens generated (generator) or trained (learner)", ["role"])
WEIGHT_SYNC_SECONDS = Histogram(
    "streamgrpo_weight_sync_seconds", "Seconds from publish to applied on a generator", buckets=_SECONDS
)
WEIGHT_BYTES = Counter("streamgrpo_weight_bytes", "Weight bytes published or received")
WEIGHT_VERSIONS = Counter("streamgrpo_weight_versions", "Learner: versions sent on PUB, whole "
                          "(kind=full) or as the delta to the previous one (kind=delta)", ["kind"])
WEIGHT_VERSION_BYTES = Counter("streamgrpo_weight_version_bytes", "Learner: bytes of the versions "
                               "sent on PUB, by kind (full, delta); each subscriber receives them once", ["kind"])
WEIGHT_DELTA_RATIO = Gauge("streamgrpo_weight_delta_ratio", "Publisher: delta bytes / full bytes of the last version "
                           "encoded as a delta (above weights.delta_max_ratio it went out whole)")
WEIGHT_SUBSCRIBERS = Gauge("streamgrpo_weight_subscribers", "Publisher (learner or relay): connections on its PUB "
                           "socket now (the learner's fan-out: one per relay or directly connected generator)")
RELAY_VERSIONS = Counter("streamgrpo_relay_versions", "Relay: versions received from the learner and re-published "
                         "to its host's generators through shared memory")
WEIGHT_DELTAS = Counter("streamgrpo_weight_deltas", "Subscriber: deltas received, by result (applied; no_base: it did "
                        "not hold the version the delta applies to, and fetched the snapshot; lost: a chunk missing "
                        "or damaged on the way; corrupt: it did not apply or check)", ["result"])
for _result in ("applied", "no_base", "lost", "corrupt"):  # exported at 0 from the start: a dashboard shows "none yet"
    WEIGHT_DELTAS.labels(result=_result)
for _kind in ("full", "delta"):
    WEIGHT_VERSIONS.labels(kind=_kind)
    WEIGHT_VERSION_BYTES.labels(kind=_kind)
UPDATE_KL = Gauge(
    "streamgrpo_update_kl",
    "How far the last optimizer step moved the policy on its own completions (mean per-token k3 KL, old to new, "
    "as applied); measured only with learner.max_update_kl",
)
UPDATES_SHRUNK = Counter(
    "streamgrpo_updates_shrunk",
    "Optimizer steps the learner.max_update_kl line search halved (outcome=halved) or undid (outcome=undone)",
    ["outcome"],
)
UPDATE_KL.set(float("nan"))  # not measured unless learner.max_update_kl is set: never a false 0
AGREEMENT_KL = Gauge(
    "streamgrpo_learner_agreement_kl",
    "KL(behaviour || learner) (k3) on tokens sampled with the learner's current weights (staleness 0), token-weighted "
    "over the last learner.agreement_window steps that had any: the generator = learner agreement (bf16 engines "
    "0.0004-0.01); NaN until such a token is seen",
)
AGREEMENT_KL.set(float("nan"))  # no staleness-0 token seen yet: never a false 0
AGREEMENT_MAX_KL = Gauge("streamgrpo_learner_agreement_max_kl",
                         "learner.agreement_max_kl: the agreement KL past which the roles are said to disagree")
AGREEMENT_STALE_KL = Gauge(
    "streamgrpo_learner_agreement_stale_kl",
    "KL(behaviour || learner) (k3) of the last step's tokens of each staleness bucket (0, 1, 2, 3+): steady per "
    "bucket while the generators compute the learner's policy (the live guard compares it with its history)",
    ["staleness"],
)
AGREEMENT_LOG_RATIO = Gauge(
    "streamgrpo_learner_agreement_log_ratio",
    "Mean log-ratio (learner minus behaviour log-prob) of the last step's tokens of each staleness bucket: about "
    "minus the KL under agreement; generators whose log-probs are off by d move it by -d",
    ["staleness"],
)
AGREEMENT_DRIFT = Gauge(
    "streamgrpo_learner_agreement_drift",
    "1 while a staleness bucket's KL or log-ratio is off its own history (the live agreement guard warned), else 0",
    ["staleness"],
)
AGREEMENT_WARNINGS = Counter(
    "streamgrpo_learner_agreement_warnings",
    "Warnings of the live agreement guard: staleness=0 the exact check (learner.agreement_max_kl), 1/2/3+ a "
    "bucket off its own history",
    ["staleness"],
)
STEP_SECONDS = Gauge("streamgrpo_step_seconds", "Wall seconds of the last learner step (train part)")
LEARNER_TOKENS_PER_SECOND = Gauge(
    "streamgrpo_learner_tokens_per_second", "Prompt + completion tokens per second of the last learner step (train part)"
)
LEARNER_MFU = Gauge(
    "streamgrpo_learner_mfu",
    "Model FLOPs utilisation of the last learner step: model FLOPs / (step seconds x peak FLOP/s of the learner "
    "devices); NaN when a device's peak is unknown (a CPU without learner.peak_tflops)",
)
LEARNER_MFU.set(float("nan"))  # unknown until a learner step with a known peak: never a false 0
IDLE_SECONDS = Counter("streamgrpo_idle_seconds", "Seconds spent waiting (learner for groups, generator on backpressure)", ["role"])
ERRORS = Counter("streamgrpo_errors", "Errors by kind (data, reward, wire, queue, weights, loss, ...)", ["kind"])
BACKPRESSURE = Gauge("streamgrpo_backpressure", "1 while this producer is blocked because the queue is full")
REDIS_FULL_WAITS = Counter(
    "streamgrpo_redis_full_waits", "Redis commands refused at maxmemory and retried, by operation (put, hold, commit, "
    "release, dead_letter, failure, group_create, sync_claim)", ["op"])
REDIS_FULL = Gauge("streamgrpo_redis_full", "1 while this process waits because Redis is at maxmemory")
MEDIA_CACHE = Counter("streamgrpo_media_cache", "Learner: referenced visuals by decoded-frame cache result (hit, miss)",
                      ["result"])
VISION_CACHE = Counter("streamgrpo_vision_cache", "HF generator: visuals by vision-feature cache result (hit, miss)",
                       ["result"])
VISION_CACHE_BYTES = Gauge("streamgrpo_vision_cache_bytes", "HF generator: bytes of vision features kept (rollout.vision_cache_mib)")
MEDIA_DECODE_SECONDS = Histogram(
    "streamgrpo_media_decode_seconds", "Learner: seconds to decode and resize one referenced visual (cache misses)",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
MEDIA_WAIT_SECONDS = Counter("streamgrpo_media_wait_seconds",
                             "Learner: seconds steps waited for referenced visuals to decode (0 while decoding is hidden)")
EVAL_ACCURACY = Gauge("streamgrpo_eval_accuracy",
                      "Evaluator: held-out accuracy at the last evaluated version, by question kind (all: every record) "
                      "and frame order (ordered, shuffled)", ["kind", "frames"])
EVAL_REWARD = Gauge("streamgrpo_eval_reward", "Evaluator: mean held-out reward at the last evaluated version, by function "
                    "(total: the weighted sum)", ["fn"])
EVAL_FORMAT = Gauge("streamgrpo_eval_format_compliance", "Evaluator: share of held-out completions in the right format")
EVAL_TOKENS = Gauge("streamgrpo_eval_completion_tokens", "Evaluator: mean held-out completion length in tokens")
EVAL_VERSION = Gauge("streamgrpo_eval_version", "Evaluator: the weight version its last results are for")
EVAL_SKIPPED = Counter("streamgrpo_eval_versions_skipped", "Evaluator: weight versions not evaluated (between "
                       "eval.every_versions, or superseded while it was busy)")
WEIGHTS_MISSING = Gauge(
    "streamgrpo_weights_missing", "1 while this generator has never received weights from the learner (it samples with its initial ones)"
)
DATA_EPOCHS = Gauge(
    "streamgrpo_data_epochs", "Generator: passes over its data shard so far, epoch + the fraction of the current one "
    "taken (a restarted generator goes on from the learner's committed data cursor)"
)

# Gauges of the whole learner step, set by rank 0 from the step's merged numbers. With several
# ranks, every rank serves /metrics (rank r on metrics.port + its local rank) and Prometheus sums
# their counters (groups, tokens, drops, idle seconds: each rank counts its own); ranks > 0 do not
# export these gauges at all, since a second series at 0 would be averaged or summed into the panels.
STEP_GAUGES = (LOSS, KL, GRAD_NORM, ENTROPY, STEP_SECONDS, LEARNER_TOKENS_PER_SECOND, LEARNER_MFU, UPDATE_KL)


def drop_step_gauges() -> None:
    """A learner rank > 0: stop exporting :data:`STEP_GAUGES` (rank 0 exports the step's)."""
    for gauge in STEP_GAUGES:
        try:
            REGISTRY.unregister(gauge)
        except KeyError:  # already dropped
            pass


class _Handler(BaseHTTPRequestHandler):
    health = None  # callable returning (ok: bool, text: str)
    timeout = 5.0  # seconds a connection may stay silent (socket timeout): half-open ones are closed

    def do_GET(self) -> None:  # noqa: N802 (http.server API)
        if self.path.startswith("/metrics"):
            body = generate_latest(REGISTRY)
            self._send(200, body, CONTENT_TYPE_LATEST)
        elif self.path.startswith("/healthz"):
            ok, text = (True, "ok") if _Handler.health is None else _Handler.health()
            self._send(200 if ok else 503, text.encode(), "text/plain")
        else:
            self._send(404, b"not found", "text/plain")

    def _send(self, code: int, body: bytes, ctype: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt: str, *args) -> None:  # silence per-request logs
        return


class _BoundedServer(ThreadingHTTPServer):
    """One thread per connection, at most ``max_connections`` at once: a connection beyond that is closed
    at once (counted), so a flood of connections cannot take the process's threads and descriptors."""

    daemon_threads = True
    max_connections = 32
    request_queue_size = 128  # listen backlog: a burst is accepted (then served or closed), not left in SYN

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(self.max_connections)
        self.refused = 0
        self.hung_up = 0  # clients gone before their reply was written

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address):
        """A scraper that hung up before its reply was written (a scrape timeout on a loaded host) is counted,
        not printed: socketserver's default prints a traceback into the process's log."""
        if isinstance(sys.exc_info()[1], ConnectionError):  # BrokenPipe, ConnectionReset, ConnectionAborted
            self.hung_up += 1
            return
        super().handle_error(request, client_address)


class MetricsServer:
    """``/metrics`` + ``/healthz`` on a daemon thread. ``port=0`` picks a free port (see ``.port``).
    Connections time out after :attr:`_Handler.timeout` seconds of silence, and at most
    :attr:`_BoundedServer.max_connections` are served at once (metrics.host may be 0.0.0.0)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, health=None):
        _Handler.health = health
        self._httpd = _BoundedServer((host, port), _Handler)
        self._httpd.daemon_threads = True
        self.host = host
        self.port = self._httpd.server_address[1]
        # serve_forever looks at its stop flag every poll interval: close() waits that long (0.5 s by default)
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="metrics-http", daemon=True)
        self._thread.start()
        log.info("metrics on http://%s:%d/metrics", host, self.port)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def serve(host: str = "127.0.0.1", port: int = 0, health=None) -> MetricsServer:
    return MetricsServer(host, port, health)


class MetricsPortTaken(ConfigError):
    """A fixed metrics port that another process on this host already serves (one line, no traceback)."""


def start_metrics(mcfg, run_dir: Path, role: str, health=None, hint: str | None = None):
    """Serve /metrics and /healthz on ``metrics.host:port`` (a :class:`~streamgrpo.config.MetricsConfig`);
    record the port in ``<run_dir>/ports/<role>.json``. A fixed port that is taken raises
    :class:`MetricsPortTaken` saying so in one line (``hint``: how this role gets another)."""
    try:
        server = serve(mcfg.host, mcfg.port, health=health)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        raise MetricsPortTaken(
            f"{role}: metrics port {mcfg.port} on {mcfg.host} is taken by another process on this host: "
            f"{hint or 'set metrics.port=0 (a free port)'}; each process's port is written to "
            f"{run_dir / 'ports'}") from None
    write_json(run_dir / "ports" / f"{role}.json", {"metrics": server.port, "pid": os.getpid(), "started": time.time()})
    log.info("%s: metrics on port %d", role, server.port)
    return server
