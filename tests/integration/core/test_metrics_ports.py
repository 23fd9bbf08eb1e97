"""Metrics ports on one host, for real: two generator processes and the weight relay they start, with
the shipped 7B video config's fixed ``metrics.port`` (9100) as the Slurm template runs them
(``--local-index g``). Each serves /metrics on a port of its own (generators P and P + 1, the relay a
free one, all written to ``<run_dir>/ports/``); a third generator on the host without its own index
refuses to start in one line instead of a traceback."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

WAIT_S = 240.0


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _base_port() -> int:
    """The 7B video config's metrics.port (9100) when it and the next one are free here, else another
    free pair (a test elsewhere on this machine may hold 9100)."""
    from streamgrpo.config import load_config
    from streamgrpo.runtime.processes import free_port

    shipped = load_config("qwen2_5_vl_7b_video").metrics.port
    assert shipped == 9100
    for port in [shipped] + [free_port() for _ in range(20)]:
        if port < 65535 and _free(port) and _free(port + 1):
            return port
    pytest.skip("no two free adjacent ports on this machine")


def _ports_file(run: Path, role: str) -> dict | None:
    p = run / "ports" / f"{role}.json"
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        return r.read().decode()


def test_two_generators_and_their_relay_on_one_host_each_serve_metrics(tiny_model_dir, demo_data_dir, redis_server,
                                                                      redis_ns, tmp_path, short_tmp):
    from streamgrpo.config import load_config
    from streamgrpo.relay.keeper import lock_path
    from streamgrpo.runtime.processes import free_port

    base = _base_port()
    shm = short_tmp
    run = tmp_path / "run"
    shipped = load_config("qwen2_5_vl_7b_video")
    cfg = load_config("demo", [f"model.name_or_path={tiny_model_dir}", "demo.tiny_model=false",
                               "demo.make_data=false", f"data.train_path={Path(demo_data_dir) / 'train.jsonl'}",
                               f"run_dir={run}", f"queue.url={redis_server.url}", f"queue.namespace={redis_ns}",
                               "rollout.num_generators=3", "rollout.prompts_per_batch=1",
                               "rollout.max_completion_length=4", f"metrics.port={base}",
                               f"metrics.host={shipped.metrics.host}", "weights.relay=true",
                               f"weights.shm_dir={shm}", f"weights.pub_port={free_port()}",
                               f"weights.snapshot_port={free_port()}", "weights.max_wait_s=0",
                               "rollout.stop_grace_s=0"])  # no learner makes room in the queue they fill
    assert cfg.weights.relay_metrics_port == 0  # the default: never the generators' port
    config = tmp_path / "job.yaml"
    config.write_text(cfg.to_yaml())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    logs = [open(tmp_path / f"gen{k}.log", "wb") for k in range(2)]
    procs = [subprocess.Popen([sys.executable, "-m", "streamgrpo", "generator", "--config", str(config), "--id", str(k),
                               "--local-index", str(k)], stdout=logs[k], stderr=subprocess.STDOUT, env=env)
             for k in range(2)]
    lock = lock_path(cfg.weights)
    relay_role = f"relay-{socket.gethostname()}"
    try:
        end = time.monotonic() + WAIT_S
        roles = ["generator-0", "generator-1", relay_role]
        while time.monotonic() < end and not all(_ports_file(run, r) for r in roles):
            assert all(p.poll() is None for p in procs), [(tmp_path / f"gen{k}.log").read_text()[-2000:] for k in range(2)]
            time.sleep(0.5)
        ports = {r: (_ports_file(run, r) or {}).get("metrics") for r in roles}
        assert ports["generator-0"] == base and ports["generator-1"] == base + 1, ports
        assert ports[relay_role] not in (None, base, base + 1), ports
        for role, port in ports.items():
            assert "streamgrpo_" in _scrape(port), role
        # a third generator on this host without an index of its own: one line, no traceback
        third = subprocess.run([sys.executable, "-m", "streamgrpo", "generator", "--config", str(config), "--id", "2"],
                               env=env, capture_output=True, text=True, timeout=300)
        assert third.returncode == 2, third.stderr[-2000:]
        assert "Traceback" not in third.stderr
        line = third.stderr.strip().splitlines()[-1]
        assert line.startswith(f"streamgrpo generator: generator-2: metrics port {base} ") and "is taken" in line
        assert "--local-index" in line
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
        if lock.is_file() and lock.read_text().strip():  # the relay outlives its generators for a minute
            try:
                os.kill(int(lock.read_text()), signal.SIGTERM)
            except (ProcessLookupError, ValueError):
                pass
