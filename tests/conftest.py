"""Shared fixtures. Servers are real (redis-server, prometheus) on free loopback ports, stopped by PID."""

from __future__ import annotations

import os

# One torch thread per process: the CI machine has 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

import pytest  # noqa: E402


# --- tiny model -------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Qwen2.5-VL (model + tokenizer + processor) saved to disk, built offline."""
    from streamgrpo.models.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny_qwen2_5_vl"), arch="qwen2_5_vl", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    """A tiny random Qwen3-VL saved to disk, built offline."""
    from streamgrpo.models.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny_qwen3_vl"), arch="qwen3_vl", seed=0)


@pytest.fixture(params=["qwen2_5_vl", "qwen3_vl"])
def tiny_any_dir(request):
    """Both tiny architectures, one after the other."""
    name = "tiny_model_dir" if request.param == "qwen2_5_vl" else "tiny_qwen3_dir"
    return request.getfixturevalue(name)


# --- demo data ---------------------------------------------------------------------------------
# (data pipeline fixtures go here)


# --- redis (queue) -----------------------------------------------------------------------------
# (redis-server fixtures go here)


# --- zmq (weights) -----------------------------------------------------------------------------
# (weight-channel fixtures go here)
