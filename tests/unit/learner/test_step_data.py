"""The typed step numbers: a rank's output, the merge over ranks, the metrics.jsonl line (no model)."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch

from streamgrpo.learner.agreement_guard import BucketSums
from streamgrpo.learner.state import Accepted, LearnerState
from streamgrpo.learner.step_data import LossStats, Probe, StepOutput, StepRecord, StepSummary
from streamgrpo.wire import Completion, ScoredGroup

# the metrics.jsonl keys, in order (orchestrate, report, tracking, the benchmarks and the dashboards read them)
RECORD_KEYS = [
    "step", "version", "time", "reward", "rewards", "accuracy", "group_accuracy", "loss", "kl", "entropy",
    "clip_frac", "clip_frac_low", "clip_frac_high", "ratio_mean", "ratio_max", "ratio_min", "grad_norm", "ess",
    "kl_behaviour", "is_masked_frac", "adv_mean", "adv_std", "policy_seq_log_prob", "zero_variance_groups",
    "staleness_mean", "staleness_max", "token_staleness_mean", "groups_trained", "groups_dropped", "tokens", "completion_len_mean", "lr",
    "ranks", "micro_batches", "seconds", "wait_seconds", "seq_tokens", "tokens_per_second", "model_flops", "mfu",
    "update_kl", "update_scale", "kl_fresh", "fresh_tokens", "staleness_tokens", "staleness_kl", "staleness_log_ratio",
]


def _group(gid, rewards, lens, staleness=0, accuracy=True, temperature=None):
    comps = [Completion(np.arange(n, dtype=np.int32), np.zeros(n, np.float32), "t", "stop",
                        {"accuracy": r, "format": 1 - r} if accuracy else {"format": r}, r)
             for r, n in zip(rewards, lens)]
    meta = {} if temperature is None else {"temperature": temperature}
    g = ScoredGroup(prompt_id="p", generator_id="g", policy_version=0, model_id="m", prompt_ids=np.zeros(3, np.int32),
                    visuals=[], answer="a", completions=comps, meta=meta, group_id=gid)
    return Accepted("s-" + gid, g, None, staleness)


def _out(tokens, adv, work=None, **stats):
    base = dict(kl=0.01, entropy=2.0, clip_frac=0.1, clip_frac_low=0.04, clip_frac_high=0.06, ratio_mean=1.0,
                ratio_sq_mean=1.05, kl_behaviour=0.003, is_masked_frac=0.0, ratio_max=1.4, ratio_min=0.7)
    return StepOutput(loss=0.25, grad_norm=1.5, tokens_global=40, zero_variance=1, adv_N=torch.tensor(adv),
                      micro_batches=2, seq_logprob_sum=-12.0, rows=len(adv),
                      stats=LossStats(tokens=tokens, **{**base, **stats}), **(work or {}))


def test_token_staleness_counts_each_token_from_its_own_version():
    a = _group("g0", [1.0, 0.0], [4, 2], staleness=3)  # learner at v3, group policy_version 0
    a.group.completions[0].versions = np.array([0, 0, 2, 3], dtype=np.int32)  # updated in flight twice
    s = StepSummary.of_rank([a], _out(6, [1.0, -1.0]), {})
    assert s.completion_tokens == 6
    assert s.token_staleness_sum == (3 + 3 + 1 + 0) + 2 * 3  # the untouched completion: all at v0


def test_two_ranks_merge_into_one_metrics_line():
    batches = [[_group("g0", [1.0, 0.0], [5, 4], 1), _group("g1", [1.0, 1.0], [3, 5], 0)],
               [_group("g2", [0.5, 0.25], [6, 6], 2, accuracy=False), _group("g3", [0.0, 1.0], [5, 6], 3)]]
    outs = [_out(17, [1.0, -1.0, 0.0, 0.0], work={"fresh_kl_sum": 0.08, "fresh_tokens": 8,  # g1: staleness 0
                                                  "staleness_sums": [BucketSums(8, 0.08, -0.08), BucketSums(9, 0.9, -0.8),
                                                                     BucketSums(), BucketSums()]}),
            _out(23, [0.5, -0.5, 1.5, -1.5], kl=0.03, entropy=None, ratio_max=2.5, ratio_min=0.9, ratio_sq_mean=1.2,
                 work={"staleness_sums": [BucketSums(), BucketSums(1, 0.1, 0.0), BucketSums(5, 0.5, -0.25),
                                          BucketSums(6, 0.6, 3.0)]})]
    drops = [Counter(stale=2), Counter(mismatch=1, stale=1)]
    parts = [json.loads(json.dumps(StepSummary.of_rank(b, o, d).to_json())) for b, o, d in zip(batches, outs, drops)]
    merged = StepSummary.merge(parts)
    assert merged.ranks == 2 and merged.groups == 4 and merged.group_ids == ["g0", "g1", "g2", "g3"]
    assert merged.drops == {"stale": 3, "mismatch": 1} and merged.staleness_G == [1, 0, 2, 3]
    assert merged.accuracy_G == [0.5, 1.0, 0.0, 0.5]  # g2 has no accuracy reward: it counts 0
    assert merged.stats.tokens == 40 == sum(len(c.token_ids) for b in batches for a in b for c in a.group.completions)

    state = LearnerState(step=3, version=5, groups_trained=12, dropped=Counter(stale=4))
    line = StepRecord.build(state, merged, outs[0], 0.75, 0.5, 1e-4).to_json()
    assert list(line) == RECORD_KEYS
    assert (line["update_kl"], line["update_scale"]) == (None, 1.0)  # learner.max_update_kl off
    assert (line["kl_fresh"], line["fresh_tokens"]) == (pytest.approx(0.01), 8)  # only rank 0 had staleness-0 tokens
    assert line["staleness_tokens"] == {"0": 8, "1": 10, "2": 5, "3+": 6}  # by staleness bucket, both ranks
    assert line["staleness_kl"] == pytest.approx({"0": 0.01, "1": 0.1, "2": 0.1, "3+": 0.1})
    assert line["staleness_log_ratio"] == pytest.approx({"0": -0.01, "1": -0.08, "2": -0.05, "3+": 0.5})
    assert [b.tokens for b in StepRecord(**line).staleness_buckets()] == [8, 10, 5, 6]
    assert line["kl"] == pytest.approx((0.01 * 17 + 0.03 * 23) / 40)
    assert line["entropy"] == pytest.approx(2.0 * 17 / 40)  # as before: a rank without it adds nothing
    assert (line["ratio_max"], line["ratio_min"]) == (2.5, 0.7)
    ratio_sq = (1.05 * 17 + 1.2 * 23) / 40
    assert line["ess"] == pytest.approx(1.0 / ratio_sq)
    assert line["rewards"] == {"accuracy": pytest.approx(4.0 / 6), "format": pytest.approx(2.75 / 8)}
    assert line["reward"] == pytest.approx(4.75 / 8) and line["accuracy"] == line["rewards"]["accuracy"]
    assert line["tokens"] == 40 and line["completion_len_mean"] == 5.0 and line["ranks"] == 2
    assert line["loss"] == 0.5 and line["zero_variance_groups"] == 2 and line["policy_seq_log_prob"] == -24.0 / 8
    assert (line["staleness_mean"], line["staleness_max"]) == (1.5, 3)
    # no token versions given: every token as old as its group; (5+4)*1 + 0 + 12*2 + 11*3 over 40 tokens
    assert line["token_staleness_mean"] == pytest.approx((9 * 1 + 24 + 33) / 40)
    adv = np.array([1.0, -1.0, 0.0, 0.0, 0.5, -0.5, 1.5, -1.5])
    assert line["adv_mean"] == pytest.approx(adv.mean()) and line["adv_std"] == pytest.approx(adv.std(ddof=1))
    assert line["groups_dropped"] == {"stale": 4} and line["micro_batches"] == 2 and line["grad_norm"] == 1.5
    json.dumps(line)


def test_a_sequence_parallel_group_counts_its_groups_once():
    """learner.sequence_parallel 2: both ranks computed the step on the reader's groups; the helper adds only its
    share of the loss and its device's peak (a merge of two of_rank summaries would count every group twice)."""
    batch = [_group("g0", [1.0, 0.0], [5, 4], 1), _group("g1", [1.0, 1.0], [3, 5], 0)]
    work = {"seq_tokens": 23, "flops": 1e9, "peak_flops": 1e12}
    reader, helper = _out(17, [1.0, -1.0, 0.0, 0.0], work=work), _out(17, [1.0, -1.0, 0.0, 0.0], work=work)
    merged = StepSummary.merge([StepSummary.of_rank(batch, reader, {}).to_json(),
                                json.loads(json.dumps(StepSummary.of_helper(helper).to_json()))])
    alone = StepSummary.of_rank(batch, reader, {})
    assert (merged.groups, merged.group_ids, merged.completions, merged.stats.tokens, merged.adv_N, merged.rows) == (
        2, ["g0", "g1"], 4, 17, alone.adv_N, alone.rows)
    assert (merged.seq_tokens, merged.flops, merged.peak_flops, merged.ranks) == (23, 1e9, 2e12, 2)
    assert merged.loss == 0.5  # each rank's share (0.25) of the step's loss
    line = StepRecord.build(LearnerState(step=1, version=1), merged, reader, 1.0, 0.0, 1e-4).to_json()
    assert line["kl"] == pytest.approx(0.01) and line["tokens"] == 17 and line["groups_trained"] == 0


