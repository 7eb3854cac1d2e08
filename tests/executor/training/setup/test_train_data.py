"""The data builder's stream: epoch after epoch, resumable at any batch, refused when too small."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from dflash_recipes.errors import DataError
from dflash_recipes.executor.data.tokenize import DatasetStats, TokenizedExample
from dflash_recipes.executor.data.train_dataset import TrainDataset
from dflash_recipes.executor.dist_env import detect_dist_env
from dflash_recipes.executor.training.setup.train_data import TrainData


def _data(n: int, *, batch_size: int = 2) -> TrainData:
    # example i holds the token i + 1, so a batch's first column names its examples
    examples = tuple(TokenizedExample([i + 1, 0, 0], [0, 1, 1]) for i in range(n))
    stats = DatasetStats(
        conversations_used=n, skipped=(), num_tokens=3 * n, num_supervised_tokens=2 * n,
        num_truncated=0,
    )  # fmt: skip
    dataset = TrainDataset(examples, pad_token_id=0, stats=stats, source=Path("data.jsonl"))
    return TrainData(
        dataset=dataset, capture=None, batch_size=batch_size, seed=7,
        env=detect_dist_env("cpu", {}),
    )  # fmt: skip


def _ids(data: TrainData, epoch: int, start: int, count: int) -> list[tuple[int, int, list[int]]]:
    stream = data.stream(epoch, start)
    return [
        (b.epoch, b.next_index, b.input_ids[:, 0].tolist()) for b in itertools.islice(stream, count)
    ]


def test_the_stream_goes_on_epoch_after_epoch_and_resumes_where_a_batch_ended() -> None:
    data = _data(5)
    assert data.batches_per_epoch == 3  # one process keeps the last, smaller batch
    straight = _ids(data, 0, 0, 7)
    assert [(epoch, index) for epoch, index, _ in straight] == [
        (0, 2), (0, 4), (0, 5), (1, 2), (1, 4), (1, 5), (2, 2),
    ]  # fmt: skip
    # each epoch is every example once, in its own seeded order
    for epoch in (0, 1):
        seen = sorted(i for e, _, ids in straight if e == epoch for i in ids)
        assert seen == [1, 2, 3, 4, 5]
    assert straight[0][2] + straight[1][2] != straight[3][2] + straight[4][2]
    # a resume at a saved (epoch, next index) draws exactly what followed it
    assert _ids(data, 0, 4, 4) == straight[2:6]
    batch = next(data.stream(0, 0))
    assert not data.offline and data.captured_states(batch) is None


def test_data_smaller_than_one_global_batch_is_refused_with_the_fix() -> None:
    data = _data(1, batch_size=2)
    data.env = detect_dist_env(
        "cpu",
        {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
    )
    with pytest.raises(DataError) as info:
        next(data.stream(0, 0))
    assert str(info.value) == (
        "the data has 1 usable conversations, fewer than one global batch (2 x 2 processes); "
        "add data or lower per_device_train_batch_size"
    )


def test_a_packed_stream_goes_on_epoch_after_epoch_in_full_rows_and_resumes_on_a_row() -> None:
    data = _data(40, batch_size=2)
    data.packed_seq_len = 8  # 3-token conversations: two per row, 20 rows per epoch
    assert data.batches_per_epoch == 10
    straight = list(itertools.islice(data.stream(0, 0), 13))
    assert [(b.epoch, b.next_index) for b in straight[9:12]] == [(0, 20), (1, 2), (1, 4)]
    assert all(tuple(b.input_ids.shape) == (2, 8) for b in straight)
    resumed = list(itertools.islice(data.stream(0, 16), 5))
    for a, b in zip(straight[8:], resumed, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.document_ids, b.document_ids)


def test_data_that_packs_into_fewer_rows_than_a_global_batch_is_refused_with_the_fix() -> None:
    data = _data(3, batch_size=2)
    data.packed_seq_len = 16  # all three conversations fit one row
    with pytest.raises(DataError, match="packs into 1 row"):
        next(data.stream(0, 0))
