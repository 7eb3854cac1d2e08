"""Under torchrun: one build of the tokenized-data cache per job, each rank tokenizing a slice.

Every rank knows the input's hash (rank 0 computed it; see
:func:`~dflash_recipes.executor.data.train_dataset.build_dataset`). When any rank finds no valid
entry, the ranks build it together:

1. Rank 0 takes the cache's lock *without waiting*, checks the entry again, makes the staging
   folder of the entry and tells the other ranks its name.
2. Every rank checks that its own cache folder holds that folder (the ranks share the cache
   folder: the same path on a file system they share).
3. The input's rows are cut into blocks of
   :data:`~dflash_recipes.executor.data.token_build.CHUNK` rows. Rank ``r`` of ``W`` parses and
   tokenizes blocks ``r, r + W, r + 2W, ...`` (it skips over the other rows without parsing
   them) into its part folder there, with ``data.num_proc // LOCAL_WORLD_SIZE`` processes (at
   least one: its own). ``data.num_proc`` is so the processes of a node, in all.
4. Rank 0 interleaves the parts back into input order, writing the entry exactly as one process
   writes it (byte-identical files), publishes it by a rename and releases the lock; every rank
   then reads the entry.

A slice that fails (a DataError, a full disk) stops every rank with a DataError: the failing
rank's own, and on the others one naming that rank. Rank 0 removes the staging folder.

The other ranks wait for rank 0's solitary work (step 1, and the merge of step 4) as
:func:`~dflash_recipes.executor.coordination.rank0_text` waits: a rank that waits longer than
`timeout_s` (``training.distributed_timeout_s``) stops with a
:class:`~dflash_recipes.errors.RanksOutOfStepError` naming rank 0 and that work, not the
backend's bare timeout.

The ranks fall back to the one-builder protocol of
:func:`~dflash_recipes.executor.data.token_build.prepared_examples` (each rank takes the lock of
its own cache folder; the first builds the whole entry, the others wait for it up to
``DFLASH_DATA_CACHE_WAIT_S``) when another job holds the lock (rank 0 never waits for a lock
while the others wait for it in a collective: their wait's time limit would end the job), when
rank 0 finds the entry valid that another rank does not, and when a rank does not find rank 0's
staging folder in its cache folder (node-local disks).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO

import numpy as np
from transformers import PreTrainedTokenizerBase

from dflash_recipes.data.conversations import SkippedLine, conversation_of
from dflash_recipes.data.sources import DataSource, iter_rows
from dflash_recipes.errors import DataError, DirectoryLockedError
from dflash_recipes.executor.collectives import first_rank_where
from dflash_recipes.executor.coordination import rank0_text
from dflash_recipes.executor.data.token_build import (
    CHUNK,
    ChunkResult,
    RawConversation,
    chunk_results,
    clear_for_build,
    log_build,
    prepared_examples,
    removed_on_data_error,
    unwritable_cache,
    write_entry,
)
from dflash_recipes.executor.data.token_cache import (
    LOCK_NAME,
    CachedExamples,
    TokenizeSettings,
    cache_key,
    entry_name,
    entry_problem,
    read_stats,
)
from dflash_recipes.executor.data.tokenize import DatasetStats
from dflash_recipes.executor.dist_env import DistEnv
from dflash_recipes.files.crashsafe import publish_directory, staging_name
from dflash_recipes.files.locking import hold_directory_lock

#: A rank's part of the staging folder: its chunks' arrays, one after the other.
_PART_ARRAYS: tuple[tuple[str, type[np.generic]], ...] = (
    ("input_ids.bin", np.int32),
    ("loss_mask.bin", np.uint8),
    ("lengths.bin", np.int64),
    ("truncated.bin", np.uint8),
)
#: Per chunk of a part: (examples, tokens), int64.
_PART_CHUNKS = "chunks.bin"
#: The conversations a part's tokenizing skipped: [[line, kind, reason], ...].
_PART_SKIPPED = "skipped.json"

#: What rank 0 tells the other ranks after step 1: build in a folder, fall back, or stop.
_BUILD, _FALL_BACK, _STOP = "build:", "fall back", "stop:"


def part_name(rank: int) -> str:
    """The folder, inside the staging folder, of rank `rank`'s slice."""
    return f"part-{rank}"


def ranks_on_this_node(env: DistEnv) -> int:
    """LOCAL_WORLD_SIZE (torchrun sets it); the world size when it is absent or not a count."""
    raw = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(raw) if raw.isdigit() and int(raw) >= 1 else env.world_size


