"""The prefetch thread: the stream's order, its errors, its end, and stopping it."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from dflash_recipes.executor.training.setup.prefetch import Prefetch, pin_batches


def _numbers(stop: int, *, fail_at: int | None = None) -> Iterator[int]:
    for n in range(stop):
        if n == fail_at:
            msg = f"bad item {n}"
            raise ValueError(msg)
        yield n


@pytest.mark.parametrize("background", [True, False])
def test_items_come_in_order_then_the_end(background: bool) -> None:
    with Prefetch(_numbers(7), depth=2, background=background) as items:
        assert list(items) == list(range(7))
        with pytest.raises(StopIteration):
            next(items)


def test_the_source_runs_on_another_thread() -> None:
    seen: list[threading.Thread] = []

    def source() -> Iterator[int]:
        while True:
            seen.append(threading.current_thread())
            yield len(seen)

    with Prefetch(source(), depth=1) as items:
        assert next(items) == 1
    assert seen and threading.current_thread() not in seen


def test_an_error_of_the_source_is_raised_by_the_next_that_would_return_it() -> None:
    with Prefetch(_numbers(5, fail_at=3), depth=2) as items:
        assert [next(items) for _ in range(3)] == [0, 1, 2]
        with pytest.raises(ValueError, match="bad item 3"):
            next(items)


def test_close_stops_a_thread_waiting_to_hand_over_an_item() -> None:
    produced: list[int] = []

    def endless() -> Iterator[int]:
        n = 0
        while True:
            produced.append(n)
            yield n
            n += 1

    items = Prefetch(endless(), depth=1)
    assert next(items) == 0
    items.close()
    assert items._thread is not None and not items._thread.is_alive()
    # It prepared at most the queue's depth and the item in its hands beyond what was taken.
    assert len(produced) <= 3


def test_batches_are_pinned_only_for_cuda() -> None:
    assert not pin_batches(torch.device("cpu"))
    assert pin_batches(torch.device("cuda")) == torch.cuda.is_available()
