"""``eval.engine``: the pure choice and the factory that puts vLLM behind `streamgrpo eval` and the evaluator
(vLLM itself exists only on a GPU machine or in .venv-vllm: here its engine class is replaced by a recorder,
and without vLLM the choice is refused in one line)."""

from __future__ import annotations

import importlib.util
import json

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
    assert err.startswith("streamgrpo eval: eval.engine=vllm needs vLLM") and "Traceback" not in err
    assert "make setup-vllm" in err and err.endswith("or use eval.engine=hf. (import error: No module named 'vllm')")


# --- `infer --engine vllm` --------------------------------------------------------------------------
def _infer_input(demo_data_dir, tmp_path, n):
    lines = (demo_data_dir / "test.jsonl").read_text().splitlines()[:n]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, [json.loads(x)["id"] for x in lines]


def test_infer_engine_choice_is_checked_before_any_work(tmp_path, capsys):
    from streamgrpo.cli import main

    code = main(["infer", "--model", str(tmp_path / "none"), "--engine", "vllm", "--adapter", "runs/x/adapter",
                 "--prompt", "hi"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == ("streamgrpo infer: --engine vllm answers with a merged model, not --adapter "
                                 "'runs/x/adapter': `streamgrpo model merge --adapter DIR --out MERGED` first, "
                                 "or --engine hf")


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_infer_engine_vllm_without_vllm_is_one_line(tiny_model_dir, demo_data_dir, tmp_path, capsys):
    from streamgrpo.cli import main

    inp, _ = _infer_input(demo_data_dir, tmp_path, 2)
    out = tmp_path / "out.jsonl"
    code = main(["infer", "--config", "demo", "--model", str(tiny_model_dir), "--input", str(inp), "--output", str(out),
                 "--set", f"data.media_root={demo_data_dir}", "--set", "data.kinds=null", "--engine", "vllm"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("streamgrpo infer: --engine vllm needs vLLM, which is not installed") and "Traceback" not in err
    assert "pip install 'streamgrpo[gpu]'" in err and "make setup-vllm" in err and "or use --engine hf." in err
    assert not out.exists() or out.read_text() == ""


def test_infer_engine_vllm_hands_the_batch_over_in_one_call(tiny_model_dir, demo_data_dir, tmp_path, monkeypatch,
                                                            capsys):
    """The wiring only (vLLM itself runs in tests/integration/engines/test_vllm_cpu.py): `infer --engine vllm` builds
    vLLM for the records it will answer, hands all of them over in one generate call (the default
    --batch-size for vLLM), and extracts the answers as the HF path does."""
    import numpy as np

    from streamgrpo.cli import main
    from streamgrpo.engines.base import SampledCompletion
    from streamgrpo.engines.vllm import VLLMEngine

    calls, built = [], []

    class Recorder:
        def generate(self, requests, sampling):
            calls.append((list(requests), sampling))
            return [[SampledCompletion(np.array([1, 2], dtype=np.int32), np.zeros(2, np.float32),
                                       f"<think>{r.request_id}</think><answer>B</answer>", "stop")] for r in requests]

        def close(self):
            pass

    def from_config(cfg, processor, *, name="generator", counts=None):
        built.append((name, cfg.model.name_or_path, list(counts)))
        return Recorder()

    monkeypatch.setattr(VLLMEngine, "from_config", staticmethod(from_config))
    inp, ids = _infer_input(demo_data_dir, tmp_path, 10)
    out = tmp_path / "out.jsonl"
    code = main(["infer", "--config", "demo", "--model", str(tiny_model_dir), "--input", str(inp), "--output", str(out),
                 "--set", f"data.media_root={demo_data_dir}", "--set", "data.kinds=null", "--engine", "vllm",
                 "--max-new-tokens", "7"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert f"10 record(s) written to {out} in 1 vllm generate call(s); 0 skipped" in err
    (name, model, counts), = built
    assert name == "infer" and model == str(tiny_model_dir) and len(counts) == 10
    (requests, sampling), = calls  # one call, every record
    assert [r.request_id for r in requests] == ids
    assert [(sum(v.kind == "video" for v in r.visuals), sum(v.kind == "image" for v in r.visuals))
            for r in requests] == counts
    assert sampling.temperature == 0 and sampling.max_tokens == 7 and sampling.n == 1
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ids and {r["answer"] for r in rows} == {"B"}
