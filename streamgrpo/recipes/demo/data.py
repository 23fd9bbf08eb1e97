"""The synthetic demo data set: real mp4 files of a coloured square moving across a grey background.

``make_demo(out_dir, n=2000, seed=0, size=56, frames=8)`` writes::

    out_dir/videos/v_<colour>_<direction>_<start>.mp4   (libx264, 4 fps, size x size, `frames` frames)
    out_dir/images/i_<colour>_<direction>_<start>.png   (the middle frame)
    out_dir/train.jsonl  test.jsonl                    (n and max(10, n // 10) records)
    out_dir/train_image.jsonl  test_image.jsonl        (the colour questions on the PNG instead)

Question kinds (``meta.kind``):

* ``colour``: "What colour is the moving square?" ``(A) red (B) green (C) blue`` (fixed order);
  ground truth e.g. ``<answer>(B) green</answer>``.
* ``direction``: "Which direction does the square move?" ``(A) left (B) right (C) up (D) down``.
* ``numeric``: "In what percentage of the frames is the square's centre in the left half?" -> a
  number such as ``37.5``.
* ``multi_video``: 2-4 videos, exactly one with a red square: "Which video shows a red square?"
  ``(1) (2) (3)`` -> ``<answer>(2)</answer>``.

A clip is fully determined by (colour, direction, start): ``start`` = lane * 4 + phase, the lane
is the square's position across the motion (top/middle/bottom or left/middle/right), the phase
where along the motion it starts. Each distinct clip is written once and reused (3 colours x 4
directions x 12 starts = at most 144 files), so 2,000 records take a few seconds. Same seed, same
files and records.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from streamgrpo.recipes.demo.config import DemoConfig

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 30), "blue": (30, 30, 220)}
COLOUR_OPTIONS = "(A) red (B) green (C) blue"
DIRECTIONS = ("left", "right", "up", "down")
DIRECTION_OPTIONS = "(A) left (B) right (C) up (D) down"
BACKGROUND = 128
DEMO_FPS = 4
SQUARE = 28  # pixels at size=56: half the side (at 14 px the tiny model needed ~2x the steps to tell red from green)
KINDS = ("colour", "direction", "numeric", "multi_video")
KIND_WEIGHTS = (0.4, 0.2, 0.2, 0.2)
N_STARTS = 12
MOTIONS = ("mirror", "reverse")


def write_jsonl(path: str | os.PathLike, rows: Iterable[Mapping[str, Any]]) -> None:
    """Write rows as JSON lines (atomically: a temp file renamed into place)."""
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def trajectory(direction: str, start: int, size: int = 56, frames: int = 8, motion: str = "mirror") -> list[tuple[int, int]]:
    """Top-left ``(y, x)`` of the square in every frame of clip (direction, start).

    ``motion="mirror"``: a left (up) clip is the right (down) clip mirrored, so every clip ends at
    the edge it moves towards (the streak's position alone gives the direction away for phases > 0).
    ``motion="reverse"``: a left (up) clip is the right (down) clip played backwards, so the two show
    the same frames and only their order tells the direction (an order-blind model gets 0.5).
    """
    if motion not in MOTIONS:
        raise ValueError(f"motion must be one of {MOTIONS}, got {motion!r}")
    sq = max(2, round(size * SQUARE / 56))
    span = size - sq
    lane, phase = divmod(start, 4)
    across = [0, span // 2, span][lane]
    p0 = round(phase * span / 7)  # phases 0..3 start 0/7 .. 3/7 of the way along
    along = [round(p0 + (span - p0) * t / max(1, frames - 1)) for t in range(frames)]
    if direction in ("left", "up"):
        along = along[::-1] if motion == "reverse" else [span - a for a in along]
    if direction in ("left", "right"):
        return [(across, a) for a in along]
    return [(a, across) for a in along]


def render(colour: str, direction: str, start: int, size: int = 56, frames: int = 8, motion: str = "mirror") -> np.ndarray:
    """The clip as uint8 frames (T, size, size, 3)."""
    sq = max(2, round(size * SQUARE / 56))
    out = np.full((frames, size, size, 3), BACKGROUND, dtype=np.uint8)
    for t, (y, x) in enumerate(trajectory(direction, start, size, frames, motion)):
        out[t, y : y + sq, x : x + sq] = COLOURS[colour]
    return out


def left_half_percent(direction: str, start: int, size: int = 56, frames: int = 8, motion: str = "mirror") -> float:
    """Percentage of frames in which the square's centre is in the left half (the numeric answer)."""
    sq = max(2, round(size * SQUARE / 56))
    inside = sum(1 for _y, x in trajectory(direction, start, size, frames, motion) if x + sq / 2 < size / 2)
    return round(100.0 * inside / frames, 1)


def write_mp4(path: str | os.PathLike, frames_THWC: np.ndarray, fps: int = DEMO_FPS, codec: str = "libx264",
              gop: int | None = None) -> None:
    """Encode uint8 RGB frames to an mp4 with PyAV (one thread: same bytes every time)."""
    import av

    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}.mp4")
    try:
        with av.open(str(tmp), "w") as container:
            try:
                stream = container.add_stream(codec, rate=fps)
            except Exception:
                codec = "mpeg4"
                stream = container.add_stream(codec, rate=fps)
            stream.width, stream.height = int(frames_THWC.shape[2]), int(frames_THWC.shape[1])
            stream.pix_fmt = "yuv420p"
            stream.codec_context.thread_count = 1
            if gop:
                stream.codec_context.gop_size = gop
            if codec == "libx264":
                stream.codec_context.options = {"crf": "12", "preset": "ultrafast", "threads": "1"}
            else:
                stream.codec_context.bit_rate = 2_000_000
            for frame in frames_THWC:
                for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


