"""The seed benchmark's pure parts: which seeds to run, and what counts as reaching 0.9."""

from __future__ import annotations

import pytest

from benchmarks.bench_seeds import parse_seeds, run_stats, task_summary


def test_seed_lists_and_ranges():
    assert parse_seeds("0-9") == list(range(10))
    assert parse_seeds("0-2,7") == [0, 1, 2, 7]
    for bad in ("", "3,3", "2-1", "-1"):
        with pytest.raises(ValueError):
            parse_seeds(bad)


def _rows(accs_per_step, t0=100.0):
    return [{"step": i + 1, "time": t0 + 2.0 * i, "group_accuracy": accs} for i, accs in enumerate(accs_per_step)]


def test_a_run_reaches_the_target_when_its_last_50_groups_average_0_9():
    rows = _rows([[0.25] * 8] * 5 + [[1.0] * 8] * 10)  # 40 groups at 0.25, then perfect ones
    stats = run_stats(rows, wall_s=33.0)  # the last 50 groups: 0.85 after step 10, 0.97 after step 11
    assert stats["steps_to_0.9"] == 11 and stats["seconds_to_0.9"] == 20.0 and stats["steps"] == 15
    never = run_stats(_rows([[0.5] * 8] * 20))
    assert never["steps_to_0.9"] is None and never["seconds_to_0.9"] is None and never["final_accuracy"] == 0.5


def test_the_summary_counts_the_seeds_that_reached_it_and_takes_their_median():
    runs = {0: {"steps_to_0.9": 100, "seconds_to_0.9": 50.0}, 1: {"steps_to_0.9": None, "seconds_to_0.9": None},
            2: {"steps_to_0.9": 300, "seconds_to_0.9": 90.0}, 3: {"steps_to_0.9": 200, "seconds_to_0.9": 70.0}}
    summary = task_summary(runs)
    assert summary["reached"] == 3 and summary["seeds"] == 4
    assert summary["median_steps"] == 200 and summary["median_s"] == 70.0 and summary["max_steps"] == 300
    assert task_summary({0: {"steps_to_0.9": None}})["median_steps"] is None


def test_a_run_is_stopped_only_once_it_has_trained_past_the_target():
    from benchmarks.bench_seeds import past_target

    rows = _rows([[0.25] * 8] * 5 + [[1.0] * 8] * 10)  # 0.9 at step 11, 15 steps in all
    assert past_target(rows, 4) and past_target(rows, 0)
    assert not past_target(rows, 5) and not past_target(rows, None) and not past_target([], 0)
    assert not past_target(_rows([[0.5] * 8] * 20), 0)
