"""Shared pieces of the benchmark scripts: machine info, figures, the result-json format, the table.

Every script reports *figures*: one measured value next to the baseline it is compared with,
measured in the same run. A figure prints as one line::

    name: value (baseline: value, ratio: x)

and the script writes ``benchmarks/results/<benchmark>.json``::

    {"benchmark": "<name>", "schema": 1, "machine": {...}, "args": {...},
     "figures": [{"name", "value", "baseline", "ratio", "unit", "note"}, ...], ...script-specific data...}

``python -m benchmarks.run_all`` reads every such file and prints one table (:func:`build_table`). The
functions here are pure (plain data in, plain data out) except :func:`machine_info`,
:func:`emit` (prints) and :func:`write_result` / :func:`load_results` (files).
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from collections.abc import Iterable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"
RESULT_SCHEMA = 1
FIGURE_KEYS = ("name", "value", "baseline", "ratio", "unit", "note")
DEFAULT_PACKAGES = ("numpy", "torch", "transformers", "msgpack", "pyzmq", "redis", "av", "decord", "trl")


def child_pythonpath() -> str:
    """``PYTHONPATH`` for a child process: the repository root first, then the caller's own entries
    (no empty entry), so ``python -m benchmarks.<name>`` and ``import streamgrpo`` resolve here."""
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


def module_argv(name: str, *args: str) -> list[str]:
    """``python -m benchmarks.<name> args...`` with this interpreter."""
    return [sys.executable, "-m", f"benchmarks.{name}", *args]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine_info(packages: Iterable[str] = DEFAULT_PACKAGES, **extra: Any) -> dict[str, Any]:
    """Where and how a benchmark ran: CPU, cores, load, thread settings, package versions, date.

    ``torch_threads`` is read only when torch is already imported (it is never imported here).
    ``extra`` entries (e.g. ``device``, ``redis_version``) are added as they are.
    """
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "gpu": None,
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "torch_threads": None,
        "versions": {p: _version(p) for p in packages},
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    info.update(extra)
    return info


def safe_ratio(value: float | None, baseline: float | None) -> float | None:
    """value / baseline, or None when either is missing or the baseline is 0."""
    if value is None or baseline is None or baseline == 0:
        return None
    return value / baseline


def figure(name: str, value: float | None, baseline: float | None, ratio: float | None = None, *,
           unit: str = "", note: str = "") -> dict[str, Any]:
    """One figure; ``ratio`` defaults to value / baseline (pass it when the ratio is a speed-up the other way
    round, or a median of per-round ratios). Values may be None (not measured / not reached)."""
    if not name or any(c.isspace() for c in name) or ":" in name:
        raise ValueError(f"figure name {name!r}: must be non-empty, without spaces or ':'")
    if ratio is None:
        ratio = safe_ratio(value, baseline)
    return {"name": name, "value": _num(value), "baseline": _num(baseline), "ratio": _num(ratio),
            "unit": unit, "note": note}


def _num(x: Any) -> float | None:
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def fmt_value(x: float | None) -> str:
    """Four significant digits, plain notation where readable; '-' for None."""
    if x is None:
        return "-"
    if x == 0:
        return "0"
    a = abs(x)
    if 1e-3 <= a < 1e6:
        digits = max(0, 3 - int(math.floor(math.log10(a))))
        return f"{x:.{digits}f}"
    return f"{x:.3e}"


def format_figure(fig: Mapping[str, Any]) -> str:
    """``name: value (baseline: value, ratio: x)`` (ratio with 2 decimals)."""
    ratio = fig.get("ratio")
    r = "-" if ratio is None else f"{ratio:.2f}"
    return f"{fig['name']}: {fmt_value(fig.get('value'))} (baseline: {fmt_value(fig.get('baseline'))}, ratio: {r})"


def emit(fig: dict[str, Any], out=None) -> dict[str, Any]:
    """Print the figure line (and its note on a '#' line) and return the figure."""
    out = out or sys.stdout
    print(format_figure(fig), file=out)
    if fig.get("note"):
        print(f"#   {fig['name']}: {fig['note']}", file=out)
    out.flush()
    return fig


def result_doc(benchmark: str, figures: list[dict[str, Any]], machine: Mapping[str, Any],
               args: Mapping[str, Any] | None = None, data: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The result-json document (validated)."""
    doc: dict[str, Any] = {"benchmark": benchmark, "schema": RESULT_SCHEMA, "machine": dict(machine),
                           "args": dict(args or {}), "figures": list(figures)}
    for k, v in (data or {}).items():
        if k in doc:
            raise ValueError(f"result data key {k!r} clashes with a reserved key")
        doc[k] = v
    problems = validate_result(doc)
    if problems:
        raise ValueError(f"{benchmark}: invalid result: " + "; ".join(problems))
    return doc


