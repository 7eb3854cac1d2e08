"""Where conversations come from: the input formats, their columns and their content hash.

An input (``data.data_path``, ``data.eval_data_path``, ``regenerate --input``, ``eval
--prompts``) is one of

- a JSONL file (``.jsonl``/``.json``/anything else), or a gzipped one (``.gz``);
- a Parquet file (``.parquet``);
- an Arrow file (``.arrow``: the IPC file or stream format);
- a ``datasets`` ``save_to_disk`` folder (``state.json`` naming its Arrow files);
- a folder of Parquet, Arrow or JSONL files (its files, not its subfolders, in name order).

Columns are the same everywhere: ``messages`` (OpenAI roles) or ``conversations`` (ShareGPT
``from``/``value``), plus an optional ``system`` string. Rows are numbered from 1 across the
files of a folder, in that order; a JSONL row is its line number.

Parquet and Arrow are read with pyarrow, imported only when such an input is read (the compile
path stays free of numpy for JSONL). :func:`source_columns` reads the schema alone (Parquet
footer, Arrow schema, ``dataset_info.json``, the first JSONL lines), never the rows.
"""

from __future__ import annotations

import gzip
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Literal, cast

import attrs

from dflash_recipes.errors import DataError
from dflash_recipes.files.jsonio import (
    FileReadProblem,
    JsonProblem,
    parse_json,
    read_regular_file,
    regular_file_problem,
)
from dflash_recipes.records import Record

if TYPE_CHECKING:
    import pyarrow as pa

FileFormat = Literal["jsonl", "jsonl.gz", "parquet", "arrow"]

#: Columns that hold a conversation, in the order they are looked for.
CONVERSATION_COLUMNS = ("messages", "conversations")
#: How many JSONL lines the compile reads to learn the columns, and how many bytes at most.
SCHEMA_LINES = 20
SCHEMA_BYTES = 16 << 20
#: A JSONL line longer than this is skipped by number, unread (a conversation is far shorter).
MAX_LINE_BYTES = 256 << 20
#: Integers in a data line are not used; any Python can convert (4300 digits) is accepted.
DATA_INT_DIGITS = 4000
#: A `datasets` save_to_disk folder is recognised by this file.
DATASET_STATE = "state.json"
_DATASET_DICT = "dataset_dict.json"
_DATASET_INFO = "dataset_info.json"
#: Arrow record batches are read this many rows at a time.
ROWS_PER_BATCH = 1024
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_MAX_JSON_BYTES = 64 << 20
_BOM = b"\xef\xbb\xbf"


@attrs.frozen(repr=False, eq=False, slots=False)
class DataSource(Record):
    """A resolved input: its files in reading order and their format."""

    path: Path
    #: "file", "folder" or "save_to_disk".
    kind: str
    files: tuple[tuple[Path, FileFormat], ...]


def file_format(path: Path) -> FileFormat:
    """The format a file's name says (JSONL when nothing else)."""
    name = path.name.lower()
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(".arrow"):
        return "arrow"
    if name.endswith(".gz"):
        return "jsonl.gz"
    return "jsonl"


_FOLDER_SUFFIXES = (".parquet", ".arrow", ".jsonl", ".jsonl.gz", ".json")


def hub_id_hint(value: str, setting: str) -> str | None:
    """When `value` (a path that does not exist) looks like a Hub dataset id: how to get it."""
    if not _HUB_ID.match(value) or value.lower().endswith(_FOLDER_SUFFIXES):
        return None
    local = f"data/{value.split('/')[1]}"
    return (
        f"download it first: `hf download {value} --repo-type dataset --local-dir {local}`, "
        f"then set {setting} to the folder of one split's files in it (e.g. {local}/data, or a "
        "single .parquet file); nothing is downloaded at run time"
    )


