"""``benchmarks/bench_cluster.py``'s pure parts: percentiles, the saturation verdict, fan-out times,
the memory estimate, a cell's summary, its figures and the table. No process is started here; the
benchmark itself runs in tests/integration/repo/test_bench_cluster_run.py."""

from __future__ import annotations

import sys

import pytest

from tests.paths import REPO

sys.path.insert(0, str(REPO))

from benchmarks import bench_cluster as bc  # noqa: E402
from benchmarks import common  # noqa: E402


def test_percentile_interpolates_between_ranks():
    assert bc.percentile([], 50) is None
    assert bc.percentile([7.0], 99) == 7.0
    xs = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert bc.percentile(xs, 0) == 1.0 and bc.percentile(xs, 100) == 4.0
    assert bc.percentile(xs, 50) == pytest.approx(2.5)
    assert bc.percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert bc.percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    with pytest.raises(ValueError):
        bc.percentile(xs, 101)


@pytest.mark.parametrize("redis, learner, gen, host, want", [
    ((0.95, 1.0), (0.95, 1.0), (0.95, 1.0), 1.0, "redis-server"),  # a single-threaded server at a full core first
    ((0.50, 0.60), (0.90, 0.95), (0.95, 1.0), 1.0, "learners"),
    ((0.50, 0.60), (0.40, 0.50), (0.90, 0.90), 1.0, "generators"),
    ((0.40, 0.98), (0.40, 0.50), (0.10, 0.20), 1.0, "redis-server (CPU-starved)"),  # runnable all along, no core
    ((0.50, 0.60), (0.40, 0.50), (0.10, 0.95), 1.0, "generators (CPU-starved)"),
    ((0.50, 0.60), (0.40, 0.50), (0.10, 0.20), 0.95, "host CPU"),  # nobody at a core, every core busy
    ((0.50, 0.60), (0.40, 0.50), (0.10, 0.20), 0.50, "none"),
    ((None, None), (None, None), (None, None), None, "none"),
])
def test_saturation_verdict(redis, learner, gen, host, want):
    roles = {"redis-server": redis, "learners": learner, "generators": gen}
    assert bc.saturation(roles, host) == want


def test_saturation_names_aof_fsync_stalls():
    idle = {"redis-server": (0.2, 0.2)}
    assert bc.saturation(idle, 0.3, aof_delayed_fsync=3) == "none (+AOF fsync stalls)"
    assert bc.saturation({"redis-server": (0.9, 0.9)}, 0.3) == "redis-server"


def test_fanout_seconds_takes_versions_every_subscriber_got():
    published = {0: 0.0, 1: 10.0, 2: 20.0, 3: 30.0}
    received = {0: {0: 0.5, 1: 0.6},  # version 0 (set-up) is not counted
                1: {0: 10.2, 1: 10.5},
                2: {0: 20.1},  # subscriber 1 never got 2 (superseded by 3)
                3: {1: 30.3, 0: 30.1}}
    times, missed = bc.fanout_seconds(published, received, subscribers=2)
    assert times == pytest.approx([0.5, 0.3]) and missed == 1
    assert bc.fanout_seconds(published, received, subscribers=0) == ([], 3)
    assert bc.fanout_seconds({}, {}, 4) == ([], 0)


def test_cell_memory_estimate_grows_with_what_a_cell_holds():
    mb = 10 << 20
    procs = 2 * (bc.PROC_BASE_BYTES + mb)
    base = bc.cell_memory_bytes(mb, 1, 1, 64, 8, 0, 0)
    assert base == 64 * mb + mb + 8 * mb + 8 * mb + procs
    many = bc.cell_memory_bytes(mb, 64, 1, 64, 8, 0, 0)
    assert many - base == 63 * 64 * mb + 63 * mb + 63 * (bc.PROC_BASE_BYTES + mb)  # each producer may fill the bound
    capped = bc.cell_memory_bytes(mb, 64, 1, 64, 8, 0, 0, redis_cap=1 << 30)
    assert many - capped == 64 * 64 * mb - (1 << 30)
    w = 16 << 20
    assert bc.cell_memory_bytes(mb, 1, 1, 64, 8, w, 1) - base == (3 + bc.SUB_COPIES) * w


def _cell(**kw):
    consumed = [(10.0 + i / 100, 10.0 + i / 100 - 0.01 * (1 + i % 10), 1_000_000) for i in range(100)]  # 1 s of groups
    consumed += [(9.0, 8.9, 1_000_000), (12.5, 12.4, 1_000_000)]  # outside the window: not counted
    cpu = {"gen": [0.5, 0.7], "learner": [0.9], "redis": 0.3, "host_busy": 0.6, "ours_busy": 0.5,
           "wait": {"gen": [0.1, 0.1], "learner": [0.2], "redis": 0.05}}
    args = {"size_mb": 1.0, "gens": 2, "learners": 1, "window": (10.0, 11.0), "consumed": consumed, "cpu": cpu,
            "fanout": ([0.2, 0.4, 0.3], 1), "versions_published": 4, "subscribers": 2}
    args.update(kw)
    return bc.summarise_cell(**args)


