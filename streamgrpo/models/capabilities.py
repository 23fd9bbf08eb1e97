"""What the installed transformers release offers streamgrpo, checked once per model class.

streamgrpo reaches past ``model(**inputs)`` into a few transformers internals, and the admitted range
(pyproject.toml: the lowest release ``make test-tf-low`` tests up to the pinned one in constraints.txt)
differs in them. Passing a keyword that a forward does not name is not an error there: ``**kwargs``
swallows it, and e.g. precomputed vision features that never arrive leave the learner blind to the
video. So nothing here is passed on trust: each internal is looked up in the signatures of the model's
own classes (:func:`capabilities`, cached per class), and every caller picks its path from the answer.

What is checked (5.17 = the lowest admitted release, 5.24 = the pinned one), who uses it, and the path
taken where it is missing:

* ``mm_encoder_outputs`` in the inner model's forward (5.24 yes, 5.17 no): the log-probs' one vision
  pass per group (``shared_vision``, ``shared_prompt``). Missing: streamgrpo scatters the features into
  ``inputs_embeds`` itself and calls the language model (:mod:`.vision_inputs`), which needs input
  embeddings, the placeholder token ids in the config and a ``language_model`` forward naming
  ``inputs_embeds``/``position_ids``/``attention_mask`` (Qwen3-VL also ``visual_pos_masks`` and
  ``deepstack_visual_embeds``; both releases have them). Without those: pixels per row (per group in
  the packed layout), the vision encoder G times.
* ``get_image_features`` / ``get_video_features`` taking ``return_dict`` (both): the vision pass itself.
  Missing: pixels per row / per group as above.
* ``get_rope_index(mm_token_type_ids=)`` (both): explicit m-RoPE positions
  (:func:`.batching.prompt_positions`). Missing: an error naming the release.
* ``every_n_layers`` / ``offload`` in the checkpointing switch: ``learner.checkpoint_every`` /
  ``checkpoint_offload``. 5.17 has them in ``gradient_checkpointing_enable(gradient_checkpointing_kwargs,
  ...)``, 5.24 in ``activation_checkpointing_enable(activation_checkpointing_kwargs, ...)`` (the old name
  a deprecated alias without them); the one that takes them is used. Missing in both: plain
  checkpointing, and those two settings refused.

The first model of a class that a role sees logs one line naming the release, what it lacks and the
path taken instead (:func:`capabilities`).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

ENCODER_OUTPUTS = "encoder_outputs"
"""Vision-once path: the model's forward takes ``mm_encoder_outputs``."""
SCATTER = "scatter"
"""Vision-once path: streamgrpo scatters the features into ``inputs_embeds`` and calls the language model."""
PER_ROW = "per_row"
"""No vision-once path: pixels go to the forward per row (per group in the packed layout)."""


def takes(fn: Callable[..., Any] | None, name: str, *, via_kwargs: bool = False) -> bool:
    """Whether ``fn``'s signature names the parameter ``name``; with ``via_kwargs`` a ``**kwargs`` counts too.

    ``via_kwargs`` is for keywords transformers' decorators consume (``return_dict`` in
    ``can_return_tuple``); never for a model input, which ``**kwargs`` would silently drop.
    """
    if fn is None:
        return False
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    if name in params:
        return True
    return via_kwargs and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def takes_all(fn: Callable[..., Any] | None, *names: str) -> bool:
    """Whether ``fn`` names every parameter in ``names``."""
    return fn is not None and all(takes(fn, n) for n in names)


