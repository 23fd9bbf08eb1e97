"""`streamgrpo slurm`'s rendered Prometheus files under a real Prometheus. The script itself runs on a real
Slurm of separate hosts in tests/integration/commands/test_slurm_cluster.py (it replaced the stand-ins for srun and
scontrol this file used to run it under)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from streamgrpo.commands.slurm import plan_job, render
from streamgrpo.config import load_config
from streamgrpo.runtime.processes import free_port
from tests.paths import REPO

pytestmark = pytest.mark.slow


def _free_ports(n: int) -> int:
    """The first of ``n`` consecutive free loopback ports."""
    from streamgrpo.runtime.processes import free_port

    for _ in range(50):
        base = free_port()
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("0.0.0.0", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


@pytest.mark.prometheus
def test_prometheus_scrapes_the_rendered_targets_under_the_rules_jobs(tmp_path):
    """A real Prometheus on the rendered prometheus.yml and targets.json (the script's writer, one node here):
    a target's `job` label replaces the scrape config's job_name, so up{job="learner"} is the learner's target
    (process and node labels kept), which StreamgrpoLearnerDown watches, and the shipped rules load healthy."""
    prometheus = shutil.which("prometheus") or "/usr/bin/prometheus"
    if not os.access(prometheus, os.X_OK):
        pytest.skip("prometheus not installed (apt-get install prometheus)")
    base = _free_ports(3)
    cfg = load_config("demo", [f"metrics.port={base}", "eval.enabled=false"])
    job = plan_job(cfg, 1, gpus_per_node=2, learner_ranks=1, generators=1)
    text = render(job, cfg, tmp_path / "my.yaml")
    prom = tmp_path / "prometheus"
    (prom / "rules").mkdir(parents=True)
    shutil.copy(REPO / "deploy/prometheus/rules.yml", prom / "rules" / "rules.yml")
    writer = re.search(r"\"\$PYTHON\" - [^\n]*<<'EOF'\n(.*?)\nEOF\n", text, re.S).group(1)
    subprocess.run([sys.executable, "-", str(prom / "targets.json"), "127.0.0.1"], input=writer, text=True, check=True)
    conf = re.search(r"prometheus\.yml\" <<'EOF'\n(.*?)EOF\n", text, re.S).group(1)
    (prom / "prometheus.yml").write_text(conf.replace("15s", "1s"))

    registry = CollectorRegistry()
    Gauge("streamgrpo_policy_version", "v", ["role"], registry=registry).labels(role="learner").set(3)
    server, _ = start_http_server(job.ports["learner-0"][1], addr="127.0.0.1", registry=registry)
    port = free_port()
    proc = subprocess.Popen([prometheus, f"--config.file={prom / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def query(q: str) -> list[dict]:
        url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": q})
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.load(r)["data"]["result"]

    try:
        deadline = time.monotonic() + 90
        learner = []
        while time.monotonic() < deadline:
            try:
                learner = query('up{job="learner"} == 1')
                if learner and len(query("up")) == len(job.ports):  # every target scraped once
                    break
            except OSError:
                pass
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            time.sleep(0.5)
        assert learner, "no learner target under job=learner"
        assert learner[0]["metric"]["process"] == "learner-0" and learner[0]["metric"]["node"] == "127.0.0.1"
        version = query('streamgrpo_policy_version{job="learner"}')
        assert version and version[0]["metric"]["role"] == "learner", "streamgrpo's own `role` label kept"
        assert {r["metric"]["job"] for r in query("up")} == {"learner", "generator", "relay"}  # no job=streamgrpo
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/rules", timeout=5) as r:
            rules = [x for g in json.load(r)["data"]["groups"] for x in g["rules"]]
        assert any(x["name"] == "StreamgrpoLearnerDown" for x in rules)
        assert all(x["health"] in ("ok", "unknown") for x in rules), [x for x in rules if x["health"] == "err"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        server.shutdown()
