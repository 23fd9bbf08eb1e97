"""``streamgrpo config init``: a shipped config copied as a starting point, each key commented with its doc.

:func:`starter_text` is pure (the shipped YAML text in, the commented text out): a header that says where
the file came from and how to check it, then the shipped lines, each ``key: value`` line without a comment
of its own followed by the first sentence of that key's documentation (the field docstring that
docs/config.md is made of), cut to one line.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel

from streamgrpo.config.reference import _item_model_of, _model_of
from streamgrpo.config.schema import Config
from streamgrpo.sections import ConfigError

_KEY = re.compile(r"^(?P<indent>\s*)(?P<dash>-\s+)?(?P<key>[A-Za-z_][A-Za-z0-9_]*):(?P<rest>.*)$")
_MAX_COMMENT = 100


def field_doc(dotted: str) -> str | None:
    """The first sentence of a config key's documentation (``rollout.vllm.gpu_memory_utilization``)."""
    model: type[BaseModel] | None = Config
    field = None
    for part in dotted.split("."):
        if model is None or part not in model.model_fields:
            return None
        field = model.model_fields[part]
        model = _model_of(field.annotation) or _item_model_of(field.annotation)
    text = (field.description or "").strip() if field is not None else ""
    if not text:
        return None
    first = re.split(r"(?<=[.;])\s", text.replace("\n", " "), maxsplit=1)[0].rstrip(".;")
    return first if len(first) <= _MAX_COMMENT else first[: _MAX_COMMENT - 3].rstrip() + "..."


def _annotate(line: str, stack: list[tuple[int, str]]) -> str:
    """``line`` with its key's doc appended (``stack``: the (indent, key) path so far, updated)."""
    m = _KEY.match(line)
    if not m or m["dash"]:  # not a key, or a list item (rewards.functions: documented by name)
        return line
    indent = len(m["indent"])
    while stack and stack[-1][0] >= indent:
        stack.pop()
    stack.append((indent, m["key"]))
    doc = field_doc(".".join(k for _, k in stack))
    if doc is None or "#" in m["rest"]:
        return line
    return f"{line}  # {doc}"


def starter_text(shipped: str, name: str) -> str:
    """The commented starting config made from the shipped config ``name`` (its YAML text)."""
    header = [
        f"# Started from the shipped config {name!r} by `streamgrpo config init`. Edit it, then check it:",
        "#   streamgrpo config show --config THIS_FILE      (the resolved config, every default filled in)",
        "#   streamgrpo up --config THIS_FILE --plan        (where each process goes, what memory it needs)",
        "# Every key and its default: docs/config.md. Relative data paths are read from the working",
        "# directory; learner.deepspeed_config: a shipped name (zero1, zero2, zero3, zero2_offload) or a path.",
        "",
    ]
    stack: list[tuple[int, str]] = []
    body = [_annotate(line, stack) for line in shipped.splitlines()]
    return "\n".join(header + body) + "\n"


def write_starter(name: str, out: str | Path, *, force: bool = False) -> Path:
    """Write :func:`starter_text` of the shipped config ``name`` to ``out`` (refused if it exists)."""
    from streamgrpo.config.loading import find_config

    src = find_config(name)
    dest = Path(out)
    if dest.exists() and not force:
        raise ConfigError(f"{dest} already exists (--force overwrites it)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(starter_text(src.read_text(encoding="utf-8"), name), encoding="utf-8")
    return dest
