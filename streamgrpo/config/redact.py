"""Secrets masked in what ``streamgrpo config show`` prints (kept apart from :mod:`streamgrpo.config`)."""

from __future__ import annotations

import re
from typing import Any

from streamgrpo.transport.queue.resp import safe_url

MASK = "***"
# keys of free-form mappings (rewards[].params, ...) whose string values are secrets
SECRET_KEY = re.compile(r"(^|[_-])(password|passwd|secret|token|api[_-]?key|access[_-]?key|credentials?|"
                        r"private[_-]?key)($|[_-])", re.IGNORECASE)


def redact_secrets(node: Any, key: str = "") -> Any:
    """``node`` with secrets masked but visibly set: the password of any URL (``queue.url``
    ``redis://user:pw@h:6379/0`` -> ``redis://user:***@h:6379/0``, ``?password=***``) and the string
    value of any secret-looking key (``api_key``, ``token``, ``password``...)."""
    if isinstance(node, dict):
        return {k: redact_secrets(v, str(k)) for k, v in node.items()}
    if isinstance(node, list):
        return [redact_secrets(v, key) for v in node]
    if isinstance(node, str) and node and SECRET_KEY.search(key):
        return MASK
    if isinstance(node, str) and ("://" in node or "password=" in node):
        return safe_url(node, mask=MASK)
    return node