def test_one_rank_without_json_round_trip_and_without_accuracy():
    batch = [_group("g0", [1.0, 0.0], [2, 2], accuracy=False)]
    merged = StepSummary.merge([StepSummary.of_rank(batch, _out(4, [1.0, -1.0], kl=None), {}).to_json()])
    line = StepRecord.build(LearnerState(step=1, version=1), merged, _out(4, [1.0, -1.0]), 1.0, 0.0, 1e-3).to_json()
    assert line["group_accuracy"] is None and line["accuracy"] is None and line["kl"] == 0.0  # defaults as before
    assert line["adv_std"] == pytest.approx(np.std([1.0, -1.0], ddof=1)) and line["ranks"] == 1


def test_the_update_line_search_outcome_reaches_the_metrics_line():
    from dataclasses import replace

    from streamgrpo.learner.update_guard import UpdateCheck

    a = _group("g0", [1.0, 0.0], [4, 2])
    out = replace(_out(6, [1.0, -1.0]), update=UpdateCheck(kl_first=2.6, kl=0.04, scale=0.125, halvings=3))
    merged = StepSummary.merge([StepSummary.of_rank([a], out, {})])
    line = StepRecord.build(LearnerState(step=1), merged, out, 1.0, 0.0, 1e-3).to_json()
    assert (line["update_kl"], line["update_scale"]) == (0.04, 0.125)


