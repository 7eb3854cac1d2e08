"""A held-out slice of the training data (``data.eval_holdout``): which conversations, the
training examples without them, and the held-out conversations themselves.

The slice is chosen among the dataset's *usable* examples (those the tokenized-data cache
holds) by a generator seeded with ``training.seed`` alone, so every start, every resume and
every world size hold out the same conversations, and the cache entry stays the one every run
of the same data shares (nothing is tokenized again for a slice). Training reads the other
examples (:class:`TrainingExamples`, a view: nothing is copied); the held-out measurement
renders the held-out conversations' prompts from the input itself
(:func:`held_out_conversations`), as it does for ``data.eval_data_path``, so a slice and a
file of the same conversations give the same prompts.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import overload

import attrs
from transformers import PreTrainedTokenizerBase

from dflash_recipes.data.conversations import Conversation, iter_conversations
from dflash_recipes.data.sources import resolve_source
from dflash_recipes.errors import DataError
from dflash_recipes.executor.data.packing import example_lengths
from dflash_recipes.executor.data.tokenize import DatasetStats, TokenizedExample
from dflash_recipes.executor.data.train_dataset import TrainDataset, build_dataset
from dflash_recipes.plan.run_plan import RunPlan


def held_out_indices(num_examples: int, count: int, *, seed: int) -> tuple[int, ...]:
    """The indices (ascending) of the `count` examples held out of `num_examples`.

    DataError when fewer than one example would be left to train on.
    """
    if count >= num_examples:
        msg = (
            f"data.eval_holdout is {count} but the data has {num_examples} usable "
            f"conversation(s), so nothing would be left to train on; lower data.eval_holdout "
            f"(at most {max(num_examples - 1, 0)}) or add data"
        )
        raise DataError(msg)
    chosen = random.Random(f"dflash-holdout:{seed}").sample(range(num_examples), count)
    return tuple(sorted(chosen))


class TrainingExamples(Sequence[TokenizedExample]):
    """The examples of a dataset less the held-out ones, in their order (a view)."""

    def __init__(self, examples: Sequence[TokenizedExample], held_out: Sequence[int]) -> None:
        self._examples = examples
        self._held_out = sorted(held_out)
        self._count = len(examples) - len(self._held_out)

    def __len__(self) -> int:
        return self._count

    def lengths(self) -> list[int]:
        """The token count of every training example (the whole dataset's, less the held-out
        ones: from the cache's offsets when it has them)."""
        held = set(self._held_out)
        whole = example_lengths(self._examples)
        return [n for i, n in enumerate(whole) if i not in held]

    def underlying(self, index: int) -> int:
        """The index in the whole dataset of training example `index`."""
        if index < 0:
            index += self._count
        if not 0 <= index < self._count:
            msg = f"example {index} out of range ({self._count} training examples)"
            raise IndexError(msg)
        # The answer u is the smallest with u - (held-out indices <= u) == index.
        low, high = index, index + len(self._held_out)
        while low < high:
            middle = (low + high) // 2
            if middle - bisect.bisect_right(self._held_out, middle) < index:
                low = middle + 1
            else:
                high = middle
        return low

    @overload
    def __getitem__(self, index: int) -> TokenizedExample: ...

    @overload
    def __getitem__(self, index: slice) -> list[TokenizedExample]: ...

    def __getitem__(self, index: int | slice) -> TokenizedExample | list[TokenizedExample]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return self._examples[self.underlying(index)]

    def __iter__(self) -> Iterator[TokenizedExample]:
        for index in range(len(self)):
            yield self[index]


def held_out_conversations(
    data_path: str,
    stats: DatasetStats,
    indices: Sequence[int],
    *,
    answer_only_loss: bool,
) -> list[Conversation]:
    """The conversations of `data_path` that are examples `indices` of its dataset.

    Example ``i`` is the ``i``-th usable conversation of the input that tokenizing did not
    skip (``stats.skipped`` names every skipped line), so the input is read again up to the
    last held-out one. DataError when the input no longer matches its dataset (edited since).
    """
    wanted = set(indices)
    skipped = {item.line for item in stats.skipped}
    source = resolve_source(Path(data_path), setting="data.data_path")
    found: list[Conversation] = []
    example = 0
    last = max(indices, default=-1)
    for item in iter_conversations(source, answer_only_loss=answer_only_loss):
        if example > last:
            break
        if not isinstance(item, Conversation) or item.line in skipped:
            continue
        if example in wanted:
            found.append(item)
        example += 1
    if len(found) != len(wanted):
        msg = (
            f"{data_path} holds fewer usable conversations than its tokenized data "
            f"({example} read, example {last} held out): the file changed since it was "
            "tokenized; rerun to tokenize it again"
        )
        raise DataError(msg)
    return found


def split_dataset(plan: RunPlan, dataset: TrainDataset) -> tuple[TrainDataset, tuple[int, ...]]:
    """(the training part of `dataset`, the held-out indices) under the plan's
    ``data.eval_holdout`` (the dataset itself and no indices when it is 0)."""
    count = plan.data.eval_holdout
    if count == 0:
        return dataset, ()
    indices = held_out_indices(len(dataset), count, seed=plan.training.seed)
    return attrs.evolve(dataset, examples=TrainingExamples(dataset.examples, indices)), indices


def plan_held_out_conversations(
    plan: RunPlan, tokenizer: PreTrainedTokenizerBase, dataset: TrainDataset | None = None
) -> list[Conversation]:
    """The held-out conversations of the plan's ``data.eval_holdout`` (`dataset`: the whole
    tokenized dataset when the caller has it; otherwise read from the cache, tokenizing the
    data first if no entry holds it)."""
    if plan.data.data_path is None or plan.data.eval_holdout == 0:
        return []
    whole = dataset if dataset is not None else build_dataset(plan, tokenizer)
    _, indices = split_dataset(plan, whole)
    return held_out_conversations(
        plan.data.data_path, whole.stats, indices, answer_only_loss=plan.data.answer_only_loss
    )


__all__ = [
    "TrainingExamples",
    "held_out_conversations",
    "held_out_indices",
    "plan_held_out_conversations",
    "split_dataset",
]
