"""Rank 0's background write of a DeepSpeed asynchronous checkpoint (checkpoint_ranks.write_rank) while another
rank still writes into the same ``step-N.tmp``: a file rank 0 lists and then finds gone (the other rank's
``*.tmp``, renamed into place) must not fail rank 0's write."""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch


def test_rank0_write_survives_another_ranks_temporary_file_vanishing(tiny_model_dir, tmp_path):
    from streamgrpo.config import build_config
    from streamgrpo.learner.checkpoint.files import list_checkpoints, pack_tree, rng_state, staging_dir
    from streamgrpo.learner.checkpoint.ranks import RankSnapshot, finalise, write_rank
    from streamgrpo.models.loading import load_model, load_processor

    cfg = build_config({}, [f"model.name_or_path={tiny_model_dir}", "model.dtype=float32"])
    model = load_model(cfg.model, "cpu")
    tmp = staging_dir(tmp_path, 4)
    shard_dir = tmp / "deepspeed" / "state"
    shard_dir.mkdir(parents=True)
    # rank 1's optimizer shard as write_tree leaves it mid-write: listed by rank 0's walk, then renamed away
    # (a dangling link: os.walk lists it, opening it finds nothing, as a just-renamed file)
    os.symlink(shard_dir / "gone", shard_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt.999.tmp")
    tensors, skeleton = pack_tree({"step": 4, "exp_avg": torch.ones(3)})
    rng_tensors, rng_meta = rng_state()
    snap = RankSnapshot(step=4, tmp=tmp, trees=[(str(shard_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
                                                  tensors, skeleton)],
                        rng=(rng_tensors, rng_meta), weights={k: v.clone() for k, v in model.state_dict().items()},
                        meta={"step": 4}, model_card=None)
    learner = SimpleNamespace(dist=SimpleNamespace(rank=0), module=model, processor=load_processor(str(tiny_model_dir)))
    assert write_rank(learner, snap) == tmp
    assert (shard_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt").is_file()
    (shard_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt.999.tmp").unlink()  # rank 1 done: renamed
    assert finalise(tmp_path, 4, None).name == "step-000004"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000004"]
