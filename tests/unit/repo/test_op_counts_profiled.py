"""benchmarks/op_counts.py's profiler count (what `bench_learner --proxy --counter profiler` reports for a compiled
step): every aten op, the kernel launches among them, the optimizer and the gradient clipping apart."""

from __future__ import annotations

import torch

from benchmarks.op_counts import profiled


def test_a_matmul_is_one_launch_and_the_optimizer_and_clipping_are_counted_apart():
    w = torch.nn.Parameter(torch.randn(8, 8))
    opt = torch.optim.AdamW([w], foreach=False)
    x = torch.randn(4, 8)
    with profiled() as p:
        y = x @ w.t()  # aten::matmul > aten::mm (resolve_conj inside); t, transpose, as_strided: views
        z = (y * 2.0).sum()
    assert p["launches"] == 3, p["by_name"]  # mm, mul, sum
    assert p["aten_ops"] > p["launches"] and p["kernels"] == 0 and p["optimizer_ops"] == 0
    z.backward()
    with profiled() as q:
        torch.nn.utils.clip_grad_norm_([w], 1.0)
        opt.step()
    assert q["optimizer_ops"] > 0 and q["aten_ops"] == 0 and q["launches"] == 0, q["by_name"]
    assert torch.nn.utils.clip_grad_norm_.__name__ == "clip_grad_norm_"  # put back after counting
