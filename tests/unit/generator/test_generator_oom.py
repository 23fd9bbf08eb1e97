"""A generator's batch that runs out of memory is sampled again in halves (issue 49): the pure
splitting of :class:`streamgrpo.generator.oom.BatchSize`, with a sampling function that runs out
of memory above a given number of prompts (the engine itself: tests/integration/generator/test_generator_oom_engine.py)."""

from __future__ import annotations

import pytest
import torch

from streamgrpo.generator.oom import (
    BatchSize,
    PromptDoesNotFit,
    does_not_fit_message,
    halved,
    is_out_of_memory,
)


class Fits:
    """Samples up to ``limit`` prompts per call (more: ``torch.OutOfMemoryError``); records every call."""

    def __init__(self, limit: int):
        self.limit, self.calls = limit, []

    def __call__(self, piece: list) -> list:
        self.calls.append(list(piece))
        if len(piece) > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory: {len(piece)} prompts")
        return [f"group-{p}" for p in piece]


def test_halving_rounds_up_so_a_chunk_splits_into_two_halves():
    assert [halved(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 1, 2, 2, 3, 4, 5]


@pytest.mark.parametrize("size,limit,kept", [(8, 8, 8), (8, 4, 4), (8, 3, 2), (8, 1, 1), (5, 2, 2), (6, 2, 2)])
def test_every_prompt_gives_one_group_in_order_and_the_smaller_size_is_kept(size, limit, kept):
    sample, halves, freed = Fits(limit), [], []
    batch = BatchSize(size, free=lambda: freed.append(1), on_halve=lambda tried, new: halves.append((tried, new)))
    chunk = list(range(size))
    assert batch.run(chunk, sample) == [f"group-{p}" for p in chunk]  # none lost, none twice, in order
    assert batch.size == kept and batch.halvings == len(halves) == len(freed)
    succeeded = [p for call in sample.calls if len(call) <= limit for p in call]
    assert succeeded == chunk  # a piece that ran out of memory gave nothing and was sampled again
    # the next chunk goes at the kept size at once: no call runs out of memory again
    sample.calls.clear()
    assert batch.run(list(range(100, 100 + size)), sample) == [f"group-{p}" for p in range(100, 100 + size)]
    assert all(len(c) <= kept for c in sample.calls) and batch.halvings == len(halves)


def test_the_rest_of_a_chunk_goes_at_the_halved_size_without_running_out_again():
    sample, halves = Fits(2), []
    batch = BatchSize(8, free=lambda: None, on_halve=lambda tried, new: halves.append((tried, new)))
    batch.run(list(range(8)), sample)
    assert [len(c) for c in sample.calls] == [8, 4, 2, 2, 2, 2]
    assert halves == [(8, 4), (4, 2)]


def test_one_prompt_that_does_not_fit_stops_with_the_given_line():
    batch = BatchSize(4, does_not_fit="g0: lower rollout.num_generations", free=lambda: None)
    with pytest.raises(PromptDoesNotFit, match="^g0: lower rollout.num_generations$") as exc:
        batch.run([1, 2, 3], Fits(0))
    assert exc.value.__cause__ is None and exc.value.__suppress_context__  # no chained OOM traceback
    assert batch.size == 1


def test_other_errors_pass_through_untouched():
    def broken(piece):
        raise ValueError("a bug")

    batch = BatchSize(4, free=lambda: pytest.fail("nothing to free"))
    with pytest.raises(ValueError, match="a bug"):
        batch.run([1, 2], broken)
    assert batch.size == 4 and batch.halvings == 0


def test_only_torchs_out_of_memory_error_counts():
    assert is_out_of_memory(torch.OutOfMemoryError("x")) and is_out_of_memory(torch.cuda.OutOfMemoryError("x"))
    assert not is_out_of_memory(RuntimeError("out of memory")) and not is_out_of_memory(MemoryError())


def test_the_stop_line_names_every_setting_that_makes_one_prompt_fit():
    from streamgrpo.config import build_config

    cfg = build_config({}, ["rollout.num_generations=16", "rollout.max_completion_length=2048",
                            "data.max_frames=64", "data.max_pixels=200704"])
    line = does_not_fit_message("generator-3", cfg)
    assert "\n" not in line and line.startswith("generator-3: one prompt does not fit")
    for part in ("rollout.num_generations (16)", "rollout.max_completion_length (2048)", "data.max_pixels (200704)",
                 "data.max_frames (64)", "rollout.prompts_per_batch is already 1"):
        assert part in line


def test_a_prompt_that_does_not_fit_ends_the_generator_command_in_one_line(monkeypatch, capsys):
    import streamgrpo.cli as cli
    import streamgrpo.commands.generator as command

    def generator(args):
        raise PromptDoesNotFit("generator-0: one prompt does not fit in the rollout engine's memory")

    monkeypatch.setattr(command, "main", generator)  # what `streamgrpo generator` runs
    assert cli.main(["generator", "--id", "0"]) == cli.FAILED_EXIT
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == "streamgrpo generator: generator-0: one prompt does not fit in the rollout engine's memory"
