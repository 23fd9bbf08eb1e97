"""A learner rank's checkpoints: save (synchronous, or a snapshot written in the background), finalise, load
(resharded on another number of ranks, ZeRO-3 included), weights only. A mixin of
:class:`~streamgrpo.learner.trainer.Learner`; the files themselves: :mod:`streamgrpo.learner.checkpoint.files`."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import torch

from streamgrpo.learner.checkpoint.background import HostBuffers, Snapshot, host_optimizer
from streamgrpo.learner.checkpoint.files import (
    CheckpointUnusable,
    CheckpointWriteError,
    _optimizer_to_flat,
    load_rank_rng,
    load_trainer_state,
    load_tree,
    rng_state,
    save_checkpoint,
    set_rng_state,
    write_checkpoint,
    write_failure,
)
from streamgrpo.learner.checkpoint.ranks import finalise
from streamgrpo.learner.checkpoint.reshard import (
    FRESH,
    ZERO3_MODEL_STATES,
    apply_to_torch,
    apply_to_zero3,
    apply_to_zero12,
    consolidate_torch,
    consolidate_zero3,
    consolidate_zero12,
)
from streamgrpo.learner.deepspeed_setup import (
    import_deepspeed,
)
from streamgrpo.learner.distributed import broadcast_json
from streamgrpo.learner.optim import param_groups
from streamgrpo.learner.state import LearnerState
from streamgrpo.learner.weights_out import gather_buckets
from streamgrpo.models.files import read_model_tensors, to_model_names

log = logging.getLogger("streamgrpo.learner")


class CheckpointIO:
    """The :class:`~streamgrpo.learner.trainer.Learner`'s checkpoints."""

    def save(self, ckpt_root: str | Path, *, model_card: str | None = None) -> Path:
        """Checkpoint ``state.step`` (every rank calls it; see :mod:`streamgrpo.learner.checkpoint.files` for the layout).
        A write that fails (disk full...) removes ``step-N.tmp`` and raises a one-line
        :class:`~streamgrpo.learner.checkpoint.files.CheckpointWriteError`: nothing is committed. DeepSpeed ranks: every
        rank raises the same line when any rank's part fails (:func:`~streamgrpo.learner.checkpoint.ranks.save_ranks`)."""
        if self.engine is not None:
            from streamgrpo.learner.checkpoint.ranks import save_ranks

            return save_ranks(self, ckpt_root, self._checkpoint_meta(), model_card)

        return self._main_writes(ckpt_root, self.state.step, lambda: self._guarded_write(
            ckpt_root, self.state.step, lambda: save_checkpoint(
                ckpt_root, self.state.step, model=self.module, processor=self.processor, optimizer=self.optimizer,
                scheduler=self.scheduler, state=self._checkpoint_meta(), model_card=model_card,
                total_limit=self.cfg.learner.save_total_limit)))

    def _main_writes(self, ckpt_root: str | Path, step: int, write) -> Path:
        """The torch backend: ``write()`` on rank 0 alone when several ranks (one sequence-parallel group, equal
        weights and optimizer state) hold the learner; every rank raises rank 0's one-line failure."""

        if not self.dist.active:
            return write()
        error, path = None, Path(ckpt_root) / f"step-{step:06d}"
        if self.dist.is_main:
            try:
                path = write()
            except Exception as exc:  # noqa: BLE001 - told to every rank first: none may wait for it in a collective
                error = exc
        refused = broadcast_json(self.dist, "" if error is None else (str(error) or type(error).__name__))
        if error is not None:
            raise error
        if refused:
            raise CheckpointWriteError(refused)
        return path

    def _checkpoint_meta(self) -> dict[str, Any]:
        """What ``trainer_state.json`` says of the learner (besides the step, the optimizer, the RNG)."""
        return {"learner": self.state.to_json(), "backend": self.cfg.learner.backend,
                "world_size": self.dist.world_size, "zero_stage": self.zero_stage,
                "param_names": self._trainable_names()}

    def snapshot(self, ckpt_root: str | Path | None = None, *, model_card: str | None = None):
        """Checkpoint ``state.step`` (under ``ckpt_root``) as host copies, the stall of an asynchronous checkpoint;
        :meth:`write_snapshot` writes it (any thread). The torch backend: a
        :class:`~streamgrpo.learner.checkpoint.background.Snapshot`; DeepSpeed (every rank calls it, collectives):
        this rank's :class:`~streamgrpo.learner.checkpoint.ranks.RankSnapshot`."""

        meta = self._checkpoint_meta()
        if self.engine is not None:
            from streamgrpo.learner.checkpoint.ranks import capture

            if ckpt_root is None:
                raise ValueError("a DeepSpeed snapshot is staged in its checkpoint folder: pass ckpt_root")
            return capture(self, ckpt_root, meta, model_card)
        if self.dist.active and not self.dist.is_main:  # one sequence-parallel group: rank 0 holds what it writes
            return None
        host = self.__dict__.setdefault("_host_buffers", HostBuffers())
        rng_tensors, rng_meta = rng_state()
        return Snapshot(step=self.state.step, model=host.copy(self.saved_weights(), prefix="model/"),
                        optimizer=host_optimizer(_optimizer_to_flat(self.optimizer, to_cpu=False), host),
                        scheduler=copy.deepcopy(self.scheduler.state_dict()),
                        rng=({k: v.clone() for k, v in rng_tensors.items()}, rng_meta), meta=meta,
                        model_card=model_card)

    def saved_weights(self) -> dict[str, torch.Tensor]:
        """The live tensors a checkpoint's model files hold (LoRA: the adapters, what peft's save_pretrained keeps,
        not the frozen base), for the host copies of an asynchronous checkpoint."""
        live = self.module.state_dict()
        if self.is_lora:
            live = {k: v for k, v in live.items() if "lora_" in k or "modules_to_save" in k}
        return live

    def write_snapshot(self, ckpt_root: str | Path, snap) -> Path:
        """Write a :meth:`snapshot` as checkpoint ``snap.step``; errors as :meth:`save`'s. The torch backend: fsynced
        and renamed when this returns; DeepSpeed: this rank's files fsynced, the rename is :meth:`finalise_write`'s
        once every rank's are."""

        if self.engine is not None:
            from streamgrpo.learner.checkpoint.ranks import write_rank

            # no rank removes the folder the ranks share here: rank 0 does once every rank's part has ended
            return self._guarded_write(ckpt_root, snap.step, lambda: write_rank(self, snap), clean=False)
        if snap is None:  # the torch backend's other ranks of a sequence-parallel group: rank 0 writes
            return Path(ckpt_root)
        return self._guarded_write(ckpt_root, snap.step, lambda: write_checkpoint(
            ckpt_root, snap.step, model=self.module, processor=self.processor, weights=snap.model,
            optimizer=snap.optimizer, scheduler=snap.scheduler, rng=snap.rng, state=snap.meta,
            model_card=snap.model_card, total_limit=self.cfg.learner.save_total_limit))

    def finalise_write(self, ckpt_root: str | Path, step: int) -> None:
        """Every rank's part of checkpoint ``step`` is durable (DeepSpeed, asynchronous): rank 0 renames it.
        The torch backend's :meth:`write_snapshot` renamed it already."""
        if self.engine is None or not self.dist.is_main:
            return

        self._guarded_write(ckpt_root, step, lambda: finalise(ckpt_root, step, self.cfg.learner.save_total_limit))

    @staticmethod
    def _guarded_write(ckpt_root: str | Path, step: int, write, *, clean: bool = True) -> Path:
        import shutil


        try:
            return write()
        except Exception as exc:
            error = write_failure(exc, ckpt_root, step)
            if error is None:
                raise
            if clean:  # not a DeepSpeed rank's background part: Checkpointing's rank 0 removes that folder
                shutil.rmtree(Path(ckpt_root) / f"step-{step:06d}.tmp", ignore_errors=True)
            raise error from None

    def load(self, ckpt: str | Path) -> dict[str, Any]:
        """Restore weights, optimizer, schedule, RNG and :attr:`state` from a checkpoint (every rank).

        A checkpoint of the same backend, ZeRO stage and number of ranks loads as it was written (DeepSpeed's
        own ``load_checkpoint``); any other (ZeRO-3 on either side too) goes through the per-parameter
        consolidation of :mod:`streamgrpo.learner.checkpoint.reshard`, or is refused in one line before DeepSpeed reads
        anything."""

        ckpt = Path(ckpt)
        meta = json.loads((ckpt / "trainer_state.json").read_text())
        ds_dir = ckpt / "deepspeed"
        same_layout = (meta.get("world_size", 1) == self.dist.world_size
                       and meta.get("zero_stage", self.zero_stage) == self.zero_stage)
        if self.engine is not None and ds_dir.is_dir() and same_layout:
            path, _ = self.engine.load_checkpoint(str(ds_dir), tag="state", load_module_strict=False,
                                                  load_optimizer_states=True, load_lr_scheduler_states=True)
            if path is None:
                raise RuntimeError(f"{ds_dir}: DeepSpeed found no checkpoint to load")
            if not load_rank_rng(ckpt, self.dist.rank):
                log.warning("%s has no RNG state for rank %d (saved by %s ranks)", ckpt, self.dist.rank,
                            meta.get("world_size"))
        elif self.engine is None and meta.get("backend", "torch") == "torch":
            if self.is_lora:
                self._load_weights(read_model_tensors(ckpt))
            meta = load_trainer_state(ckpt, model=None if self.is_lora else self.module,
                                      optimizer=self.optimizer, scheduler=self.scheduler)
        else:
            from streamgrpo.learner.checkpoint.reshard import reshard_refusal

            why = reshard_refusal(ckpt, meta, zero_stage=self.zero_stage, world_size=self.dist.world_size)
            if why:
                raise CheckpointUnusable(why)
            self._load_resharded(ckpt, meta)
        self.state = LearnerState.from_json(meta["learner"])
        self.resumed_from = ckpt
        return meta

    def load_weights_only(self, ckpt: str | Path) -> None:
        """The weights of checkpoint ``ckpt`` (any backend, ZeRO stage and number of ranks; LoRA: its adapters),
        nothing else: optimizer, schedule and :attr:`state` stay fresh (``learner.from_weights``). Every rank calls
        it (under ZeRO-3 the partitions are gathered and rewritten, a collective)."""

        self._load_weights(read_model_tensors(Path(ckpt)))
        if self.engine is not None and hasattr(self.engine.optimizer, "refresh_fp32_params"):
            self.engine.optimizer.refresh_fp32_params()  # the fp32 master copy from the weights just loaded

    def _trainable_names(self) -> list[str]:
        """The trained parameters' names in the optimizer's order (its state is keyed by that index)."""
        if self.engine is not None:
            return []
        order = {id(p): n for n, p in self.module.named_parameters()}
        # learner.master_weights: the optimizer steps float32 masters of these model parameters, in this order
        params = getattr(self.optimizer, "model_params", None)
        if params is None:
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
        return [order[id(p)] for p in params]

    def _load_resharded(self, ckpt: Path, meta: dict[str, Any]) -> None:
        """Weights, then the optimizer state consolidated per parameter (any backend, ZeRO-1/2/3, any number of
        ranks), the lr schedule and this rank's RNG: see :mod:`streamgrpo.learner.checkpoint.reshard`."""

        weights = read_model_tensors(ckpt)
        self._load_weights(weights)
        if meta.get("backend", "torch") == "deepspeed":
            weights = {}  # loaded; the fp32 masters come from the shards (a 7B model's copy freed first)
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        shapes = {n: getattr(p, "ds_shape", p.shape) for n, p in named}  # ZeRO-3: the whole shape, not the partition
        target = self.engine.optimizer if self.engine is not None else self.optimizer
        zero12 = hasattr(target, "single_partition_of_fp32_groups")
        zero3 = self.zero_stage >= 3 and hasattr(target, "fp32_partitioned_groups_flat")
        if not (zero12 or zero3) and not isinstance(target, torch.optim.Optimizer):
            raise CheckpointUnusable(f"{ckpt} was written by {meta.get('world_size', 1)} rank(s): resuming it on "
                                     f"{self.dist.world_size} needs ZeRO-1/2/3 or the torch backend here (this is "
                                     f"{type(target).__name__}); or start from its weights with "
                                     f"{FRESH.format(ckpt=ckpt)}")
        mine = [n for n, p in named if not zero12 or getattr(p, "_hp_mapping", None) is not None]
        ds_state = ckpt / "deepspeed" / "state"
        if meta.get("backend", "torch") == "deepspeed":
            if int(meta.get("zero_stage", -1)) >= 3 or (ds_state / ZERO3_MODEL_STATES).is_file():
                states = consolidate_zero3(ds_state, shapes, wanted=mine)
                sched = load_tree(ds_state / ZERO3_MODEL_STATES).get("lr_scheduler")
            else:
                states = consolidate_zero12(ds_state, shapes, wanted=mine)
                sched = load_tree(ds_state / "mp_rank_00_model_states.pt").get("lr_scheduler")
        else:
            from streamgrpo.models.files import to_model_names

            full = to_model_names(weights, self.module.state_dict().keys())
            name_of = {id(p): n for n, p in named}  # an older checkpoint without names: the optimizer's order now
            order = [name_of[id(p)] for g in param_groups(named, self.cfg.learner) for p in g["params"]]
            states = consolidate_torch(ckpt, meta, order, full, wanted=mine)
            sched = meta.get("scheduler")
        try:
            if zero3:
                apply_to_zero3(target, named, states)
            elif zero12:
                apply_to_zero12(target, named, states)
            else:
                apply_to_torch(target, named, states)
        finally:
            states.close()
        if self.engine is not None:
            self.engine.global_steps = states.step
        if sched:
            self.scheduler.load_state_dict(sched)
        if not load_rank_rng(ckpt, self.dist.rank) and (ckpt / "rng.safetensors").is_file():
            from safetensors.torch import load_file

            set_rng_state(load_file(str(ckpt / "rng.safetensors")), meta["rng"])
        log.info("%s: written by %s rank(s) (%s%s), resumed on %d (%s): optimizer state of %d parameter(s) "
                 "consolidated and re-partitioned", ckpt, meta.get("world_size", 1), meta.get("backend", "torch"),
                 f" ZeRO-{meta['zero_stage']}" if "zero_stage" in meta else "", self.dist.world_size,
                 f"ZeRO-{self.zero_stage}" if self.engine is not None else "torch", len(mine))

    def _load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        if self.zero_stage >= 3:
            self._load_weights_zero3(tensors)
            return
        if self.is_lora:
            from peft import set_peft_model_state_dict

            res = set_peft_model_state_dict(self.module, tensors)
            bad = [k for k in getattr(res, "unexpected_keys", []) if "lora_" in k]
            if bad:
                raise RuntimeError(f"adapter checkpoint does not match the model (unexpected {bad[:5]})")
            return

        missing, unexpected = self.module.load_state_dict(to_model_names(tensors, self.module.state_dict()), strict=False)
        if unexpected or [m for m in missing if "lm_head" not in m]:
            raise RuntimeError(f"checkpoint does not match the model (missing {missing[:5]}, unexpected {unexpected[:5]})")

    def _load_weights_zero3(self, tensors: dict[str, torch.Tensor]) -> None:
        """Whole tensors (every rank read them) into the ZeRO-3 partitions, bucket by bucket: the bucket's parameters
        gathered (``deepspeed.zero.GatheredParameters``), rank 0 writes them, DeepSpeed partitions them again on
        leaving; then the fp32 master partitions are copied from them (the reshard path then sets them from the
        checkpoint's own fp32 masters). A mismatch is raised on every rank alike, before any collective."""

        if self.is_lora:  # peft's file names the adapters without the adapter's name: peft maps them itself
            from peft import get_peft_model_state_dict, set_peft_model_state_dict

            named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
            unknown = sorted(set(tensors) - set(get_peft_model_state_dict(self.module)))
            if unknown:
                raise RuntimeError(f"adapter checkpoint does not match the model (unexpected {unknown[:5]})")

            def write(_bucket) -> None:
                set_peft_model_state_dict(self.module, tensors)
            buckets = [named]  # the adapters: small
        else:
            named = list(self.module.named_parameters())
            buffers = dict(self.module.named_buffers())
            full = to_model_names(tensors, {n for n, _ in named} | set(buffers))
            have = {n for n, _ in named}
            missing = sorted(n for n in have - set(full) if "lm_head" not in n)
            unexpected = sorted(set(full) - have - set(buffers))
            if missing or unexpected:
                raise RuntimeError(f"checkpoint does not match the model (missing {missing[:5]}, "
                                   f"unexpected {unexpected[:5]})")
            with torch.no_grad():
                for n, b in buffers.items():  # not partitioned: every rank copies its own
                    if n in full:
                        b.copy_(full[n].to(b.dtype))

            def write(bucket) -> None:
                for n, p in bucket:
                    if n in full:
                        p.data.copy_(full[n].to(p.dtype).view(p.shape))
            buckets = gather_buckets(named, budget=1 << 28)  # gather about 256M elements at a time
        deepspeed = import_deepspeed()
        for bucket in buckets:
            with deepspeed.zero.GatheredParameters([p for _, p in bucket], modifier_rank=0), torch.no_grad():
                if self.dist.is_main:
                    write(bucket)
        if self.engine is not None:
            self.engine.optimizer.refresh_fp32_params()  # the fp32 masters from the weights just loaded