class _Clips:
    """Writes each distinct clip (and its PNG) once; returns paths relative to the data set root."""

    def __init__(self, root: Path, size: int, frames: int, motion: str = "mirror"):
        self.root, self.size, self.frames, self.motion = root, size, frames, motion
        self.tag = "" if motion == "mirror" else "r"  # a reversed left/up clip never reuses a mirrored file
        (root / "videos").mkdir(parents=True, exist_ok=True)
        (root / "images").mkdir(parents=True, exist_ok=True)

    def video(self, colour: str, direction: str, start: int) -> str:
        rel = f"videos/v_{colour}_{direction}_{start}{self.tag}.mp4"
        if not (self.root / rel).exists():
            write_mp4(self.root / rel, render(colour, direction, start, self.size, self.frames, self.motion))
        return rel

    def image(self, colour: str, direction: str, start: int) -> str:
        from PIL import Image

        rel = f"images/i_{colour}_{direction}_{start}{self.tag}.png"
        if not (self.root / rel).exists():
            frame = render(colour, direction, start, self.size, self.frames, self.motion)[self.frames // 2]
            tmp = self.root / (rel + f".tmp{os.getpid()}.png")
            Image.fromarray(frame).save(tmp, format="PNG")
            os.replace(tmp, self.root / rel)
        return rel


def _turns(question: str, think: str, answer: str) -> list[dict[str, str]]:
    return [{"from": "human", "value": question},
            {"from": "gpt", "value": f"<think>{think}</think> <answer>{answer}</answer>"}]


def _record(rng: np.random.Generator, rid: str, clips: _Clips) -> tuple[dict, dict | None]:
    """One video record (and, for colour questions, its image twin)."""
    kind = KINDS[int(rng.choice(len(KINDS), p=KIND_WEIGHTS))]
    colour = list(COLOURS)[int(rng.integers(3))]
    direction = DIRECTIONS[int(rng.integers(4))]
    start = int(rng.integers(N_STARTS))
    meta = {"kind": kind}
    image_twin = None
    if kind == "colour":
        letter = "ABC"[list(COLOURS).index(colour)]
        q = f"What colour is the moving square? {COLOUR_OPTIONS}. Answer with the option letter."
        answer = f"({letter}) {colour}"
        think = f"The square is {colour}."
        row = {"id": rid, "conversations": _turns("<video>\n" + q, think, answer),
               "video": clips.video(colour, direction, start), "meta": meta}
        image_twin = {"id": rid + "-img", "conversations": _turns("<image>\n" + q, think, answer),
                      "image": clips.image(colour, direction, start), "meta": {"kind": "colour_image"}}
        return row, image_twin
    if kind == "direction":
        letter = "ABCD"[DIRECTIONS.index(direction)]
        q = f"Which direction does the square move? {DIRECTION_OPTIONS}. Answer with the option letter."
        row = {"id": rid, "conversations": _turns("<video>\n" + q, f"The square moves {direction}.",
                                                  f"({letter}) {direction}"),
               "video": clips.video(colour, direction, start), "meta": meta}
        return row, None
    if kind == "numeric":
        pct = left_half_percent(direction, start, clips.size, clips.frames, clips.motion)
        q = "In what percentage of the frames is the centre of the square in the left half? Answer with a number."
        value = f"{pct:g}"
        row = {"id": rid, "conversations": _turns("<video>\n" + q, f"I count the frames: {value}%.", value),
               "video": clips.video(colour, direction, start), "meta": meta}
        return row, None
    n_videos = int(rng.integers(2, 5))
    target = int(rng.integers(n_videos))
    videos = []
    for k in range(n_videos):
        c = "red" if k == target else ("green", "blue")[int(rng.integers(2))]
        videos.append(clips.video(c, DIRECTIONS[int(rng.integers(4))], int(rng.integers(N_STARTS))))
    options = " ".join(f"({k + 1})" for k in range(n_videos))
    q = "<video>\n" * n_videos + f"Which video shows a red square? {options}. Answer with the option number."
    meta["frame_cnts"] = [clips.frames] * n_videos
    row = {"id": rid, "conversations": _turns(q, f"Video {target + 1} shows red.", f"({target + 1})"),
           "video": videos, "meta": meta}
    return row, None


def make_demo(out_dir: str | os.PathLike, n: int = 2000, seed: int = 0, size: int = 56, frames: int = 8,
              motion: str = "mirror") -> Path:
    """Write the demo data set to ``out_dir`` (``n`` train records, ``max(10, n // 10)`` test); return it.

    ``motion``: how a left/up clip relates to its right/down twin (see :func:`trajectory`).
    """
    if n < 1 or size < 16 or size % 2 or frames < 1 or motion not in MOTIONS:
        raise ValueError(f"make_demo: need n >= 1, an even size >= 16, frames >= 1 and motion in {MOTIONS} "
                         f"(got {n}, {size}, {frames}, {motion!r})")
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".demo.lock", "w") as lock:  # several processes may start on a missing data set
        fcntl.flock(lock, fcntl.LOCK_EX)
        clips = _Clips(root, size, frames, motion)
        rng = np.random.default_rng(seed)
        for split, count in (("train", n), ("test", max(10, n // 10))):
            rows, image_rows = [], []
            for i in range(count):
                row, twin = _record(rng, f"{split}-{i:05d}", clips)
                rows.append(row)
                if twin is not None:
                    image_rows.append(twin)
            write_jsonl(root / f"{split}_image.jsonl", image_rows)
            write_jsonl(root / f"{split}.jsonl", rows)
    return root


def prepare_data(demo: DemoConfig, train_path: str | Path, seed: int = 0, say=None) -> bool:
    """Make the demo data set in ``train_path``'s directory when it is missing and ``demo.make_data``
    asks for it; True when it was made."""
    train = Path(train_path).expanduser()
    if train.exists() or not demo.make_data:
        return False
    if say:
        say(f"making the demo data set in {train.parent} ({demo.size} records) ...")
    make_demo(train.parent, n=demo.size, seed=seed, motion=demo.motion)
    return True