def resolve_source(path: Path, *, setting: str) -> DataSource:
    """The files of the input at `path`; DataError (what, where, the fix) when it is unusable."""
    try:
        is_dir = path.is_dir()
    except (OSError, ValueError):
        is_dir = False
    if not is_dir:
        unreadable = regular_file_problem(path)
        if unreadable is None:
            return DataSource(path, "file", ((path, file_format(path)),))
        what = "does not exist" if unreadable.missing else f"cannot be read: {unreadable.reason}"
        msg = (
            f"data file {path} {what}; set {setting} to a JSONL file (or a Parquet or Arrow "
            "file, a folder of them, or a `datasets` save_to_disk folder)"
        )
        raise DataError(msg)
    if (path / _DATASET_DICT).is_file():
        splits = _dataset_dict_splits(path)
        msg = (
            f"{path} is a `datasets` DatasetDict folder (splits: {', '.join(splits) or '?'}); "
            f"set {setting} to one split's folder, e.g. {path / (splits[0] if splits else 'train')}"
        )
        raise DataError(msg)
    if (path / DATASET_STATE).is_file():
        return DataSource(path, "save_to_disk", _save_to_disk_files(path))
    try:
        children = sorted(path.iterdir())
    except OSError as exc:
        msg = f"data folder {path} cannot be listed: {exc.strerror or exc}; set {setting}"
        raise DataError(msg) from None
    files = tuple(
        (child, file_format(child))
        for child in children
        if not child.name.startswith(".")
        and child.name.lower().endswith(_FOLDER_SUFFIXES)
        and child.is_file()
    )
    if not files:
        msg = (
            f"data folder {path} holds no .parquet, .arrow, .jsonl or .jsonl.gz file; set "
            f"{setting} to the folder that holds them (its subfolders are not read)"
        )
        raise DataError(msg)
    return DataSource(path, "folder", files)


def _read_small_json(path: Path) -> object:
    try:
        return parse_json(read_regular_file(path, max_bytes=_MAX_JSON_BYTES))
    except (FileReadProblem, JsonProblem) as exc:
        msg = f"{path} cannot be read as JSON: {exc.reason}; is the `datasets` folder complete?"
        raise DataError(msg) from None


def _dataset_dict_splits(path: Path) -> list[str]:
    value = _read_small_json(path / _DATASET_DICT)
    splits = value.get("splits") if isinstance(value, dict) else None
    return [str(s) for s in splits] if isinstance(splits, list) else []


def _save_to_disk_files(path: Path) -> tuple[tuple[Path, FileFormat], ...]:
    state = _read_small_json(path / DATASET_STATE)
    entries = state.get("_data_files") if isinstance(state, dict) else None
    names = [e.get("filename") for e in entries if isinstance(e, dict)] if entries else []
    if not names or not all(isinstance(n, str) and "/" not in n for n in names):
        msg = (
            f"{path / DATASET_STATE} lists no Arrow files (_data_files); the `datasets` folder "
            "is incomplete: save it again with Dataset.save_to_disk"
        )
        raise DataError(msg)
    files = tuple((path / str(name), "arrow") for name in names)
    missing = [f.name for f, _ in files if not f.is_file()]
    if missing:
        msg = (
            f"{path} lists Arrow files that are missing: {', '.join(missing[:5])}; the "
            "`datasets` folder is incomplete: save it again with Dataset.save_to_disk"
        )
        raise DataError(msg)
    return files  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# schema (compile) and content hash (cache key)
# ---------------------------------------------------------------------------------------------


def source_columns(source: DataSource) -> tuple[str, ...] | None:
    """The columns of the first file from its schema alone; None when the first JSONL lines
    hold no JSON object with a key to learn them from. DataError when the file cannot be
    read."""
    if source.kind == "save_to_disk":
        info_path = source.path / _DATASET_INFO
        if info_path.is_file():
            info = _read_small_json(info_path)
            features = info.get("features") if isinstance(info, dict) else None
            if isinstance(features, dict):
                return tuple(str(k) for k in features)
    path, fmt = source.files[0]
    if fmt in ("jsonl", "jsonl.gz"):
        return _jsonl_columns(path, fmt)
    return tuple(arrow_schema(path, fmt).names)