@dataclass(frozen=True)
class Capabilities:
    """The transformers internals one model class offers (see the module docstring's table)."""

    release: str
    """transformers.__version__"""
    model: str
    """The ``*ForConditionalGeneration`` class name."""
    inner: str
    """The inner (``model.model``) class name."""
    encoder_outputs_kwarg: bool
    """The inner forward names ``mm_encoder_outputs``."""
    encoder_features: bool
    """``get_image_features`` and ``get_video_features`` exist and take ``return_dict``."""
    embeds_scatter: bool
    """Input embeddings, placeholder token ids in the config and a ``language_model`` whose forward names
    ``inputs_embeds``, ``position_ids`` and ``attention_mask``: the features can be scattered here."""
    deepstack_kwargs: bool
    """The language model's forward names ``visual_pos_masks`` and ``deepstack_visual_embeds`` (Qwen3-VL)."""
    deepstack: bool
    """The vision tower has deepstack mergers (Qwen3-VL): the scatter must hand their features on too."""
    rope_index: bool
    """``get_rope_index`` exists and names ``mm_token_type_ids``."""
    checkpointing: str | None
    """The method that takes ``every_n_layers`` and ``offload``, or None (plain checkpointing only)."""
    checkpointing_kwargs: str
    """The keyword of that method (or of ``gradient_checkpointing_enable``) for the checkpoint function's kwargs."""

    @property
    def vision_once(self) -> str:
        """How a once-computed vision pass reaches the decoder: ENCODER_OUTPUTS, SCATTER or PER_ROW."""
        if not self.encoder_features:
            return PER_ROW
        if self.encoder_outputs_kwarg:
            return ENCODER_OUTPUTS
        if self.embeds_scatter and (self.deepstack_kwargs or not self.deepstack):
            return SCATTER
        return PER_ROW

    def notices(self) -> list[str]:
        """What this release lacks and the path taken instead (empty on a release with everything)."""
        out = []
        if not self.encoder_outputs_kwarg:
            if self.vision_once == SCATTER:
                out.append(f"{self.inner}.forward takes no mm_encoder_outputs: the once-per-group vision features are "
                           "scattered into inputs_embeds by streamgrpo")
            else:
                out.append(f"{self.inner}.forward takes no mm_encoder_outputs and the features cannot be scattered "
                           "here: the vision encoder runs per row (per group when packed)")
        elif not self.encoder_features:
            out.append(f"{self.inner} has no get_image_features/get_video_features(return_dict=): the vision "
                       "encoder runs per row (per group when packed)")
        if not self.rope_index:
            out.append(f"{self.inner}.get_rope_index(mm_token_type_ids=) is missing: batches cannot be positioned")
        if self.checkpointing is None:
            out.append("no *_checkpointing_enable takes every_n_layers/offload: plain activation checkpointing only "
                       "(learner.checkpoint_every / checkpoint_offload refused)")
        return out


_CACHE: dict[type, Capabilities] = {}


def _release() -> str:
    try:
        import transformers

        return str(transformers.__version__)
    except ImportError:  # a stand-in model in a test
        return "unknown"


def _deepstack(inner: Any) -> bool:
    visual = getattr(inner, "visual", None)
    if visual is not None and len(getattr(visual, "deepstack_merger_list", ()) or ()):
        return True
    vcfg = getattr(getattr(inner, "config", None), "vision_config", None)
    return bool(getattr(vcfg, "deepstack_visual_indexes", None))


def inspect_model(hf: Any) -> Capabilities:
    """The capabilities of ``hf`` (a transformers Qwen-VL ``*ForConditionalGeneration``), uncached."""
    inner = getattr(hf, "model", hf)
    inner_cls = type(inner)
    lm = getattr(inner, "language_model", None)
    lm_fwd = getattr(type(lm), "forward", None) if lm is not None else None
    cfg = getattr(hf, "config", None)
    ckpt, ckpt_kw = None, "gradient_checkpointing_kwargs"
    for name, kw in (("activation_checkpointing_enable", "activation_checkpointing_kwargs"),
                     ("gradient_checkpointing_enable", "gradient_checkpointing_kwargs")):
        fn = getattr(type(hf), name, None)
        if takes_all(fn, "every_n_layers", "offload", kw):
            ckpt, ckpt_kw = name, kw
            break
    return Capabilities(
        release=_release(),
        model=type(hf).__name__,
        inner=inner_cls.__name__,
        encoder_outputs_kwarg=takes(getattr(inner_cls, "forward", None), "mm_encoder_outputs"),
        encoder_features=all(takes(getattr(inner_cls, f, None), "return_dict", via_kwargs=True)
                             for f in ("get_image_features", "get_video_features")),
        embeds_scatter=(callable(getattr(inner, "get_input_embeddings", None))
                        and takes_all(lm_fwd, "inputs_embeds", "position_ids", "attention_mask")
                        and all(isinstance(getattr(cfg, k, None), int) for k in ("image_token_id", "video_token_id"))),
        deepstack_kwargs=takes_all(lm_fwd, "visual_pos_masks", "deepstack_visual_embeds"),
        deepstack=_deepstack(inner),
        rope_index=takes(getattr(inner_cls, "get_rope_index", None), "mm_token_type_ids"),
        checkpointing=ckpt,
        checkpointing_kwargs=ckpt_kw,
    )


def capabilities(hf: Any, role: str = "learner") -> Capabilities:
    """:func:`inspect_model`, once per model class; the first look logs one line if something is missing."""
    key = type(hf)
    caps = _CACHE.get(key)
    if caps is None:
        caps = _CACHE[key] = inspect_model(hf)
        notes = caps.notices()
        if notes:
            log.warning("%s on transformers %s (%s): %s", role, caps.release, caps.model, "; ".join(notes))
    return caps


def clear_cache() -> None:
    """Forget what was inspected (tests that swap a class's methods)."""
    _CACHE.clear()
