"""``streamgrpo data check FILE``: validate every record up front and print a report.

Checks per record: it parses (human and gpt turns, placeholders match the media lists, meta
types), every file exists and the sampled frames decode (the real pipeline: probe, sample,
resize within the pixel budget), and the ground truth is something the rewards can score
(:func:`streamgrpo.rewards.classify_answer`: choice, actions, numeric or text, not empty).
Warnings (no effect on the exit code): ``meta.frame_cnts`` that disagree with the file, videos
shorter than ``min_frames`` (frames repeat), frame counts cut below ``min_frames`` by the budget.

Output: one ``ERROR``/``WARN`` line per problem (kind, record id, path, message), then a summary
table. Exit code 1 when any record has an error, unless ``allow_errors``.
"""

from __future__ import annotations

import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TextIO

from streamgrpo.config import DataConfig
from streamgrpo.data.records import DataError, Record, read_records
from streamgrpo.data.video import load_visuals, sampling_params


@dataclass
class RecordReport:
    record_id: str
    order: int
    videos: int = 0
    images: int = 0
    frames: int = 0
    pixels: int = 0
    answer_kind: str = ""
    error: DataError | None = None
    warnings: list[tuple[str, str]] = field(default_factory=list)  # (path, message)


def _classify(record: Record, cfg: DataConfig) -> str:
    try:
        from streamgrpo.rewards import classify_answer
    except ImportError:  # pragma: no cover - the rewards package ships with streamgrpo
        return "text" if record.answer.strip() else "empty"
    return classify_answer(record.answer, record.question, cfg.answer_tag)


def check_record(record: Record, cfg: DataConfig, order: int = 0, factor: int = 28,
                 temporal_patch: int = 2) -> RecordReport:
    """Load one record through the real pipeline and classify its answer."""
    rep = RecordReport(record.id, order)
    try:
        visuals = load_visuals(record, cfg, factor, temporal_patch)
    except DataError as exc:
        rep.error = exc
        return rep
    params = sampling_params(record, cfg)
    cnts = params["frame_cnts"]
    video_no = 0
    for (kind, path), v in zip(record.media(), visuals):
        rep.frames += v.frames.shape[0]
        rep.pixels += v.frames.shape[0] * v.frames.shape[1] * v.frames.shape[2]
        if kind == "image":
            rep.images += 1
            continue
        rep.videos += 1
        total = int(v.frame_indices[-1]) + 1
        if cnts and cnts[video_no] != total:
            rep.warnings.append((path, f"meta.frame_cnts says {cnts[video_no]} frames, the file has {total}"))
        if total < params["min_frames"]:
            rep.warnings.append((path, f"video has {total} frames, fewer than min_frames={params['min_frames']} "
                                       "(frames repeat)"))
        elif v.frames.shape[0] < min(params["min_frames"], total) - 1:
            rep.warnings.append((path, f"total_pixels budget cut the sample to {v.frames.shape[0]} frames"))
        video_no += 1
    rep.answer_kind = _classify(record, cfg)
    if rep.answer_kind == "empty":
        rep.error = DataError(record.id, record.source, "ground truth is empty: no reward can score it",
                              kind="no_answer")
    return rep


def _progress(total: int, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return None
    return tqdm(total=total, desc=desc, unit="rec", file=sys.stderr, leave=False, dynamic_ncols=True)


def run_check(path: str, cfg: DataConfig, workers: int = 1, allow_errors: bool = False, *, factor: int = 28,
              temporal_patch: int = 2, out: TextIO | None = None) -> int:
    """Check every record of ``path``; print problems and a summary to ``out`` (stdout); exit code."""
    out = out or sys.stdout
    try:
        records, parse_errors = read_records(path, cfg)
    except DataError as exc:
        print(f"ERROR {exc.kind} {exc}", file=out)
        return 1
    except (OSError, ValueError) as exc:
        print(f"ERROR bad_file {path}: {exc}", file=out)
        return 1
    bar = _progress(len(records), "data check")

    def one(item: tuple[int, Record]) -> RecordReport:
        rep = check_record(item[1], cfg, item[0], factor, temporal_patch)
        if bar is not None:
            bar.update(1)
        return rep

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        reports = list(pool.map(one, enumerate(records)))
    if bar is not None:
        bar.close()

    errors = list(parse_errors) + [r.error for r in reports if r.error is not None]
    for err in errors:
        print(f"ERROR {err.kind} {err}", file=out)
    n_warn = 0
    for rep in reports:
        for wpath, msg in rep.warnings:
            n_warn += 1
            print(f"WARN  record {rep.record_id!r} ({wpath}): {msg}", file=out)

    ok = [r for r in reports if r.error is None]
    by_kind = Counter(e.kind for e in errors)
    answers = Counter(r.answer_kind for r in ok)
    kinds = Counter((rec.kind or "-") for rec, r in zip(records, reports) if r.error is None)
    n_total = len(records) + len(parse_errors)
    rows = [
        ("file", str(path)),
        ("records", f"{n_total} ({len(ok)} ok, {len(errors)} with errors)"),
        ("videos", str(sum(r.videos for r in ok))),
        ("images", str(sum(r.images for r in ok))),
        ("frames", f"{sum(r.frames for r in ok)} sampled (fps={cfg.fps}, frames {cfg.min_frames}-{cfg.max_frames})"),
        ("pixels", f"{max((r.pixels for r in ok), default=0)} max per sample (budget {cfg.total_pixels})"),
        ("answers", ", ".join(f"{k} {v}" for k, v in sorted(answers.items())) or "-"),
        ("kinds", ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())) or "-"),
        ("errors", f"{len(errors)}" + (": " + ", ".join(f"{k} {v}" for k, v in sorted(by_kind.items()))
                                       if by_kind else "")),
        ("warnings", str(n_warn)),
    ]
    print("", file=out)
    print("data check summary", file=out)
    for name, value in rows:
        print(f"  {name:<9} {value}", file=out)
    if errors and not allow_errors:
        print(f"FAILED: {len(errors)} records with errors (use --allow-errors to accept)", file=out)
        return 1
    if not ok:
        print("FAILED: no usable records", file=out)
        return 1
    print("OK" if not errors else f"OK with {len(errors)} errors allowed", file=out)
    return 0
