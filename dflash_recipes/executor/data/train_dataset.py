"""The training dataset of a plan: its input -> cached, tokenized examples -> seeded batches.

Reading conversations (formats, columns, skipped rows) is torch-free and lives in
:mod:`dflash_recipes.data.conversations`; tokenizing and masking in
:mod:`~dflash_recipes.executor.data.tokenize`; the tokenize-once cache (read in place, shared by
the ranks, keyed by a fingerprint of everything that changes tokens) in
:mod:`~dflash_recipes.executor.data.token_cache`. This module puts them together for a plan
(:func:`build_dataset`, a :class:`TrainDataset`) and batches the result (:func:`batches`).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

import attrs
import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from dflash_recipes.data.conversations import summarize
from dflash_recipes.data.sources import DataSource, content_sha256, resolve_source
from dflash_recipes.errors import DataError
from dflash_recipes.executor.collectives import broadcast_digest
from dflash_recipes.executor.coordination import wait_for_rank0
from dflash_recipes.executor.data.token_build import default_num_proc, prepared_examples
from dflash_recipes.executor.data.token_cache import TokenizeSettings
from dflash_recipes.executor.data.token_shared import shared_prepared_examples
from dflash_recipes.executor.data.tokenize import (
    DatasetStats,
    TokenizedExample,
    read_chat_template,
    resolve_template,
)
from dflash_recipes.executor.dist_env import DistEnv
from dflash_recipes.files.data_cache import (
    default_data_cache_dir,
    describe_entry,
    variable_not_used,
)
from dflash_recipes.files.run_dir import DATA_CACHE_DIR
from dflash_recipes.plan.run_plan import RunPlan
from dflash_recipes.records import Record

logger = logging.getLogger(__name__)


@attrs.frozen(repr=False, eq=False, slots=False)
class TrainDataset(Record):
    """Tokenized examples plus the pad id batches use and the stats of how they were made."""

    #: A tuple, or the examples of the cache (read from its files on access).
    examples: Sequence[TokenizedExample]
    pad_token_id: int
    stats: DatasetStats
    source: Path

    def __len__(self) -> int:
        return len(self.examples)

    @property
    def summary(self) -> str:
        """The reading summary plus token counts, e.g. for the run log."""
        s = self.stats
        return (
            f"{self.source}: {summarize(s.conversations_used, s.skipped)}; "
            f"{s.num_tokens} tokens, {s.num_supervised_tokens} supervised, "
            f"{s.num_truncated} truncated"
        )


def build_dataset(
    plan: RunPlan,
    tokenizer: PreTrainedTokenizerBase,
    *,
    split: Literal["train", "eval"] = "train",
    env: DistEnv | None = None,
) -> TrainDataset:
    """The plan's data (`data.data_path`, or `data.eval_data_path`), tokenized and masked.

    Tokenized once into the cache (`data.cache_dir`, by default the per-user cache folder of
    :func:`~dflash_recipes.files.data_cache.default_data_cache_dir`, shared by every run) with
    `data.num_proc` processes, then read in place; see
    :mod:`~dflash_recipes.executor.data.token_cache`. Conversations that cannot open a single
    block (``draft.block_size`` tokens starting on two consecutive supervised tokens within
    ``training.training_seq_len``) are skipped with a reason. Raises DataError when nothing
    usable remains, quoting the first reasons. Under torchrun (`env` of a joined process
    group) rank 0 alone reads the input to hash it (the cache key) and sends the hash to the
    other ranks, which wait for it; a build is then shared, each rank tokenizing a slice (see
    :mod:`~dflash_recipes.executor.data.token_shared`). A rank that waits for rank 0's work
    alone (the hash, starting and merging the build) longer than
    ``training.distributed_timeout_s`` stops with a
    :class:`~dflash_recipes.errors.RanksOutOfStepError` naming rank 0 and that work.
    """
    data = plan.data
    raw_path = data.data_path if split == "train" else data.eval_data_path
    field = "data.data_path" if split == "train" else "data.eval_data_path"
    if raw_path is None:
        msg = f"{field} is not set; point it at a JSONL file of conversations"
        raise DataError(msg)
    path = Path(raw_path)
    source = resolve_source(path, setting=field)
    template = resolve_template(tokenizer, read_chat_template(data.chat_template))
    settings = TokenizeSettings(
        chat_template=template,
        answer_only_loss=data.answer_only_loss,
        max_len=plan.training.training_seq_len,
        block_size=plan.draft.block_size,
        supervise=data.supervise,
        unrenderable_rows=data.unrenderable_rows,
    )
    # compile decided it; a plan without one (made by hand) takes the same default
    cache_dir = data.cache_dir or str(
        default_data_cache_dir() or Path(plan.training.output_dir) / DATA_CACHE_DIR
    )
    ignored = variable_not_used(data.cache_dir)  # the plan's folder wins: say so, once
    if ignored is not None and split == "train" and (env is None or env.rank == 0):
        logger.warning("%s", ignored)
    num_proc = data.num_proc or default_num_proc()
    if env is not None and env.is_distributed:
        timeout_s = plan.training.distributed_timeout_s
        examples, stats, built = shared_prepared_examples(
            source, tokenizer, settings, cache_dir=Path(cache_dir), num_proc=num_proc, env=env,
            data_sha256=_shared_input_sha256(source, env, timeout_s), timeout_s=timeout_s,
        )  # fmt: skip
    else:
        examples, stats, built = prepared_examples(
            source, tokenizer, settings, cache_dir=Path(cache_dir), num_proc=num_proc
        )
    logger.info("%s", describe_entry(examples.directory, built=built))
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    return TrainDataset(examples, int(pad), stats, path)


def _shared_input_sha256(source: DataSource, env: DistEnv, timeout_s: float | None) -> str:
    """The input's content hash, computed by rank 0 alone and sent to the other ranks of a
    distributed `env`, which wait for it up to `timeout_s` (then a RanksOutOfStepError). A
    rank 0 that cannot read the input stops every rank with a DataError instead of leaving
    them waiting."""
    digest = problem = None
    if env.rank == 0:
        try:
            digest = content_sha256(source)
        except DataError as exc:
            problem = exc
    what = f"hash the data {source.path} (the key of the tokenized-data cache)"
    wait_for_rank0(env, what, timeout_s=timeout_s)
    shared = broadcast_digest(digest, env)
    if problem is not None:
        raise problem
    if shared is None:
        msg = f"rank 0 could not read the data {source.path}; its error says why"
        raise DataError(msg)
    return shared


@attrs.frozen(eq=False)
class Batch:
    """Right-padded LongTensors ``[B, T]`` (T = longest example) and where the data stands.

    A packed batch (``data.packing``, :mod:`~dflash_recipes.executor.data.packing`) has rows of
    exactly ``training_seq_len`` tokens holding several whole conversations, `document_ids`
    saying which, and `next_index` counting rows of the epoch's packing plan.
    """

    input_ids: Tensor
    attention_mask: Tensor
    loss_mask: Tensor
    epoch: int
    #: Index into the epoch's order (packed: its rows) just after this (global) batch: save it
    #: to resume.
    next_index: int
    #: Packed rows: ``[B, T]`` long, per token its document's number within the row (0, 1,
    #: ...), -1 for the filler after the last document (attention 0 there); None unpacked.
    document_ids: Tensor | None = None

    def to(self, device: torch.device, *, non_blocking: bool = False) -> Batch:
        """The same batch with its tensors on `device` (`non_blocking`: an asynchronous copy
        when the tensors are pinned)."""
        docs = self.document_ids
        return attrs.evolve(
            self,
            input_ids=self.input_ids.to(device, non_blocking=non_blocking),
            attention_mask=self.attention_mask.to(device, non_blocking=non_blocking),
            loss_mask=self.loss_mask.to(device, non_blocking=non_blocking),
            document_ids=None if docs is None else docs.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> Batch:
        """The same batch in pinned host memory (for asynchronous copies; CUDA only)."""
        return attrs.evolve(
            self,
            input_ids=self.input_ids.pin_memory(),
            attention_mask=self.attention_mask.pin_memory(),
            loss_mask=self.loss_mask.pin_memory(),
            document_ids=None if self.document_ids is None else self.document_ids.pin_memory(),
        )


def epoch_order(num_examples: int, *, seed: int, epoch: int) -> list[int]:
    """The deterministic shuffled order of example indices for `epoch` (same in every process)."""
    order = list(range(num_examples))
    random.Random(f"dflash-data:{seed}:{epoch}").shuffle(order)
    return order


def batches_per_epoch(
    num_examples: int, *, batch_size: int, world_size: int = 1, drop_last: bool = False
) -> int:
    """How many batches :func:`batches` yields per epoch (per process)."""
    global_batch = batch_size * world_size
    if drop_last or world_size > 1:
        return num_examples // global_batch
    return -(-num_examples // global_batch)


def batches(
    dataset: TrainDataset,
    *,
    batch_size: int,
    seed: int,
    epoch: int,
    start_index: int = 0,
    rank: int = 0,
    world_size: int = 1,
    drop_last: bool = False,
) -> Iterator[Batch]:
    """Yield the batches of one epoch in a seeded order, starting at `start_index`.

    The order depends only on (seed, epoch). A global batch is ``batch_size * world_size``
    consecutive examples of that order; process `rank` gets its ``batch_size`` slice. Resume by
    passing a saved :attr:`Batch.next_index` as `start_index`. The last, smaller batch is
    yielded on one process unless `drop_last`; with several processes an incomplete global
    batch is always dropped (every process must take the same number of steps).
    """
    if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
        msg = (
            f"need batch_size >= 1 and 0 <= rank < world_size; got batch_size={batch_size}, "
            f"rank={rank}, world_size={world_size}"
        )
        raise ValueError(msg)
    order = epoch_order(len(dataset), seed=seed, epoch=epoch)
    global_batch = batch_size * world_size
    keep_partial = world_size == 1 and not drop_last
    index = start_index
    while index < len(order):
        chunk = order[index : index + global_batch]
        if len(chunk) < global_batch and not keep_partial:
            return
        mine = chunk[rank * batch_size : (rank + 1) * batch_size]
        index += len(chunk)
        yield _collate([dataset.examples[i] for i in mine], dataset.pad_token_id, epoch, index)


def _collate(examples: Sequence[TokenizedExample], pad: int, epoch: int, next_index: int) -> Batch:
    longest = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), longest), pad, dtype=torch.long)
    attention = torch.zeros((len(examples), longest), dtype=torch.long)
    loss = torch.zeros((len(examples), longest), dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        ids[row, :n] = torch.tensor(example.input_ids, dtype=torch.long)
        attention[row, :n] = 1
        loss[row, :n] = torch.tensor(example.loss_mask, dtype=torch.long)
    return Batch(ids, attention, loss, epoch, next_index)


__all__ = [
    "Batch",
    "TrainDataset",
    "batches",
    "batches_per_epoch",
    "build_dataset",
    "epoch_order",
]
