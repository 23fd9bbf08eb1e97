"""A generator whose engine runs out of memory (issue 49), with the real tiny Qwen2.5-VL, the real
HF engine and demo mp4s: ``torch.OutOfMemoryError`` is injected into ``HFEngine.generate`` (a CPU
has no device memory to run out of), the rest is the generator's own code.

* a batch of 4 prompts that runs out of memory is sampled again in halves: 4 complete groups, in
  the chunk's order, none twice; the next batches are taken at 2 prompts and never run out again;
* through the whole generator loop and a real Redis stream: every record's group arrives once;
* where one prompt alone does not fit, the generator stops with one line and sends nothing.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from streamgrpo import metrics
from streamgrpo.engines.hf import HFEngine
from streamgrpo.generator.applier import WeightApplier


def _cfg(model_dir, data: Path, run_dir, *sets):
    from streamgrpo.config import load_config

    return load_config("demo", [f"model.name_or_path={model_dir}", f"run_dir={run_dir}",
                                f"data.train_path={data / 'train.jsonl'}", "demo.tiny_model=false",
                                "demo.make_data=false", "data.min_frames=4", "data.max_frames=4",
                                "rollout.max_completion_length=4", "rollout.num_generations=2",
                                "rollout.prompts_per_batch=4", "weights.pub_port=0", "weights.snapshot_port=0",
                                "metrics.port=0", *sets])


def oom_above(monkeypatch, limit: int, times: int | None = None) -> list[int]:
    """``HFEngine.generate`` raises ``torch.OutOfMemoryError`` for more than ``limit`` prompts (the first
    ``times`` such calls; None: every one); returns the sizes of the calls that sampled."""
    real, sampled, failed = HFEngine.generate, [], []

    def generate(self, requests, sampling, between_steps=None):
        if len(requests) > limit and (times is None or len(failed) < times):
            failed.append(len(requests))
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected: {len(requests)} prompts)")
        sampled.append(len(requests))
        return real(self, requests, sampling, between_steps)

    monkeypatch.setattr(HFEngine, "generate", generate)
    return sampled


def oom_count() -> float:
    return metrics.ERRORS.labels(kind="generator_oom")._value.get()


def test_a_batch_that_runs_out_of_memory_is_sampled_in_halves_and_stays_halved(tiny_model_dir, demo_data_dir,
                                                                                tmp_path, monkeypatch, caplog):
    from streamgrpo.data.dataset import iter_samples
    from streamgrpo.data.prompts import vision_factors
    from streamgrpo.data.records import load_records
    from streamgrpo.engines.base import SamplingParams
    from streamgrpo.generator.sampling import Sampler
    from streamgrpo.models.loading import load_model, load_processor
    from streamgrpo.rewards import RewardSet

    cfg = _cfg(tiny_model_dir, demo_data_dir, tmp_path / "run")
    processor = load_processor(str(tiny_model_dir))
    engine = HFEngine(load_model(cfg.model, "cpu"), processor)
    factor, temporal = vision_factors(processor)
    samples = iter_samples(load_records(cfg.data.train_path, cfg.data), cfg.data, shard=0, num_shards=1, seed=0,
                           epochs=None, factor=factor, temporal_patch=temporal)
    sampler = Sampler(engine, processor, cfg, SamplingParams.from_config(cfg.rollout), RewardSet(cfg), "g0",
                      np.random.default_rng(0))
    sampled = oom_above(monkeypatch, limit=1, times=1)  # the first call with more than 1 prompt
    before = oom_count()
    chunk = [next(samples) for _ in range(sampler.batch.size)]
    with caplog.at_level(logging.WARNING, logger="streamgrpo.generator"):
        groups = sampler.groups(chunk)
    assert [g.prompt_id for g in groups] == [record.id for record, _ in chunk]  # complete, in order, none twice
    assert all(len(g.completions) == 2 and all(len(c.token_ids) for c in g.completions) for g in groups)
    assert sampled == [2, 2] and sampler.batch.size == 2 and oom_count() == before + 1
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning == ("g0: out of memory sampling 4 prompts at once: 2 prompt(s) per engine call from now on "
                       "(rollout.prompts_per_batch=4)")
    chunk = [next(samples) for _ in range(sampler.batch.size)]  # the generator's next batch: the kept size
    assert [g.prompt_id for g in sampler.groups(chunk)] == [record.id for record, _ in chunk]
    assert sampled == [2, 2, 2] and oom_count() == before + 1


class _NoSnapshot(WeightApplier):
    """The generator's weight applier without the start-up snapshot wait (no learner runs here)."""

    def snapshot(self, timeout_s: float) -> None:
        pass


def test_the_generator_loop_sends_every_group_once_after_running_out_of_memory(tiny_model_dir, demo_data_dir,
                                                                               tmp_path, monkeypatch, redis_server,
                                                                               redis_ns):
    import math

    from streamgrpo.generator.loop import run_generator, train_records
    from streamgrpo.transport.queue.redis_stream import RedisQueue

    cfg = _cfg(tiny_model_dir, demo_data_dir, tmp_path / "run", f"queue.url={redis_server.url}",
               f"queue.namespace={redis_ns}", "rollout.num_epochs=0.5", "rollout.num_generators=1")
    n = math.ceil(0.5 * len(train_records(cfg)))  # the records this generator samples before its data ends
    assert n > 4
    sampled = oom_above(monkeypatch, limit=2)  # every call with more than 2 prompts
    before = oom_count()
    assert run_generator(cfg, 0, applier=_NoSnapshot) == 0
    assert sampled == [2] * (n // 2) + [1] * (n % 2)  # 4 ran out once; every later batch was taken at 2
    assert oom_count() == before + 1
    queue = RedisQueue.from_config(cfg.queue, redis_server.url, consumer="test")
    got = queue.get(100, timeout_s=1.0)
    queue.close()
    ids = [d.group.prompt_id for d in got]
    assert len(ids) == len(set(ids)) == n  # every record's group once
    assert all(len(d.group.completions) == 2 for d in got)


def test_one_prompt_that_does_not_fit_stops_the_generator_and_sends_nothing(tiny_model_dir, demo_data_dir, tmp_path,
                                                                            monkeypatch, redis_server, redis_ns):
    from streamgrpo.generator.loop import run_generator
    from streamgrpo.generator.oom import PromptDoesNotFit

    cfg = _cfg(tiny_model_dir, demo_data_dir, tmp_path / "run", f"queue.url={redis_server.url}",
               f"queue.namespace={redis_ns}", "rollout.prompts_per_batch=2")
    sampled = oom_above(monkeypatch, limit=0)
    with pytest.raises(PromptDoesNotFit, match=r"^generator-0: one prompt does not fit .*rollout.num_generations \(2\)"):
        run_generator(cfg, 0, applier=_NoSnapshot)
    assert sampled == []
    from streamgrpo.transport.queue.redis_stream import RedisQueue

    queue = RedisQueue.from_config(cfg.queue, redis_server.url, consumer="test")
    assert queue.get(10, timeout_s=0.5) == []  # nothing sent
    queue.close()
