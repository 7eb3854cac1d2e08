"""Building a tokenized-data cache entry: stream the input, tokenize in parallel, write arrays.

The input is read as a stream and cut into chunks of :data:`CHUNK` usable conversations. With
``num_proc > 1`` (and more than :data:`INLINE_LIMIT` conversations, below which starting the
processes costs more than it saves) the chunks go to a ``spawn`` process pool, at most two per
process in flight, so memory stays bounded; results are written in input order, so the entry is
byte-identical to the one a single process writes. Each worker gets a copy of the tokenizer
and the settings once, when it starts.

The entry is written into a staging folder and published by a rename (crash-safe; see
:mod:`~dflash_recipes.executor.data.token_cache`).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import json
import logging
import multiprocessing
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

import numpy as np
from transformers import PreTrainedTokenizerBase

from dflash_recipes.data.conversations import (
    Conversation,
    SkippedLine,
    iter_conversations,
    no_usable_conversation,
)
from dflash_recipes.data.sources import DataSource
from dflash_recipes.errors import DataError, DirectoryLockedError
from dflash_recipes.executor.data.token_cache import (
    ARRAYS,
    DEFAULT_WAIT_S,
    LOCK_NAME,
    META_FILE,
    WAIT_ENV,
    CachedExamples,
    TokenizeSettings,
    cache_key,
    entry_name,
    entry_problem,
    meta_record,
    read_stats,
)
from dflash_recipes.executor.data.tokenize import (
    DatasetStats,
    UnrenderablePart,
    opens_a_block,
    tokenize_to_arrays,
)
from dflash_recipes.files.crashsafe import remove_stale_staging, staged_directory
from dflash_recipes.files.locking import hold_directory_lock

logger = logging.getLogger(__name__)

#: Conversations per unit of work sent to a process.
CHUNK = 256
#: Up to this many conversations are tokenized in this process whatever num_proc says.
INLINE_LIMIT = 4096
_INT32_MAX = 2**31 - 1

#: One conversation as it travels to a worker (its line, messages and tools).
RawConversation = Conversation


class ChunkResult:
    """The tokenized examples of one chunk, as flat arrays, and the conversations it skipped."""

    __slots__ = ("ids", "lengths", "mask", "skipped", "truncated")

    def __init__(
        self,
        ids: np.ndarray,
        mask: np.ndarray,
        lengths: np.ndarray,
        truncated: np.ndarray,
        skipped: list[tuple[int, str, str]],
    ) -> None:
        self.ids, self.mask, self.lengths, self.truncated = ids, mask, lengths, truncated
        self.skipped = skipped

    def __reduce__(self) -> tuple[object, ...]:
        return (ChunkResult, (self.ids, self.mask, self.lengths, self.truncated, self.skipped))


def tokenize_chunk(
    tokenizer: PreTrainedTokenizerBase, settings: TokenizeSettings, chunk: list[RawConversation]
) -> ChunkResult:
    """Tokenize, mask and check (the block-opening rule) each conversation of `chunk`.

    A conversation the template cannot render is skipped with its reason, or, with
    ``unrenderable_rows`` "error", stops the build with a DataError naming its line."""
    ids: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    lengths: list[int] = []
    truncated: list[bool] = []
    skipped: list[tuple[int, str, str]] = []
    for conversation in chunk:
        line = conversation.line
        try:
            example_ids, mask, cut = tokenize_to_arrays(
                tokenizer,
                conversation.messages,
                chat_template=settings.chat_template,
                answer_only_loss=settings.answer_only_loss,
                max_len=settings.max_len,
                tools=conversation.tools,
                supervise=settings.supervise,
            )
        except DataError as exc:
            kind = "unrenderable part" if isinstance(exc, UnrenderablePart) else "template error"
            if settings.unrenderable_rows == "error":
                msg = f"data row {line} ({kind}, data.unrenderable_rows: error): {exc}"
                if "data.unrenderable_rows: skip" not in msg:
                    msg += (
                        "; fix the row or the template (data.chat_template), or set "
                        "data.unrenderable_rows: skip to leave such rows out (counted)"
                    )
                raise DataError(msg) from None
            skipped.append((line, kind, str(exc)))
            continue
        if not opens_a_block(mask, settings.block_size):
            reason = (
                f"no block of {settings.block_size} tokens starts on two supervised tokens "
                f"within training_seq_len={settings.max_len} ({len(example_ids)} tokens, "
                f"{int(mask.sum())} supervised)"
            )
            skipped.append((line, "nothing to supervise", reason))
            continue
        ids.append(example_ids)
        masks.append(mask)
        lengths.append(len(example_ids))
        truncated.append(cut)
    id_array = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
    if id_array.size and (id_array.min() < 0 or id_array.max() > _INT32_MAX):
        msg = "the tokenizer produced a token id outside int32; the cache cannot store it"
        raise DataError(msg)
    return ChunkResult(
        id_array.astype(np.int32),
        np.concatenate(masks) if masks else np.zeros(0, dtype=np.uint8),
        np.asarray(lengths, dtype=np.int64),
        np.asarray(truncated, dtype=np.uint8),
        skipped,
    )


# The worker side of the pool: set once per process by the initializer.
_worker_state: tuple[PreTrainedTokenizerBase, TokenizeSettings] | None = None


def _init_worker(tokenizer: PreTrainedTokenizerBase, settings: TokenizeSettings) -> None:
    global _worker_state
    _worker_state = (tokenizer, settings)


def _work(chunk: list[RawConversation]) -> ChunkResult:
    assert _worker_state is not None, "the pool initializer did not run"
    return tokenize_chunk(_worker_state[0], _worker_state[1], chunk)


def default_num_proc() -> int:
    """The cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def chunk_stream(
    source: DataSource, answer_only_loss: bool, skipped: list[SkippedLine]
) -> Iterator[list[RawConversation]]:
    chunk: list[RawConversation] = []
    for item in iter_conversations(source, answer_only_loss=answer_only_loss):
        if not isinstance(item, Conversation):
            skipped.append(item)
            continue
        chunk.append(item)
        if len(chunk) == CHUNK:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def chunk_results(
    chunks: Iterator[list[RawConversation]],
    tokenizer: PreTrainedTokenizerBase,
    settings: TokenizeSettings,
    num_proc: int,
) -> Iterator[ChunkResult]:
    """Each chunk's result, in order: here, or in a pool once the input proves large."""
    head = list(itertools.islice(chunks, INLINE_LIMIT // CHUNK + 1))
    if num_proc <= 1 or len(head) * CHUNK <= INLINE_LIMIT:
        for chunk in itertools.chain(head, chunks):
            yield tokenize_chunk(tokenizer, settings, chunk)
        return
    context = multiprocessing.get_context("spawn")
    with context.Pool(num_proc, initializer=_init_worker, initargs=(tokenizer, settings)) as pool:
        pending: collections.deque[multiprocessing.pool.AsyncResult[ChunkResult]]
        pending = collections.deque()
        for chunk in itertools.chain(head, chunks):
            pending.append(pool.apply_async(_work, (chunk,)))
            if len(pending) >= 2 * num_proc:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _write(handle: IO[bytes], digest: hashlib._Hash, array: np.ndarray) -> None:
    data = array.tobytes()
    handle.write(data)
    digest.update(data)


def write_entry(
    staging: Path,
    results: Iterable[ChunkResult],
    skipped: list[SkippedLine],
    source: DataSource,
    key: dict[str, object],
) -> DatasetStats:
    """Write `results`, in order, as a cache entry's arrays and meta.json into `staging`.

    `skipped` holds the conversations skipped while reading (it may still grow while `results`
    is consumed); the chunks' own skips join it. Raises DataError when no example is usable.
    """
    handles = {name: (staging / name).open("wb") for name, _ in ARRAYS}
    digests = {name: hashlib.sha256() for name, _ in ARRAYS}
    used = tokens = supervised = truncated = 0
    try:
        _write(handles["offsets.bin"], digests["offsets.bin"], np.zeros(1, np.int64))
        for result in results:
            _write(handles["input_ids.bin"], digests["input_ids.bin"], result.ids)
            _write(handles["loss_mask.bin"], digests["loss_mask.bin"], result.mask)
            ends = tokens + np.cumsum(result.lengths, dtype=np.int64)
            _write(handles["offsets.bin"], digests["offsets.bin"], ends)
            _write(handles["truncated.bin"], digests["truncated.bin"], result.truncated)
            used += len(result.lengths)
            tokens += int(result.lengths.sum())
            supervised += int(result.mask.sum(dtype=np.int64))
            truncated += int(result.truncated.sum(dtype=np.int64))
            skipped.extend(SkippedLine(*item) for item in result.skipped)
    finally:
        for handle in handles.values():
            handle.close()
    skipped.sort(key=lambda item: item.line)
    if used == 0:
        raise no_usable_conversation(source.path, skipped)
    stats = DatasetStats(used, tuple(skipped), tokens, supervised, truncated)
    checksums = {name: digest.hexdigest() for name, digest in digests.items()}
    meta = meta_record(key, stats, checksums, source.path)
    (staging / META_FILE).write_text(json.dumps(meta), encoding="utf-8")
    return stats


def build_entry(
    source: DataSource,
    tokenizer: PreTrainedTokenizerBase,
    settings: TokenizeSettings,
    key: dict[str, object],
    directory: Path,
    *,
    num_proc: int,
) -> DatasetStats:
    """Tokenize `source` into a new cache entry at `directory`; its stats.

    Raises DataError (and leaves nothing behind) when no conversation is usable.
    """
    started = time.perf_counter()
    skipped: list[SkippedLine] = []
    with staged_directory(directory) as staging:
        chunks = chunk_stream(source, settings.answer_only_loss, skipped)
        results = chunk_results(chunks, tokenizer, settings, num_proc)
        stats = write_entry(staging, results, skipped, source, key)
    log_build(source, directory, stats, started, processes=num_proc)
    return stats


def log_build(
    source: DataSource,
    directory: Path,
    stats: DatasetStats,
    started: float,
    *,
    processes: int,
    ranks: int = 1,
) -> None:
    """The log line of a finished build: by `processes` processes, or by `ranks` ranks of a
    job, a slice each, each with `processes` processes."""
    how = f"{processes} process" + ("es" if processes != 1 else "")
    if ranks > 1:
        how = f"{ranks} ranks, a slice each, {how}"
    logger.info(
        "tokenized %s into %s: %d conversations in %.1f s (%s)",
        source.path, directory, stats.conversations_used, time.perf_counter() - started, how,
    )  # fmt: skip


def tokenize_all(
    conversations: Iterable[Conversation],
    tokenizer: PreTrainedTokenizerBase,
    settings: TokenizeSettings,
) -> ChunkResult:
    """Tokenize conversations in this process, as one chunk (for tests and the benchmark)."""
    return tokenize_chunk(tokenizer, settings, list(conversations))


def wait_seconds() -> float:
    """How long to wait for another builder: DFLASH_DATA_CACHE_WAIT_S, else the default."""
    raw = os.environ.get(WAIT_ENV)
    if raw is None:
        return DEFAULT_WAIT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        msg = f"{WAIT_ENV}={raw!r} is not a number of seconds >= 0; unset it or fix it"
        raise DataError(msg)
    return value


@contextlib.contextmanager
def removed_on_data_error(cache_dir: Path) -> Iterator[None]:
    """Unusable data leaves nothing behind: on a DataError in the block, remove the folders of
    `cache_dir`'s path that did not exist when it began (the run's output directory among
    them, made by taking the lock), after what the block held is released. The error is the
    same on every rank, so no other builder is left waiting on that lock."""
    created = first_missing(cache_dir)
    try:
        yield
    except DataError:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise


def first_missing(directory: Path) -> Path | None:
    """The outermost folder of `directory`'s path that does not exist yet (None: it exists)."""
    missing = None
    for folder in (directory, *directory.parents):
        if folder.exists():
            break
        missing = folder
    return missing


def clear_for_build(directory: Path, problem: str, source: DataSource) -> None:
    """Under the lock, before building `directory`: remove what killed builders left and an
    entry that is not used (`problem`, other than "absent"), with a warning that says why."""
    remove_stale_staging(directory)
    if problem != "absent":
        logger.warning(
            "data cache %s is not used: %s; tokenizing %s again", directory, problem, source.path
        )
        shutil.rmtree(directory, ignore_errors=True)


def unwritable_cache(cache_dir: Path, exc: OSError) -> DataError:
    """The error of a cache folder that cannot be written (no permission, a full disk)."""
    msg = (
        f"cannot write the tokenized data cache in {cache_dir}: {exc.strerror or exc}; "
        "set data.cache_dir to a writable folder with free space"
    )
    return DataError(msg)


def prepared_examples(
    source: DataSource,
    tokenizer: PreTrainedTokenizerBase,
    settings: TokenizeSettings,
    *,
    cache_dir: Path,
    num_proc: int,
    wait_s: float | None = None,
    data_sha256: str | None = None,
) -> tuple[CachedExamples, DatasetStats, bool]:
    """The input's examples from the cache, built first when needed: (examples, stats, built).

    Raises DataError when nothing is usable (nothing is cached then), when the cache folder
    cannot be written, or when another process holds the build for longer than `wait_s`.
    `data_sha256`: the input's content hash when rank 0 computed it for this job.
    """
    key = cache_key(source, tokenizer, settings, data_sha256=data_sha256)
    directory = cache_dir / entry_name(key)
    problem, meta = entry_problem(directory, key)
    if problem is None:
        return CachedExamples(directory), read_stats(meta), False
    wait = wait_seconds() if wait_s is None else wait_s
    lock = hold_directory_lock(
        cache_dir, purpose="data tokenization", lock_name=LOCK_NAME, wait_s=wait
    )
    try:
        with removed_on_data_error(cache_dir), lock:
            problem, meta = entry_problem(directory, key)  # another process may have built it
            if problem is None:
                return CachedExamples(directory), read_stats(meta), False
            clear_for_build(directory, problem, source)
            stats = build_entry(source, tokenizer, settings, key, directory, num_proc=num_proc)
    except DirectoryLockedError as exc:
        msg = (
            f"waited {wait:.0f} s for the tokenized data cache in {cache_dir}: {exc}; if that "
            f"process is stuck, stop it (its lock is released when it exits) and rerun, or set "
            f"{WAIT_ENV} to wait longer"
        )
        raise DataError(msg) from None
    except OSError as exc:
        raise unwritable_cache(cache_dir, exc) from None
    # Not verified again: this process wrote every byte under the lock and hashed it while
    # writing (meta.json's checksums, for the next start).
    return CachedExamples(directory), stats, True


__all__ = [
    "CHUNK",
    "INLINE_LIMIT",
    "ChunkResult",
    "build_entry",
    "chunk_results",
    "chunk_stream",
    "clear_for_build",
    "default_num_proc",
    "first_missing",
    "log_build",
    "prepared_examples",
    "removed_on_data_error",
    "tokenize_all",
    "tokenize_chunk",
    "unwritable_cache",
    "wait_seconds",
    "write_entry",
]
