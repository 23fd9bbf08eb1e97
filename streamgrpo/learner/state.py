"""What a learner carries between steps and saves in a checkpoint (:class:`LearnerState`), and a
group accepted for training (:class:`Accepted`)."""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from streamgrpo.data.prompts import processor_inputs

RECENT_GROUP_IDS = 10_000
"""Trained group ids a checkpoint remembers (the Redis trained set is the de-duplication truth)."""

@dataclass
class LearnerState:
    """Everything besides weights and optimizer that a checkpoint must restore (identical on every rank).

    ``committing``: the ``(stream id, group id)`` entries, of all ranks, whose training this
    checkpoint holds and that are committed in Redis right after it is written; a resumed learner
    commits them again (idempotent), in case it crashed in between.
    """

    step: int = 0
    version: int = 0
    groups_trained: int = 0
    dropped: Counter = field(default_factory=Counter)
    tokens_trained: int = 0
    recent_group_ids: deque = field(default_factory=lambda: deque(maxlen=RECENT_GROUP_IDS))
    committing: list = field(default_factory=list)
    data_cursor: dict = field(default_factory=dict)
    started_at: float = field(default_factory=time.time)
    _recent: set = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        self._recent = set(self.recent_group_ids)

    def remember(self, group_ids: list[str]) -> None:
        """Record trained group ids (the newest RECENT_GROUP_IDS are kept, in a checkpoint too)."""
        for gid in group_ids:
            if len(self.recent_group_ids) == self.recent_group_ids.maxlen:
                self._recent.discard(self.recent_group_ids[0])
            self.recent_group_ids.append(gid)
            self._recent.add(gid)

    def trained_recently(self, group_id: str) -> bool:
        return group_id in self._recent

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "version": self.version, "groups_trained": self.groups_trained,
                "dropped": dict(self.dropped), "tokens_trained": self.tokens_trained,
                "recent_group_ids": list(self.recent_group_ids), "committing": [list(e) for e in self.committing],
                "data_cursor": {k: list(v) for k, v in sorted(self.data_cursor.items())}}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LearnerState:
        return cls(step=d["step"], version=d["version"], groups_trained=d.get("groups_trained", 0),
                   dropped=Counter(d.get("dropped", {})), tokens_trained=d.get("tokens_trained", 0),
                   recent_group_ids=deque(d.get("recent_group_ids", []), maxlen=RECENT_GROUP_IDS),
                   committing=[tuple(e) for e in d.get("committing", [])],
                   data_cursor={k: (int(v[0]), int(v[1])) for k, v in d.get("data_cursor", {}).items()})


@dataclass
class Accepted:
    """A group that passed the checks, with its re-processed prompt inputs."""

    stream_id: str
    group: Any  # ScoredGroup
    inputs: Any  # processor outputs for the prompt
    staleness: int

    @classmethod
    def directly(cls, groups, processor, *, version: int = 0) -> list[Accepted]:
        """Groups fed to the learner without a queue (``check agreement``, tests, benchmarks): their prompts
        re-processed, their staleness against ``version``."""
        return [cls(f"direct-{i}", g, processor_inputs(processor, g.prompt_text, g.visuals),
                    version - int(g.policy_version)) for i, g in enumerate(groups)]
