"""The session's cache of sampled groups (``conftest.sampled_groups``) gives what sampling gives: ``n``
groups are the first ``n`` of a larger draw (group i is seeded by its index), and each caller gets its
own copy."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _same(a, b) -> bool:
    return (a.group_id == b.group_id and a.prompt_id == b.prompt_id and np.array_equal(a.prompt_ids, b.prompt_ids)
            and all(np.array_equal(x.token_ids, y.token_ids) and np.array_equal(x.logprobs, y.logprobs)
                    and x.reward == y.reward for x, y in zip(a.completions, b.completions, strict=True)))


def test_sampled_groups_are_the_first_of_a_larger_draw(tiny_model_dir, demo_data_dir):
    from conftest import sampled_groups

    from benchmarks.rollouts import sample_groups

    data = Path(demo_data_dir) / "train.jsonl"
    two = sample_groups(tiny_model_dir, data, 2, num_generations=2, max_tokens=3)
    three = sample_groups(tiny_model_dir, data, 3, num_generations=2, max_tokens=3)
    assert all(_same(a, b) for a, b in zip(two, three[:2], strict=True))
    cached = sampled_groups(tiny_model_dir, data, 3, num_generations=2, max_tokens=3)
    again = sampled_groups(tiny_model_dir, data, 2, num_generations=2, max_tokens=3)
    assert all(_same(a, b) for a, b in zip(three, cached, strict=True))
    assert all(_same(a, b) for a, b in zip(two, again, strict=True))
    again[0].completions[0].token_ids[0] += 1  # a caller's change stays its own
    assert _same(sampled_groups(tiny_model_dir, data, 1, num_generations=2, max_tokens=3)[0], three[0])
