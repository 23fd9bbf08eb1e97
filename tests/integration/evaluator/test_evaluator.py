"""The evaluator against a real weight publisher: each published version is evaluated at that version
(a version whose weights were changed by hand gives other results), lines land in eval.jsonl, the
gauges follow, and a missing held-out file is a one-line error. Real demo mp4s and a tiny Qwen2.5-VL
taught the answer format."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import make_warm_demo


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    data, model = make_warm_demo(tmp_path_factory.mktemp("evaluator"), n=60)
    return {"data": data, "model": str(model)}


def _cfg(warm, run, pub, *sets):
    from streamgrpo.config import load_config

    return load_config("demo", [f"model.name_or_path={warm['model']}", f"run_dir={run}",
                                f"data.train_path={warm['data'] / 'train.jsonl'}",
                                f"data.eval_path={warm['data'] / 'test.jsonl'}", "data.kinds=null",
                                f"weights.pub_port={pub.pub_port}", f"weights.snapshot_port={pub.snapshot_port}",
                                "metrics.port=0", "eval.every_versions=1", "eval.max_records=6", *sets])


def _weights(model_dir: str, zero_norm: bool = False) -> dict:
    from streamgrpo.config import load_config
    from streamgrpo.models.loading import load_model

    net = load_model(load_config("demo", [f"model.name_or_path={model_dir}"]).model, "cpu", dtype="float32")
    out = {n: p.detach().clone() for n, p in net.named_parameters()}
    if zero_norm:  # changed by hand: the last norm outputs zeros, so every logit is 0 and greedy picks token 0
        name = next(n for n in out if n.endswith("language_model.norm.weight"))
        out[name].zero_()
    return out


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_evaluator_scores_each_version_at_that_version(warm, weight_publisher, tmp_path):
    from streamgrpo import metrics as M
    from streamgrpo.engines.base import SamplingParams
    from streamgrpo.evaluator.answering import load_policy
    from streamgrpo.evaluator.loop import _records, evaluate_version, run_evaluator
    from streamgrpo.rewards import RewardSet
    from streamgrpo.runtime.processes import StopFlag

    run = tmp_path / "run"
    cfg = _cfg(warm, run, weight_publisher, "eval.shuffle_frames=true")
    v0, v1 = _weights(warm["model"]), _weights(warm["model"], zero_norm=True)
    weight_publisher.publish(0, v0)
    done = threading.Event()
    result = {}
    t = threading.Thread(target=lambda: (result.update(code=run_evaluator(cfg, stop=StopFlag(install=False),
                                                                           max_evals=2)), done.set()), daemon=True)
    t.start()
    deadline = time.monotonic() + 300
    while not _lines(run / "eval.jsonl") and time.monotonic() < deadline:
        time.sleep(0.2)
    weight_publisher.publish(1, v1)
    assert done.wait(300) and result["code"] == 0
    first, second = _lines(run / "eval.jsonl")
    assert [first["version"], second["version"]] == [0, 1]
    # the same numbers as an offline evaluation of each version's weights
    policy = load_policy(warm["model"], cfg)
    sampling = SamplingParams(n=1, temperature=0.0, max_tokens=cfg.rollout.max_completion_length, seed=cfg.seed)
    rewards = RewardSet(cfg)
    records = _records(cfg)
    for line, tensors in ((first, v0), (second, v1)):
        policy.engine.load_weights(line["version"], tensors)
        summary, shuffled = evaluate_version(policy, records, cfg, sampling, rewards)
        assert {k: line[k] for k in summary} == summary and line["shuffled"] == shuffled
    assert first["format_compliance"] > 0.5 and second["format_compliance"] == 0.0 and second["accuracy"] == 0.0
    assert first != second
    # per kind, ordered and shuffled, with the drop
    assert set(first["by_kind"]) == set(first["shuffled"]["by_kind"]) == set(first["shuffle_drop"]["by_kind"])
    assert M.EVAL_VERSION._value.get() == 1
    assert M.EVAL_FORMAT._value.get() == 0.0
    assert M.EVAL_ACCURACY.labels(kind="all", frames="shuffled")._value.get() == second["shuffled"]["accuracy"]


def test_evaluator_without_held_out_records_is_one_line(warm, tmp_path):
    out = subprocess.run([sys.executable, "-m", "streamgrpo", "evaluator", "--config", "demo",
                          "--set", f"model.name_or_path={warm['model']}", "--set", "data.eval_path=null",
                          "--set", "eval.enabled=false"],
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == ("streamgrpo evaluator: the evaluator needs held-out records: set "
                                                   "data.eval_path")
    missing = subprocess.run([sys.executable, "-m", "streamgrpo", "evaluator", "--config", "demo",
                              "--set", f"model.name_or_path={warm['model']}", "--set",
                              f"data.eval_path={tmp_path / 'nope.jsonl'}"],
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr and "nope.jsonl" in missing.stderr