def test_tokens_per_second_and_mfu_add_up_over_ranks():
    """FLOPs, tokens and device peaks add up over ranks; MFU is None when any rank's peak is unknown."""
    batch = [_group("g0", [1.0, 0.0], [2, 2])]
    works = [dict(seq_tokens=10, flops=3e12, peak_flops=1e13), dict(seq_tokens=30, flops=5e12, peak_flops=1e13)]
    merged = StepSummary.merge([StepSummary.of_rank(batch, _out(4, [1.0, -1.0], w), {}).to_json() for w in works])
    assert (merged.seq_tokens, merged.flops, merged.peak_flops) == (40, 8e12, 2e13)
    line = StepRecord.build(LearnerState(step=1, version=1), merged, _out(4, [1.0, -1.0]), 2.0, 0.0, 1e-3).to_json()
    assert line["tokens_per_second"] == 20.0 and line["model_flops"] == 8e12
    assert line["mfu"] == pytest.approx(8e12 / (2.0 * 2e13))
    works[1]["peak_flops"] = None  # e.g. a CPU rank without learner.peak_tflops
    merged = StepSummary.merge([StepSummary.of_rank(batch, _out(4, [1.0, -1.0], w), {}) for w in works])
    line = StepRecord.build(LearnerState(step=1, version=1), merged, _out(4, [1.0, -1.0]), 2.0, 0.0, 1e-3).to_json()
    assert merged.peak_flops is None and line["mfu"] is None and line["tokens_per_second"] == 20.0

    from streamgrpo.commands.up_watch import status_line

    status = status_line([{**line, "mfu": 0.3125, "tokens_per_second": 1234.4}], 3, 0.0, "gens 1/1")
    assert "1234 tok/s" in status and "MFU 31.2%" in status and status.endswith("gens 1/1")
    assert "MFU" not in status_line([line], 3, 0.0, "gens 1/1") and "20 tok/s" in status_line([line], 3, 0.0, "")
    assert "eval" not in status_line([line], 3, 0.0, "")
    held = status_line([line], 3, 0.0, "gens 1/1", [{"version": 25, "accuracy": 0.5}, {"version": 50, "accuracy": 0.75}])
    assert "eval 0.750@v50" in held  # the held-out accuracy of the last evaluated version


