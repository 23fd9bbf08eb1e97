"""Reads a wandb offline run's transaction log (``offline-run-*/run-<id>.wandb``) back into records.

wandb >= 0.20 writes its runs from a Go service and no longer ships a Python reader, so the tests
parse the file as wandb itself does: a 7-byte header (``:W&B``, a 2-byte magic, a version byte), then
LevelDB's log format (32 KiB blocks; each fragment a 7-byte head: CRC-32C, little-endian length,
type FULL/FIRST/MIDDLE/LAST; a block's tail shorter than a head is padding), each reassembled
record one ``wandb.proto.wandb_internal_pb2.Record``. Searching the raw bytes for a key instead is
wrong by chance: a key that straddles a block boundary has a fragment head in its middle.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32768
HEAD = 7  # checksum (4), length (2), type (1)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str | Path) -> list[Any]:
    """Every record of one ``.wandb`` file, in order (``wandb_internal_pb2.Record``)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a wandb transaction log (header {data[:4]!r})")
    out, parts, pos = [], [], HEAD
    while pos + HEAD <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEAD:  # the block's padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEAD])
        chunk = data[pos + HEAD : pos + HEAD + length]
        pos += HEAD + length
        if kind in (FULL, FIRST):
            parts = [chunk]
        elif kind in (MIDDLE, LAST):
            parts.append(chunk)
        else:  # zero-filled tail of a block
            continue
        if kind in (FULL, LAST):
            rec = pb.Record()
            rec.ParseFromString(b"".join(parts))
            out.append(rec)
    return out


def history(path: str | Path) -> list[dict[str, Any]]:
    """The rows logged with ``run.log`` (nested keys joined with ``/``), values JSON-decoded."""
    rows = []
    for rec in records(path):
        if rec.WhichOneof("record_type") == "history":
            rows.append({(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                         for item in rec.history.item})
    return rows


def run_config(path: str | Path) -> dict[str, Any]:
    """The config the run was started with (``wandb.init(config=...)``), values JSON-decoded."""
    for rec in records(path):
        if rec.WhichOneof("record_type") == "run":
            return {item.key: json.loads(item.value_json) for item in rec.run.config.update}
    raise ValueError(f"{path}: no run record")
