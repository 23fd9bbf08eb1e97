"""The ``weights`` section: how weight versions reach the generators."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from streamgrpo.sections import Section


class WeightsConfig(Section):
    bind_host: str = "127.0.0.1"
    """Interface the learner binds the weight sockets to (0.0.0.0 to reach other machines; use CURVE keys then)."""
    connect_host: str = "127.0.0.1"
    """Host generators connect to for weights (the learner's address)."""
    pub_port: int = Field(5555, ge=0, le=65535)
    """PUB port for new versions (0 = pick a free one; `up` passes it on)."""
    snapshot_port: int = Field(5556, ge=0, le=65535)
    """ROUTER port serving the latest complete version to late joiners."""
    chunk_mib: float = Field(8.0, gt=0.0, le=1024.0)
    """Chunk size of one multipart weight message."""
    sync_every: int = Field(1, ge=1)
    """Publish weights every this many optimizer steps."""
    curve_keys_dir: Optional[str] = None
    """Directory made by `streamgrpo keys`: enables CURVE encryption and client authorisation."""
    sndhwm: int = Field(64, ge=1)
    """Minimum PUB high-water mark in messages; raised automatically to hold two versions (a subscriber that falls further behind repairs through the snapshot endpoint)."""
    digest: Literal["xxh3_128", "sha256"] = "xxh3_128"
    """Hash of every chunk of a version (its meta says which): xxh3_128 (fast; needs the xxhash package on subscribers) or sha256 (the standard library's, for subscribers written without xxhash; several times slower on the learner and every subscriber)."""
    transport: Literal["tcp", "ipc", "shm"] = "tcp"
    """How generators reach the weights: tcp (any host); ipc (unix sockets in <run_dir>/ipc: generators on the learner's host; the learner listens on TCP as well); shm (as ipc, but each version's bytes are read from the learner's shared-memory file in shm_dir instead of being sent: no socket copy at all)."""
    shm_dir: str = "/dev/shm"
    """transport=shm: the directory (a tmpfs) where the learner keeps its version files, which the generators on its host map. With relay, the relay's files and its unix sockets (a private folder here): a socket's path may have 107 bytes, so keep this path short."""
    delta: bool = False
    """Send a version as its difference to the previous one (positions and new values of the 16-bit words that changed) when that is at most delta_max_ratio of its bytes, else whole; subscribers apply it bit for bit, check the full version's digests, and fetch the snapshot when they missed the version it applies to. Costs the learner one comparison pass per version and each TCP subscriber one more payload of host memory; for generators (or relays) on other hosts."""
    delta_max_ratio: float = Field(0.5, gt=0.0, le=1.0)
    """With delta: the largest delta sent, as a share of the full version's bytes (early in training, or at high learning rates, versions go out whole)."""
    relay: bool = False
    """Generators take versions from their host's relay (`streamgrpo relay`; a generator starts one when none runs, and another when it dies) through shared memory in shm_dir and unix sockets in a private folder there, instead of from the learner: the learner sends each version once per host whatever the number of generators there. The relay subscribes to the learner with this section's connect_host, ports, keys and delta; one relay per learner address and host (runs with other learners get their own)."""
    relay_metrics_port: int = Field(0, ge=0, le=65535)
    """Port of the relay's own /metrics (never a generator's metrics.port, which the generators of its host use): 0 = a free one, written to <run_dir>/ports/relay-<host>.json."""
    send_frozen: bool = False
    """Also send frozen parameters with every version (they never change, and generators load them from the same checkpoint; LoRA mode sends adapters only either way)."""
    host_buffers: int = Field(3, ge=2, le=16)
    """Pinned host buffers of the learner's CUDA export (one version each, pinned once at the first publish): the latest version, the one going out, one spare."""
    io_threads: int = Field(1, ge=1, le=64)
    """ZeroMQ I/O threads of the learner's weight sockets (more help when many subscribers pull at once on a many-core host)."""
    warn_every_s: float = Field(30.0, gt=0.0)
    """Generator: while it has never received weights, and whenever the learner refuses its connection (CURVE key not authorised, wrong server key, CURVE on one side only), log a WARNING with the reason this often (checked between batches; counted in streamgrpo_errors_total{kind="weights_missing"|"weights_refused"})."""
    max_wait_s: Optional[float] = Field(600.0, ge=0.0)
    """Generator: give up (one-line error, exit code 3) when no weights have arrived this many seconds after its model and engine are ready; meanwhile it keeps generating with its initial weights (v0). 0 or null: wait forever. Once a version has arrived it never gives up."""
