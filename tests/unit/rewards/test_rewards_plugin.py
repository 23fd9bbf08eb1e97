"""Custom reward functions used by test_rewards_set.py through ``module:function`` import paths.

Not a test module itself (pytest collects nothing here); it lives next to the tests so the import
path ``test_rewards_plugin:<name>`` works once this folder is on ``sys.path`` (test_rewards_set.py
puts it there on purpose, as a user would with their own plugin folder).
"""

from __future__ import annotations

import math
import threading

RELEASE = threading.Event()  # set by the timeout test to let the hung call finish


def length_reward(completions, answers, scale=10.0, **fields):
    """min(1, len(text) / scale): a user reward with a parameter."""
    return [min(1.0, len(c) / scale) for c in completions]


def question_echo(completions, question, **_):
    """1.0 where the completion contains the record's question field (fields reach custom rewards)."""
    return [1.0 if q and q in c else 0.0 for c, q in zip(completions, question)]


def trl_style(completions, solution):
    """TRL / R1-V signature without **kwargs: gets the ground truth as ``solution``."""
    return [1.0 if c.strip() == s else 0.0 for c, s in zip(completions, solution)]


def boom(completions, answers, **_):
    raise RuntimeError("reward exploded")


def too_short(completions, answers, **_):
    return [1.0] * (len(completions) - 1)


def not_finite(completions, answers, **_):
    return [math.nan, math.inf, 0.5, "x"][: len(completions)]


def not_a_list(completions, answers, **_):
    return 0.5


def hangs(completions, answers, **_):
    RELEASE.wait(60.0)
    return [1.0] * len(completions)
