"""Where ``learner.deepspeed_config`` points: a shipped file by its short name, or a JSON path.

* ``zero1``, ``zero2``, ``zero3``, ``zero2_offload`` (or ``zero3.json``): the files shipped inside the
  package (``streamgrpo/configs/deepspeed/``), found from any working directory;
* an absolute path: that file;
* a relative path: next to the config file that names it (:func:`anchor`, at load time), else from
  the working directory;
* an old ``deploy/deepspeed/<name>.json`` that no longer exists: the shipped file of that name.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

OLD_FOLDER = "deploy/deepspeed/"


def shipped_folder() -> Path:
    """The package's folder of DeepSpeed JSON files."""
    return Path(str(resources.files("streamgrpo") / "configs" / "deepspeed"))


def shipped_names() -> list[str]:
    """Short names of the shipped DeepSpeed files (``zero1``, ``zero2``, ``zero2_offload``, ``zero3``)."""
    return sorted(p.stem for p in shipped_folder().glob("*.json"))


def _shipped(value: str) -> Path | None:
    """The shipped file ``value`` names (``zero3``, ``zero3.json``, ``deploy/deepspeed/zero3.json``)."""
    name = value[len(OLD_FOLDER):] if value.replace("\\", "/").startswith(OLD_FOLDER) else value
    if "/" in name or "\\" in name:
        return None
    stem = name[:-5] if name.endswith(".json") else name
    path = shipped_folder() / f"{stem}.json"
    return path if path.is_file() else None


def anchor(value: str | None, config_dir: str | Path) -> str | None:
    """``value`` made absolute when it is a relative path to a file next to the config (else unchanged)."""
    if not value:
        return value
    path = Path(value).expanduser()
    if path.is_absolute():
        return value
    beside = Path(config_dir) / path
    return str(beside.resolve()) if beside.is_file() else value


def resolve(value: str) -> Path:
    """The JSON file of ``learner.deepspeed_config`` (see the module docstring)."""
    path = Path(value).expanduser()
    if path.is_file():
        return path
    shipped = _shipped(value)
    if shipped is not None:
        return shipped
    return path  # reading it fails with the path in the message