def shared_prepared_examples(
    source: DataSource,
    tokenizer: PreTrainedTokenizerBase,
    settings: TokenizeSettings,
    *,
    cache_dir: Path,
    num_proc: int,
    env: DistEnv,
    data_sha256: str | None,
    wait_s: float | None = None,
    timeout_s: float | None = None,
) -> tuple[CachedExamples, DatasetStats, bool]:
    """The input's examples from the cache, built by all ranks together when needed; see the
    module's text. Every rank of `env` must call it. `timeout_s`
    (``training.distributed_timeout_s``): how long a rank waits for rank 0's solitary work
    (None: the backend's default). Returns (examples, stats, built by this call: on rank 0
    only)."""
    key = cache_key(source, tokenizer, settings, data_sha256=data_sha256)
    directory = cache_dir / entry_name(key)
    problem, meta = entry_problem(directory, key)
    if first_rank_where(problem is not None, env) is None:
        return CachedExamples(directory), read_stats(meta), False
    # Rank 0 alone removes what the build created: it alone creates folders here.
    cleanup = removed_on_data_error(cache_dir) if env.rank == 0 else contextlib.nullcontext()
    with cleanup, contextlib.ExitStack() as held:
        answer = None
        if env.rank == 0:
            answer = _start_build(held, cache_dir, directory, key, source)
        what = f"start the build of the tokenized-data cache in {cache_dir}"
        answer = rank0_text(answer, env, what, timeout_s=timeout_s) or ""
        if answer.startswith(_STOP):
            raise DataError(answer[len(_STOP) :])
        if answer.startswith(_BUILD):
            # Each rank looks in its own cache folder: the same folder when it is shared.
            staging = cache_dir / answer[len(_BUILD) :]
            if first_rank_where(not staging.is_dir(), env) is None:
                return _build_together(
                    staging, directory, source, tokenizer, settings, key, num_proc, env,
                    timeout_s=timeout_s,
                )  # fmt: skip
            # Not every rank sees rank 0's folder: each builds in its own cache folder.
    return prepared_examples(
        source, tokenizer, settings, cache_dir=cache_dir, num_proc=num_proc, wait_s=wait_s,
        data_sha256=data_sha256,
    )  # fmt: skip


def _start_build(
    held: contextlib.ExitStack,
    cache_dir: Path,
    directory: Path,
    key: dict[str, object],
    source: DataSource,
) -> str:
    """Rank 0: take the lock (in `held`) and make the staging folder; what to tell the others."""
    try:
        held.enter_context(
            hold_directory_lock(
                cache_dir, purpose="data tokenization", lock_name=LOCK_NAME, wait_s=0.0
            )
        )
    except DirectoryLockedError:
        return _FALL_BACK  # another job builds it: wait for it the one-builder way
    except OSError as exc:
        return _STOP + str(unwritable_cache(cache_dir, exc))
    problem, _ = entry_problem(directory, key)
    if problem is None:
        return _FALL_BACK  # built meanwhile; ranks that still see no entry build their own
    try:
        clear_for_build(directory, problem, source)
        staging = staging_name(directory, uuid.uuid4().hex[:8])
        staging.mkdir()
    except OSError as exc:
        return _STOP + str(unwritable_cache(cache_dir, exc))
    held.callback(shutil.rmtree, staging, True)  # a build that does not publish leaves nothing
    return _BUILD + staging.name


