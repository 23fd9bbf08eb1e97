"""Docs that cannot lie quietly: the config reference is regenerated from the code, every `streamgrpo`
command that README.md and docs/*.md show parses with the real CLI parser, and every config key they
name exists.

The checkers are pure functions of a Markdown text (:func:`commands_in`, :func:`bad_commands`,
:func:`keys_in`, :func:`unknown_keys`), tested on planted stale lines below, then run on the real
documents.

Where commands are found: lines of fenced code blocks in a shell language (or none), inline code
spans, and prose lines that start with ``.venv/bin/streamgrpo`` or ``python -m streamgrpo``. In each,
the shell is read as a shell would: ``\\`` continuations, quotes, ``# comments``, ``|``, ``&&``,
``;`` and ``&`` between commands, redirections, ``KEY=VAL`` prefixes, ``$VAR`` (from an assignment
earlier in the block, ``${VAR:-default}``, else a placeholder), ``$(...)``. A command is
``streamgrpo ...``, ``.venv/bin/streamgrpo ...`` or ``<launcher> -m streamgrpo ...`` (python,
torchrun, ``deepspeed --module``). The usage notation of the docs is read too: ``[optional]`` groups
are included, ``(a | b)`` and ``a|b`` alternatives each parse on their own, ``<name>``, ``$VAR`` and
upper-case metavars (``N``, ``DIR``) become a value the option accepts, and ``...`` says the command
is abbreviated (after an option that takes a value, it is that value too: ``--set ...``).

A command parses when ``build_parser().parse_args`` does not exit with an error. Two relaxations,
not skips: a command that names only (sub)command words (prose such as "`streamgrpo eval` writes
...") or is abbreviated with ``...`` may leave out required arguments; every option it does give
must exist and have its value. Skipped, for the reasons in :data:`SKIP` only: the CLI's own one-line
messages quoted in the docs (``streamgrpo learner: not enough memory ...``, ``streamgrpo <command>:
<what is wrong>``).

Config keys: inline code that starts with a dotted key (``weights.delta``, ``rollout.vllm.*``,
``learner.bf16: true``, ``eval.enabled=true``, ``loss.beta > 0``) whose first part is a section, and ``--set section.key=...`` anywhere
in code; ``[0]`` matches ``[]``, ``*`` matches a name. Not keys (:data:`NOT_KEYS`): file names such
as ``metrics.jsonl``, and attributes of the transformers model (``model.visual.merger``,
``model.generate``). Keys below a free-form mapping (``rewards.functions[].params.x``) are the
mapping's. Old keys that moved to
another section (:data:`streamgrpo.config.loading.ALL_MOVED`) still load, with a notice, so docs may name
them.
"""

from __future__ import annotations

import difflib
import io
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

from streamgrpo.cli import build_parser, main
from streamgrpo.config.loading import ALL_MOVED as MOVED
from streamgrpo.config.reference import REGENERATE, config_keys, reference_tables, render_reference
from streamgrpo.config.schema import SECTIONS
from tests.paths import REPO

REFERENCE = REPO / "docs" / "config.md"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
        *sorted((REPO / "streamgrpo" / "recipes").glob("*/README.md"))]

# A command is skipped only for one of these reasons: (pattern on the words after `streamgrpo`, why).
SKIP = [
    (re.compile(r"^(?:[a-z<][\w<>.-]* ){0,2}[a-z<][\w<>.-]*: "),
     "the CLI's own one-line message (`streamgrpo <command>: <what is wrong>`), quoted as output"),
]
# Inline code that looks like a dotted config key but is not one: (pattern, why).
NOT_KEYS = [
    (re.compile(r"\.(py|json|jsonl|ya?ml|md|png|svg|jpe?g|txt|csv|log|safetensors|bin|pt|mp4|sh|toml|html|gz|lock|pid|sock)$",
                re.I), "a file name (metrics.jsonl, eval.png, learner.lock)"),
    (re.compile(r"^model\.(visual|language_model|lm_head|generate|forward)(\.|$)"),
     "an attribute of the loaded transformers model (model.visual.merger, model.generate), not a config key"),
]
SHELL_LANGUAGES = {"", "bash", "sh", "shell", "zsh", "console", "shell-session", "sh-session", "terminal"}
LAUNCHER_WRAPPERS = {"sudo", "env", "nohup", "exec", "time", "command"}
MODULES = ("streamgrpo", "streamgrpo.cli", "streamgrpo.__main__")  # python -m / torchrun -m / deepspeed --module
PH = "\x00"  # a placeholder (<name>, $VAR, $(...)): filled with a value its option accepts
MAX_VARIANTS = 64


