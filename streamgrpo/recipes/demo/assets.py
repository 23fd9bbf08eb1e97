"""The demo's assets, made in this one place when its config asks: the synthetic data set
(``demo.make_data``) and the tiny Qwen2.5-VL taught the answer format (``demo.tiny_model``)."""

from __future__ import annotations

import shutil
from pathlib import Path

from streamgrpo.recipes.demo.tasks import prepare_data


def warm_data_config(cfg):
    """The data section a config's format warm start runs on: ``cfg.data``, at ``demo.warm_pixels`` when set."""
    px = cfg.demo.warm_pixels
    return cfg.data if px is None else cfg.data.model_copy(update={"min_pixels": px, "max_pixels": px})


def prepare_model(cfg, say=None) -> bool:
    """Build the tiny model at ``model.name_or_path`` and teach it the answer format when it is missing
    and ``demo.tiny_model`` asks for it; True when it was built."""
    model_dir = Path(cfg.model.name_or_path)
    if not cfg.demo.tiny_model or (model_dir / "config.json").exists():
        return False
    from streamgrpo.models.tiny import build_tiny
    from streamgrpo.recipes.demo.warm import warm_format

    if say:
        say(f"building the tiny Qwen2.5-VL in {model_dir} and teaching it the answer format ...")
    tmp = model_dir.with_name(model_dir.name + ".tmp")
    build_tiny(tmp, arch="qwen2_5_vl", seed=cfg.seed)
    warm_format(tmp, data_cfg=warm_data_config(cfg), seed=cfg.seed, letters=cfg.demo.warm_letters,
                demo=cfg.demo)
    if model_dir.exists():
        shutil.rmtree(model_dir)
    tmp.rename(model_dir)
    return True


def prepare_assets(cfg, say=None) -> None:
    """Both, in order (the warm start reads the data)."""
    prepare_data(cfg.demo, cfg.data.train_path, seed=cfg.seed, say=say)
    prepare_model(cfg, say=say)
