"""State trees as safetensors (the DeepSpeed checkpoint engine that writes no pickle)."""

from __future__ import annotations

import enum
import pickle
from collections import OrderedDict

import pytest
import torch

from streamgrpo.learner.checkpoint.files import (
    CheckpointError,
    SafeTensorsCheckpointEngine,
    load_tree,
    pack_tree,
    save_tree,
    unpack_tree,
)


class _Colour(enum.IntEnum):
    RED = 1


def _tree():
    return {
        "module": OrderedDict([("w", torch.arange(6, dtype=torch.float32).reshape(2, 3)), ("b", torch.zeros(0))]),
        "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(4, dtype=torch.bfloat16)}},
                      "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.99), "params": [0]}]},
        "shapes": [OrderedDict([("w", torch.Size([2, 3]))])],
        "dtype": torch.float32, "device": torch.device("cpu"), "flags": {1, 2}, "raw": b"\x00\x01",
        "none": None, "nan": float("inf"), "big": 2**40, "tuple_key": {(1, "a"): "x"},
    }


def test_round_trip_keeps_structure_types_and_bits(tmp_path):
    tree = _tree()
    save_tree(tree, tmp_path / "s.pt")
    back = load_tree(tmp_path / "s.pt")
    assert isinstance(back["module"], OrderedDict) and list(back["module"]) == ["w", "b"]
    assert torch.equal(back["module"]["w"], tree["module"]["w"]) and back["module"]["b"].shape == (0,)
    state = back["optimizer"]["state"][0]  # int keys survive
    assert state["exp_avg"].dtype == torch.bfloat16 and float(state["step"]) == 3.0
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.99)
    assert back["shapes"][0]["w"] == torch.Size([2, 3]) and back["dtype"] is torch.float32
    assert back["flags"] == {1, 2} and back["raw"] == b"\x00\x01" and back["nan"] == float("inf")
    assert back["big"] == 2**40 and back["tuple_key"] == {(1, "a"): "x"} and back["none"] is None
    with pytest.raises(pickle.UnpicklingError):  # the file is safetensors, not a torch.save pickle
        torch.load(tmp_path / "s.pt", weights_only=True)


def test_shared_storage_tensors_are_stored_separately(tmp_path):
    base = torch.arange(10.0)
    save_tree({"a": base[:5], "b": base[5:], "c": base}, tmp_path / "x")
    back = load_tree(tmp_path / "x")
    assert torch.equal(back["a"], base[:5]) and torch.equal(back["b"], base[5:]) and torch.equal(back["c"], base)


def test_deepspeed_objects_restore_but_foreign_classes_are_refused(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import LossScaler

    scaler = LossScaler(scale=4.0)
    back = load_tree_from(tmp_path, {"loss_scaler": scaler})
    assert isinstance(back["loss_scaler"], LossScaler) and back["loss_scaler"].cur_scale == 4.0

    with pytest.raises(CheckpointError, match="without pickle"):
        pack_tree({"x": _Colour.RED.__class__})  # a class object is not state
    with pytest.raises(CheckpointError, match="Colour"):
        pack_tree({"e": object.__new__(type("Colour", (), {}))})
    # a skeleton naming a class outside deepspeed is refused on load (no code named by a file runs)
    tensors, skeleton = pack_tree({"s": scaler})
    skeleton["items"][0][1]["cls"] = "os:system"
    with pytest.raises(CheckpointError, match="trusted"):
        unpack_tree(tensors, skeleton)


def load_tree_from(tmp_path, tree):
    save_tree(tree, tmp_path / "t")
    return load_tree(tmp_path / "t")


def test_engine_reads_back_and_rejects_a_pickle(tmp_path):
    eng = SafeTensorsCheckpointEngine()
    eng.makedirs(str(tmp_path / "d"), exist_ok=True)
    eng.save({"w": torch.ones(2)}, str(tmp_path / "d" / "m.pt"))
    assert torch.equal(eng.load(str(tmp_path / "d" / "m.pt"))["w"], torch.ones(2))
    assert eng.is_data_parallel_writer(0) and not eng.is_data_parallel_writer(1) and not eng.preserves_storage_sharing()
    torch.save({"w": torch.ones(2)}, tmp_path / "legacy.pt")
    with pytest.raises(CheckpointError, match="not a streamgrpo safetensors state file"):
        eng.load(str(tmp_path / "legacy.pt"))
