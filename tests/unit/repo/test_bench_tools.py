"""The benchmark tooling's pure parts: figures, the result-json format, the table, run scoring.

No benchmark is run here and no measured number is asserted: only formats and arithmetic on
hand-made inputs.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os

import pytest

from benchmarks import common
from benchmarks import loop_runs as lr


def _machine():
    return common.machine_info(packages=("numpy",))


# ------------------------------------------------------------------ figures and their line format
def test_figure_line_has_the_contract_format():
    f = common.figure("queue_1MB_MBps", 150.0, 300.0, unit="MB/s")
    assert f["ratio"] == pytest.approx(0.5)
    line = common.format_figure(f)
    assert line == "queue_1MB_MBps: 150.0 (baseline: 300.0, ratio: 0.50)"


def test_figure_explicit_ratio_and_missing_values():
    f = common.figure("step_s", 0.1, 0.3, ratio=3.0)
    assert f["ratio"] == 3.0
    g = common.figure("time_to_0.9_s", None, 12.0)
    assert g["value"] is None and g["ratio"] is None
    assert common.format_figure(g) == "time_to_0.9_s: - (baseline: 12.00, ratio: -)"
    z = common.figure("x", 1.0, 0.0)
    assert z["ratio"] is None  # no division by zero
    nan = common.figure("y", float("nan"), 1.0)
    assert nan["value"] is None and nan["ratio"] is None


@pytest.mark.parametrize("bad", ["", "two words", "a:b"])
def test_figure_name_is_checked(bad):
    with pytest.raises(ValueError, match="figure name"):
        common.figure(bad, 1.0, 1.0)


def test_emit_prints_the_line_and_the_note():
    buf = io.StringIO()
    common.emit(common.figure("a_b", 2.0, 4.0, note="baseline: something"), out=buf)
    lines = buf.getvalue().splitlines()
    assert lines[0] == "a_b: 2.000 (baseline: 4.000, ratio: 0.50)"
    assert lines[1].startswith("#") and "baseline: something" in lines[1]


def test_fmt_value():
    assert common.fmt_value(None) == "-"
    assert common.fmt_value(0) == "0"
    assert common.fmt_value(1234.5678) == "1235"
    assert common.fmt_value(0.012345) == "0.01235"
    assert "e" in common.fmt_value(1.5e-6)


# ------------------------------------------------------------------------- result-json format
def test_machine_info_has_the_required_keys():
    m = _machine()
    for key in ("cores", "omp_num_threads", "versions", "date", "cpu", "loadavg"):
        assert key in m
    assert "numpy" in m["versions"] and m["versions"]["numpy"]


def test_result_doc_roundtrip_and_validation(tmp_path):
    figs = [common.figure("a", 1.0, 2.0), common.figure("b", None, 3.0)]
    path = common.write_result("bench_x", figs, _machine(), {"n": 3}, {"runs": {"k": 1}}, out=tmp_path / "bench_x.json")
    doc = json.loads(path.read_text())
    assert doc["benchmark"] == "bench_x" and doc["schema"] == common.RESULT_SCHEMA
    assert [f["name"] for f in doc["figures"]] == ["a", "b"]
    assert set(doc["figures"][0]) == set(common.FIGURE_KEYS)
    assert doc["runs"] == {"k": 1} and doc["args"] == {"n": 3}
    assert common.validate_result(doc) == []


def test_validate_result_names_the_problems():
    assert common.validate_result([]) == ["expected a mapping, got list"]
    doc = {"benchmark": "b", "schema": 1, "machine": {"cores": 2}, "figures": [{"name": "x", "value": "fast"}]}
    problems = " | ".join(common.validate_result(doc))
    assert "machine.omp_num_threads: missing" in problems
    assert "figures[0]: missing" in problems
    assert "figures[0].value" in problems
    with pytest.raises(ValueError, match="reserved"):
        common.result_doc("b", [], _machine(), data={"figures": []})


def test_load_results_marks_broken_files(tmp_path):
    common.write_result("bench_ok", [common.figure("f", 1.0, 1.0)], _machine(), out=tmp_path / "bench_ok.json")
    (tmp_path / "bench_bad.json").write_text("{not json")
    (tmp_path / "bench_old.json").write_text(json.dumps({"machine": {}, "results": {}}))
    docs = {d["benchmark"]: d for d in common.load_results(tmp_path)}
    assert set(docs) == {"bench_ok", "bench_bad", "bench_old"}
    assert "error" not in docs["bench_ok"]
    assert "unreadable" in docs["bench_bad"]["error"]
    assert "schema" in docs["bench_old"]["error"]


# ------------------------------------------------------------------------------------- table
def _docs():
    m = _machine()
    return [common.result_doc("bench_a", [common.figure("a_speed", 10.0, 5.0, unit="GB/s"),
                                          common.figure("a_time", None, 2.0, unit="s")], m),
            common.result_doc("bench_b", [common.figure("b|pipe", 1.0, 4.0)], m),
            {"benchmark": "bench_c", "error": "bench_c.json: unreadable", "figures": []}]


def test_table_rows_cover_every_figure():
    rows = common.table_rows(_docs())
    assert [r[:2] for r in rows] == [["bench_a", "a_speed"], ["bench_a", "a_time"], ["bench_b", "b|pipe"],
                                     ["bench_c", "(invalid result file: see below)"]]
    assert rows[0][4] == "2.00" and rows[1][2] == "-" and rows[1][4] == "-"


def test_every_benchmark_names_its_machine_and_date():
    lines = common.machine_lines(_docs())
    m = _machine()
    assert lines == [f"- bench_a: {m['cpu']} ({m['cores']} cores), {m['date'][:10]}",
                     f"- bench_b: {m['cpu']} ({m['cores']} cores), {m['date'][:10]}"]


def test_text_table_is_aligned():
    text = common.build_table(_docs())
    lines = text.splitlines()
    assert lines[0].split() == common.TABLE_HEADER
    assert set(lines[1].replace(" ", "")) == {"-"}
    assert len(lines) == 2 + 4 + 1
    assert lines[-1] == "invalid result file: bench_c.json: unreadable"
    assert all("a_speed" not in ln or "GB/s" in ln for ln in lines)


def test_markdown_table_escapes_pipes():
    md = common.build_table(_docs(), style="markdown").splitlines()
    assert md[-1] == "invalid result file: bench_c.json: unreadable"
    md = md[:-2]
    assert md[0].startswith("| benchmark | figure |")
    assert all(ln.startswith("|") and ln.endswith("|") for ln in md)
    assert any("b\\|pipe" in ln for ln in md)
    cols = {ln.count(" | ") for ln in md[2:] if "\\|" not in ln}
    assert cols == {5}
    with pytest.raises(ValueError):
        common.build_table([], style="html")


# ------------------------------------------------------------------------ run scoring (pure)
def _rows(accs_per_step, t0=100.0, dt=2.0, seconds=1.0):
    return [{"step": i + 1, "time": t0 + i * dt, "group_accuracy": list(a), "seconds": seconds}
            for i, a in enumerate(accs_per_step)]


def test_target_and_throughput_on_made_up_rows():
    rows = _rows([[0.0] * 10] * 5 + [[1.0] * 10] * 5)  # 10 groups per step
    assert lr.target_reached(rows, target=0.9, window=10) == (6, 110.0)
    assert lr.steps_to_target(rows, 0.9, 10) == 6
    assert lr.time_to_target(rows, 0.9, 10) == pytest.approx(10.0)
    assert lr.throughput(rows) == pytest.approx(90 / 18.0)
    assert lr.final_accuracy(rows, 10) == 1.0 and lr.first_accuracy(rows, 10) == 0.0
    assert lr.train_seconds_per_group(rows) == pytest.approx(0.1)
    assert lr.target_reached(_rows([[0.5] * 4] * 30), 0.9, 10) is None
    s = lr.summarise_rows(rows, 0.9, 10)
    assert s["groups_trained"] == 100 and s["steps"] == 10 and s["steps_to_target"] == 6
    assert lr.summarise_rows([])["groups_per_s"] is None


def test_generate_seconds_per_group_skips_waiting():
    ev = [
        {"event": "produced", "version": 0, "t": 10.0, "put_s": 0.0},  # first batch: no known start, skipped
        {"event": "produced", "version": 0, "t": 10.5, "put_s": 0.0},
        {"event": "applied", "version": 1, "t": 15.0},  # waiting for weights before this is not generation
        {"event": "produced", "version": 1, "t": 16.0, "put_s": 0.0},
        {"event": "produced", "version": 1, "t": 16.5, "put_s": 0.5},  # blocked on the queue for 0.5 s
        {"event": "produced", "version": 1, "t": 19.0, "put_s": 0.0},  # same version: the generator stayed busy
        {"event": "applied", "version": 2, "t": 30.0},
        {"event": "produced", "version": 2, "t": 33.0, "put_s": 1.0},
    ]
    # v1: 15.0 -> 19.0 minus 0.5 s of puts = 3.5 s for 3 groups; v2: 30 -> 33 minus 1 s = 2 s for 1 group
    assert lr.generate_seconds_per_group(ev[:6]) == pytest.approx(3.5 / 3)
    assert lr.generate_seconds_per_group(ev) == pytest.approx((3.5 / 3 + 2.0) / 2)
    assert lr.generate_seconds_per_group(ev[:2]) is None
    assert lr.generate_seconds_per_group([]) is None


def test_overlap_bound():
    assert lr.overlap_bound(1.0, 1.0) == pytest.approx(2.0)
    assert lr.overlap_bound(1.0, 3.0) == pytest.approx(4 / 3)
    assert lr.overlap_bound(None, 1.0) is None


def test_e2e_figures_with_a_missing_run():
    from benchmarks.bench_e2e import e2e_figures

    stats = {"async": {"groups_per_s": 3.0, "time_to_target_s": 100.0, "final_accuracy": 0.9},
             "sync": {"groups_per_s": 2.0, "time_to_target_s": None, "final_accuracy": 0.8,
                      "gen_s_per_group": 0.1, "train_s_per_group": 0.2}}
    figs = {f["name"]: f for f in e2e_figures(stats)}
    assert figs["e2e_async_vs_sync_groups_per_s"]["ratio"] == pytest.approx(1.5)
    assert figs["e2e_async_vs_trl_groups_per_s"]["baseline"] is None  # no TRL run: no ratio, no crash
    assert figs["e2e_overlap_speedup"]["baseline"] == pytest.approx(1.5)
    assert figs["e2e_overlap_speedup"]["ratio"] == pytest.approx(1.0)
    assert common.validate_result(common.result_doc("bench_e2e", list(figs.values()), _machine())) == []


def test_staleness_table_and_overrides():
    from benchmarks.bench_staleness import moving_accuracy, run_sets, staleness_table
    from benchmarks.lockstep import lagged_version

    up = run_sets(4, "naive", 100, "up", extra=["learner.learning_rate=1e-3"])
    assert "demo.weight_apply_delay=4" in up and "loss.ratio_mode=current" in up
    assert up[0] == "learner.learning_rate=1e-3" and "learner.max_steps=100" in up
    assert "loss.ratio_mode=behaviour" in run_sets(0, "clipped", 100)
    assert any(s.startswith("learner.max_staleness=") and int(s.split("=")[1]) >= 8
               for s in run_sets(8, "clipped", 5, "up"))
    # lockstep: the lag is exact, no generator delay and nothing for the learner to drop
    assert not any(s.startswith(("demo.weight_apply_delay", "learner.max_staleness")) for s in run_sets(8, "naive", 5))
    # step v (1-based) trains on groups of version v-1-k: k versions behind the learner's v-1
    assert [lagged_version(v, 0) for v in (1, 2, 3)] == [0, 1, 2]
    assert [lagged_version(v, 2) for v in (1, 2, 3, 4, 5)] == [0, 0, 0, 1, 2]
    results = {"k4_naive": {"final_accuracy": 0.5, "steps_to_target": None, "staleness_mean": 4.5,
                            "groups_trained": 80, "groups_dropped": {}},
               "k0_clipped": {"final_accuracy": 0.95, "steps_to_target": 40, "staleness_mean": 0.5,
                              "groups_trained": 80, "groups_dropped": {"stale": 1}}}
    lines = staleness_table(results).splitlines()
    assert lines[2].startswith("| 0 | clipped | 0.950 | 40 |")
    assert lines[3].startswith("| 4 | naive | 0.500 | - |")
    steps, means = moving_accuracy(_rows([[1.0] * 4] * 5), window=8)
    assert steps == [2, 3, 4, 5] and means == [1.0] * 4


def test_staleness_corrections_and_their_figures():
    from benchmarks.bench_staleness import LOSSES, run_sets, staleness_figures

    assert set(LOSSES) == {"clipped", "tis", "decoupled", "mis", "naive"}
    assert {"loss.ratio_mode=decoupled", "loss.tis_cap=5.0"} <= set(run_sets(8, "decoupled", 5))
    assert "loss.is_mask=token" in run_sets(8, "mis", 5) and "loss.tis_cap=2.0" in run_sets(8, "tis", 5)
    results = {f"k{k}_{loss}": {"final_accuracy": acc, "steps_to_target": None}
               for (k, loss, acc) in [(0, "naive", 0.9), (8, "naive", 0.5), (0, "mis", 0.9), (8, "mis", 0.81),
                                      (0, "clipped", 0.9), (8, "clipped", 0.72)]}
    figs = {f["name"]: f for f in staleness_figures(results, [0, 8, 16], ["clipped", "mis", "naive"])}
    assert figs["staleness_k8_final_accuracy"]["value"] == 0.72  # clipped keeps the historical name
    assert figs["staleness_k8_mis_final_accuracy"]["baseline"] == 0.5
    assert figs["staleness_mis_k8_vs_k0"]["ratio"] == pytest.approx(0.9)  # k=8 is the goal's lag, not 16
    assert figs["staleness_k16_mis_final_accuracy"]["value"] is None  # a missing run: no crash


def test_staleness_seeds_aggregate():
    from benchmarks.bench_staleness import aggregate, mean_curve, run_key, staleness_table

    runs = {run_key(4, "clipped", 0): {"final_accuracy": 0.9, "steps_to_target": 60, "staleness_mean": 3.9,
                                       "groups_trained": 800, "groups_dropped": {"stale": 1}},
            run_key(4, "clipped", 1): {"final_accuracy": 0.7, "steps_to_target": None, "staleness_mean": 3.9,
                                       "groups_trained": 800, "groups_dropped": {"stale": 2}},
            run_key(4, "clipped", 2): {"final_accuracy": 0.8, "steps_to_target": 80, "staleness_mean": 3.9,
                                       "groups_trained": 800, "groups_dropped": {}}}
    agg = aggregate(runs)
    assert list(agg) == ["k4_clipped"]
    r = agg["k4_clipped"]
    assert (r["seeds"], r["reached"], r["steps_to_target"], r["groups_dropped"]) == (3, 2, 70, {"stale": 3})
    assert (r["final_accuracy"], r["final_accuracy_min"], r["final_accuracy_max"]) == pytest.approx((0.8, 0.7, 0.9))
    assert staleness_table(agg).splitlines()[2] == "| 4 | clipped | 0.800 (0.70-0.90) | 70 | 2/3 | 3.90 | 800 | {\"stale\": 3} |"
    assert mean_curve([([1, 2, 3], [0.2, 0.4, 0.6]), ([2, 3], [0.6, 1.0]), ([], [])]) == ([2, 3], pytest.approx([0.5, 0.8]))
    assert mean_curve([]) == ([], [])


def test_run_all_plan():
    from benchmarks.run_all import SCRIPTS, plan

    names = [n for n, _, _ in plan(set(), set(), False)]
    assert names == list(SCRIPTS)
    sub = plan({"wire", "e2e"}, set(), False)
    assert [n for n, _, _ in sub] == ["wire", "e2e"]
    # every command runs an existing module of the benchmarks package: python -m benchmarks.<name>
    assert all(cmd[1] == "-m" and importlib.util.find_spec(cmd[2]) for _, cmd, _ in plan(set(), set(), True))
    assert "staleness" not in [n for n, _, _ in plan(set(), {"staleness"}, False)]
    with pytest.raises(ValueError, match="unknown"):
        plan({"nope"}, set(), False)


def test_child_pythonpath_prepends_the_root(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    assert common.child_pythonpath().split(os.pathsep) == [str(common.ROOT), "/elsewhere"]
    monkeypatch.delenv("PYTHONPATH")
    assert common.child_pythonpath() == str(common.ROOT)  # no empty trailing entry
    monkeypatch.setenv("PYTHONPATH", "")
    assert common.child_pythonpath() == str(common.ROOT)
    assert common.module_argv("bench_wire", "--rounds", "5")[1:] == ["-m", "benchmarks.bench_wire", "--rounds", "5"]


def test_bench_env_prepends_to_pythonpath(monkeypatch):
    import os

    from benchmarks.common import ROOT
    from benchmarks.loop_runs import bench_env

    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    assert bench_env()["PYTHONPATH"] == os.pathsep.join([str(ROOT), "/elsewhere"])
    monkeypatch.delenv("PYTHONPATH")
    assert bench_env()["PYTHONPATH"] == str(ROOT)  # no empty entry (that would put the cwd on the path)


def test_gpu_weights_waits_for_the_generator_end_with_a_clear_error():
    import queue
    import types

    from benchmarks.gpu_weights import _read

    child = types.SimpleNamespace(lines=queue.Queue(), poll=lambda: None, wait=lambda: 3)
    child.lines.put({"event": "ready"})
    child.lines.put({"event": "applied", "version": 2})
    assert _read(child, "applied", timeout_s=1.0) == {"event": "applied", "version": 2}  # other events skipped
    with pytest.raises(RuntimeError, match="no 'applied' from the generator process in 0s"):
        _read(child, "applied", timeout_s=0.05)
    child.lines.put(None)
    with pytest.raises(RuntimeError, match=r"ended \(rc 3\) before 'applied'"):
        _read(child, "applied", timeout_s=1.0)


def test_motion_figures_and_probe_accuracy():
    from benchmarks.bench_motion import mean_of, motion_figures, probe_accuracy

    result = {"model": {"metrics": {"accuracy": 0.9, "by_kind": {"direction": {"accuracy": 0.95, "records": 40}}},
                        "shuffled": {"accuracy": 0.5, "by_kind": {"direction": {"accuracy": 0.45, "records": 40}}}}}
    assert probe_accuracy(result) == {"ordered": 0.95, "shuffled": 0.45}
    assert probe_accuracy({"model": {"metrics": {}}}) == {"ordered": None, "shuffled": None}
    plain = [{"time_to_target_s": 200.0, "final_accuracy": 0.92, "ordered": 0.95, "shuffled": 0.45},
             {"time_to_target_s": 280.0, "final_accuracy": 0.9, "ordered": 0.9, "shuffled": 0.55}]
    assert mean_of(plain, "time_to_target_s") == 240.0
    assert mean_of(plain + [{"time_to_target_s": None}], "time_to_target_s") is None  # one seed never got there
    figs = {f["name"]: f for f in motion_figures(plain, None)}  # the shipped recipe's runs only
    assert figs["motion_time_to_0.9_s"]["ratio"] == pytest.approx(0.8)  # of the 300 s budget
    assert figs["motion_final_accuracy"]["baseline"] == 0.5
    assert figs["motion_ordered_vs_shuffled_accuracy"]["value"] == pytest.approx(0.925)
    assert figs["motion_ordered_vs_shuffled_accuracy"]["baseline"] == pytest.approx(0.5)
    assert not any(name.startswith("motion_tgrpo") for name in figs)
    tgrpo = [dict(p, time_to_target_s=None) for p in plain]
    figs = {f["name"]: f for f in motion_figures(tgrpo, plain)}
    assert figs["motion_tgrpo_vs_plain_time_to_0.9_s"]["value"] is None
    assert figs["motion_tgrpo_vs_plain_final_accuracy"]["ratio"] == pytest.approx(1.0)


def test_motion_probe_sees_the_clips_as_the_run_did():
    from benchmarks.bench_motion import PLAIN, probe_sets

    sets = ["seed=1", PLAIN, "data.min_pixels=12544", "data.max_pixels=12544", "loss.zero_variance_weight=0.5"]
    assert probe_sets(sets) == ["--set", "data.min_pixels=12544", "--set", "data.max_pixels=12544"]
    assert probe_sets([]) == []


def test_motion_study_jobs_stats_and_figures():
    from benchmarks.bench_motion import PLAIN, TGRPO, study_figures, study_jobs, study_stats

    jobs = dict(study_jobs([0, 2], 300))
    assert sorted(jobs) == ["plain_s0", "plain_s2", "tgrpo_s0", "tgrpo_s2"]
    assert TGRPO in jobs["tgrpo_s2"] and TGRPO not in jobs["plain_s2"] and PLAIN in jobs["plain_s2"]
    assert jobs["plain_s2"][jobs["plain_s2"].index("--seed") + 1] == "2" and "demo-motion" in jobs["plain_s0"]
    rows = [{"step": s, "time": float(s), "group_accuracy": [0.5 if s < 5 else 1.0] * 8, "p_shuffled": 0.25}
            for s in range(1, 13)]
    stats = study_stats(rows)
    assert stats["steps"] == 12 and stats["final_accuracy"] == pytest.approx(1.0)
    assert stats["steps_to_0.5"] is not None and stats["steps_to_0.9"] > stats["steps_to_0.5"]
    assert stats["p_shuffled_end"] == pytest.approx(0.25)
    assert study_stats(rows[:2])["steps_to_0.9"] is None  # not reached
    figs = {f["name"]: f for f in study_figures({"plain_s0": dict(stats, final_accuracy=0.5),
                                                 "tgrpo_s0": stats}, [0])}
    assert figs["motion_study_tgrpo_vs_plain_final_accuracy"]["ratio"] == pytest.approx(2.0)
    assert figs["motion_study_tgrpo_vs_plain_steps_to_0.9"]["ratio"] == pytest.approx(1.0)


def test_prepare_assets_builds_again_when_the_config_changed(tmp_path, monkeypatch):
    """The cached demo model is reused only while it was built from the config's current settings."""
    builds = []

    def fake_build(argv, **kw):  # the subprocess's work: the files it leaves (the decision is what is tested)
        builds.append(argv[-1])
        for p in (tmp_path / "model" / "config.json", tmp_path / "data" / "train.jsonl",
                  tmp_path / "data" / "train_image.jsonl"):
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text("{}")

    monkeypatch.setattr(lr.subprocess, "run", fake_build)
    lr.prepare_assets(tmp_path, config="demo-motion")
    lr.prepare_assets(tmp_path, config="demo-motion")
    assert len(builds) == 1  # built once, then reused
    recipe = json.loads((tmp_path / "recipe.json").read_text())
    assert recipe["warm_pixels"] == 3136 and recipe["min_pixels"] == 12544
    (tmp_path / "model" / "stale_marker").write_text("x")
    lr.prepare_assets(tmp_path, config="demo")  # other settings: the old model and data go, a new build
    assert len(builds) == 2 and not (tmp_path / "model" / "stale_marker").exists()
    assert json.loads((tmp_path / "recipe.json").read_text()) == lr.asset_recipe("demo") != recipe
    (tmp_path / "recipe.json").unlink()  # built before recipes were recorded: built again
    lr.prepare_assets(tmp_path, config="demo")
    assert len(builds) == 3
