"""Records: LLaVA-style JSON/JSONL and local Hugging Face ``datasets``, parsed into :class:`Record`.

A LLaVA record::

    {"id": "r1",
     "conversations": [{"from": "human", "value": "<video>\\n<video>\\nWhich video ...?"},
                       {"from": "gpt", "value": "<think>...</think> <answer>(2)</answer>"}],
     "video": "a.mp4" | ["a.mp4", "b.mp4"], "image": "x.png" | [...],
     "meta": {"frame_cnts": [15, 11], "min_frames": 4, "max_frames": 8, "dynamic_sample": true,
              "kind": "multi_video"}}

* The ground truth (``Record.answer``) is the gpt turn, or its ``<answer>`` content when tagged
  (the tag name is ``data.answer_tag``); ``Record.solution`` keeps the whole gpt turn.
* ``<video>`` / ``<image>`` placeholders are matched in order with the ``video`` / ``image``
  lists; a count mismatch is a :class:`DataError`. A question with no placeholder at all gets one
  per media item prepended (videos first), as R1-V / Video-R1 style data has none.
* Media paths are relative to ``data.media_root`` (default: the records file's directory) unless
  absolute. ``turn`` keys ``from``/``value`` and ``role``/``content`` both work; ``human``/``user``
  and ``gpt``/``assistant`` are synonyms.
* Per-record ``meta`` overrides (validated here): ``fps``, ``min_frames``, ``max_frames``,
  ``dynamic_sample``, ``frame_cnts``, ``min_pixels``, ``max_pixels``, ``total_pixels``; ``kind``
  tags the question family (``data.kinds`` filters on it).

Bad records never stop a load: :func:`read_records` returns the good records and one
:class:`DataError` per bad one; :func:`load_records` logs each bad one once and counts it in
``streamgrpo_errors_total{kind="data"}``.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streamgrpo.config import DataConfig
from streamgrpo.metrics import ERRORS
from streamgrpo.rewards.extract import truth_text

log = logging.getLogger(__name__)

PLACEHOLDER_RE = re.compile(r"<video>|<image>")
_HUMAN = {"human", "user"}
_GPT = {"gpt", "assistant", "bot", "model"}
_INT_META = ("min_frames", "max_frames", "min_pixels", "max_pixels", "total_pixels")


class DataError(ValueError):
    """A record or one of its media files cannot be used; names the record id and the path.

    ``kind`` is a short machine label for reports: ``bad_record``, ``no_answer``,
    ``placeholder_mismatch``, ``missing_file``, ``unreadable_video``, ``zero_frames``,
    ``bad_image``, ``budget``, ``too_long``, ``outside_media_root``, ``not_a_file``.
    """

    def __init__(self, record_id: str | None, path: str | os.PathLike | None, message: str, kind: str = "bad_record"):
        self.record_id = record_id
        self.path = None if path is None else str(path)
        self.reason = message
        self.kind = kind
        where = f"record {record_id!r}" if record_id is not None else "record"
        if self.path:
            where += f" ({self.path})"
        super().__init__(f"{where}: {message}")


class DataFileNotFound(DataError):
    """The records file or data set directory (``data.train_path``, ``--data``...) does not exist."""

    def __init__(self, path: str | os.PathLike, what: str = "data file"):
        super().__init__(None, path, f"{what} not found", kind="missing_file")
        self.args = (f"{what} not found: {self.path}",)  # no "record (...)": the whole file is missing


def require_data_path(path: str | os.PathLike) -> Path:
    """``path`` (``~`` expanded); :class:`DataFileNotFound` if absent."""
    path = Path(os.path.expanduser(str(path)))
    if not path.exists():
        raise DataFileNotFound(path)
    return path


@dataclass
class Record:
    """One prompt: question with placeholders, ground truth, resolved media paths, meta."""

    id: str
    question: str  # human turn, with one <video>/<image> placeholder per media item, in order
    answer: str  # ground truth: the <answer> content of the gpt turn when tagged, else the turn
    solution: str  # the full gpt turn
    videos: list[str] = field(default_factory=list)  # resolved paths, in <video> order
    images: list[str] = field(default_factory=list)  # resolved paths, in <image> order
    meta: dict[str, Any] = field(default_factory=dict)
    kind: str | None = None
    source: str = ""  # "file:line" (or "file#index") the record came from, for messages

    def media(self) -> list[tuple[str, str]]:
        """``(kind, path)`` for every placeholder of the question, in order."""
        vids, imgs = iter(self.videos), iter(self.images)
        return [("video", next(vids)) if m.group() == "<video>" else ("image", next(imgs))
                for m in PLACEHOLDER_RE.finditer(self.question)]


# ----------------------------------------------------------------------------------- parsing
def ground_truth(gpt_turn: str, answer_tag: str = "answer") -> str:
    """The content of the last complete ``<answer_tag>`` block of the gpt turn, else the stripped turn."""
    return truth_text(gpt_turn, answer_tag)


def _as_list(value: Any, what: str, rid: str, where: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) and v for v in value):
        return list(value)
    raise DataError(rid, where, f"{what!r} must be a path or a list of paths, got {value!r}")


def resolve_path(path: str, media_root: str | os.PathLike) -> str:
    """``path`` if absolute, else joined to ``media_root`` (``~`` expanded)."""
    p = Path(os.path.expanduser(path))
    return str(p if p.is_absolute() else Path(media_root) / p)


def default_media_root(cfg: DataConfig) -> str:
    """The directory relative media paths of ``cfg.train_path`` resolve against: ``data.media_root``,
    else the records file's directory (a ``datasets`` directory itself)."""
    if cfg.media_root:
        return os.path.abspath(os.path.expanduser(cfg.media_root))
    path = Path(os.path.expanduser(cfg.train_path)).absolute()
    return str(path if path.is_dir() else path.parent)


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def ref_path(path: str, cfg: DataConfig, root: str | None = None) -> str | None:
    """How a generator names the media file ``path`` in a reference: relative to its media root
    (``root``, else :func:`default_media_root`). None for a file the learner would refuse (one that lies
    outside that root once symlinks are resolved, see :func:`ref_file`) or that only this machine has
    (extracted from a ``datasets`` row into the local cache): those travel inline."""
    full = os.path.normpath(os.path.abspath(path))
    if _inside(full, os.path.normpath(str(_cache_dir() / "hf_media"))):
        return None
    root = os.path.normpath(root or default_media_root(cfg))
    real, real_root = os.path.realpath(full), os.path.realpath(root)
    if not _inside(real, real_root):
        return None
    return os.path.relpath(full, root) if _inside(full, root) else os.path.relpath(real, real_root)


