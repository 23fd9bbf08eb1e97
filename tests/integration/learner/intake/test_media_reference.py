"""Visuals by reference: real demo mp4s and PNGs, the tiny Qwen2.5-VL, a real Redis.

A group whose visuals travel by reference must train on exactly the pixels the generator used: the
learner decodes them again and checks the digest. A changed or missing file is a dead letter that
names the file; a schema-2 (inline) message from the previous release still trains.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from streamgrpo import metrics


def value(metric, **labels) -> float:
    return (metric.labels(**labels) if labels else metric)._value.get()


def _copy(demo_data_dir, dst: Path) -> Path:
    shutil.copytree(demo_data_dir, dst)
    return dst


def _sample(model_dir, data: Path, n: int, kinds: str, seed: int = 0, records: str = "train.jsonl"):
    from benchmarks.rollouts import sample_groups

    return sample_groups(model_dir, data / records, n, num_generations=2, max_tokens=4, seed=seed,
                         data_overrides=[f"data.kinds={kinds}"], media="reference")


@pytest.fixture(scope="module")
def media(demo_data_dir, tmp_path_factory):
    return _copy(demo_data_dir, tmp_path_factory.mktemp("media") / "demo")


@pytest.fixture(scope="module")
def mixed(tiny_model_dir, media):
    """A video, a multi-video and an image group, by reference."""
    return (_sample(tiny_model_dir, media, 1, "[direction]") + _sample(tiny_model_dir, media, 1, "[multi_video]")
            + _sample(tiny_model_dir, media, 1, "null", records="train_image.jsonl"))


def _cfg(model_dir, data: Path, run_dir, *sets):
    from streamgrpo.config import load_config

    return load_config("demo", [f"model.name_or_path={model_dir}", f"run_dir={run_dir}",
                                f"data.train_path={data / 'train.jsonl'}", "learner.groups_per_step=2",
                                "learner.get_timeout_s=0.5", "weights.pub_port=0", "weights.snapshot_port=0",
                                "metrics.port=0", "learner.max_staleness=100", *sets])


def _logprobs(learner, accepted) -> torch.Tensor:
    from streamgrpo.models.batching import GroupInputs, build_batch

    groups = [GroupInputs.from_processor(a.inputs, [torch.from_numpy(np.asarray(c.token_ids, dtype=np.int64))
                                                    for c in a.group.completions]) for a in accepted]
    with torch.no_grad():
        return learner.forward(build_batch(groups, learner.processor.tokenizer.pad_token_id))[0]


def test_a_group_by_reference_trains_on_the_generators_pixels_exactly(mixed, tiny_model_dir, media, tmp_path):
    """Video, multi-video and image groups: the message is a fraction of the inline one; the learner
    decodes the same pixels (bit-exact) and computes the same log-probs; a second read hits the cache."""
    from streamgrpo.learner.intake.media import MediaResolver
    from streamgrpo.learner.state import Accepted
    from streamgrpo.learner.trainer import Learner
    from streamgrpo.wire import decode, encode, inline

    cfg = _cfg(tiny_model_dir, media, tmp_path / "run")
    assert [len(g.visuals) > 1 for g in mixed] == [False, True, False]
    assert [v.kind for v in mixed[2].visuals] == ["image"]
    by_ref = [decode(encode(g)) for g in mixed]
    by_pixels = [decode(encode(inline(g))) for g in mixed]
    for g, sent in zip(mixed, by_ref):
        assert all(v.frames is None and v.ref is not None and not Path(v.ref.path).is_absolute() for v in sent.visuals)
        assert len(encode(g)) < len(encode(inline(g)))  # (the ratio at real sizes is in benchmarks/bench_media.py)
    resolver = MediaResolver(cfg.data, cache_mib=64)
    misses0, hits0 = value(metrics.MEDIA_CACHE, result="miss"), value(metrics.MEDIA_CACHE, result="hit")
    resolved = [resolver.resolve(g) for g in by_ref]
    n_visuals = sum(len(g.visuals) for g in mixed)
    assert value(metrics.MEDIA_CACHE, result="miss") - misses0 == n_visuals
    for a, b in zip(resolved, by_pixels):
        for va, vb in zip(a.visuals, b.visuals):
            assert va.frames.dtype == np.uint8 and np.array_equal(va.frames, vb.frames)
    learner = Learner(cfg)
    lp_ref = _logprobs(learner, Accepted.directly(resolved, learner.processor))
    lp_inline = _logprobs(learner, Accepted.directly(by_pixels, learner.processor))
    assert torch.equal(lp_ref, lp_inline)
    again = resolver.resolve(by_ref[1])
    assert value(metrics.MEDIA_CACHE, result="hit") - hits0 == len(mixed[1].visuals)
    assert all(np.array_equal(x.frames, y.frames) for x, y in zip(again.visuals, resolved[1].visuals))
    resolver.close()


def test_tgrpo_group_by_reference_names_the_ordered_frames(tiny_model_dir, media, tmp_path):
    """T-GRPO: the group sent is the ordered one; its references resolve to the ordered frames."""
    from streamgrpo.config import TemporalContrastConfig
    from streamgrpo.data.dataset import iter_samples
    from streamgrpo.data.prompts import vision_factors
    from streamgrpo.data.records import load_records
    from streamgrpo.engines.base import SamplingParams
    from streamgrpo.engines.hf import HFEngine
    from streamgrpo.generator.sampling import Sampler
    from streamgrpo.learner.intake.media import MediaResolver
    from streamgrpo.models.loading import load_model, load_processor
    from streamgrpo.rewards import RewardSet
    from streamgrpo.wire import decode, encode

    cfg = _cfg(tiny_model_dir, media, tmp_path / "run", "data.min_frames=4", "data.max_frames=4",
               "rollout.max_completion_length=4", "rollout.num_generations=2", "data.kinds=[direction]")
    cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={
        "temporal_contrast": TemporalContrastConfig(num_generations=2)})})
    processor = load_processor(str(tiny_model_dir))
    engine = HFEngine(load_model(cfg.model, "cpu"), processor)
    factor, temporal = vision_factors(processor)
    samples = iter_samples(load_records(cfg.data.train_path, cfg.data), cfg.data, shard=0, num_shards=1, seed=0,
                           epochs=None, factor=factor, temporal_patch=temporal)
    chunk = [next(samples) for _ in range(2)]
    sampler = Sampler(engine, processor, cfg, SamplingParams.from_config(cfg.rollout), RewardSet(cfg), "g0",
                      np.random.default_rng(0))
    groups = sampler.groups(chunk)
    assert all("temporal" in g.meta for g in groups)
    resolver = MediaResolver(cfg.data)
    for (_record, visuals), g in zip(chunk, groups):
        sent = decode(encode(g))
        assert all(v.frames is None for v in sent.visuals)
        got = resolver.resolve(sent)
        assert all(np.array_equal(v.frames, w.frames) for v, w in zip(got.visuals, visuals))  # ordered, not shuffled
    resolver.close()


def test_changed_and_missing_files_are_dead_letters_that_name_the_file(tiny_model_dir, demo_data_dir, redis_server,
                                                                       redis_ns, tmp_path):
    """Through a real Redis stream and the learner's gate: the untouched group is admitted, the one
    whose file was rewritten with other frames is ``media_mismatch``, the one whose file is gone
    ``media_missing``; each reason names its file."""
    from streamgrpo.config import load_config
    from streamgrpo.learner.intake.gate import Gate
    from streamgrpo.learner.intake.media import MediaResolver, ReadAhead
    from streamgrpo.learner.state import LearnerState
    from streamgrpo.models.loading import load_processor
    from streamgrpo.runtime.jsonl import JsonlWriter
    from streamgrpo.transport.queue.redis_stream import RedisQueue

    data = _copy(demo_data_dir, tmp_path / "demo")
    groups = _sample(tiny_model_dir, data, 6, "[direction]", seed=3)
    files = {}  # one group per distinct clip
    for g in groups:
        files.setdefault(g.visuals[0].ref.path, g)
    assert len(files) >= 3, "the demo sample should name three different clips"
    (keep, keep_g), (change, change_g), (gone, gone_g) = list(files.items())[:3]
    shutil.copyfile(data / keep, data / change)  # the same size class of file, other frames
    (data / gone).unlink()
    cfg = load_config("demo", [f"data.train_path={data / 'train.jsonl'}"])
    q = RedisQueue(redis_server.url, namespace=redis_ns, consumer="learner-0")
    try:
        q.put_many([keep_g, change_g, gone_g])
        resolver = MediaResolver(cfg.data, cache_mib=16)
        audit = JsonlWriter(tmp_path / "audit.jsonl")
        gate = Gate(q, cfg.loss, LearnerState(), audit, load_processor(str(tiny_model_dir)), 10**6, media=resolver,
                    max_staleness=cfg.learner.max_staleness)
        source = ReadAhead(q, resolver, ahead=2)
        deliveries = source.get(3, timeout_s=5.0)
        admitted = [a for a in (gate.admit(d) for d in deliveries) if a is not None]
        assert [a.group.group_id for a in admitted] == [keep_g.group_id]
        assert all(v.frames is not None for v in admitted[0].group.visuals)
        dead = {d["group_id"]: d for d in q.dead_letters()}
        assert str(data / change) in dead[change_g.group_id]["reason"]
        assert "other pixels" in dead[change_g.group_id]["reason"]
        assert str(data / gone) in dead[gone_g.group_id]["reason"] and "not found" in dead[gone_g.group_id]["reason"]
        assert gate.drops == {"media_mismatch": 1, "media_missing": 1}
        audit.close()
        reasons = [r["reason"] for x in (tmp_path / "audit.jsonl").read_text().splitlines()
                   for r in [json.loads(x)] if r["event"] == "dropped"]
        assert sorted(reasons) == ["media_mismatch", "media_missing"]
        resolver.close()
    finally:
        q.close()


def test_learner_trains_references_and_a_schema_2_inline_message(mixed, tiny_model_dir, media, redis_server,
                                                                  redis_ns, tmp_path):
    """A whole learner run: groups by reference (read ahead, decoded while a step trains) and a message
    as the previous release's generators wrote it (schema 2, pixels inline) all train; nothing is
    dead-lettered; every referenced visual was decoded by the learner."""
    from dataclasses import replace

    from benchmarks.audit import audit_run
    from streamgrpo.learner.loop import run_learner
    from streamgrpo.transport.queue.redis_stream import RedisQueue
    from streamgrpo.wire import encode, inline

    old = replace(inline(mixed[0]), group_id="schema-2", schema=2)
    old_message = encode(old)
    assert b"\xa6schema\x02" in old_message and b"ref" not in old_message
    q = RedisQueue(redis_server.url, namespace=redis_ns, consumer="producer")
    misses0 = value(metrics.MEDIA_CACHE, result="miss")
    try:
        q.put_many([replace(g, group_id=f"ref-{i}") for i, g in enumerate(mixed)])
        q.client.xadd(q.stream, {b"g": b"schema-2", b"d": old_message})
        run = tmp_path / "run"
        assert run_learner(_cfg(tiny_model_dir, media, run, f"queue.url={redis_server.url}",
                                f"queue.namespace={redis_ns}", "learner.max_steps=2")) == 0
        trained = [g for line in (run / "audit" / "learner.jsonl").read_text().splitlines()
                   for e in [json.loads(line)] if e["event"] == "trained" for g in e["group_ids"]]
        assert sorted(trained) == ["ref-0", "ref-1", "ref-2", "schema-2"]
        assert q.dead_letters() == [] and q.depth() == 0 and q.held_count() == 0
        audit = audit_run(run, q)  # no producer kept a log: every group is accounted from the learner's reads
        assert audit.ok and audit.produced == audit.unlogged == 4 and audit.trained == 4
        assert value(metrics.MEDIA_CACHE, result="miss") - misses0 == sum(len(g.visuals) for g in mixed)
    finally:
        q.close()


def test_long_clips_decode_in_chunks_to_the_same_pixels(tmp_path):
    """Past DECODE_CHUNK frames, decoding goes chunk by chunk (bounded memory) to the same pixels."""
    from streamgrpo.data.video import DECODE_CHUNK, decode_resized
    from streamgrpo.recipes.demo.data import write_mp4

    rng = np.random.default_rng(0)
    n = DECODE_CHUNK + 9
    write_mp4(tmp_path / "long.mp4", rng.integers(0, 256, (n, 64, 64, 3), dtype=np.uint8))
    idx = list(range(n))
    whole = decode_resized("video", str(tmp_path / "long.mp4"), idx, 56, 56, "auto")
    parts = [decode_resized("video", str(tmp_path / "long.mp4"), idx[i:i + 20], 56, 56, "auto") for i in (0, 20, 40)]
    assert whole.shape == (n, 56, 56, 3) and np.array_equal(whole, np.concatenate(parts))


def _unresolvable(good, media: Path, outside: Path, n: int) -> list:
    """``n`` groups by reference the learner must refuse, four kinds in turn: a missing file, a symlink
    inside the root to a copy of the group's own clip outside it (the pixels match: only the boundary
    refuses it), /proc/self/environ, and a path that climbs out with ``../``."""
    v = good.visuals[0]
    shutil.copyfile(media / v.ref.path, outside)
    link = media / "videos" / "escape.mp4"
    link.unlink(missing_ok=True)
    link.symlink_to(outside)
    paths = ["videos/nope.mp4", "videos/escape.mp4", "/proc/self/environ", "../../../../etc/passwd"]
    return [replace(good, group_id=f"bad-{i}", visuals=[replace(v, ref=replace(v.ref, path=paths[i % 4]))])
            for i in range(n)]


def test_many_unresolvable_references_among_good_groups_are_dead_letters_and_training_goes_on(
        mixed, tiny_model_dir, media, redis_server, redis_ns, tmp_path):
    """40 references the learner cannot (or must not) resolve, in runs of 20 between good groups: each
    is dead-lettered with its reason (a symlink out of the root names where it leads), every good group
    trains, and the audit accounts for all: lost 0, twice 0."""
    from benchmarks.audit import audit_run
    from streamgrpo.learner.loop import run_learner
    from streamgrpo.transport.queue.redis_stream import RedisQueue
    from streamgrpo.wire import decode, encode

    good = [replace(mixed[i % 3], group_id=f"ref-{i}") for i in range(6)]
    bad = _unresolvable(decode(encode(mixed[0])), media, tmp_path / "outside.mp4", 40)
    q = RedisQueue(redis_server.url, namespace=redis_ns, consumer="producer")
    try:
        q.put_many(good[:2] + bad[:20] + good[2:4] + bad[20:] + good[4:])
        run = tmp_path / "run"
        assert run_learner(_cfg(tiny_model_dir, media, run, f"queue.url={redis_server.url}",
                                f"queue.namespace={redis_ns}", "learner.max_steps=3")) == 0
        trained = [g for line in (run / "audit" / "learner.jsonl").read_text().splitlines()
                   for e in [json.loads(line)] if e["event"] == "trained" for g in e["group_ids"]]
        assert sorted(trained) == [f"ref-{i}" for i in range(6)]
        dead = {d["group_id"]: d for d in q.dead_letters(count=100)}
        assert sorted(dead) == sorted(g.group_id for g in bad)
        reasons = [dead[f"bad-{i}"]["reason"] for i in range(4)]
        assert "nope.mp4 not found" in reasons[0]
        assert f"lies outside data.media_root ({media}) (a symlink: it resolves to {tmp_path / 'outside.mp4'})" \
            in reasons[1]
        assert "'/proc/self/environ' lies outside data.media_root" in reasons[2]
        assert "lies outside data.media_root" in reasons[3]
        audit = audit_run(run, q)
        assert audit.ok and audit.lost == 0 and audit.twice == 0 and audit.trained == 6
        assert audit.dropped == {"media_missing": 10, "media_outside": 30}
    finally:
        (media / "videos" / "escape.mp4").unlink(missing_ok=True)
        q.close()


def test_a_learner_whose_media_root_is_removed_stops_in_one_line_after_the_configured_time(
        mixed, tiny_model_dir, redis_server, redis_ns, tmp_path):
    """The media root is gone on this machine: references keep failing (a producer sends one every half
    second), and after learner.media_unavailable_s without any resolved the learner stops: exit 1, one
    line that names the root, no traceback; the learner went on past the first failure."""
    import os
    import subprocess
    import sys
    import threading

    from streamgrpo.transport.queue.redis_stream import RedisQueue

    gone = tmp_path / "gone"
    cfg = _cfg(tiny_model_dir, gone, tmp_path / "run", f"queue.url={redis_server.url}",
               f"queue.namespace={redis_ns}", "learner.media_unavailable_s=3")
    (tmp_path / "learner.yaml").write_text(cfg.to_yaml())
    q = RedisQueue(redis_server.url, namespace=redis_ns, consumer="producer")
    done = threading.Event()

    def produce():
        i = 0
        while not done.wait(0.5):
            q.put_many([replace(mixed[0], group_id=f"unreadable-{i}")])
            i += 1

    feeder = threading.Thread(target=produce, daemon=True)
    feeder.start()
    try:
        out = subprocess.run([sys.executable, "-m", "streamgrpo", "learner", "--config", str(tmp_path / "learner.yaml")],
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    finally:
        done.set()
        feeder.join(5)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    (line,) = [x for x in out.stderr.splitlines() if x.startswith("streamgrpo learner:")]
    assert "stopping: no group by reference could be resolved here for" in line
    assert f"data.media_root {gone} is not a directory here" in line
    waited = int(line.split("resolved here for ")[1].split(" s")[0])
    assert waited >= 3
    assert len(q.dead_letters(count=100)) >= 2  # it went on past the first failure
    q.close()


def test_media_behind_a_symlink_out_of_the_root_travel_inline_and_train(tiny_model_dir, demo_data_dir, redis_server,
                                                                        redis_ns, tmp_path):
    """What the generator and the learner agree on: the data set's videos folder is a symlink to storage
    outside the records' folder. The learner would refuse such references (media_outside), so the
    generator sends those visuals inline; the learner admits the groups, nothing is dead-lettered."""
    from streamgrpo.config import load_config
    from streamgrpo.learner.intake.gate import Gate
    from streamgrpo.learner.intake.media import MediaResolver, by_reference
    from streamgrpo.learner.state import LearnerState
    from streamgrpo.models.loading import load_processor
    from streamgrpo.runtime.jsonl import JsonlWriter
    from streamgrpo.transport.queue.redis_stream import RedisQueue
    from streamgrpo.wire import decode, encode

    data = _copy(demo_data_dir, tmp_path / "data")
    (tmp_path / "store").mkdir()
    shutil.move(str(data / "videos"), str(tmp_path / "store" / "videos"))
    (data / "videos").symlink_to(tmp_path / "store" / "videos")
    groups = _sample(tiny_model_dir, data, 2, "[direction]", seed=5)
    assert all(v.ref is None and v.frames is not None for g in groups for v in g.visuals)
    assert not any(by_reference(decode(encode(g))) for g in groups)
    cfg = load_config("demo", [f"data.train_path={data / 'train.jsonl'}"])
    q = RedisQueue(redis_server.url, namespace=redis_ns, consumer="learner-0")
    try:
        q.put_many(groups)
        resolver = MediaResolver(cfg.data, cache_mib=16)
        gate = Gate(q, cfg.loss, LearnerState(), JsonlWriter(tmp_path / "audit.jsonl"),
                    load_processor(str(tiny_model_dir)), 10**6, media=resolver,
                    max_staleness=cfg.learner.max_staleness)
        admitted = [gate.admit(d) for d in q.get(2, timeout_s=5.0)]
        assert [a.group.group_id for a in admitted if a is not None] == [g.group_id for g in groups]
        assert q.dead_letters() == []
        resolver.close()
    finally:
        q.close()
