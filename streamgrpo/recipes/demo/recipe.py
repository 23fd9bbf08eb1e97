"""What the core sees of the CPU demo (:mod:`streamgrpo.config.recipes`), registered under the entry-point group
``streamgrpo.recipes`` (pyproject.toml) as ``demo``: its section and its hooks, which import their parts when
called (every config load imports this module: torch stays out)."""

from __future__ import annotations

from streamgrpo.recipes.demo.config import DemoConfig

SECTION = DemoConfig
SECTION_DOC = "The demo recipe's knobs (streamgrpo/recipes/demo): its data, its tiny model, the staleness benchmark's delay."
# the demo's knobs lived in the core's sections before the demo had its own
MOVED = {
    "model.tiny_if_missing": "demo.tiny_model",
    "model.warm_pixels": "demo.warm_pixels",
    "model.warm_letters": "demo.warm_letters",
    "data.make_demo_if_missing": "demo.make_data",
    "data.demo_size": "demo.size",
    "data.demo_motion": "demo.motion",
    "rollout.weight_apply_delay": "demo.weight_apply_delay",
}


def prepare(cfg, *, model: bool, say=None) -> None:
    """The data set of ``demo.task`` when ``demo.make_data`` asks and it is missing; with ``model``, the tiny model too."""
    from streamgrpo.recipes.demo.assets import prepare_assets, prepare_data

    if model:
        prepare_assets(cfg, say=say)
    else:
        prepare_data(cfg.demo, cfg.data.train_path, seed=cfg.seed, say=say)


def generator_applier(section: DemoConfig):
    """A lagging applier under ``demo.weight_apply_delay`` (the staleness benchmark), else None."""
    from streamgrpo.recipes.demo.lag import applier_for

    return applier_for(section) if section.weight_apply_delay else None


def warm_start(model_dir, cfg, *, seed: int, steps: int) -> None:
    """Teach the tiny model the answer format on ``cfg``'s prompts (None: the colour demo's)."""
    from streamgrpo.recipes.demo.assets import warm_data_config
    from streamgrpo.recipes.demo.warm import warm_format

    warm_format(model_dir, data_cfg=warm_data_config(cfg) if cfg else None, seed=seed, steps=steps,
                letters=cfg.demo.warm_letters if cfg else "uniform", demo=cfg.demo if cfg else None)


def tokenizer_phrases() -> list[str]:
    """The demo's questions, so that the tiny tokenizer gives their words single tokens."""
    from streamgrpo.recipes.demo.data import COLOUR_OPTIONS, DIRECTION_OPTIONS

    return [f"What colour is the moving square? {COLOUR_OPTIONS}. Answer with the option letter.",
            f"Which direction does the square move? {DIRECTION_OPTIONS}. Answer with the option letter.",
            "In what percentage of the frames is the centre of the square in the left half? Answer with a number.",
            "Which video shows a red square? (1) (2) (3) (4). Answer with the option number."]


def make_data(out, *, n: int, seed: int) -> None:
    """The colour, motion, numeric and multi-video clips (real mp4 files): ``streamgrpo data demo``."""
    from streamgrpo.recipes.demo.data import make_demo

    make_demo(out, n=n, seed=seed)
