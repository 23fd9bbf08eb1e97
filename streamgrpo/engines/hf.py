"""Hugging Face transformers rollout engine (CPU or GPU).

Several prompts (each with its own videos/images) are left-padded into one batch. Each prompt is
prefilled once (:meth:`HFEngine._prefill`): one forward over every prompt column but the last, so the
vision encoder and the prompt's decoder pass run once per group, not G times; its KV cache is then
repeated to G rows per prompt (``DynamicCache.batch_repeat_interleave``, the rows in generate's own
prompt-major order, Qwen-VL's stored m-RoPE ``rope_deltas`` alike) and ``generate`` continues from it
with the last prompt token as its only uncached input. Same tokens and log-probs as
``generate(num_return_sequences=G)`` over the whole prompt (to float rounding: tests/unit/engines/test_engine_hf.py);
the G copies of the prompt's KV still exist while decoding (a shared-prefix attention would be needed to
hold one). Where that cannot be done (a release without a cache keyword, a prompt of one token, one
ending in a vision token) the prompt goes to ``generate`` whole, G times. With ``rollout.vision_cache_mib``
the prefill takes the vision features of visuals seen before from a byte-bounded cache
(:mod:`.vision_features`). The behaviour log-prob of each sampled token is the log-prob
under the distribution the token was actually drawn from: the processed logits (vision tokens
suppressed, divided by the temperature, top-k/top-p masked). With ``top_p == 1`` and ``top_k == 0``
that equals ``log_softmax(logits / T)``, which is what the learner recomputes.

It is captured inside the generation loop by :class:`LogprobRecorder`, the last logits processor
(the sampling warpers are ours, placed before it): at each step it keeps the processed logits of
that step and their ``logsumexp`` until the next step, whose ``input_ids`` end with the token just
sampled from them, and then keeps only that token's log-prob (B floats). The last token is taken
after ``generate`` returns. Memory: one (B, V) row of the current step, and (B, L) log-probs, never
``output_scores``' stacked (B, L, V). Anything in the checkpoint's ``generation_config`` that would
change the distribution beyond that (Qwen2.5-VL-Instruct ships ``repetition_penalty: 1.05``) is
switched off (:data:`NEUTRAL_GENERATION`): the learner could not recompute it.

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

from streamgrpo.engines.base import Engine, PromptRequest, SampledCompletion, SamplingParams, cut_at_stop
from streamgrpo.engines.vision_features import VisionFeatureCache
from streamgrpo.models.batching import vision_token_ids
from streamgrpo.models.capabilities import ENCODER_OUTPUTS, capabilities, takes

log = logging.getLogger(__name__)

NEUTRAL_GENERATION: dict[str, Any] = dict(
    repetition_penalty=1.0, no_repeat_ngram_size=0, min_length=0, min_new_tokens=None, min_p=None, typical_p=1.0,
    epsilon_cutoff=0.0, eta_cutoff=0.0, renormalize_logits=False, num_beams=1,
)
"""generate() settings that keep the checkpoint's generation_config from reshaping the sampled distribution."""


