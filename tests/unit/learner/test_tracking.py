"""wandb tracking: seed-era keys, flattened scalars, the samples table, offline runs with no network."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import wandb_log

from streamgrpo.learner.tracking import SEED_KEYS, Tracker, flat_scalars, sample_rows, seed_scalars

REC = {"step": 3, "version": 3, "time": 1.0, "reward": 0.6, "rewards": {"format": 0.9, "accuracy": 0.4},
       "kl": 0.02, "adv_mean": 0.0, "policy_seq_log_prob": -12.5, "loss": 0.1, "entropy": None,
       "groups_dropped": {"stale": 2}, "group_accuracy": [0.5, 0.25], "ranks": 2}


def test_seed_keys_map_from_a_metrics_record():
    s = seed_scalars(REC)
    assert set(s) == set(SEED_KEYS)
    assert s["grpo/format_reward"] == 0.9 and s["grpo/accuracy_reward"] == 0.4 and s["grpo/total_reward"] == 0.6
    assert s["grpo/kl_div"] == 0.02 and s["grpo/policy_seq_log_prob"] == -12.5 and s["grpo/advantage"] == 0.0
    assert "grpo/format_reward" not in seed_scalars({**REC, "rewards": {"accuracy": 1.0}})  # not configured: left out


def test_flat_scalars_skip_non_numbers_and_nest_dicts():
    f = flat_scalars(REC)
    assert f["streamgrpo/rewards/accuracy"] == 0.4 and f["streamgrpo/groups_dropped/stale"] == 2.0
    assert "streamgrpo/entropy" not in f and "streamgrpo/time" not in f and "streamgrpo/group_accuracy" not in f


def test_eval_lines_flatten_under_eval():
    from streamgrpo.learner.tracking import eval_scalars

    line = {"version": 50, "time": 1.0, "accuracy": 0.75, "by_kind": {"direction": {"records": 8, "accuracy": 0.5}},
            "shuffled": {"accuracy": 0.5}, "shuffle_drop": {"accuracy": 0.25, "by_kind": {"direction": None}},
            "accuracy_reward": "accuracy"}
    assert eval_scalars(line) == {"eval/version": 50.0, "eval/accuracy": 0.75, "eval/by_kind/direction/records": 8.0,
                                  "eval/by_kind/direction/accuracy": 0.5, "eval/shuffled/accuracy": 0.5,
                                  "eval/shuffle_drop/accuracy": 0.25}


def test_sample_rows_are_capped():
    comp = SimpleNamespace(text="<answer>A</answer>", reward=1.0, rewards={"accuracy": 1.0})
    batch = [SimpleNamespace(group=SimpleNamespace(prompt_id=f"p{i}", answer="A", completions=[comp] * 8)) for i in range(6)]
    rows = sample_rows(batch, step=5, limit=10)
    assert len(rows) == 10 and rows[0] == {"step": 5, "prompt_id": "p0", "answer": "A", "completion": "<answer>A</answer>",
                                           "reward": 1.0, "reward/accuracy": 1.0}


def test_disabled_or_absent_is_a_no_op(tmp_path):
    from streamgrpo.config import build_config

    for cfg in (build_config({}), build_config({"metrics": {"wandb": {"mode": "disabled"}}})):
        t = Tracker.from_config(cfg, tmp_path)
        assert type(t) is Tracker
        t.log_step(REC)
        t.close()
    assert not (tmp_path / "wandb").exists()


@pytest.mark.slow
def test_offline_run_directory_holds_the_seed_keys_and_table(tmp_path, monkeypatch):
    from streamgrpo.config import build_config

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = build_config({"run_dir": str(tmp_path), "metrics": {"wandb": {"project": "sg-test", "mode": "offline"}},
                        "queue": {"url": "redis://:wandb-leak-pw@redis-host:6379/0"}})
    tracker = Tracker.from_config(cfg, tmp_path)
    (tmp_path / "eval.jsonl").write_text('{"version": 3, "accuracy": 0.625, "by_kind": {"colour": {"accuracy": 0.5}}}\n')
    tracker.log_step({**REC, "step": 1})  # the evaluator's line reaches wandb under eval/
    tracker.log_step({**REC, "step": 2}, samples=[{"step": 2, "prompt_id": "p", "completion": "hello-table-row"}])
    tracker.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    (log_file,) = runs[0].glob("run-*.wandb")
    rows = wandb_log.history(log_file)  # read back as wandb wrote it (not a grep of bytes)
    assert [r["_step"] for r in rows] == [1, 2], ([r.WhichOneof("record_type") for r in wandb_log.records(log_file)], log_file.stat().st_size)
    for key in SEED_KEYS:
        assert rows[0][key] == seed_scalars(REC)[key], key
    assert rows[1]["streamgrpo/loss"] == 0.1 and rows[1]["streamgrpo/groups_dropped/stale"] == 2
    assert rows[0]["eval/accuracy"] == 0.625 and rows[0]["eval/by_kind/colour/accuracy"] == 0.5
    assert "eval/accuracy" not in rows[1]  # the evaluator's line is logged once
    table = runs[0] / "files" / rows[1]["samples/path"]
    assert rows[1]["samples/_type"] == "table-file" and "hello-table-row" in table.read_text()
    assert (tmp_path / "wandb-run-id").read_text().strip() in log_file.name  # a resumed learner reuses the id
    config = wandb_log.run_config(log_file)
    assert "redis-host:6379" in config["queue"]["url"] and "wandb-leak-pw" not in config["queue"]["url"]
    assert b"wandb-leak-pw" not in b"".join(p.read_bytes() for p in runs[0].rglob("*") if p.is_file())


def test_wandb_mode_online_with_a_project_unless_told_otherwise():
    """The pure mode choice (no test goes online: conftest sets WANDB_MODE=offline for the real runs)."""
    from streamgrpo.config import WandbConfig
    from streamgrpo.learner.tracking import wandb_mode

    assert wandb_mode(WandbConfig(project="video-grpo"), {}) == "online"
    assert wandb_mode(WandbConfig(), {}) == "offline"  # no project: nothing to upload to
    assert wandb_mode(WandbConfig(project="video-grpo"), {"WANDB_MODE": "offline"}) == "offline"
    assert wandb_mode(WandbConfig(project="video-grpo"), {"WANDB_MODE": " "}) == "online"
    assert wandb_mode(WandbConfig(), {"WANDB_MODE": "online"}) == "online"
    assert wandb_mode(WandbConfig(project="p", mode="offline"), {"WANDB_MODE": "online"}) == "offline"
    assert wandb_mode(WandbConfig(mode="disabled"), {}) == "disabled"


def test_wandb_mode_disabled_by_the_environment_is_a_no_op(tmp_path, monkeypatch):
    from streamgrpo.config import build_config

    monkeypatch.setenv("WANDB_MODE", "disabled")
    t = Tracker.from_config(build_config({"metrics": {"wandb": {"project": "p"}}}), tmp_path)
    assert type(t) is Tracker and not (tmp_path / "wandb").exists()
