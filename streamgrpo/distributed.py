"""The few collectives the learner needs when it runs as several ranks (torchrun / deepspeed launcher).

Every function here is a no-op-shaped identity for a single process, so the learner loop calls
them unconditionally. Nothing is pickled: small per-rank values travel as float64 tensors in
"slots" (rank r writes row r of a zero matrix, one SUM all-reduce gives every rank every row), and
JSON records as padded uint8 tensors.

Launch environment (set by torchrun / the deepspeed launcher): ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``. Backend: NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from streamgrpo.runtime import free_port

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands among the learner ranks."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        """True when a process group spans several ranks."""
        return self.world_size > 1

    @classmethod
    def from_env(cls) -> DistInfo:
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                   int(os.environ.get("LOCAL_RANK", 0)))


def init_distributed(backend: str, timeout_s: float = 3600.0) -> DistInfo:
    """Join the process group the launcher describes (nothing to do for one process).

    ``backend`` is the learner backend: ``deepspeed`` may span ranks; ``torch`` must run alone.
    """
    info = DistInfo.from_env()
    if info.world_size <= 1 and backend != "deepspeed":
        return info
    if backend != "deepspeed":
        raise RuntimeError(
            f"WORLD_SIZE={info.world_size} but learner.backend={backend!r}: several learner ranks need "
            "learner.backend=deepspeed (the torch backend is one process)"
        )
    import torch.distributed as dist

    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:  # one DeepSpeed process started without a launcher
            os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
                               "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(info.local_rank)
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
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


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, set):
        return sorted(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
