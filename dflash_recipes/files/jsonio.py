"""Reading JSON and other small files so that any bytes give a clean error (no torch).

Every JSON reader of the project (plans, trainer_state.json, metrics, data and prompt lines)
parses through :func:`parse_json`, which turns every way JSON can go wrong into one
:class:`JsonProblem` with a short reason: syntax errors, integers longer than a limit (Python
refuses to convert more than 4300 digits, and big ones are slow), nesting deep enough to hit the
recursion limit, ``NaN``/``Infinity`` (not JSON), duplicate keys and text that is not UTF-8.
Callers add the file (and line) and raise their own error type.

Files are opened with :func:`read_regular_file`: the path is stat'ed first and must be a regular
file (a FIFO, socket or device is refused before ``open()``, so a reader never blocks), it is
opened non-blocking in case it was swapped in between, and at most ``max_bytes`` are read.

:func:`shorten` and :func:`clip` (from :mod:`dflash_recipes.echo`, re-exported here) bound a
value echoed into a message, however long it is.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path

from dflash_recipes.echo import ECHO_LIMIT, clip, shorten

#: Integers in machine-written files (plans, trainer state) fit in a u64: 20 digits.
MAX_INT_DIGITS = 20


class JsonProblem(ValueError):
    """Why a text is not acceptable JSON; `reason` names the rule (no file, no line)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    result: dict[str, object] = {}
    for key, value in pairs:
        if key in result:
            msg = f"duplicate key {shorten(key)}"
            raise JsonProblem(msg)
        result[key] = value
    return result


def _no_constant(name: str) -> object:
    msg = f"{name} is not valid JSON (only finite numbers are allowed)"
    raise JsonProblem(msg)


