"""Reading a config: a YAML file or a shipped name, ``${VAR}`` expansion, seed-era names mapped to
their sections with a one-line notice each, ``--set section.key=value`` overrides (parsed as YAML,
then validated), and validation errors that name the key, the value and the file."""

from __future__ import annotations

import copy
import math
import os
import sys
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from streamgrpo.config.aliases import ALIASES, MOVED, REWARD_WEIGHT_ALIASES
from streamgrpo.config.deepspeed_files import anchor
from streamgrpo.config.rewards import RewardsConfig
from streamgrpo.config.rollout import RolloutConfig
from streamgrpo.config.schema import RECIPES, Config
from streamgrpo.sections import ConfigError


def _notice(msg: str) -> None:
    print(f"streamgrpo config: {msg}", file=sys.stderr)


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {key!r}: {'.'.join(parts[: i + 1])!r} is not a section")
        node = child
    node[parts[-1]] = value


def _apply_aliases(tree: dict[str, Any], source: str) -> dict[str, Any]:
    """Move seed-era top-level names to their sections, with a one-line notice each."""
    tree = dict(tree)
    reward_weights: dict[str, Any] = {}
    batch_completions = None
    for name in list(tree):
        if name in ALIASES:
            target = ALIASES[name]
            value = tree.pop(name)
            if name == "deepspeed":
                _set_dotted(tree, "learner.backend", "deepspeed")
            _notice(f"{source}: seed-era key {name!r} mapped to {target!r}")
            _set_dotted(tree, target, value)
        elif name in REWARD_WEIGHT_ALIASES:
            reward_weights[REWARD_WEIGHT_ALIASES[name]] = tree.pop(name)
            _notice(f"{source}: seed-era key {name!r} mapped to the weight of reward {REWARD_WEIGHT_ALIASES[name]!r}")
        elif name == "per_device_train_batch_size":
            batch_completions = tree.pop(name)
    if reward_weights:
        rewards = tree.setdefault("rewards", {})
        if isinstance(rewards, list):
            rewards = tree["rewards"] = {"functions": rewards}
        functions = rewards.get("functions")
        if functions is None:
            functions = rewards["functions"] = [
                {"name": s.name, "weight": s.weight, "params": dict(s.params)} for s in RewardsConfig().functions
            ]
        for fname, weight in reward_weights.items():
            for spec in functions:
                if isinstance(spec, dict) and spec.get("name") == fname:
                    spec["weight"] = weight
                    break
            else:
                functions.append({"name": fname, "weight": weight})
    if batch_completions is not None:
        g = tree.get("rollout", {}).get("num_generations", RolloutConfig().num_generations)
        try:
            groups = max(1, math.ceil(int(batch_completions) / int(g)))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: per_device_train_batch_size={batch_completions!r} is not an integer") from exc
        _notice(f"{source}: per_device_train_batch_size={batch_completions} completions mapped to learner.groups_per_step={groups}")
        _set_dotted(tree, "learner.groups_per_step", groups)
    return tree


# keys that moved to another section: the core's (:data:`MOVED`) and each installed recipe's (into its section)
ALL_MOVED: dict[str, str] = {**MOVED, **{old: new for r in RECIPES for old, new in r.moved.items()}}


def _apply_moves(tree: dict[str, Any], source: str) -> None:
    """Keys that moved to another section (:data:`ALL_MOVED`) go to their new place, with a one-line notice each."""
    for old, new in ALL_MOVED.items():
        section, key = old.split(".")
        node = tree.get(section)
        if isinstance(node, dict) and key in node:
            _notice(f"{source}: {old!r} moved to {new!r}")
            _set_dotted(tree, new, node.pop(key))


