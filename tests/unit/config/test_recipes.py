"""Recipes on one side of the core: the core imports no recipe; a recipe's section and hooks reach the core
through the entry-point group ``streamgrpo.recipes`` (the demo's from pyproject.toml, a second one installed
here as a real distribution on ``sys.path``)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import streamgrpo
from streamgrpo.config import SECTIONS, Config, ConfigError, build_config
from streamgrpo.config.recipes import GROUP, HOOKS, check_recipe, hooks
from streamgrpo.config.schema import CORE_SECTIONS, RECIPES

PACKAGE = Path(streamgrpo.__file__).parent
ROOT = PACKAGE.parent


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_the_core_imports_no_recipe():
    core = [p for p in PACKAGE.rglob("*.py") if "recipes" not in p.relative_to(PACKAGE).parts]
    offenders = {str(p.relative_to(ROOT)): sorted(m for m in _imports(p) if m.startswith("streamgrpo.recipes"))
                 for p in core}
    assert len(core) > 100
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_demo_section_comes_from_its_entry_point():
    assert "demo" not in CORE_SECTIONS and SECTIONS[-1] == "demo"
    (demo,) = [r for r in RECIPES if r.name == "demo"]
    assert demo.module.__name__ == "streamgrpo.recipes.demo.recipe" and Config.model_fields["demo"].annotation is demo.section
    assert {name for name in HOOKS if demo.hook(name)} == set(HOOKS)  # the demo has every hook
    assert build_config({"demo": {"size": 12}}).demo.size == 12
    with pytest.raises(ConfigError, match="demo.sizes"):
        build_config({"demo": {"sizes": 12}})


def test_a_module_without_a_section_or_with_a_core_name_is_refused():
    import types

    empty = types.ModuleType("empty_recipe")
    with pytest.raises(ConfigError, match="SECTION must be a streamgrpo.sections.Section subclass"):
        check_recipe("empty", empty, set(CORE_SECTIONS))
    demo = next(r for r in RECIPES if r.name == "demo").module
    with pytest.raises(ConfigError, match="'learner' is already a config section"):
        check_recipe("learner", demo, set(CORE_SECTIONS))
    with pytest.raises(ConfigError, match="must be a Python identifier"):
        check_recipe("my-recipe", demo, set(CORE_SECTIONS))
    with pytest.raises(KeyError, match="not a recipe hook"):
        next(r for r in RECIPES if r.name == "demo").hook("prepare_everything")


RECIPE = '''
from pydantic import Field
from streamgrpo.sections import Section


class FlashConfig(Section):
    brightness: int = Field(3, ge=0)
    """How bright the flash is."""


SECTION = FlashConfig
SECTION_DOC = "The flash recipe's knobs."
MOVED = {"data.flash_brightness": "flash.brightness"}


def make_data(out, *, n, seed):
    """write the flash recipe's records"""
    from pathlib import Path
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "made.txt").write_text(f"{n} {seed}")


def prepare(cfg, *, model, say=None):
    from pathlib import Path
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    (Path(cfg.run_dir) / "flash-prepared.txt").write_text(f"{cfg.flash.brightness} {model}")
'''


def _install(site: Path) -> None:
    """A distribution ``flash-recipe`` with one module and its entry point, as pip would lay it out."""
    info = site / "flash_recipe-0.1.dist-info"
    info.mkdir(parents=True)
    (site / "flash_recipe.py").write_text(RECIPE)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flash-recipe\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{GROUP}]\nflash = flash_recipe\n")


def _run(site: Path, code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)


def test_an_installed_recipe_adds_its_section_its_moved_keys_its_data_command_and_its_preparation(tmp_path):
    site = tmp_path / "site"
    _install(site)
    out = _run(site, f"""
        import json, sys
        from streamgrpo.config import SECTIONS, build_config, load_config
        from streamgrpo.cli import main
        from streamgrpo.commands.checks import prepare_recipes
        cfg = build_config({{"flash": {{"brightness": 7}}, "run_dir": {str(tmp_path / 'run')!r}}})
        old = build_config({{"data": {{"flash_brightness": 5}}}})
        prepare_recipes(cfg, model=True)
        code = main(["data", "flash", "--out", {str(tmp_path / 'data')!r}, "--n", "4", "--seed", "9"])
        print(json.dumps({{"sections": SECTIONS, "brightness": cfg.flash.brightness, "old": old.flash.brightness,
                          "demo": cfg.demo.size, "code": code, "shipped": load_config("demo").flash.brightness}}))
        """, tmp_path)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["sections"][-2:] == ["demo", "flash"]  # recipes in name order after the core's sections
    assert (seen["brightness"], seen["old"], seen["demo"], seen["code"], seen["shipped"]) == (7, 5, 2000, 0, 3)
    assert "'data.flash_brightness' moved to 'flash.brightness'" in out.stderr
    assert (tmp_path / "run" / "flash-prepared.txt").read_text() == "7 True"
    assert (tmp_path / "data" / "made.txt").read_text() == "4 9"


def test_a_recipe_that_does_not_import_is_an_error_naming_it(tmp_path):
    site = tmp_path / "site"
    _install(site)
    (site / "flash_recipe.py").write_text("import no_such_module_here\n")
    out = _run(site, "from streamgrpo.config import Config", tmp_path)
    assert out.returncode != 0
    assert "recipe 'flash' (flash_recipe, entry-point group streamgrpo.recipes) does not import" in out.stderr


def test_hooks_are_in_name_order_and_only_where_a_recipe_has_one():
    assert [r.name for r, _ in hooks(RECIPES, "prepare")] == ["demo"]
    assert all(callable(f) for _, f in hooks(RECIPES, "make_data"))


def test_a_checkout_that_is_not_installed_registers_the_recipes_of_its_pyproject(monkeypatch):
    import importlib.metadata

    from streamgrpo.config import recipes

    eps = recipes.source_tree_entry_points(ROOT / "pyproject.toml")
    assert [(e.name, e.value, e.group) for e in eps] == [("demo", "streamgrpo.recipes.demo.recipe", GROUP)]
    assert eps[0].load() is next(r for r in RECIPES if r.name == "demo").module

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [])  # python -m streamgrpo in a checkout
    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    assert [e.name for e in recipes._entry_points()] == ["demo"]
    assert recipes.source_tree_entry_points(ROOT / "no-such-pyproject.toml") == []
