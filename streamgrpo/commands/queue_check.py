"""``streamgrpo queue check``: the learner's checks on messages, without training them.

For a producer written outside streamgrpo (docs/protocol.md): each message of a file (ScoredGroup
frames one after another, as ``wire.encode`` writes them) or of the run's Redis stream (read with
XRANGE: nothing is consumed, acknowledged or changed) is decoded and put through what the learner
checks before a step (:mod:`streamgrpo.learner.intake.checks`: the wire contract, the model's vocabulary,
visuals by reference, the re-processed prompt; with ``loss.drop_zero_variance`` equal rewards), with
the learner's own processor and media root.
One line per message (``OK`` or ``DROP`` with the reason the learner would count and the field);
exit code 0 when every message would train, 1 otherwise. Staleness depends on the learner's version
at the time and is not checked.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from streamgrpo.advantages import is_zero_variance
from streamgrpo.commands.args import load
from streamgrpo.config import Config
from streamgrpo.learner.intake.checks import Problem, check_group
from streamgrpo.learner.intake.limits import GroupLimits, too_large
from streamgrpo.learner.intake.media import MediaResolver
from streamgrpo.models.loading import load_processor
from streamgrpo.transport.queue.factory import queue_url
from streamgrpo.wire import WireError, decode
from streamgrpo.wire.arrays import _ALIGN, _HEAD


def file_messages(path: str | Path) -> Iterator[tuple[str, bytes]]:
    """``(where, message bytes)`` for each frame of a file of concatenated messages; a truncated tail
    is yielded as it is (its decode then says what is wrong)."""
    data = Path(path).read_bytes()
    at, i = 0, 0
    while at < len(data):
        if len(data) - at < _HEAD.size:
            yield f"{path}#{i} (byte {at})", data[at:]
            return
        _magic, hlen, blen = _HEAD.unpack_from(data, at)
        body_start = _HEAD.size + hlen + (-(_HEAD.size + hlen) % _ALIGN)
        end = at + body_start + blen
        yield f"{path}#{i} (byte {at})", data[at:min(end, len(data))]
        at, i = end, i + 1


def stream_messages(queue, count: int) -> Iterator[tuple[str, bytes, str]]:
    """``(where, message bytes, entry group id)`` of the stream's first ``count`` entries (XRANGE)."""
    for sid, gid, data in queue.entries(count):
        yield f"{queue.stream} {sid}", data, gid


def vocab_size(model_path: str) -> int:
    """Token ids the model can embed, from its config alone (no weights loaded)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_path)
    return int(getattr(getattr(cfg, "text_config", None), "vocab_size", None) or cfg.vocab_size)


def check_message(data: bytes, processor, vocab: int, media, max_bytes: int, entry_gid: str = "",
                  drop_zero_variance: bool = False, limits=None):
    """``(group id or "?", Problem or None, group or None)`` for one message; with
    ``drop_zero_variance`` (``loss.drop_zero_variance``) a group whose rewards are all equal is dropped too;
    ``limits`` (:class:`~streamgrpo.learner.intake.limits.GroupLimits`): a group over them is ``too_large``."""

    try:
        group = decode(data, max_bytes=max_bytes)
    except WireError as exc:
        return entry_gid or "?", Problem("malformed", str(exc)), None
    if entry_gid and entry_gid != group.group_id:
        return entry_gid, Problem("malformed", f"group_id: entry says {entry_gid!r}, message says {group.group_id!r}"), None
    why = too_large(group, limits) if limits is not None else None
    if why is not None:
        return group.group_id, Problem("too_large", why), group
    if drop_zero_variance and is_zero_variance([c.reward for c in group.completions]):
        return group.group_id, Problem("zero_variance", f"completions: all {len(group.completions)} rewards are "
                                                        f"{group.completions[0].reward!r} (loss.drop_zero_variance)"), group
    group, _inputs, problem = check_group(group, processor, vocab, media)
    return group.group_id, problem, group


def run_queue_check(cfg: Config, *, file: str | None = None, count: int = 100, out: TextIO = sys.stdout) -> int:

    processor = load_processor(cfg.model.name_or_path)
    vocab = vocab_size(cfg.model.name_or_path)
    media = MediaResolver(cfg.data, cache_mib=cfg.learner.media_cache_mib,
                          max_source_pixels=cfg.learner.max_source_pixels)
    max_bytes = int(cfg.queue.max_message_mib * (1 << 20))
    limits = GroupLimits.from_config(cfg)
    queue = None
    try:
        if file is not None:
            items = ((where, data, "") for where, data in file_messages(file))
        else:
            from streamgrpo.transport.queue.factory import open_queue

            queue = open_queue(cfg.queue, queue_url(cfg.queue, Path(cfg.run_dir)), consumer="queue-check")
            items = stream_messages(queue, count)
        verdicts: Counter = Counter()
        for where, data, gid in items:
            gid, problem, group = check_message(data, processor, vocab, media, max_bytes, gid,
                                                drop_zero_variance=cfg.loss.drop_zero_variance,
                                                limits=limits)
            if problem is None:
                kinds = sorted({"reference" if v.ref is not None else "inline" for v in group.visuals}) or ["none"]
                print(f"OK    {where}: group {gid} (v{group.policy_version}, {len(group.completions)} completions, "
                      f"visuals {'+'.join(kinds)})", file=out)
                verdicts["ok"] += 1
            else:
                print(f"DROP  {where}: group {gid}: {problem.label}: {problem.reason}", file=out)
                verdicts[problem.label] += 1
    finally:
        media.close()
        if queue is not None:
            queue.close()
    total = sum(verdicts.values())
    dropped = {k: n for k, n in sorted(verdicts.items()) if k != "ok"}
    print(f"{total} message(s): {verdicts['ok']} would train"
          + (f", {sum(dropped.values())} would be dropped ({', '.join(f'{k} {n}' for k, n in dropped.items())})"
             if dropped else ""), file=out)
    return 0 if total and not dropped else 1


def main(args) -> int:
    return run_queue_check(load(args), file=args.file, count=args.count)
