"""``python -m benchmarks.bench_cluster`` end to end, tiny: real redis-server, forked generator and
learner processes, real ZeroMQ weight fan-out; checks the result json's cells and figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.paths import REPO

sys.path.insert(0, str(REPO))

from benchmarks.common import validate_result  # noqa: E402


@pytest.mark.slow
def test_bench_cluster_tiny_run_writes_positive_figures(tmp_path):
    from streamgrpo.transport.queue.server import RedisServerError, find_redis_server

    try:
        find_redis_server("system")
    except RedisServerError as exc:
        pytest.skip(str(exc))
    out = tmp_path / "bench_cluster.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "benchmarks.bench_cluster", "--gens", "1,2", "--learners", "1", "--sizes", "0.1",
           "--seconds", "1", "--weights-mib", "1", "--weights-every", "0.3", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert validate_result(doc) == [] and doc["benchmark"] == "bench_cluster"
    cells = doc["cells"]
    assert [(c["gens"], c["learners"], c["size_mb"]) for c in cells] == [(1, 1, 0.1), (2, 1, 0.1)]
    for c in cells:
        assert c["groups"] > 0 and c["groups_per_s"] > 0 and c["MBps"] > 0, c
        assert c["latency_p50_ms"] > 0 and c["latency_p99_ms"] >= c["latency_p50_ms"], c
        assert c["redis_cpu_s"] > 0 and c["learner_cpu_s_mean"] > 0 and c["gen_cpu_s_mean"] > 0, c
        assert c["subscribers"] == c["gens"] and c["versions_published"] >= 1, c
        assert 0 < c["host_busy"] <= 1 and c["saturated"], c
    assert any(c["fanout_s_median"] is not None and c["fanout_s_median"] > 0 for c in cells), cells
    figs = {f["name"]: f for f in doc["figures"]}
    for name in ("cluster_0.1MB_1gen_1learn_groups_per_s", "cluster_0.1MB_2gen_1learn_groups_per_s",
                 "cluster_0.1MB_2gen_1learn_p99_ms"):
        assert figs[name]["value"] > 0 and figs[name]["baseline"] > 0 and figs[name]["ratio"] > 0, figs[name]
    assert figs["cluster_0.1MB_1gen_1learn_groups_per_s"]["ratio"] == pytest.approx(1.0)
    assert any(n.startswith("cluster_weights_fanout_") for n in figs)
    assert "| size MB | gens | learners |" in proc.stdout and "cores" in proc.stdout
    assert doc["machine"]["loadavg"] and doc["machine"]["redis_version"]
