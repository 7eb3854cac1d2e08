"""The packing plan of an epoch: whole conversations laid into rows of exactly ``seq_len`` tokens.

A pure function of the token cache's lengths, the row length, the seed and the epoch: it never
reads a token, and the same inputs give the same rows in every process and on every rank count
(rows are global; a rank takes its share of them), so a run resumed at row ``k`` of an epoch
continues with the very rows an uninterrupted run would have used.

The examples are visited in the epoch's seeded order (:func:`epoch_order`) and placed first-fit
into a bounded window of open rows; when an example fits no open row and the window is full, the
fullest open row is closed (emitted). A conversation longer than the row is truncated to the row
(as the padded path truncates it) and counted in :attr:`PackingPlan.truncated`.

:func:`packed_batches` turns a plan into :class:`~dflash_recipes.executor.data.train_dataset.
Batch` es: a global batch is ``batch_size * world_size`` consecutive rows of the plan, rank ``r``
takes its slice, and :attr:`Batch.next_index` is the row index after the global batch, so a
checkpoint's data position resumes on the very next row. An incomplete last global batch is
dropped (every step has the same shape ``[batch_size, seq_len]``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from dflash_recipes.executor.data.tokenize import TokenizedExample
from dflash_recipes.executor.data.train_dataset import Batch, TrainDataset, epoch_order

#: How many rows stay open for first-fit; larger packs tighter and costs more time per example.
OPEN_ROWS = 64


@dataclass(frozen=True)
class PackedRow:
    """One row: ``(example index, tokens taken from it)`` per document, in row order."""

    documents: tuple[tuple[int, int], ...]

    @property
    def used(self) -> int:
        """Tokens of the row that belong to a document (the rest, at the end, is filler)."""
        return sum(n for _, n in self.documents)


@dataclass(frozen=True)
class PackingPlan:
    """The rows of one epoch, and how many conversations were truncated to fit a row."""

    rows: tuple[PackedRow, ...]
    seq_len: int
    truncated: int

    def fill(self) -> float:
        """The share of all row tokens that belong to documents (1.0 is no filler at all)."""
        if not self.rows:
            return 1.0
        return sum(r.used for r in self.rows) / (len(self.rows) * self.seq_len)


def pack_epoch(
    lengths: list[int] | tuple[int, ...],
    *,
    seq_len: int,
    seed: int,
    epoch: int,
    open_rows: int = OPEN_ROWS,
) -> PackingPlan:
    """Plan the rows of `epoch` from the examples' token `lengths` (index = example index).

    Examples of length 0 are skipped. Raises ValueError on a non-positive `seq_len` or
    `open_rows`.
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    if open_rows <= 0:
        raise ValueError(f"open_rows must be positive, got {open_rows}")
    rows: list[PackedRow] = []
    open_docs: list[list[tuple[int, int]]] = []
    open_free: list[int] = []
    truncated = 0
    for index in epoch_order(len(lengths), seed=seed, epoch=epoch):
        n = int(lengths[index])
        if n <= 0:
            continue
        if n > seq_len:
            n = seq_len
            truncated += 1
        slot = next((i for i, free in enumerate(open_free) if free >= n), None)
        if slot is None:
            if len(open_docs) >= open_rows:
                fullest = min(range(len(open_free)), key=lambda i: (open_free[i], i))
                rows.append(PackedRow(tuple(open_docs.pop(fullest))))
                open_free.pop(fullest)
            open_docs.append([])
            open_free.append(seq_len)
            slot = len(open_docs) - 1
        open_docs[slot].append((index, n))
        open_free[slot] -= n
    rows.extend(PackedRow(tuple(docs)) for docs in open_docs)
    return PackingPlan(rows=tuple(rows), seq_len=seq_len, truncated=truncated)


def document_bounds(row: PackedRow) -> list[tuple[int, int]]:
    """The ``[start, end)`` token span of each document of `row`, in row order."""
    spans: list[tuple[int, int]] = []
    start = 0
    for _, n in row.documents:
        spans.append((start, start + n))
        start += n
    return spans


def position_ids(row: PackedRow, seq_len: int) -> list[int]:
    """Position ids restarting at 0 per document; filler after the last document counts on."""
    out: list[int] = []
    for _, n in row.documents:
        out.extend(range(n))
    out.extend(range(seq_len - len(out)))
    return out


def example_lengths(examples: Sequence[TokenizedExample]) -> list[int]:
    """The token count of every example: from the cache's offsets when the examples offer
    ``lengths()`` (the tokenize cache, its held-out view), else by measuring each."""
    lengths = getattr(examples, "lengths", None)
    if callable(lengths):
        return [int(n) for n in lengths()]
    return [len(e.input_ids) for e in examples]


def packed_rows_per_epoch(plan: PackingPlan, *, batch_size: int, world_size: int = 1) -> int:
    """How many packed batches a rank draws from `plan` (whole global batches only)."""
    return len(plan.rows) // (batch_size * world_size)


def packed_batches(
    dataset: TrainDataset,
    plan: PackingPlan,
    *,
    batch_size: int,
    epoch: int,
    start_index: int = 0,
    rank: int = 0,
    world_size: int = 1,
) -> Iterator[Batch]:
    """Yield this rank's packed batches of `plan` (the rows of `epoch`) from row `start_index`
    on (a saved :attr:`Batch.next_index`); see the module docstring."""
    if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
        msg = (
            f"need batch_size >= 1 and 0 <= rank < world_size; got batch_size={batch_size}, "
            f"rank={rank}, world_size={world_size}"
        )
        raise ValueError(msg)
    global_batch = batch_size * world_size
    index = start_index
    while index + global_batch <= len(plan.rows):
        mine = plan.rows[index + rank * batch_size : index + (rank + 1) * batch_size]
        index += global_batch
        yield collate_packed(
            dataset.examples, mine, plan.seq_len, dataset.pad_token_id, epoch, index
        )


def collate_packed(
    examples: Sequence[TokenizedExample],
    rows: Sequence[PackedRow],
    seq_len: int,
    pad: int,
    epoch: int,
    next_index: int,
) -> Batch:
    """The :class:`Batch` of packed `rows`: each row's documents' ids and loss masks end to end
    (the first ``n`` tokens of each), the filler after them pad ids with attention 0, loss 0
    and document -1."""
    shape = (len(rows), seq_len)
    ids = torch.full(shape, pad, dtype=torch.long)
    attention = torch.zeros(shape, dtype=torch.long)
    loss = torch.zeros(shape, dtype=torch.long)
    documents = torch.full(shape, -1, dtype=torch.long)
    for r, row in enumerate(rows):
        for number, ((index, n), (start, end)) in enumerate(
            zip(row.documents, document_bounds(row), strict=True)
        ):
            example = examples[index]
            ids[r, start:end] = torch.tensor(example.input_ids[:n], dtype=torch.long)
            loss[r, start:end] = torch.tensor(example.loss_mask[:n], dtype=torch.long)
            attention[r, start:end] = 1
            documents[r, start:end] = number
    return Batch(ids, attention, loss, epoch, next_index, document_ids=documents)
