"""``eval.engine``: the pure choice and the factory that puts vLLM behind `streamgrpo eval` and the evaluator
(vLLM itself exists only on a GPU machine or in .venv-vllm: here its engine class is replaced by a recorder,
and without vLLM the choice is refused in one line)."""

from __future__ import annotations

import importlib.util

import pytest

from streamgrpo.config import ConfigError, build_config
from streamgrpo.evaluator.answering import engine_choice, load_policy

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def test_engine_choice():
    assert engine_choice("hf", None) == "hf" and engine_choice("hf", "adapter/") == "hf"
    assert engine_choice("vllm", None) == "vllm"
    with pytest.raises(ConfigError, match=r"eval.engine=vllm answers with a merged model.*streamgrpo model merge"):
        engine_choice("vllm", "runs/x/adapter")
    with pytest.raises(ConfigError, match="expected hf or vllm"):
        engine_choice("sglang", None)
    assert build_config({}).eval.engine == "hf"
    with pytest.raises(ConfigError, match="eval.engine"):
        build_config({"eval": {"engine": "sglang"}})


def test_the_factory_builds_vllm_for_the_model_and_the_records_it_will_answer(tiny_model_dir, demo_data_dir,
                                                                               monkeypatch):
    from streamgrpo.data.records import load_records
    from streamgrpo.engines.vllm import VLLMEngine

    calls = []

    class Recorder:
        closed = False

        def close(self):
            Recorder.closed = True

    def from_config(cfg, processor, *, name="generator", counts=None):
        calls.append((cfg, processor, list(counts)))
        assert name == "eval"  # its start errors and log file are named for eval
        return Recorder()

    monkeypatch.setattr(VLLMEngine, "from_config", staticmethod(from_config))
    cfg = build_config({}, ["eval.engine=vllm", "rollout.vllm.gpu_memory_utilization=0.3"])
    records = load_records(demo_data_dir / "test.jsonl", cfg.data)[:4]
    policy = load_policy(str(tiny_model_dir), cfg, engine=cfg.eval.engine, records=records)
    (got, processor, counts), = calls
    assert got.model.name_or_path == str(tiny_model_dir) and got.model.lora is None
    assert got.rollout.vllm.gpu_memory_utilization == 0.3
    assert counts == [(len(r.videos), len(r.images)) for r in records]
    assert policy.processor is processor and policy.factor == 28 and isinstance(policy.engine, Recorder)
    policy.close()
    assert Recorder.closed and policy.engine is None  # vLLM's engine core is shut down with the policy
    assert cfg.model.name_or_path != str(tiny_model_dir)  # the caller's config is left as it was


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_eval_engine_vllm_without_vllm_is_one_line(tiny_model_dir, demo_data_dir, tmp_path, capsys):
    from streamgrpo.cli import main

    code = main(["eval", "--config", "demo", "--model", str(tiny_model_dir), "--data", str(demo_data_dir / "test.jsonl"),
                 "--limit", "2", "--out", str(tmp_path / "eval"), "--set", "eval.engine=vllm"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("streamgrpo eval: eval.engine=vllm: ") and "Traceback" not in err
