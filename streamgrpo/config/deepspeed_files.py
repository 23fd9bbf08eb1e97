"""Where ``learner.deepspeed_config`` points: a shipped file by its short name, or a JSON path.

* ``zero1``, ``zero2``, ``zero3``, ``zero2_offload`` (or ``zero3.json``): the files shipped inside the
  package (``streamgrpo/configs/deepspeed/``), found from any working directory;
* an absolute path: that file;
* a relative path: next to the config file that names it (:func:`anchor`, at load time), else from
  the working directory;
* an old ``deploy/deepspeed/<name>.json`` that no longer exists: the shipped file of that name.
"""

from __future__ import annotations

import json
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


BUILT_IN_STAGE = 2
"""The ZeRO stage of the built-in DeepSpeed config (``learner.deepspeed_config: null``:
:data:`streamgrpo.learner.deepspeed_setup.DEFAULT_DEEPSPEED`)."""


def shipped_zero_stage(value: str | None) -> int | None:
    """The ZeRO stage of ``learner.deepspeed_config`` where it is known without reading the user's files: the
    built-in config's, or a shipped file's (by its short name); None for a path (read at learner start)."""
    if not value:
        return BUILT_IN_STAGE
    if Path(value).expanduser().is_file():  # a file of that name here wins over a shipped one (resolve())
        return None
    shipped = _shipped(value)
    if shipped is None:
        return None
    return int((json.loads(shipped.read_text()).get("zero_optimization") or {}).get("stage", 0))


def compile_refusal(stage: int, value: str | None) -> str | None:
    """Why ``learner.compile`` cannot run under DeepSpeed ZeRO ``stage`` (one line), or None where it can.

    ZeRO-0/1/2 keep every parameter whole on each rank and reduce its gradient from a hook on the
    parameter's gradient accumulation, which a compiled layer's backward (one AOTAutograd node) still runs
    into. ZeRO-3 partitions the parameters and gathers each layer's in hooks around the layer's forward and
    backward, which dynamo traces with the compiled layer and compiles again for every layer (DeepSpeed 0.19.8,
    torch 2.14: ``_pre_backward_module_hook`` and ``post_sub_module_forward_function`` hit the recompile limit
    and the first step had not finished after 3 minutes on the tiny model)."""
    if stage < 3:
        return None
    return (f"learner.compile with DeepSpeed ZeRO-{stage} (learner.deepspeed_config={value!r}): ZeRO-3 gathers "
            "each layer's partitioned parameters in hooks around the layer, which the compiled layer traces and "
            "recompiles for every layer: "
            "use ZeRO stage 0, 1 or 2 (zero1, zero2, zero2_offload), or set learner.compile to false")