# ----------------------------------------------------------------------------------- Markdown
def _fenced_and_prose(text: str) -> tuple[list[tuple[str, list[tuple[int, str]]]], list[list[tuple[int, str]]]]:
    """(fenced blocks as (language, [(line number, line)]), prose paragraphs as [(line number, line)])."""
    blocks, paragraphs = [], [[]]
    fence = None  # (character, length) of the open fence
    for number, line in enumerate(text.splitlines(), 1):
        m = re.match(r"^\s*(`{3,}|~{3,})\s*([^\s`]*)", line)
        if fence is None and m:
            fence = (m.group(1)[0], len(m.group(1)))
            blocks.append((m.group(2).lower(), []))
            paragraphs.append([])
        elif fence is not None:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= fence[1] and not m.group(2):
                fence = None
            else:
                blocks[-1][1].append((number, line))
        elif not line.strip():
            paragraphs.append([])
        elif line.lstrip().startswith("|"):  # a table row: its spans end with it
            paragraphs += [[(number, line)], []]
        else:
            paragraphs[-1].append((number, line))
    return blocks, [p for p in paragraphs if p]


_SPAN = re.compile(r"(?<![`\\])(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)


def code_spans(text: str) -> Iterator[tuple[int, str]]:
    """Inline code spans: (line where the span starts, its text on one line). In prose a span may
    continue on the next line; in a fenced block (in a comment, say) it ends with its line."""
    blocks, paragraphs = _fenced_and_prose(text)
    for paragraph in paragraphs + [[line] for _, lines in blocks for line in lines]:
        first, joined = paragraph[0][0], "\n".join(line for _, line in paragraph)
        for m in _SPAN.finditer(joined):
            yield first + joined.count("\n", 0, m.start()), " ".join(m.group(2).split())


def _logical_lines(lines: list[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    """Shell lines with their backslash continuations joined: (line number of the first, text)."""
    start, parts = None, []
    for number, line in lines:
        start = number if start is None else start
        if line.rstrip().endswith("\\") and not line.rstrip().endswith("\\\\"):
            parts.append(line.rstrip()[:-1])
            continue
        parts.append(line)
        yield start, " ".join(p.strip() for p in parts)
        start, parts = None, []
    if parts:
        yield start, " ".join(p.strip() for p in parts)


# -------------------------------------------------------------------------------------- shell
@dataclass(frozen=True)
class Tok:
    text: str
    op: bool = False  # | || && ; & [ ] ( ): separators, or the usage notation's groups and alternatives
    quoted: bool = False


def _expand(line: str, env: dict[str, str]) -> str:
    """$(...) and unknown variables become placeholders; known ones their value, split as words."""
    line = re.sub(r"<[A-Za-z_][^<>\n]*?>", PH, line)  # <name>, <pod index>: not a redirection
    line = re.sub(r"\$\((?:[^()]|\([^()]*\))*\)", PH, line)

    def var(m: re.Match) -> str:
        name = m.group("braced") or m.group("plain")
        if name in env:
            return env[name]
        return m.group("default") if m.group("default") is not None else PH

    return re.sub(r"\$\{(?P<braced>\w+)(?::?-(?P<default>[^}]*))?\}|\$(?P<plain>[A-Za-z_]\w*)", var, line)


def _tokens(line: str) -> tuple[list[Tok], str]:  # noqa: C901 - one shell tokenizer state machine, a branch a character class
    """Shell words and operators, quotes removed (a quoted word keeps quoted=True); and the comment."""
    toks: list[Tok] = []
    word: list[str] = []
    state = {"in_word": False, "quoted": False}
    depth = 0

    def end_word() -> None:
        if state["in_word"]:
            toks.append(Tok("".join(word), quoted=state["quoted"]))
        word.clear()
        state.update(in_word=False, quoted=False)

    i, n = 0, len(line)
    while i < n:
        c = line[i]
        if c.isspace():
            end_word()
            i += 1
        elif c == "'":
            j = line.find("'", i + 1)
            j = n if j < 0 else j
            word.append(line[i + 1:j])
            state.update(in_word=True, quoted=True)
            i = j + 1
        elif c == '"':
            i += 1
            while i < n and line[i] != '"':
                if line[i] == "\\" and i + 1 < n and line[i + 1] in '"\\$`':
                    i += 1
                word.append(line[i])
                i += 1
            state.update(in_word=True, quoted=True)
            i += 1
        elif c == "\\":
            word.append(line[i + 1:i + 2])
            state["in_word"] = True
            i += 2
        elif c == "#" and not state["in_word"]:
            end_word()
            return toks, line[i + 1:].strip()
        elif c in "<>" or (c == "&" and line[i + 1:i + 2] == ">"):
            if state["in_word"] and "".join(word).isdigit():  # 2>file: the fd is no word
                word.clear()
                state.update(in_word=False, quoted=False)
            end_word()
            i += 1
            while i < n and line[i] in "<>&":
                i += 1
            if line[i - 1] == "&":  # 2>&1
                while i < n and line[i].isdigit():
                    i += 1
            else:  # the target word
                while i < n and line[i].isspace():
                    i += 1
                while i < n and not line[i].isspace():
                    i += 1
        elif c in ";&":
            end_word()
            op = "&&" if line[i:i + 2] == "&&" else c
            toks.append(Tok(op, op=True))
            i += len(op)
        elif c == "|" and not state["in_word"]:
            op = "||" if line[i:i + 2] == "||" else "|"
            toks.append(Tok(op, op=True))
            i += len(op)
        elif c in "[(" and not state["in_word"]:
            toks.append(Tok(c, op=True))
            depth += 1
            i += 1
        elif c in "])" and depth and (i + 1 == n or line[i + 1].isspace() or line[i + 1] in "])|"):
            end_word()
            toks.append(Tok(c, op=True))
            depth -= 1
            i += 1
        else:
            word.append(c)
            state["in_word"] = True
            i += 1
    end_word()
    return toks, ""


def _segments(toks: list[Tok]) -> Iterator[list[Tok]]:
    """The simple commands of a line: split at | || && ; & outside the notation's groups."""
    segment, depth = [], 0
    for t in toks:
        if t.op and t.text in "[(":
            depth += 1
        elif t.op and t.text in "])":
            depth = max(0, depth - 1)
        elif t.op and depth == 0 and t.text in ("|", "||", "&&", ";", "&"):
            yield segment
            segment = []
            continue
        segment.append(t)
    yield segment


def _invocation(segment: list[Tok]) -> tuple[str, list[Tok]] | None:
    """(how streamgrpo was named, the tokens after it) when the simple command runs streamgrpo."""
    words = list(segment)
    if words and not words[0].op and words[0].text == "$":  # a console prompt
        words = words[1:]
    while words and not words[0].op and (re.match(r"^[A-Za-z_]\w*=", words[0].text)
                                         or words[0].text in LAUNCHER_WRAPPERS):
        words = words[1:]
    if words and not words[0].op and (words[0].text == "streamgrpo" or words[0].text.endswith("bin/streamgrpo")):
        return words[0].text, words[1:]
    for i, t in enumerate(words[:-1]):
        if not t.op and t.text in ("-m", "--module") and words[i + 1].text in MODULES:
            return " ".join(w.text for w in words[:i + 2] if not w.op), words[i + 2:]
    return None


def _alternatives(toks: list[Tok], i: int = 0, group: bool = False) -> tuple[list[list], int]:
    """The usage notation: a list of alternatives, each a list of ("word", Tok) / ("group", alternatives)."""
    alts: list[list] = [[]]
    while i < len(toks):
        t = toks[i]
        if t.op and t.text in "])":
            if group:
                return alts, i + 1
            i += 1  # a closer without its opener (the command started inside a group)
        elif t.op and t.text == "|":
            alts.append([])
            i += 1
        elif t.op and t.text in "[(":
            sub, i = _alternatives(toks, i + 1, True)
            alts[-1].append(("group", sub))
        else:
            alts[-1].append(("word", t))
            i += 1
    return alts, i


def _word_choices(t: Tok) -> list[Tok]:
    """`qwen2_5_vl|qwen3_vl`, `--size=3b|7b`, `up|learner|...`: each alternative; other words as they are."""
    if t.quoted or "|" not in t.text.strip("|"):
        return [t]
    prefix, _, rest = t.text.rpartition("=") if "=" in t.text.split("|")[0] else ("", "", t.text)
    return [Tok(f"{prefix}={alt}" if prefix else alt) for alt in rest.split("|")]


def _variants(alts: list[list]) -> list[list[Tok]]:
    out: list[list[Tok]] = []
    for seq in alts:
        combos: list[list[Tok]] = [[]]
        for kind, item in seq:
            options = _variants(item) if kind == "group" else [[w] for w in _word_choices(item)]
            combos = [c + o for c in combos for o in options][:MAX_VARIANTS]
        out.extend(combos)
    return out[:MAX_VARIANTS]


# ---------------------------------------------------------------------------------------- CLI
@cache
def _parser():
    return build_parser()


def _subparsers(parser) -> dict:
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            return action.choices
    return {}


def _is_placeholder(t: Tok) -> bool:
    return not t.quoted and (t.text == PH or re.fullmatch(r"[A-Z][A-Z0-9_]*", t.text) is not None)


def _argv(words: list[Tok]) -> tuple[list[str], bool, bool]:
    """(argv with placeholders filled, elided by `...`, only (sub)command words were given)."""
    parser, argv, elided, path = _parser(), [], False, 0
    for t in words:
        subs = _subparsers(parser)
        if not t.quoted and t.text in subs and len(argv) == path:
            parser = subs[t.text]
            argv.append(t.text)
            path += 1
            continue
        prev = argv[-1] if argv else ""
        action = parser._option_string_actions.get(prev) if prev.startswith("-") and "=" not in prev else None
        if t.text in ("...", "…") and not t.quoted:
            if action is not None and action.nargs != 0:  # `--set ...`: a value, and the command goes on
                argv.append(str(action.choices[0]) if action.choices else "1")
            elided = True
            continue
        if _is_placeholder(t):
            argv.append(str(action.choices[0]) if action is not None and action.choices else "1")
        else:
            argv.append(t.text.replace(PH, "1"))
    return argv, elided, path == len(argv)


def parse_error(argv: list[str], lenient: bool = False) -> str | None:
    """argparse's error for ``streamgrpo <argv>``, or None when it parses (``--help`` included);
    ``lenient``: missing required arguments are no error."""
    err = io.StringIO()
    try:
        with redirect_stderr(err), redirect_stdout(io.StringIO()):
            _parser().parse_args(argv)
    except SystemExit as exc:
        if exc.code in (0, None):
            return None
        lines = err.getvalue().strip().splitlines()
        message = lines[-1] if lines else f"exit {exc.code}"
        if lenient and "the following arguments are required" in message:
            return None
        return message
    return None


# ------------------------------------------------------------------------------------ checkers
@dataclass
class Command:
    line: int
    text: str  # as the document writes it (continuations joined)
    argvs: list[tuple[list[str], bool]] = field(default_factory=list)  # (argv, lenient) per variant
    skipped: str | None = None  # the SKIP reason


def _commands_of_line(number: int, line: str, env: dict[str, str]) -> Iterator[Command]:
    toks, _ = _tokens(_expand(line, env))
    for segment in _segments(toks):
        found = _invocation(segment)
        if found is None:
            continue
        name, rest = found
        words = " ".join(t.text for t in rest).replace(PH, "<...>")
        cmd = Command(number, f"{name} {words}".replace(PH, "<...>").strip())
        cmd.skipped = next((why for pattern, why in SKIP if pattern.search(words + " ")), None)
        if cmd.skipped is None:
            for variant in _variants(_alternatives(rest)[0]):
                argv, elided, only_words = _argv(variant)
                cmd.argvs.append((argv, elided or only_words))
        yield cmd


def _assignments(line: str, env: dict[str, str]) -> None:
    """`W="--set a=b"` or `export X=1` alone on a line: remembered for later lines of the block."""
    toks, _ = _tokens(_expand(line, env))
    if toks and toks[0].text == "export" and not toks[0].op:
        toks = toks[1:]
    if toks and all(not t.op and re.match(r"^[A-Za-z_]\w*=", t.text) for t in toks):
        for t in toks:
            name, _, value = t.text.partition("=")
            env[name] = value


def commands_in(text: str) -> list[Command]:
    """Every streamgrpo command a Markdown text shows (skipped ones included, with their reason)."""
    out: list[Command] = []
    blocks, paragraphs = _fenced_and_prose(text)
    for language, lines in blocks:
        if language not in SHELL_LANGUAGES:
            continue
        env: dict[str, str] = {}
        for number, line in _logical_lines(lines):
            out.extend(_commands_of_line(number, line, env))
            _assignments(line, env)
            comment = _tokens(_expand(line, env))[1]
            if comment and "`" not in comment:  # `# (or: deepspeed --module streamgrpo learner ...)`
                out.extend(_commands_of_line(number, comment, env))
    for number, span in code_spans(text):
        out.extend(_commands_of_line(number, span.replace("\\|", "|"), {}))
    for paragraph in paragraphs:
        for number, line in paragraph:
            if re.match(r"^\s*(\.venv/bin/streamgrpo|python3? -m streamgrpo)\b", line):
                out.extend(_commands_of_line(number, line, {}))
    return sorted(out, key=lambda c: c.line)


def bad_commands(text: str) -> list[tuple[int, str, str]]:
    """(line, command, argparse's error) for every shown command some variant of which does not parse."""
    out = []
    for cmd in commands_in(text):
        if cmd.skipped:
            continue
        for argv, lenient in cmd.argvs:
            error = parse_error(argv, lenient)
            if error:
                out.append((cmd.line, cmd.text, f"{error} (argv {argv})"))
                break
    return out


_KEY = r"[A-Za-z_*][\w*]*(?:\[\d*\])?"
# a span that starts with a key: `weights.delta`, `learner.bf16: true`, `loss.beta > 0`, not `learner.publish()`
_KEY_SPAN = re.compile(rf"^(?P<key>(?:{'|'.join(SECTIONS)})(?:\.{_KEY})+)(?=$|[\s:=/,])")
_SET = re.compile(rf"--set(?:\s+|=)['\"]?(?P<key>[A-Za-z_][\w]*(?:\.{_KEY})+)\s*=")


def keys_in(text: str) -> list[tuple[int, str]]:
    """(line, key) for inline code that is a dotted config key of a section, and for `--set key=...` in
    code spans and fenced blocks; file names and the other NOT_KEYS left out."""
    found = []
    for number, span in code_spans(text):
        m = _KEY_SPAN.match(span)
        if m:
            found.append((number, m.group("key")))
        found.extend((number, s.group("key")) for s in _SET.finditer(span))
    for _, lines in _fenced_and_prose(text)[0]:
        for number, line in lines:
            found.extend((number, s.group("key")) for s in _SET.finditer(line))
    return sorted({(n, k) for n, k in found
                   if k.split(".")[0].split("[")[0] in SECTIONS and not any(p.search(k) for p, _ in NOT_KEYS)})


@cache
def _known() -> tuple[frozenset[str], tuple[str, ...]]:
    """Every config key, and the keys of free-form mappings (any key below them is theirs)."""
    mappings = tuple(row.key for t in reference_tables() for row in t.rows if "mapping" in row.type)
    return frozenset(config_keys()), mappings


def unknown_keys(text: str) -> list[tuple[int, str, str]]:
    """(line, key, why) for every key of :func:`keys_in` that the config does not have."""
    keys, mappings = _known()
    out = []
    for number, key in keys_in(text):
        norm = re.sub(r"\[\d+\]", "[]", key)
        if norm in keys or norm in MOVED or any(norm.startswith(m + ".") for m in mappings):
            continue
        if "*" in norm:
            pattern = re.compile(re.escape(norm).replace(r"\*", r"[^.]*") + "$")
            if any(pattern.match(k) for k in keys):
                continue
        close = difflib.get_close_matches(norm, sorted(keys), n=1)
        out.append((number, key, "not a config key" + (f" (did you mean {close[0]}?)" if close else "")))
    return out


def _report(path: Path, problems: list[tuple[int, str, str]]) -> str:
    rel = path.relative_to(REPO)
    return "\n".join(f"{rel}:{line}: {what}: {why}" for line, what, why in problems)


# --------------------------------------------------------------------------- the checkers, planted
def test_a_made_up_command_is_reported():
    text = "Run `streamgrpo frobnicate --now` first.\n\n```bash\nstreamgrpo up --config demo --no-such-flag\n```\n"
    bad = bad_commands(text)
    assert [(line, cmd) for line, cmd, _ in bad] == [
        (1, "streamgrpo frobnicate --now"), (4, "streamgrpo up --config demo --no-such-flag")]
    assert "invalid choice: 'frobnicate'" in bad[0][2] and "--no-such-flag" in bad[1][2]


def test_missing_values_and_required_arguments_are_reported():
    text = "`streamgrpo generator --config demo --id` and `streamgrpo model tiny --size 3b` and `streamgrpo up --generators many`"
    assert [cmd for _, cmd, _ in bad_commands(text)] == [
        "streamgrpo generator --config demo --id", "streamgrpo model tiny --size 3b", "streamgrpo up --generators many"]


def test_shell_details_parse():
    text = """
```bash
W="--set weights.pub_port=5555 --set weights.snapshot_port=5556"
export STREAMGRPO_REDIS_URL=redis://127.0.0.1:6379/0   # or --set queue.url=...
CUDA_VISIBLE_DEVICES=0 .venv/bin/streamgrpo generator --config demo \\
    --id ${ID:-0} $W 2>&1 | tee gen.log &   # a comment with `streamgrpo keys --out keys`
torchrun --nnodes 2 --node_rank $RANK -m streamgrpo learner --config my.yaml --resume && echo done
streamgrpo data demo --out data/demo && streamgrpo model tiny --out runs/demo-model --warm-format
$ python -m streamgrpo config show --config <name> --set 'data.kinds=[colour, direction]'
# (or: deepspeed --num_gpus 8 --module streamgrpo learner --config my.yaml)
```
"""
    cmds = commands_in(text)
    assert [c.text.split()[0] for c in cmds] == [
        ".venv/bin/streamgrpo", "streamgrpo", "torchrun", "streamgrpo", "streamgrpo", "python", "or:"]
    assert cmds[0].argvs == [(["generator", "--config", "demo", "--id", "0", "--set", "weights.pub_port=5555", "--set",
                              "weights.snapshot_port=5556"], False)]
    assert bad_commands(text) == []
    planted = text.replace("keys --out keys", "frobnicate").replace("learner --config my.yaml)", "learner --nope)")
    assert [(line, cmd) for line, cmd, _ in bad_commands(planted)] == [
        (6, "streamgrpo frobnicate"), (10, "or: deepspeed --num_gpus 8 --module streamgrpo learner --nope )")]


def test_usage_notation_parses_each_alternative():
    text = """
| `streamgrpo learner --config F [--resume \\| --fresh] [--set k=v ...]` | one learner |
| `streamgrpo infer --model M (--video V --prompt P \\| --input in.jsonl --output out.jsonl)` | inference |
| `streamgrpo model tiny --out DIR [--arch qwen2_5_vl\\|qwen3_vl] [--size tiny\\|3b\\|7b\\|8b]` | tiny |

`streamgrpo up --config <name> --plan`, `streamgrpo report RUN_DIR`, `streamgrpo up|learner|generator|eval|...`,
`streamgrpo eval` writes eval.json, `deepspeed --num_gpus 8 -m streamgrpo learner ...`, `streamgrpo queue
check`, and `streamgrpo learner: not enough memory for the learner: this host has 23.5 GiB`.
"""
    cmds = commands_in(text)
    assert len(cmds[0].argvs) == 2 and len(cmds[1].argvs) == 2 and len(cmds[2].argvs) == 8
    assert [c.skipped is not None for c in cmds] == [False] * 9 + [True]
    assert bad_commands(text) == []
    assert [cmd for _, cmd, _ in bad_commands(text.replace("qwen3_vl", "qwen4_vl"))] == [
        "streamgrpo model tiny --out DIR [ --arch qwen2_5_vl|qwen4_vl ] [ --size tiny|3b|7b|8b ]"]
    assert bad_commands("`streamgrpo learner --config F [--resume --fresh]`")  # not allowed together


def test_not_commands_are_not_read_as_commands():
    text = ("`streamgrpo/config/weights.py`, `streamgrpo_errors_total{kind}`, `kubectl -n streamgrpo get pods`, "
            "`streamgrpo-learner`, `~/.cache/streamgrpo`\n\n"
            "```yaml\nkey: streamgrpo frobnicate   # streamgrpo frobnicate\n```\n```python\nsubprocess.run(['streamgrpo', 'frobnicate'])\n```\n")
    assert commands_in(text) == []


def test_a_made_up_key_is_reported():
    text = ("Set `weights.no_such_key` or `weights.delta_max_ratio: 0.4`, `eval.enabled=true`, `rollout.vllm.*`,\n"
            "`rewards.functions[0].params.x`, `model.tiny_if_missing` (moved), `metrics.jsonl`, `model.visual.merger`,\n"
            "`streamgrpo up --set learner.nope=1 --set learner.bf16=true`.\n\n"
            "```bash\nstreamgrpo up --set 'rollout.vllm.gpu_memory_util=0.5'   # or --set queue.urll=x\n```\n")
    assert keys_in(text) == [
        (1, "eval.enabled"), (1, "rollout.vllm.*"), (1, "weights.delta_max_ratio"), (1, "weights.no_such_key"),
        (2, "model.tiny_if_missing"), (2, "rewards.functions[0].params.x"), (3, "learner.bf16"), (3, "learner.nope"),
        (6, "queue.urll"), (6, "rollout.vllm.gpu_memory_util")]
    assert [(line, key) for line, key, _ in unknown_keys(text)] == [
        (1, "weights.no_such_key"), (3, "learner.nope"), (6, "queue.urll"), (6, "rollout.vllm.gpu_memory_util")]
    assert "did you mean rollout.vllm.gpu_memory_utilization?" in unknown_keys(text)[-1][2]


# ---------------------------------------------------------------------------- the real documents
def test_config_reference_is_current():
    assert REFERENCE.is_file(), f"docs/config.md is missing: run `{REGENERATE}`"
    assert REFERENCE.read_text(encoding="utf-8") == render_reference(), (
        f"docs/config.md is stale (a config field or its docstring changed): run `{REGENERATE}`")


def test_every_field_is_documented_and_every_key_listed():
    tables = reference_tables()
    undocumented = [row.key for t in tables for row in t.rows if not row.description and row.key not in SECTIONS]
    assert undocumented == [], "give these fields a docstring (the line under the field): " + ", ".join(undocumented)
    assert {"run_dir", "seed", "weights.delta_max_ratio", "rollout.vllm.gpu_memory_utilization",
            "rewards.functions[].name", "metrics.wandb.mode", "demo.tiny_model"} <= config_keys()
    assert render_reference() == render_reference()


def test_config_reference_command(tmp_path, capsys):
    out = tmp_path / "config.md"
    assert main(["config", "reference", "--out", str(out), "--check"]) == 1
    assert main(["config", "reference", "--out", str(out)]) == 0 and out.read_text() == render_reference()
    assert main(["config", "reference", "--out", str(out), "--check"]) == 0
    out.write_text(render_reference() + "stale\n")
    capsys.readouterr()
    assert main(["config", "reference", "--out", str(out), "--check"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "stale" in err and "streamgrpo config reference --out" in err
    assert main(["config", "reference", "--check"]) == 2
    assert main(["config", "reference"]) == 0 and capsys.readouterr().out == render_reference()


def test_config_reference_command_runs_without_torch():
    code = ("import sys\nfrom streamgrpo.cli import main\nmain(['config', 'reference'])\n"
            "print('torch' in sys.modules, file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stderr.strip().splitlines()[-1] == "False"


def test_the_docs_show_commands_and_keys():  # the checkers below would pass vacuously otherwise
    texts = [p.read_text(encoding="utf-8") for p in DOCS]
    assert sum(len(commands_in(t)) for t in texts) >= 10
    assert sum(len(keys_in(t)) for t in texts) >= 10


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_commands_in_docs_parse(path):
    bad = bad_commands(path.read_text(encoding="utf-8"))
    assert bad == [], "commands the CLI does not accept:\n" + _report(path, bad)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_config_keys_in_docs_exist(path):
    unknown = unknown_keys(path.read_text(encoding="utf-8"))
    assert unknown == [], f"config keys that do not exist (keys: {REFERENCE.relative_to(REPO)}):\n" + _report(path, unknown)


def test_nothing_in_the_repo_points_outside_it():
    """The brief and spec the project began from lived beside the checkout (a folder named shared); the repo's own
    truth is docs/design.md, so no tracked file may point there."""
    OUTSIDE = "../" + "shared"  # spelt apart: this file is tracked too
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    pointing = [name for name in files.decode().split("\0") if name and (REPO / name).is_file()
                and OUTSIDE in (REPO / name).read_text(errors="ignore")]
    assert pointing == [], f"files that point at {OUTSIDE}: {pointing}"


def _design_map() -> dict[str, str]:
    """docs/design.md's map of the package: each folder's entry (``learner/``, ``learner/intake/``, ``""`` for
    the top-level modules) -> its text. An entry starts at a line indented 2 (a top folder or a top-level module)
    or 4 (a room inside the folder above) and runs on over its deeper-indented lines."""
    text = (REPO / "docs" / "design.md").read_text().split("## Layout", 1)[1]
    block = text.split("```\n", 2)[1]
    entries: dict[str, str] = {"": ""}
    key, parent = "", ""
    for line in block.splitlines()[1:]:  # the first line is "streamgrpo/"
        indent = len(line) - len(line.lstrip())
        if indent in (2, 4):
            first = line.split()[0]
            if not first.endswith("/"):
                key = ""
            elif indent == 2:
                key = parent = first
            else:
                key = parent + first
        entries[key] = entries.get(key, "") + "\n" + line
    return entries


def test_the_design_map_names_every_module_in_its_folder():
    """The map in docs/design.md matches the package: every folder has an entry, every module is named in its
    folder's entry, and every module an entry names exists there."""
    package = REPO / "streamgrpo"
    entries = _design_map()
    folders = {"" if p.parent == package else p.parent.relative_to(package).as_posix() + "/"
               for p in package.rglob("*.py") if p.name != "__init__.py"}
    assert sorted(folders - entries.keys()) == [], "package folders without an entry in docs/design.md's map"
    assert sorted(entries.keys() - folders) == [], "entries of docs/design.md's map that are not package folders"
    unnamed, stale = [], []
    for folder in folders:
        here = {p.name for p in (package / folder).glob("*.py")} - {"__init__.py"}
        named = set(re.findall(r"(?<![\w/.])(\w+\.py)\b", entries[folder]))
        unnamed += [folder + name for name in sorted(here - named)]
        stale += [folder + name for name in sorted(named - here)]
    assert unnamed == [], "modules the map in docs/design.md does not name"
    assert stale == [], "modules the map in docs/design.md names that are not there"
