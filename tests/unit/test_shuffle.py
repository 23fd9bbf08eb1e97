"""Shuffled frames: really permuted, deterministic per seed, each video on its own, images untouched."""

from __future__ import annotations

import numpy as np

from streamgrpo.data.shuffle import has_video, shuffle_visuals, shuffled_order
from streamgrpo.wire import Visual


def _video(t: int, base: int) -> Visual:
    frames = np.stack([np.full((4, 4, 3), base + i, np.uint8) for i in range(t)])
    return Visual("video", frames, 2.0, np.arange(10, 10 + t, dtype=np.int32))


def test_order_is_a_non_identity_permutation_for_two_or_more():
    rng = np.random.default_rng(0)
    for n in (2, 3, 8):
        for _ in range(50):
            order = shuffled_order(n, rng)
            assert sorted(order.tolist()) == list(range(n)) and order.tolist() != list(range(n))
    assert shuffled_order(1, rng).tolist() == [0] and shuffled_order(0, rng).tolist() == []


def test_frames_are_permuted_within_each_video_and_images_kept():
    image = Visual("image", np.zeros((1, 4, 4, 3), np.uint8))
    visuals = [_video(8, 0), image, _video(4, 100)]
    out = shuffle_visuals(visuals, np.random.default_rng(7))
    assert out[1] is image
    for before, after in ((visuals[0], out[0]), (visuals[2], out[2])):
        firsts = after.frames[:, 0, 0, 0].tolist()
        assert sorted(firsts) == before.frames[:, 0, 0, 0].tolist() and firsts != sorted(firsts)  # same frames, new order
        assert after.frame_indices.tolist() == before.frame_indices.tolist()  # position labels keep their order
        assert after.fps == before.fps
    assert visuals[0].frames[:, 0, 0, 0].tolist() == list(range(8))  # inputs untouched
    again = shuffle_visuals(visuals, np.random.default_rng(7))
    assert all(np.array_equal(a.frames, b.frames) for a, b in zip(out, again))  # deterministic per seed
    other = shuffle_visuals(visuals, np.random.default_rng(8))
    assert not np.array_equal(other[0].frames, out[0].frames)
    assert has_video(visuals) and not has_video([image]) and not has_video([_video(1, 0)])
