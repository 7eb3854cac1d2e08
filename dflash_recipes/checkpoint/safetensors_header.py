"""The safetensors header reader: tensor names, dtypes, shapes and offsets, never tensor bytes.

Stdlib + attrs only, so `dflash-recipe compile` can inspect a 2 GB drafter by reading a few
kilobytes. The reader is deliberately stricter than "whatever loads": a header that is
malformed, ambiguous or inconsistent with the file size raises
:class:`~dflash_recipes.errors.SafetensorsHeaderError` naming the file, the tensor and the rule.
Only the 8-byte length prefix and the header itself are read; the JSON rules (duplicate keys,
NaN, integers of more than 20 digits) are :func:`dflash_recipes.files.jsonio.parse_json`'s.
"""

from __future__ import annotations

import os
import reprlib
import stat
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import attrs

from dflash_recipes.errors import SafetensorsHeaderError
from dflash_recipes.files.jsonio import parse_json_object
from dflash_recipes.records import Record

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


_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxlevel = 3
_SHORT_REPR.maxstring = 80
_SHORT_REPR.maxother = 40
_SHORT_REPR.maxlist = 6
_SHORT_REPR.maxdict = 4
_SHORT_REPR.maxlong = 40


def show_value(value: object) -> str:
    """A short repr for messages: bounded length and depth, whatever a header holds."""
    return _SHORT_REPR.repr(value)


def has_surrogates(text: str) -> bool:
    """True if `text` holds an unpaired UTF-16 surrogate (JSON allows one; UTF-8 cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


@attrs.frozen(repr=False, eq=False, slots=False)
class TensorInfo(Record):
    """One tensor's entry in a safetensors header (offsets relative to the data region)."""

    dtype: str
    shape: tuple[int, ...]
    data_offsets: tuple[int, int]

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes."""
        return self.data_offsets[1] - self.data_offsets[0]


@attrs.frozen(repr=False, eq=False, slots=False)
class SafetensorsHeader(Record):
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
    label = f"{where}: tensor {show_value(name)}"
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
        msg = f"{label}: unknown dtype {show_value(dtype)} (known: {', '.join(sorted(DTYPE_BITS))})"
        raise SafetensorsHeaderError(msg)

    raw_shape = entry["shape"]
    if not isinstance(raw_shape, list):
        msg = f"{label}: shape must be a list of integers >= 0, got {show_value(raw_shape)}"
        raise SafetensorsHeaderError(msg)
    for dim in raw_shape:
        if not isinstance(dim, int) or isinstance(dim, bool) or not 0 <= dim <= _U64_MAX:
            msg = f"{label}: shape must be a list of integers >= 0, got dimension {show_value(dim)}"
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
        shown = show_value(raw_offsets)
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
                f"{where}: tensor {show_value(name)} data_offsets [{begin}, {end}] overlap tensor "
                f"{show_value(previous)} [{prev[0]}, {prev[1]}]"
            )
            raise SafetensorsHeaderError(msg)
        if begin > position:
            after = (
                f"after tensor {show_value(previous)}" if previous is not None else "at the start"
            )
            msg = (
                f"{where}: tensor {show_value(name)} starts at byte {begin} but the previous data "
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
    document = parse_json_object(
        raw, where=where, what="header", error=SafetensorsHeaderError, must_open_brace=True
    )

    metadata: dict[str, str] = {}
    tensors: dict[str, TensorInfo] = {}
    for name, entry in document.items():
        if has_surrogates(name):
            shown = show_value(name)
            msg = f"{where}: tensor name {shown} contains an unpaired UTF-16 surrogate escape"
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
        msg = f"{where}: __metadata__ must be an object of string values, got {show_value(entry)}"
        raise SafetensorsHeaderError(msg)
    for key, value in entry.items():
        if not isinstance(value, str):
            shown = show_value(value)
            msg = f"{where}: __metadata__[{show_value(key)}] must be a string, got {shown}"
            raise SafetensorsHeaderError(msg)
        if has_surrogates(key) or has_surrogates(value):
            label = f"__metadata__[{show_value(key)}]"
            msg = f"{where}: {label} contains an unpaired UTF-16 surrogate escape"
            raise SafetensorsHeaderError(msg)
    return dict(entry)


__all__ = [
    "DTYPE_BITS",
    "SafetensorsHeader",
    "TensorInfo",
    "has_surrogates",
    "read_safetensors_header",
    "show_value",
]
