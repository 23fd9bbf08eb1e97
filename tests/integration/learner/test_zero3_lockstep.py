"""DeepSpeed ZeRO-3 on several ranks gathers a module's weights at each call, collectively: every rank must call the
LM head as often, though its micro-batch holds its own number of completion tokens (the learner agrees on the most
any rank needs, :meth:`streamgrpo.learner.trainer.Learner._head_calls`, and the others call it over no rows).

Real parts: ``python -m torch.distributed.run`` with two gloo ranks (``zero3_lockstep_driver.py``), the tiny
Qwen2.5-VL, the shipped ``zero3`` DeepSpeed config with no weight kept whole (its persistence threshold 0: most of
the tiny model's weights are otherwise under it), groups sampled from the demo data; rank 0's completions are made
long enough for two chunks of the head, rank 1's need one. Without the agreement the ranks' collectives do not
match (gloo: "Received data size doesn't match expected size"; NCCL would hang). Likewise the vision encoder: rank 0's
micro-batch holds an image group and a video group, rank 1's the video group alone; with a call per kind rank 0 called
the encoder twice, rank 1 once (the same failure); the learner runs both kinds through it in one call
(``TrainBatch.one_vision_call``). And a rank whose micro-batch has no visual at all (a text-only record) while the
other's has a video runs the encoder over a stand-in (``TrainBatch.vision_stand_in``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import msgpack
import pytest

from tests.conftest import sampled_groups
from tests.paths import REPO
from tests.sessions import run_session

pytestmark = pytest.mark.slow


def test_zero3_ranks_with_different_completion_lengths_call_the_head_alike_and_train(tiny_model_dir, demo_data_dir,
                                                                                     tmp_path):
    from streamgrpo.models.logprobs import CHUNK_TOKENS
    from streamgrpo.runtime.processes import free_port
    from streamgrpo.wire import encode

    groups = sampled_groups(tiny_model_dir, Path(demo_data_dir) / "train.jsonl", 2, num_generations=4, max_tokens=6)
    (tmp_path / "groups.msgpack").write_bytes(msgpack.packb([encode(g) for g in groups]))
    image = sampled_groups(tiny_model_dir, Path(demo_data_dir) / "train_image.jsonl", 1, num_generations=4, max_tokens=6)
    (tmp_path / "mixed.msgpack").write_bytes(msgpack.packb([encode(g) for g in image + groups[:1]]))
    text = sampled_groups(tiny_model_dir, _text_records(Path(demo_data_dir), tmp_path), 1, num_generations=4,
                          max_tokens=6)
    assert not text[0].visuals
    (tmp_path / "text.msgpack").write_bytes(msgpack.packb([encode(g) for g in text]))
    zero3_every_weight_partitioned(tmp_path / "zero3.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(Path(__file__).with_name("zero3_lockstep_driver.py")),
           "--model", str(tiny_model_dir), "--groups", str(tmp_path / "groups.msgpack"),
           "--mixed", str(tmp_path / "mixed.msgpack"), "--text", str(tmp_path / "text.msgpack"),
           "--deepspeed-config", str(tmp_path / "zero3.json"),
           "--run-dir", str(tmp_path / "run"), "--out", str(tmp_path / "out")]
    out = run_session(cmd, env=env, cwd=tmp_path, timeout=600)
    (tmp_path / "torchrun.log").write_text(out.stdout + out.stderr)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"out-rank{r}.json").read_text()) for r in (0, 1))
    assert r0["tokens"] > CHUNK_TOKENS >= r1["tokens"]  # two head chunks against one
    assert all(loss is not None and loss == loss for loss in r0["losses"] + r1["losses"])  # both steps trained
    assert r0["calls"] == r1["calls"]  # forward and backward (the chunks' recompute included) alike
    assert r1["calls"]["forward"] >= 2 * 2  # two steps, the second chunk over no rows on rank 1
    # images and videos on rank 0, videos alone on rank 1: as many encoder calls, and both trained
    assert (r0["mixed"]["kinds"], r1["mixed"]["kinds"]) == (["image", "video"], ["video"])
    assert r0["mixed"]["vision_calls"] == r1["mixed"]["vision_calls"] >= 1
    # a text-only micro-batch on rank 0, a video on rank 1: rank 0 calls the encoder over a stand-in as often
    assert (r0["text"]["kinds"], r1["text"]["kinds"]) == ([], ["video"])
    assert r0["text"]["vision_calls"] == r1["text"]["vision_calls"] >= 1
    for step in ("mixed", "text"):
        assert all(r[step]["loss"] is not None and r[step]["loss"] == r[step]["loss"] for r in (r0, r1)), step


def zero3_every_weight_partitioned(path: Path) -> Path:
    """The shipped ``zero3`` DeepSpeed config with no weight kept whole (persistence threshold 0: the tiny model's
    weights are otherwise under it), written to ``path``: every module call gathers, so a mismatch shows."""
    ds = json.loads((REPO / "streamgrpo" / "configs" / "deepspeed" / "zero3.json").read_text())
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    path.write_text(json.dumps(ds))
    return path


def _text_records(demo: Path, tmp: Path) -> Path:
    """The demo's single-video records without their video: text-only questions, media paths resolved there."""
    out = tmp / "text.jsonl"
    rows = []
    for line in (demo / "train.jsonl").read_text().splitlines():
        r = json.loads(line)
        if isinstance(r.get("video"), str):
            r.pop("video")
            r["conversations"][0]["value"] = r["conversations"][0]["value"].replace("<video>\n", "")
            rows.append(json.dumps(r))
    out.write_text("\n".join(rows) + "\n")
    return out
