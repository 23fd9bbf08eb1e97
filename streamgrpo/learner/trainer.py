"""The learner's training core: one :class:`Learner` per rank, driven by ``run_learner`` or directly.

``Learner(cfg).train_step(accepted_groups)`` is one optimizer step on groups already checked by the
loop (no Redis, no ZeroMQ here), so tests and benchmarks can feed a fixed sequence of groups.

What it owns:

* the policy: the transformers model, frozen by ``model.tune_mm_*`` or wrapped in LoRA adapters
  (``model.lora``; QLoRA with ``quantize_4bit`` on CUDA), with ``learner.gradient_checkpointing``;
* the reference for ``beta > 0``: the same peft model with its adapters disabled (LoRA: no
  second copy in memory) or a frozen copy of the base model;
* AdamW + the lr schedule (:mod:`streamgrpo.learner.optim`), either plain torch or inside a DeepSpeed engine
  (``learner.backend=deepspeed``; ZeRO stage from ``learner.deepspeed_config``);
* checkpoints (:meth:`save` / :meth:`load`) and the tensors generators receive (:meth:`policy_tensors`).

Several ranks. Every rank calls :meth:`train_step` with its own share of the step's groups. One
all-reduce at the start agrees on the step's global completion-token count (the ``dapo``
normaliser) and on the number of micro-batches (:mod:`streamgrpo.learner.micro_batches`; every rank runs the
same number of forward/backward passes, since ZeRO-2/3 reduce gradients inside each backward). DeepSpeed
averages gradients over ranks, so a rank's ``dapo`` loss is scaled by ``world_size``: the sum over
ranks and micro-batches is then exactly the global token mean. A non-finite loss on any rank
turns into a non-finite global gradient norm, and DeepSpeed skips the step on every rank.

Precision. The weights that train are kept in float32. ``learner.bf16`` means bfloat16 autocast for
the torch backend (CUDA, or CPU when asked), with the weights that do not train (the LoRA base, a
frozen vision tower) stored in bfloat16, and DeepSpeed's bf16 mode (bf16 weights, fp32 master copy
in the optimizer) for the deepspeed backend. ``learner.master_weights`` gives the torch backend the
latter too (:mod:`streamgrpo.learner.master_weights`): no weight is cast in a forward.

Compilation. ``learner.compile`` compiles each decoder layer of the policy and the reference in place
(:mod:`streamgrpo.models.compile`): same modules and names, activation checkpointing and adapters inside.
Under DeepSpeed ZeRO-0/1/2 too, compiled before ``deepspeed.initialize`` (lazily: the first forward compiles):
the gradient of each parameter still reaches its accumulation, where DeepSpeed's reduce hook runs; ZeRO-3,
whose hooks gather the parameters around each layer, is refused.

Vision. Each micro-batch's :class:`~streamgrpo.models.batching.TrainBatch` carries a ``vision_cache``:
a frozen vision trunk runs once for the reference, the policy and the update guard's probes
(:mod:`streamgrpo.models.vision_trunk`).
"""

from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path
from typing import Any, Literal, overload

import numpy as np
import torch

from streamgrpo import metrics as M
from streamgrpo.advantages import AdvantageError, batch_advantages
from streamgrpo.config import Config, ConfigError
from streamgrpo.learner.agreement_guard import BUCKETS, BucketSums, add_buckets
from streamgrpo.learner.building import (
    PolicyLogprobs,
    enable_activation_checkpointing,
    refuse_selective_around_compiled_layers,
)
from streamgrpo.learner.checkpoint.learner_io import CheckpointIO
from streamgrpo.learner.deepspeed_setup import (
    deepspeed_config,
    import_deepspeed,
    offloads_optimizer,
    reference_config,
    refuse_compile_under_zero3,
)
from streamgrpo.learner.distributed import DistInfo, share
from streamgrpo.learner.flops import LearnerWork
from streamgrpo.learner.master_weights import MasterAdamW, trained_tensors
from streamgrpo.learner.memory.oom import out_of_memory
from streamgrpo.learner.memory.plan import preflight
from streamgrpo.learner.micro_batches import (
    MicroBudget,
    cut_to,
    fresh_token_mask,
    group_tokens,
    sampling_temperature,
    split_groups,
    split_micro_batches,
    token_staleness,
)
from streamgrpo.learner.optim import fused_adamw, make_optimizer
from streamgrpo.learner.state import Accepted, LearnerState
from streamgrpo.learner.step_data import LossStats, Probe, StepOutput
from streamgrpo.learner.update_guard import UpdateCheck, backtrack, kl_terms, shrink_towards
from streamgrpo.learner.weights_out import WeightsOut
from streamgrpo.loss import LossError, LossSpec, compute_loss
from streamgrpo.models.batching import GroupInputs, build_batch, pad_right, unwrap_model, vision_token_ids
from streamgrpo.models.capabilities import capabilities
from streamgrpo.models.loading import load_model, load_processor, resolve_device, store_frozen_in
from streamgrpo.models.logprobs import completion_logprobs, head_chunks
from streamgrpo.models.lora import apply_lora, check_quantization, load_quantized
from streamgrpo.models.sp_group import SPGroup, gate, new_groups
from streamgrpo.models.ulysses import install

