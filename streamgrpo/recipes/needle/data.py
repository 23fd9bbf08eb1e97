"""The needle data set: long synthetic videos where the answer rests on one brief event.

Every video has ``frames`` frames (256 by default) of ``size`` x ``size`` pixels: a grey background and a
dark-grey square that drifts across the whole video (a distractor with no colour). Somewhere in it, at a
random time, a coloured square flashes for 4-8 frames (the *needle*); nothing else in the video is coloured.
The question: "What colour is the square that flashes? (A) red (B) green (C) blue", so a model that does not
find those frames gets 1/3 at best, and a model that samples 16 frames of the 256 misses the needle most of
the time.

``make_needle(out_dir, n=400, seed=0)`` writes::

    out_dir/videos/n_<index>.mp4            the video (libx264, 8 fps)
    out_dir/videos/n_<index>_cut.mp4        the same video with the needle's frames cut out
    out_dir/train.jsonl  test.jsonl          n and max(10, n // 10) records (``meta.needle``: [first, last + 1))
    out_dir/test_cut.jsonl                   the test records on the cut videos: the ablation

Rendering is pure (:func:`needle_spec`, :func:`render_needle`, :func:`cut_needle`); the same seed gives the
same records and frames.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from streamgrpo.recipes.demo.data import BACKGROUND, COLOUR_OPTIONS, COLOURS, write_jsonl, write_mp4

NEEDLE_FPS = 8
NEEDLE_LENGTHS = (4, 5, 6, 7, 8)
"""How many frames the needle lasts (drawn uniformly): 2-4 of the 128 video tokens. A model that samples 16 evenly
spaced frames of the 256 sees it in 24-47% of the videos."""
DISTRACTOR = 112
"""Grey level of the drifting square: no colour, and faint (the needle is the one strong signal in the video)."""
QUESTION = f"What colour is the square that flashes? {COLOUR_OPTIONS}. Answer with the option letter."


@dataclass(frozen=True)
class NeedleSpec:
    """One video: the needle's colour, first frame and length, and where the squares are."""

    colour: str
    start: int
    length: int
    frames: int
    size: int
    needle_yx: tuple[int, int]
    drift: tuple[int, int, int, int]  # distractor's (y0, x0, y1, x1): it moves linearly from one to the other

    @property
    def needle_frames(self) -> range:
        return range(self.start, self.start + self.length)


def square_sides(size: int) -> tuple[int, int]:
    """Sides of the needle (most of the frame) and of the distractor (a quarter)."""
    return max(2, round(size * 0.8)), max(2, size // 4)


def needle_spec(rng: np.random.Generator, frames: int = 256, size: int = 28) -> NeedleSpec:
    """Draw one video's layout (pure given ``rng``)."""
    if frames < 8 or size < 8 or size % 2:
        raise ValueError(f"needle video: need frames >= 8 and an even size >= 8 (got {frames}, {size})")
    needle, dist = square_sides(size)
    colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
    length = int(rng.choice(NEEDLE_LENGTHS))
    start = int(rng.integers(0, frames - length + 1))
    yx = (int(rng.integers(0, size - needle + 1)), int(rng.integers(0, size - needle + 1)))
    drift = tuple(int(v) for v in rng.integers(0, size - dist + 1, size=4))
    return NeedleSpec(colour, start, length, frames, size, yx, drift)


def render_needle(spec: NeedleSpec) -> np.ndarray:
    """The video as uint8 frames (T, size, size, 3): background, drifting distractor, the needle."""
    size, frames = spec.size, spec.frames
    needle, dist = square_sides(size)
    out = np.full((frames, size, size, 3), BACKGROUND, dtype=np.uint8)
    y0, x0, y1, x1 = spec.drift
    for t in range(frames):
        a = t / max(1, frames - 1)
        y, x = round(y0 + (y1 - y0) * a), round(x0 + (x1 - x0) * a)
        out[t, y : y + dist, x : x + dist] = DISTRACTOR
    ny, nx = spec.needle_yx
    out[spec.start : spec.start + spec.length, ny : ny + needle, nx : nx + needle] = COLOURS[spec.colour]
    return out


def cut_needle(frames_THWC: np.ndarray, spec: NeedleSpec) -> np.ndarray:
    """The video without the needle's frames (``spec.length`` frames shorter): the ablation."""
    keep = np.ones(len(frames_THWC), dtype=bool)
    keep[spec.start : spec.start + spec.length] = False
    return frames_THWC[keep]


def _record(rid: str, spec: NeedleSpec, video: str) -> dict:
    letter = "ABC"[list(COLOURS).index(spec.colour)]
    answer = f"({letter}) {spec.colour}"
    return {"id": rid, "video": video,
            "conversations": [{"from": "human", "value": "<video>\n" + QUESTION},
                              {"from": "gpt", "value": f"<think>A {spec.colour} square flashes.</think> "
                                                       f"<answer>{answer}</answer>"}],
            "meta": {"kind": "needle", "needle": [spec.start, spec.start + spec.length], "colour": spec.colour}}


def make_needle(out_dir: str | os.PathLike, n: int = 400, seed: int = 0, frames: int = 256,
                size: int = 28) -> Path:
    """Write the needle data set to ``out_dir`` (``n`` train records, ``max(10, n // 10)`` test, and the
    test records on cut videos); return it. Every record has its own video."""
    if n < 1:
        raise ValueError(f"make_needle: need n >= 1 (got {n})")
    root = Path(out_dir)
    (root / "videos").mkdir(parents=True, exist_ok=True)
    with open(root / ".needle.lock", "w") as lock:  # several processes may start on a missing data set
        fcntl.flock(lock, fcntl.LOCK_EX)
        rng = np.random.default_rng(seed)
        index = 0
        for split, count in (("train", n), ("test", max(10, n // 10))):
            rows, cut_rows = [], []
            for i in range(count):
                spec = needle_spec(rng, frames, size)
                rel, rel_cut = f"videos/n_{index:05d}.mp4", f"videos/n_{index:05d}_cut.mp4"
                index += 1
                video = render_needle(spec)
                if not (root / rel).exists():
                    write_mp4(root / rel, video, fps=NEEDLE_FPS)
                rows.append(_record(f"{split}-{i:05d}", spec, rel))
                if split == "test":
                    if not (root / rel_cut).exists():
                        write_mp4(root / rel_cut, cut_needle(video, spec), fps=NEEDLE_FPS)
                    cut = _record(f"{split}-{i:05d}-cut", spec, rel_cut)
                    cut["meta"]["needle"] = None
                    cut_rows.append(cut)
            if split == "test":
                write_jsonl(root / "test_cut.jsonl", cut_rows)
            write_jsonl(root / f"{split}.jsonl", rows)
    return root


def prepare_needle(demo, train_path: str | Path, seed: int = 0, say=None) -> bool:
    """Make the needle data set in ``train_path``'s directory when it is missing; True when it was made."""
    train = Path(train_path).expanduser()
    if train.exists():
        return False
    if say:
        say(f"making the needle data set in {train.parent} ({demo.size} videos of {demo.frames} frames) ...")
    make_needle(train.parent, n=demo.size, seed=seed, frames=demo.frames)
    return True
