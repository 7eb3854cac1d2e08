"""Crash-safe files and directories: a reader sees the old content or the whole new one.

Pure standard library (no torch). Every writer of the project that must not leave a partial
file or directory behind uses one of these:

- :func:`write_text_atomic` / :func:`write_bytes_atomic` / :func:`atomic_replace`: files the
  tool owns (``plan.json``, ``metrics.jsonl``, a capture shard): written to a temporary
  sibling, then renamed over the path.
- :func:`write_output`: a path the user named with ``-o``, which may not be a regular file:

  - a regular file (or a new name): atomic, as above;
  - a symlink: the link stays a link; its resolved target gets the new content, atomically;
  - ``/dev/null``, another character or block device, a FIFO or a socket: written through
    (opened and written), as a shell redirection would, never replaced by a regular file;
  - a directory: ``IsADirectoryError``, nothing written.
- :func:`write_new_file`: a file that must not exist yet (``init -o``): complete or not at all,
  never replacing an existing file, even in a race.
- :func:`staged_directory`: a directory (an export, a training checkpoint) built in a hidden
  staging sibling, flushed and renamed into place by :func:`publish_directory`, which
  replaces an old directory only once the new one is complete.
- :func:`remove_stale_staging` / :func:`remove_staging_dirs`: the staging siblings a killed
  writer left, removed by the next writer.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# ---------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------


def temporary_sibling(path: Path) -> Path:
    """A hidden name next to `path`, unique to this process, to write into before renaming."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


@contextmanager
def atomic_replace(path: Path) -> Iterator[Path]:
    """Yield a temporary sibling of `path` to write; it is renamed over `path` on success.

    For writers that take a path (``safetensors.save_file``). On an exception the temporary
    file is removed and `path` keeps its old content (or stays absent).
    """
    tmp = temporary_sibling(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _replace_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_replace(path) as tmp:
        tmp.write_bytes(data)


def write_text_atomic(path: Path, text: str) -> None:
    """Write text to path through a temporary sibling, so a failure leaves no partial file.

    Raises OSError (the folder cannot be created, or is not writable) with nothing left behind.
    """
    _replace_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Like :func:`write_text_atomic`, for bytes."""
    _replace_atomic(path, data)


def write_output(path: Path, data: bytes | str) -> Path:
    """Write `data` (str: UTF-8) to a user-named output path; returns the file written.

    Regular files are replaced atomically; a symlink is followed (the link is kept, its
    target replaced atomically); special files (devices, FIFOs, sockets) are written through.
    Raises OSError (``IsADirectoryError`` for a directory) with no partial file left behind.
    """
    payload = data.encode("utf-8") if isinstance(data, str) else data
    path = Path(path)
    target = path.resolve() if path.is_symlink() else path
    try:
        mode = target.stat().st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    if mode is not None and not stat.S_ISREG(mode):
        # Opened as it is (no O_CREAT, no O_TRUNC): the node stays what it was.
        fd = os.open(target, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        return target
    _replace_atomic(target, payload)
    return target


def write_new_file(path: Path, text: str) -> bool:
    """Write text to a new file at path, complete or not at all; False if path exists.

    The content goes to a temporary sibling first, then is linked into place: creating the
    link fails when the name exists, so an existing file is never replaced, even in a race.
    Raises OSError (the folder cannot be created or written) with nothing left behind.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(path)
    try:
        tmp.write_text(text, encoding="utf-8")
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError:  # no hard links on this file system: exclusive create instead
            try:
                handle = path.open("x", encoding="utf-8")
            except FileExistsError:
                return False
            try:
                with handle:
                    handle.write(text)
            except OSError:
                path.unlink(missing_ok=True)
                raise
        return True
    finally:
        tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# directories
# ---------------------------------------------------------------------------------------------


def staging_name(out_dir: Path, token: str, kind: str = "tmp") -> Path:
    """`.tmp-NAME-PID-TOKEN` next to `out_dir` (`kind` "old" for a retired directory)."""
    return out_dir.with_name(f".{kind}-{out_dir.name}-{os.getpid()}-{token}")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _default_file_mode(directory: Path) -> int:
    """0666 minus the umask, read from a probe file (``os.umask`` would change process state)."""
    probe = directory / f".mode-probe-{uuid.uuid4().hex[:8]}"
    fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    try:
        return stat.S_IMODE(os.fstat(fd).st_mode)
    finally:
        os.close(fd)
        probe.unlink()


def publish_directory(staging: Path, out_dir: Path) -> None:
    """Rename a complete ``staging`` directory to ``out_dir``, replacing an old one last.

    Files get the usual permissions (0666 minus the umask): some writers create private
    (0600) files, which a serving process running as another user could not read.
    """
    mode = _default_file_mode(staging)
    for child in staging.iterdir():
        if child.is_file():
            os.chmod(child, mode)
        _fsync(child)
    _fsync(staging)
    if out_dir.exists() or out_dir.is_symlink():
        if not out_dir.is_dir():
            msg = f"{out_dir} exists and is not a directory; choose another export directory"
            raise FileExistsError(msg)
        retired = staging_name(out_dir, uuid.uuid4().hex[:8], kind="old")
        os.rename(out_dir, retired)
        try:
            os.rename(staging, out_dir)
        except BaseException:
            # The old directory goes back under its name: a failed publish changes nothing.
            os.rename(retired, out_dir)
            raise
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.rename(staging, out_dir)
    _fsync(out_dir.parent)


@contextmanager
def staged_directory(out_dir: Path) -> Iterator[Path]:
    """Yield a new staging directory next to `out_dir`; published there when the block ends.

    The block writes the directory's files into the staging directory; on success it is
    renamed into place by :func:`publish_directory`; on any exception (a crash in the block or
    in publishing) the staging directory is removed and `out_dir` is left as it was.
    """
    staging = staging_name(out_dir, uuid.uuid4().hex[:8])
    staging.mkdir()
    try:
        yield staging
        publish_directory(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


_STAGING_RE = r"^\.(?:tmp|old)-{name}-(?:(\d{{1,10}})-)?[0-9a-f]{{8}}$"


def remove_stale_staging(out_dir: Path) -> list[Path]:
    """Remove staging and retired siblings of `out_dir` left by a killed writer; returns them.

    Staging names carry the pid of their writer; a directory whose writer still runs on this
    host is left alone (a concurrent export), as is anything whose name does not match.
    """
    out_dir = Path(out_dir)
    pattern = re.compile(_STAGING_RE.format(name=re.escape(out_dir.name)))
    removed: list[Path] = []
    try:
        siblings = list(out_dir.parent.iterdir())
    except OSError:
        return removed
    for child in siblings:
        match = pattern.match(child.name)
        if match is None or child.is_symlink() or not child.is_dir():
            continue
        pid = match.group(1)
        if pid is not None and int(pid) != os.getpid() and _alive(int(pid)):
            continue
        shutil.rmtree(child, ignore_errors=True)
        removed.append(child)
    return removed


def remove_staging_dirs(parent: Path, prefix: str) -> None:
    """Remove every directory in `parent` whose name starts with `prefix`.

    For staging directories of a writer that holds a lock on `parent` (a run's checkpoints):
    no other writer can be using them.
    """
    for child in parent.iterdir():
        if child.name.startswith(prefix) and child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


__all__ = [
    "atomic_replace",
    "publish_directory",
    "remove_staging_dirs",
    "remove_stale_staging",
    "staged_directory",
    "staging_name",
    "temporary_sibling",
    "write_bytes_atomic",
    "write_new_file",
    "write_output",
    "write_text_atomic",
]
