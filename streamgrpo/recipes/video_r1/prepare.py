"""Video-R1's JSON (Video-R1-260k, its eval sets) -> the JSONL the recipe's configs read.

A Video-R1 record (``problem_id``, ``problem``, ``problem_type``, ``options``, ``solution``, ``path``,
``data_type``) is read by streamgrpo as it is; this step only adds what Video-R1's trainer adds to the
prompt -- the options under the question and one sentence per problem type saying what to put in the
``<answer>`` tag -- and leaves out records whose media file is missing (a partial download), counting
them. Paths stay relative to ``--media-root`` (``data.media_root`` in the configs)::

    python -m streamgrpo.recipes.video_r1.prepare data/video_r1/Video-R1-260k.json \\
        --media-root data/video_r1 --out data/video_r1/train.jsonl

Pure core: :func:`prepare_record` (one record), :func:`prepare` (a list, with counts).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

PROBLEM_TYPES = ("multiple choice", "numerical", "OCR", "free-form", "regression")

ANSWER_INSTRUCTION = {
    "multiple choice": "Put only the letter of the right option (A, B, C, ...) in the <answer> </answer> tags.",
    "numerical": "Put only the number (for example 42 or 3.14) in the <answer> </answer> tags.",
    "OCR": "Write out the text shown in the image or video in the <answer> </answer> tags.",
    "free-form": "Put your answer as text in the <answer> </answer> tags.",
    "regression": "Put only the number (for example 42 or 3.14) in the <answer> </answer> tags.",
}
"""What the prompt asks for, per problem type (Video-R1 adds one such sentence to every prompt)."""


def prepare_record(raw: Mapping[str, Any]) -> dict[str, Any]:
    """One Video-R1 record with its options and answer instruction in ``problem`` (``options`` folded in).

    ValueError (naming the field) for a record that is not Video-R1's: no problem, solution or path, or a
    problem type outside :data:`PROBLEM_TYPES`."""
    for key in ("problem", "solution", "path", "problem_type"):
        if not isinstance(raw.get(key), str) or not raw[key].strip():
            raise ValueError(f"no {key!r}")
    kind = raw["problem_type"]
    if kind not in ANSWER_INSTRUCTION:
        raise ValueError(f"problem_type {kind!r} is none of {', '.join(PROBLEM_TYPES)}")
    question = raw["problem"].rstrip()
    options = raw.get("options")
    if kind == "multiple choice" and isinstance(options, list) and options:
        question += "\nOptions:\n" + "\n".join(str(o) for o in options)
    out = {k: v for k, v in raw.items() if k not in ("options", "process")}
    out["problem"] = f"{question}\n{ANSWER_INSTRUCTION[kind]}"
    out.setdefault("data_type", "video" if Path(raw["path"]).suffix.lower() in (".mp4", ".avi", ".mkv", ".webm",
                                                                                ".mov") else "image")
    return out


def prepare(records: Iterable[Any], media_root: str | os.PathLike, *,
            types: Iterable[str] | None = None, limit: int | None = None) -> tuple[list[dict], Counter]:
    """The prepared records whose media exists under ``media_root``, and counts: ``kept/<type>``,
    ``kept/<data_type>``, ``skipped/missing media``, ``skipped/<reason>``, ``skipped/type filter``."""
    wanted = set(types) if types else None
    root = Path(media_root)
    kept: list[dict] = []
    counts: Counter = Counter()
    for raw in records:
        if limit is not None and len(kept) >= limit:
            break
        try:
            rec = prepare_record(raw if isinstance(raw, Mapping) else {})
        except ValueError as exc:
            counts[f"skipped/{exc}"] += 1
            continue
        if wanted is not None and rec["problem_type"] not in wanted:
            counts["skipped/type filter"] += 1
            continue
        if not (root / rec["path"]).is_file():
            counts["skipped/missing media"] += 1
            continue
        kept.append(rec)
        counts[f"kept/{rec['problem_type']}"] += 1
        counts[f"kept/{rec['data_type']}"] += 1
    return kept, counts


def _read(path: Path) -> list[Any]:
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m streamgrpo.recipes.video_r1.prepare", description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="Video-R1's JSON (Video-R1-260k.json, or an eval set's eval_*.json)")
    p.add_argument("--media-root", required=True, help="the folder the records' paths are relative to")
    p.add_argument("--out", required=True, help="the JSONL to write (data.train_path / data.eval_path)")
    p.add_argument("--types", default=None, help=f"comma-separated problem types to keep (default: all of "
                   f"{', '.join(PROBLEM_TYPES)})")
    p.add_argument("--limit", type=int, default=None, help="keep at most this many records")
    args = p.parse_args(argv)
    try:
        records = _read(Path(args.source))
    except (OSError, ValueError) as exc:
        print(f"prepare: {args.source}: cannot read it as JSON: {exc}", file=sys.stderr)
        return 2
    types = [t.strip() for t in args.types.split(",")] if args.types else None
    kept, counts = prepare(records, args.media_root, types=types, limit=args.limit)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as fh:
        for rec in kept:
            fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
    print(f"{out}: {len(kept)} of {len(records)} records; " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return 0 if kept else 1


if __name__ == "__main__":
    sys.exit(main())
