"""One hidden-states file of vLLM's ExampleHiddenStatesConnector: taken under its lock, checked,
read, then deleted (or kept).

vLLM answers a request, then writes ``cmpl-{rid}-{i}-{8 hex}.safetensors`` in a later engine
step while it holds an exclusive ``flock`` on ``<file>.lock``, created before the answer was sent.
So the file may not exist when the answer arrives: :func:`take_states_file` polls for a shared
lock (``LOCK_SH | LOCK_NB``) until a deadline, and only then opens the file. A lock acquired with
no file beside it is a write that failed. vLLM never deletes either file: the reader does.

Every check that says "the server serves other states" (:class:`ServedStatesError`: token ids,
layer count, hidden size, dtype, NaN/Inf) is final; what says "this attempt failed" (no file,
the lock still held at the deadline, a file that cannot be read) is a
:class:`StatesFileFailure`, which the client retries.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import attrs
import torch
from safetensors.torch import load_file
from torch import Tensor

from dflash_recipes.checkpoint.safetensors_header import SafetensorsHeader, read_safetensors_header
from dflash_recipes.errors import RunIOError, SafetensorsHeaderError, ServedStatesError
from dflash_recipes.files.capture_manifest import SAFETENSORS_DTYPES
from dflash_recipes.records import Record

#: The tensors of a file (the connector writes no metadata).
HIDDEN_STATES = "hidden_states"
TOKEN_IDS = "token_ids"
_LOCK_SUFFIX = ".lock"
#: The longest pause between two tries of the lock.
_MAX_POLL_S = 0.05


@attrs.frozen(eq=False)
class ServedStates:
    """One conversation's states, as a server gave them and the checks passed."""

    #: ``[T, n_layers, H]`` in the served dtype, the layers in ascending vLLM id order.
    hidden_states: Tensor
    #: ``[T]`` int64: the token ids the states are of (equal to those sent).
    token_ids: Tensor
    #: The server that answered, ``host:port``.
    server: str
    #: The file, where it was kept (settings ``keep_dir``); None once deleted.
    path: Path | None


@attrs.frozen(repr=False, eq=False, slots=False)
class ExpectedStates(Record):
    """What every file must hold: one row per token, these layers, this width and dtype."""

    layer_ids: tuple[int, ...]
    hidden_size: int
    dtype: str

    def describe(self) -> str:
        """``2 layers (vLLM ids [2, 4]) of hidden size 64 in bfloat16``."""
        n = len(self.layer_ids)
        return (
            f"{n} layer{'s' * (n != 1)} (vLLM ids {list(self.layer_ids)}) of hidden size "
            f"{self.hidden_size} in {self.dtype}"
        )


class StatesFileFailure(Exception):
    """The server did not deliver a readable file for an answer it gave (no file under the
    lock, the lock still held at the deadline, a truncated file): this attempt failed, and the
    client retries it. Its text names the file or the lock."""


def lock_path(path: Path) -> Path:
    """The lock vLLM holds while it writes `path`: ``<path>.lock``."""
    return path.with_name(path.name + _LOCK_SUFFIX)


def first_difference(sent: Sequence[int], served: Sequence[int]) -> int | None:
    """The first position where two token-id lists differ (a length counts); None if equal."""
    for position, (a, b) in enumerate(zip(sent, served, strict=False)):
        if a != b:
            return position
    return None if len(sent) == len(served) else min(len(sent), len(served))


def token_mismatch(
    sent: Sequence[int], served: Sequence[int], *, conversation: int, server: str, where: str
) -> ServedStatesError | None:
    """The error for `served` token ids that are not `sent` (None when they are equal)."""
    position = first_difference(sent, served)
    if position is None:
        return None

    def at(ids: Sequence[int]) -> str:
        return str(ids[position]) if position < len(ids) else "nothing (it ends there)"

    msg = (
        f"conversation {conversation}: the server {server} has other token ids than were sent "
        f"({where}): the first difference is at position {position}, sent {at(sent)}, served "
        f"{at(served)} ({len(sent)} tokens sent, {len(served)} served). The server tokenized "
        "the prompt again (a BOS token or chat-template drift): send token ids as the trainer "
        "tokenizes them, to a server that serves the same tokenizer; not retried"
    )
    return ServedStatesError(msg)


