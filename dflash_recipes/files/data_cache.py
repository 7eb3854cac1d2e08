"""Where the tokenized-data cache lives, and its entries as `dflash-recipe cache` shows them.

The cache is keyed by content (the input's bytes, the tokenizer, the template, the settings:
:mod:`~dflash_recipes.executor.data.token_cache`), so one folder serves every run of a user:
the second experiment on the same data, every run of a sweep, reads the tokens the first one
made. The folder is decided at compile and recorded in the plan (``data.cache_dir``); a
variable set for `run` alone is not read, and the run says so (:func:`variable_not_used`):

1. ``data.cache_dir`` in the recipe, when set;
2. else ``$DFLASH_RECIPES_CACHE/tokenized`` (:data:`CACHE_ENV`);
3. else ``$XDG_CACHE_HOME/dflash-recipes/tokenized`` (an absolute ``XDG_CACHE_HOME`` only, as
   the XDG base directory rules say);
4. else ``~/.cache/dflash-recipes/tokenized``.

An entry is a folder ``<cache>/<24 hex digits>/`` holding a ``meta.json`` whose ``format`` is
:data:`CACHE_FORMAT_NAME`; builders take the cache folder's lock (:data:`LOCK_NAME`) and stage
entries in hidden ``.tmp-<name>-<pid>-<token>`` siblings. :func:`list_entries` and
:func:`remove_entries` touch nothing else: a folder the project did not make is never listed
or removed, and removing takes the same lock, so an entry is never removed while a build
writes into the folder.

Pure standard library (no torch, no numpy): the CLI's ``cache`` commands import it.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs

from dflash_recipes.errors import DataError, DirectoryLockedError
from dflash_recipes.files.crashsafe import staging_name
from dflash_recipes.files.jsonio import FileReadProblem, JsonProblem, parse_json, read_regular_file
from dflash_recipes.files.locking import hold_directory_lock
from dflash_recipes.records import Record

#: The environment variable naming the project's cache folder (tokenized data goes below it).
CACHE_ENV = "DFLASH_RECIPES_CACHE"
#: The project's folder in the per-user cache ($XDG_CACHE_HOME or ~/.cache).
CACHE_APP_DIR = "dflash-recipes"
#: The tokenized-data cache's folder in the project's cache folder.
TOKENIZED_DIR = "tokenized"
#: ``meta.json``'s ``format`` in every entry this project writes.
CACHE_FORMAT_NAME = "dflash-token-cache"
META_FILE = "meta.json"
#: The lock file of a cache folder (not the run's: a cache may live in an output directory).
LOCK_NAME = ".dflash-data-cache-lock"
#: What an entry's folder is called: the first 24 hex digits of its key's sha256.
_ENTRY_NAME = re.compile(r"^[0-9a-f]{24}$")
#: A staging or retired folder of an entry, left by a killed builder.
_STAGING_NAME = re.compile(r"^\.(?:tmp|old)-[0-9a-f]{24}-(?:\d{1,10}-)?[0-9a-f]{8}$")
#: The most of an entry's meta.json read to describe it (its skipped lines can be many).
_MAX_META_BYTES = 1 << 30


def cache_root(environ: Mapping[str, str] | None = None) -> Path | None:
    """The project's per-user cache folder (absolute), or None when there is no home to put it
    in (no ``HOME`` and no password entry): $DFLASH_RECIPES_CACHE, else
    $XDG_CACHE_HOME/dflash-recipes, else ~/.cache/dflash-recipes."""
    env = os.environ if environ is None else environ
    chosen = env.get(CACHE_ENV, "").strip()
    if chosen:
        return Path(os.path.abspath(os.path.expanduser(chosen)))
    xdg = env.get("XDG_CACHE_HOME", "").strip()
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / CACHE_APP_DIR
    home = env.get("HOME", "").strip() or _password_home()
    if not home or not os.path.isabs(home):
        return None
    return Path(home) / ".cache" / CACHE_APP_DIR


def _password_home() -> str:
    """The home folder of the password database's entry for this user ("" when none)."""
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_dir
    except (ImportError, KeyError, OSError):
        return ""