def test_summarise_cell():
    c = _cell()
    assert c["groups"] == 100 and c["groups_per_s"] == pytest.approx(100.0)
    assert c["MBps"] == pytest.approx(100.0)
    assert c["latency_p50_ms"] == pytest.approx(55.0) and c["latency_p99_ms"] == pytest.approx(100.0)
    assert c["fanout_s_median"] == pytest.approx(0.3) and c["fanout_s_max"] == pytest.approx(0.4)
    assert (c["fanout_versions"], c["fanout_missed"], c["versions_published"]) == (3, 1, 4)
    assert c["gen_cpu_s_mean"] == pytest.approx(0.6) and c["learner_cpu_s_max"] == pytest.approx(0.9)
    assert c["redis_wait_s"] == pytest.approx(0.05) and c["learner_wait_s_mean"] == pytest.approx(0.2)
    assert c["saturated"] == "learners"  # 0.9 s of CPU in a 1 s window
    idle = _cell(consumed=[], fanout=([], 0), cpu={"gen": [float("nan")], "learner": [], "redis": None})
    assert idle["groups_per_s"] == 0 and idle["latency_p99_ms"] is None and idle["gen_cpu_s_mean"] is None
    assert idle["saturated"] == "none"


def test_table_rows_and_skipped_cells():
    cells = [_cell(), {"size_mb": 10.0, "gens": 64, "learners": 4, "skipped": "needs ~30 GiB"}]
    table = bc.format_table(cells)
    lines = table.splitlines()
    assert lines[0] == "| " + " | ".join(bc.TABLE_HEADER) + " |"
    assert all(ln.startswith("|") and ln.endswith("|") for ln in lines)
    assert {ln.count("|") for ln in lines} == {len(bc.TABLE_HEADER) + 1}
    row = dict(zip(bc.TABLE_HEADER, bc.table_row(cells[0])))
    assert [row[k] for k in ("size MB", "gens", "learners", "put/s", "groups/s", "MB/s")] == ["1", "2", "1", "-", "100.0", "100.0"]
    assert row["latency p50/p99 ms"] == "55/100" and row["queue peak"] == "-"
    assert row["fan-out s (subs; ok/pub)"] == "0.300 (2; 3/4)" and row["gen CPU s (core%)"] == "0.60 (60%)"
    assert row["waited for CPU redis/learner"] == "5%/20%" and row["host busy (ours)"] == "60% (50%)"
    assert row["saturated"] == "learners"
    assert lines[-1].endswith("| skipped: needs ~30 GiB |") and lines[-1].startswith("| 10 | 64 | 4 |")
    no_weights = dict(zip(bc.TABLE_HEADER, bc.table_row(_cell(subscribers=0, fanout=([], 0)))))
    assert no_weights["fan-out s (subs; ok/pub)"] == "-"
    early = dict(zip(bc.TABLE_HEADER, bc.table_row({**_cell(), "queue_len_max": 900, "put_per_s": 250.0,
                                                     "stopped_early": "redis held 7.0 GiB (limit 6.0 GiB)"})))
    assert (early["queue peak"], early["put/s"]) == ("900", "250.0")
    assert early["saturated"] == "learners [stopped early: redis held 7.0 GiB (limit 6.0 GiB)]"


def test_figures_use_the_same_runs_1x1_cell_as_baseline():
    cells = [_cell(gens=1, learners=1), _cell(gens=4, learners=2, consumed=[(10.5, 10.4, 10)] * 300),
             {"size_mb": 1.0, "gens": 64, "learners": 1, "skipped": "memory"},
             _cell(size_mb=10.0, gens=4, learners=1)]
    figs = {f["name"]: f for f in bc.cluster_figures(cells)}
    g = figs["cluster_1MB_4gen_2learn_groups_per_s"]
    assert g["value"] == pytest.approx(300.0) and g["baseline"] == pytest.approx(100.0) and g["ratio"] == pytest.approx(3.0)
    assert "1 generator x 1 learner" in g["note"]
    assert figs["cluster_1MB_1gen_1learn_groups_per_s"]["ratio"] == pytest.approx(1.0)
    assert "cluster_1MB_64gen_1learn_groups_per_s" not in figs  # skipped: no figure
    # no 1x1 cell of 10 MB: its first measured cell is the baseline, and the note says which
    assert "4 generator x 1 learner" in figs["cluster_10MB_4gen_1learn_groups_per_s"]["note"]
    assert figs["cluster_1MB_4gen_2learn_p99_ms"]["unit"] == "ms"
    fan = figs["cluster_weights_fanout_4gen_s"]
    assert fan["baseline"] == pytest.approx(0.3) and fan["value"] == pytest.approx(0.3)
    assert figs["cluster_weights_fanout_1gen_s"]["ratio"] == pytest.approx(1.0)
    m = common.machine_info(packages=("numpy",))
    assert common.validate_result(common.result_doc("bench_cluster", list(figs.values()), m)) == []


def test_host_note_is_honest_about_cores():
    cells = [_cell(gens=64, learners=4), {"size_mb": 1.0, "gens": 64, "learners": 1, "skipped": "memory"}]
    cells[0]["saturated"] = "host CPU"
    note = bc.host_note(2, cells)
    assert "2 cores" in note and "up to 69 here" in note and "1 of 2 cells" in note


def test_cli_defaults_cover_the_issue_grid():
    a = bc.parse_args([])
    assert (a.gens, a.learners, a.sizes) == ("1,4,16,64", "1,2,4", "0.1,1,10")
    assert a.seconds > 0 and a.weights_mib > 0 and a.aof == "always"
