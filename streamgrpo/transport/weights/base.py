"""The weight-sync interface: how new policy versions get from the learner to the generators.

Two small abstract classes, one per side, and one implementation per backend (today: ZeroMQ over
TCP or, for generators on the learner's host, ``ipc://``; see :mod:`.publisher`), built from a config
by :mod:`.factory` (the only reader of ``weights.transport``). The learner and the generator loops see only these methods::

    sync = publisher_from_config(cfg.weights, run_dir)              # learner rank 0
    sync.publish(version, named_tensors, dtype=torch.bfloat16)   # returns once the bytes are safe to overwrite
    ...
    client = subscriber_from_config(cfg.weights, run_dir, client_key) # each generator
    got = client.request_snapshot(10.0)              # late joiner: the latest version now
    got = client.poll()                              # (version, tensors) or None, between batches
    if got: engine.load_weights(*got); client.mark_applied()
    client.status()                                  # WeightsStatus: why no weights arrive, in one line
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

import torch

from streamgrpo.transport.weights.layout import TensorSpec, specs_of


class VersionWriter(ABC):
    """One version being written (ZeRO-3 writes it bucket by bucket, as partitions are gathered)."""

    @abstractmethod
    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one tensor in (cast to its spec's dtype); a CUDA tensor is copied asynchronously."""

    @abstractmethod
    def sync(self) -> None:
        """Wait until every tensor written so far has been copied (then its memory may be freed)."""

    @abstractmethod
    def commit(self) -> None:
        """Every tensor is written: the version may go out whole. The tensors may be modified afterwards."""

    @abstractmethod
    def abort(self) -> None:
        """Give the version up (it is never sent)."""


class WeightSync(ABC):
    """Learner side: publish versions; serve the latest one to late joiners."""

    @abstractmethod
    def begin(self, version: int, specs: Sequence[TensorSpec], *, cuda: bool = False) -> VersionWriter:
        """Start a version whose tensors are described by ``specs``."""

    def publish(self, version: int, tensors: Mapping[str, torch.Tensor], *, dtype: torch.dtype | None = None) -> None:
        """Send ``tensors`` as ``version`` (floating ones cast to ``dtype`` when given). Returns once the
        tensors may be overwritten; the sending goes on in the background, and a newer version
        replaces one not yet started."""

        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"weights: version must be an integer >= 0, got {version!r}")
        specs = specs_of(tensors, dtype)
        writer = self.begin(version, specs, cuda=any(t.is_cuda for t in tensors.values()))
        try:  # in the payload's byte order (largest elements first), so chunks go out as they are written
            for s in sorted(specs, key=lambda s: -s.dtype.itemsize):
                writer.write(s.name, tensors[s.name])
            writer.commit()
        except BaseException:
            writer.abort()
            raise

    @property
    @abstractmethod
    def latest_version(self) -> int | None:
        """The newest version fully handed over (the one late joiners get)."""

    @abstractmethod
    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every published version has been handed over; False on timeout."""

    @abstractmethod
    def close(self, timeout_s: float = 5.0) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class WeightsState(str, Enum):
    """Where a generator's weight channel stands (worst first)."""

    AUTH_REFUSED = "auth_refused"  # the learner refused this generator's CURVE key
    HANDSHAKE_FAILED = "handshake_failed"  # connected, but the security handshake failed (keys, CURVE vs plain)
    UNREACHABLE = "unreachable"  # no connection: nothing listens there, host unreachable, or connection lost
    CONNECTING = "connecting"  # the first attempts are still under way
    WAITING = "waiting"  # connected to the learner; no version received yet
    OK = "ok"  # connected, and a version received


@dataclass(frozen=True)
class WeightsStatus:
    """:meth:`WeightSyncClient.status`: a state, one line for humans, and the newest version received."""

    state: WeightsState
    reason: str
    version: int | None = None  # newest complete version received (None: none yet)

    @property
    def refused(self) -> bool:
        """The learner is there but will not talk to us (keys, security settings): retrying alone will not help."""
        return self.state in (WeightsState.AUTH_REFUSED, WeightsState.HANDSHAKE_FAILED)

    def __str__(self) -> str:
        return f"{self.state.value}: {self.reason}"


class WeightSyncClient(ABC):
    """Generator side: the newest complete, verified version, whole or not at all."""

    @abstractmethod
    def poll(self, timeout_s: float = 0.0) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest verified version not returned yet, waiting up to ``timeout_s``; else None."""

    @abstractmethod
    def request_snapshot(self, timeout_s: float = 10.0) -> tuple[int, dict[str, torch.Tensor]] | None:
        """Ask for the latest version now and wait for it (late joiners, restarts)."""

    @abstractmethod
    def mark_applied(self, release: bool = True) -> float | None:
        """The last returned version is in use; returns publish-to-applied seconds."""

    @property
    @abstractmethod
    def version(self) -> int | None: ...

    @abstractmethod
    def status(self) -> WeightsStatus:
        """Why weights do (not) arrive now: refused, unreachable, waiting for a first version, or ok."""

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
