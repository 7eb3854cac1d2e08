"""The tokenized-data cache: tokenize once, read in place on every later start and on every rank.

A cache entry is a folder ``CACHE_DIR/<name>/`` holding four flat arrays and ``meta.json``:

- ``input_ids.bin`` (int32, every example's ids end to end), ``loss_mask.bin`` (uint8, same
  length), ``offsets.bin`` (int64, examples + 1: example ``i`` is ``offsets[i]:offsets[i+1]``),
  ``truncated.bin`` (uint8, one per example);
- ``meta.json``: the key it was made for, the dataset stats and skip reasons, and the sha256
  of each array file.

**Key.** The folder name hashes the input's content (every byte, so an edit that keeps size and
mtime is noticed) and the settings that change tokens (``answer_only_loss``,
``training_seq_len``, the block size of the block-opening rule). ``meta.json`` adds the
tokenizer (its serialised vocabulary, rules and special tokens), the chat template text and
:data:`CACHE_FORMAT_VERSION`: an entry whose meta differs (another tokenizer, another template,
another version of this code) or does not verify (a missing or edited file) is rebuilt with a
warning that says why. Stale tokens are never used.

**Crash safety.** An entry is built in a hidden staging sibling and renamed into place only
when complete (:func:`~dflash_recipes.files.crashsafe.staged_directory`); a ``kill -9`` leaves
only a staging folder, removed by the next builder. Builders take the cache folder's lock; a
process that finds it held (another rank, another run) waits for the entry instead of building
it again, up to :data:`WAIT_ENV` seconds (default :data:`DEFAULT_WAIT_S`), then stops with a
message naming the holder: one tokenization per job, never a silent hang. Under torchrun the
ranks of a job build an entry together, a slice each
(:mod:`~dflash_recipes.executor.data.token_shared`).

**Memory.** Nothing of an entry is loaded up front: :class:`CachedExamples` reads an example's
bytes when it is used (positional reads through the page cache, which the ranks of a node
share), so resident memory does not grow with the number of conversations, neither while
preparing the data nor over an epoch. Verifying an entry hashes its files with buffered reads
(page cache, not this process's memory).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import overload

import attrs
import numpy as np
from transformers import PreTrainedTokenizerBase

from dflash_recipes.data.conversations import SkippedLine
from dflash_recipes.data.sources import DataSource, content_sha256
from dflash_recipes.errors import DataError
from dflash_recipes.executor.data.tokenize import DatasetStats, TokenizedExample
from dflash_recipes.files.data_cache import CACHE_FORMAT_NAME, LOCK_NAME, META_FILE
from dflash_recipes.files.jsonio import (
    FileReadProblem,
    JsonProblem,
    parse_json,
    read_regular_file,
    shorten,
)
from dflash_recipes.recipe.choices import SUPERVISED_PARTS
from dflash_recipes.records import Record

logger = logging.getLogger(__name__)

#: Bump whenever tokenizing, masking or the block rule changes the tokens a conversation gets.
#: 2: rows with tool turns, tool calls, reasoning and `tools` are tokenized (they were skipped).
CACHE_FORMAT_VERSION = 2
_FORMAT = CACHE_FORMAT_NAME
#: (file name, numpy dtype) of the arrays of an entry.
ARRAYS = (
    ("input_ids.bin", np.int32),
    ("loss_mask.bin", np.uint8),
    ("offsets.bin", np.int64),
    ("truncated.bin", np.uint8),
)
#: How long a process waits for another one building the same cache (seconds).
DEFAULT_WAIT_S = 7200.0
WAIT_ENV = "DFLASH_DATA_CACHE_WAIT_S"
_MAX_META_BYTES = 1 << 30
#: The parts of the key that name an entry's folder.
_NAMED_BY = ("data_sha256", "answer_only_loss", "supervise", "training_seq_len", "block_size")


@attrs.frozen(repr=False, eq=False, slots=False)
class TokenizeSettings(Record):
    """Everything besides the tokenizer and the input that decides an example's tokens."""

    #: The chat template's text (data.chat_template's content, or the tokenizer's own).
    chat_template: str
    answer_only_loss: bool
    #: training.training_seq_len.
    max_len: int
    #: draft.block_size: conversations that cannot open a block are skipped.
    block_size: int
    #: data.supervise: the assistant parts that keep their loss with answer_only_loss.
    supervise: tuple[str, ...] = SUPERVISED_PARTS
    #: data.unrenderable_rows: a row the template cannot render is skipped, or stops the build.
    unrenderable_rows: str = "skip"