def _jsonl_columns(path: Path, fmt: FileFormat) -> tuple[str, ...] | None:
    columns: dict[str, None] = {}
    budget = SCHEMA_BYTES
    try:
        with _open_binary(path, fmt) as handle:
            for _ in range(SCHEMA_LINES):
                line = handle.readline(budget + 1)
                budget -= len(line)
                if not line or budget < 0:
                    break
                try:
                    # the run's own line rules: a line too deep, too large or not JSON says
                    # nothing about the columns (the run skips it by number)
                    record = parse_json(line, max_int_digits=DATA_INT_DIGITS)
                except JsonProblem:
                    continue
                if isinstance(record, dict):
                    columns.update(dict.fromkeys(str(k) for k in record))
    except (OSError, EOFError, gzip.BadGzipFile, zlib.error) as exc:
        msg = f"data file {path} cannot be read: {exc}"
        raise DataError(msg) from None
    # Objects without keys (`{}`) say nothing about the columns: the rows tell at run time.
    return tuple(columns) if columns else None


def arrow_schema(path: Path, fmt: FileFormat) -> pa.Schema:
    """The schema of a Parquet or Arrow file (its footer or header); DataError if unreadable."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if fmt == "parquet":
            schema = pq.read_schema(path)
        else:
            with pa.memory_map(str(path)) as source:
                schema = _open_arrow(source).schema
        # pyarrow decodes a field's name when it is asked for it, not when it reads the schema:
        # a damaged name that is not UTF-8 is found here, not in a caller reading `.names`
        _decode_field_names(schema)
    except UnicodeDecodeError as exc:
        raise _unreadable(path, fmt, exc, what="a column name is not UTF-8") from None
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise _unreadable(path, fmt, exc) from None
    return schema


def _decode_field_names(schema: pa.Schema) -> None:
    """Read every field's name, nested ones included (UnicodeDecodeError when one is not
    UTF-8)."""
    import pyarrow as pa

    pending = list(schema)
    while pending:
        field = pending.pop()
        _ = field.name
        kind = field.type
        if isinstance(kind, pa.StructType):
            pending.extend(kind)
        for child in ("value_field", "key_field", "item_field"):
            if hasattr(kind, child):
                pending.append(getattr(kind, child))


def _unreadable(path: Path, fmt: str, exc: Exception, what: str | None = None) -> DataError:
    name = "a Parquet" if fmt == "parquet" else "an Arrow"
    reason = " ".join(str(exc).split())[:300]
    reason = f"{what}: {reason}" if what else reason
    return DataError(
        f"{path} cannot be read as {name} file ({reason}); the file is truncated or "
        "corrupt: write or download it again"
    )


def _open_arrow(source: pa.MemoryMappedFile) -> pa.ipc.RecordBatchFileReader:
    import pyarrow as pa

    try:
        return pa.ipc.open_file(source)
    except pa.ArrowInvalid:
        source.seek(0)
        return pa.ipc.open_stream(source)


def content_sha256(source: DataSource) -> str:
    """One sha256 over the names and bytes of the input's files: any edit changes it."""
    import hashlib  # OpenSSL's: not on the compile path, which never hashes data

    digest = hashlib.sha256()
    for path, _ in source.files:
        digest.update(path.name.encode("utf-8") + b"\0")
        try:
            with path.open("rb") as handle:
                while chunk := handle.read(1 << 20):
                    digest.update(chunk)
        except OSError as exc:
            msg = f"data file {path} cannot be read: {exc.strerror or exc}"
            raise DataError(msg) from None
        digest.update(b"\0")
    return digest.hexdigest()


def input_sha256(path: Path) -> str | None:
    """sha256 of an input as a capture manifest records it: a file's bytes, a folder's files
    (:func:`content_sha256`). None when it cannot be read."""
    import hashlib

    try:
        if path.is_file():
            digest = hashlib.sha256()
            with path.open("rb") as handle:
                while chunk := handle.read(1 << 20):
                    digest.update(chunk)
            return digest.hexdigest()
        return content_sha256(resolve_source(path, setting="data.data_path"))
    except (OSError, DataError):
        return None


# ---------------------------------------------------------------------------------------------
# rows
# ---------------------------------------------------------------------------------------------