def parse_override(item: str) -> tuple[str, Any]:
    """Split ``section.key=value``; the value is parsed as YAML (``1`` -> int, ``true`` -> bool)."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected section.key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"--set {item!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def _format_validation_error(exc: ValidationError, tree: Mapping[str, Any], source: str) -> str:
    lines = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        key = ".".join(loc) or "<root>"
        value = err.get("input")
        if err["type"] == "extra_forbidden":
            lines.append(f"{source}: unknown key {key!r} (value {value!r})")
        elif err["type"] == "finite_number":  # NaN/inf: not "should be <= 1", which would mislead
            got = value if isinstance(value, str) else repr(value)
            lines.append(f"{source}: {key}: must be a finite number, got {got}")
        elif err["type"] == "value_error" and isinstance(value, Mapping):  # a section's or the config's own check
            # (its message names the keys); a type error on a key given a mapping still names the key, below
            lines.append(f"{source}: {err['msg'].removeprefix('Value error, ')}")
        else:
            lines.append(f"{source}: {key} = {value!r}: {err['msg']}")
    return "\n".join(lines)


def _shipped_file(name: str):
    """The packaged YAML of a shipped name: ``demo`` (streamgrpo/configs/demo.yaml) or a recipe's
    ``video_r1/qwen2_5_vl_7b_1node`` (streamgrpo/recipes/video_r1/qwen2_5_vl_7b_1node.yaml)."""
    folder, _, stem = name.rpartition("/")
    stem = stem[:-5] if stem.endswith(".yaml") else stem[:-4] if stem.endswith(".yml") else stem
    if not folder:
        return resources.files("streamgrpo") / "configs" / f"{stem}.yaml"
    if "/" in folder or folder.startswith(".") or not stem:
        return None
    return resources.files("streamgrpo") / "recipes" / folder / f"{stem}.yaml"


def find_config(name_or_path: str | Path) -> Path:
    """A path to a YAML file, or the name of a shipped config (``demo`` -> streamgrpo/configs/demo.yaml,
    ``video_r1/qwen2_5_vl_7b_1node`` -> the Video-R1 recipe's)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    for shipped in (_shipped_file(str(name_or_path)),  # then a path to a shipped file elsewhere: by its name
                    resources.files("streamgrpo") / "configs" / f"{Path(str(name_or_path)).stem}.yaml"):
        if shipped is not None and shipped.is_file():
            return Path(str(shipped))
    if str(name_or_path).endswith((".yaml", ".yml")):
        raise ConfigError(f"config file {str(name_or_path)!r} not found")
    raise ConfigError(
        f"config {str(name_or_path)!r} is neither a file nor a shipped config (shipped: {', '.join(shipped_configs())})"
    )


def shipped_configs() -> list[str]:
    """Names of the shipped configs: streamgrpo/configs/*.yaml, then each recipe's as ``recipe/name``."""
    folder = resources.files("streamgrpo") / "configs"
    names = sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))
    recipes = resources.files("streamgrpo") / "recipes"
    for recipe in sorted(recipes.iterdir(), key=lambda p: p.name):
        if recipe.is_dir() and not recipe.name.startswith(("_", ".")):
            names += sorted(f"{recipe.name}/{p.name[:-5]}" for p in recipe.iterdir() if p.name.endswith(".yaml"))
    return names


def build_config(tree: Mapping[str, Any] | None = None, overrides: Iterable[str] = (), source: str = "<dict>") -> Config:
    """Validate a raw tree plus ``--set`` overrides into a Config (errors name key, value, source)."""
    tree = copy.deepcopy(dict(tree or {}))
    if not isinstance(tree, dict):
        raise ConfigError(f"{source}: top level must be a mapping")
    tree = _apply_aliases(tree, source)
    _apply_moves(tree, source)
    for item in overrides:
        key, value = parse_override(item)
        if key in ALL_MOVED:
            _notice(f"--set {item}: {key!r} moved to {ALL_MOVED[key]!r}")
            key = ALL_MOVED[key]
        flat = {key: value} if key in ALIASES or key in REWARD_WEIGHT_ALIASES or key == "per_device_train_batch_size" else None
        if flat is not None:
            merged = _apply_aliases(flat, f"--set {item}")
            _deep_merge(tree, merged)
        else:
            _set_dotted(tree, key, value)
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        overridden = ", ".join(f"--set {o}" for o in overrides)
        where = source + (f" (with {overridden})" if overridden else "")
        raise ConfigError(_format_validation_error(exc, tree, where)) from None


def _deep_merge(dst: dict[str, Any], src: Mapping[str, Any]) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _deep_merge(dst[k], v)
        else:
            dst[k] = v


def load_config(name_or_path: str | Path | None = None, overrides: Iterable[str] = ()) -> Config:
    """Load a YAML config (a path or a shipped name) and apply ``--set`` overrides."""
    overrides = list(overrides)
    if name_or_path is None:
        return build_config({}, overrides, source="<defaults>")
    path = find_config(name_or_path)
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(tree).__name__}")
    cfg = build_config(_expand_env(tree), overrides, source=str(path))
    if not any(o.split("=", 1)[0].strip() in ("learner.deepspeed_config", "deepspeed") for o in overrides):
        cfg.learner.deepspeed_config = anchor(cfg.learner.deepspeed_config, path.parent)
    return cfg


def _expand_env(node: Any) -> Any:
    """Expand ``${VAR}`` in string values (compose/k8s pass secrets such as REDIS_PASSWORD this way)."""
    if isinstance(node, dict):
        return {k: _expand_env(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_expand_env(v) for v in node]
    if isinstance(node, str) and "$" in node:
        return os.path.expandvars(node)
    return node