def default_data_cache_dir(environ: Mapping[str, str] | None = None) -> Path | None:
    """Where tokenized data goes when ``data.cache_dir`` is not set (see the module docstring);
    None when there is no per-user cache folder."""
    root = cache_root(environ)
    return None if root is None else root / TOKENIZED_DIR


def variable_not_used(
    plan_cache_dir: str | None, environ: Mapping[str, str] | None = None
) -> str | None:
    """The warning for a run whose $DFLASH_RECIPES_CACHE names another folder than the plan's
    ``data.cache_dir`` (None when it is unset, agrees, or the plan has no folder).

    The folder is decided when the plan is compiled and the plan's wins at `run`: every rank,
    every requeue of the same plan.json, reads the same entry. A variable set for `run` alone
    would otherwise be ignored without a word.
    """
    env = os.environ if environ is None else environ
    chosen = env.get(CACHE_ENV, "").strip()
    wanted = default_data_cache_dir(env)
    if not chosen or plan_cache_dir is None or wanted is None:
        return None
    if Path(os.path.abspath(plan_cache_dir)) == wanted:
        return None
    return (
        f"warning: {CACHE_ENV} is set ({chosen}, tokenized data in {wanted}), but this run "
        f"reads and writes the plan's data.cache_dir, {plan_cache_dir}: the folder is decided "
        f"when the plan is compiled; to use {wanted}, compile the plan again with {CACHE_ENV} "
        "set (`dflash-recipe run RECIPE` compiles in the run's environment), or set "
        "data.cache_dir"
    )


@attrs.frozen(repr=False, eq=False, slots=False)
class CacheEntry(Record):
    """One folder of a tokenized-data cache, as `dflash-recipe cache list` shows it."""

    name: str
    path: Path
    #: Bytes of every file in the folder.
    size: int
    #: "ready" (an entry), or "incomplete" (a staging folder a killed build left).
    state: str
    #: The input it was made from, its conversations and tokens (None when not known).
    source: str | None = None
    conversations: int | None = None
    tokens: int | None = None
    #: When it was made (the folder's modification time, seconds since the epoch).
    made: float = 0.0


def folder_bytes(path: Path) -> int:
    """Bytes of the regular files under `path` (symlinks are not followed); 0 if unreadable."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                info = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            if stat.S_ISREG(info.st_mode):
                total += info.st_size
    return total


def format_bytes(size: int) -> str:
    """`812 B`, `3.4 MiB`, `1.20 GiB`."""
    if size < 1024:
        return f"{size} B"
    for unit, scale in (("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30), ("TiB", 2**40)):
        if size < scale * 1024 or unit == "TiB":
            value = size / scale
            return f"{value:.2f} {unit}" if value < 10 else f"{value:.1f} {unit}"
    return f"{size} B"  # not reached


def _entry_meta(path: Path) -> dict[str, object] | None:
    """The entry's meta.json when it is one this project wrote, else None."""
    try:
        meta = parse_json(read_regular_file(path / META_FILE, max_bytes=_MAX_META_BYTES))
    except (FileReadProblem, JsonProblem):
        return None
    if not isinstance(meta, dict) or meta.get("format") != CACHE_FORMAT_NAME:
        return None
    return meta


