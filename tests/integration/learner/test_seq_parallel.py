"""``learner.sequence_parallel: 2`` on two gloo ranks: the same log-probs, entropies, gradients, losses and steps as
one rank without it (streamgrpo/models/ulysses.py, streamgrpo/models/seq_split.py, the learner's step).

Real parts: ``python -m torch.distributed.run`` with two gloo ranks on the CPU (``seq_parallel_driver.py``, one
launch for every check), the tiny Qwen2.5-VL (float32; sdpa and eager) and Qwen3-VL (sdpa), the row layout and the
shared-prompt layout, groups sampled from the demo videos, the torch backend (full, LoRA, the decoder layers compiled
with aot_eager) and DeepSpeed ZeRO-2 and ZeRO-3 (every weight partitioned: each call of a module gathers it, so every
rank must call each alike), a checkpoint written by the sequence-parallel learner and resumed, the frozen vision
trunk's frames split over the ranks (a rank without frames runs it over a stand-in). Bounds: log-probs and entropies 1e-6 (absolute);
each gradient tensor within 2e-6 of its largest element and the whole gradient within 1e-6 (relative norm): float32
sums in another order (the local columns' matmuls, two ranks' parts added), nothing else: the same model in float64
has every gradient element within 1e-6 absolute and 1e-9 of its tensor's largest.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import msgpack
import pytest

from tests.conftest import sampled_groups
from tests.integration.learner.seq_parallel_driver import RESUME
from tests.integration.learner.test_zero3_lockstep import zero3_every_weight_partitioned
from tests.paths import REPO
from tests.sessions import run_session


@pytest.fixture(scope="module")
def ranks(tiny_model_dir, tiny_qwen3_dir, demo_data_dir, tmp_path_factory):
    from streamgrpo.runtime.processes import free_port
    from streamgrpo.wire import encode

    tmp = tmp_path_factory.mktemp("seq_parallel")
    groups = sampled_groups(tiny_model_dir, Path(demo_data_dir) / "train.jsonl", 2, num_generations=4, max_tokens=6)
    (tmp / "groups.msgpack").write_bytes(msgpack.packb([encode(g) for g in groups]))
    short = sampled_groups(tiny_model_dir, Path(demo_data_dir) / "train.jsonl", 2, num_generations=4, max_tokens=6,
                           data_overrides=["data.min_frames=2", "data.max_frames=2"])  # one temporal patch
    (tmp / "short.msgpack").write_bytes(msgpack.packb([encode(g) for g in short]))
    zero3_every_weight_partitioned(tmp / "zero3.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(Path(__file__).with_name("seq_parallel_driver.py")),
           "--model", str(tiny_model_dir), "--model", str(tiny_qwen3_dir), "--groups", str(tmp / "groups.msgpack"),
           "--short-groups", str(tmp / "short.msgpack"), "--zero3-config", str(tmp / "zero3.json"),
           "--run-dir", str(tmp / "runs"), "--out", str(tmp / "out")]
    out = run_session(cmd, env=env, cwd=tmp, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return [json.loads((tmp / f"out-rank{r}.json").read_text()) for r in (0, 1)]


def test_logprobs_entropies_and_gradients_equal_one_rank(ranks):
    for rank in ranks:
        checks = rank["logprobs"]
        assert set(checks) == {"tiny_qwen2_5_vl0/sdpa", "tiny_qwen2_5_vl0/eager", "tiny_qwen3_vl0/sdpa",
                               "tiny_qwen2_5_vl0/sdpa/kv1",  # one key/value head for 2 ranks: repeated
                               "tiny_qwen2_5_vl0/sdpa/float64"}
        for where, layouts in checks.items():
            for layout, c in layouts.items():
                at = f"{where} {layout}: {c}"
                assert c["tokens"] > 0 and c["lp_scale"] > 1.0 and c["vision_grad"], at
                assert c["lp"] <= 1e-6 and c["ent"] <= 1e-6, at
                assert c["same_grads"] and c["grad_rel"] <= 2e-6 and c["grad_norm_rel"] <= 1e-6, at
                if where.endswith("float64"):  # every gradient element within 1e-6 of its tensor's largest, and absolute
                    assert c["grad_rel"] <= 1e-9 and c["grad"] <= 1e-6, at


def test_learner_steps_equal_one_rank_torch_lora_and_deepspeed(ranks):
    for rank in ranks:
        steps = rank["steps"]
        assert set(steps) == {"torch_rows", "torch_shared", "torch_lora", "zero2_rows", "zero3_rows", "torch_compile"}
        for name, c in steps.items():
            at = f"{name}: {c}"
            for one, sp in c["steps"]:  # [loss, grad norm, kl, micro-batches, global tokens]
                assert sp[3:] == one[3:], at  # the same micro-batches; the group's tokens counted once
                assert 2 * sp[0] == pytest.approx(one[0], abs=1e-6), at  # each rank's share: the two add up
                assert sp[1] == pytest.approx(one[1], rel=1e-5), at  # DeepSpeed sums the norm its own way
                assert sp[2] == pytest.approx(one[2], abs=1e-7), at
            second = c["steps"][1][0]
            assert abs(second[0]) > 1e-3, at  # a step with a real loss (the first one's is ~0: ratios 1)
            assert c["moved"] >= 1e-4 and c["weight"] <= 1e-4, at  # Adam's first steps: about the learning rate
            assert c["compiled"] == name.endswith("compile"), at  # learner.compile: every decoder layer
            if not name.startswith("zero"):
                assert c["same_grads"] and c["grad_rel"] <= 2e-6, at
            # the frozen vision trunk: each sequence-parallel rank ran it over its share of the frames only
            one_rows, sp_rows = c["vision_rows"]
            assert sp_rows and sum(sp_rows) < sum(one_rows), at
            if name.startswith("zero3"):  # a video of one temporal patch: one rank ran it whole, the other a stand-in
                assert set(sp_rows) & set(one_rows), at  # (of as many rows: both ranks' rows are equal, below)


def test_a_sequence_parallel_checkpoint_resumes(ranks):
    for rank in ranks:
        for name in RESUME:
            c = rank["steps"][name]
            assert c["resumed_exact"], name
            continued, resumed = c["after_resume"]
            assert resumed == continued, name
    assert ranks[0]["steps"] == ranks[1]["steps"]  # every rank computed the same step
