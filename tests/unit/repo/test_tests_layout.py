"""The tests mirror the package: each folder under tests/unit/ and tests/integration/ is named for a folder of
streamgrpo/ (``core/``: the top-level modules; ``repo/``: what lies outside the package), and no two test
modules share a basename (pytest's default import mode names a module by its file's basename)."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.paths import REPO, TESTS

PACKAGE = REPO / "streamgrpo"
OUTSIDE = {"core", "repo"}


def _folders(kind: str) -> list[str]:
    root = TESTS / kind
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                  if p.is_dir() and p.name != "__pycache__" and "__pycache__" not in p.parts)


@pytest.mark.parametrize("kind", ["unit", "integration"])
def test_every_test_folder_names_a_package_folder(kind):
    folders = _folders(kind)
    assert folders, f"tests/{kind} has no folders"
    strays = [f for f in folders if f not in OUTSIDE and not (PACKAGE / f).is_dir()]
    assert strays == [], f"tests/{kind}/ folders that name no folder of streamgrpo/: {strays}"
    assert not list((TESTS / kind).glob("*.py")), f"tests/{kind}/ holds files outside its folders"


def test_test_module_basenames_are_unique():
    names = Counter(p.name for p in TESTS.rglob("*.py")
                    if "__pycache__" not in p.parts and not (p.parent / "__init__.py").exists())
    assert [n for n, c in names.items() if c > 1 and n != "__init__.py"] == []
