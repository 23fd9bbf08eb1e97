"""Recipes on one side of the core: the core never imports a recipe, it finds the installed ones here.

A recipe (the CPU demo in ``streamgrpo/recipes/demo``, or any installed package) registers a module under the
entry-point group ``streamgrpo.recipes`` (``[project.entry-points."streamgrpo.recipes"]`` in its
pyproject.toml); the entry point's name is its config section's key. The module is imported by every config
load, so it stays light (no torch at its top) and must not import :mod:`streamgrpo.config` at its top (it is
imported while the schema is built; its section derives from :class:`streamgrpo.sections.Section`). It has

* ``SECTION``: its config section's model, a top-level key of every config (defaults when a config leaves it out);
* ``SECTION_DOC`` (optional): the one line the config reference shows for that key;
* ``MOVED`` (optional): old dotted keys that moved into its section -> their new keys (load with a notice);
* optional hooks, each a function, called by the core where the table :data:`HOOKS` says.
"""

from __future__ import annotations

import functools
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from streamgrpo.sections import ConfigError, Section

GROUP = "streamgrpo.recipes"

HOOKS: dict[str, str] = {
    "prepare": "prepare(cfg, *, model, say=None): make what its section asks for and is missing before a run "
               "(`up`, model too) or before a role reads its data (`generator`, `learner`: model=False)",
    "generator_applier": "generator_applier(section): the weight applier (a WeightApplier factory) a generator "
                         "runs with, or None for the plain one",
    "warm_start": "warm_start(model_dir, cfg, *, seed, steps): `model tiny --warm-format` (cfg None without "
                  "--config)",
    "tokenizer_phrases": "tokenizer_phrases(): phrases the tiny model's tokenizer gives single tokens",
    "make_data": "make_data(out, *, n, seed): `streamgrpo data <name>` writes its synthetic data set",
}


@dataclass(frozen=True)
class Recipe:
    """One installed recipe: its name (its config section's key) and its module."""

    name: str
    module: ModuleType

    @property
    def section(self) -> type[Section]:
        return self.module.SECTION

    @property
    def doc(self) -> str:
        return getattr(self.module, "SECTION_DOC", "") or f"The {self.name} recipe's section."

    @property
    def moved(self) -> dict[str, str]:
        return dict(getattr(self.module, "MOVED", {}))

    def hook(self, name: str) -> Callable | None:
        if name not in HOOKS:
            raise KeyError(f"{name!r} is not a recipe hook ({', '.join(HOOKS)})")
        return getattr(self.module, name, None)


def check_recipe(name: str, module: ModuleType, taken: set[str]) -> Recipe:
    """The module as a :class:`Recipe`, or a :class:`ConfigError` naming what is wrong with it."""
    where = f"recipe {name!r} ({module.__name__}, entry-point group {GROUP})"
    if not name.isidentifier():
        raise ConfigError(f"{where}: its name must be a Python identifier (it is a config key)")
    if name in taken:
        raise ConfigError(f"{where}: {name!r} is already a config section")
    section = getattr(module, "SECTION", None)
    if not (isinstance(section, type) and issubclass(section, Section)):
        raise ConfigError(f"{where}: SECTION must be a streamgrpo.sections.Section subclass, got {section!r}")
    return Recipe(name, module)


def load_recipes(core_sections: tuple[str, ...]) -> tuple[Recipe, ...]:
    """The installed recipes in name order (each entry point imported once per process)."""
    return _load(tuple(core_sections))


def source_tree_entry_points(pyproject: Path) -> list[importlib.metadata.EntryPoint]:
    """The group's entry points of a source tree that is not installed (``python -m streamgrpo`` run from a
    checkout, as on a GPU box the project was carried to): read from its pyproject.toml."""
    try:
        import tomllib  # Python 3.11+
    except ImportError:  # pragma: no cover - Python 3.10 without tomli: the installed metadata only
        try:
            import tomli as tomllib
        except ImportError:
            return []
    if not pyproject.is_file():
        return []
    table = tomllib.loads(pyproject.read_text()).get("project", {}).get("entry-points", {}).get(GROUP, {})
    return [importlib.metadata.EntryPoint(name, value, GROUP) for name, value in table.items()]


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    installed = list(importlib.metadata.entry_points(group=GROUP))
    try:
        importlib.metadata.distribution("streamgrpo")
    except importlib.metadata.PackageNotFoundError:  # a checkout on sys.path: its own pyproject.toml
        installed += source_tree_entry_points(Path(__file__).resolve().parents[2] / "pyproject.toml")
    return installed


@functools.cache
def _load(core_sections: tuple[str, ...]) -> tuple[Recipe, ...]:
    taken = set(core_sections)
    found = []
    for ep in sorted(_entry_points(), key=lambda e: e.name):
        if ep.name in {r.name for r in found}:
            continue  # the same distribution seen twice on sys.path (an editable install and a source tree)
        try:
            module = ep.load()
        except ImportError as e:
            raise ConfigError(f"recipe {ep.name!r} ({ep.value}, entry-point group {GROUP}) does not import: {e}") from e
        if not isinstance(module, ModuleType):
            raise ConfigError(f"recipe {ep.name!r} ({ep.value}): the entry point must name a module, not {module!r}")
        recipe = check_recipe(ep.name, module, taken)
        taken.add(recipe.name)
        found.append(recipe)
    return tuple(found)


def hooks(recipes: tuple[Recipe, ...], name: str) -> list[tuple[Recipe, Callable]]:
    """Each recipe's ``name`` hook where it has one, in name order."""
    return [(r, f) for r in recipes for f in [r.hook(name)] if f is not None]