def _count(stats: object, key: str) -> int | None:
    value = stats.get(key) if isinstance(stats, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _describe(path: Path) -> CacheEntry | None:
    """The entry (or leftover staging folder) at `path`; None for anything the project did not
    make (left alone)."""
    if path.is_symlink() or not path.is_dir():
        return None
    try:
        made = path.stat().st_mtime
    except OSError:
        return None
    staging = _STAGING_NAME.match(path.name)
    if staging is not None:
        return CacheEntry(path.name, path, folder_bytes(path), "incomplete", made=made)
    if _ENTRY_NAME.match(path.name) is None:
        return None
    meta = _entry_meta(path)
    if meta is None:
        return None
    source = meta.get("source")
    stats = meta.get("stats")
    return CacheEntry(
        name=path.name,
        path=path,
        size=folder_bytes(path),
        state="ready",
        source=source if isinstance(source, str) else None,
        conversations=_count(stats, "conversations_used"),
        tokens=_count(stats, "num_tokens"),
        made=made,
    )


def list_entries(cache_dir: Path) -> list[CacheEntry]:
    """The entries (and leftover staging folders) of `cache_dir`, oldest first; nothing else
    in the folder is listed. A folder that does not exist has none."""
    try:
        children = sorted(cache_dir.iterdir())
    except FileNotFoundError:
        return []
    except OSError as exc:
        msg = f"cannot list the tokenized data cache {cache_dir}: {exc.strerror or exc}"
        raise DataError(msg) from None
    entries = [entry for child in children if (entry := _describe(child)) is not None]
    return sorted(entries, key=lambda e: (e.made, e.name))


def remove_entries(
    cache_dir: Path, names: Sequence[str] = (), *, every: bool = False
) -> list[CacheEntry]:
    """Remove the entries `names` of `cache_dir` (all of them with `every`), under the cache
    folder's lock; the entries removed.

    Raises DataError, removing nothing, when a name is not an entry this project made in that
    folder, or when a build holds the lock (it writes there now).
    """
    if not cache_dir.is_dir() and not names:
        return []  # nothing to remove, and no folder made by taking its lock
    try:
        lock = hold_directory_lock(cache_dir, purpose="data cache removal", lock_name=LOCK_NAME)
        with lock:
            entries = {e.name: e for e in list_entries(cache_dir)}
            unknown = [name for name in names if name not in entries]
            if unknown:
                shown = ", ".join(sorted(entries)[:8]) or "none"
                msg = (
                    f"{', '.join(unknown)}: not an entry of the tokenized data cache {cache_dir} "
                    f"(its entries: {shown}); nothing was removed (`dflash-recipe cache list` "
                    "lists them)"
                )
                raise DataError(msg)
            chosen = list(entries.values()) if every else [entries[name] for name in names]
            for entry in chosen:
                # a rename first: a reader never sees a half-removed entry under its name
                retired = entry.path
                if entry.state == "ready":
                    retired = staging_name(entry.path, os.urandom(4).hex(), kind="old")
                    entry.path.rename(retired)
                shutil.rmtree(retired)
            return chosen
    except DirectoryLockedError as exc:
        msg = f"the tokenized data cache {cache_dir} is being built into: {exc}"
        raise DataError(msg) from None
    except OSError as exc:
        msg = f"cannot remove from the tokenized data cache {cache_dir}: {exc.strerror or exc}"
        raise DataError(msg) from None


def describe_entry(path: Path, *, built: bool) -> str:
    """The run log's line about the entry a run reads: where it is and how big."""
    how = "new" if built else "reused"
    return (
        f"tokenized data: {path} ({format_bytes(folder_bytes(path))}, {how}); "
        "`dflash-recipe cache list` shows every entry, `dflash-recipe cache rm` removes them"
    )


def age(made: float, now: float | None = None) -> str:
    """How long ago `made` was, roughly: `5 min`, `3 h`, `12 days`."""
    seconds = max(0.0, (time.time() if now is None else now) - made)
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.0f} h"
    return f"{seconds / 86400:.0f} days"


__all__ = [
    "CACHE_APP_DIR",
    "CACHE_ENV",
    "CACHE_FORMAT_NAME",
    "LOCK_NAME",
    "META_FILE",
    "TOKENIZED_DIR",
    "CacheEntry",
    "age",
    "cache_root",
    "default_data_cache_dir",
    "describe_entry",
    "folder_bytes",
    "format_bytes",
    "list_entries",
    "remove_entries",
    "variable_not_used",
]