def _int_parser(max_digits: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        digits = len(text.lstrip("-"))
        if digits > max_digits:
            msg = f"an integer of {digits} digits (more than {max_digits} digits are refused)"
            raise JsonProblem(msg)
        return int(text)

    return parse


def _float_parser(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        msg = f"the number {shorten(text, 24)} is too large for a float"
        raise JsonProblem(msg)
    return value


def parse_json(
    text: str | bytes,
    *,
    max_int_digits: int = MAX_INT_DIGITS,
    allow_duplicate_keys: bool = False,
) -> object:
    """Parse JSON strictly; every problem is a :class:`JsonProblem` (never another error).

    Bytes must be UTF-8 (a leading byte-order mark is ignored). Refused: syntax errors,
    NaN/Infinity, numbers that overflow a float, integers of more than `max_int_digits`
    digits, nesting too deep to parse, and (unless allowed) duplicate keys.
    """
    if isinstance(text, (bytes, bytearray)):
        raw = bytes(text)
        if raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            msg = f"not valid UTF-8 (byte {exc.start}: {exc.reason})"
            raise JsonProblem(msg) from None
    try:
        return json.loads(
            text,
            object_pairs_hook=None if allow_duplicate_keys else _no_duplicates,
            parse_constant=_no_constant,
            parse_int=_int_parser(max_int_digits),
            parse_float=_float_parser,
        )
    except JsonProblem:
        raise
    except json.JSONDecodeError as exc:
        msg = f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        raise JsonProblem(msg) from None
    except RecursionError:
        msg = "invalid JSON: nested too deeply"
        raise JsonProblem(msg) from None
    except (ValueError, OverflowError) as exc:  # e.g. Python's int digit limit
        msg = f"invalid JSON: {shorten(str(exc))}"
        raise JsonProblem(msg) from None


def file_kind(mode: int) -> str:
    """What a file is, in words ('a regular file', 'a FIFO (named pipe)', 'a folder', ...)."""
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    return "not a regular file"


class FileReadProblem(Exception):
    """Why a file could not be read; `reason` is a short phrase, `missing` for ENOENT."""

    def __init__(self, reason: str, *, missing: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.missing = missing


def regular_file_problem(path: str | os.PathLike[str]) -> FileReadProblem | None:
    """None when `path` is a regular file (after symlinks); else why it cannot be read as one."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return FileReadProblem("it does not exist", missing=True)
    except NotADirectoryError:
        return FileReadProblem("a part of the path is a file, not a folder", missing=True)
    except OSError as exc:
        return FileReadProblem(f"cannot read it: {exc.strerror or exc}")
    except ValueError:  # a NUL byte in the path
        return FileReadProblem("the path contains a NUL byte")
    if not stat.S_ISREG(info.st_mode):
        return FileReadProblem(f"it is {file_kind(info.st_mode)}, not a regular file")
    return None


def read_regular_file(path: str | os.PathLike[str], *, max_bytes: int) -> bytes:
    """The bytes of a regular file of at most `max_bytes`, or :class:`FileReadProblem`.

    Stat first (a FIFO, socket or device is refused before opening, so this never blocks),
    open non-blocking and check again (the path may have been replaced in between), then read
    at most `max_bytes` + 1 bytes so a file that is too large is refused without reading it all.
    """
    problem = regular_file_problem(path)
    if problem is not None:
        raise problem
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise FileReadProblem(f"cannot read it: {exc.strerror or exc}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise FileReadProblem(f"it is {file_kind(mode)}, not a regular file")
        chunks: list[bytes] = []
        remaining = max_bytes + 1
        while remaining > 0:
            chunk = os.read(fd, min(remaining, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
    except OSError as exc:
        raise FileReadProblem(f"cannot read it: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    raw = b"".join(chunks)
    if len(raw) > max_bytes:
        raise FileReadProblem(f"it is larger than the limit of {max_bytes} bytes")
    return raw


def read_json_file(
    path: Path,
    *,
    what: str,
    fix: str,
    error: Callable[[str], Exception],
    max_bytes: int = 16 * 2**20,
    max_int_digits: int = MAX_INT_DIGITS,
) -> object:
    """Read and parse one JSON file; `error(message)` is raised naming the file, what it is
    (`what`, e.g. "run plan") and `fix` (what the user should do) for every problem."""
    try:
        raw = read_regular_file(path, max_bytes=max_bytes)
        return parse_json(raw, max_int_digits=max_int_digits)
    except (FileReadProblem, JsonProblem) as exc:
        msg = f"{os.fsdecode(path)}: cannot read the {what}: {exc.reason}; {fix}"
        raise error(msg) from None


def parse_json_object(
    raw: bytes,
    *,
    where: str,
    what: str,
    error: Callable[[str], Exception],
    must_open_brace: bool = False,
) -> dict[str, object]:
    """Parse `raw` (UTF-8) with :func:`parse_json`'s rules; it must hold one JSON object.

    Every problem is `error(message)`, the message naming `where` (the file) and `what` (e.g.
    "config", "shard index"). `must_open_brace`: the text (after whitespace) must start with
    ``{`` and no byte-order mark is skipped, as the safetensors format requires of its header.
    """
    if must_open_brace:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            msg = f"{where}: the {what} is not valid UTF-8 (byte {exc.start} of the {what})"
            raise error(msg) from None
        if not text.lstrip(" \t\r\n").startswith("{"):
            msg = f"{where}: the {what} must be a JSON object (it starts with {text[:16]!r})"
            raise error(msg)
        source: str | bytes = text
    else:
        source = raw
    try:
        document = parse_json(source)
    except JsonProblem as problem:
        msg = f"{where}: the {what} is rejected: {problem.reason}"
        raise error(msg) from None
    if not isinstance(document, dict):
        msg = f"{where}: the {what} must be a JSON object, got {type(document).__name__}"
        raise error(msg)
    return document


def read_json_object_file(
    path: Path, *, max_bytes: int, what: str, error: Callable[[str], Exception]
) -> dict[str, object]:
    """Read a regular file of at most `max_bytes` holding one strict JSON object.

    Like :func:`parse_json_object` for the content; a file that cannot be read (missing, not a
    regular file, too large) is `error(message)` too, naming the file and the reason.
    """
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
    return parse_json_object(raw, where=where, what=what, error=error)


__all__ = [
    "ECHO_LIMIT",
    "MAX_INT_DIGITS",
    "FileReadProblem",
    "JsonProblem",
    "clip",
    "file_kind",
    "parse_json",
    "parse_json_object",
    "read_json_file",
    "read_json_object_file",
    "read_regular_file",
    "regular_file_problem",
    "shorten",
]
