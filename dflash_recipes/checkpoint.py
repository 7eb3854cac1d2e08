"""Reading checkpoints without tensor data: safetensors headers, shard indexes, config.json.

Everything here is stdlib + attrs, so `dflash-recipe compile` can inspect a 2 GB drafter by
reading a few kilobytes. The safetensors reader is deliberately stricter than "whatever loads":
a header that is malformed, ambiguous or inconsistent with the file size raises
:class:`~dflash_recipes.errors.SafetensorsHeaderError` naming the file, the tensor and the rule.
Only the 8-byte length prefix and the header itself are read, never tensor bytes.

Paths in recipes are resolved with :func:`resolve_local_path`: `~` is expanded and a relative
path is taken relative to the recipe's folder (`base_dir`), not the shell's working directory,
so a recipe means the same thing wherever `dflash-recipe` is run from. Recipes built in Python
(no file) resolve relative paths against the current working directory.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import reprlib
import stat
import struct
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal, Protocol

import attrs

from dflash_recipes.errors import CheckpointError, SafetensorsHeaderError
from dflash_recipes.jsonio import FileReadProblem, read_regular_file

#: The single-file weights of an exported drafter.
WEIGHTS_NAME = "model.safetensors"
#: The index of a sharded checkpoint (weight_map: tensor name -> shard file name).
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
#: The configuration file of a model or exported drafter directory.
CONFIG_NAME = "config.json"

#: Bits per element of every dtype the safetensors format defines.
DTYPE_BITS: Mapping[str, int] = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E4M3": 8,
    "F8_E5M2": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "U16": 16,
    "I16": 16,
    "F16": 16,
    "BF16": 16,
    "U32": 32,
    "I32": 32,
    "F32": 32,
    "U64": 64,
    "I64": 64,
    "F64": 64,
    "C64": 64,
}

_HEADER_KEYS = frozenset({"dtype", "shape", "data_offsets"})
_METADATA_KEY = "__metadata__"
#: Shape dimensions and offsets are u64 in the format; anything larger is not a safetensors file.
_U64_MAX = 2**64 - 1
#: A u64 has at most 20 decimal digits; longer integer literals are rejected before conversion
#: (Python refuses to convert more than 4300 digits, and big ones are slow to multiply).
_MAX_INT_DIGITS = 20
#: Directory listings in messages show at most this many names.
_LISTING_LIMIT = 12


# ---------------------------------------------------------------------------------------------
# strict JSON
# ---------------------------------------------------------------------------------------------


class _JsonRuleError(Exception):
    """Raised by the JSON hooks; turned into the caller's error type with the file named."""


def _reject_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    result: dict[str, object] = {}
    for key, value in pairs:
        if key in result:
            msg = f"duplicate key {_show(key)}"
            raise _JsonRuleError(msg)
        result[key] = value
    return result


def _reject_constant(name: str) -> object:
    msg = f"{name} is not valid JSON (only finite numbers are allowed)"
    raise _JsonRuleError(msg)


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > _MAX_INT_DIGITS:
        msg = f"integer {text[:24]}... has more than {_MAX_INT_DIGITS} digits"
        raise _JsonRuleError(msg)
    return int(text)


def _strict_json(text: str) -> object:
    """Parse JSON rejecting duplicate keys, NaN/Infinity and absurd integers.

    Raises _JsonRuleError or ValueError/RecursionError; callers convert them.
    """
    return json.loads(
        text,
        object_pairs_hook=_reject_duplicates,
        parse_constant=_reject_constant,
        parse_int=_bounded_int,
    )


def _json_problem(exc: BaseException) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
    if isinstance(exc, RecursionError):
        return "invalid JSON: nested too deeply"
    return f"invalid JSON: {exc}"


_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxlevel = 3
_SHORT_REPR.maxstring = 80
_SHORT_REPR.maxother = 40
_SHORT_REPR.maxlist = 6
_SHORT_REPR.maxdict = 4
_SHORT_REPR.maxlong = 40


def _show(value: object) -> str:
    """A short repr for messages: bounded length and depth, whatever a header holds."""
    return _SHORT_REPR.repr(value)


