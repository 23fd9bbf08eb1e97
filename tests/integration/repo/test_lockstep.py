"""The staleness study's in-process driver (:mod:`benchmarks.lockstep`) on the tiny model and real demo clips."""

from __future__ import annotations

import json
from pathlib import Path


def test_lockstep_trains_on_exactly_lagged_rollouts(tmp_path, tiny_model_dir, demo_data_dir):
    from benchmarks.lockstep import run
    from benchmarks.loop_runs import summarise_rows

    summary = run(tmp_path / "run", Path(tiny_model_dir), Path(demo_data_dir) / "train.jsonl", lag=2, steps=4,
                  sets=["learner.groups_per_step=2", "rollout.prompts_per_batch=2", "rollout.num_generations=3",
                        "learner.learning_rate=1e-3", "data.kinds=[colour]"])
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["staleness_mean"] for r in rows] == [0.0, 1.0, 2.0, 2.0]  # versions 0, 0, 0, 1
    assert all(len(r["group_accuracy"]) == 2 and all(0.0 <= a <= 1.0 for a in r["group_accuracy"]) for r in rows)
    assert all(not r["skipped"] and r["loss"] is not None for r in rows)
    assert summary["groups_trained"] == 8
    stats = summarise_rows(rows, window=4)
    assert stats["groups_trained"] == 8 and stats["steps"] == 4 and 0.0 <= stats["final_accuracy"] <= 1.0


def test_lockstep_scores_the_temporal_contrast_when_asked(tmp_path, tiny_model_dir, demo_data_dir):
    from benchmarks.lockstep import run

    run(tmp_path / "run", Path(tiny_model_dir), Path(demo_data_dir) / "train.jsonl", lag=0, steps=2,
        sets=["learner.groups_per_step=2", "rollout.prompts_per_batch=2", "rollout.num_generations=3",
              "data.kinds=[direction]", "rollout.temporal_contrast={num_generations: 2}"])
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:  # every direction group got a shuffled contrast group, scored
        assert 0.0 <= r["temporal_applied"] <= 1.0 and 0.0 <= r["p_shuffled"] <= 1.0


def test_motion_probe_trains_on_labels_and_is_deterministic_per_seed(tiny_model_dir, demo_data_dir):
    from benchmarks.motion_probe import EVAL_EVERY, probe

    train = Path(demo_data_dir) / "train.jsonl"
    first = probe(Path(tiny_model_dir), train, seed=3, steps=2 * EVAL_EVERY, lr=1e-3, sets=[])
    again = probe(Path(tiny_model_dir), train, seed=3, steps=2 * EVAL_EVERY, lr=1e-3, sets=[])
    assert len(first["accs"]) == 2 and all(0.0 <= a <= 1.0 for a in first["accs"])
    assert first["hit"] in (None, EVAL_EVERY, 2 * EVAL_EVERY)
    assert first["accs"] == again["accs"] and first["hit"] == again["hit"]
