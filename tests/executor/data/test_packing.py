"""The epoch packing plan: whole conversations in full rows, seeded, reproducible, token-free."""

from __future__ import annotations

import random

import pytest

from dflash_recipes.executor.data.packing import (
    PackedRow,
    document_bounds,
    pack_epoch,
    position_ids,
)


def _lengths(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [max(1, int(rng.lognormvariate(6.4, 0.9))) for _ in range(n)]


def test_every_example_placed_once_whole_and_rows_never_overflow() -> None:
    lengths = _lengths(500)
    plan = pack_epoch(lengths, seq_len=4096, seed=3, epoch=0)
    seen = [i for row in plan.rows for i, _ in row.documents]
    assert sorted(seen) == list(range(len(lengths)))
    for row in plan.rows:
        assert 0 < row.used <= 4096
        for i, n in row.documents:
            assert n == min(lengths[i], 4096)


def test_too_long_conversations_are_truncated_to_the_row_and_counted() -> None:
    plan = pack_epoch([10, 5000, 20, 4097, 4096], seq_len=4096, seed=0, epoch=0)
    assert plan.truncated == 2
    taken = dict(d for row in plan.rows for d in row.documents)
    assert taken[1] == 4096 and taken[3] == 4096 and taken[4] == 4096


def test_plan_is_a_function_of_seed_and_epoch() -> None:
    lengths = _lengths(300)
    a = pack_epoch(lengths, seq_len=2048, seed=7, epoch=1)
    assert a == pack_epoch(list(lengths), seq_len=2048, seed=7, epoch=1)
    assert a != pack_epoch(lengths, seq_len=2048, seed=7, epoch=2)
    assert a != pack_epoch(lengths, seq_len=2048, seed=8, epoch=1)


def test_packing_fills_rows_far_better_than_one_conversation_per_row() -> None:
    lengths = _lengths(1000)
    plan = pack_epoch(lengths, seq_len=4096, seed=0, epoch=0)
    padded_rows = len(lengths)
    assert len(plan.rows) * 4 < padded_rows
    assert plan.fill() > 0.9


def test_empty_examples_are_skipped_and_bad_arguments_refused() -> None:
    plan = pack_epoch([0, 3, 0], seq_len=8, seed=0, epoch=0)
    assert [row.documents for row in plan.rows] == [((1, 3),)]
    with pytest.raises(ValueError, match="seq_len"):
        pack_epoch([1], seq_len=0, seed=0, epoch=0)
    with pytest.raises(ValueError, match="open_rows"):
        pack_epoch([1], seq_len=4, seed=0, epoch=0, open_rows=0)


def test_document_bounds_and_position_ids_restart_per_document() -> None:
    row = PackedRow(((4, 3), (0, 2)))
    assert document_bounds(row) == [(0, 3), (3, 5)]
    assert position_ids(row, 7) == [0, 1, 2, 0, 1, 0, 1]