def _remove(*paths: Path) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _open_lock(lock: Path) -> int | None:
    try:
        return os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return None


def wait_for_lock(path: Path, *, deadline: float, server: str) -> int | None:
    """A descriptor of `path`'s lock file holding a shared lock, once vLLM has released its
    exclusive one; None when there is no lock file but the file is there (a server that does
    not lock). Polls until `deadline` (``time.monotonic()``), then StatesFileFailure."""
    lock = lock_path(path)
    pause = 0.001
    fd = _open_lock(lock)
    while True:
        if fd is None:
            fd = _open_lock(lock)
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                pass
        elif path.exists():
            return None
        if time.monotonic() >= deadline:
            if fd is not None:
                os.close(fd)
                why = f"vLLM still held its lock {lock} on the file {path}"
            else:
                why = f"neither the file {path} nor its lock {lock} appeared"
            msg = f"{server}: {why} at the lock deadline (lock_timeout_s)"
            raise StatesFileFailure(msg)
        time.sleep(pause)
        pause = min(2 * pause, _MAX_POLL_S)


def _check_header(
    header: SafetensorsHeader,
    path: Path,
    *,
    tokens: int,
    expected: ExpectedStates,
    server: str,
) -> None:
    missing = [name for name in (HIDDEN_STATES, TOKEN_IDS) if name not in header.tensors]
    if missing:
        msg = (
            f"{server}: the file {path} has no tensor {', '.join(missing)} (it holds "
            f"{sorted(header.tensors)}): not a file of vLLM's hidden-states connector"
        )
        raise ServedStatesError(msg)
    states = header.tensors[HIDDEN_STATES]
    shape = states.shape
    if len(shape) != 3 or shape[1:] != (len(expected.layer_ids), expected.hidden_size):
        shown = f"{shape[1]} layers of hidden size {shape[2]}" if len(shape) == 3 else f"{shape}"
        msg = (
            f"{server} serves {shown} per token (file {path}); this run expects "
            f"{expected.describe()}: the server was started for other taps or another target. "
            "Restart it with the command `dflash-recipe serve-target` prints for this plan"
        )
        raise ServedStatesError(msg)
    code = SAFETENSORS_DTYPES.get(expected.dtype)
    if states.dtype != code:
        served = {v: k for k, v in SAFETENSORS_DTYPES.items()}.get(states.dtype, states.dtype)
        msg = (
            f"{server} serves states in {served} (file {path}); this run trains on "
            f"{expected.dtype}: restart the server with --dtype {expected.dtype}"
        )
        raise ServedStatesError(msg)
    ids = header.tensors[TOKEN_IDS]
    if shape[0] != tokens or ids.shape != (tokens,) or ids.dtype != "I64":
        msg = (
            f"{server}: the file {path} holds {shape[0]} rows of states and token_ids "
            f"{ids.dtype}{list(ids.shape)} for a prompt of {tokens} tokens sent; a vLLM "
            "with include_output_tokens, or another request's file"
        )
        raise ServedStatesError(msg)


def _check_finite(states: Tensor, path: Path, expected: ExpectedStates, server: str) -> None:
    finite = torch.isfinite(states)
    if bool(finite.all()):
        return
    row, layer, _ = (int(i) for i in (~finite).nonzero()[0])
    msg = (
        f"{server}: the file {path} holds NaN or Inf states (first at token {row}, vLLM layer "
        f"{expected.layer_ids[layer]}): the served target overflows in {expected.dtype}; "
        "not retried"
    )
    raise ServedStatesError(msg)


