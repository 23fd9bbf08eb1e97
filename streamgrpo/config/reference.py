"""The configuration reference (docs/config.md), rendered from the config models themselves.

Every field of every section documents itself with the docstring under it (``Section`` sets pydantic's
``use_attribute_docstrings``, so the docstring is the field's ``description``); its type, default and
bounds come from the same field. :func:`render_reference` turns that into Markdown, so the reference
cannot drift from the code: ``streamgrpo config reference --out docs/config.md`` regenerates it and
tests/unit/repo/test_docs.py fails while the file differs. :func:`config_keys` is every dotted key it
documents (``weights.delta_max_ratio``, ``rollout.vllm.gpu_memory_utilization``,
``rewards.functions[].name``), for checking the keys that other documents name.

Pure: no I/O, no torch; the same models give the same text.
"""

from __future__ import annotations

import json
import re
import sys
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, Union

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python

from streamgrpo.config.schema import SECTIONS, Config

REGENERATE = "streamgrpo config reference --out docs/config.md"


@dataclass(frozen=True)
class Row:
    key: str  # dotted: weights.delta_max_ratio, rollout.vllm.max_model_len, rewards.functions[].name
    type: str
    default: str  # Markdown
    bounds: str  # Markdown
    description: str  # Markdown


@dataclass(frozen=True)
class Table:
    key: str  # "" for the top level, else the dotted key of the section or sub-model ("rewards.functions[]")
    intro: str  # Markdown, may be empty
    rows: tuple[Row, ...]


# ------------------------------------------------------------------------------------- types
def _without_none(annotation: Any) -> tuple[Any, bool]:
    """``Optional[X]`` -> (X, True); anything else -> (itself, False)."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) < len(typing.get_args(annotation)):
            return (args[0] if len(args) == 1 else Union[tuple(args)]), True
    return annotation, False


def _model_of(annotation: Any) -> type[BaseModel] | None:
    inner, _ = _without_none(annotation)
    return inner if isinstance(inner, type) and issubclass(inner, BaseModel) else None


def _item_model_of(annotation: Any) -> type[BaseModel] | None:
    """The model of a ``list[Model]`` field (``rewards.functions``), else None."""
    inner, _ = _without_none(annotation)
    if typing.get_origin(inner) is list:
        (item,) = typing.get_args(inner) or (None,)
        return item if isinstance(item, type) and issubclass(item, BaseModel) else None
    return None


def _type_name(annotation: Any) -> str:
    inner, optional = _without_none(annotation)
    origin = typing.get_origin(inner)
    if origin is Literal:
        name = " or ".join(sorted({type(v).__name__ for v in typing.get_args(inner)}))
    elif origin in (Union, types.UnionType):
        name = " or ".join(_type_name(a) for a in typing.get_args(inner))
    elif origin is list:
        (item,) = typing.get_args(inner) or (Any,)
        name = "list of objects" if _item_model_of(inner) else f"list of {_type_name(item)}"
    elif origin is dict:
        name = "mapping"
    elif inner is Any:
        name = "any"
    elif isinstance(inner, type) and issubclass(inner, BaseModel):
        name = "object"
    elif isinstance(inner, type):
        name = inner.__name__
    else:
        name = str(inner)
    return f"{name} or null" if optional else name


def _choices(annotation: Any) -> list[Any]:
    inner, optional = _without_none(annotation)
    if typing.get_origin(inner) is not Literal:
        return []
    return [*typing.get_args(inner), *([None] if optional else [])]


# ------------------------------------------------------------------------------------ Markdown
def _code(value: str) -> str:
    """A code span for a table cell: `|` escaped, backticks fenced with longer runs."""
    value = value.replace("|", "\\|")
    if "`" not in value:
        return f"`{value}`"
    return f"`` {value} ``"


def _json(value: Any) -> str:
    return json.dumps(to_jsonable_python(value), ensure_ascii=False)


def _prose(text: str) -> str:
    """A docstring as one line of Markdown for a table cell: whitespace collapsed, reStructuredText's
    ``code`` and :role:`target` as code spans, and outside code what Markdown would take for markup
    (``<run_dir>`` as an HTML tag, ``*`` as emphasis, ``|`` as a cell border) escaped."""
    text = " ".join(text.split())
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", text)
    text = re.sub(r"``(.+?)``", r"`\1`", text)
    parts = text.split("`")
    paired = len(parts) % 2 == 1  # else an unpaired backtick: all prose, the backticks escaped
    out = []
    for i, part in enumerate(parts):
        if i % 2 and paired:
            out.append(_code(part))
        else:
            out.append(part.replace("\\", "\\\\").replace("<", "&lt;").replace("*", "\\*").replace("|", "\\|"))
    return "".join(out) if paired else "\\`".join(out)


def _bounds(field: FieldInfo) -> str:
    out = []
    for meta in field.metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if isinstance(meta, getattr(annotated_types, attr.capitalize())):
                out.append(f"{sign} {getattr(meta, attr)}")
        if isinstance(meta, annotated_types.MinLen):
            out.append(f"length >= {meta.min_length}")
        if isinstance(meta, annotated_types.MaxLen):
            out.append(f"length <= {meta.max_length}")
        pattern = getattr(meta, "pattern", None)
        if isinstance(pattern, str):
            out.append(f"matches {_code(pattern)}")
    choices = _choices(field.annotation)
    if choices:
        out.append("one of " + ", ".join(_code(_json(c) if c is None else str(c)) for c in choices))
    return "; ".join(out)


def _default(field: FieldInfo, model: type[BaseModel] | None) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if model is not None and isinstance(value, model):
        return "the defaults below"
    return _code(_json(value))


# -------------------------------------------------------------------------------------- tables
def _module_intro(model: type[BaseModel]) -> str:
    """The first paragraph of the docstring of the module that defines ``model``."""
    doc = getattr(sys.modules.get(model.__module__), "__doc__", None) or ""
    return _prose(doc.strip().split("\n\n")[0]) if doc.strip() else ""


def _row(key: str, field: FieldInfo) -> Row:
    return Row(key=key, type=_type_name(field.annotation), default=_default(field, _model_of(field.annotation)),
               bounds=_bounds(field), description=_prose(field.description or ""))


def _tables(model: type[BaseModel], prefix: str, intro: str) -> list[Table]:
    """The table of ``model``'s fields under ``prefix``, then one per nested model, depth first."""
    rows, nested = [], []
    for name, field in model.model_fields.items():
        key = f"{prefix}.{name}" if prefix else name
        rows.append(_row(key, field))
        sub, items = _model_of(field.annotation), _item_model_of(field.annotation)
        if sub is not None:
            nested.append((sub, key))
        elif items is not None:
            nested.append((items, f"{key}[]"))
    tables = [Table(key=prefix, intro=intro, rows=tuple(rows))]
    for sub, key in nested:
        tables.extend(_tables(sub, key, ""))
    return tables


