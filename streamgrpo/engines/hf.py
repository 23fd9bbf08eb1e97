"""Hugging Face transformers rollout engine (CPU or GPU).

Several prompts (each with its own videos/images) are left-padded into one batch and sampled with
``generate(num_return_sequences=G)``. The behaviour log-prob of each sampled token is taken from
``scores`` (the processed logits: divided by the temperature, top-k/top-p masked), so it is the
log-prob under the distribution the token was actually drawn from. With ``top_p == 1`` and
``top_k == 0`` that equals ``log_softmax(logits / T)``, which is what the learner recomputes.

Vision placeholder tokens (``<|video_pad|>``, ``<|image_pad|>``, ``<|vision_start|>`` ...) are
never sampled: in a completion they would break the training forward. The learner masks the same
ids out of its softmax (see ``suppressed_token_ids``), so both sides use one distribution.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from streamgrpo.engines.base import PromptRequest, SampledCompletion, SamplingParams, cut_at_stop
from streamgrpo.models.batching import vision_token_ids

log = logging.getLogger(__name__)

def suppressed_token_ids(tokenizer) -> list[int]:
    """Token ids a completion must never contain (the vision placeholders this tokenizer knows)."""
    return vision_token_ids(tokenizer)


def stop_token_ids(tokenizer) -> list[int]:
    ids = {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(i for i in ids if i is not None)


_CAT_KEYS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "second_per_grid_ts")
_PAD_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids")


def collate_prompts(inputs: list[Any], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Left-pad per-prompt processor outputs into one batch; concatenate the visual tensors in order."""
    lengths = [int(x["input_ids"].shape[-1]) for x in inputs]
    width = max(lengths)
    out: dict[str, torch.Tensor] = {}
    for key in _PAD_KEYS:
        if key not in inputs[0]:
            continue
        fill = pad_token_id if key == "input_ids" else 0
        rows = []
        for x, n in zip(inputs, lengths):
            t = torch.as_tensor(x[key]).reshape(-1)
            pad = torch.full((width - n,), fill, dtype=t.dtype)
            rows.append(torch.cat([pad, t]))
        out[key] = torch.stack(rows)
    for key in _CAT_KEYS:
        parts = [torch.as_tensor(x[key]) for x in inputs if key in x and x[key] is not None]
        if parts:
            out[key] = torch.cat(parts, dim=0)
    return out


class HFEngine:
    """Sampling with ``model.generate``; weights applied in place between calls."""

    def __init__(self, model, processor, *, device: torch.device | str = "cpu"):
        self.model = model
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.device = torch.device(device)
        self.version = 0
        self.suppress_ids = suppressed_token_ids(self.tokenizer)
        self.stop_ids = stop_token_ids(self.tokenizer)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_ids[0]

    @torch.no_grad()
    def generate(self, requests: list[PromptRequest], sampling: SamplingParams) -> list[list[SampledCompletion]]:
        if not requests:
            return []
        batch = collate_prompts([r.inputs for r in requests], self.pad_id)
        batch = {k: v.to(self.device) for k, v in batch.items()}
        width = batch["input_ids"].shape[1]
        greedy = sampling.temperature == 0  # argmax decoding: one sequence per prompt, copied n times
        kwargs: dict[str, Any] = dict(
            max_new_tokens=sampling.max_tokens,
            num_return_sequences=1 if greedy else sampling.n,
            output_scores=True,
            return_dict_in_generate=True,
            eos_token_id=self.stop_ids,
            pad_token_id=self.pad_id,
            suppress_tokens=self.suppress_ids or None,
        )
        if greedy:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                          top_k=sampling.top_k if sampling.top_k > 0 else None)
        if sampling.stop:
            kwargs["stop_strings"] = list(sampling.stop)
            kwargs["tokenizer"] = self.tokenizer
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        self.model.eval()
        out = self.model.generate(**batch, **kwargs)
        new_tokens = out.sequences[:, width:]
        scores = torch.stack(out.scores, dim=1).float()  # (B*G, L, V) processed logits
        logprobs = torch.log_softmax(scores, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        ids_np = new_tokens.cpu().numpy().astype(np.int32)
        lp_np = logprobs.cpu().numpy().astype(np.float32)
        stop_ids = set(self.stop_ids)
        results: list[list[SampledCompletion]] = []
        for i in range(len(requests)):
            group = []
            for j in range(sampling.n):
                row = i if greedy else i * sampling.n + j
                n, reason = cut_at_stop(ids_np[row], stop_ids)
                text = self.tokenizer.decode(ids_np[row, :n], skip_special_tokens=True)
                if reason == "length" and sampling.stop and any(s in text for s in sampling.stop):
                    reason = "stop"
                group.append(SampledCompletion(ids_np[row, :n].copy(), lp_np[row, :n].copy(), text, reason))
            results.append(group)
        return results

    @torch.no_grad()
    def load_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """In-place copy into the existing parameters (no reallocation); all names checked first."""
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        for name, t in tensors.items():
            if name not in params:
                raise KeyError(f"weight {name!r} is not a parameter of the rollout model")
            if tuple(params[name].shape) != tuple(t.shape):
                raise ValueError(f"weight {name!r}: shape {tuple(t.shape)} != model {tuple(params[name].shape)}")
        start = time.perf_counter()
        cuda = False
        with torch.no_grad():
            for name, t in tensors.items():
                dst = params[name]
                fast = dst.is_cuda and t.is_pinned()  # pinned receive buffer: asynchronous host-to-device copy
                cuda = cuda or fast
                dst.copy_(t, non_blocking=fast)  # copy_ casts (e.g. float32 sent to a bfloat16 model)
        if cuda:
            torch.cuda.synchronize(self.device)
        self.version = int(version)
        log.debug("applied weights v%d (%d tensors) in %.3fs", version, len(tensors), time.perf_counter() - start)