class LogprobRecorder:
    """A logits processor that records the log-prob of every sampled token under the processed
    distribution; it must come last. Holds one step's (B, V) logits and (B,) floats per step."""

    def __init__(self) -> None:
        self.steps: list[torch.Tensor] = []
        self._scores: torch.Tensor | None = None
        self._lse: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self._scores is not None:  # input_ids now end with the token sampled from the previous step's scores
            self.steps.append(self._take(input_ids[:, -1]))
        self._scores, self._lse = scores, torch.logsumexp(scores.float(), dim=-1)
        return scores

    def _take(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self._scores.float().gather(-1, token_ids[:, None]).squeeze(-1) - self._lse

    def finish(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """(B, L) float32 log-probs of ``new_tokens``, the generated columns of the sequences; frees the last step.

        ``generate`` may have run a step past the last token it returns (a deferred stop check undoes
        it): only the first L steps count."""
        L = int(new_tokens.shape[1])
        if self._scores is not None and len(self.steps) < L:
            self.steps.append(self._take(new_tokens[:, len(self.steps)]))
        self._scores = self._lse = None
        if len(self.steps) < L:
            raise RuntimeError(f"recorded {len(self.steps)} sampling steps for {L} generated tokens")
        if not L:
            return torch.zeros((new_tokens.shape[0], 0), dtype=torch.float32, device=new_tokens.device)
        return torch.stack(self.steps[:L], dim=1)


def sampling_processors(sampling: SamplingParams) -> list[Any]:
    """The sampling warpers in generate's own order (temperature, top-k, top-p) for ``sampling``, then a
    :class:`LogprobRecorder`; greedy decoding has the recorder alone."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    out: list[Any] = []
    if sampling.temperature != 0:
        if sampling.temperature != 1.0:
            out.append(TemperatureLogitsWarper(sampling.temperature))
        if sampling.top_k > 0:
            out.append(TopKLogitsWarper(top_k=sampling.top_k))
        if sampling.top_p < 1.0:
            out.append(TopPLogitsWarper(top_p=sampling.top_p))
    return [*out, LogprobRecorder()]


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


def cache_keyword(model) -> str | None:
    """The keyword ``model``'s forward and ``generate`` take a KV cache by (``cache`` from transformers 5.2x,
    ``past_key_values`` before), None if its forward names neither."""
    fwd = getattr(type(model), "forward", None)
    return next((k for k in ("cache", "past_key_values") if takes(fwd, k)), None)


def repeat_rows(batch: dict[str, torch.Tensor], repeat: int) -> dict[str, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` of a collated batch with each row repeated ``repeat`` times in
    place (prompt-major: generate's own order for ``num_return_sequences``): what ``generate`` needs after a
    prefill (the visuals and their token types stay with the prefill)."""
    return {k: batch[k].repeat_interleave(repeat, dim=0) for k in ("input_ids", "attention_mask")}


class HFEngine(Engine):
    """Sampling with ``model.generate``; weights applied in place between calls.

    ``prompt_once`` (default on): each prompt prefilled once and its KV cache repeated for the G samples
    (the module docstring); off, the whole prompt goes to ``generate`` G times (the benchmark's baseline).
    ``vision_cache_mib`` (``rollout.vision_cache_mib``): vision features kept by visual for the prefill
    (:mod:`.vision_features`); 0 = off."""

    def __init__(self, model, processor, *, device: torch.device | str = "cpu", prompt_once: bool = True,
                 vision_cache_mib: int = 0):
        self.model = model
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.device = torch.device(device)
        self.version = 0
        self.suppress_ids = suppressed_token_ids(self.tokenizer)
        self.stop_ids = stop_token_ids(self.tokenizer)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_ids[0]
        self.prompt_once = prompt_once
        self.cache_kw = cache_keyword(model)
        self.vision_cache = VisionFeatureCache(vision_cache_mib << 20) if vision_cache_mib > 0 else None
        if self.vision_cache is not None and capabilities(model, "generator").vision_once != ENCODER_OUTPUTS:
            log.warning("rollout.vision_cache_mib: %s.forward takes no mm_encoder_outputs on this transformers "
                        "release: vision features are not kept (the vision tower runs every prompt)",
                        type(getattr(model, "model", model)).__name__)
            self.vision_cache = None
        self._visual_names: set[str] | None = None

    @torch.no_grad()
    def generate(self, requests: list[PromptRequest], sampling: SamplingParams,
                 between_steps=None) -> list[list[SampledCompletion]]:
        """``between_steps`` is never called: this engine applies weights between batches only."""
        if not requests:
            return []
        batch = collate_prompts([r.inputs for r in requests], self.pad_id)
        batch = {k: v.to(self.device) for k, v in batch.items()}
        width = batch["input_ids"].shape[1]
        greedy = sampling.temperature == 0  # argmax decoding: one sequence per prompt, copied n times
        processors = sampling_processors(sampling)
        kwargs: dict[str, Any] = dict(
            NEUTRAL_GENERATION,
            max_new_tokens=sampling.max_tokens,
            num_return_sequences=1 if greedy else sampling.n,
            eos_token_id=self.stop_ids,
            pad_token_id=self.pad_id,
            suppress_tokens=self.suppress_ids or None,
            logits_processor=processors,
            do_sample=not greedy,
            # the warpers are in `processors`, before the recorder; generate would append its own after it
            temperature=None if greedy else 1.0, top_p=None if greedy else 1.0, top_k=None,
        )
        if sampling.stop:
            kwargs["stop_strings"] = list(sampling.stop)
            kwargs["tokenizer"] = self.tokenizer
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        self.model.eval()
        repeat = 1 if greedy else sampling.n
        if self._can_prefill(batch):
            inputs = repeat_rows(batch, repeat)
            inputs[self.cache_kw] = self._prefill(batch, repeat, [r.visuals for r in requests])
            kwargs["num_return_sequences"] = 1
        else:
            inputs = batch
        sequences = self.model.generate(**inputs, **kwargs)
        new_tokens = sequences[:, width:]
        logprobs = processors[-1].finish(new_tokens)
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
                group.append(SampledCompletion(ids_np[row, :n].copy(), lp_np[row, :n].copy(), text, reason,
                                               versions=np.full(n, self.version, dtype=np.int32)))
            results.append(group)
        return results

    def _can_prefill(self, batch: dict[str, torch.Tensor]) -> bool:
        """Whether the prompts can be prefilled once here: a cache keyword, two columns or more, and a last
        column of text tokens (the uncached token ``generate`` starts from must not be a vision placeholder)."""
        ids = batch["input_ids"]
        if not self.prompt_once or self.cache_kw is None or ids.shape[1] < 2:
            return False
        return not (self.suppress_ids and bool(torch.isin(ids[:, -1], torch.tensor(self.suppress_ids,
                                                                                   device=ids.device)).any()))

    def _prefill(self, batch: dict[str, torch.Tensor], repeat: int, visuals: list | None = None):
        """One forward over all prompt columns but the last (the vision encoder once per prompt, or not at all
        for visuals whose features are kept: ``visuals``, each prompt's); its KV cache with each prompt's row
        repeated ``repeat`` times, as are Qwen-VL's stored m-RoPE deltas, which ``generate`` adds to the text
        positions of the tokens after the cache."""
        head = {k: v[:, :-1] if k in _PAD_KEYS else v for k, v in batch.items()}
        if self.vision_cache is not None and visuals is not None:
            encoded = self.vision_cache.encoder_outputs(self.model.model, batch, visuals)
            if encoded:
                head = {k: v for k, v in head.items() if k not in ("pixel_values", "pixel_values_videos")}
                head["mm_encoder_outputs"] = encoded
        if takes(type(self.model).forward, "logits_to_keep"):
            head["logits_to_keep"] = 1  # no logits wanted: the last column is generate's first step
        out = self.model(**head, use_cache=True)
        cache = getattr(out, "cache", None)
        if cache is None:
            cache = getattr(out, "past_key_values", None)
        if cache is None:
            raise RuntimeError(f"{type(self.model).__name__} returned no KV cache from its prefill")
        if repeat > 1:
            cache.batch_repeat_interleave(repeat)
            inner = getattr(self.model, "model", None)
            deltas = getattr(inner, "rope_deltas", None)
            if isinstance(deltas, torch.Tensor) and deltas.shape[0] == batch["input_ids"].shape[0]:
                inner.rope_deltas = deltas.repeat_interleave(repeat, dim=0)
        return cache

    def _vision_changes(self, tensors: dict[str, torch.Tensor], params: dict[str, torch.Tensor]) -> bool:
        """Whether ``tensors`` change a parameter of the vision tower (the kept features' weights)."""
        if self._visual_names is None:
            visual = getattr(getattr(self.model, "model", None), "visual", None)
            ids = {id(p) for p in visual.parameters()} if visual is not None else set()
            self._visual_names = {n for n, p in self.model.named_parameters() if id(p) in ids}
        return any(not torch.equal(params[n], t.to(device=params[n].device, dtype=params[n].dtype))
                   for n, t in tensors.items() if n in self._visual_names)

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
        if self.vision_cache is not None and self.vision_cache.nbytes and self._vision_changes(tensors, params):
            self.vision_cache.clear()
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
