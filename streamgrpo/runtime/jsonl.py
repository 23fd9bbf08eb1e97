"""The run directory's JSON and JSONL files: written atomically or a line at a time, read as they grow, and
rewound to a checkpoint's step on resume."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger("streamgrpo.runtime")


def _default(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, set):
        return sorted(obj)
    return str(obj)


def write_json(path: str | Path, data: Any) -> None:
    """Write JSON atomically (readers never see half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)


class JsonlWriter:
    """Append-only JSON lines, flushed per line (``metrics.jsonl``, audit logs)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps(record, default=_default) + "\n")

    def close(self) -> None:
        self._fh.close()


def read_new_lines(path: Path, offset: int, rows: list[dict[str, Any]]) -> int:
    """Append the whole JSON lines of ``path`` past byte ``offset`` to ``rows`` (a line still being
    written waits for the next call; a malformed one is skipped); returns the new offset."""
    if not path.exists():
        return offset
    with open(path) as fh:
        fh.seek(offset)
        while True:
            line = fh.readline()
            if not line or not line.endswith("\n"):
                break
            offset += len(line.encode())
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return offset


def rewind_jsonl(path: str | Path, step: int) -> int:
    """Drop the lines of ``path`` whose ``step`` is after ``step`` (and a torn last line), in place
    and atomically; lines without a step stay. Returns how many lines were dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    keep, dropped = [], 0
    for line in path.read_text().splitlines(keepends=True):
        try:
            row = json.loads(line) if line.endswith("\n") else None
        except ValueError:
            row = None
        if not isinstance(row, dict) or (isinstance(row.get("step"), int) and row["step"] > step):
            dropped += 1
            continue
        keep.append(line)
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(keep))
        os.replace(tmp, path)
    return dropped


def read_rows(path: str | Path | None) -> tuple[list[dict[str, Any]], int]:
    """``(the JSON objects of a JSON-lines file, how many non-blank lines were not one)``: a line cut short by a
    process killed mid-write is skipped and counted. A missing file (or None): no rows."""
    p = Path(path) if path is not None else None
    if p is None or not p.is_file():
        return [], 0
    rows, bad = [], 0
    with p.open(encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if isinstance(row, dict):
                rows.append(row)
            else:
                bad += 1
    return rows, bad
