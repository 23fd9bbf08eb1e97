"""Reward registry: built-in reward factories by name, custom rewards by ``module:function``.

A reward function has one signature everywhere (the TRL convention, with plain-string completions)::

    fn(completions: list[str], answers: list[str], **fields) -> list[float]

``fields`` are the record's other columns (``question``, ``id``, ...). A built-in reward is made by
a *factory* that takes its parameters and returns such a function; :func:`get` calls the factory.
A custom reward ``module:function`` is imported as is; its ``params`` are bound as keyword
arguments (``functools.partial``).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any, Protocol


class RewardFn(Protocol):
    """``fn(completions, answers, **fields) -> list[float]`` (one value per completion)."""

    def __call__(self, completions: list[str], answers: list[str], **fields: Any) -> list[float]: ...


class RewardError(ValueError):
    """A reward name or its parameters are wrong (the message names the reward and the problem)."""


_FACTORIES: dict[str, Callable[..., RewardFn]] = {}
_ALIASES = {
    "format_reward": "format",
    "accuracy_reward": "accuracy",
    "strict_format_reward": "strict_format",
    "soft_format_reward": "soft_format",
    "xmlcount": "xml_count",
    "xml_count_reward": "xml_count",
    "iou": "action_iou",
    "numeric_reward": "numeric",
    "exact": "exact_match",
}


def register(name: str) -> Callable[[Callable[..., RewardFn]], Callable[..., RewardFn]]:
    """Decorator: register a built-in reward factory under ``name``."""

    def deco(factory: Callable[..., RewardFn]) -> Callable[..., RewardFn]:
        if name in _FACTORIES:
            raise RewardError(f"reward {name!r} registered twice")
        _FACTORIES[name] = factory
        return factory

    return deco


def builtin_names() -> list[str]:
    """Names of the built-in rewards (aliases not included)."""
    return sorted(_FACTORIES)


def canonical_name(name: str) -> str:
    """The built-in name behind an alias (``accuracy_reward`` -> ``accuracy``); others unchanged."""
    return _ALIASES.get(name, name)


def factory_params(name: str) -> set[str] | None:
    """Keyword parameters a built-in factory accepts (``None`` for a custom reward: unknown)."""
    name = canonical_name(name)
    factory = _FACTORIES.get(name)
    if factory is None:
        return None
    return {
        p.name
        for p in inspect.signature(factory).parameters.values()
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
    }


def _import_custom(name: str) -> Callable[..., Any]:
    module_name, _, attr_path = name.partition(":")
    if not module_name or not attr_path:
        raise RewardError(f"custom reward {name!r}: expected 'module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or an error inside the user's module
        raise RewardError(f"custom reward {name!r}: cannot import module {module_name!r}: {exc}") from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise RewardError(
                f"custom reward {name!r}: module {module_name!r} has no {attr_path!r}"
            ) from None
    if not callable(obj):
        raise RewardError(f"custom reward {name!r}: {attr_path!r} is not callable")
    return obj


def get(name: str, **params: Any) -> RewardFn:
    """The reward function ``name`` built with ``params``.

    ``name`` is a built-in (``format``, ``strict_format``, ``soft_format``, ``xml_count``,
    ``accuracy``, ``action_iou``, ``numeric``, ``exact_match``, or a seed-era alias such as
    ``accuracy_reward``) or ``module:function`` for a user function, whose params are bound as
    keyword arguments. Unknown names and unknown parameters raise :class:`RewardError`.
    """
    if ":" in name:
        fn = _import_custom(name)
        if params:
            fn = functools.partial(fn, **params)
        return fn
    key = _ALIASES.get(name, name)
    factory = _FACTORIES.get(key)
    if factory is None:
        raise RewardError(
            f"unknown reward {name!r}; built-ins: {', '.join(builtin_names())} (or 'module:function' for a custom one)"
        )
    accepted = factory_params(key) or set()
    unknown = sorted(set(params) - accepted)
    if unknown:
        raise RewardError(f"reward {name!r}: unknown parameter(s) {unknown}; accepted: {sorted(accepted)}")
    try:
        fn = factory(**params)
    except (TypeError, ValueError) as exc:
        raise RewardError(f"reward {name!r}: bad parameters {params!r}: {exc}") from exc
    return fn
