"""Checkpoints: safetensors/JSON only, atomic, loadable by plain transformers, optimizer+RNG restored."""

from __future__ import annotations

import random

import numpy as np
import torch

from streamgrpo.learner.checkpoint.files import (
    latest_checkpoint,
    list_checkpoints,
    load_trainer_state,
    save_checkpoint,
)


def _train_one(model, opt):
    x = torch.randn(4, 8)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


class _Tiny(torch.nn.Module):
    """A plain module with save_pretrained, to test optimizer/RNG state without a big model."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x)

    def save_pretrained(self, d, safe_serialization=True):
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(d / "model.safetensors"))


def test_round_trip_restores_optimizer_scheduler_and_rng(tmp_path):
    torch.manual_seed(0)
    m = _Tiny()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    for _ in range(3):
        _train_one(m, opt)
        sched.step()
    path = save_checkpoint(tmp_path, 3, model=m, optimizer=opt, scheduler=sched, state={"learner": {"version": 3}})
    assert not any(p.suffix in (".pt", ".bin", ".pkl") for p in path.iterdir())
    expect_torch, expect_py, expect_np = torch.rand(3), random.random(), np.random.rand()

    m2 = _Tiny()
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0 / (s + 1))
    meta = load_trainer_state(path, model=m2, optimizer=opt2, scheduler=sched2)
    assert meta["learner"]["version"] == 3
    assert torch.equal(torch.rand(3), expect_torch) and random.random() == expect_py and np.random.rand() == expect_np
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    assert sched2.get_last_lr() == sched.get_last_lr()
    # the next step is identical
    torch.manual_seed(1)
    _train_one(m, opt)
    torch.manual_seed(1)
    _train_one(m2, opt2)
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_total_limit_and_latest_ignore_tmp(tmp_path):
    m = _Tiny()
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, model=m, total_limit=2)
    (tmp_path / "step-000009.tmp").mkdir()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000003", "step-000004"]
    assert latest_checkpoint(tmp_path).name == "step-000004"


def test_real_model_checkpoint_loads_with_transformers(tmp_path, tiny_model_dir):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from streamgrpo.config import build_config
    from streamgrpo.models.card import model_card

    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir)
    proc = AutoProcessor.from_pretrained(tiny_model_dir)
    cfg = build_config({"model": {"name_or_path": str(tiny_model_dir)}})
    card = model_card(cfg, {"step": 5, "version": 5, "groups_trained": 40}, {"reward": 0.5, "rewards": {"accuracy": 0.5}})
    path = save_checkpoint(tmp_path, 5, model=model, processor=proc, model_card=card)
    again = AutoModelForImageTextToText.from_pretrained(path)
    for (n, a), (_, b) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), n
    text = (path / "README.md").read_text()
    assert f"base_model: {tiny_model_dir}" in text and "accuracy" in text and "groups trained" in text


def test_a_checkpoint_is_durable_before_it_is_renamed_and_the_rename_before_it_returns(tmp_path, monkeypatch):
    """Every file and folder of ``step-N.tmp`` is fsynced before the rename, the checkpoints folder after
    it: only then may the queue commit the groups the checkpoint holds."""
    import os
    from pathlib import Path

    from streamgrpo.learner.checkpoint import files as ck

    tmp = ck.staging_dir(tmp_path / "ckpts", 3)
    (tmp / "model.safetensors").write_bytes(b"w" * 10)
    (tmp / "deepspeed" / "state").mkdir(parents=True)
    (tmp / "deepspeed" / "state" / "optim.pt").write_bytes(b"o")
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, Path.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(self, target):
        events.append(("rename", str(self)))
        return real_rename(self, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(Path, "rename", rename)
    final = ck.commit_checkpoint(tmp_path / "ckpts", 3)
    at = events.index(("rename", str(tmp)))
    before = {p for kind, p in events[:at] if kind == "fsync"}
    want = {str(tmp), str(tmp / "model.safetensors"), str(tmp / "deepspeed"), str(tmp / "deepspeed" / "state"),
            str(tmp / "deepspeed" / "state" / "optim.pt")}
    assert want <= before, want - before
    assert ("fsync", str(tmp_path / "ckpts")) in events[at + 1:]  # the rename itself is durable
    assert final == tmp_path / "ckpts" / "step-000003" and (final / "model.safetensors").read_bytes() == b"w" * 10