def _has_surrogates(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


# ---------------------------------------------------------------------------------------------
# safetensors header
# ---------------------------------------------------------------------------------------------


@attrs.frozen
class TensorInfo:
    """One tensor's entry in a safetensors header (offsets relative to the data region)."""

    dtype: str
    shape: tuple[int, ...]
    data_offsets: tuple[int, int]

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes."""
        return self.data_offsets[1] - self.data_offsets[0]


@attrs.frozen
class SafetensorsHeader:
    """A validated safetensors header. `tensors` is in file (offset) order."""

    tensors: Mapping[str, TensorInfo]
    metadata: Mapping[str, str]
    #: Length of the JSON header in bytes (the value of the 8-byte prefix).
    header_size: int
    file_size: int

    @property
    def data_size(self) -> int:
        """Bytes of the data region (everything after the header)."""
        return self.file_size - 8 - self.header_size


def _element_count(shape: tuple[int, ...], limit: int) -> int | None:
    """prod(shape), or None once the running product exceeds `limit` (no need to go on)."""
    if 0 in shape:
        return 0
    count = 1
    for dim in shape:
        count *= dim
        if count > limit:
            return None
    return count


def _check_entry(where: str, name: str, entry: object, data_size: int) -> TensorInfo:
    label = f"{where}: tensor {_show(name)}"
    if not isinstance(entry, dict):
        msg = f"{label}: entry must be an object with dtype, shape, data_offsets"
        raise SafetensorsHeaderError(msg)
    keys = set(entry)
    if keys != _HEADER_KEYS:
        missing = sorted(_HEADER_KEYS - keys)
        extra = sorted(keys - _HEADER_KEYS)
        parts = []
        if missing:
            parts.append("missing " + ", ".join(missing))
        if extra:
            parts.append("unknown keys " + ", ".join(repr(k) for k in extra))
        msg = f"{label}: entry must have exactly dtype, shape, data_offsets ({'; '.join(parts)})"
        raise SafetensorsHeaderError(msg)

    dtype = entry["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        msg = f"{label}: unknown dtype {_show(dtype)} (known: {', '.join(sorted(DTYPE_BITS))})"
        raise SafetensorsHeaderError(msg)

    raw_shape = entry["shape"]
    if not isinstance(raw_shape, list):
        msg = f"{label}: shape must be a list of integers >= 0, got {_show(raw_shape)}"
        raise SafetensorsHeaderError(msg)
    for dim in raw_shape:
        if not isinstance(dim, int) or isinstance(dim, bool) or not 0 <= dim <= _U64_MAX:
            msg = f"{label}: shape must be a list of integers >= 0, got dimension {_show(dim)}"
            raise SafetensorsHeaderError(msg)
    shape = tuple(raw_shape)

    raw_offsets = entry["data_offsets"]
    if (
        not isinstance(raw_offsets, list)
        or len(raw_offsets) != 2
        or not all(
            isinstance(o, int) and not isinstance(o, bool) and 0 <= o <= _U64_MAX
            for o in raw_offsets
        )
    ):
        shown = _show(raw_offsets)
        msg = f"{label}: data_offsets must be two integers [begin, end] >= 0, got {shown}"
        raise SafetensorsHeaderError(msg)
    begin, end = raw_offsets
    if begin > end:
        msg = f"{label}: data_offsets [{begin}, {end}] end before they begin"
        raise SafetensorsHeaderError(msg)
    if end > data_size:
        msg = (
            f"{label}: data_offsets [{begin}, {end}] run past the end of the file "
            f"(the data region holds {data_size} bytes; the file is truncated or the header lies)"
        )
        raise SafetensorsHeaderError(msg)

    bits = DTYPE_BITS[dtype]
    # Exact sizes for anything a u64 can hold; beyond that only "too big" matters.
    count = _element_count(shape, max(data_size * 8 // bits, _U64_MAX))
    if count is None:
        msg = (
            f"{label}: shape {list(shape)} of {dtype} needs more bytes than the whole data "
            f"region of the file ({data_size})"
        )
        raise SafetensorsHeaderError(msg)
    if (count * bits) % 8:
        msg = f"{label}: {count} elements of the sub-byte dtype {dtype} do not fill whole bytes"
        raise SafetensorsHeaderError(msg)
    expected = count * bits // 8
    if expected != end - begin:
        msg = (
            f"{label}: shape {list(shape)} of {dtype} needs {expected} bytes, but data_offsets "
            f"[{begin}, {end}] span {end - begin}"
        )
        raise SafetensorsHeaderError(msg)
    return TensorInfo(dtype=dtype, shape=shape, data_offsets=(begin, end))


def _check_coverage(where: str, tensors: Mapping[str, TensorInfo], data_size: int) -> None:
    """Tensors must tile the data region exactly: from 0, no overlap, no gap, to the end."""
    ordered = sorted(tensors.items(), key=lambda item: item[1].data_offsets)
    position = 0
    previous: str | None = None
    for name, info in ordered:
        begin, end = info.data_offsets
        if begin < position:
            assert previous is not None
            prev = tensors[previous].data_offsets
            msg = (
                f"{where}: tensor {_show(name)} data_offsets [{begin}, {end}] overlap tensor "
                f"{_show(previous)} [{prev[0]}, {prev[1]}]"
            )
            raise SafetensorsHeaderError(msg)
        if begin > position:
            after = f"after tensor {_show(previous)}" if previous is not None else "at the start"
            msg = (
                f"{where}: tensor {_show(name)} starts at byte {begin} but the previous data "
                f"ends at {position}: a gap of {begin - position} bytes {after} (tensors must be "
                "contiguous, the first starting at 0)"
            )
            raise SafetensorsHeaderError(msg)
        position = end
        previous = name
    if position != data_size:
        msg = (
            f"{where}: the tensors cover {position} bytes of data but the file holds "
            f"{data_size} bytes after the header ({data_size - position} trailing bytes "
            "belong to no tensor)"
        )
        raise SafetensorsHeaderError(msg)


class _Readable(Protocol):
    """A raw binary file: read(n) returns at most n bytes, b"" at the end."""

    def read(self, size: int, /) -> bytes: ...


def _read_exact(handle: _Readable, count: int, where: str) -> bytes:
    chunks: list[bytes] = []
    remaining = count
    while remaining:
        chunk = handle.read(remaining)
        if not chunk:
            msg = f"{where}: file ended while reading the header ({count - remaining} of {count})"
            raise SafetensorsHeaderError(msg)
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def read_safetensors_header(
    path: Path, *, max_header_bytes: int = 100 * 2**20
) -> SafetensorsHeader:
    """Read and validate the header of a safetensors file, never its tensor data.

    The length prefix is checked against `max_header_bytes` and the file size before anything
    else is read, and the file is opened unbuffered so no tensor bytes are pulled in by
    read-ahead. Raises SafetensorsHeaderError (file, tensor and rule in the message) for any
    malformed, ambiguous or inconsistent header, and for files that cannot be read.
    """
    where = str(path)
    try:
        info = os.stat(path)
    except OSError as exc:
        msg = f"{where}: cannot read the safetensors file: {exc.strerror or exc}"
        raise SafetensorsHeaderError(msg) from exc
    if not stat.S_ISREG(info.st_mode):
        msg = f"{where}: not a regular file (a safetensors file was expected)"
        raise SafetensorsHeaderError(msg)
    try:
        with open(path, "rb", buffering=0) as handle:
            file_size = os.fstat(handle.fileno()).st_size
            if file_size < 8:
                msg = (
                    f"{where}: file is {file_size} bytes, too short for a safetensors file "
                    "(it starts with an 8-byte header length)"
                )
                raise SafetensorsHeaderError(msg)
            (header_size,) = struct.unpack("<Q", _read_exact(handle, 8, where))
            if header_size > max_header_bytes:
                msg = (
                    f"{where}: header length {header_size} bytes exceeds the limit of "
                    f"{max_header_bytes} bytes (corrupt file or not a safetensors file)"
                )
                raise SafetensorsHeaderError(msg)
            if header_size > file_size - 8:
                msg = (
                    f"{where}: header length {header_size} bytes runs past the end of the file "
                    f"({file_size} bytes): the file is truncated or not a safetensors file"
                )
                raise SafetensorsHeaderError(msg)
            raw = _read_exact(handle, header_size, where)
    except OSError as exc:
        msg = f"{where}: cannot read the safetensors file: {exc.strerror or exc}"
        raise SafetensorsHeaderError(msg) from exc

    data_size = file_size - 8 - header_size
    return _parse_header(where, raw, header_size, file_size, data_size)


def _parse_header(
    where: str, raw: bytes, header_size: int, file_size: int, data_size: int
) -> SafetensorsHeader:
    # The format's text says the header begins with "{"; the reference library also takes
    # leading whitespace, and so do we: a file every engine loads must not fail to compile.
    document = _json_object(
        raw, where=where, what="header", error=SafetensorsHeaderError, must_open_brace=True
    )

    metadata: dict[str, str] = {}
    tensors: dict[str, TensorInfo] = {}
    for name, entry in document.items():
        if _has_surrogates(name):
            msg = f"{where}: tensor name {_show(name)} contains an unpaired UTF-16 surrogate escape"
            raise SafetensorsHeaderError(msg)
        if name == _METADATA_KEY:
            metadata = _check_metadata(where, entry)
            continue
        tensors[name] = _check_entry(where, name, entry, data_size)
    _check_coverage(where, tensors, data_size)
    ordered = dict(sorted(tensors.items(), key=lambda item: (item[1].data_offsets, item[0])))
    return SafetensorsHeader(
        tensors=ordered, metadata=metadata, header_size=header_size, file_size=file_size
    )


def _check_metadata(where: str, entry: object) -> dict[str, str]:
    if not isinstance(entry, dict):
        msg = f"{where}: __metadata__ must be an object of string values, got {_show(entry)}"
        raise SafetensorsHeaderError(msg)
    for key, value in entry.items():
        if not isinstance(value, str):
            msg = f"{where}: __metadata__[{_show(key)}] must be a string, got {_show(value)}"
            raise SafetensorsHeaderError(msg)
        if _has_surrogates(key) or _has_surrogates(value):
            msg = (
                f"{where}: __metadata__[{_show(key)}] contains an unpaired UTF-16 surrogate escape"
            )
            raise SafetensorsHeaderError(msg)
    return dict(entry)


# ---------------------------------------------------------------------------------------------
# checkpoint directories (single file or sharded)
# ---------------------------------------------------------------------------------------------


@attrs.frozen
class CheckpointWeights:
    """The merged tensor table of a checkpoint directory (one file or the shards of an index)."""

    directory: Path
    #: Weight files relative to `directory`, sorted.
    weight_files: tuple[str, ...]
    tensors: Mapping[str, TensorInfo]
    #: Tensor name -> the weight file (relative) that holds it.
    tensor_files: Mapping[str, str]
    #: Safetensors dtypes present, sorted unique (e.g. ("BF16",)).
    dtypes: tuple[str, ...]
    #: Bytes of tensor data over all weight files (headers excluded).
    total_bytes: int

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor name -> shape, as :func:`dflash_recipes.draft_layout.compare_layout` takes it."""
        return {name: info.shape for name, info in self.tensors.items()}


def read_checkpoint_weights(
    directory: Path, *, max_index_bytes: int = 16 * 2**20
) -> CheckpointWeights:
    """Read the tensor table of a checkpoint directory from its safetensors headers only.

    `model.safetensors` is used when present (as transformers does); otherwise
    `model.safetensors.index.json` and the shards it names. Raises CheckpointError for a
    missing or inconsistent directory, index or shard; a malformed header is reported as a
    CheckpointError too, caused by (``__cause__``) the SafetensorsHeaderError.
    """
    single = directory / WEIGHTS_NAME
    index = directory / WEIGHTS_INDEX_NAME
    if single.exists() or single.is_symlink():
        header = _header_or_checkpoint_error(single)
        return _weights(directory, {WEIGHTS_NAME: header})
    if index.exists():
        return _read_sharded(directory, index, max_index_bytes)
    msg = (
        f"{directory}: no {WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME}; "
        f"the directory holds {_listing(directory)}"
    )
    raise CheckpointError(msg)


def _header_or_checkpoint_error(path: Path) -> SafetensorsHeader:
    try:
        return read_safetensors_header(path)
    except SafetensorsHeaderError as exc:
        raise CheckpointError(str(exc)) from exc


def _weights(directory: Path, headers: Mapping[str, SafetensorsHeader]) -> CheckpointWeights:
    tensors: dict[str, TensorInfo] = {}
    tensor_files: dict[str, str] = {}
    total = 0
    for file_name in sorted(headers):
        header = headers[file_name]
        for name, info in header.tensors.items():
            tensors[name] = info
            tensor_files[name] = file_name
        total += header.data_size
    return CheckpointWeights(
        directory=directory,
        weight_files=tuple(sorted(headers)),
        tensors=tensors,
        tensor_files=tensor_files,
        dtypes=tuple(sorted({info.dtype for info in tensors.values()})),
        total_bytes=total,
    )


def _plain_basename(name: str) -> bool:
    return (
        bool(name)
        and name not in {".", ".."}
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
        and not os.path.isabs(name)
        and not _has_surrogates(name)
    )


def _read_sharded(directory: Path, index: Path, max_index_bytes: int) -> CheckpointWeights:
    where = str(index)
    document = _read_strict_json_file(
        index, max_bytes=max_index_bytes, what="shard index", error=CheckpointError
    )
    weight_map = document.get("weight_map")
    if not isinstance(weight_map, dict):
        msg = f"{where}: the index must have a weight_map object (tensor name -> shard file)"
        raise CheckpointError(msg)
    if not weight_map:
        msg = f"{where}: weight_map is empty, the index names no tensors"
        raise CheckpointError(msg)
    by_shard: dict[str, set[str]] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            msg = (
                f"{where}: weight_map[{_show(name)}] must be a shard file name, got {_show(shard)}"
            )
            raise CheckpointError(msg)
        if not _plain_basename(shard):
            msg = (
                f"{where}: weight_map[{_show(name)}] names shard {_show(shard)}, which is not "
                f"a plain file name inside {directory} (no '/', '..' or absolute paths)"
            )
            raise CheckpointError(msg)
        by_shard.setdefault(shard, set()).add(name)

    missing_files = sorted(s for s in by_shard if not (directory / s).is_file())
    if missing_files:
        msg = (
            f"{where}: shard file(s) {', '.join(missing_files)} named by the index are missing "
            f"or not files; the directory holds {_listing(directory)}"
        )
        raise CheckpointError(msg)

    headers: dict[str, SafetensorsHeader] = {}
    seen_in: dict[str, str] = {}
    for shard in sorted(by_shard):
        header = _header_or_checkpoint_error(directory / shard)
        headers[shard] = header
        for name in header.tensors:
            other = seen_in.get(name)
            if other is not None:
                msg = (
                    f"{directory}: tensor {_show(name)} is stored in two shards, {other} and "
                    f"{shard}; which copy to load would be ambiguous"
                )
                raise CheckpointError(msg)
            seen_in[name] = shard
        listed = by_shard[shard]
        absent = sorted(listed - set(header.tensors))
        if absent:
            msg = (
                f"{where}: {len(absent)} tensor(s) the index places in {shard} are not in its "
                f"header: {_name_list(absent)}"
            )
            raise CheckpointError(msg)
    for name, shard in seen_in.items():
        if name not in weight_map:
            msg = (
                f"{where}: shard {shard} holds tensor {_show(name)}, which the index does not list "
                "(the index and the shards disagree)"
            )
            raise CheckpointError(msg)
    return _weights(directory, headers)


def _name_list(names: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    if len(names) > limit:
        shown += f", ... ({len(names) - limit} more)"
    return shown


# ---------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------


def _read_strict_json_file(
    path: Path,
    *,
    max_bytes: int,
    what: str,
    error: Callable[[str], Exception],
) -> dict[str, object]:
    where = str(path)
    try:
        # Stat before open: a FIFO or device is refused without ever blocking on it.
        raw = read_regular_file(path, max_bytes=max_bytes)
    except FileReadProblem as problem:
        if "not a regular file" in problem.reason:
            msg = f"{where}: not a regular file (a JSON {what} was expected): {problem.reason}"
        elif "larger than the limit" in problem.reason:
            msg = f"{where}: the {what} is larger than the limit of {max_bytes} bytes"
        else:
            msg = f"{where}: cannot read the {what}: {problem.reason}"
        raise error(msg) from None
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    return _json_object(raw, where=where, what=what, error=error)


def _json_object(
    raw: bytes,
    *,
    where: str,
    what: str,
    error: Callable[[str], Exception],
    must_open_brace: bool = False,
) -> dict[str, object]:
    """Decode `raw` as UTF-8 strict JSON (:func:`_strict_json` rules) holding one object."""
    try:
        text = raw.decode("utf-8", errors="strict")
    except UnicodeDecodeError as exc:
        msg = f"{where}: the {what} is not valid UTF-8 (byte {exc.start} of the {what})"
        raise error(msg) from exc
    if must_open_brace and not text.lstrip(" \t\r\n").startswith("{"):
        msg = f"{where}: the {what} must be a JSON object (it starts with {text[:16]!r})"
        raise error(msg)
    try:
        document = _strict_json(text)
    except _JsonRuleError as exc:
        msg = f"{where}: the {what} is rejected: {exc}"
        raise error(msg) from exc
    except (ValueError, RecursionError) as exc:
        msg = f"{where}: the {what} is {_json_problem(exc)}"
        raise error(msg) from exc
    if not isinstance(document, dict):
        msg = f"{where}: the {what} must be a JSON object, got {type(document).__name__}"
        raise error(msg)
    return document


def read_json_config(path: Path, *, max_bytes: int = 4 * 2**20) -> dict[str, object]:
    """Read a config.json strictly: at most `max_bytes`, UTF-8, a JSON object.

    Duplicate keys, NaN/Infinity and integers of more than 20 digits are rejected.
    Raises CheckpointError naming the file and the problem.
    """
    return _read_strict_json_file(path, max_bytes=max_bytes, what="config", error=CheckpointError)


# ---------------------------------------------------------------------------------------------
# resolving and inspecting local directories
# ---------------------------------------------------------------------------------------------

ProblemKind = Literal[
    "hub-id",
    "not-found",
    "broken-symlink",
    "not-a-directory",
    "unreadable",
    "empty-directory",
    "no-weights",
    "no-config",
]

# owner/name as the Hub spells repository ids; a value like this that is not a local
# directory is almost certainly a Hub id.
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


@attrs.frozen
class CheckpointDirProblem:
    """Why a recipe's directory value cannot be used: kind, the message, and the fix."""

    kind: ProblemKind
    #: The value as the recipe wrote it.
    value: str
    #: The absolute path it resolved to.
    path: str
    #: What is wrong, listing what the directory holds where that helps.
    message: str
    #: The fix.
    hint: str


def resolve_local_path(value: str, *, base_dir: Path | None) -> Path:
    """An absolute path for a recipe value: `~` expanded, relative paths under `base_dir`.

    `base_dir` is the recipe file's folder; None (a recipe built in Python) means the current
    working directory. `..` is collapsed lexically and symlinks are not resolved, so the plan
    shows the path the user wrote.
    """
    path = Path(value).expanduser()
    if not path.is_absolute():
        path = (base_dir if base_dir is not None else Path.cwd()) / path
    return Path(os.path.normpath(path.absolute()))


def looks_like_hub_id(value: str) -> bool:
    """True for `owner/name` values such as `z-lab/Qwen3-8B-DFlash-b16`."""
    return bool(_HUB_ID_RE.match(value)) and not value.startswith(".")


def _listing(directory: Path, limit: int = _LISTING_LIMIT) -> str:
    try:
        names = sorted(_entry_label(child) for child in directory.iterdir())
    except OSError as exc:
        return f"nothing that can be listed ({exc.strerror or exc})"
    if not names:
        return "nothing (it is empty)"
    shown = ", ".join(names[:limit])
    if len(names) > limit:
        shown += f", ... ({len(names) - limit} more)"
    return f"{len(names)} entr{'y' if len(names) == 1 else 'ies'}: {shown}"


def _entry_label(child: Path) -> str:
    try:
        if child.is_dir():
            return child.name + "/"
    except OSError:
        pass
    return child.name


@attrs.frozen
class _Requirement:
    """What a usable directory must contain, for one kind of recipe value."""

    noun: str
    kind_missing: ProblemKind
    #: Any one of these names makes the directory usable (first: the main one).
    accepted: tuple[str, ...]
    expected: str
    hub_hint: str


_CHECKPOINT_REQUIREMENT = _Requirement(
    noun="init checkpoint",
    kind_missing="no-weights",
    accepted=(WEIGHTS_NAME, WEIGHTS_INDEX_NAME),
    expected=(
        f"an exported DFlash drafter: {WEIGHTS_NAME} (or {WEIGHTS_INDEX_NAME} with its "
        f"shards) and {CONFIG_NAME}"
    ),
    hub_hint="stage the drafter first: hf download {value} --local-dir <dir>, then use <dir>",
)

_MODEL_REQUIREMENT = _Requirement(
    noun="base model",
    kind_missing="no-config",
    accepted=(CONFIG_NAME,),
    expected=f"a Hugging Face model directory with {CONFIG_NAME} (weights are needed to run)",
    hub_hint="stage the model first: hf download {value} --local-dir <dir>, then use <dir>",
)


def inspect_checkpoint_dir(value: str, *, base_dir: Path | None) -> CheckpointDirProblem | None:
    """Check that `value` names a local directory holding drafter weights; None when it does.

    Accepts `model.safetensors` or `model.safetensors.index.json` (the shards themselves are
    checked by :func:`read_checkpoint_weights`). Relative values resolve under `base_dir`,
    the recipe's folder (see :func:`resolve_local_path`). Never raises for filesystem trouble:
    each problem comes back as a CheckpointDirProblem with a message and a fix.
    """
    return _inspect_dir(value, base_dir, _CHECKPOINT_REQUIREMENT)


def inspect_model_dir(value: str, *, base_dir: Path | None) -> CheckpointDirProblem | None:
    """Like :func:`inspect_checkpoint_dir` for a base model directory (needs config.json)."""
    return _inspect_dir(value, base_dir, _MODEL_REQUIREMENT)


def resolve_checkpoint_dir(value: str, *, base_dir: Path | None, role: str) -> Path:
    """The absolute init-checkpoint directory, or CheckpointError with the problem and fix.

    `role` names the value in the message (e.g. `dflash.dflash_init_checkpoint`).
    """
    problem = inspect_checkpoint_dir(value, base_dir=base_dir)
    if problem is not None:
        msg = f"{role}: {problem.message}\nfix: {problem.hint}"
        raise CheckpointError(msg)
    return resolve_local_path(value, base_dir=base_dir)


def _problem(
    kind: ProblemKind, value: str, path: Path, message: str, hint: str
) -> CheckpointDirProblem:
    return CheckpointDirProblem(kind=kind, value=value, path=str(path), message=message, hint=hint)


def _inspect_dir(
    value: str, base_dir: Path | None, need: _Requirement
) -> CheckpointDirProblem | None:
    path = resolve_local_path(value, base_dir=base_dir)
    try:
        exists = path.exists()
        is_link = path.is_symlink()
    except OSError as exc:
        return _problem(
            "unreadable",
            value,
            path,
            f"{need.noun} {path} cannot be examined: {exc.strerror or exc}",
            "check the path and its permissions",
        )
    if not exists:
        return _missing_path(value, path, is_link, need, base_dir)
    if not path.is_dir():
        hint = f"point it at the directory that holds {need.accepted[0]}"
        if path.name in need.accepted:
            hint = f"point it at the directory {path.parent}, not at the file itself"
        return _problem(
            "not-a-directory",
            value,
            path,
            f"{need.noun} {path} is a file, not a directory ({need.expected} expected)",
            hint,
        )
    try:
        children = sorted(path.iterdir())
    except OSError as exc:
        return _problem(
            "unreadable",
            value,
            path,
            f"{need.noun} directory {path} cannot be listed: {exc.strerror or exc}",
            "make it readable (and searchable) by this user",
        )
    if not children:
        return _problem(
            "empty-directory",
            value,
            path,
            f"{need.noun} directory {path} is empty ({need.expected} expected)",
            _stage_hint(need, path),
        )
    return _check_required_file(value, path, need)


def _missing_path(
    value: str, path: Path, is_link: bool, need: _Requirement, base_dir: Path | None
) -> CheckpointDirProblem:
    if is_link:
        target = os.readlink(path)
        return _problem(
            "broken-symlink",
            value,
            path,
            f"{need.noun} {path} is a symbolic link to {target}, which does not exist",
            "restore the link's target or point the recipe at the real directory",
        )
    if looks_like_hub_id(value):
        return _problem(
            "hub-id",
            value,
            path,
            f"{need.noun} {value!r} is not a local directory (looked for {path}); it looks like "
            "a Hugging Face Hub id, and hub ids are not fetched",
            need.hub_hint.format(value=value),
        )
    base = "the recipe's folder" if base_dir is not None else "the working directory"
    hint = f"check the path (a relative path is resolved against {base})"
    parent = path.parent
    if parent.is_dir():
        try:
            siblings = [c.name for c in parent.iterdir()]
        except OSError:
            siblings = []
        close = difflib.get_close_matches(path.name, siblings, n=1)
        if close:
            hint = f"did you mean {parent / close[0]}?"
        else:
            hint = f"{parent} holds {_listing(parent)}"
    return _problem("not-found", value, path, f"{need.noun} {path} does not exist", hint)


def _check_required_file(value: str, path: Path, need: _Requirement) -> CheckpointDirProblem | None:
    for name in need.accepted:
        candidate = path / name
        if candidate.is_symlink() and not candidate.exists():
            return _problem(
                "broken-symlink",
                value,
                path,
                f"{need.noun} file {candidate} is a symbolic link to {os.readlink(candidate)}, "
                "which does not exist",
                "download the file again, or restore the link's target",
            )
        if candidate.exists():
            if not candidate.is_file():
                return _problem(
                    need.kind_missing,
                    value,
                    path,
                    f"{need.noun} {candidate} is not a regular file",
                    f"{need.accepted[0]} must be a file",
                )
            if not os.access(candidate, os.R_OK):
                return _problem(
                    "unreadable",
                    value,
                    path,
                    f"{need.noun} file {candidate} is not readable by this user",
                    f"make it readable: chmod a+r {candidate}",
                )
            return None
    wanted = " or ".join(need.accepted)
    return _problem(
        need.kind_missing,
        value,
        path,
        f"{need.noun} directory {path} has no {wanted}; it holds {_listing(path)}",
        _stage_hint(need, path),
    )


def _stage_hint(need: _Requirement, path: Path) -> str:
    nested = _nested_candidates(path, need.accepted)
    if nested:
        return f"did you mean {nested[0]}? ({need.expected} is expected directly inside)"
    return f"expected {need.expected}; stage it with: hf download <repo> --local-dir {path}"


def _nested_candidates(path: Path, accepted: tuple[str, ...]) -> list[Path]:
    """Subdirectories one level down that hold what is missing (a common staging slip)."""
    found: list[Path] = []
    try:
        for child in sorted(path.iterdir()):
            if child.is_dir() and any((child / name).is_file() for name in accepted):
                found.append(child)
    except OSError:
        return []
    return found


__all__ = [
    "CONFIG_NAME",
    "DTYPE_BITS",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "CheckpointDirProblem",
    "CheckpointWeights",
    "ProblemKind",
    "SafetensorsHeader",
    "TensorInfo",
    "inspect_checkpoint_dir",
    "inspect_model_dir",
    "looks_like_hub_id",
    "read_checkpoint_weights",
    "read_json_config",
    "read_safetensors_header",
    "resolve_checkpoint_dir",
    "resolve_local_path",
]
