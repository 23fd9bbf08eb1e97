"""The chaos soak, short: kill -9 of the learner (twice, once while it writes a checkpoint), a generator
and redis-server during a run of 50 s, each restarted; then Redis at maxmemory for 10 s; then the run goes on under
`up --resume`, which is killed with -9 and sent SIGHUP, each time restarted; then the audit: every produced group trained
exactly once (or dropped with a reason, or still queued), steps 1..N with version N. The 10-minute
version: python -m benchmarks.chaos."""

from __future__ import annotations

import re
from pathlib import Path

from benchmarks import chaos


def test_make_plan_spreads_seeded_kills_over_the_middle_of_the_run():
    plan = chaos.make_plan(600.0, 10, 2, seed=3)
    targets = [t for _, t in plan.kills]
    assert targets.count("learner") == 9 and targets.count("learner-ckpt") == 1 and targets.count("redis") == 3
    assert sum(t.startswith("generator-") for t in targets) == 3
    assert all(60.0 <= at <= 510.0 for at, _ in plan.kills)
    assert [at for at, _ in plan.kills] == sorted(at for at, _ in plan.kills)
    assert plan == chaos.make_plan(600.0, 10, 2, seed=3) and plan != chaos.make_plan(600.0, 10, 2, seed=4)


SHORT_S, SHORT_SEED = 50.0, 64  # the soak of the test below


def test_the_short_plan_kills_each_target_once_with_room_to_spare():
    """The short soak's plan: run_chaos defers a learner kill until that learner has lived 15 s (5 s at a
    time) and the loop ends at ``duration_s``, dropping what is left. Replaying that rule on the plan (a kill
    in a checkpoint taken as 3 s, redis's restart as 1 s) leaves >= 12 s after the last kill."""
    plan = chaos.make_plan(SHORT_S, 2, 2, seed=SHORT_SEED)
    assert sorted(t.split("-")[0] for _, t in plan.kills) == ["generator", "learner", "learner", "redis"]
    pending, started, now = list(plan.kills), 0.0, 0.0
    while pending:
        at, target = pending.pop(0)
        if target.startswith("learner") and at - started < 15.0:
            pending.insert(0, (at + 5.0, target))
            continue
        now = max(now, at) + {"learner-ckpt": 3.0, "redis": 1.0}.get(target, 0.0)
        started = now if target.startswith("learner") else started
    assert now <= SHORT_S - 12.0, now


def test_kill9_learner_generator_and_redis_loses_nothing_and_trains_nothing_twice(tiny_model_dir, demo_data_dir,
                                                                                  tmp_path):
    lines: list[str] = []
    # 50 s with seed 64: the plan kills redis at 12.6 s, the learner at 15.1 s, a generator at 25.1 s and the
    # learner in a checkpoint at 30.8 s, each learner kill >= 15 s after its start, so no kill waits for a
    # fresh learner and the last one lands ~16 s before the end (the 75 s plan of seed 1 left ~10 s):
    # test_the_short_plan_kills_each_target_once_with_room_to_spare
    result, kills, _ = chaos.run_chaos(tmp_path / "chaos", duration_s=SHORT_S, learner_kills=2, generators=2,
                                       seed=SHORT_SEED, model=str(tiny_model_dir),
                                       data=str(Path(demo_data_dir) / "train.jsonl"), sets=("learner.save_steps=4",),
                                       log=lines.append, up_s=15.0, maxmemory_s=10.0)
    targets = [k.target for k in kills]
    assert targets.count("learner") == 1 and targets.count("learner-ckpt") == 1, lines
    assert targets.count("redis") == 1 and any(t.startswith("generator") for t in targets), lines
    assert targets.count("up") == 1 and targets.count("up-hup") == 1, lines
    huge = [k.note for k in kills if k.target == "huge-group"]  # killed in its step until it is crash_loop
    assert len(huge) == 3 and "crash_loop" in huge[0] and "too_large" in huge[0], lines
    assert all(not k.note.startswith("children still running") for k in kills), lines
    assert next(k.note for k in kills if k.target == "learner-ckpt").startswith("while writing step-"), lines
    assert result.resumes >= 4 and result.steps > 0, lines  # 2 learner kills, and 3 starts of `up --resume`
    assert result.steps_in_order and result.version == result.steps, lines
    assert result.trained > 0 and result.uncommitted == 0, lines
    assert (result.lost, result.twice) == (0, 0), (result.lost_ids, result.twice_ids, lines)
    full = next(k for k in kills if k.target == "redis-maxmemory")  # Redis full for 10 s: writes refused, no exit
    at = re.match(r"steps (\d+) -> (\d+) at maxmemory, (\d+) after the restore; (\d+) writes refused", full.note)
    assert at and int(at[3]) > int(at[2]) and int(at[4]) > 0 and full.note.endswith("exited: none"), lines
