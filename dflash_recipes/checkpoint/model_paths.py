"""Where a recipe's model paths point: local-path resolution, hub ids and directory checks.

Paths in recipes are resolved with :func:`resolve_local_path`: `~` is expanded and a relative
path is taken relative to the recipe's folder (`base_dir`), not the shell's working directory,
so a recipe means the same thing wherever `dflash-recipe` is run from. Recipes built in Python
(no file) resolve relative paths against the current working directory.

:func:`inspect_checkpoint_dir` and :func:`inspect_model_dir` say, without raising, why a
directory cannot be used (missing, a hub id, a broken link, empty, no weights or config.json)
and how to fix it. Pure stdlib + attrs: nothing here reads a file's content.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

import attrs

from dflash_recipes.checkpoint.model_files import CONFIG_FILE, WEIGHTS_FILE, WEIGHTS_INDEX_FILE
from dflash_recipes.errors import CheckpointError
from dflash_recipes.records import Record

#: Directory listings in messages show at most this many names.
_LISTING_LIMIT = 12

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
_HUB_ID_RE = r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$"


#: A Hugging Face cache folder names its repository: models--OWNER--NAME, datasets--OWNER--NAME.
_CACHE_REPO = r"^(models|datasets)--([A-Za-z0-9][\w.-]*)--([\w.-]+)$"


def hub_id_from_cache_path(path: str | None, kind: str) -> str | None:
    """``OWNER/NAME`` when `path` lies in a Hugging Face cache folder of `kind` (models,
    datasets), e.g. ``.../hub/models--Qwen--Qwen3-8B/snapshots/<sha>``; else None.

    The model card's base_model and datasets, and the name a served target answers to."""
    if path is None:
        return None
    for part in reversed(Path(path).parts):
        match = re.match(_CACHE_REPO, part)
        if match and match.group(1) == kind:
            return f"{match.group(2)}/{match.group(3)}"
    return None


@attrs.frozen(repr=False, eq=False, slots=False)
class CheckpointDirProblem(Record):
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
    return bool(re.match(_HUB_ID_RE, value)) and not value.startswith(".")


def describe_directory(directory: Path, limit: int = _LISTING_LIMIT) -> str:
    """What `directory` holds, for a message: 'N entries: a, b/, ...' (bounded), or why not."""
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


@attrs.frozen(repr=False, eq=False, slots=False)
class _Requirement(Record):
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
    accepted=(WEIGHTS_FILE, WEIGHTS_INDEX_FILE),
    expected=(
        f"an exported DFlash drafter: {WEIGHTS_FILE} (or {WEIGHTS_INDEX_FILE} with its "
        f"shards) and {CONFIG_FILE}"
    ),
    hub_hint="stage the drafter first: hf download {value} --local-dir <dir>, then use <dir>",
)

_MODEL_REQUIREMENT = _Requirement(
    noun="base model",
    kind_missing="no-config",
    accepted=(CONFIG_FILE,),
    expected=f"a Hugging Face model directory with {CONFIG_FILE} (weights are needed to run)",
    hub_hint="stage the model first: hf download {value} --local-dir <dir>, then use <dir>",
)


def inspect_checkpoint_dir(value: str, *, base_dir: Path | None) -> CheckpointDirProblem | None:
    """Check that `value` names a local directory holding drafter weights; None when it does.

    Accepts `model.safetensors` or `model.safetensors.index.json` (the shards themselves are
    checked by :func:`~dflash_recipes.checkpoint.weight_index.read_checkpoint_weights`). Relative
    values resolve under `base_dir`, the recipe's folder (see :func:`resolve_local_path`).
    Never raises for filesystem trouble: each problem comes back as a CheckpointDirProblem
    with a message and a fix.
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
    if Path(value).expanduser().is_absolute():
        hint = (
            f"check the path, or stage the {need.noun} there: hf download <repo> --local-dir {path}"
        )
    else:
        base = "the recipe's folder" if base_dir is not None else "the working directory"
        hint = f"check the path (a relative path is resolved against {base}, here {path})"
    parent = path.parent
    if parent.is_dir():
        try:
            siblings = [c.name for c in parent.iterdir()]
        except OSError:
            siblings = []
        import difflib  # only on an error path: kept off the start-up of every command

        close = difflib.get_close_matches(path.name, siblings, n=1)
        if close:
            hint = f"did you mean {parent / close[0]}?"
        else:
            hint = f"{parent} holds {describe_directory(parent)}"
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
        f"{need.noun} directory {path} has no {wanted}; it holds {describe_directory(path)}",
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
    "CheckpointDirProblem",
    "ProblemKind",
    "describe_directory",
    "hub_id_from_cache_path",
    "inspect_checkpoint_dir",
    "inspect_model_dir",
    "looks_like_hub_id",
    "resolve_checkpoint_dir",
    "resolve_local_path",
]
