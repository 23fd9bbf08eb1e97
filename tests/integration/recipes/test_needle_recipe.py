"""The needle recipe end to end: 256-frame videos through the generator, the Redis queue and the learner
(`streamgrpo up --config demo-needle`, real processes, the tiny model), two optimizer steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
VIDEO_TOKENS = 128  # 256 frames of 28x28: one merged token per temporal patch of 2 frames


def test_a_256_frame_video_goes_through_generator_queue_and_learner(tmp_path, tiny_model_dir):
    from streamgrpo.config import load_config
    from streamgrpo.recipes.needle.data import make_needle

    data = make_needle(tmp_path / "data", n=6, seed=0, frames=256)
    run = tmp_path / "run"
    cfg = load_config("demo-needle", [
        f"data.train_path={data / 'train.jsonl'}", f"model.name_or_path={tiny_model_dir}", f"run_dir={run}",
        "demo.tiny_model=false", "demo.make_data=false", "eval.enabled=false", "launch.agreement_check=false",
        "rollout.stop_grace_s=0", "rollout.num_generations=2", "rollout.prompts_per_batch=2",
        "learner.groups_per_step=2", "learner.max_steps=2", "learner.save_steps=1000", "metrics.log_every=1"])
    assert (cfg.data.min_frames, cfg.data.max_frames) == (256, 256)  # the shipped config takes every frame
    run.mkdir()
    path = run / "test-config.yaml"
    path.write_text(cfg.to_yaml())
    out = subprocess.run([sys.executable, "-m", "streamgrpo", "up", "--config", str(path), "--generators", "1"],
                         env=ENV, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["groups_trained"] == 4
    for r in rows:  # every group's prompt carried the whole video: 128 video tokens (16 frames would be 8)
        assert r["seq_tokens"] >= 2 * 2 * VIDEO_TOKENS, r["seq_tokens"]  # 2 groups x 2 completions, each a row
        assert len(r["group_accuracy"]) == 2