log = logging.getLogger("streamgrpo.learner")

# ------------------------------------------------------------------------------ pure helpers
@contextlib.contextmanager
def counted_errors():
    """Count an error of the pure core (:mod:`~streamgrpo.loss`, :mod:`~streamgrpo.advantages`) in
    ``streamgrpo_errors_total{kind}`` (``loss``: bad loss inputs or settings; ``reward``: a non-finite
    reward) and re-raise it."""
    try:
        yield
    except (LossError, AdvantageError) as exc:
        M.ERRORS.labels(kind=exc.kind).inc()
        raise


# ------------------------------------------------------------------------------------- Learner
class Learner(WeightsOut, CheckpointIO):
    """Policy, reference, optimizer and step of one learner rank (see the module docstring); the weights it hands
    to generators: :class:`~streamgrpo.learner.weights_out.WeightsOut`; its checkpoints:
    :class:`~streamgrpo.learner.checkpoint.learner_io.CheckpointIO`."""

    def __init__(self, cfg: Config, *, dist: DistInfo | None = None, device: torch.device | None = None):

        self.cfg = cfg
        self.dist = dist or DistInfo()
        lc = cfg.learner
        self.deepspeed = lc.backend == "deepspeed"
        if device is None:
            device = self.dist.train_device() if self.deepspeed or self.dist.active else resolve_device(lc.device)
        self.device = device
        if lc.checkpoint_offload and torch.device(device).type != "cuda":
            raise ConfigError(f"learner.checkpoint_offload moves saved activations from a GPU to the host, and this "
                              f"learner runs on {torch.device(device).type}: set it to false")
        refuse_selective_around_compiled_layers(lc)
        refuse_compile_under_zero3(cfg)  # a DeepSpeed JSON path's stage, known now (config time: shipped names)
        self.master_weights = lc.master_weights
        if lc.master_weights and (not lc.bf16 or self.deepspeed or cfg.model.lora is not None):
            raise ConfigError("learner.master_weights (bf16 parameters, float32 master weights in the optimizer) is for "
                              "full-weight training with learner.bf16: true and learner.backend: torch (DeepSpeed's "
                              "bf16 mode does this already; LoRA's base is bf16 already): set it to false")
        if lc.max_update_kl is not None and self.deepspeed:
            raise ValueError("learner.max_update_kl needs learner.backend: torch (DeepSpeed owns the weights)")
        self.seq_parallel = self._sequence_parallel_group(lc)
        replicas = self.dist.world_size // self.seq_parallel.world  # data parallel: ranks / sequence_parallel
        if cfg.learner.groups_per_step % replicas:
            raise ValueError(f"learner.groups_per_step={lc.groups_per_step} is not a multiple of the "
                             f"{replicas} data-parallel learner ranks (ranks / learner.sequence_parallel)")
        self.processor = load_processor(cfg.model.name_or_path, cfg.model.revision)
        self.memory = preflight(cfg, device, self.dist.world_size)  # refuses what cannot fit, before loading
        self.state = LearnerState()
        lora = cfg.model.lora
        frozen_bf16 = lc.bf16 and not self.deepspeed  # autocast reads a frozen weight as bf16 anyway
        packed = lc.shared_prompt or self.seq_parallel.active  # a custom attention mask (auto is sdpa)
        if lora is not None:
            check_quantization(lora, device)
            base = load_quantized(cfg.model, lora, device, custom_mask=packed) if lora.quantize_4bit else \
                load_model(cfg.model, device, dtype="bfloat16" if frozen_bf16 else "float32", custom_mask=packed)
            if lc.gradient_checkpointing:
                enable_activation_checkpointing(base, lc.checkpoint_every, lc.checkpoint_offload, lc.checkpoint_matmuls)
            model = apply_lora(base, lora, seed=cfg.seed)
            model.train()
        else:
            model = load_model(cfg.model, device, dtype="bfloat16" if lc.master_weights else "float32", trainable=True,
                               custom_mask=packed)
            if frozen_bf16:
                store_frozen_in(model, torch.bfloat16)
            if lc.gradient_checkpointing:
                enable_activation_checkpointing(model, lc.checkpoint_every, lc.checkpoint_offload,
                                                lc.checkpoint_matmuls)
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)  # token ids the model can embed
        self.trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.total = sum(p.numel() for p in model.parameters())
        if self.dist.is_main and lora is not None:  # full-weight training: apply_freezing logged the counts
            log.info("trainable parameters: %d of %d (%.2f%%, LoRA adapters)", self.trainable, self.total,
                     100.0 * self.trainable / max(self.total, 1))
        # reference: the base itself with adapters off (LoRA), else a frozen copy
        # (learner.master_weights: in bf16 like the policy, so that both compute alike and nothing is cast)
        ref_dtype = "bfloat16" if lc.master_weights else None
        self.ref = (load_model(cfg.model, device, dtype=ref_dtype, custom_mask=packed)
                    if cfg.loss.beta > 0 and lora is None else None)
        if lc.compile:  # each decoder layer in place: same modules, same parameter names (models/compile.py)
            from streamgrpo.models.compile import compile_decoder_layers

            n = sum(compile_decoder_layers(m, lc.compile_backend) for m in (model, self.ref) if m is not None)
            if self.dist.is_main:
                log.info("learner.compile: %d decoder layers compiled (%s); the first step of each kind of forward "
                         "compiles them (minutes on a CPU, about one on a GPU)", n, lc.compile_backend)
        self._install_sequence_parallel(model)
        self.module = model  # the peft or transformers module: names, saving, publishing
        capabilities(unwrap_model(model), role="learner")  # one line if this release lacks what log-probs use
        # what computes the policy's log-probs (DeepSpeed wraps it)
        self.forward = PolicyLogprobs(model, entropy_grad=cfg.loss.entropy_coef > 0,
                                      shared_prompt=cfg.learner.shared_prompt, seq_parallel=self.seq_parallel)
        self.engine = None
        ds = deepspeed_config(cfg) if self.deepspeed else None
        fused = fused_adamw(torch.device(device).type, offload=ds is not None and offloads_optimizer(ds))
        self.optimizer, self.scheduler = make_optimizer(model, cfg, fused=fused, master_weights=lc.master_weights)
        self.resumed_from: Path | None = None
        if self.deepspeed:
            deepspeed = import_deepspeed()
            self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=self.forward, optimizer=self.optimizer, lr_scheduler=self.scheduler,
                config=ds, dist_init_required=True)
            from streamgrpo.learner.checkpoint.files import SafeTensorsCheckpointEngine

            SafeTensorsCheckpointEngine.install(self.engine)
            self.forward = self.engine
            ref_ds = reference_config(ds)
            if self.ref is not None and ref_ds is not None:  # ZeRO-3: the reference is partitioned too
                self.ref = deepspeed.initialize(model=self.ref, config=ref_ds, dist_init_required=True)[0].module
        self.zero_stage = int(self.engine.zero_optimization_stage()) if self.engine is not None else 0
        self._mixed_temperatures_logged = False
        self.budget = MicroBudget(lc.micro_batch_tokens)  # halved after an out-of-memory step (every rank alike)
        self.share_vision_trunk = True  # models/vision_trunk.py (same values either way; benchmarks turn it off)
        self.work = LearnerWork.of_learner(model, cfg, device)  # model FLOPs per step, device peak: MFU

    # -------------------------------------------------------------------------------- helpers
    @property
    def is_lora(self) -> bool:
        return self.cfg.model.lora is not None

    def _sequence_parallel_group(self, lc):
        """``learner.sequence_parallel``: this rank's :class:`~streamgrpo.models.ulysses.SPGroup` (every rank
        makes the groups together); refused in one line where it cannot run."""

        n = lc.sequence_parallel
        if n <= 1:
            return SPGroup()
        if self.dist.world_size % n:
            raise ConfigError(f"learner.sequence_parallel={n} needs a multiple of {n} learner ranks "
                              f"(this learner has {self.dist.world_size})")
        return new_groups(self.dist.world_size, self.dist.rank, n)

    def _install_sequence_parallel(self, model) -> None:
        """The decoders of the policy and the reference exchange attention heads over the group."""

        if self.seq_parallel.active:
            for m in (model, self.ref):
                if m is not None:
                    install(unwrap_model(m))

    def _autocast(self):
        if self.cfg.learner.bf16 and not self.deepspeed:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _reference_logprobs(self, tb, temperature: float, suppress) -> torch.Tensor | None:

        if self.cfg.loss.beta <= 0:
            return None
        kw = dict(temperature=temperature, suppress_token_ids=suppress, shared_prompt=self.cfg.learner.shared_prompt,
                  seq_parallel=self.seq_parallel)
        with torch.no_grad(), self._autocast():
            if self.is_lora:
                with self.module.disable_adapter():
                    lp, _ = completion_logprobs(self.module, tb, **kw)
                return lp
            lp, _ = completion_logprobs(self.ref, tb, **kw)
            return lp

    def own_logprobs(self, batch: list[Accepted], *, shared_vision: bool = True) -> list[np.ndarray]:
        """The learner's log-probs of every completion's tokens, one array per completion in group order,
        computed as a step computes them (this rank's model, dtype, autocast, backend; no gradient,
        nothing changes): what the importance ratio compares with the behaviour log-probs.
        ``shared_vision=False``: the vision tower once per row instead (the agreement check's switch)."""

        suppress = vision_token_ids(self.processor)
        pad_id = self.processor.tokenizer.pad_token_id
        out: list[np.ndarray] = []
        for a in batch:
            completions = a.group.completions
            groups = [GroupInputs.from_processor(a.inputs, [torch.from_numpy(np.array(c.token_ids, dtype=np.int64))
                                                            for c in completions])]
            tb = build_batch(groups, pad_id).to(self.device)
            temperature = sampling_temperature(a, self.cfg.rollout.temperature)
            with torch.no_grad(), self._autocast():
                if shared_vision:
                    lp, _ = self.forward(tb, temperature=temperature, suppress_token_ids=suppress)
                else:
                    lp, _ = completion_logprobs(self.module, tb, temperature=temperature, suppress_token_ids=suppress,
                                                shared_vision=False)
            lp = lp.float().cpu().numpy()
            out += [lp[i, : len(c.token_ids)] for i, c in enumerate(completions)]
        return out

    # ----------------------------------------------------------------------------- the step
    @overload
    def train_step(self, batch: list[Accepted], *, dry_run: Literal[False] = ...) -> StepOutput | None: ...
    @overload
    def train_step(self, batch: list[Accepted], *, dry_run: Literal[True]) -> Probe: ...
    def train_step(self, batch: list[Accepted], *, dry_run: bool = False) -> StepOutput | Probe | None:
        """One optimizer step on this rank's share of the groups (every rank calls it together): this
        rank's :class:`~streamgrpo.learner.step_data.StepOutput`, or None when it was skipped (non-finite loss or
        gradient). ``dry_run``: forward and backward only, nothing applied (the learner probes suspect
        groups one at a time so), returns a :class:`~streamgrpo.learner.step_data.Probe`.

        Each group's log-probs are recomputed at its own sampling temperature (``meta["temperature"]``,
        else ``rollout.temperature``; a step may mix them, e.g. after a resume with a new setting).
        """

        cfg = self.cfg
        rewards = [torch.tensor([c.reward for c in a.group.completions], dtype=torch.float32) for a in batch]
        with counted_errors():
            advs, zero_var = batch_advantages(rewards, cfg.loss.scale_rewards, cfg.loss.adv_eps,
                                              cfg.loss.zero_variance_weight)
        temperatures = sorted({sampling_temperature(a, cfg.rollout.temperature) for a in batch})
        if len(temperatures) > 1 and not self._mixed_temperatures_logged:
            log.warning("groups sampled at different temperatures %s in one step: each is trained at its own "
                        "(logged once)", temperatures)
            self._mixed_temperatures_logged = True
        pad_id = self.processor.tokenizer.pad_token_id
        # neither engine (hf, vllm) samples vision placeholders (hf: suppress_tokens; vllm: a -inf logit bias
        # inside its processed log-probs): the learner's softmax excludes them too
        suppress = vision_token_ids(self.processor)
        local_tokens = sum(len(c.token_ids) for a in batch for c in a.group.completions)
        shared = cfg.learner.shared_prompt
        units, origin = split_groups(batch, self.budget.tokens if self.budget.cut_groups else None, shared_prompt=shared)
        greedy = split_micro_batches(units, self.budget.tokens, shared_prompt=shared)
        agreed = share(self.dist, [local_tokens, len(greedy)])  # the one all-reduce of the step
        sp = self.seq_parallel.world  # the ranks of a sequence-parallel group hold the same groups: counted once
        global_tokens, n_micro = int(agreed[:, 0].sum()) // sp, int(agreed[:, 1].max())
        if n_micro > len(units):  # another rank cut its groups finer (after running out of memory)
            units, origin = cut_to(units, origin, n_micro)
        micro = split_micro_batches(units, self.budget.tokens, n_parts=n_micro, shared_prompt=shared)
        lockstep = self._lockstep(micro)
        dapo = cfg.loss.loss_type == "dapo"
        spec = LossSpec.from_config(cfg.loss, cfg.rollout.max_completion_length)
        unit_adv = {id(u): advs[i][j: j + len(u.group.completions)] for u, (i, j) in zip(units, origin)}
        batch_rows = sum(len(a.group.completions) for a in batch)
        stats: list[LossStats] = []
        probes: list[tuple[Any, torch.Tensor, float]] = []  # (inputs, log-probs before the step, temperature)
        guard = cfg.learner.max_update_kl is not None and not dry_run
        loss_total, finite, seq_lp, rows = 0.0, True, 0.0, 0
        fresh_kl, fresh_tokens = 0.0, 0  # KL(behaviour || learner) on staleness-0 tokens: the live guard
        by_staleness: list[list[BucketSums]] = []  # the same by token staleness bucket (0, 1, 2, 3+)
        self._zero_grad()
        for k, part in enumerate(micro):
            temperature = sampling_temperature(part[0], cfg.rollout.temperature)  # one per micro-batch
            groups = [GroupInputs.from_processor(a.inputs, [torch.from_numpy(np.array(c.token_ids, dtype=np.int64))
                                                            for c in a.group.completions]) for a in part]
            tb = build_batch(groups, pad_id).to(self.device)
            # a frozen vision trunk once for the reference, the policy and the probes
            tb.vision_cache = {} if self.share_vision_trunk else None
            tb.head_chunks, any_visual = lockstep[k]  # every rank calls the head and the vision encoder alike
            tb.one_vision_call = self.zero_stage >= 3 and self.dist.active
            tb.vision_stand_in = any_visual and not any(a.group.visuals for a in part)
            with out_of_memory(self, part, shared):  # every rank agrees before the backward's collectives
                ref_lp = self._reference_logprobs(tb, temperature, suppress)
                with self._autocast():
                    logprobs, entropy = self.forward(tb, temperature=temperature, suppress_token_ids=suppress)
                behaviour = pad_right([torch.from_numpy(np.array(c.logprobs, dtype=np.float32))
                                       for a in part for c in a.group.completions], 0.0,
                                      length=logprobs.shape[1]).to(self.device)
                adv = torch.cat([unit_adv[id(a)] for a in part]).to(self.device)
                with counted_errors():
                    loss, m = compute_loss(logprobs.float(), behaviour, adv, tb.completion_mask, ref_lp,
                                           entropies=entropy, token_normaliser=global_tokens if dapo else None,
                                           spec=spec)
            # gradients are averaged over the ranks (DeepSpeed; the torch backend's sequence-parallel group too), and
            # a sequence-parallel group's ranks each hold a part of one gradient: dapo's global token sum needs the
            # rank count back, a mean over the data-parallel replicas the group's size
            part_rows = sum(len(a.group.completions) for a in part)
            loss = loss * self.dist.world_size if dapo else loss * (sp * part_rows / batch_rows)
            if not torch.isfinite(loss):
                finite = False
                if not dry_run:
                    log.warning("non-finite loss (%s) in micro-batch %d", loss.item(), k)
                if not self.deepspeed:
                    self._zero_grad()
                    return Probe(finite=False) if dry_run else None
            with out_of_memory(self, part, shared):
                self._backward(loss, last=k == len(micro) - 1)
            loss_total += float(loss.detach()) / (self.dist.world_size * sp)  # this rank's share of the step's loss
            with torch.no_grad():
                mask = tb.completion_mask.to(torch.bool)
                seq_lp += float(torch.where(mask, logprobs.float(), 0.0).sum())
                rows += int(mask.shape[0])
                fresh = fresh_token_mask(part, mask.shape[1]).to(mask.device) & mask  # staleness-0 tokens
                d = (logprobs.float() - behaviour)[fresh].clamp(-50.0, 50.0)
                fresh_kl += float((torch.expm1(d) - d).sum())
                fresh_tokens += int(fresh.sum())
                by_staleness.append(staleness_sums(logprobs.float() - behaviour, mask,
                                                   token_staleness(part, mask.shape[1]).to(mask.device)))
            stats.append(LossStats.from_loss(m))
            if guard:
                probes.append((tb, logprobs.detach(), temperature))
        if dry_run:  # the loss can be finite while its gradient is not (inf x 0 in a masked ratio)
            finite = finite and all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in self._trained())
            self._zero_grad()
            return Probe(finite=finite)
        params = self._trained() if guard else []
        before = [p.detach().clone() for p in params]
        with out_of_memory(self, max(micro, key=lambda p: sum(group_tokens(a, shared) for a in p)), shared):
            grad_norm, applied = self._optimizer_step()
        if not applied or not finite:
            log.warning("step skipped: non-finite loss or gradient norm (%s)", grad_norm)
            return None
        update = self._bound_update(probes, params, before, suppress) if guard else None
        return StepOutput(update=update, loss=loss_total, grad_norm=grad_norm, tokens_global=global_tokens,
                          zero_variance=int(zero_var.sum()), adv_N=torch.cat(advs), micro_batches=n_micro,
                          seq_logprob_sum=seq_lp, rows=rows, stats=LossStats.merge(stats), fresh_kl_sum=fresh_kl,
                          fresh_tokens=fresh_tokens, staleness_sums=add_buckets(by_staleness), **self.work.of_groups(batch))

    def _lockstep(self, micro: list[list]) -> list[tuple[int, bool]]:
        """Under DeepSpeed ZeRO-3 on several ranks, per micro-batch what its forwards must call on every rank: the LM
        head's chunks, the most any rank's completion tokens need, and whether any rank's micro-batch has a visual
        (then a rank without one runs the vision encoder over a stand-in). ZeRO-3 gathers a module's weights at each
        of its calls, collectively. One all-reduce; else ``(0, False)`` each (as needed)."""
        if self.zero_stage < 3 or not self.dist.active:
            return [(0, False)] * len(micro)
        need = [head_chunks(sum(len(c.token_ids) for a in part for c in a.group.completions)) for part in micro]
        seen = [int(any(a.group.visuals for a in part)) for part in micro]
        agreed = share(self.dist, need + seen).max(axis=0)
        return [(int(agreed[k]), bool(agreed[len(micro) + k])) for k in range(len(micro))]

    def _bound_update(self, probes, params, before, suppress) -> UpdateCheck:
        """``learner.max_update_kl``: halve the step just taken until it moves the policy little enough on
        its own completions (:mod:`streamgrpo.learner.update_guard`)."""
        lc = self.cfg.learner

        def measure() -> float:
            total, tokens = 0.0, 0
            with torch.no_grad(), self._autocast():
                for tb, old, temperature in probes:
                    new, _ = self.forward(tb, temperature=temperature, suppress_token_ids=suppress)
                    s, n = kl_terms(old, new, tb.completion_mask)
                    total, tokens = total + s, tokens + n
            agreed = share(self.dist, [total, tokens]).sum(axis=0)  # every rank takes the same decision
            return float(agreed[0] / max(agreed[1], 1.0))

        def shrink(f: float) -> None:
            shrink_towards(params, before, f)
            if isinstance(self.optimizer, MasterAdamW):  # the masters moved: the model follows
                self.optimizer.push()

        check = backtrack(measure, shrink, lc.max_update_kl, lc.max_update_halvings)
        M.UPDATE_KL.set(check.kl)
        if check.scale < 1.0:  # halved, or undone (also with max_update_halvings 0)
            M.UPDATES_SHRUNK.labels(outcome="undone" if check.undone else "halved").inc()
            if self.dist.is_main:
                log.warning("step %s: it moved the policy by KL %.3g on its own completions (learner.max_update_kl "
                            "%.3g): %s", self.state.step + 1, check.kl_first, lc.max_update_kl,
                            "undone" if check.undone else f"applied x{check.scale:g} (KL {check.kl:.3g})")
        return check

    def _trained(self) -> list[torch.Tensor]:
        """What an optimizer step changes (``learner.master_weights``: the float32 masters, whose gradients
        the backward fills), for clipping, the gradient checks and ``learner.max_update_kl``."""
        return trained_tensors(self.optimizer, (p for p in self.module.parameters() if p.requires_grad))

    def discard_gradients(self) -> None:
        """Forget any gradients of a failed or probing step (nothing is applied)."""
        self._zero_grad()

    def _zero_grad(self) -> None:
        if self.engine is not None:
            self.engine.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def _backward(self, loss: torch.Tensor, *, last: bool) -> None:
        if self.engine is None:
            loss.backward()
            return
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss, scale_wrt_gas=False)

    def _optimizer_step(self) -> tuple[float, bool]:
        """Clip, step, schedule; returns ``(grad_norm, applied)`` (identical on every rank)."""
        if self.engine is not None:
            self.engine.step()
            norm = self.engine.get_global_grad_norm()
            norm = float(norm) if norm is not None else float("nan")
            applied = bool(self.engine.was_step_applied())
            return norm, applied and math.isfinite(norm)
        if self.dist.active:  # a sequence-parallel group: each rank holds a part of the gradient; averaged as DeepSpeed
            self._average_gradients()
        norm = float(torch.nn.utils.clip_grad_norm_(self._trained(), self.cfg.learner.max_grad_norm))
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            return norm, False
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm, True

    def _average_gradients(self) -> None:
        """The torch backend on several ranks (one sequence-parallel group): every trained tensor's gradient
        averaged over the ranks, in one flat all-reduce per dtype (a missing gradient counts as zeros)."""
        import torch.distributed as tdist

        params = self._trained()
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            by_dtype.setdefault(p.grad.dtype, []).append(p)
        for ps in by_dtype.values():
            flat = torch.cat([p.grad.reshape(-1) for p in ps])
            gate(self.seq_parallel)  # the torch backend's ranks are one sequence-parallel group
            tdist.all_reduce(flat)
            flat /= self.dist.world_size
            at = 0
            for p in ps:
                n = p.grad.numel()
                p.grad.copy_(flat[at:at + n].view_as(p.grad))
                at += n

    def last_lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])



def staleness_sums(log_ratio: torch.Tensor, mask: torch.Tensor, staleness: torch.Tensor) -> list[BucketSums]:
    """Per staleness bucket (:data:`~streamgrpo.learner.agreement_guard.BUCKETS`) of the ``mask``ed tokens: their
    count, k3 KL(behaviour || learner) and log-ratio (learner - behaviour log-prob, clamped to +-50) summed."""
    d = log_ratio[mask].double().clamp(-50.0, 50.0)
    b = staleness[mask].clamp(0, len(BUCKETS) - 1)
    sums = torch.zeros((3, len(BUCKETS)), dtype=torch.float64, device=d.device)
    sums[0].index_add_(0, b, torch.ones_like(d))
    sums[1].index_add_(0, b, torch.expm1(d) - d)
    sums[2].index_add_(0, b, d)
    n, kl, lr = sums.tolist()  # one host sync per micro-batch
    return [BucketSums(int(n[i]), kl[i], lr[i]) for i in range(len(BUCKETS))]
