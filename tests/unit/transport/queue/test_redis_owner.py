"""All of Redis is the queue layer's (streamgrpo/transport/queue/): no other module of the package imports redis,
sends a Redis command through a queue's client, or spells a key of the namespace (they are in .keys)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import streamgrpo

PACKAGE = Path(streamgrpo.__file__).parent
OWNER = PACKAGE / "transport" / "queue"
COMMANDS = {"get", "set", "delete", "incrby", "expire", "hget", "hset", "hdel", "hgetall", "hincrby", "sadd", "srem",
            "smembers", "xrange", "xrevrange", "xadd", "zadd", "zmscore", "config_get", "info", "pipeline", "ping"}
KEY = re.compile(r"[}\w]:(groups|dead|held|trained|failures|committed_step|cursor|sync|stepping|reading|crash_starts)\b")


def _modules():
    return [p for p in sorted(PACKAGE.rglob("*.py")) if OWNER not in p.parents]


def test_no_module_outside_the_queue_layer_imports_redis_or_sends_a_command_through_a_queues_client():
    found = []
    for path in _modules():
        text = path.read_text()
        tree = ast.parse(text)
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(PACKAGE)}:{node.lineno} imports {n}" for n in names
                      if n.split(".")[0] == "redis"]
            if (isinstance(node, ast.Attribute) and node.attr in COMMANDS and isinstance(node.value, ast.Attribute)
                    and node.value.attr == "client"):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} calls client.{node.attr}")
        found += [f"{path.relative_to(PACKAGE)}: a script imports redis" for _ in re.finditer(r"import [\w, ]*redis\b",
                                                                                                text)]
    assert found == [], found


def test_no_module_outside_the_queue_layer_spells_a_redis_key():
    found = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and KEY.search(node.value):
                if not isinstance(getattr(node, "parent", None), ast.Expr):
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.value[:60]!r}")
    # docstrings may name keys (a reader looks them up in transport/queue/keys.py); code may not
    code = [f for f in found if not _in_docstring(f)]
    assert code == [], code


def _in_docstring(where: str) -> bool:
    rel, line = where.split(":")[0], int(where.split(":")[1])
    tree = ast.parse((PACKAGE / rel).read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = node.body[0] if node.body and isinstance(node.body[0], ast.Expr) else None
            if doc is not None and isinstance(doc.value, ast.Constant) and doc.lineno <= line <= doc.end_lineno:
                return True
    return False
