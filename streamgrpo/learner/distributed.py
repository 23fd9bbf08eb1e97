"""The few collectives the learner needs when it runs as several ranks (torchrun / deepspeed launcher).

Every function here is a no-op-shaped identity for a single process, so the learner loop calls
them unconditionally. Small per-rank values travel as float64 tensors in "slots" (rank r writes row r of a
zero matrix, one SUM all-reduce gives every rank every row), and JSON records as padded uint8 tensors; only a
sequence-parallel group's batch is pickled, from its reader to its other ranks (:class:`ReadLayout`,
:func:`hand_out`).

Launch environment (set by torchrun / the deepspeed launcher): ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, and the ranks on this host (``LOCAL_WORLD_SIZE``
from torchrun, ``LOCAL_SIZE`` from the deepspeed launcher; without either, ``WORLD_SIZE``).

Backend (``learner.dist_backend``, :func:`plan_ranks`): ``auto`` takes NCCL only when CUDA is
visible and there is a device for every rank on this host, and then gives rank ``r`` GPU
``LOCAL_RANK``; otherwise gloo, with every rank on the CPU (no ``cuda.set_device`` past the device
count, and DeepSpeed told so: ``DS_ACCELERATOR=cpu`` unless set). ``nccl`` insists (an error when
the devices do not go round); ``gloo`` keeps the ranks on their GPUs when they go round.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from streamgrpo.runtime.processes import free_port

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands among the learner ranks."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: str = ""
    """Where this rank trains, as :func:`init_distributed` chose it (``cuda:<local rank>`` or ``cpu``); empty
    when it chose nothing (one torch-backend process, or a process group started elsewhere)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        """True when a process group spans several ranks."""
        return self.world_size > 1

    def train_device(self) -> torch.device:
        """A DeepSpeed rank's device: :attr:`device`; without it its local GPU when CUDA is visible, else the CPU."""
        if self.device:
            return torch.device(self.device)
        return torch.device("cuda", self.local_rank) if torch.cuda.is_available() else torch.device("cpu")

    @classmethod
    def from_env(cls) -> DistInfo:
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                   int(os.environ.get("LOCAL_RANK", 0)))


@dataclass(frozen=True)
class ReadLayout:
    """Which learner ranks read groups from the queue, with ``learner.sequence_parallel`` N (pure).

    The ranks form sequence-parallel groups of N consecutive ranks (:func:`streamgrpo.models.ulysses.new_groups`),
    ``world_size / N`` data-parallel replicas. The ranks of a group train the same groups, so only its first rank
    (its *reader*) is a queue consumer that takes groups: its replica's share of a step, which it hands to the
    group's other ranks; it alone commits them, writes their audit rows and counts them. Every rank marks the groups
    it steps for the crash-loop breaker; the reader judges the marks of the group's ranks. N = 1: every rank reads
    its own share."""

    rank: int = 0
    world_size: int = 1
    sequence_parallel: int = 1

    def __post_init__(self) -> None:
        n = self.sequence_parallel
        if n < 1 or self.world_size % n or not 0 <= self.rank < self.world_size:
            raise ValueError(f"learner.sequence_parallel={n} needs a multiple of {n} learner ranks (rank "
                             f"{self.rank} of {self.world_size})")

    @property
    def replicas(self) -> int:
        """Data-parallel replicas: ranks / sequence_parallel."""
        return self.world_size // self.sequence_parallel

    @property
    def reader(self) -> int:
        """The rank that reads this rank's groups: the first of its sequence-parallel group."""
        return self.rank - self.rank % self.sequence_parallel

    @property
    def reads(self) -> bool:
        return self.rank == self.reader

    @property
    def helpers(self) -> list[int]:
        """A reader's other ranks (none for a non-reader, or N = 1): they train its groups, and it judges their deaths
        in a step for the crash-loop breaker (their marks are of its groups)."""
        return list(range(self.rank + 1, self.rank + self.sequence_parallel)) if self.reads else []

    def share(self, groups_per_step: int) -> int:
        """Groups this rank takes from the queue each step: its replica's share (none for a non-reader)."""
        return groups_per_step // self.replicas if self.reads else 0


