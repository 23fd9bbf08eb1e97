"""The live agreement guard on stale tokens (pure): each staleness bucket against its own history."""

from __future__ import annotations

import math

import numpy as np

from streamgrpo.config import build_config
from streamgrpo.learner.agreement_guard import BucketSums, DriftGuard, add_buckets, bucket_of


def _step(rng, kl_by_bucket, shift=0.0, tokens=200):
    """One step's sums: per bucket a KL near the given value (5% noise) and a log-ratio of about minus it
    (agreement), both moved by a behaviour log-prob shift of ``-shift`` (learner - behaviour grows by shift)."""
    out = [BucketSums()]
    for kl in kl_by_bucket:
        k = kl * (1 + 0.05 * rng.standard_normal())
        lr = -k + shift
        k = k + math.exp(shift) - 1 - shift if shift else k
        out.append(BucketSums(tokens, k * tokens, lr * tokens))
    return out


def _guard(**sets):
    lc = build_config({}, [f"learner.{k}={v}" for k, v in sets.items()]).learner
    return DriftGuard.from_config(lc)


def test_a_stable_run_at_staleness_1_to_3_never_warns():
    rng = np.random.default_rng(0)
    g = _guard()
    lines = []
    for step in range(300):
        lr_scale = min(1.0, (step + 1) / 50)  # a warm-up: the per-bucket KL grows 2500-fold, then stays
        _, got = g.observe(_step(rng, [0.03 * lr_scale ** 2, 0.07 * lr_scale ** 2, 0.12 * lr_scale ** 2]))
        lines += got
    assert lines == [] and not any(g.firing)


def test_a_shift_of_the_behaviour_log_probs_warns_within_a_few_steps_once_per_bucket_and_rearms():
    rng = np.random.default_rng(1)
    g = _guard()
    for _ in range(30):
        assert g.observe(_step(rng, [0.03, 0.07, 0.12]))[1] == []
    verdicts, lines = g.observe(_step(rng, [0.03, 0.07, 0.12], shift=1.0))
    assert lines == [] and all(v.off for v in verdicts)  # one off step is not enough
    verdicts, lines = g.observe(_step(rng, [0.03, 0.07, 0.12], shift=1.0))
    assert [v.bucket for v in verdicts] == ["1", "2", "3+"] and all(v.firing for v in verdicts)
    assert len(lines) == 3 and lines[1].startswith("generators and learner disagree on tokens 2 version(s) old")
    assert "streamgrpo check agreement" in lines[0]
    for _ in range(10):  # a lasting mismatch keeps firing, without another line, and never becomes the baseline
        verdicts, lines = g.observe(_step(rng, [0.03, 0.07, 0.12], shift=1.0))
        assert lines == [] and all(v.firing for v in verdicts)
        assert all(abs(v.baseline_log_ratio + k) < 0.02 for v, k in zip(verdicts, [0.03, 0.07, 0.12]))
    verdicts, lines = g.observe(_step(rng, [0.03, 0.07, 0.12]))
    assert lines == [] and not any(v.firing for v in verdicts)  # back in agreement: re-armed
    g.observe(_step(rng, [0.03, 0.07, 0.12], shift=-0.4))  # a small shift up: the KL barely moves (0.07),
    verdicts, lines = g.observe(_step(rng, [0.03, 0.07, 0.12], shift=-0.4))  # the log-ratio does
    assert len(lines) == 3 and all(v.kl < 3 * v.baseline_kl for v in verdicts[1:])


def test_a_single_outlier_and_thin_buckets_do_not_warn():
    rng = np.random.default_rng(2)
    g = _guard()
    for _ in range(10):
        g.observe(_step(rng, [0.03, 0.07, 0.12]))
    assert g.observe(_step(rng, [0.03, 0.07, 0.12], shift=2.0))[1] == []
    assert g.observe(_step(rng, [0.03, 0.07, 0.12]))[1] == []
    assert g.observe(_step(rng, [0.03, 0.07, 0.12], shift=2.0))[1] == []  # the strike count started over
    thin = _step(rng, [0.03, 0.07, 0.12], shift=2.0, tokens=8)  # under min_tokens: not judged
    assert g.observe(thin) == ([], []) and g.observe(thin) == ([], [])


def test_buckets_add_up_and_staleness_3_and_older_share_one():
    assert [bucket_of(s) for s in (0, 1, 2, 3, 7)] == [0, 1, 2, 3, 3]
    a = [BucketSums(1, 0.5, -0.5), BucketSums(), BucketSums(2, 1.0, 2.0), BucketSums()]
    total = add_buckets([a, a])
    assert total[2].to_list() == [4, 2.0, 4.0] and total[2].kl == 0.5 and total[2].log_ratio == 1.0
    assert BucketSums.from_list(total[0].to_list()) == total[0] and math.isnan(total[1].kl)
