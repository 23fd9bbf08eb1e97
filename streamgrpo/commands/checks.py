"""What the role commands check before they load a model, so that a mistake ends them within seconds."""

from __future__ import annotations

from pathlib import Path

from streamgrpo.config import Config
from streamgrpo.config.recipes import hooks
from streamgrpo.config.schema import RECIPES
from streamgrpo.data.records import require_data_path
from streamgrpo.transport.queue.base import QueueStopped
from streamgrpo.transport.queue.factory import open_queue, queue_url


def check_before_loading(cfg: Config, role: str, *, data: bool = False, queue: bool = True) -> None:
    """What can never work, found in a second instead of after loading a model: a missing data
    file, no Redis configured, a Redis that refuses this URL (password, TLS, ACL). An unreachable
    Redis is left to the queue, which waits for it (``stop=True`` ends this one try at once)."""
    if data:
        prepare_recipes(cfg, model=False)
        require_data_path(cfg.data.train_path)
    if not queue:
        return
    url = queue_url(cfg.queue, Path(cfg.run_dir))
    try:
        open_queue(cfg.queue, url, consumer=f"{role}-check", stop=True).close()
    except QueueStopped:
        pass


def prepare_recipes(cfg: Config, *, model: bool, say=None) -> None:
    """What each installed recipe's section asks for and is missing (its ``prepare`` hook): the data set a
    generator or learner reads, and with ``model`` (``up``) the model too."""
    for _, prepare in hooks(RECIPES, "prepare"):
        prepare(cfg, model=model, say=say)