def validate_result(doc: Any) -> list[str]:
    """Problems with a result document (empty list = valid)."""
    if not isinstance(doc, Mapping):
        return [f"expected a mapping, got {type(doc).__name__}"]
    problems = []
    if not isinstance(doc.get("benchmark"), str) or not doc.get("benchmark"):
        problems.append("benchmark: missing or not a non-empty string")
    if doc.get("schema") != RESULT_SCHEMA:
        problems.append(f"schema: {doc.get('schema')!r}, expected {RESULT_SCHEMA}")
    machine = doc.get("machine")
    if not isinstance(machine, Mapping):
        problems.append("machine: missing or not a mapping")
    else:
        for key in ("cores", "omp_num_threads", "versions", "date"):
            if key not in machine:
                problems.append(f"machine.{key}: missing")
    figures = doc.get("figures")
    if not isinstance(figures, list):
        return problems + ["figures: missing or not a list"]
    for i, f in enumerate(figures):
        if not isinstance(f, Mapping):
            problems.append(f"figures[{i}]: not a mapping")
            continue
        missing = [k for k in FIGURE_KEYS if k not in f]
        if missing:
            problems.append(f"figures[{i}]: missing {', '.join(missing)}")
        for k in ("value", "baseline", "ratio"):
            v = f.get(k)
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)):
                problems.append(f"figures[{i}].{k}: {v!r} is not a finite number or null")
    return problems


def write_result(benchmark: str, figures: list[dict[str, Any]], machine: Mapping[str, Any],
                 args: Mapping[str, Any] | None = None, data: Mapping[str, Any] | None = None,
                 out: str | Path | None = None) -> Path:
    """Write ``benchmarks/results/<benchmark>.json`` (or ``out``) and return its path."""
    doc = result_doc(benchmark, figures, machine, args, data)
    path = Path(out) if out else RESULTS_DIR / f"{benchmark}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    tmp.replace(path)
    print(f"# wrote {path}")
    return path


def load_results(directory: str | Path = RESULTS_DIR) -> list[dict[str, Any]]:
    """Every ``bench_*.json`` in ``directory`` (sorted by name; the chaos soak's ``chaos.json`` is its own
    format); an unreadable or invalid file becomes a document with ``error`` set, so the table can say
    which one is broken."""
    docs = []
    for p in sorted(Path(directory).glob("bench_*.json")):
        try:
            doc = json.loads(p.read_text())
        except (OSError, ValueError) as exc:
            docs.append({"benchmark": p.stem, "error": f"{p.name}: unreadable ({exc})", "figures": []})
            continue
        problems = validate_result(doc)
        if problems:
            docs.append({"benchmark": p.stem, "error": f"{p.name}: " + "; ".join(problems[:3]), "figures": []})
        else:
            docs.append(doc)
    return docs


def table_rows(docs: Iterable[Mapping[str, Any]]) -> list[list[str]]:
    """Rows ``[benchmark, figure, value, baseline, ratio, unit]`` of every figure of every document."""
    rows = []
    for doc in docs:
        if doc.get("error"):
            rows.append([str(doc.get("benchmark", "?")), "(invalid result file: see below)", "-", "-", "-", ""])
            continue
        for f in doc.get("figures", []):
            ratio = f.get("ratio")
            rows.append([doc["benchmark"], f["name"], fmt_value(f.get("value")), fmt_value(f.get("baseline")),
                         "-" if ratio is None else f"{ratio:.2f}", f.get("unit") or ""])
    return rows


TABLE_HEADER = ["benchmark", "figure", "value", "baseline", "ratio", "unit"]


def build_table(docs: Iterable[Mapping[str, Any]], style: str = "text") -> str:
    """One table of all figures: ``style="markdown"`` (a GitHub table) or ``"text"`` (aligned columns).
    Result files that could not be read are listed under the table with the reason."""
    docs = list(docs)
    rows = table_rows(docs)
    errors = [f"invalid result file: {d['error']}" for d in docs if d.get("error")]
    if style == "markdown":
        lines = ["| " + " | ".join(TABLE_HEADER) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * 3 + ["---"]) + "|"]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
        return "\n".join(lines + ([""] + errors if errors else []))
    if style != "text":
        raise ValueError(f"style={style!r}: must be 'text' or 'markdown'")
    widths = [max(len(r[i]) for r in [TABLE_HEADER, *rows]) for i in range(len(TABLE_HEADER))]
    right = {2, 3, 4}

    def line(r: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    return "\n".join([line(TABLE_HEADER), line(["-" * w for w in widths])] + [line(r) for r in rows] + errors)


def machine_lines(docs: Iterable[Mapping[str, Any]]) -> list[str]:
    """Where and when each benchmark's figures were measured: ``- bench_x: CPU (N cores[, GPU]), date``."""
    out = []
    for doc in docs:
        m = doc.get("machine") or {}
        if doc.get("error") or not m:
            continue
        gpu = f", {m['gpu']}" if m.get("gpu") else ""
        line = f"- {doc['benchmark']}: {m.get('cpu', '?')} ({m.get('cores', '?')} cores{gpu}), {str(m.get('date', '?'))[:10]}"
        if line not in out:
            out.append(line)
    return out


def make_group(mb: float, seed: int = 0):
    """A ScoredGroup whose message is about ``mb`` MB (frames dominate); for the wire/queue benches."""
    import numpy as np

    from streamgrpo.wire import Completion, ScoredGroup, Visual

    rng = np.random.default_rng(seed)
    frame = 112 * 112 * 3
    t = max(1, round(mb * 1e6 / frame))
    completions = [
        Completion(rng.integers(0, 150_000, 256, dtype=np.int32), -np.abs(rng.standard_normal(256)).astype(np.float32),
                   "<answer>(B) green</answer>", "stop", {"accuracy": 1.0}, 1.0)
        for _ in range(8)
    ]
    visuals = [Visual("video", rng.integers(0, 256, (t, 112, 112, 3), dtype=np.uint8), 2.0, np.arange(t, dtype=np.int32))]
    return ScoredGroup("bench", "gen-0", 0, "bench", np.arange(300, dtype=np.int32), visuals, "(B) green", completions)
