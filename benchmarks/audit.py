"""Did every group get trained exactly once? An audit of a run directory and its Redis queue.

Sources: the producers' audit logs (``audit/generator-*.jsonl`` of streamgrpo's generators, and any
other ``audit/*.jsonl`` a producer writes with ``{"event": "produced", "group_id": ...}`` lines, see
docs/protocol.md: every group they put, by id), the groups the learner read (its ``consumed``
lines: groups from producers that keep no log are accounted from their first read on), the
learner's (``audit/learner.jsonl`` and ``learner-rank<R>.jsonl``: each rank's groups of every
step, rewound to the checkpoint on each resume, and every group it dropped or dead-lettered), the queue's dead letters, the entries still
in the stream, and the trained set in Redis (what was committed). :func:`tally` is the pure part
(logs in, :class:`RunAudit` out); :func:`audit_run` reads the files and asks Redis.

* ``lost``: produced, and neither trained, dropped with a reason, dead-lettered, nor still queued;
* ``twice``: the extra trainings of groups trained more than once in the surviving step log;
* ``uncommitted``: trained groups that Redis does not know as trained (expected 0 after a clean stop);
* the step log must run 1, 2, ..., N with the policy version equal to the step.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streamgrpo.runtime.jsonl import read_rows


@dataclass(frozen=True)
class RunAudit:
    produced: int
    trained: int  # distinct groups in the step log
    steps: int
    version: int  # policy version of the last step
    steps_in_order: bool  # steps 1..N, each once, version == step
    dropped: dict[str, int]  # by reason (learner), dead letters included
    queued: int  # produced groups still in the stream
    lost: int
    twice: int
    uncommitted: int
    resumes: int
    unlogged: int = 0  # produced groups known only from the learner's reads (their producer keeps no audit log)
    lost_ids: list[str] = field(default_factory=list)
    twice_ids: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.lost == 0 and self.twice == 0 and self.steps_in_order and self.uncommitted == 0

    def line(self) -> str:
        return f"lost: {self.lost}, twice: {self.twice}"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSON-lines file; a torn last line (a process killed mid-write) is skipped."""
    return read_rows(path)[0]


def tally(produced_rows: list[dict], learner_rows: list[dict], dead_ids: set[str], queued_ids: set[str],
          committed_ids: set[str], other_ranks: list[list[dict]] = ()) -> RunAudit:
    """The audit from the logs' rows and what Redis holds (pure). ``learner_rows``: rank 0's log (the
    step sequence); ``other_ranks``: the logs of ranks 1.. (their groups of each step, their drops)."""
    logged = {r["group_id"] for r in produced_rows if r.get("event") == "produced"}
    steps = [r for r in learner_rows if r.get("event") == "trained"]
    every = [learner_rows, *other_ranks]
    read = {r["group_id"] for rows in every for r in rows if r.get("event") == "consumed"}
    produced = logged | read
    counts = Counter(g for rows in every for r in rows if r.get("event") == "trained" for g in r.get("group_ids", []))
    dropped_rows = [r for rows in every for r in rows if r.get("event") == "dropped"]
    dropped = Counter(r.get("reason", "?") for r in dropped_rows)
    dropped_ids = {r["group_id"] for r in dropped_rows}
    extra_dead = dead_ids - dropped_ids  # dead-lettered by the queue itself (undecodable, failed too often)
    if extra_dead:
        dropped["dead_letter"] += len(extra_dead)
    accounted = set(counts) | dropped_ids | dead_ids | queued_ids
    lost = sorted(produced - accounted)
    twice = sorted(g for g, n in counts.items() if n > 1)
    in_order = [r.get("step") for r in steps] == list(range(1, len(steps) + 1)) and all(
        r.get("version") == r.get("step") for r in steps)
    return RunAudit(
        produced=len(produced), trained=len(counts), steps=len(steps), version=steps[-1]["version"] if steps else 0,
        steps_in_order=in_order, dropped=dict(dropped), queued=len(produced & queued_ids), lost=len(lost),
        twice=sum(n - 1 for n in counts.values() if n > 1), uncommitted=len(set(counts) - committed_ids),
        resumes=sum(r.get("event") == "resumed" for r in learner_rows), unlogged=len(read - logged),
        lost_ids=lost[:20], twice_ids=twice[:20],
    )


def audit_run(run_dir: str | Path, queue) -> RunAudit:
    """Audit ``run_dir`` against the queue (a :class:`~streamgrpo.transport.queue.base.GroupQueue`)."""
    run_dir = Path(run_dir)
    produced = [r for p in sorted((run_dir / "audit").glob("*.jsonl")) if not p.name.startswith("learner")
                for r in read_jsonl(p)]
    learner = read_jsonl(run_dir / "audit" / "learner.jsonl")
    ranks = [read_jsonl(p) for p in sorted((run_dir / "audit").glob("learner-rank*.jsonl"))]
    dead = {str(d.get("group_id", "")) for d in queue.dead_letters(None)}
    queued = {gid for _, gid, _ in queue.entries() if gid}
    trained_ids = sorted({g for rows in [learner, *ranks] for row in rows if row.get("event") == "trained"
                          for g in row.get("group_ids", [])})
    committed = {g for g, done in zip(trained_ids, queue.is_trained(trained_ids)) if done} if trained_ids else set()
    return tally(produced, learner, dead - {""}, queued, committed, ranks)