def tokenizer_sha256(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 of what decides the tokenizer's ids: its serialised model, rules and specials."""
    digest = hashlib.sha256(type(tokenizer).__name__.encode() + b"\0")
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(backend.to_str().encode("utf-8"))
    else:  # a slow tokenizer: its vocabulary
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode("utf-8"))
    specials = sorted(zip(tokenizer.all_special_tokens, tokenizer.all_special_ids, strict=False))
    digest.update(json.dumps(specials).encode("utf-8"))
    return digest.hexdigest()


def cache_key(
    source: DataSource,
    tokenizer: PreTrainedTokenizerBase,
    settings: TokenizeSettings,
    *,
    data_sha256: str | None = None,
) -> dict[str, object]:
    """The fingerprint an entry is made for (see the module docstring). `data_sha256`: the
    input's :func:`~dflash_recipes.data.sources.content_sha256` when another rank computed
    it for this job; None hashes the input here."""
    return {
        "data_sha256": content_sha256(source) if data_sha256 is None else data_sha256,
        "answer_only_loss": settings.answer_only_loss,
        "supervise": list(settings.supervise),
        "unrenderable_rows": settings.unrenderable_rows,
        "training_seq_len": settings.max_len,
        "block_size": settings.block_size,
        "tokenizer_sha256": tokenizer_sha256(tokenizer),
        "chat_template_sha256": hashlib.sha256(settings.chat_template.encode()).hexdigest(),
        "version": CACHE_FORMAT_VERSION,
    }


def entry_name(key: dict[str, object]) -> str:
    """The folder of an entry: the input's content and the token settings (not the tokenizer,
    template or version: an entry made with others is found, and rebuilt with a warning)."""
    named = {k: key[k] for k in _NAMED_BY}
    return hashlib.sha256(json.dumps(named, sort_keys=True).encode()).hexdigest()[:24]


# ---------------------------------------------------------------------------------------------
# reading an entry
# ---------------------------------------------------------------------------------------------