def test_loss_stats_of_micro_batches_add_up_to_the_whole_batch():
    from streamgrpo.loss import LossSpec, compute_loss

    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(6, 5, generator=g, dtype=torch.float64) * 3
    behaviour = logp + 0.3 * torch.randn(6, 5, generator=g, dtype=torch.float64)
    adv = torch.randn(6, generator=g, dtype=torch.float64)
    mask = torch.rand(6, 5, generator=g) < 0.7
    ent = torch.rand(6, 5, generator=g, dtype=torch.float64)
    spec = LossSpec(is_mask="token")
    whole = LossStats.from_loss(compute_loss(logp, behaviour, adv, mask, entropies=ent, spec=spec)[1])
    parts = [LossStats.from_loss(compute_loss(logp[s], behaviour[s], adv[s], mask[s], entropies=ent[s], spec=spec)[1])
             for s in (slice(0, 2), slice(2, 6))]
    merged = LossStats.merge(parts)
    assert merged.tokens == whole.tokens == int(mask.sum())
    for name in (*LossStats.means(), "ratio_max", "ratio_min"):
        assert getattr(merged, name) == pytest.approx(getattr(whole, name), rel=1e-12), name


def test_step_output_reads_its_metrics_from_the_loss_stats():
    out = _out(17, [1.0, -1.0], entropy=None)
    assert out.tokens == out.stats.tokens == 17 and out.loss == 0.25 and out.stats.kl == 0.01
    assert out.stats.entropy is None and not hasattr(out, "__getitem__")
    assert Probe(finite=True).finite


def test_the_learner_counts_the_pure_cores_errors():
    from streamgrpo import metrics as M
    from streamgrpo.advantages import group_advantages
    from streamgrpo.learner.trainer import counted_errors
    from streamgrpo.loss import LossSpec, compute_loss

    value = {k: M.ERRORS.labels(kind=k)._value.get for k in ("loss", "reward")}
    before = {k: v() for k, v in value.items()}
    with pytest.raises(ValueError, match="loss_type"), counted_errors():
        compute_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1), torch.ones(1, 2), spec=LossSpec(loss_type="ppo"))
    with pytest.raises(ValueError, match="finite"), counted_errors():
        group_advantages(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="other"), counted_errors():
        raise ValueError("other")  # not the core's: not counted here
    assert {k: v() - before[k] for k, v in value.items()} == {"loss": 1, "reward": 1}


