"""The demo recipe's data set for its task (``demo.task``): the colour and motion clips
(:mod:`streamgrpo.recipes.demo.data`) or the long-video needle (:mod:`streamgrpo.recipes.needle.data`)."""

from __future__ import annotations

from pathlib import Path

from streamgrpo.recipes.demo.config import DemoConfig
from streamgrpo.recipes.demo.data import prepare_data as prepare_clips
from streamgrpo.recipes.needle.data import prepare_needle


def prepare_data(demo: DemoConfig, train_path: str | Path, seed: int = 0, say=None) -> bool:
    """Make the data set of ``demo.task`` in ``train_path``'s directory when it is missing and ``demo.make_data``
    asks for it; True when it was made."""
    if not demo.make_data:
        return False
    if demo.task == "needle":
        return prepare_needle(demo, Path(train_path).expanduser(), seed=seed, say=say)
    return prepare_clips(demo, train_path, seed=seed, say=say)
