"""Host copies of an asynchronous checkpoint from a GPU (``HostBuffers``): pinned buffers, reused from one
checkpoint to the next, one buffer per name for DeepSpeed's state trees (``tied=False``). Skips without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_gpu_tensors_go_to_pinned_buffers_reused_across_checkpoints():
    from streamgrpo.learner.checkpoint.background import HostBuffers

    live = torch.randn(1024, 256, device="cuda")
    tensors = {"a": live, "b": live, "c": torch.arange(10, device="cuda")}
    host = HostBuffers()
    first = host.copy(tensors, prefix="optim/")
    assert first["a"].is_pinned() and first["a"].device.type == "cpu" and torch.equal(first["a"], live.cpu())
    assert first["a"] is first["b"]  # tied storage: one host copy (the model's state dict)
    live.add_(1.0)  # training goes on: the copy does not move
    assert not torch.equal(first["a"], live.cpu())
    second = host.copy(tensors, prefix="optim/")
    assert second["a"].data_ptr() == first["a"].data_ptr() and torch.equal(second["a"], live.cpu())  # reused
    trees = host.copy(tensors, prefix="tree/", tied=False)  # a safetensors state tree: no shared storage
    assert trees["a"].data_ptr() != trees["b"].data_ptr() and torch.equal(trees["a"], trees["b"])