def test_micro_batches_never_mix_sampling_temperatures():
    from streamgrpo.learner.micro_batches import sampling_temperature, split_micro_batches

    batch = [_group(f"g{i}", [1.0, 0.0], [2, 2], temperature=t) for i, t in enumerate([1.0, 1.0, 0.7, None, 1.0])]
    parts = split_micro_batches(batch, None)
    assert [[a.group.group_id for a in p] for p in parts] == [["g0", "g1"], ["g2"], ["g3"], ["g4"]]
    assert [a for p in split_micro_batches(batch, None, n_parts=5) for a in p] == batch
    assert [sampling_temperature(a, 0.9) for a in batch] == [1.0, 1.0, 0.7, 0.9, 1.0]
    same = [_group(f"h{i}", [1.0, 0.0], [2, 2], temperature=1.0) for i in range(3)]
    assert split_micro_batches(same, None) == [same]


def test_micro_batch_budget_counts_the_layout_the_decoder_sees():
    from streamgrpo.learner.micro_batches import group_tokens, split_micro_batches

    # prompt 3 tokens, four completions of 2: rows 4 x (3 + 2) = 20; shared prompt 3 + 4 x 2 = 11
    batch = [_group(f"g{i}", [1.0, 0.0, 1.0, 0.0], [2, 2, 2, 2]) for i in range(4)]
    assert (group_tokens(batch[0]), group_tokens(batch[0], shared_prompt=True)) == (20, 11)
    assert [len(p) for p in split_micro_batches(batch, 40)] == [2, 2]
    assert [len(p) for p in split_micro_batches(batch, 40, shared_prompt=True)] == [3, 1]
    assert [len(p) for p in split_micro_batches(batch, 40, n_parts=4, shared_prompt=True)] == [1, 1, 1, 1]


def test_after_running_out_of_memory_groups_are_cut_into_runs_of_rows_down_to_one_sequence():
    from streamgrpo.learner.micro_batches import MicroBudget, cut_to, split_groups

    # prompt 3 tokens: rows of 3 + 2, 3 + 4, 3 + 2, 3 + 6 tokens (a group of 28)
    batch = [_group("g0", [1.0, 0.0, 1.0, 0.0], [2, 4, 2, 6]), _group("g1", [1.0, 0.0], [2, 2])]
    units, origin = split_groups(batch, 12)
    assert [[len(c.token_ids) for c in u.group.completions] for u in units] == [[2, 4], [2], [6], [2, 2]]
    assert origin == [(0, 0), (0, 2), (0, 3), (1, 0)]
    assert all(u.stream_id == batch[i].stream_id and u.inputs is batch[i].inputs for u, (i, _) in zip(units, origin))
    assert len(batch[0].group.completions) == 4  # the groups themselves are untouched
    assert split_groups(batch, None) == (batch, [(0, 0), (1, 0)])
    one, _ = split_groups(batch, 1)  # below one sequence: each sequence alone
    assert [len(u.group.completions) for u in one] == [1, 1, 1, 1, 1, 1]
    shared, _ = split_groups(batch, 9, shared_prompt=True)  # the prompt counts once per unit: 3 + 2 + 4 = 9
    assert [len(u.group.completions) for u in shared] == [2, 1, 1, 2]
    more, where = cut_to(units, origin, 6)  # another rank needs 6 micro-batches: the largest units split
    assert len(more) == 6 and sum(len(u.group.completions) for u in more) == 6 and where[:2] == [(0, 0), (0, 1)]
    with pytest.raises(ValueError):
        cut_to(one, [(0, 0)] * 6, 7)
    budget = MicroBudget(4096)
    assert budget.halve(1444, 16) == 722 and (budget.tokens, budget.cut_groups) == (722, True)
    assert budget.halve(20, 2) == 16 and budget.halve(500, 1) is None and budget.tokens == 16  # one row: unchanged
