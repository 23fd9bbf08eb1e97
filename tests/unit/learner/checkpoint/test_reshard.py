"""The per-parameter consolidation of ZeRO-1/2/3 optimizer shards and the refusals before DeepSpeed loads
(pure logic of ``streamgrpo.learner.checkpoint.reshard``; the end-to-end moves between 1 and 2 ranks are in
tests/integration/learner/checkpoint/test_resume_ranks.py)."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace

import torch

from streamgrpo.learner.checkpoint.files import save_tree
from streamgrpo.learner.checkpoint.reshard import (
    ZERO3_MODEL_STATES,
    consolidate_zero3,
    merge_zero12_shard,
    reshard_refusal,
)


def _shards(full: dict[str, torch.Tensor], ranks: int) -> list[dict]:
    """ZeRO-2 optimizer shards of one parameter group as DeepSpeed lays them out: the flattened parameters one
    after the other, cut into ``ranks`` equal partitions (the last padded); each rank records the fragment of
    each parameter it holds (``param_slice_mappings``: start in its partition, length)."""
    flat = torch.cat([t.flatten() for t in full.values()])
    part = -(-flat.numel() // ranks)
    flat = torch.cat([flat, torch.zeros(part * ranks - flat.numel())])
    out = []
    for r in range(ranks):
        lo, hi = r * part, (r + 1) * part
        mapping, offset = {}, 0
        for name, t in full.items():
            a, b = max(lo, offset), min(hi, offset + t.numel())
            if a < b:
                mapping[f"policy.{name}"] = SimpleNamespace(start=a - lo, numel=b - a)
            offset += t.numel()
        p = flat[lo:hi]
        out.append({"optimizer_state_dict": {
            "param_slice_mappings": [mapping], "single_partition_of_fp32_groups": [p.clone()],
            "base_optimizer_state": {"state": {0: {"step": torch.tensor(7.0), "exp_avg": p * 2, "exp_avg_sq": p * 3}},
                                     "param_groups": [{"params": [0]}]}}})
    return out


def test_the_fragments_of_every_rank_make_each_parameter_whole_again():
    g = torch.Generator().manual_seed(0)
    full = {"a.weight": torch.randn(3, 5, generator=g), "b.bias": torch.randn(7, generator=g),
            "c.weight": torch.randn(2, 2, generator=g)}
    for ranks in (1, 2, 3):
        pieces: dict = {}
        steps = [merge_zero12_shard(tree, None, pieces) for tree in _shards(full, ranks)]
        assert steps == [7] * ranks
        for name, t in full.items():
            got = {k: torch.cat(v).view(t.shape) for k, v in pieces[f"policy.{name}"].items()}
            assert torch.equal(got["fp32"], t) and torch.equal(got["exp_avg"], t * 2) and torch.equal(got["exp_avg_sq"], t * 3)


def test_a_rank_takes_only_the_parameters_it_wants():
    full = {"a.weight": torch.ones(4), "b.bias": torch.ones(6)}
    pieces: dict = {}
    for tree in _shards(full, 2):
        merge_zero12_shard(tree, {"policy.b.bias"}, pieces)
    assert set(pieces) == {"policy.b.bias"} and torch.cat(pieces["policy.b.bias"]["fp32"]).numel() == 6


def _ckpt(tmp_path, world: int, stage: int, shards: list[int]):
    state = tmp_path / "deepspeed" / "state"
    state.mkdir(parents=True)
    for r in shards:
        (state / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(b"")
    meta = {"backend": "deepspeed", "world_size": world, "zero_stage": stage}
    (tmp_path / "trainer_state.json").write_text(json.dumps(meta))
    return meta


def test_what_cannot_be_resharded_is_one_line_before_deepspeed_loads(tmp_path):
    meta = _ckpt(tmp_path / "ok", 2, 2, [0, 1])
    assert reshard_refusal(tmp_path / "ok", meta, zero_stage=2, world_size=1) is None
    assert reshard_refusal(tmp_path / "ok", meta, zero_stage=0, world_size=1) is None  # -> the torch backend
    assert reshard_refusal(tmp_path / "ok", meta, zero_stage=3, world_size=4) is None  # -> ZeRO-3 (issue 61)
    meta = _ckpt(tmp_path / "z3", 2, 3, [0, 1])
    (tmp_path / "z3" / "deepspeed" / "state" / ZERO3_MODEL_STATES).write_bytes(b"")
    assert reshard_refusal(tmp_path / "z3", meta, zero_stage=3, world_size=1) is None
    assert reshard_refusal(tmp_path / "z3", meta, zero_stage=2, world_size=4) is None
    meta = _ckpt(tmp_path / "z3-torn", 2, 3, [0, 1])  # its layout file missing
    assert ZERO3_MODEL_STATES in reshard_refusal(tmp_path / "z3-torn", meta, zero_stage=3, world_size=1)
    meta = _ckpt(tmp_path / "torn", 4, 2, [0, 1, 3])
    why = reshard_refusal(tmp_path / "torn", meta, zero_stage=2, world_size=2)
    assert "3 ZeRO optimizer shard(s) on disk" in why and "written by 4 rank(s)" in why
    meta = _ckpt(tmp_path / "zero0", 2, 0, [])
    why = reshard_refusal(tmp_path / "zero0", meta, zero_stage=3, world_size=1)
    # the way out it names works under ZeRO-3 too (tests/integration/learner/checkpoint/test_resume_ranks.py runs it)
    assert "ZeRO-0" in why and f"--fresh --from-weights {tmp_path / 'zero0'}" in why and "\n" not in why


def _zero3_shards(state: Path, full: dict[str, torch.Tensor], ranks: int, groups: list[list[str]]) -> None:
    """A ZeRO-3 checkpoint's state files as DeepSpeed lays them out (written as streamgrpo's safetensors trees):
    every parameter cut into ``ranks`` equal partitions (the last padded with zeros), rank r's partitions of a
    sub-group's parameters one after the other in its flat fp32 group, AdamW's moments alike; the order in rank 0's
    module file (``param_shapes``)."""
    state.mkdir(parents=True)
    save_tree({"param_shapes": [OrderedDict((f"policy.{n}", full[n].shape) for n in g) for g in groups],
               "lr_scheduler": {"last_epoch": 5}}, state / ZERO3_MODEL_STATES)
    for r in range(ranks):
        flats = []
        for g in groups:
            parts = []
            for n in g:
                t = full[n].flatten()
                part = -(-t.numel() // ranks)
                parts.append(torch.cat([t, torch.zeros(part * ranks - t.numel())])[r * part:(r + 1) * part])
            flats.append(torch.cat(parts))
        base = {i: {"step": torch.tensor(5.0), "exp_avg": f * 2, "exp_avg_sq": f * 3} for i, f in enumerate(flats)}
        save_tree({"optimizer_state_dict": {"partition_count": ranks, "fp32_flat_groups": flats,
                                            "optimizer_state_dict": {"state": base, "param_groups": []}}},
                  state / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")


def test_the_partitions_of_every_zero3_rank_make_each_parameter_whole_again(tmp_path):
    g = torch.Generator().manual_seed(0)
    full = {"a.weight": torch.randn(3, 5, generator=g), "b.bias": torch.randn(7, generator=g),
            "c.weight": torch.randn(2, 2, generator=g), "d.weight": torch.randn(1, generator=g)}
    shapes = {n: t.shape for n, t in full.items()}
    for ranks in (1, 2, 3, 4):
        state = tmp_path / f"r{ranks}"
        _zero3_shards(state, full, ranks, [["a.weight", "b.bias"], ["c.weight", "d.weight"]])  # two sub-groups
        states = consolidate_zero3(state, shapes)
        try:
            assert states.step == 5 and set(states.tensors) == set(full)
            for name, t in full.items():
                got = states.tensors[name]
                assert torch.equal(got["fp32"], t) and torch.equal(got["exp_avg"], t * 2), (ranks, name)
                assert torch.equal(got["exp_avg_sq"], t * 3), (ranks, name)
            # a rank of the new layout reads its range only, across the old ranks' partitions
            assert torch.equal(states.piece("a.weight", "exp_avg", 4, 13), (full["a.weight"] * 2).flatten()[4:13])
            assert torch.equal(states.piece("b.bias", "fp32", 6, 8), full["b.bias"][6:])  # past the end: cut
        finally:
            states.close()
    wanted = consolidate_zero3(tmp_path / "r2", shapes, wanted=["b.bias"])
    assert list(wanted.tensors) == ["b.bias"] and "a.weight" not in wanted.tensors
    wanted.close()


def test_a_zero3_state_that_does_not_fit_the_model_is_refused(tmp_path):
    full = {"a.weight": torch.ones(4, 3), "b.bias": torch.ones(5)}
    _zero3_shards(tmp_path / "s", full, 2, [list(full)])
    try:
        consolidate_zero3(tmp_path / "s", {"a.weight": torch.Size([4, 4]), "b.bias": torch.Size([5])})
    except ValueError as exc:
        assert "'a.weight' has shape (4, 3) in the checkpoint" in str(exc)
    else:
        raise AssertionError("a parameter of another shape was accepted")
    try:
        consolidate_zero3(tmp_path / "s", {n: t.shape for n, t in full.items()}, wanted=["a.weight", "c.weight"])
    except ValueError as exc:
        assert "no optimizer state for 1 trainable parameter(s)" in str(exc) and "c.weight" in str(exc)
    else:
        raise AssertionError("a trainable parameter without state was accepted")
