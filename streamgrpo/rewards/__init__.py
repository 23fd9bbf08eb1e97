"""Rewards: every seed reward family, the weighted set, custom rewards by import path.

One interface (TRL's, with plain-string completions)::

    fn(completions: list[str], answers: list[str], **fields) -> list[float]

* :func:`get` -- a built-in by name with its params, or ``module:function`` for a user function.
* :func:`extract_answer` -- the one place that reads the ``<answer>`` tag.
* :class:`RewardSet` -- the ``rewards`` config section: weighted total, per-function values,
  robustness (raise / wrong length / non-finite / timeout -> 0, logged and counted), debug log,
  Prometheus ``streamgrpo_reward{fn}``.

Built-ins: ``format``, ``strict_format``, ``soft_format``, ``xml_count``, ``accuracy``,
``action_iou``, ``numeric``, ``exact_match`` (see each module). This package imports no torch.
"""

from __future__ import annotations

from . import accuracy as _accuracy  # noqa: F401  (registers)
from . import action_iou as _action_iou  # noqa: F401
from . import exact as _exact  # noqa: F401
from . import format as _format  # noqa: F401
from . import numeric as _numeric  # noqa: F401
from .accuracy import classify_answer, score_choice
from .choices import named_options, parse_options
from .combine import RewardSet, RewardTimeout, ScoredRewards
from .extract import answer_text, extract_answer, first_number, normalize, numbers, truth_text
from .registry import RewardError, RewardFn, builtin_names, canonical_name, get, register

__all__ = [
    "RewardError",
    "RewardFn",
    "RewardSet",
    "RewardTimeout",
    "ScoredRewards",
    "answer_text",
    "builtin_names",
    "canonical_name",
    "classify_answer",
    "extract_answer",
    "first_number",
    "get",
    "named_options",
    "normalize",
    "numbers",
    "parse_options",
    "register",
    "score_choice",
    "truth_text",
]
