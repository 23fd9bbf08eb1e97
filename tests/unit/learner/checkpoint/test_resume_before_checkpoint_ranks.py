"""A learner killed before its first checkpoint on more ranks than the next start has: the next start (step 0)
trims every learner audit log the audit reads, the absent ranks' too (else their groups count twice)."""

from __future__ import annotations

import json

from streamgrpo.learner.distributed import DistInfo
from streamgrpo.learner.loop import _resume_or_reset


class FakeQueue:
    reset = 0

    def reset_committed_step(self):
        self.reset += 1


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_no_checkpoint_trims_the_audits_of_absent_ranks(tmp_path):
    audit = tmp_path / "audit"
    audit.mkdir()
    rows = [{"event": "consumed", "group_id": "g1"}, {"event": "trained", "step": 1, "version": 1, "group_ids": ["g1"]}]
    for name in ("learner.jsonl", "learner-rank1.jsonl"):
        _write(audit / name, rows)
    _write(tmp_path / "metrics.jsonl", [{"step": 1}])
    queue = FakeQueue()
    again = _resume_or_reset(None, None, queue, audit / "learner.jsonl", tmp_path, DistInfo(), resume=True)
    assert again and queue.reset == 1
    for name in ("learner.jsonl", "learner-rank1.jsonl"):
        assert [json.loads(x)["event"] for x in (audit / name).read_text().splitlines()] == ["consumed"], name
    assert (tmp_path / "metrics.jsonl").read_text() == ""
