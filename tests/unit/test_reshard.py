"""The per-parameter consolidation of ZeRO-1/2 optimizer shards and the refusals before DeepSpeed loads
(pure logic of ``streamgrpo.learner.reshard``; the end-to-end moves between 1 and 2 ranks are in
tests/integration/test_resume_ranks.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from streamgrpo.learner.reshard import merge_zero12_shard, reshard_refusal


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
    why = reshard_refusal(tmp_path / "ok", meta, zero_stage=3, world_size=4)
    assert "ZeRO-3" in why and "--from-weights" in why and "\n" not in why
    meta = _ckpt(tmp_path / "z3", 2, 3, [0, 1])
    assert "ZeRO-3" in reshard_refusal(tmp_path / "z3", meta, zero_stage=2, world_size=4)
    meta = _ckpt(tmp_path / "torn", 4, 2, [0, 1, 3])
    why = reshard_refusal(tmp_path / "torn", meta, zero_stage=2, world_size=2)
    assert "3 ZeRO optimizer shard(s) on disk" in why and "written by 4 rank(s)" in why
    (tmp_path / "torch").mkdir()
    assert "optimizer.safetensors" in reshard_refusal(tmp_path / "torch", {"backend": "torch"}, zero_stage=2,
                                                      world_size=2)
