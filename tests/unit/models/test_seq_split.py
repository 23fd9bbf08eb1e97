"""The sequence-parallel split (streamgrpo/models/seq_split.py), pure: padding, columns, positions, owners of the
log-probs, the vision features of each rank's columns, and the frames of a vision pass dealt to ranks."""

from __future__ import annotations

import pytest
import torch

from streamgrpo.models.seq_split import SeqSplit, SplitError, split_frames


def test_columns_padding_and_owners_by_hand():
    ids = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]])
    a, b = SeqSplit(5, 2, 0), SeqSplit(5, 2, 1)
    assert (a.chunk, a.padded, a.start, a.stop, b.start, b.stop) == (3, 6, 0, 3, 3, 6)
    assert a.local(ids, 9).tolist() == [[1, 2, 3], [6, 7, 8]]
    assert b.local(ids, 9).tolist() == [[4, 5, 9], [0, 0, 9]]  # the padding goes to the last rank, after all
    pos = torch.tensor([0, 2, 3, 4])  # the positions whose hidden states predict completion tokens
    assert a.owner(pos).tolist() == [0, 0, 1, 1]
    assert a.owns(pos).tolist() == [True, True, False, False] and b.owns(pos).tolist() == [False, False, True, True]
    assert SeqSplit(6, 3, 2).local(torch.arange(6)).tolist() == [4, 5]  # a multiple already: no padding
    assert SeqSplit(1, 4, 3).local(torch.tensor([7])).tolist() == [0]  # more ranks than tokens: padding only


@pytest.mark.parametrize("length,world", [(7, 2), (8, 2), (10, 3), (3, 4)])
def test_every_column_and_token_is_one_ranks(length, world):
    ids = torch.arange(2 * length).view(2, length)
    splits = [SeqSplit(length, world, r) for r in range(world)]
    joined = torch.cat([s.local(ids, -1) for s in splits], dim=-1)
    assert torch.equal(joined[:, :length], ids) and (joined[:, length:] == -1).all()
    pos = torch.arange(length)
    owned = torch.stack([s.owns(pos) for s in splits]).int()
    assert (owned.sum(0) == 1).all()
    assert torch.equal(owned.argmax(0), splits[0].owner(pos))


def test_positions_sliced_on_every_axis_and_padding_continues():
    # m-RoPE: 3 axes (temporal, height, width), a video's tokens share a temporal position
    pos = torch.tensor([[[0, 1, 1, 1, 1, 3, 4]], [[0, 1, 1, 2, 2, 3, 4]], [[0, 1, 2, 1, 2, 3, 4]]])
    a, b = SeqSplit(7, 2, 0), SeqSplit(7, 2, 1)
    assert a.local_positions(pos)[:, 0].tolist() == [[0, 1, 1, 1], [0, 1, 1, 2], [0, 1, 2, 1]]
    assert b.local_positions(pos)[:, 0].tolist() == [[1, 3, 4, 5], [2, 3, 4, 5], [2, 3, 4, 5]]
    qwen3 = torch.cat([torch.arange(7).view(1, 1, 7), pos])  # 4 axes: text positions first
    assert torch.equal(b.local_positions(qwen3)[1:], b.local_positions(pos))


def test_vision_features_of_each_ranks_columns():
    # two sequences; placeholders (1) take features 0..4 in row-major order
    mask = torch.tensor([[0, 1, 1, 0, 1], [1, 1, 0, 0, 0]], dtype=torch.bool)
    a, b = SeqSplit(5, 2, 0), SeqSplit(5, 2, 1)
    la, ia = a.feature_index(mask)
    lb, ib = b.feature_index(mask)
    assert la.tolist() == [[False, True, True], [True, True, False]] and ia.tolist() == [0, 1, 3, 4]
    assert lb.tolist() == [[False, True, False], [False, False, False]] and ib.tolist() == [2]
    # scattered into local embeddings, every feature lands where the whole sequence has it
    feats = torch.arange(5.0)[:, None] * 10
    whole = torch.zeros((2, 5, 1)).masked_scatter(mask[..., None], feats)
    parts = [torch.zeros((2, s.chunk, 1)).masked_scatter(lm[..., None], feats[i])
             for s, (lm, i) in ((a, (la, ia)), (b, (lb, ib)))]
    assert torch.equal(torch.cat(parts, dim=1)[:, :5], whole)


def test_frames_dealt_in_order_and_about_evenly():
    grids = [(4, 2, 2), (1, 4, 4), (2, 2, 2)]  # a 4-frame video, an image (16 patches), a 2-frame video
    parts = split_frames(grids, 2)
    # concatenated in rank order the pieces are the frames in order, each whole (item, first t, count, patches)
    flat = [(i, t) for pieces in parts for (i, first, n, _) in pieces for t in range(first, first + n)]
    assert flat == [(i, t) for i, (n, _, _) in enumerate(grids) for t in range(n)]
    sizes = [sum(p for *_, p in pieces) for pieces in parts]
    assert sum(sizes) == 16 + 16 + 8 and abs(sizes[0] - sizes[1]) <= 16
    assert parts[0] == [(0, 0, 4, 16)] and parts[1] == [(1, 0, 1, 16), (2, 0, 2, 8)]
    assert split_frames([(3, 1, 1)], 4) == [[(0, 0, 1, 1)], [], [(0, 1, 1, 1)], [(0, 2, 1, 1)]]  # a rank may get none
    assert split_frames([(5, 2, 2)], 1) == [[(0, 0, 5, 20)]]


def test_bad_splits_say_why():
    with pytest.raises(SplitError, match="rank 2 of 2"):
        SeqSplit(4, 2, 2)
    with pytest.raises(SplitError, match="0 tokens"):
        SeqSplit(0, 2, 0)
    with pytest.raises(SplitError, match="3 columns for sequences of 4"):
        SeqSplit(4, 2, 0).local(torch.zeros((1, 3)))


def test_torch_backend_ranks_only_as_one_sequence_parallel_group(monkeypatch):
    from streamgrpo.learner.distributed import init_distributed

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match="learner.sequence_parallel=4"):
        init_distributed("torch", sequence_parallel=2)  # 4 ranks are not one group of 2


def test_the_learner_refuses_ranks_that_sequence_parallel_cannot_split_before_loading(tmp_path):
    from streamgrpo.config import ConfigError, build_config
    from streamgrpo.learner.distributed import DistInfo
    from streamgrpo.learner.trainer import Learner

    tree = {"run_dir": str(tmp_path), "model": {"name_or_path": "/nonexistent/model"},
            "learner": {"sequence_parallel": 2, "groups_per_step": 2, "device": "cpu"}}
    with pytest.raises(ConfigError, match="needs a multiple of 2 learner ranks .this learner has 3."):
        Learner(build_config(tree), dist=DistInfo(rank=0, world_size=3))
