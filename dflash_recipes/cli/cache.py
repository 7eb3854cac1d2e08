"""`dflash-recipe cache list | rm`: the tokenized-data cache every run shares.

Torch-free: it reads the entries' ``meta.json`` and sizes
(:mod:`~dflash_recipes.files.data_cache`), never their tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from dflash_recipes.cli.group import EXIT_USAGE, _fail, main
from dflash_recipes.files.data_cache import (
    CACHE_ENV,
    CacheEntry,
    age,
    default_data_cache_dir,
    format_bytes,
    list_entries,
    remove_entries,
)

_CACHE_DIR = click.option(
    "--cache-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help=f"The cache folder (a recipe's data.cache_dir); default: ${CACHE_ENV}/tokenized, else "
    "$XDG_CACHE_HOME/dflash-recipes/tokenized, else ~/.cache/dflash-recipes/tokenized.",
)


def _folder(cache_dir: Path | None) -> Path:
    if cache_dir is not None:
        return cache_dir.absolute()
    default = default_data_cache_dir()
    if default is None:
        _fail(f"there is no home folder to hold the cache: pass --cache-dir or set {CACHE_ENV}")
    return default


@main.group("cache")
def cache_group() -> None:
    """The tokenized-data cache that every run shares (see `data.cache_dir`).

    \b
    Examples:
      dflash-recipe cache list
      dflash-recipe cache rm 3f9c0a1b2c3d4e5f60718293
      dflash-recipe cache rm --all
    """


def _line(entry: CacheEntry) -> str:
    if entry.state != "ready":
        what = "incomplete (left by a build that was stopped)"
    else:
        counts = []
        if entry.conversations is not None:
            counts.append(f"{entry.conversations:,} conversations")
        if entry.tokens is not None:
            counts.append(f"{entry.tokens:,} tokens")
        what = ", ".join(counts) + (f" of {entry.source}" if entry.source else "")
    return f"  {entry.name}  {format_bytes(entry.size):>10}  {age(entry.made):>8} old  {what}"


@cache_group.command("list")
@_CACHE_DIR
@click.option("--json", "as_json", is_flag=True, help="Print the entries as JSON.")
def list_command(cache_dir: Path | None, as_json: bool) -> None:
    """List the entries: name, size, age, conversations and tokens, and the input."""
    folder = _folder(cache_dir)
    entries = list_entries(folder)
    total = sum(e.size for e in entries)
    if as_json:
        rows = [
            {
                "name": e.name,
                "path": str(e.path),
                "bytes": e.size,
                "state": e.state,
                "source": e.source,
                "conversations": e.conversations,
                "tokens": e.tokens,
                "made": e.made,
            }
            for e in entries
        ]
        click.echo(json.dumps({"cache_dir": str(folder), "bytes": total, "entries": rows}))
        return
    count = f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}"
    click.echo(f"tokenized-data cache {folder}: {count}, {format_bytes(total)}")
    for entry in entries:
        click.echo(_line(entry))


@cache_group.command("rm")
@click.argument("names", nargs=-1)
@click.option("--all", "every", is_flag=True, help="Remove every entry.")
@_CACHE_DIR
def rm_command(names: tuple[str, ...], every: bool, cache_dir: Path | None) -> None:
    """Remove entries by name (as `cache list` shows them), or --all of them.

    Only entries dflash-recipes made are removed, under the cache folder's lock (a build in
    progress is waited for by nobody: the command refuses instead). A run that needs a removed
    entry tokenizes its data again.
    """
    if bool(names) == every:
        _fail(
            "name the entries to remove (as `dflash-recipe cache list` shows them), or pass --all",
            EXIT_USAGE,
        )
    folder = _folder(cache_dir)
    removed = remove_entries(folder, names, every=every)
    for entry in removed:
        click.echo(f"removed {entry.path} ({format_bytes(entry.size)})")
    freed = format_bytes(sum(e.size for e in removed))
    click.echo(f"removed {len(removed)} entr{'y' if len(removed) == 1 else 'ies'}, {freed} freed")


__all__ = ["cache_group"]
