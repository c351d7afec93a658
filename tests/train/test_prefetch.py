"""Prefetcher: order, results equal to building in the loop, errors re-raised, no hang, clean close."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from typing import Any

import pytest
import torch

import torchfold
from torchfold import Fold, FoldError
from torchfold.train import Prefetcher


class Cell(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(10, 4)
        self.mix = torch.nn.Linear(8, 4)

    def leaf(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids)

    def node(self, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mix(torch.cat([left, right], 1)))


def build(words: list[int]) -> tuple[Fold, list[torchfold.Node]]:
    fold = Fold()
    level = [fold.add("leaf", w) for w in words]
    while len(level) > 1:
        level = [fold.add("node", level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)] + level[
            len(level) - len(level) % 2 :
        ]
    return fold, level


BATCHES = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [1]]


@pytest.mark.parametrize("prefetch_factor", [1, 2, 5])
def test_prefetched_folds_give_the_same_results_in_order(prefetch_factor: int) -> None:
    model = Cell()
    expected = []
    for batch in BATCHES:
        fold, roots = build(batch)
        expected.append(fold.apply(model, [roots])[0])
    with Prefetcher(BATCHES, build, prefetch_factor=prefetch_factor) as ready:
        got = [fold.apply(model, [roots])[0] for fold, roots in ready]
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)


def test_worker_errors_are_raised_in_the_loop_with_the_batch_number() -> None:
    def failing(batch: list[int]) -> int:
        if batch == [6, 7, 8, 9]:
            raise KeyError("no such word")
        return len(batch)

    seen = []
    with pytest.raises(KeyError, match="no such word") as info, Prefetcher(BATCHES, failing) as ready:
        seen.extend(ready)
    assert seen == [3, 2]
    assert info.value.__notes__ == ["torchfold.train.Prefetcher: while building batch 2"]


@pytest.mark.parametrize(
    "error",
    [
        UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"),
        json.JSONDecodeError("Expecting value", "{", 1),
        subprocess.CalledProcessError(3, ["parse"]),
    ],
    ids=lambda e: type(e).__name__,
)
def test_a_build_error_keeps_its_type(error: Exception) -> None:
    # These came back as FoldError: `except UnicodeDecodeError:` must catch a UnicodeDecodeError.
    def failing(batch: list[int]) -> int:
        raise error

    with pytest.raises(type(error)) as info, Prefetcher(BATCHES, failing) as ready:
        next(ready)
    assert info.value is error


def test_a_stop_iteration_in_the_build_does_not_end_the_loop_silently() -> None:
    def failing(batch: list[int]) -> int:
        if batch == [6, 7, 8, 9]:
            raise StopIteration
        return len(batch)

    seen: list[int] = []
    with (
        pytest.raises(RuntimeError, match="build raised StopIteration for batch 2"),
        Prefetcher(BATCHES, failing) as ready,
    ):
        seen.extend(ready)
    assert seen == [3, 2]


def test_a_stuck_build_times_out_instead_of_hanging() -> None:
    release = threading.Event()

    def stuck(batch: list[int]) -> int:
        release.wait(5)
        return 0

    start = time.monotonic()
    ready = Prefetcher(BATCHES, stuck, timeout=0.2)
    with pytest.raises(FoldError, match=r"no batch was ready within timeout=0.2s"):
        next(ready)
    release.set()
    assert time.monotonic() - start < 5


def _never_returns_after_the_first(never: threading.Event) -> Any:
    def build(batch: list[int]) -> int:
        if batch != BATCHES[0]:
            never.wait()  # a build stuck for good (a dead lock, a hung read)
        return len(batch)

    return build


def _body_timed_out(ready: Prefetcher[list[int], int]) -> None:
    for _ in ready:
        pass


def _body_raised(ready: Prefetcher[list[int], int]) -> None:
    next(ready)
    raise KeyError("the training step failed")


@pytest.mark.parametrize(
    ("body", "error"),
    [(_body_timed_out, "no batch was ready within timeout=0.3s"), (_body_raised, "training step")],
    ids=["after a timeout", "after an error in the loop"],
)
def test_leaving_the_with_block_does_not_wait_for_a_build_stuck_for_good(body: Any, error: str) -> None:
    never = threading.Event()
    raised: list[BaseException] = []

    def loop() -> None:
        try:
            with Prefetcher(BATCHES, _never_returns_after_the_first(never), timeout=0.3) as ready:
                body(ready)
        except (FoldError, KeyError) as caught:
            raised.append(caught)

    runner = threading.Thread(target=loop, daemon=True)  # so that a regression fails, not hangs, the suite
    start = time.monotonic()
    runner.start()
    runner.join(10)
    try:
        assert not runner.is_alive(), "the with-block still waits for the stuck build"
        assert time.monotonic() - start < 2  # within about the timeout
        assert len(raised) == 1 and error in str(raised[0])
    finally:
        never.set()


def test_close_stops_the_worker_early() -> None:
    built = []

    def record(batch: int) -> int:
        built.append(batch)
        return batch

    ready = Prefetcher(range(10_000), record, prefetch_factor=2)
    assert next(ready) == 0
    ready.close()
    assert not ready._thread.is_alive()
    assert len(built) < 100
    with pytest.raises(StopIteration):
        next(ready)


@pytest.mark.parametrize(
    ("kwargs", "message"), [({"prefetch_factor": 0}, "prefetch_factor"), ({"timeout": 0}, "timeout")]
)
def test_bad_arguments(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Prefetcher([], len, **kwargs)  # type: ignore[arg-type]


def test_prefetch_factor_is_checked_as_every_int_argument() -> None:
    with pytest.raises(ValueError, match="prefetch_factor must be a positive int, got 0"):
        Prefetcher(BATCHES, len, prefetch_factor=0)
    with pytest.raises(TypeError, match=r"prefetch_factor must be an int, got float 1\.5"):
        Prefetcher(BATCHES, len, prefetch_factor=1.5)  # type: ignore[arg-type]
