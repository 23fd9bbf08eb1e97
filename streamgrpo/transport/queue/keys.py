"""Every Redis key this project uses, in one place (``ns`` = ``queue.namespace``).

The queue (:mod:`.redis_stream`), consumer side (:mod:`.redis_consumer`) and producer side (:mod:`.redis_producer`):

* ``<ns>:groups`` -- the stream. Entry fields: ``g`` (group id, read without decoding) and ``d``
  (the :mod:`streamgrpo.wire` message). Consumer group ``learner``; one consumer per learner rank.
* ``<ns>:dead`` -- dead letters: undecodable, invalid or untrainable entries with the reason, the
  original stream id, the group id and (when small) the raw bytes. Capped at about 10 000 entries.
* ``<ns>:held`` -- group id -> stream id of every entry a learner has accepted and not yet
  committed: the claim that makes a second entry with the same group id a duplicate.
* ``<ns>:trained`` -- group ids whose training is committed (in a checkpoint), with the time.
* ``<ns>:failures`` -- group id -> how many training attempts failed (and ``<gid>:err``, the last error).
* ``<ns>:committed_step`` -- the highest checkpoint step whose groups are committed.
* ``<ns>:cursor`` -- the data cursor: ``"<num_shards>/<shard>"`` -> ``"<epoch> <position> <step>"``, the furthest
  record of each generator shard the learner consumed (trained or dropped), committed with the groups of
  checkpoint ``<step>``.
* ``<ns>:sync:<version>`` -- on-policy mode (``up --sync``): the slots of a step's groups the generators have
  claimed for that policy version (expires after a day).

The learner's crash-loop breaker (:mod:`.crash_marks`):

* ``<ns>:stepping:<consumer>`` -- the step a learner rank is in, with the witness of its state.
* ``<ns>:reading:<consumer>`` -- the groups that rank decodes outside a step (read-ahead).
* ``<ns>:crash_starts`` -- group id -> learner starts that found it in a dead learner's step or decode.
"""

from __future__ import annotations

from dataclasses import dataclass

CONSUMER_GROUP = "learner"  # the stream's one consumer group: every learner rank is a consumer in it


@dataclass(frozen=True)
class Keys:
    namespace: str

    @property
    def stream(self) -> str:
        return f"{self.namespace}:groups"

    @property
    def dead(self) -> str:
        return f"{self.namespace}:dead"

    @property
    def held(self) -> str:
        return f"{self.namespace}:held"

    @property
    def trained(self) -> str:
        return f"{self.namespace}:trained"

    @property
    def failures(self) -> str:
        return f"{self.namespace}:failures"

    @property
    def committed_step(self) -> str:
        return f"{self.namespace}:committed_step"

    @property
    def cursor(self) -> str:
        return f"{self.namespace}:cursor"

    @property
    def crash_starts(self) -> str:
        return f"{self.namespace}:crash_starts"

    def sync(self, version: int) -> str:
        return f"{self.namespace}:sync:{int(version)}"

    def stepping(self, consumer: str) -> str:
        return f"{self.namespace}:stepping:{consumer}"

    def reading(self, consumer: str) -> str:
        return f"{self.namespace}:reading:{consumer}"