def hand_out(batch: list | None, layout: ReadLayout, group: Any) -> list:
    """The reader's ``batch`` on every rank of its sequence-parallel group (``group``: its process group; every
    rank of the group calls it). Pickled (``broadcast_object_list``): the learner's own accepted groups, their
    processor inputs already made, or their ids, between its own ranks."""
    if layout.sequence_parallel == 1:
        return batch
    import torch.distributed as dist

    box = [batch if layout.reads else None]
    dist.broadcast_object_list(box, src=layout.reader, group=group)
    return box[0]


DIST_BACKENDS = ("auto", "nccl", "gloo")


@dataclass(frozen=True)
class RankPlan:
    """The process group's backend, and whether this host's ranks each take a GPU."""

    backend: str
    cuda: bool
    warning: str | None = field(default=None, compare=False)
    """One line for the log when ``auto`` falls back to gloo on the CPU although CUDA is visible."""


def plan_ranks(requested: str, *, cuda_available: bool, device_count: int, local_world_size: int) -> RankPlan:
    """``learner.dist_backend`` -> the backend and devices of this host's ranks (pure; see the module docstring)."""
    if requested not in DIST_BACKENDS:
        raise ValueError(f"learner.dist_backend={requested!r}: expected one of {', '.join(DIST_BACKENDS)}")
    fits = cuda_available and device_count >= local_world_size
    if requested == "nccl" and not fits:
        raise RuntimeError(f"learner.dist_backend=nccl needs a CUDA device for each of the {local_world_size} learner "
                           f"rank(s) on this host, and {device_count} are visible (use auto or gloo)")
    if requested == "auto":
        why = None
        if cuda_available and not fits:
            why = (f"learner.dist_backend=auto: {local_world_size} learner rank(s) on this host and {device_count} "
                   "visible CUDA device(s): every rank trains on the CPU with gloo (give each rank a GPU, or set "
                   "learner.dist_backend=nccl to make this an error)")
        return RankPlan("nccl" if fits else "gloo", fits, why)
    return RankPlan(requested, fits)


def local_world_size(env: Mapping[str, str]) -> int:
    """Learner ranks on this host: ``LOCAL_WORLD_SIZE`` (torchrun), ``LOCAL_SIZE`` (deepspeed launcher), else
    ``WORLD_SIZE`` (an upper bound that every rank reads alike, so that they all choose the same backend)."""
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "WORLD_SIZE"):
        if env.get(key):
            return int(env[key])
    return 1


def init_distributed(backend: str, timeout_s: float = 3600.0, dist_backend: str = "auto",
                     sequence_parallel: int = 1) -> DistInfo:
    """Join the process group the launcher describes (nothing to do for one process).

    ``backend`` is the learner backend: ``deepspeed`` may span ranks; ``torch`` runs alone, or as the ranks of one
    sequence-parallel group (``sequence_parallel``: ``learner.sequence_parallel`` equal to the ranks).
    ``dist_backend``: ``learner.dist_backend`` (:func:`plan_ranks`).
    """
    info = DistInfo.from_env()
    if info.world_size <= 1 and backend != "deepspeed":
        return info
    if backend != "deepspeed" and info.world_size != sequence_parallel:
        raise RuntimeError(
            f"WORLD_SIZE={info.world_size} but learner.backend={backend!r}: several learner ranks need "
            "learner.backend=deepspeed (the torch backend is one process, or one sequence-parallel group: "
            f"learner.sequence_parallel={info.world_size})"
        )
    import torch.distributed as dist

    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:  # one DeepSpeed process started without a launcher
            os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
                               "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
        visible = torch.cuda.is_available()
        plan = plan_ranks(dist_backend, cuda_available=visible, device_count=torch.cuda.device_count() if visible else 0,
                          local_world_size=local_world_size(os.environ))
        if plan.warning and info.rank == 0:
            log.warning("%s", plan.warning)
        if plan.cuda:
            torch.cuda.set_device(info.local_rank)
        elif visible and "DS_ACCELERATOR" not in os.environ:  # else DeepSpeed puts rank r on cuda:r regardless
            os.environ["DS_ACCELERATOR"] = "cpu"
            log.info("learner ranks on the CPU (gloo): DS_ACCELERATOR=cpu")
        dist.init_process_group(plan.backend, timeout=datetime.timedelta(seconds=timeout_s))
        info = replace(info, device=f"cuda:{info.local_rank}" if plan.cuda else "cpu")
    for handler in logging.getLogger().handlers:  # tell the ranks' interleaved log lines apart
        fmt = getattr(handler.formatter, "_fmt", None) or "%(levelname)s %(name)s: %(message)s"
        if "[rank " not in fmt:
            handler.setFormatter(logging.Formatter(fmt.replace("%(name)s", f"[rank {info.rank}] %(name)s"),
                                                   getattr(handler.formatter, "datefmt", None)))
    log.info("learner rank %d of %d (local rank %d, %s)", info.rank, info.world_size, info.local_rank,
             dist.get_backend())
    return info