def ref_file(path: str, cfg: DataConfig) -> str:
    """The local file a reference's ``path`` names, resolved (``os.path.realpath``): relative to this
    machine's media root (``data.media_root``, else the training file's folder), or absolute; either way
    it must lie inside that root once every symlink is resolved, so a reference never names any other
    file (``/proc/self/environ``, a link inside the root that points out of it). Raises ``ValueError``
    saying why a path is refused."""
    root = os.path.normpath(default_media_root(cfg))
    full = os.path.normpath(path if os.path.isabs(path) else os.path.join(root, path))
    real = os.path.realpath(full)
    if not _inside(real, os.path.realpath(root)):
        via = f" (a symlink: it resolves to {real})" if _inside(full, root) else ""
        raise ValueError(f"{path!r} lies outside data.media_root ({root}){via}")
    return real


def _check_meta(meta: Any, rid: str, where: str, n_videos: int) -> dict[str, Any]:
    if meta is None:
        return {}
    if not isinstance(meta, Mapping):
        raise DataError(rid, where, f"'meta' must be an object, got {type(meta).__name__}")
    meta = dict(meta)
    for key in _INT_META:
        if key in meta and meta[key] is not None:
            v = meta[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise DataError(rid, where, f"meta.{key} must be a positive integer, got {v!r}")
    if meta.get("fps") is not None:
        v = meta["fps"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise DataError(rid, where, f"meta.fps must be a positive number, got {v!r}")
    if meta.get("dynamic_sample") is not None and not isinstance(meta["dynamic_sample"], bool):
        raise DataError(rid, where, f"meta.dynamic_sample must be true/false, got {meta['dynamic_sample']!r}")
    lo, hi = meta.get("min_frames"), meta.get("max_frames")
    if lo is not None and hi is not None and lo > hi:
        raise DataError(rid, where, f"meta.min_frames ({lo}) > meta.max_frames ({hi})")
    cnts = meta.get("frame_cnts")
    if cnts is not None:
        if isinstance(cnts, int) and not isinstance(cnts, bool):
            cnts = meta["frame_cnts"] = [cnts]
        if not isinstance(cnts, list) or not all(isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in cnts):
            raise DataError(rid, where, f"meta.frame_cnts must be a list of positive integers, got {cnts!r}")
        if len(cnts) != n_videos:
            raise DataError(rid, where, f"meta.frame_cnts has {len(cnts)} entries for {n_videos} videos",
                            kind="placeholder_mismatch")
    return meta


def _turns(raw: Mapping[str, Any], rid: str, where: str) -> tuple[str, str]:
    """(question, gpt turn) of a LLaVA ``conversations`` list, or Video-R1 ``problem``/``solution``."""
    conv = raw.get("conversations", raw.get("messages"))
    if conv is None and "problem" in raw:
        question = str(raw["problem"])
        options = raw.get("options")
        if isinstance(options, list) and options:
            question += "\nOptions:\n" + "\n".join(str(o) for o in options)
        sol = raw.get("solution")
        if sol is None or not str(sol).strip():
            raise DataError(rid, where, "record has no 'solution' (no ground truth)", kind="no_answer")
        return question, str(sol)
    if not isinstance(conv, list) or not conv:
        raise DataError(rid, where, "record has no 'conversations' list")
    question = gpt = None
    for turn in conv:
        if not isinstance(turn, Mapping):
            raise DataError(rid, where, f"conversation turn is not an object: {turn!r}")
        who = str(turn.get("from", turn.get("role", ""))).lower()
        value = turn.get("value", turn.get("content"))
        if who in _HUMAN and question is None:
            question = value
        elif who in _GPT and question is not None and gpt is None:
            gpt = value
    if not isinstance(question, str):
        raise DataError(rid, where, "record has no human turn (the question)")
    if gpt is None or not isinstance(gpt, str) or not gpt.strip():
        raise DataError(rid, where, "record has no gpt turn (no ground truth)", kind="no_answer")
    return question, gpt


def parse_record(raw: Any, *, media_root: str | os.PathLike, answer_tag: str = "answer", where: str = "",
                 default_id: str | None = None, bounded: bool = False,
                 max_question_chars: int | None = None) -> Record:
    """One raw LLaVA (or Video-R1 ``problem``/``solution``) record -> :class:`Record`, or DataError.

    ``bounded`` (an explicit ``data.media_root``): a relative media path must stay inside ``media_root``
    (``../`` cannot climb out of it; an absolute path names its file itself); ``max_question_chars``: a
    longer question is refused (``too_long``)."""
    if not isinstance(raw, Mapping):
        raise DataError(default_id, where, f"record is not a JSON object but {type(raw).__name__}")
    rid = raw.get("id", raw.get("problem_id", default_id))
    rid = str(rid) if rid is not None else default_id
    question, gpt = _turns(raw, rid, where)
    if max_question_chars is not None and len(question) > max_question_chars:
        raise DataError(rid, where, f"question has {len(question):,} characters, over data.max_question_chars "
                        f"({max_question_chars:,})", kind="too_long")
    videos = _as_list(raw.get("video", raw.get("videos")), "video", rid, where)
    images = _as_list(raw.get("image", raw.get("images")), "image", rid, where)
    if not videos and not images and isinstance(raw.get("path"), str):  # Video-R1: path + data_type
        (images if raw.get("data_type") == "image" else videos).append(raw["path"])
    n_vid, n_img = question.count("<video>"), question.count("<image>")
    if n_vid == 0 and n_img == 0 and (videos or images):
        question = "<video>\n" * len(videos) + "<image>\n" * len(images) + question
    elif n_vid != len(videos) or n_img != len(images):
        raise DataError(
            rid, where,
            f"question has {n_vid} <video> and {n_img} <image> placeholders but the record lists "
            f"{len(videos)} videos and {len(images)} images",
            kind="placeholder_mismatch",
        )
    meta = _check_meta(raw.get("meta"), rid, where, len(videos))
    kind = meta.get("kind", raw.get("kind", raw.get("problem_type")))
    if bounded:
        root = os.path.normpath(os.path.abspath(os.path.expanduser(str(media_root))))
        for p in videos + images:
            if Path(os.path.expanduser(p)).is_absolute():
                continue
            full = os.path.normpath(os.path.abspath(resolve_path(p, media_root)))
            if os.path.commonpath([root, full]) != root:
                raise DataError(rid, where, f"media path {p!r} lies outside data.media_root ({root})",
                                kind="outside_media_root")
    return Record(
        id=rid,
        question=question,
        answer=ground_truth(gpt, answer_tag),
        solution=gpt,
        videos=[resolve_path(v, media_root) for v in videos],
        images=[resolve_path(i, media_root) for i in images],
        meta=meta,
        kind=None if kind is None else str(kind),
        source=where,
    )


# ----------------------------------------------------------------------------------- sources
def _iter_json(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, raw record or DataError) from a JSON array, one JSON object, ``{"data": [...]}`` or JSONL."""
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        data = exc
    if isinstance(data, Mapping):
        data = data.get("data", data.get("records", [data]))
    if isinstance(data, list):
        for i, raw in enumerate(data):
            yield f"{path}#{i}", raw
        return
    if isinstance(data, json.JSONDecodeError) and text.lstrip()[:1] == "[":
        raise DataError(None, path, f"not valid JSON: {data}")
    if not isinstance(data, json.JSONDecodeError):
        raise DataError(None, path, f"top level must be a list of records, got {type(data).__name__}")
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            yield where, json.loads(line)
        except json.JSONDecodeError as exc:
            yield where, DataError(None, where, f"line is not valid JSON: {exc.msg}")


def _is_hf(path: Path) -> bool:
    if path.is_dir():
        return any((path / n).exists() for n in ("dataset_info.json", "state.json", "dataset_dict.json")) or any(
            path.glob("*.parquet")) or any(path.glob("*/*.arrow")) or any(path.glob("*.arrow"))
    return path.suffix in (".parquet", ".arrow")


def _hf_dataset(path: Path):
    import datasets

    if path.is_dir() and any((path / n).exists() for n in ("dataset_info.json", "state.json", "dataset_dict.json")):
        ds = datasets.load_from_disk(str(path))
    elif path.is_dir():
        files = sorted(str(p) for p in path.glob("*.parquet"))
        ds = datasets.load_dataset("parquet", data_files=files, split="train") if files else \
            datasets.load_from_disk(str(path))
    elif path.suffix == ".parquet":
        ds = datasets.load_dataset("parquet", data_files=[str(path)], split="train")
    elif path.suffix in (".json", ".jsonl", ".csv"):  # flat question/answer columns (data.source: hf)
        ds = datasets.load_dataset(path.suffix.lstrip(".").replace("jsonl", "json"), data_files=[str(path)],
                                   split="train")
    else:
        ds = datasets.Dataset.from_file(str(path))
    if isinstance(ds, datasets.DatasetDict):
        split = "train" if "train" in ds else next(iter(ds))
        ds = ds[split]
    return ds


def _cache_dir() -> Path:
    return Path(os.environ.get("STREAMGRPO_CACHE", Path.home() / ".cache" / "streamgrpo"))


def _hf_media(value: Any, rid: str, where: str, what: str, store: Path) -> list[str]:
    """Paths for an HF media cell: a path, a list of paths, or embedded images (written once as PNG)."""
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    out = []
    for k, item in enumerate(items):
        if isinstance(item, str):
            if item:
                out.append(item)
            continue
        if isinstance(item, Mapping) and item.get("path") and not item.get("bytes"):
            out.append(str(item["path"]))
            continue
        data = item.get("bytes") if isinstance(item, Mapping) else None
        target = store / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', rid)}_{what}{k}.png"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_suffix(f".tmp{os.getpid()}")
            if data is not None:
                tmp.write_bytes(data)
            elif hasattr(item, "save"):  # a PIL image
                item.save(tmp, format="PNG")
            else:
                raise DataError(rid, where, f"{what} column holds {type(item).__name__}, not a path or image")
            os.replace(tmp, target)
        out.append(str(target))
    return out


def _iter_hf(path: Path, cfg: DataConfig) -> Iterator[tuple[str, Any]]:
    """(where, Record or DataError) for each row of a local HF data set, by the configured columns."""
    ds = _hf_dataset(path)
    media_root = cfg.media_root or (path if path.is_dir() else path.parent)
    cols = set(ds.column_names)
    for col in (cfg.hf_question_column, cfg.hf_answer_column):
        if col not in cols:
            raise DataError(None, path, f"HF data set has no column {col!r} (columns: {sorted(cols)})")
    store = _cache_dir() / "hf_media" / re.sub(r"[^A-Za-z0-9_.-]", "_", str(path.resolve()).strip("/"))
    if cfg.hf_image_column in cols:  # keep embedded images as bytes, not decoded PIL objects
        import datasets

        if isinstance(ds.features[cfg.hf_image_column], datasets.Image):
            ds = ds.cast_column(cfg.hf_image_column, datasets.Image(decode=False))
    for i, row in enumerate(ds):
        where = f"{path}#{i}"
        rid = str(row.get("id", row.get("problem_id", f"{path.name}:{i}")))
        try:
            videos = _hf_media(row.get(cfg.hf_video_column), rid, where, "video", store)
            images = _hf_media(row.get(cfg.hf_image_column), rid, where, "image", store)
            answer = row.get(cfg.hf_answer_column)
            if answer is None or not str(answer).strip():
                raise DataError(rid, where, f"empty answer column {cfg.hf_answer_column!r}", kind="no_answer")
            raw = {
                "id": rid,
                "conversations": [{"from": "human", "value": str(row.get(cfg.hf_question_column) or "")},
                                  {"from": "gpt", "value": str(answer)}],
                "video": videos,
                "image": images,
                "meta": row.get("meta") if isinstance(row.get("meta"), Mapping) else None,
                "kind": row.get("kind"),
            }
            yield where, parse_record(raw, media_root=media_root, answer_tag=cfg.answer_tag, where=where,
                                      max_question_chars=cfg.max_question_chars)
        except DataError as exc:
            yield where, exc


def _source_kind(path: Path, cfg: DataConfig) -> str:
    if cfg.source != "auto":
        return cfg.source
    return "hf" if _is_hf(path) else "llava"


def iter_raw(path: str | os.PathLike, cfg: DataConfig) -> Iterator[Record | DataError]:
    """Every record of ``path`` in file order: a :class:`Record` or the :class:`DataError` it raised."""
    path = require_data_path(path)
    if _source_kind(path, cfg) == "hf":
        for _where, item in _iter_hf(path, cfg):
            yield item
        return
    media_root = cfg.media_root or path.parent
    for i, (where, raw) in enumerate(_iter_json(path)):
        if isinstance(raw, DataError):
            yield raw
            continue
        try:
            yield parse_record(raw, media_root=media_root, answer_tag=cfg.answer_tag, where=where,
                               default_id=f"{path.stem}-{i}", bounded=cfg.media_root is not None,
                               max_question_chars=cfg.max_question_chars)
        except DataError as exc:
            yield exc


def read_records(path: str | os.PathLike, cfg: DataConfig) -> tuple[list[Record], list[DataError]]:
    """Good records (filtered by ``data.kinds``) and one DataError per bad record; no logging."""
    records: list[Record] = []
    errors: list[DataError] = []
    seen: set[str] = set()
    for item in iter_raw(path, cfg):
        if isinstance(item, DataError):
            errors.append(item)
        elif item.id in seen:
            errors.append(DataError(item.id, item.source, "duplicate record id"))
        else:
            seen.add(item.id)
            if cfg.kinds is None or item.kind in cfg.kinds:
                records.append(item)
    return records, errors


def load_records(path: str | os.PathLike, cfg: DataConfig) -> list[Record]:
    """The usable records of ``path``; each bad one is logged once and counted (errors kind=data)."""

    records, errors = read_records(path, cfg)
    for err in errors:
        log.warning("skipping %s", err)
        ERRORS.labels(kind="data").inc()
    if not records:
        raise DataError(None, path, f"no usable records ({len(errors)} bad"
                        + (f", data.kinds={cfg.kinds}" if cfg.kinds else "") + ")")
    return records
