"""What a learner rank hands to generators and keeps consistent across ranks: the policy's tensors published as a
weight version (every rank calls it; ZeRO-3 gathers bucket by bucket), never a non-finite one; CPU copies for
checkpoints; the ranks' weights compared by checksum. A mixin of :class:`~streamgrpo.learner.trainer.Learner`."""

from __future__ import annotations

import logging

import torch

from streamgrpo import metrics as M
from streamgrpo.learner.deepspeed_setup import (
    import_deepspeed,
)
from streamgrpo.learner.distributed import share
from streamgrpo.models.lora import filter_lora
from streamgrpo.transport.weights.layout import TensorSpec

log = logging.getLogger("streamgrpo.learner")


def gather_buckets(named: list, budget: int):
    """Consecutive slices of ``named`` holding about ``budget`` elements each (ZeRO-3 gathers)."""
    bucket, size = [], 0
    for n, p in named:
        bucket.append((n, p))
        size += int(getattr(p, "ds_numel", p.numel()))
        if size >= budget:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def _first_nonfinite(named: list) -> str | None:
    """The name of the first tensor holding a NaN or inf, or None; one device sync for all of them."""
    if not named:
        return None
    flags = torch.stack([torch.isfinite(p.detach()).all().to(named[0][1].device) for _, p in named])
    if bool(flags.all()):
        return None
    return named[int((~flags).nonzero()[0, 0])][0]


def weights_checksum(module: torch.nn.Module) -> list[float]:
    """``[sum, sum of squares]`` of every parameter in float64: equal on ranks holding equal weights."""
    s = q = 0.0
    with torch.no_grad():
        for p in module.parameters():
            d = p.detach().double()
            s += float(d.sum())
            q += float((d * d).sum())
    return [s, q]



class WeightsOut:
    """The :class:`~streamgrpo.learner.trainer.Learner`'s weights out (its ``module``, ``cfg``, ``dist``, ``zero_stage``)."""

    def _named_for_generators(self, *, trainable_only: bool = False) -> list[tuple[str, torch.nn.Parameter]]:

        named = list(self.module.named_parameters())
        if self.is_lora:
            keep = set(filter_lora(dict(named)))
            named = [(n, p) for n, p in named if n in keep]
        elif trainable_only:  # frozen parameters never change: generators hold them from the same checkpoint
            named = [(n, p) for n, p in named if p.requires_grad]
        return named

    @property
    def export_dtype(self) -> torch.dtype | None:
        """The dtype floating weights travel in: the generators' ``model.dtype`` (never the fp32 master
        copy); LoRA adapters keep their own (they are merged in float32 on the generator)."""
        return None if self.is_lora else getattr(torch, self.cfg.model.dtype)

    def publish(self, sync, version: int) -> None:
        """Hand the policy to a :class:`~streamgrpo.transport.weights.base.WeightSync` as ``version``.

        Every rank calls it (under ZeRO-3 the partitions are gathered bucket by bucket, a collective);
        only rank 0's ``sync`` is used (the others pass None). The live tensors go in as they are:
        the channel casts them to :attr:`export_dtype` on their device and copies them out
        asynchronously, so this returns long before the bytes are on the wire.
        """
        named = self._named_for_generators(trainable_only=not self.cfg.weights.send_frozen)
        dtype = self.export_dtype
        if self.zero_stage < 3:
            if sync is not None and self.dist.is_main:
                bad = _first_nonfinite(named)
                if bad is not None:
                    return self._refuse_publish(version, bad)
                sync.publish(version, {n: p.detach() for n, p in named}, dtype=dtype)
            return

        deepspeed = import_deepspeed()
        writer = None
        try:  # rank 0 failing anywhere gives the version up (the other ranks then fail or time out in the gather)
            if sync is not None and self.dist.is_main:
                specs = [TensorSpec(n, tuple(p.ds_shape), dtype if dtype is not None and p.is_floating_point()
                                    else p.dtype) for n, p in named]
                writer = sync.begin(version, specs, cuda=self.device.type == "cuda")
            bad = None
            for bucket in gather_buckets(named, budget=1 << 28):
                with deepspeed.zero.GatheredParameters([p for _, p in bucket], modifier_rank=None):
                    if writer is not None and bad is None:  # every rank gathers to the end either way
                        bad = _first_nonfinite(bucket)
                        for n, p in bucket if bad is None else ():
                            writer.write(n, p.detach())
                        writer.sync()  # the gathered copies are freed when the context ends
            if writer is not None and bad is not None:
                writer.abort()
                writer = None
                self._refuse_publish(version, bad)
            if writer is not None:
                writer.commit()
        except BaseException:
            if writer is not None:
                writer.abort()
            raise

    def _refuse_publish(self, version: int, name: str) -> None:
        """Non-finite weights never reach a generator: the version is not sent (counted, one line)."""
        M.ERRORS.labels(kind="weights").inc()
        log.error("weights v%d not published: %s holds a NaN or infinite value (generators keep the last good "
                  "version)", version, name)

    def nonfinite_weight(self) -> str | None:
        """The name of a parameter this rank holds with a NaN or infinite value (ZeRO-3: its partition), or None."""
        for name, p in self.module.named_parameters():
            t = getattr(p, "ds_tensor", None)
            t = p if t is None else t
            if t.numel() and not bool(torch.isfinite(t.detach()).all()):
                return name
        return None

    def policy_tensors(self, copy=None) -> dict[str, torch.Tensor] | None:
        """CPU copies of the trained parameters as the learner holds them (fp32; LoRA: the adapters only),
        for checkpoints and tests; generators get :meth:`publish`'s export instead.

        Under ZeRO-3 the partitions are gathered (a collective: every rank must call this);
        only rank 0 gets the tensors, the other ranks get None. ``copy`` (ZeRO-3): what rank 0 does with each
        gathered bucket of ``{name: tensor}`` (an asynchronous checkpoint's reused host buffers) instead of
        cloning it to the CPU; it must not raise (every rank has the same gathers to do).
        """
        named = self._named_for_generators()
        if self.zero_stage < 3:
            if not self.dist.is_main:
                return None
            return {n: p.detach().to("cpu").contiguous() for n, p in named}
        deepspeed = import_deepspeed()
        out: dict[str, torch.Tensor] = {}
        for bucket in gather_buckets(named, budget=1 << 28):  # gather about 256M elements at a time
            with deepspeed.zero.GatheredParameters([p for _, p in bucket], modifier_rank=None):
                if self.dist.is_main and copy is not None:
                    out.update(copy({n: p.detach() for n, p in bucket}))
                elif self.dist.is_main:
                    for n, p in bucket:
                        out[n] = p.detach().to("cpu").clone()
        return out if self.dist.is_main else None

    def replicas_agree(self) -> list[float]:
        """Compare a checksum of the weights across ranks (ZeRO-0/1/2 replicate them); raises if they differ.

        Returns this rank's checksum.
        """
        mine = weights_checksum(self.module)
        if self.zero_stage >= 3 or not self.dist.active:
            return mine
        every = share(self.dist, mine)
        if not (every == every[0]).all():
            raise RuntimeError(f"learner ranks hold different weights after step {self.state.step}: checksums {every.tolist()}")
        return mine

