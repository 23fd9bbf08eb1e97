"""The ``learner`` section: backend, ranks, optimizer, schedule, memory knobs, checkpoints."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from streamgrpo.sections import Section


class LearnerConfig(Section):
    backend: Literal["torch", "deepspeed"] = "torch"
    """Plain torch (one process) or DeepSpeed ZeRO (one or many ranks, launched by torchrun/deepspeed)."""
    deepspeed_config: Optional[str] = None
    """DeepSpeed JSON config: a shipped one by name (zero1, zero2, zero3, zero2_offload) or a path (relative: to the config file, else the working directory); null = built-in ZeRO-2. learner.bf16 and max_grad_norm override its bf16/gradient_clipping."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device of a single-process learner."""
    dist_backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process-group backend of DeepSpeed ranks: auto = NCCL (rank r on GPU LOCAL_RANK) when CUDA is visible and this host has a GPU per learner rank, else gloo with every rank on the CPU; nccl insists (an error when the GPUs do not go round); gloo keeps the ranks on their GPUs when they go round."""
    groups_per_step: int = Field(8, ge=1, le=65536)
    """Groups (prompts) consumed per optimizer step, summed over ranks."""
    micro_batch_tokens: Optional[int] = Field(None, ge=16)
    """Split a step's groups into micro-batches of at most this many decoder tokens (gradient accumulation; with shared_prompt a group's prompt counts once). A step that runs out of device memory is retried with half of it (null: the step's size), down to one sequence; the learner keeps the smaller value."""
    learning_rate: float = Field(1e-6, gt=0.0, le=1.0)
    """Peak AdamW learning rate."""
    vision_lr: Optional[float] = Field(None, gt=0.0, le=1.0)
    """Peak learning rate of the vision tower (``model.visual.*`` without the merger); null = learning_rate. Like qwen-vl-finetune's ``vision_tower_lr``."""
    merger_lr: Optional[float] = Field(None, gt=0.0, le=1.0)
    """Peak learning rate of the vision-language merger (``model.visual.merger``); null = learning_rate. Like qwen-vl-finetune's ``mm_projector_lr``."""
    weight_decay: float = Field(0.0, ge=0.0, le=1.0)
    """AdamW weight decay."""
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0)
    """AdamW beta1."""
    adam_beta2: float = Field(0.99, ge=0.0, lt=1.0)
    """AdamW beta2."""
    adam_eps: float = Field(1e-8, gt=0.0, le=1.0)
    """AdamW epsilon (TRL's ``adam_epsilon``)."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up steps."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Schedule after warm-up (cosine/linear decay to 0 at max_steps)."""
    max_grad_norm: float = Field(1.0, gt=0.0)
    """Gradient clipping norm."""
    agreement_max_kl: float = Field(0.01, gt=0.0, le=100.0)
    """KL(behaviour || learner) on tokens sampled with the learner's current weights (staleness 0) past which the generator and the learner are said to compute different policies: `up`'s check before training refuses above it, and the learner's live guard warns and sets streamgrpo_learner_agreement_kl above it over agreement_window steps. bf16 engines measure 0.0004-0.01; see docs/training.md."""
    agreement_window: int = Field(20, ge=1, le=100000)
    """Steps of staleness-0 tokens the live agreement guard averages over before it judges."""
    agreement_history: int = Field(20, ge=5, le=100000)
    """Steps of history per staleness bucket (1, 2, 3+) the live guard compares each step's stale tokens with: tokens sampled a few versions ago differ from the learner by a KL that is not 0 but steady, so a jump against the bucket's own median (agreement_kl_factor, agreement_max_shift) is a mismatch that appeared mid-run; see docs/training.md."""
    agreement_kl_factor: float = Field(3.0, gt=1.0, le=1e6)
    """The live guard's stale buckets: a step's KL past this x the bucket's median over agreement_history steps + agreement_max_kl, two steps in a row, warns and sets streamgrpo_learner_agreement_drift."""
    agreement_max_shift: float = Field(0.25, gt=0.0, le=100.0)
    """The live guard's stale buckets: a step's mean log-ratio (learner minus behaviour log-prob) further than this (nats, or 6 robust sigmas of the bucket's history if more) from the bucket's median, two steps in a row, warns and sets streamgrpo_learner_agreement_drift. A generator that reports every log-prob shifted by d moves it by d."""
    max_update_kl: Optional[float] = Field(None, gt=0.0, le=100.0)
    """Bound on how far one optimizer step may move the policy: after each step the learner measures the change on the step's own completions (mean per-token KL, old to new) and halves the step until it is at most this (a backtracking line search; up to max_update_halvings times, then the step is undone). Adam moves every weight by about the learning rate whatever the gradient norm, so max_grad_norm does not bound a step. Costs one forward pass per try; torch backend only; null = off."""
    max_update_halvings: int = Field(4, ge=0, le=30)
    """With max_update_kl: halvings before a step is undone."""
    max_steps: int = Field(1000, ge=1)
    """Optimizer steps to train; `streamgrpo up` stops everything after this many."""
    get_timeout_s: float = Field(5.0, gt=0.0, le=3600.0)
    """How long one queue read waits for groups before counting idle time and retrying."""
    media_cache_mib: int = Field(1024, ge=0, le=1 << 20)
    """Byte budget of the learner's cache of frames decoded from references (rollout.media: reference), keyed by file, frame indices and size: a prompt that comes back is not decoded again."""
    media_workers: int = Field(1, ge=1, le=64)
    """Threads that decode referenced visuals ahead of the step (the next step's groups are read and decoded while a step trains)."""
    media_unavailable_s: float = Field(60.0, ge=0.0, le=86400.0)
    """A group whose media reference cannot be resolved (missing file, outside data.media_root, other pixels) is dead-lettered and training goes on with the others. The learner stops with one line only when it has resolved no reference for this many seconds and its own media root (data.media_root, else the training file's folder), checked directly, is missing, unreadable or empty; the groups it has not read stay queued."""
    max_group_pixels: Optional[int] = Field(None, ge=1, le=1 << 40)
    """Pixels (frames x height x width, summed over a group's visuals, read from the message's declared sizes before anything is decoded) past which a group is dead-lettered as too_large. null = what data allows one sample: data.total_pixels, capped by data.max_frames x data.max_pixels per video and data.max_pixels per image of the group (set it when records' meta raise those limits)."""
    max_source_pixels: int = Field(7680 * 4320, ge=28 * 28, le=1 << 40)
    """Native pixels (height x width, read from the file's own header before anything is decoded) past which a frame or image a group references (rollout.media: reference) is not decoded: the group is dead-lettered as size_mismatch. The message declares only the resized size, and decoding costs memory by the native one (an 8000 x 8000 MJPEG declared 56 x 56: GBs). Default 8K UHD (7680 x 4320); raise it for larger sources."""
    max_group_tokens: Optional[int] = Field(None, ge=1, le=1 << 40)
    """Decoder tokens of a group (prompt tokens x completions + completion tokens) past which it is dead-lettered as too_large. null = rollout.num_generations x (the prompt that max_group_pixels and data.max_question_chars allow + rollout.max_completion_length)."""
    max_staleness: int = Field(4, ge=0, le=1_000_000)
    """Groups whose policy version is more than this many steps behind the learner (or ahead of it: made by weights a resumed learner rolled back) are dropped as they arrive; 0 with rollout.sync (on-policy), whatever is set here. Was loss.max_staleness (still read, with a notice)."""
    crash_loop_starts: int = Field(3, ge=1, le=1000)
    """A group that was in the step being trained when the learner died (kill -9, out of memory, an error) in this many consecutive starts is dead-lettered as crash_loop (counted in Redis, per group), so one message can never stop training. After a first such death, each group of that step trains in a step of its own (the most counted first): up to groups_per_step / ranks extra steps."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    checkpoint_every: int = Field(1, ge=1, le=1000)
    """With gradient_checkpointing: recompute only every n-th layer (vision blocks and decoder layers, counted in order; transformers' every_n_layers); the others keep their activations. 1 = every layer; 2 recomputes half of them: less recomputation for more memory."""
    checkpoint_offload: bool = False
    """With gradient_checkpointing on a GPU: hold the inputs saved for each recomputed layer in pinned host memory instead of on the GPU (transformers' offload); frees layers x tokens x hidden of GPU memory for two copies per layer and step."""
    checkpoint_matmuls: bool = False
    """With gradient_checkpointing: selective checkpointing. Each recomputed layer keeps the outputs of its matmuls and its attention, and backward recomputes only the elementwise ops around them (norms, rotary, SiLU gate, residuals): each projection's forward matmul runs once a step instead of twice (and the attention once), for about T x (4 hidden + 2 key-value widths + 2 intermediate) x 2 bytes more per recomputed layer (T: a micro-batch's tokens; 3B: 60 KiB a token a layer, counted by the memory plan). Works eagerly and with compile (the partitioner saves the same outputs; with compile it needs transformers 5.24 or later). See docs/performance.md."""
    shared_prompt: bool = False
    """Put each group's prompt in the forward once, its completions after it behind a block attention mask (each sees the prompt and itself), instead of once per completion: the decoder processes P + sum(C) tokens per group instead of G*P + sum(C). Same log-probs (to float rounding); needs model.attn_implementation sdpa or eager."""
    sequence_parallel: int = Field(1, ge=1, le=1024)
    """Split each forward's sequences over this many learner ranks (DeepSpeed-Ulysses style): the ranks of a group read the same groups, each runs the decoder over 1/N of every sequence's tokens (q, k, v exchanged all-to-all so that each rank attends over the whole sequence with 1/N of the heads) and the LM head over the completion tokens its part predicts; the log-probs are summed over the group, so loss and gradients are one rank's. Decoder activations per rank fall by N (the memory plan divides them). Data parallelism is the ranks / N. Needs the decoder's attention heads divisible by N and model.attn_implementation sdpa or eager (auto is sdpa then); learner.backend torch (all the ranks form one group: ranks = N) or DeepSpeed ZeRO-0/1/2/3 (ZeRO-3 partitions the weights over all the ranks; every rank of a group runs each module as often, a rank without frames runs the vision trunk over a stand-in); with learner.compile the exchanges run eagerly between a layer's compiled graphs; the learner loop runs it: the first rank of each group reads the group's share of the queue and hands it to the others. 1 = off. See docs/design.md."""
    bf16: bool = False
    """bfloat16 training: autocast for the torch backend (float32 master weights for what trains, bf16 storage for what does not: a LoRA base, a frozen tower), DeepSpeed's bf16 mode for the deepspeed backend; false keeps float32."""
    master_weights: bool = False
    """With bf16 and the torch backend (full-weight training, not LoRA): the model's parameters in bfloat16 and float32 master copies in the optimizer (gradients summed in float32, AdamW on the masters, the result copied back rounded), as DeepSpeed's bf16 mode and Megatron do, instead of float32 parameters cast to bf16 by autocast in every forward and recompute. Faster on a GPU; the model then computes as a bf16 generator does (bf16 residual stream). See docs/performance.md."""
    compile: bool = False
    """torch.compile each decoder layer of the policy and the reference (nn.Module.compile, dynamic shapes: one graph all layers reuse, no recompile when the sequence length changes; parameter names unchanged), activation checkpointing and LoRA adapters inside it. Fewer, fused kernels per layer for a launch-bound step on a GPU; the first step pays the compile (about 1-2 minutes, and once more for each new kind of forward: the reference's, under no_grad). The vision blocks and the rest of the step stay eager. The torch backend, or DeepSpeed at ZeRO stage 0, 1 or 2 (zero1, zero2, zero2_offload: each parameter's gradient still reaches the hook that reduces it; tested on CPU ranks, not yet measured on a GPU), not ZeRO-3 (its hooks gather each layer's parameters around the layer: refused); not with checkpoint_offload, and with gradient_checkpointing and inductor on a GPU not with LoRA dropout (model.lora.dropout: 0; inductor failed to replay it in the recompute on CUDA). On an H100 (2026-11-27): 3B full 45.5% MFU, 1.34x the eager step's speed; 7B LoRA 42.1%, 1.48x. See docs/performance.md."""
    compile_backend: Literal["inductor", "aot_eager"] = "inductor"
    """With compile: torch.compile's backend: inductor (generated, fused kernels: the speed-up) or aot_eager (dynamo and AOTAutograd run the same aten ops without code generation: checks that the model traces, no speed-up)."""
    save_steps: int = Field(100, ge=1)
    """Write a checkpoint every this many steps (and on SIGTERM)."""
    async_checkpoint: bool = True
    """Write checkpoints in the background: at the step boundary the state is copied to host memory (pinned when it is on a GPU) and a thread writes it while training goes on; the groups it holds are committed in Redis once the files are fsynced (exactly once unchanged). Costs a second copy of weights and optimizer state in host memory. The torch backend and DeepSpeed ranks (one or many: each rank copies and writes its own part; rank 0 renames the checkpoint once every rank's part is fsynced); the final checkpoint is always synchronous."""
    save_total_limit: Optional[int] = Field(3, ge=1)
    """Keep at most this many checkpoints (oldest deleted first)."""
    resume: bool = False
    """Continue from the newest checkpoint in the run directory."""
    fresh: bool = False
    """Start at step 0 although the run directory has checkpoints: they, metrics.jsonl and the learner's audit log are moved to <run_dir>/previous/<time>/ first. Without resume or fresh, a learner refuses to start over existing checkpoints."""
    from_weights: Optional[str] = None
    """Start a new run from the weights of this checkpoint folder (a step-N of any run: torch or DeepSpeed at any ZeRO stage, ZeRO-3 included, on any number of ranks; LoRA adapters too): step 0, policy version 0 (generators take these weights as their first version), a fresh optimizer and lr schedule, and nothing of the old run's queue (what it left pending is not resumed). Used only when the learner starts at step 0: with resume and a checkpoint in this run directory, the resume wins (so the same command continues a crashed run). A checkpoint of this run directory itself: with --fresh (it moves to previous/ and is found there)."""
    replica_check_every: int = Field(0, ge=0)
    """Several ranks (ZeRO-0/1/2): every this many steps, compare a checksum of the weights across ranks and stop with an error if they differ (0 = off)."""
    peak_tflops: Optional[float] = Field(None, gt=0.0, le=1e6)
    """Peak dense TFLOP/s of one learner device at the training precision, for MFU (streamgrpo_learner_mfu, `mfu` in metrics.jsonl); null looks it up by the GPU's name (H100, H200, A100; AMD MI300X, MI325X, MI250X); on a CPU or an unlisted GPU MFU is then not reported."""
