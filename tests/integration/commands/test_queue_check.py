"""`streamgrpo queue check` finds each fault the learner would drop, from a file and from a real Redis
stream (which it leaves as it was); the learner's gate says why a prompt mismatches, in one warning.

Real demo mp4s, the tiny Qwen2.5-VL's processor, the real CLI in a subprocess.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def data(demo_data_dir, tmp_path_factory):
    return Path(shutil.copytree(demo_data_dir, tmp_path_factory.mktemp("qc") / "demo"))


@pytest.fixture(scope="module")
def good(tiny_model_dir, data):
    from benchmarks.rollouts import sample_groups

    return sample_groups(tiny_model_dir, data / "train.jsonl", 2, num_generations=2, max_tokens=4,
                         data_overrides=["data.kinds=[direction]"], media="reference")


def _faults(good) -> dict[str, object]:
    """One group per reason the learner drops, built from a good one."""
    g = good[0]
    v = g.visuals[0]
    big = replace(g.completions[0], token_ids=np.array([10**9, 1], np.int32), logprobs=np.zeros(2, np.float32),
                  versions=None)
    other = "0" * 31 + ("1" if v.ref.digest[-1] != "1" else "2")
    ids = g.prompt_ids.copy()
    ids[5] += 1
    return {
        "invalid": replace(g, group_id="bad-vocab", completions=[big, *g.completions[1:]]),
        "media_missing": replace(g, group_id="bad-file", visuals=[replace(v, frames=None,
                                                                          ref=replace(v.ref, path="videos/nope.mp4"))]),
        "media_mismatch": replace(g, group_id="bad-pixels", visuals=[replace(v, frames=None, ref=replace(
            v.ref, digest="xxh3_128:" + other))]),
        "mismatch": replace(g, group_id="bad-prompt", prompt_ids=ids),
        "zero_variance": replace(g, group_id="all-equal", completions=[replace(c, reward=0.5) for c in g.completions]),
    }


def _check(tiny_model_dir, data, *args):
    return subprocess.run([sys.executable, "-m", "streamgrpo", "queue", "check", "--config", "demo",
                           "--set", f"model.name_or_path={tiny_model_dir}", "--set", f"data.train_path={data / 'train.jsonl'}",
                           *args], env=ENV, capture_output=True, text=True, timeout=300)


def test_queue_check_names_every_drop_reason_from_a_file(good, tiny_model_dir, data, tmp_path):
    from streamgrpo.wire import encode, inline

    faults = _faults(good)
    path = tmp_path / "messages.bin"
    path.write_bytes(b"".join([encode(good[0]), encode(inline(good[1])), *(encode(f) for f in faults.values()),
                               b"SGRX" + bytes(12)]))
    out = _check(tiny_model_dir, data, "--file", str(path), "--set", "loss.drop_zero_variance=true")
    assert out.returncode == 1, out.stdout + out.stderr
    lines = [x for x in out.stdout.splitlines() if x.startswith(("OK", "DROP"))]
    assert len(lines) == 8 and "Traceback" not in out.stderr
    assert lines[0].startswith("OK") and "visuals reference" in lines[0]
    assert lines[1].startswith("OK") and "visuals inline" in lines[1]
    by_group = {line.split("group ")[1].split(":")[0].split(" ")[0]: line for line in lines}
    assert "invalid: completions[0].token_ids: token id 1000000000 is outside" in by_group["bad-vocab"]
    assert "media_missing: visuals[0]: media file" in by_group["bad-file"] and "nope.mp4 not found" in by_group["bad-file"]
    assert "media_mismatch: visuals[0]: media file" in by_group["bad-pixels"] and "other pixels" in by_group["bad-pixels"]
    n = len(good[0].prompt_ids)
    assert f"mismatch: prompt_ids: the message has {n} tokens, the learner's processor gives {n}" in by_group["bad-prompt"]
    assert "first difference at token 5" in by_group["bad-prompt"]
    assert lines[-1].startswith("DROP") and "malformed: message: bad magic" in lines[-1]
    assert "zero_variance: completions: all 2 rewards are 0.5 (loss.drop_zero_variance)" in by_group["all-equal"]
    assert out.stdout.splitlines()[-1] == ("8 message(s): 2 would train, 6 would be dropped (invalid 1, malformed 1, "
                                           "media_mismatch 1, media_missing 1, mismatch 1, zero_variance 1)")


def test_queue_check_reads_a_stream_without_consuming_it(good, tiny_model_dir, data, redis_server, redis_ns):
    from streamgrpo.transport.queue.redis_stream import RedisQueue

    q = RedisQueue(redis_server.url, namespace=redis_ns, consumer="producer")
    try:
        q.put_many([good[1], _faults(good)["mismatch"]])
        before = q.client.xinfo_groups(q.stream)
        out = _check(tiny_model_dir, data, "--set", f"queue.url={redis_server.url}", "--set", f"queue.namespace={redis_ns}")
        assert out.returncode == 1, out.stdout + out.stderr
        assert out.stdout.splitlines()[-1] == "2 message(s): 1 would train, 1 would be dropped (mismatch 1)"
        assert q.client.xlen(q.stream) == 2 and q.client.xinfo_groups(q.stream) == before  # nothing read by a group
        q.client.xdel(q.stream, *[sid for sid, _ in q.client.xrange(q.stream)][1:])  # the good one alone: exit 0
        ok = _check(tiny_model_dir, data, "--set", f"queue.url={redis_server.url}", "--set", f"queue.namespace={redis_ns}")
        assert ok.returncode == 0 and ok.stdout.splitlines()[-1] == "1 message(s): 1 would train"
    finally:
        q.close()


def test_gate_says_why_a_prompt_mismatches_in_one_warning(good, tiny_model_dir, data, tmp_path, caplog):
    """Two mismatched groups in a row: one warning with both lengths and the first differing token,
    both counted and audited with the reason."""
    from streamgrpo.config import load_config
    from streamgrpo.learner.intake.gate import Gate
    from streamgrpo.learner.intake.media import MediaResolver
    from streamgrpo.learner.state import LearnerState
    from streamgrpo.models.loading import load_processor
    from streamgrpo.runtime.jsonl import JsonlWriter
    from streamgrpo.transport.queue.base import Delivery

    class Acks:
        def ack(self, ids):
            self.acked = ids

    cfg = load_config("demo", [f"data.train_path={data / 'train.jsonl'}"])
    audit = JsonlWriter(tmp_path / "audit.jsonl")
    gate = Gate(Acks(), cfg.loss, LearnerState(), audit, load_processor(str(tiny_model_dir)), 10**6,
                media=MediaResolver(cfg.data), max_staleness=cfg.learner.max_staleness)
    bad = _faults(good)["mismatch"]
    with caplog.at_level(logging.WARNING, logger="streamgrpo.learner"):
        assert gate.admit(Delivery("1-0", bad)) is None
        assert gate.admit(Delivery("2-0", replace(bad, group_id="bad-prompt-2"))) is None
    warnings = [r.getMessage() for r in caplog.records if "dropped as mismatch" in r.getMessage()]
    assert len(warnings) == 1 and "first difference at token 5" in warnings[0] and "bad-prompt" in warnings[0]
    assert gate.drops == {"mismatch": 2}
    audit.close()
    import json

    rows = [json.loads(x) for x in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert [r["event"] for r in rows] == ["consumed", "dropped"] * 2
    dropped = [r for r in rows if r["event"] == "dropped"]
    assert [r["reason"] for r in dropped] == ["mismatch", "mismatch"] and all("first difference" in r["why"] for r in dropped)