def reference_tables() -> list[Table]:
    """The top-level keys, then every section in ``SECTIONS`` order (a section missing from ``SECTIONS``
    comes after them rather than going undocumented), each followed by its nested models."""
    fields = Config.model_fields
    sections = [s for s in SECTIONS if s in fields]
    sections += [name for name, f in fields.items() if _model_of(f.annotation) and name not in sections]
    top = [name for name in fields if name not in sections]
    rows = tuple(_row(name, fields[name]) for name in top)
    tables = [Table(key="", intro="Keys at the root of the document, beside the sections.", rows=rows)]
    for name in sections:
        model = _model_of(fields[name].annotation)
        assert model is not None, name
        intro = _module_intro(model)
        if fields[name].description and not intro:
            intro = _prose(fields[name].description)
        tables.extend(_tables(model, name, intro))
    return tables


def config_keys() -> set[str]:
    """Every dotted key the reference documents: sections, their fields, nested fields
    (``rollout.vllm.gpu_memory_utilization``) and list items (``rewards.functions[].name``)."""
    keys = set()
    for table in reference_tables():
        if table.key:
            keys.add(table.key.removesuffix("[]"))
        keys.update(row.key for row in table.rows)
    return keys


def _anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation but - and _ dropped, spaces as -."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def render_reference() -> str:
    """docs/config.md: a header, a contents list, then a table per section and nested model."""
    tables = reference_tables()
    titles = ["Top level" if not t.key else t.key for t in tables]
    out = [
        "# Configuration reference",
        "",
        f"<!-- Generated by `{REGENERATE}` from the config's field docstrings: do not edit. -->",
        "",
        "Generated from the docstrings of the config's fields (`streamgrpo/config/*.py`, the `demo` section's",
        "`streamgrpo/recipes/demo/config.py`): do not edit it by hand, change the docstring and regenerate it",
        f"with `{REGENERATE}` (`tests/unit/repo/test_docs.py` fails while it is stale).",
        "",
        "A config is one YAML document with these keys; unknown keys are errors. `--set key=value` overrides",
        "one on the command line (dotted, e.g. `--set weights.delta_max_ratio=0.4`), and",
        "`streamgrpo config show --config demo` prints a resolved config. Defaults are JSON; `null` is YAML's",
        "`null` or `~`. Keys with `[]` are keys of each item of a list.",
        "",
    ]
    out += [f"- [{title}](#{_anchor(title)})" for title, table in zip(titles, tables)]
    for title, table in zip(titles, tables):
        depth = "##" if "." not in table.key else "###"
        out += ["", f"{depth} {title}", ""]
        if table.intro:
            out += [table.intro, ""]
        out += ["| Key | Type | Default | Bounds / choices | Description |", "| --- | --- | --- | --- | --- |"]
        out += [f"| `{r.key}` | {r.type} | {r.default} | {r.bounds} | {r.description} |" for r in table.rows]
    return "\n".join(out) + "\n"
