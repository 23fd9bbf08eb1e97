"""The reference client (examples/producer_client.py, which imports nothing from streamgrpo) against
a real learner: its groups train with no dead letter, its behaviour log-probs agree with the
learner's (importance ratio 1 at the first step, both sampling and training the same weights), and it
fetches and applies a weight version the learner published after training."""

from __future__ import annotations

import ast
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.paths import REPO

CLIENT = REPO / "examples" / "producer_client.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_client_imports_nothing_from_streamgrpo():
    tree = ast.parse(CLIENT.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {x for x in names if x.split(".")[0] == "streamgrpo"}, names


def test_reference_client_feeds_a_real_learner_and_applies_its_weights(tiny_model_dir, demo_data_dir, redis_server,
                                                                       redis_ns, tmp_path):
    from streamgrpo.config import load_config
    from streamgrpo.transport.queue.redis_stream import RedisQueue

    run = tmp_path / "run"
    pub, snap = _free_port(), _free_port()
    cfg = load_config("demo", [f"model.name_or_path={tiny_model_dir}", f"run_dir={run}",
                               f"data.train_path={Path(demo_data_dir) / 'train_image.jsonl'}",
                               f"queue.url={redis_server.url}", f"queue.namespace={redis_ns}",
                               "learner.max_steps=3", "learner.groups_per_step=2", "learner.save_steps=3",
                               "loss.drop_zero_variance=false", f"weights.pub_port={pub}", f"weights.snapshot_port={snap}",
                               "metrics.port=0", "demo.tiny_model=false", "demo.make_data=false"])
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(cfg.to_yaml())
    learner = subprocess.Popen([sys.executable, "-m", "streamgrpo", "learner", "--config", str(run / "config.yaml")],
                               env=ENV, stdout=open(tmp_path / "learner.log", "w"), stderr=subprocess.STDOUT)
    try:
        client = subprocess.run(
            [sys.executable, str(CLIENT), "--redis", redis_server.url, "--namespace", redis_ns, "--model",
             str(tiny_model_dir), "--records", str(Path(demo_data_dir) / "train_image.jsonl"), "--pub-port", str(pub),
             "--snapshot-port", str(snap), "--groups", "8", "--until-version", "1", "--num-generations", "4",
             "--max-tokens", "6", "--timeout-s", "300"],
            env={k: v for k, v in ENV.items() if k != "PYTHONPATH"}, cwd=tmp_path, capture_output=True, text=True,
            timeout=420)
        assert client.returncode == 0, client.stdout[-2000:] + client.stderr[-3000:]
        assert learner.wait(300) == 0, (tmp_path / "learner.log").read_text()[-3000:]
    finally:
        if learner.poll() is None:
            learner.kill()
    lines = client.stdout.splitlines()
    applied = [int(x.split(" v")[1].split(" ")[0]) for x in lines if x.startswith("applied weights v")]
    # a trained version, newer each time (v0 too when the learner published it before the client's first put;
    # a client that started late on a loaded machine sees v1 first, having sampled from the model on disk)
    assert applied == sorted(set(applied)) and applied[-1] >= 1, applied
    assert sum(x.startswith("put group ") for x in lines) == 8
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert abs(rows[0]["ratio_min"] - 1) < 1e-4 and abs(rows[0]["ratio_max"] - 1) < 1e-4  # the same log-probs
    assert rows[0]["kl_behaviour"] < 1e-6
    q = RedisQueue(redis_server.url, namespace=redis_ns, consumer="inspector")
    try:
        assert q.dead_letters() == []
        trained = [g for x in (run / "audit" / "learner.jsonl").read_text().splitlines() for e in [json.loads(x)]
                   if e["event"] == "trained" for g in e["group_ids"]]
        assert len(trained) == 6 == len(set(trained))
    finally:
        q.close()
