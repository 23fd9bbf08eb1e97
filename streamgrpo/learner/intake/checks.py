"""What the learner checks in a decoded group before it trains on it, as functions of the group alone:
the gate (:mod:`streamgrpo.learner.intake.gate`) and ``streamgrpo queue check`` run the same ones.

In order: every completion token is one the model can embed (else ``invalid``); visuals by reference
decode to the generator's pixels (``media_missing`` / ``media_mismatch``, :mod:`.media`); the prompt,
re-processed from ``prompt_text`` and the visuals by the learner's processor, gives exactly the
message's ``prompt_ids`` (else ``mismatch``: the generator used another processor, template or frames).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from streamgrpo.data.prompts import processor_inputs
from streamgrpo.learner.intake.media import MediaError, by_reference


@dataclass(frozen=True)
class Problem:
    """Why a group is not trained: ``label`` is the ``groups_dropped`` reason, ``reason`` one line."""

    label: str
    reason: str


def token_problem(group, vocab_size: int) -> str | None:
    """Why the model cannot train on ``group``'s completion tokens (an id it cannot embed), or None."""
    for i, c in enumerate(group.completions):
        ids = np.asarray(c.token_ids)
        if ids.size and (int(ids.max()) >= vocab_size or int(ids.min()) < 0):
            bad = int(ids.max()) if int(ids.max()) >= vocab_size else int(ids.min())
            return f"completions[{i}].token_ids: token id {bad} is outside the model's vocabulary (0..{vocab_size - 1})"
    return None


def prompt_problem(message_ids: Any, learner_ids: Any) -> str | None:
    """None when the two prompt token sequences are equal, else one line: both lengths and the first
    position where they differ, with the token on each side."""
    sent = np.asarray(message_ids).reshape(-1)
    mine = np.asarray(learner_ids).reshape(-1)
    if sent.shape == mine.shape and np.array_equal(sent, mine):
        return None
    n = min(len(sent), len(mine))
    differ = np.flatnonzero(sent[:n] != mine[:n])
    i = int(differ[0]) if differ.size else n
    at = lambda ids: str(int(ids[i])) if i < len(ids) else "end"  # noqa: E731
    return (f"prompt_ids: the message has {len(sent)} tokens, the learner's processor gives {len(mine)} for its "
            f"prompt_text and visuals; first difference at token {i} (message {at(sent)}, learner {at(mine)})")


def reprocess(processor, group) -> tuple[Any, Problem | None]:
    """The learner's processor inputs for ``group`` (visuals resolved), and the mismatch if any."""

    try:
        inputs = processor_inputs(processor, group.prompt_text, group.visuals)
    except Exception as exc:  # noqa: BLE001 - any failure to re-create the inputs is a mismatch
        return None, Problem("mismatch", f"prompt: the learner's processor cannot re-process it: {exc}")
    why = prompt_problem(group.prompt_ids, inputs["input_ids"])
    return inputs, (Problem("mismatch", why) if why else None)


def check_group(group, processor, vocab_size: int, media=None) -> tuple[Any, Any, Problem | None]:
    """``(group with visuals resolved, processor inputs, problem)`` after every check above; ``media``
    (a :class:`~streamgrpo.learner.intake.media.MediaResolver`) resolves references synchronously."""

    why = token_problem(group, vocab_size)
    if why:
        return group, None, Problem("invalid", why)
    if by_reference(group):
        if media is None:
            return group, None, Problem("media_missing", "visuals by reference, and this consumer decodes none")
        try:
            group = media.resolve(group)
        except MediaError as exc:
            return group, None, Problem(exc.label, str(exc))
    inputs, problem = reprocess(processor, group)
    return group, inputs, problem
