"""The epoch packing plan: whole conversations in full rows, seeded, reproducible, token-free."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from dflash_recipes.executor.data.packing import (
    PackedRow,
    document_bounds,
    example_lengths,
    pack_epoch,
    packed_batches,
    position_ids,
)
from dflash_recipes.executor.data.tokenize import DatasetStats, TokenizedExample
from dflash_recipes.executor.data.train_dataset import TrainDataset


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


# -- packed batches ----------------------------------------------------------------------------


def _dataset(n: int) -> TrainDataset:
    """Example i has i % 7 + 3 tokens, all equal to i + 1, the first one unsupervised."""
    examples = tuple(
        TokenizedExample([i + 1] * (i % 7 + 3), [0] + [1] * (i % 7 + 2)) for i in range(n)
    )
    return TrainDataset(
        examples, pad_token_id=0, stats=DatasetStats(n, (), 0, 0, 0), source=Path("x")
    )


def test_a_packed_batch_lays_each_rows_documents_end_to_end() -> None:
    dataset = _dataset(30)
    plan = pack_epoch(example_lengths(dataset.examples), seq_len=16, seed=1, epoch=0)
    batch = next(packed_batches(dataset, plan, batch_size=2, epoch=0))
    assert batch.input_ids.shape == (2, 16) and batch.next_index == 2
    assert batch.document_ids is not None
    for r, row in enumerate(plan.rows[:2]):
        for number, ((index, n), (start, end)) in enumerate(
            zip(row.documents, document_bounds(row), strict=True)
        ):
            example = dataset.examples[index]
            assert batch.input_ids[r, start:end].tolist() == example.input_ids[:n]
            assert batch.loss_mask[r, start:end].tolist() == example.loss_mask[:n]
            assert batch.document_ids[r, start:end].tolist() == [number] * n
        used = row.used
        assert batch.attention_mask[r].tolist() == [1] * used + [0] * (16 - used)
        assert batch.document_ids[r, used:].tolist() == [-1] * (16 - used)
        assert batch.loss_mask[r, used:].sum() == 0


def test_ranks_share_the_global_rows_and_a_resume_continues_with_the_same_rows() -> None:
    dataset = _dataset(60)
    plan = pack_epoch(example_lengths(dataset.examples), seq_len=16, seed=1, epoch=0)
    one = list(packed_batches(dataset, plan, batch_size=4, epoch=0))
    assert len(one) == len(plan.rows) // 4  # the incomplete last batch is dropped
    assert {tuple(b.input_ids.shape) for b in one} == {(4, 16)}
    ranks = [list(packed_batches(dataset, plan, batch_size=2, epoch=0, rank=r, world_size=2))
             for r in (0, 1)]  # fmt: skip
    for whole, half0, half1 in zip(one, *ranks, strict=True):
        assert torch.equal(whole.input_ids, torch.cat([half0.input_ids, half1.input_ids]))
        assert whole.next_index == half0.next_index == half1.next_index
    resumed = list(packed_batches(dataset, plan, batch_size=4, epoch=0, start_index=8))
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(one[2:], resumed, strict=True))
