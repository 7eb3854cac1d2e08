"""Which directories an export may replace, and how it recognises its own earlier exports.

`dflash-recipe export CKPT DIR` (and the export at the end of `run`) publishes a new directory
by renaming it over ``DIR``. That deletes whatever ``DIR`` held, so the rule is narrow:

- a missing or empty ``DIR``, or an earlier export, is replaced;
- any other directory is refused, unless ``force`` (``--force``) says the user means it;
- never, even with ``force``: a run directory (``plan.json``, ``metrics.jsonl``, the run
  lock, checkpoints), a training checkpoint, a directory holding the checkpoint being
  exported, the current directory or one above it, the home directory, a symlink, a file.

An export is recognised by the marker file it writes (:data:`EXPORT_MARKER`), which lists the
files the export wrote: a directory is an earlier export only if it holds nothing else. An
export written before the marker existed is recognised by holding exactly ``config.json`` and
``model.safetensors`` (and possibly ``dflash.py``) with ``architectures: ["DFlashDraftModel"]``.

Pure standard library (no torch): the CLI checks before any model is built.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from dflash_recipes.checkpoint.model_files import CONFIG_FILE, WEIGHTS_FILE, WEIGHTS_INDEX_FILE
from dflash_recipes.errors import ReplaceRefusedError
from dflash_recipes.files.locking import LOCK_FILE
from dflash_recipes.files.run_dir import (
    CHECKPOINT_PREFIX,
    METRICS_FILE,
    OPTIMIZER_STATE,
    PLAN_FILE,
    TMP_PREFIX,
    TRAINER_STATE,
)

#: Written into every export; lists the files the export wrote (JSON).
EXPORT_MARKER = ".dflash-export.json"

#: The files of an export written before the marker existed (``dflash.py``: remote code,
#: which some of those exports carry).
_LEGACY_EXPORT_FILES = frozenset({CONFIG_FILE, WEIGHTS_FILE})
_LEGACY_OPTIONAL_FILES = frozenset({"dflash.py"})
_ARCHITECTURE = "DFlashDraftModel"
_MAX_MARKER_BYTES = 64 * 1024
_MAX_CONFIG_BYTES = 1024 * 1024


def export_marker_text(files: Iterable[str]) -> str:
    """The marker's JSON for an export made of `files` (names inside the export directory)."""
    return json.dumps({"dflash_export": 1, "files": sorted(files)}, indent=2) + "\n"


def _read_json(path: Path, limit: int) -> object:
    try:
        if not path.is_file() or path.stat().st_size > limit:
            return None
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None


def is_earlier_export(directory: Path) -> bool:
    """True if `directory` holds an export this tool wrote and nothing besides it."""
    try:
        names = {child.name for child in directory.iterdir()}
    except OSError:
        return False
    marker = _read_json(directory / EXPORT_MARKER, _MAX_MARKER_BYTES)
    if isinstance(marker, dict) and isinstance(marker.get("files"), list):
        listed = {name for name in marker["files"] if isinstance(name, str)}
        return names <= listed | {EXPORT_MARKER}
    if names - _LEGACY_OPTIONAL_FILES != _LEGACY_EXPORT_FILES:
        return False
    config = _read_json(directory / CONFIG_FILE, _MAX_CONFIG_BYTES)
    return isinstance(config, dict) and config.get("architectures") == [_ARCHITECTURE]