def _build_together(
    staging: Path,
    directory: Path,
    source: DataSource,
    tokenizer: PreTrainedTokenizerBase,
    settings: TokenizeSettings,
    key: dict[str, object],
    num_proc: int,
    env: DistEnv,
    *,
    timeout_s: float | None,
) -> tuple[CachedExamples, DatasetStats, bool]:
    started = time.perf_counter()
    per_rank = max(1, num_proc // ranks_on_this_node(env))
    skipped: list[SkippedLine] = []  # this rank's, while reading
    failure: DataError | None = None
    try:
        blocks = row_blocks(source, settings.answer_only_loss, env.rank, env.world_size, skipped)
        results = chunk_results(blocks, tokenizer, settings, per_rank)
        write_part(staging / part_name(env.rank), results, skipped)
    except DataError as exc:
        failure = exc
    except OSError as exc:
        failure = unwritable_cache(staging.parent, exc)
    failed = first_rank_where(failure is not None, env)
    if failure is not None:
        raise failure
    if failed is not None:
        msg = (
            f"rank {failed} could not tokenize its slice of {source.path}; its error, in its "
            "output, says why"
        )
        raise DataError(msg)
    stats: DatasetStats | None = None
    problem: str | None = None
    if env.rank == 0:
        try:
            every_skip: list[SkippedLine] = []
            merged = merged_results(staging, env.world_size, every_skip)
            stats = write_entry(staging, merged, every_skip, source, key)
            for rank in range(env.world_size):
                shutil.rmtree(staging / part_name(rank))
            publish_directory(staging, directory)
        except DataError as exc:
            problem = str(exc)
        except OSError as exc:
            problem = str(unwritable_cache(staging.parent, exc))
    what = f"merge the ranks' slices into the tokenized-data cache {directory}"
    problem = rank0_text(problem, env, what, timeout_s=timeout_s)
    if problem is not None:
        raise DataError(problem)
    if stats is not None:
        log_build(source, directory, stats, started, processes=per_rank, ranks=env.world_size)
        return CachedExamples(directory), stats, True
    found, meta = entry_problem(directory, key)
    if found is not None:
        msg = f"the data cache {directory} that rank 0 built is not usable here: {found}"
        raise DataError(msg)
    return CachedExamples(directory), read_stats(meta), False


def row_blocks(
    source: DataSource, answer_only_loss: bool, rank: int, world_size: int,
    skipped: list[SkippedLine],
) -> Iterator[list[RawConversation]]:  # fmt: skip
    """The usable conversations of each of rank `rank`'s blocks of rows, in order: blocks of
    :data:`CHUNK` rows, every `world_size`-th from block `rank` (one list per block, empty when
    it has none). Only these rows are parsed; their skipped rows join `skipped`."""
    rows = enumerate(iter_rows(source))
    mine = ((i, row) for i, row in rows if (i // CHUNK) % world_size == rank)
    for _, block in itertools.groupby(mine, key=lambda item: item[0] // CHUNK):
        chunk: list[RawConversation] = []
        for _, (number, row) in block:
            item = conversation_of(number, row, answer_only_loss=answer_only_loss)
            if isinstance(item, SkippedLine):
                skipped.append(item)
            elif item is not None:
                chunk.append(item)
        yield chunk


def write_part(
    part: Path, results: Iterable[ChunkResult], skipped_reading: Sequence[SkippedLine] = ()
) -> None:
    """Write a rank's chunk results, in order, into the new folder `part`, and the rows it
    skipped (`skipped_reading`, read after `results` is consumed, and the chunks' own)."""
    part.mkdir()
    skipped: list[tuple[int, str, str]] = []
    with contextlib.ExitStack() as files:
        handles = {name: files.enter_context((part / name).open("wb")) for name, _ in _PART_ARRAYS}
        table = files.enter_context((part / _PART_CHUNKS).open("wb"))
        for result in results:
            handles["input_ids.bin"].write(result.ids.tobytes())
            handles["loss_mask.bin"].write(result.mask.tobytes())
            handles["lengths.bin"].write(result.lengths.tobytes())
            handles["truncated.bin"].write(result.truncated.tobytes())
            table.write(np.array([len(result.lengths), len(result.ids)], np.int64).tobytes())
            skipped.extend(result.skipped)
    skipped.extend((item.line, item.kind, item.reason) for item in skipped_reading)
    (part / _PART_SKIPPED).write_text(json.dumps(skipped), encoding="utf-8")


def _read(handle: IO[bytes], dtype: type[np.generic], count: int, part: Path) -> np.ndarray:
    size = count * np.dtype(dtype).itemsize
    data = handle.read(size)
    if len(data) != size:
        msg = f"the tokenized slice {part} is cut short; rerun to build the data cache again"
        raise DataError(msg)
    return np.frombuffer(data, dtype=dtype)


def merged_results(
    staging: Path, world_size: int, skipped: list[SkippedLine]
) -> Iterator[ChunkResult]:
    """The chunks of every part, back in input order (chunk i is part i % W's chunk i // W);
    the parts' skipped conversations are added to `skipped`."""
    parts = [staging / part_name(rank) for rank in range(world_size)]
    tables = [np.fromfile(part / _PART_CHUNKS, dtype=np.int64).reshape(-1, 2) for part in parts]
    for part in parts:
        items = json.loads((part / _PART_SKIPPED).read_text(encoding="utf-8"))
        skipped.extend(SkippedLine(*item) for item in items)
    with contextlib.ExitStack() as files:
        handles = [
            {name: files.enter_context((part / name).open("rb")) for name, _ in _PART_ARRAYS}
            for part in parts
        ]
        for index in itertools.count():
            rank, position = index % world_size, index // world_size
            if position >= len(tables[rank]):
                break
            examples, tokens = (int(n) for n in tables[rank][position])
            part, read = parts[rank], handles[rank]
            yield ChunkResult(
                _read(read["input_ids.bin"], np.int32, tokens, part),
                _read(read["loss_mask.bin"], np.uint8, tokens, part),
                _read(read["lengths.bin"], np.int64, examples, part),
                _read(read["truncated.bin"], np.uint8, examples, part),
                [],
            )
    if index != sum(len(table) for table in tables):
        msg = f"the tokenized slices in {staging} do not fit together; rerun to build again"
        raise DataError(msg)


__all__ = [
    "merged_results",
    "part_name",
    "ranks_on_this_node",
    "shared_prepared_examples",
    "write_part",
]
