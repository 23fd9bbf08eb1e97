"""How one step's groups are cut into micro-batches (pure): whole groups per micro-batch, a token
budget (:class:`MicroBudget`, which the out-of-memory retry halves), one sampling temperature per micro-batch, and an exact count when ranks must agree."""

from __future__ import annotations

from dataclasses import dataclass, replace

from streamgrpo.learner.state import Accepted

__all__ = ["MicroBudget", "cut_to", "group_tokens", "sampling_temperature", "split_groups", "split_micro_batches"]

MIN_BUDGET = 16  # learner.micro_batch_tokens' own lower bound


@dataclass
class MicroBudget:
    """How a step cuts its groups into micro-batches: at most ``tokens`` tokens a micro-batch (None: no limit,
    ``learner.micro_batch_tokens`` unset), and whether a group over it is cut into runs of its rows (only after
    running out of memory). Every rank holds the same; the out-of-memory retry halves it
    (:mod:`streamgrpo.learner.memory.oom`) and the next steps keep it."""

    tokens: int | None = None
    cut_groups: bool = False

    def halve(self, failed_tokens: int, failed_rows: int) -> int | None:
        """After a micro-batch of ``failed_tokens`` tokens in ``failed_rows`` sequences ran out of memory: half of
        it (a micro-batch always holds at least one sequence), groups cut from now on; the new budget, or None
        (unchanged) when it was one sequence already."""
        if failed_rows <= 1:
            return None
        self.tokens, self.cut_groups = max(MIN_BUDGET, failed_tokens // 2), True
        return self.tokens


def _temperature_key(a: Accepted):
    """The sampling temperature a group's ``meta`` records (None: not recorded, the config's applies)."""
    return a.group.meta.get("temperature")


def sampling_temperature(a: Accepted, default: float) -> float:
    """The temperature ``a`` was sampled at: its own, else ``default`` (``rollout.temperature``)."""
    return float(default if _temperature_key(a) is None else _temperature_key(a))


def group_tokens(a: Accepted, shared_prompt: bool = False) -> int:
    """Decoder tokens of one group (what a micro-batch budget counts): prompt + completion per row, or
    with ``shared_prompt`` (``learner.shared_prompt``) the prompt once and every completion."""
    completions = sum(len(c.token_ids) for c in a.group.completions)
    prompts = 1 if shared_prompt else len(a.group.completions)
    return prompts * len(a.group.prompt_ids) + completions


def split_groups(batch: list[Accepted], max_tokens: int | None,
                 shared_prompt: bool = False) -> tuple[list[Accepted], list[tuple[int, int]]]:
    """The units micro-batches are made of: each group whole, or, when the group alone is over
    ``max_tokens`` (the learner halved its budget after running out of memory), its completions cut
    into consecutive runs that fit (one completion over the budget alone: one sequence is the least a
    micro-batch holds). A cut unit is the group with a run of its completions (the same stream entry,
    prompt and inputs; its vision pass runs once per unit). Returns the units in order and, for each,
    ``(index of its group in batch, index of its first completion)``."""
    units: list[Accepted] = []
    origin: list[tuple[int, int]] = []
    for i, a in enumerate(batch):
        comps = a.group.completions
        if not max_tokens or group_tokens(a, shared_prompt) <= max_tokens or len(comps) == 1:
            units.append(a)
            origin.append((i, 0))
            continue
        prompt = len(a.group.prompt_ids)
        base, per_row = (prompt, 0) if shared_prompt else (0, prompt)
        start, size = 0, base
        for j, c in enumerate(comps):
            n = per_row + len(c.token_ids)
            if j > start and size + n > max_tokens:
                units.append(replace(a, group=replace(a.group, completions=comps[start:j])))
                origin.append((i, start))
                start, size = j, base
            size += n
        units.append(replace(a, group=replace(a.group, completions=comps[start:])))
        origin.append((i, start))
    return units, origin


def cut_to(units: list[Accepted], origin: list[tuple[int, int]],
           n: int) -> tuple[list[Accepted], list[tuple[int, int]]]:
    """At least ``n`` units: the unit with the most completions cut in two halves until there are (the
    micro-batch count ranks agree on may ask a rank for more parts than its units, once groups are
    cut after running out of memory)."""
    units, origin = list(units), list(origin)
    while len(units) < n:
        i = max(range(len(units)), key=lambda k: len(units[k].group.completions))
        u, (g, start) = units[i], origin[i]
        comps = u.group.completions
        if len(comps) < 2:
            raise ValueError(f"cannot cut {len(units)} units of one completion into {n} micro-batches")
        half = len(comps) // 2
        units[i:i + 1] = [replace(u, group=replace(u.group, completions=comps[:half])),
                          replace(u, group=replace(u.group, completions=comps[half:]))]
        origin[i:i + 1] = [(g, start), (g, start + half)]
    return units, origin


def split_micro_batches(batch: list[Accepted], max_tokens: int | None,
                        n_parts: int | None = None, shared_prompt: bool = False) -> list[list[Accepted]]:
    """Whole groups per micro-batch (one vision pass per group), at most ``max_tokens`` tokens each
    (a single larger group gets a micro-batch of its own), in order. Groups sampled at different
    temperatures never share a micro-batch (log-probs are recomputed at one temperature per forward).

    ``n_parts`` asks for exactly that many micro-batches (at least the greedy count, at most one
    per group): the heaviest splittable part is cut at its token midpoint until there are enough.
    Ranks use it to run the same number of backward passes. ``shared_prompt``: tokens as that layout
    has them (:func:`group_tokens`).
    """

    def tokens(a: Accepted) -> int:
        return group_tokens(a, shared_prompt)

    parts: list[list[Accepted]] = [[]]
    size = 0
    for a in batch:
        n = tokens(a)
        if parts[-1] and ((max_tokens and size + n > max_tokens)
                          or _temperature_key(a) != _temperature_key(parts[-1][-1])):
            parts.append([])
            size = 0
        parts[-1].append(a)
        size += n
    if n_parts is None or n_parts == len(parts):
        return parts
    if not len(parts) <= n_parts <= len(batch):
        raise ValueError(f"cannot split {len(batch)} groups into {n_parts} micro-batches "
                         f"(the token budget needs at least {len(parts)})")
    while len(parts) < n_parts:
        i = max((i for i, p in enumerate(parts) if len(p) > 1), key=lambda i: sum(map(tokens, parts[i])))
        p = parts[i]
        sizes = [tokens(a) for a in p]
        half, run, cut = sum(sizes) / 2, 0, 1
        for j in range(1, len(p)):
            run += sizes[j - 1]
            cut = j
            if run >= half:
                break
        parts[i:i + 1] = [p[:cut], p[cut:]]
    return parts


def token_staleness(part: list[Accepted], length: int):
    """(rows, ``length``) int64: each completion token's staleness (the learner's version minus the version it
    was sampled with; without per-token versions, the group's staleness), rows in group order as
    ``build_batch`` lays them out (padding 0: mask it). The live agreement guard buckets tokens by it
    (:mod:`streamgrpo.learner.agreement_guard`)."""
    import numpy as np
    import torch

    rows = []
    for a in part:
        current = a.staleness + int(a.group.policy_version)
        for c in a.group.completions:
            n = len(c.token_ids)
            row = np.zeros(length, dtype=np.int64)
            row[:n] = a.staleness if c.versions is None else current - np.asarray(c.versions[:n], dtype=np.int64)
            rows.append(row)
    return torch.from_numpy(np.stack(rows)) if rows else torch.zeros((0, length), dtype=torch.int64)


def fresh_token_mask(part: list[Accepted], length: int):
    """(rows, ``length``) bool: the completion tokens sampled with the learner's current weights (each
    token's own policy version equals the learner's; without per-token versions, every token of a
    group at staleness 0), rows in group order as ``build_batch`` lays them out. The live agreement
    guard measures the generator = learner agreement on these (:mod:`streamgrpo.learner.agreement_guard`)."""
    import numpy as np
    import torch

    rows = []
    for a in part:
        current = a.staleness + int(a.group.policy_version)
        for c in a.group.completions:
            n = len(c.token_ids)
            row = np.zeros(length, dtype=bool)
            row[:n] = a.staleness == 0 if c.versions is None else np.asarray(c.versions[:n]) == current
            rows.append(row)
    return torch.from_numpy(np.stack(rows)) if rows else torch.zeros((0, length), dtype=torch.bool)
