"""The DeepSpeed config streamgrpo derives from learner.* and the shipped DeepSpeed files (streamgrpo/configs/deepspeed)."""

from __future__ import annotations

import json

import pytest

from streamgrpo.config import ConfigError, build_config
from streamgrpo.learner.deepspeed_setup import deepspeed_config
from tests.paths import REPO

DEPLOY = REPO / "streamgrpo" / "configs" / "deepspeed"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_shipped_files_get_what_streamgrpo_owns(stage):
    cfg = build_config({"learner": {"backend": "deepspeed", "deepspeed_config": str(DEPLOY / f"zero{stage}.json"),
                                    "bf16": False, "max_grad_norm": 0.5}})
    ds = deepspeed_config(cfg)
    assert ds["zero_optimization"]["stage"] == stage
    assert ds["bf16"]["enabled"] is False and ds["gradient_clipping"] == 0.5  # learner.* wins over the file
    assert ds["train_micro_batch_size_per_gpu"] == 1 and ds["gradient_accumulation_steps"] == 1
    assert "optimizer" not in ds and "train_batch_size" not in ds
    if stage == 1:
        assert ds["zero_optimization"]["overlap_comm"] is False


def test_default_is_zero2_and_bf16_follows_the_flag():
    ds = deepspeed_config(build_config({"learner": {"backend": "deepspeed", "bf16": True}}))
    assert ds["zero_optimization"]["stage"] == 2 and ds["bf16"]["enabled"] is True


def test_optimizer_blocks_and_bad_files_are_clear_errors(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 2}}))
    with pytest.raises(ConfigError, match="'optimizer' block"):
        deepspeed_config(build_config({"learner": {"deepspeed_config": str(bad)}}))
    with pytest.raises(ConfigError, match="cannot read it as JSON"):
        deepspeed_config(build_config({"learner": {"deepspeed_config": str(tmp_path / "missing.json")}}))
    fp16 = tmp_path / "fp16.json"
    fp16.write_text(json.dumps({"fp16": {"enabled": True}}))
    with pytest.raises(ConfigError, match="pick one"):
        deepspeed_config(build_config({"learner": {"deepspeed_config": str(fp16), "bf16": True}}))


def test_reference_config_partitions_the_reference_under_zero3_only():
    from streamgrpo.learner.deepspeed_setup import reference_config

    z3 = deepspeed_config(build_config({"learner": {"backend": "deepspeed", "bf16": True,
                                                    "deepspeed_config": str(DEPLOY / "zero3.json")}}))
    ref = reference_config(z3)
    assert ref is not None and ref["zero_optimization"]["stage"] == 3 and ref["bf16"] == {"enabled": True}
    assert "optimizer" not in ref and "scheduler" not in ref  # an engine without optimizer: inference only
    assert ref["zero_optimization"]["stage3_param_persistence_threshold"] == \
        z3["zero_optimization"]["stage3_param_persistence_threshold"]
    assert "reduce_bucket_size" not in ref["zero_optimization"]  # nothing of the gradient side
    for stage in (1, 2):
        ds = deepspeed_config(build_config({"learner": {"backend": "deepspeed",
                                                        "deepspeed_config": str(DEPLOY / f"zero{stage}.json")}}))
        assert reference_config(ds) is None
