"""The policy's ``config.json``, for the plans made before a model loads (``streamgrpo config memory``,
``up --plan``, the learner's memory check): from a local directory, the Hugging Face cache, or one
try at the Hub.

``transformers.AutoConfig`` would retry an unreachable Hub for about 25 s (five retries, a warning
each) and end in a traceback; with ``HF_HUB_OFFLINE`` set and the file not cached it fails with a
message that names neither the file nor a way out. Here the Hub gets one request, and every way to
have no config is :class:`ModelConfigUnavailable`: one line naming ``model.name_or_path``, the file
it needs and how to get it (a local directory with the model's ``config.json``, or ``streamgrpo
model tiny --config-only``, which writes one at the published sizes).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from streamgrpo.config import ConfigError

HUB_TIMEOUT_S = 10.0
"""Seconds the one request to the Hub may take."""


class ModelConfigUnavailable(ConfigError):
    """The model's config.json cannot be read (offline, unreachable, not found): one line with the way out."""


def tiny_command(name_or_path: str) -> str:
    """The ``streamgrpo model tiny ... --config-only`` command that writes a stand-in config.json at the
    published layer sizes of ``name_or_path`` (recognised: Qwen2.5-VL 3B/7B, Qwen3-VL 8B; pure)."""
    name = str(name_or_path).lower()
    if re.search(r"qwen3[-_.]?vl[-_.]?8b", name):
        arch, size = "qwen3_vl", "8b"
    elif m := re.search(r"qwen2\.?5[-_.]?vl[-_.]?([37])b", name):
        arch, size = "qwen2_5_vl", f"{m.group(1)}b"
    else:
        return "streamgrpo model tiny --size 3b|7b|8b --config-only --out DIR"
    arch_flag = "" if arch == "qwen2_5_vl" else f" --arch {arch}"
    return f"streamgrpo model tiny{arch_flag} --size {size} --config-only --out DIR"


def unavailable_message(name_or_path: str, why: str) -> str:
    """The one line of :class:`ModelConfigUnavailable` (pure)."""
    return (f"no model config for model.name_or_path={name_or_path!r}: {why}; it needs the model's config.json: "
            f"set model.name_or_path to a local directory that holds it, e.g. one written by "
            f"`{tiny_command(name_or_path)}` (the published layer sizes, no weights)")


def offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set, as the Hub client reads it."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def looks_local(name_or_path: str) -> bool:
    """A filesystem path rather than a Hub id (``owner/name``)."""
    text = str(name_or_path)
    return Path(text).expanduser().exists() or text.startswith(("/", ".", "~")) or text.count("/") > 1


def config_json(name_or_path: str, revision: str | None = None) -> Path:
    """The path of the model's config.json: in the local directory, in the Hugging Face cache, or
    downloaded after one request to the Hub; :class:`ModelConfigUnavailable` otherwise."""
    name = str(name_or_path)
    if looks_local(name):
        path = Path(name).expanduser() / "config.json"
        if not path.is_file():
            why = "no config.json in that directory" if path.parent.is_dir() else "no such directory"
            raise ModelConfigUnavailable(unavailable_message(name, why))
        return path
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(name, "config.json", revision=revision)
    except ValueError as exc:  # not a valid Hub id
        raise ModelConfigUnavailable(unavailable_message(name, f"not a directory, nor a Hub id ({exc})")) from None
    if isinstance(cached, str):
        return Path(cached)
    if offline():
        raise ModelConfigUnavailable(unavailable_message(
            name, "HF_HUB_OFFLINE is set and the Hugging Face cache does not hold its config.json"))
    return _download_once(name, revision)


def _download_once(name: str, revision: str | None) -> Path:
    """config.json from the Hub after one metadata request (the Hub client alone retries for ~25 s)."""
    import inspect

    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url

    once = {"retry_on_errors": False} if "retry_on_errors" in inspect.signature(get_hf_file_metadata).parameters \
        else {}
    try:
        get_hf_file_metadata(hf_hub_url(name, "config.json", revision=revision), timeout=HUB_TIMEOUT_S, **once)
        return Path(hf_hub_download(name, "config.json", revision=revision, etag_timeout=HUB_TIMEOUT_S))
    except Exception as exc:  # noqa: BLE001 - unreachable, not found, gated: all the same way out
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        why = f"the Hub did not give its config.json ({type(exc).__name__}{': ' + first if first else ''})"
        raise ModelConfigUnavailable(unavailable_message(name, why)) from None


def load_model_config(name_or_path: str, revision: str | None = None) -> Any:
    """The ``transformers`` config of the model (:func:`config_json`, read by ``AutoConfig``)."""
    path = config_json(name_or_path, revision)  # first: a missing config is said before transformers loads
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path.parent))