def export_evidence(directory: Path) -> str | None:
    """Why `directory` holds a drafter export (None if it does not): this tool's marker, or a
    drafter's config.json (its `dflash_config`, or an ``architectures`` entry naming a
    ``...DraftModel``) beside its weights, whatever else the folder holds.

    Such a folder is never a training run's output_dir: the run would write its plan,
    checkpoints and metrics beside the export, and :func:`check_export_target` would then
    refuse to replace it as a run directory.
    """
    try:
        names = {child.name for child in directory.iterdir()}
    except (OSError, ValueError):  # ValueError: a path with a NUL byte (its own error says so)
        return None
    if EXPORT_MARKER in names:
        return f"its {EXPORT_MARKER}"
    weights = next((n for n in (WEIGHTS_FILE, WEIGHTS_INDEX_FILE) if n in names), None)
    if weights is None or CONFIG_FILE not in names:
        return None
    config = _read_json(directory / CONFIG_FILE, _MAX_CONFIG_BYTES)
    if not isinstance(config, dict):
        return None
    architectures = config.get("architectures")
    drafters = [
        name
        for name in (architectures if isinstance(architectures, list) else [])
        if isinstance(name, str) and name.endswith("DraftModel")
    ]
    if drafters:
        return f"{weights} and a {CONFIG_FILE} of architectures {drafters[0]}"
    if isinstance(config.get("dflash_config"), dict):
        return f"{weights} and a {CONFIG_FILE} with a dflash_config"
    return None


def run_directory_evidence(directory: Path) -> str | None:
    """Why `directory` is a run directory or a training checkpoint (None if it is neither)."""
    try:
        children = list(directory.iterdir())
    except OSError:
        return None
    names = {child.name for child in children}
    for name in (PLAN_FILE, METRICS_FILE, LOCK_FILE, TRAINER_STATE, OPTIMIZER_STATE):
        if name in names:
            return f"it holds {name}"
    for name in sorted(names):
        if name.startswith((CHECKPOINT_PREFIX, TMP_PREFIX + CHECKPOINT_PREFIX)):
            return f"it holds the training checkpoint {name}"
    return None


def _is_within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def check_export_target(
    out_dir: Path, *, force: bool = False, sources: Sequence[Path] = ()
) -> None:
    """Raise :class:`ReplaceRefusedError` unless an export may be published at `out_dir`.

    `sources` are directories the export reads (the checkpoint), which it must never replace.
    """
    out_dir = Path(out_dir)
    if out_dir.is_symlink():
        msg = (
            f"export directory {out_dir} is a symlink; pass the directory it points to "
            f"({os.path.realpath(out_dir)}) or a new path"
        )
        raise ReplaceRefusedError(msg)
    if out_dir.exists() and not out_dir.is_dir():
        msg = f"export directory {out_dir} exists and is not a directory; choose another path"
        raise ReplaceRefusedError(msg)
    resolved = out_dir.resolve()
    try:
        cwd: Path | None = Path.cwd().resolve()
    except OSError:  # the current directory was deleted: nothing to protect there
        cwd = None
    if (cwd is not None and _is_within(cwd, resolved)) or resolved == Path.home().resolve():
        what = "the home directory" if resolved == Path.home().resolve() else "the current one"
        msg = (
            f"refusing to export into {out_dir}: replacing it would delete {what} and "
            "everything below it; pass a new directory, e.g. drafter-export/"
        )
        raise ReplaceRefusedError(msg)
    for source in sources:
        if _is_within(Path(source).resolve(), resolved):
            msg = (
                f"refusing to export into {out_dir}: it holds {source}, which this export "
                "reads and replacing the directory would delete; pass a new directory"
            )
            raise ReplaceRefusedError(msg)
    if not out_dir.exists():
        return
    try:
        empty = not any(out_dir.iterdir())
    except OSError as exc:
        msg = f"export directory {out_dir} cannot be listed: {exc.strerror or exc}"
        raise ReplaceRefusedError(msg) from exc
    if empty:
        return
    evidence = run_directory_evidence(out_dir)
    if evidence is not None:
        msg = (
            f"refusing to export into {out_dir}: it is a training run directory ({evidence}) "
            "and an export replaces its whole target, even with --force; pass a new "
            "directory, e.g. its export/ subdirectory"
        )
        raise ReplaceRefusedError(msg)
    if force or is_earlier_export(out_dir):
        return
    msg = (
        f"refusing to export into {out_dir}: it is not empty and is not an earlier export, "
        "and an export replaces the whole directory; pass a new or empty directory, or "
        "--force to delete what it holds"
    )
    raise ReplaceRefusedError(msg)


__all__ = [
    "EXPORT_MARKER",
    "check_export_target",
    "export_evidence",
    "export_marker_text",
    "is_earlier_export",
    "run_directory_evidence",
]