class CachedExamples(Sequence[TokenizedExample]):
    """The examples of a cache entry, read from its arrays on access.

    Each access reads the example's bytes with positional reads (``os.pread``): they come
    from the operating system's page cache (shared by the ranks of a node, reclaimable), and
    only the example read is held by this process. Nothing is read up front, so opening an
    entry costs the same for 64 or 2 million conversations, and an epoch's reads do not add
    the cache's pages to the process's resident memory as a memory map would.
    """

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self._fds: dict[str, int] = {}
        self._closer = weakref.finalize(self, _close_all, self._fds)
        for name, _ in ARRAYS:
            self._fds[name] = os.open(directory / name, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._count = os.fstat(self._fds["truncated.bin"]).st_size
        #: Tokens the arrays hold: every example's offsets must lie within them.
        self._tokens = os.fstat(self._fds["input_ids.bin"]).st_size // 4
        sizes = {name: os.fstat(fd).st_size for name, fd in self._fds.items()}
        if sizes["offsets.bin"] != 8 * (self._count + 1) or sizes["loss_mask.bin"] != self._tokens:
            self.close()
            raise self._damaged("its arrays do not agree in length")

    def __len__(self) -> int:
        return self._count

    @property
    def directory(self) -> Path:
        """The entry's folder."""
        return self._directory

    def _damaged(self, what: str) -> DataError:
        return DataError(
            f"the tokenized data cache {self._directory} is damaged ({what}); delete that folder "
            "(`dflash-recipe cache rm`) and rerun to tokenize again"
        )

    def _read(self, name: str, dtype: type[np.generic], first: int, count: int) -> np.ndarray:
        size = np.dtype(dtype).itemsize
        data = os.pread(self._fds[name], count * size, first * size)
        if len(data) != count * size:
            msg = (
                f"the tokenized data cache {self._directory} changed while in use ({name} is "
                "shorter than its offsets say); delete that folder and rerun"
            )
            raise DataError(msg)
        return np.frombuffer(data, dtype=dtype)

    @overload
    def __getitem__(self, index: int) -> TokenizedExample: ...

    @overload
    def __getitem__(self, index: slice) -> list[TokenizedExample]: ...

    def __getitem__(self, index: int | slice) -> TokenizedExample | list[TokenizedExample]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            msg = f"example {index} out of range ({len(self)} examples)"
            raise IndexError(msg)
        start, end = (int(v) for v in self._read("offsets.bin", np.int64, index, 2))
        if not 0 <= start <= end <= self._tokens:
            # the index is read, not trusted: a bad offset must not size a read
            raise self._damaged(f"example {index} has offsets {start}:{end}, outside its tokens")
        return TokenizedExample(
            self._read("input_ids.bin", np.int32, start, end - start).tolist(),
            self._read("loss_mask.bin", np.uint8, start, end - start).tolist(),
            bool(self._read("truncated.bin", np.uint8, index, 1)[0]),
        )

    def __iter__(self) -> Iterator[TokenizedExample]:
        for index in range(len(self)):
            yield self[index]

    def lengths(self) -> list[int]:
        """The token count of every example (from the offsets alone, not the tokens)."""
        offsets = self._read("offsets.bin", np.int64, 0, len(self) + 1)
        return np.diff(offsets).tolist()  # type: ignore[no-any-return]

    def __reduce__(self) -> tuple[object, ...]:
        return (CachedExamples, (self._directory,))

    def close(self) -> None:
        """Close the entry's files (also done when the object is collected)."""
        self._closer()


def _close_all(fds: dict[str, int]) -> None:
    for fd in fds.values():
        os.close(fd)
    fds.clear()


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def entry_problem(directory: Path, key: dict[str, object]) -> tuple[str | None, dict[str, object]]:
    """(why the entry cannot be used, or None; its meta). "absent" when there is none."""
    meta_path = directory / META_FILE
    if not directory.is_dir():
        return "absent", {}
    try:
        meta = parse_json(read_regular_file(meta_path, max_bytes=_MAX_META_BYTES))
    except (FileReadProblem, JsonProblem) as exc:
        return f"its {META_FILE} cannot be read ({exc.reason})", {}
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        return f"its {META_FILE} is not a {_FORMAT} file", {}
    found = meta.get("key")
    if not isinstance(found, dict):
        return f"its {META_FILE} has no key", {}
    if found.get("version") != key["version"]:
        return (
            f"it was written by another version of dflash-recipes (cache format "
            f"{shorten(found.get('version'))}, this one writes {key['version']})",
            meta,
        )
    changed = sorted(name for name in key if found.get(name) != key[name])
    if changed:
        what = {"tokenizer_sha256": "the tokenizer", "chat_template_sha256": "the chat template"}
        return "it was made with another " + ", ".join(
            what.get(name, name).removeprefix("the ") for name in changed
        ), meta
    checksums = meta.get("sha256")
    if not isinstance(checksums, dict):
        return f"its {META_FILE} has no checksums", meta
    for name, _ in ARRAYS:
        try:
            if _file_sha256(directory / name) != checksums.get(name):
                return f"{name} does not match its checksum (the file was changed)", meta
        except OSError as exc:
            return f"{name} cannot be read ({exc.strerror or exc})", meta
    try:
        read_stats(meta)
    except (KeyError, TypeError, ValueError, IndexError, AssertionError):
        return f"its {META_FILE} has no readable dataset stats", meta
    return None, meta


def read_stats(meta: dict[str, object]) -> DatasetStats:
    raw = meta["stats"]
    if not isinstance(raw, dict):
        msg = "stats is not an object"
        raise TypeError(msg)
    skipped = tuple(SkippedLine(int(s[0]), str(s[1]), str(s[2])) for s in raw["skipped"])
    return DatasetStats(
        conversations_used=int(raw["conversations_used"]),
        skipped=skipped,
        num_tokens=int(raw["num_tokens"]),
        num_supervised_tokens=int(raw["num_supervised_tokens"]),
        num_truncated=int(raw["num_truncated"]),
    )


def stats_record(stats: DatasetStats) -> dict[str, object]:
    """The stats as meta.json stores them."""
    return {
        "conversations_used": stats.conversations_used,
        "skipped": [[s.line, s.kind, s.reason] for s in stats.skipped],
        "num_tokens": stats.num_tokens,
        "num_supervised_tokens": stats.num_supervised_tokens,
        "num_truncated": stats.num_truncated,
    }


def meta_record(
    key: dict[str, object], stats: DatasetStats, checksums: dict[str, str], source: Path
) -> dict[str, object]:
    """The content of an entry's meta.json."""
    return {
        "format": _FORMAT,
        "key": key,
        "source": str(source),
        "stats": stats_record(stats),
        "sha256": checksums,
    }


__all__ = [
    "ARRAYS",
    "CACHE_FORMAT_VERSION",
    "DEFAULT_WAIT_S",
    "LOCK_NAME",
    "META_FILE",
    "WAIT_ENV",
    "CachedExamples",
    "TokenizeSettings",
    "cache_key",
    "entry_name",
    "entry_problem",
    "meta_record",
    "tokenizer_sha256",
]