def _device() -> torch.device:
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def share(info: DistInfo, values: list[float] | np.ndarray) -> np.ndarray:
    """Every rank's ``values`` as a (world_size, k) array, with one SUM all-reduce.

    All ranks must pass the same number of values. Exact for integers up to 2**53.
    """
    row = np.asarray(values, dtype=np.float64).reshape(-1)
    if not info.active:
        return row[None, :]
    import torch.distributed as dist

    slots = torch.zeros((info.world_size, row.size), dtype=torch.float64, device=_device())
    slots[info.rank] = torch.from_numpy(row).to(slots.device)
    dist.all_reduce(slots, op=dist.ReduceOp.SUM)
    return slots.cpu().numpy()


def gather_json(info: DistInfo, obj: Any) -> list[Any]:
    """Every rank's JSON-able ``obj``, in rank order (two collectives: the sizes, then the bytes)."""
    if not info.active:
        return [obj]
    import torch.distributed as dist

    data = np.frombuffer(json.dumps(obj, default=_json_default).encode(), dtype=np.uint8)
    sizes = share(info, [data.size])[:, 0].astype(np.int64)
    buf = torch.zeros((info.world_size, int(sizes.max())), dtype=torch.uint8, device=_device())
    buf[info.rank, : data.size] = torch.from_numpy(data.copy()).to(buf.device)
    dist.all_reduce(buf, op=dist.ReduceOp.SUM)  # each row is written by one rank only
    rows = buf.cpu().numpy()
    return [json.loads(rows[r, : sizes[r]].tobytes()) for r in range(info.world_size)]


def broadcast_json(info: DistInfo, obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    return gather_json(info, obj if info.is_main else None)[0]


def barrier(info: DistInfo) -> None:
    if info.active:
        import torch.distributed as dist

        dist.barrier()


def shutdown(info: DistInfo) -> None:
    """Leave the process group (after the last collective)."""
    if info.active:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


# What a collective raises when another rank is gone (killed, crashed, stopped by torchrun) or the transport between
# the ranks broke: gloo's "Connection closed by peer" / "Connection reset by peer", NCCL's remote errors and aborted
# communicators, the TCP store's refused connections, a collective timed out waiting for a rank that never came.
_PEER_FAILURE = re.compile(
    r"gloo|nccl|connection (closed|reset|refused)|broken pipe|closed by peer|remote process exited|"
    r"communicator was aborted|watchdog|timed out|process group|processgroup|tcpstore|socket timeout",
    re.IGNORECASE)


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (raised by a training step on a rank of several) is a collective's failure: another rank's
    death or the transport between ranks, not the groups this rank trains. torch's distributed errors by type; gloo
    and NCCL errors that torch raises as plain RuntimeErrors by their message."""
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    return isinstance(exc, (RuntimeError, ConnectionError, TimeoutError)) and bool(_PEER_FAILURE.search(str(exc)))


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, set):
        return sorted(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