def read_states_file(
    path: Path,
    token_ids: Sequence[int],
    *,
    expected: ExpectedStates,
    server: str,
    conversation: int,
) -> tuple[Tensor, Tensor]:
    """``(hidden_states, token_ids)`` of a complete file, every check passed: the header first
    (tensors, layer count, hidden size, dtype, rows), then the data (token ids, NaN/Inf).
    ServedStatesError for states other than expected; StatesFileFailure for a file that cannot
    be read."""
    try:
        header = read_safetensors_header(path)
    except SafetensorsHeaderError as exc:
        if not path.exists():
            msg = (
                f"{server}: the lock {lock_path(path)} was free but the file {path} was not "
                "there: the server failed to write it"
            )
            raise StatesFileFailure(msg) from exc
        msg = f"{server}: the file {path} cannot be read: {exc}"
        raise StatesFileFailure(msg) from exc
    _check_header(header, path, tokens=len(token_ids), expected=expected, server=server)
    try:
        tensors = load_file(str(path))
    except (OSError, RuntimeError) as exc:  # safetensors raises its own SafetensorError too
        msg = f"{server}: the file {path} cannot be read: {exc}"
        raise StatesFileFailure(msg) from exc
    states, ids = tensors[HIDDEN_STATES], tensors[TOKEN_IDS]
    error = token_mismatch(
        token_ids,
        ids.tolist(),
        conversation=conversation,
        server=server,
        where=f"the token_ids of the file {path}",
    )
    if error is not None:
        raise error
    _check_finite(states, path, expected, server)
    return states, ids


def _keep(path: Path, keep_dir: Path, server: str) -> Path:
    """Move a checked file into `keep_dir` (a rename on one file system); RunIOError."""
    if keep_dir.resolve() == path.parent.resolve():
        return path
    target = keep_dir / path.name
    try:
        shutil.move(path, target)
    except OSError as exc:
        _remove(target)
        msg = f"cannot keep the file {path} from {server} in {keep_dir}: {exc}"
        raise RunIOError(msg) from exc
    return target


def take_states_file(
    path: Path,
    token_ids: Sequence[int],
    *,
    expected: ExpectedStates,
    server: str,
    conversation: int,
    deadline: float,
    keep_dir: Path | None,
) -> ServedStates:
    """The states of one answer: wait for vLLM's lock (until `deadline`), read and check the
    file under a shared lock, then delete it and its lock, or keep the file in `keep_dir` once
    it passed every check. Whatever happens, nothing of this answer is left but a kept file."""
    fd = wait_for_lock(path, deadline=deadline, server=server)
    kept: Path | None = None
    try:
        if fd is not None and not path.exists():
            msg = (
                f"{server}: vLLM released its lock {lock_path(path)} but the file {path} is not "
                "there: the server failed to write it"
            )
            raise StatesFileFailure(msg)
        states, ids = read_states_file(
            path, token_ids, expected=expected, server=server, conversation=conversation
        )
        kept = None if keep_dir is None else _keep(path, keep_dir, server)
        return ServedStates(states, ids, server, kept)
    finally:
        _remove(lock_path(path))
        if kept != path:
            _remove(path)  # read, refused, or moved away already
        if fd is not None:
            os.close(fd)


def sweep_request_files(storage_dir: Path, request_id: str) -> bool:
    """Delete the files of an abandoned request (``cmpl-{request_id}-*``, the ones vLLM has
    finished with); True when none is left, False while vLLM still holds a lock on one.
    Only this request's files are touched: other clients share the folder."""
    pending = False
    for lock in sorted(storage_dir.glob(f"cmpl-{request_id}-*{_LOCK_SUFFIX}")):
        data = lock.with_name(lock.name.removesuffix(_LOCK_SUFFIX))
        fd = _open_lock(lock)
        if fd is None:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pending = True
        else:
            _remove(data, lock)
        finally:
            os.close(fd)
    for data in storage_dir.glob(f"cmpl-{request_id}-*.safetensors"):
        if not lock_path(data).exists():
            _remove(data)
    return not pending


__all__ = [
    "HIDDEN_STATES",
    "TOKEN_IDS",
    "ExpectedStates",
    "ServedStates",
    "StatesFileFailure",
    "first_difference",
    "lock_path",
    "read_states_file",
    "sweep_request_files",
    "take_states_file",
    "token_mismatch",
    "wait_for_lock",
]