class RawLine:
    """A JSONL line that is still text (parsed by the conversation reader, which owns the
    per-line rules), or a line that cannot be: `text` None, `kind` and `error` say why (bytes
    that are not UTF-8, a line over :data:`MAX_LINE_BYTES`)."""

    __slots__ = ("error", "kind", "text")

    def __init__(self, text: str | None, error: str | None = None, kind: str = "not UTF-8") -> None:
        self.text = text
        self.error = error
        self.kind = kind


def iter_rows(source: DataSource) -> Iterator[tuple[int, RawLine | dict[str, object]]]:
    """(row number from 1, a raw JSONL line or a Parquet/Arrow row as a dict) in order."""
    offset = 0
    for path, fmt in source.files:
        last = 0
        rows = _jsonl_rows(path, fmt) if fmt in ("jsonl", "jsonl.gz") else _table_rows(path, fmt)
        for number, row in rows:
            last = number
            yield offset + number, row
        offset += last


def _open_binary(path: Path, fmt: FileFormat) -> IO[bytes]:
    if fmt == "jsonl.gz":
        return cast("IO[bytes]", gzip.open(path, "rb"))
    return path.open("rb")


def _jsonl_rows(path: Path, fmt: FileFormat) -> Iterator[tuple[int, RawLine | dict[str, object]]]:
    number = 0
    try:
        with _open_binary(path, fmt) as handle:
            while raw := handle.readline(MAX_LINE_BYTES + 1):
                number += 1
                if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                    size = len(raw) + _skip_line(handle)
                    why = f"the line holds {size} bytes, more than {MAX_LINE_BYTES}"
                    yield number, RawLine(None, why, kind="line too long")
                    continue
                try:
                    # a byte-order mark (Windows editors write one first) is not content, as
                    # in every JSON the project reads
                    yield number, RawLine(raw.removeprefix(_BOM).decode("utf-8"))
                except UnicodeDecodeError as exc:
                    yield number, RawLine(None, f"not valid UTF-8 ({exc.reason})")
    except (OSError, EOFError, gzip.BadGzipFile, zlib.error) as exc:
        msg = f"data file {path} cannot be read after line {number}: {exc}"
        raise DataError(msg) from None


def _skip_line(handle: IO[bytes]) -> int:
    """Read past the rest of the current line, a MiB at a time; the bytes skipped."""
    skipped = 0
    while chunk := handle.readline(1 << 20):
        skipped += len(chunk)
        if chunk.endswith(b"\n"):
            break
    return skipped


def _table_rows(path: Path, fmt: FileFormat) -> Iterator[tuple[int, dict[str, object]]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    number = 0
    try:
        if fmt == "parquet":
            batches = pq.ParquetFile(path).iter_batches(batch_size=ROWS_PER_BATCH)
            for batch in batches:
                for row in batch.to_pylist():
                    number += 1
                    yield number, row
            return
        with pa.memory_map(str(path)) as mapped:
            reader = _open_arrow(mapped)
            if isinstance(reader, pa.ipc.RecordBatchFileReader):
                chunks = (reader.get_batch(i) for i in range(reader.num_record_batches))
            else:
                chunks = iter(reader)
            for batch in chunks:
                # An Arrow file's offsets are not checked when it is mapped: a damaged one would
                # read out of bounds. Full validation (offsets, UTF-8) first, then the rows.
                batch.validate(full=True)
                for start in range(0, batch.num_rows, ROWS_PER_BATCH):
                    for row in batch.slice(start, ROWS_PER_BATCH).to_pylist():
                        number += 1
                        yield number, row
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise _unreadable(path, fmt, exc) from None


def describe_columns(columns: tuple[str, ...]) -> str:
    """'a, b, c' (or 'none'), clipped for a message."""
    text = ", ".join(columns) or "none"
    return text if len(text) <= 300 else text[:300] + f"... ({len(columns)} columns)"


__all__ = [
    "CONVERSATION_COLUMNS",
    "DataSource",
    "FileFormat",
    "RawLine",
    "arrow_schema",
    "content_sha256",
    "describe_columns",
    "file_format",
    "hub_id_hint",
    "input_sha256",
    "iter_rows",
    "resolve_source",
    "source_columns",
]
