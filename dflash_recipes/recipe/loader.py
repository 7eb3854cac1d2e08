"""Load a recipe from a file (or text) plus `a.b.c=value` overrides, with diagnostics.

:func:`load_recipe_with_diagnostics` never raises for a user's mistake: a missing file, a
folder, an empty file, invalid UTF-8, bad YAML or bad overrides each become a diagnostic.
:func:`load_recipe` raises :class:`~dflash_recipes.errors.RecipeError` carrying them all.

Overrides name an existing dotted path of the schema; the value is read as a one-line YAML
flow scalar or flow list with the same strict resolver as files (`training.max_steps=null`,
`dflash.dflash_architecture_config.target_layer_ids=[1,9,17]`), merged into the file's data
and structured by the same converter, so an override is checked exactly like a file value.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs

from dflash_recipes.diagnostics import (
    Diagnostic,
    Severity,
    SourceMap,
    SourceMark,
    has_errors,
    register_code,
)
from dflash_recipes.errors import RecipeError
from dflash_recipes.files.jsonio import FileReadProblem, clip, read_regular_file
from dflash_recipes.recipe.converter import closest_name, recipe_field_paths, structure_recipe
from dflash_recipes.recipe.sections import Recipe
from dflash_recipes.recipe.yamlio import load_yaml
from dflash_recipes.records import Record

EMPTY_RECIPE = register_code(
    "empty-recipe", Severity.ERROR, "The recipe file is empty or holds only comments."
)
RECIPE_NOT_FOUND = register_code(
    "recipe-not-found", Severity.ERROR, "The recipe path does not exist."
)
RECIPE_IS_DIRECTORY = register_code(
    "recipe-is-directory", Severity.ERROR, "The recipe path is a folder, not a YAML file."
)
RECIPE_UNREADABLE = register_code(
    "recipe-unreadable", Severity.ERROR, "The recipe file exists but cannot be read (permissions)."
)
RECIPE_NOT_A_FILE = register_code(
    "recipe-not-a-file",
    Severity.ERROR,
    "The recipe path is a FIFO, socket or device, not a regular file (it is never opened).",
)
RECIPE_TOO_LARGE = register_code(
    "recipe-too-large",
    Severity.ERROR,
    "The recipe file is larger than 1 MiB; recipes are a few hundred bytes of YAML.",
)
#: Recipe files larger than this are refused before they are read.
RECIPE_MAX_BYTES = 2**20
INVALID_UTF8 = register_code("invalid-utf8", Severity.ERROR, "The recipe file is not UTF-8 text.")
BAD_OVERRIDE = register_code(
    "bad-override",
    Severity.ERROR,
    "An override is not `path=value`, names a whole section, or has a value that is not a "
    "one-line YAML scalar or flat list.",
)
UNKNOWN_OVERRIDE_PATH = register_code(
    "unknown-override-path",
    Severity.ERROR,
    "An override names a path the recipe schema does not have.",
)

_MINIMAL_RECIPE = "model:\n  model_name_or_path: <local Hugging Face model dir>"


@attrs.frozen(repr=False, eq=False, slots=False)
class LoadResult(Record):
    """What loading produced: the recipe (None on errors), every diagnostic, and the marks."""

    recipe: Recipe | None
    diagnostics: tuple[Diagnostic, ...]
    source: SourceMap
    #: The recipe file, absolute (`<string>` or the given name for text).
    file: str
    overrides: tuple[str, ...]

    @property
    def ok(self) -> bool:
        """A recipe was produced and no diagnostic is an error."""
        return self.recipe is not None and not has_errors(self.diagnostics)


@attrs.frozen(repr=False, eq=False, slots=False)
class _Override(Record):
    label: str
    path: str
    value: object


def _override_label(number: int) -> str:
    return f"<override {number}>"


def _override_diagnostic(label: str, code: str, path: str, message: str, hint: str) -> Diagnostic:
    return Diagnostic(
        severity=Severity.ERROR, code=code, path=path, message=message, hint=hint, file=label
    )


def _children(parent: str, paths: set[str]) -> list[str]:
    prefix = f"{parent}." if parent else ""
    return sorted(
        p[len(prefix) :] for p in paths if p.startswith(prefix) and "." not in p[len(prefix) :]
    )


def _unknown_path_hint(path: str, paths: set[str]) -> str:
    parent, _, leaf = path.rpartition(".")
    if parent in paths and not _children(parent, paths):
        return f"{parent} is set as a whole: {parent}=<value>"
    same_leaf = sorted(p for p in paths if p.rpartition(".")[2] == leaf)
    if same_leaf:
        return f"did you mean {' or '.join(same_leaf)}?"
    if parent in paths or not parent:
        siblings = _children(parent, paths)
        guess = closest_name(leaf, siblings)
        if guess is not None:
            return f"did you mean {parent + '.' if parent else ''}{guess}?"
        where = f"{parent} has" if parent else "the sections are"
        return f"{where}: {', '.join(siblings)}"
    guess = closest_name(path, paths)
    if guess is not None:
        return f"did you mean {guess}?"
    return f"a path starts with a section: {', '.join(_children('', paths))}"


def _parse_override(number: int, text: str, paths: set[str]) -> _Override | Diagnostic:
    label = _override_label(number)
    name, equals, raw = text.partition("=")
    path = name.strip()
    if not equals or not path:
        return _override_diagnostic(
            label,
            BAD_OVERRIDE,
            "",
            f"override {text!r} is not of the form path=value",
            "write it as section.key=value, for example training.learning_rate=1e-4",
        )
    if path not in paths:
        return _override_diagnostic(
            label,
            UNKNOWN_OVERRIDE_PATH,
            path,
            f"override path {path!r} is not a recipe field",
            _unknown_path_hint(path, paths),
        )
    fields = [p for p in sorted(paths) if p.startswith(f"{path}.") and not _children(p, paths)]
    if fields:
        return _override_diagnostic(
            label,
            BAD_OVERRIDE,
            path,
            f"{path} is a section; an override sets one field",
            f"override its fields one at a time, for example {fields[0]}=<value>",
        )
    value_hint = (
        "write a number, true/false, null, a string or a flow list such as [1, 9, 17]; "
        "quote strings that contain ': ' or ' #'"
    )
    if "\n" in raw or "\r" in raw:
        return _override_diagnostic(
            label, BAD_OVERRIDE, path, "an override value must be on one line", value_hint
        )
    try:
        value, _ = load_yaml(raw, filename=label)
    except RecipeError as exc:
        reason = exc.diagnostics[0].message if exc.diagnostics else str(exc)
        return _override_diagnostic(
            label,
            BAD_OVERRIDE,
            path,
            f"cannot read the value {raw.strip()!r}: {reason}",
            value_hint,
        )
    if isinstance(value, dict) or (
        isinstance(value, list) and any(isinstance(item, dict | list) for item in value)
    ):
        return _override_diagnostic(
            label,
            BAD_OVERRIDE,
            path,
            f"the value {raw.strip()!r} is a YAML mapping or nested list; an override sets "
            "one scalar or a flat list",
            value_hint,
        )
    return _Override(label=label, path=path, value=value)


def _apply(data: dict[str, object], marks: dict[str, SourceMark], override: _Override) -> None:
    """Set `override.path` in `data`, creating absent sections; mark it as the override's."""
    *parents, leaf = override.path.split(".")
    node = data
    for key in parents:
        if key not in node:
            node[key] = {}
        child = node[key]
        if not isinstance(child, dict):
            return  # the file's own value is not a mapping; structuring reports that
        node = child
    node[leaf] = override.value
    prefix = f"{override.path}."
    for stale in [p for p in marks if p == override.path or p.startswith(prefix)]:
        del marks[stale]
    mark = SourceMark(file=override.label)
    marks[override.path] = mark
    if isinstance(override.value, list):
        for index in range(len(override.value)):
            marks[f"{override.path}.{index}"] = mark


def _parse_overrides(overrides: Sequence[str]) -> tuple[list[_Override], list[Diagnostic]]:
    if not overrides:
        return [], []
    paths = recipe_field_paths()
    parsed: list[_Override] = []
    problems: list[Diagnostic] = []
    for number, text in enumerate(overrides, start=1):
        outcome = _parse_override(number, text, paths)
        if isinstance(outcome, Diagnostic):
            problems.append(outcome)
        else:
            parsed.append(outcome)
    return parsed, problems


def recipe_from_text(
    text: str, *, filename: str = "<string>", overrides: Sequence[str] = ()
) -> LoadResult:
    """Load a recipe from YAML text, named `filename` in diagnostics; never raises on bad data."""
    overrides = tuple(overrides)
    parsed, override_problems = _parse_overrides(overrides)

    def finish(
        recipe: Recipe | None, diagnostics: Sequence[Diagnostic], marks: Mapping[str, SourceMark]
    ) -> LoadResult:
        return LoadResult(
            recipe=recipe if not override_problems else None,
            diagnostics=(*diagnostics, *override_problems),
            source=SourceMap(file=filename, marks=dict(marks)),
            file=filename,
            overrides=overrides,
        )

    try:
        data, marks = load_yaml(text, filename=filename)
    except RecipeError as exc:
        return finish(None, exc.diagnostics, {})
    if data is None:
        empty = Diagnostic(
            severity=Severity.ERROR,
            code=EMPTY_RECIPE,
            path="",
            message="the recipe is empty",
            hint=f"a recipe needs at least:\n{_MINIMAL_RECIPE}",
            file=filename,
        )
        return finish(None, [empty], marks)
    if isinstance(data, dict):
        for override in parsed:
            _apply(data, marks, override)
    source = SourceMap(file=filename, marks=marks)
    recipe, diagnostics = structure_recipe(data, source=source)
    return finish(recipe, diagnostics, marks)


def _file_problem(code: str, display: str, message: str, hint: str) -> Diagnostic:
    return Diagnostic(
        severity=Severity.ERROR, code=code, path="", message=message, hint=hint, file=display
    )


def _not_found_hint(path: Path, display: str) -> str:
    folder = path.parent
    if not folder.is_dir():
        return f"the folder {os.path.dirname(display) or '.'} does not exist either; check the path"
    siblings = [p.name for p in folder.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file()]
    guess = closest_name(path.name, siblings)
    if guess is not None:
        return f"did you mean {os.path.join(os.path.dirname(display), guess)}?"
    return f"check the path (relative paths start from {os.getcwd()})"


def _directory_hint(path: Path, display: str) -> str:
    recipes = sorted(p.name for p in path.iterdir() if p.suffix in (".yaml", ".yml"))
    if recipes:
        example = os.path.join(display, recipes[0])
        return (
            f"pass one recipe file, for example {example} "
            f"(`dflash-recipe lint {display}` checks every recipe in the folder)"
        )
    return "pass the path of a recipe .yaml file"


def _read_problem(problem: FileReadProblem, path: Path, display: str) -> Diagnostic:
    if problem.missing:
        return _file_problem(
            RECIPE_NOT_FOUND,
            display,
            f"recipe file {display} does not exist",
            _not_found_hint(path, display),
        )
    if "not a regular file" in problem.reason:
        return _file_problem(
            RECIPE_NOT_A_FILE,
            display,
            f"recipe path {display}: {problem.reason}",
            "pass the path of a recipe .yaml file (nothing was read from this one)",
        )
    if "larger than the limit" in problem.reason:
        return _file_problem(
            RECIPE_TOO_LARGE,
            display,
            f"recipe file {display}: {problem.reason}",
            "a recipe is a short YAML file; check that this is the file you meant",
        )
    return _file_problem(
        RECIPE_UNREADABLE,
        display,
        f"cannot read recipe file {display}: {problem.reason}",
        "check the file's permissions",
    )


def _invalid_utf8(raw: bytes, error: UnicodeDecodeError, display: str) -> Diagnostic:
    start = error.start
    line_start = raw.rfind(b"\n", 0, start) + 1
    line = raw.count(b"\n", 0, start) + 1
    column = len(raw[line_start:start].decode("utf-8", errors="replace")) + 1
    return Diagnostic(
        severity=Severity.ERROR,
        code=INVALID_UTF8,
        path="",
        message=f"the file is not UTF-8 text: byte 0x{raw[start]:02x} cannot be decoded",
        hint="save the file as UTF-8 (editors: 'Save with encoding' -> UTF-8)",
        file=display,
        line=line,
        column=column,
    )


def load_recipe_with_diagnostics(
    path: str | os.PathLike[str], overrides: Sequence[str] = ()
) -> LoadResult:
    """Load a recipe file plus overrides; every user error becomes a diagnostic, none raises.

    Diagnostics name the file as given (so editors and CI can open it); `LoadResult.file` is
    the absolute path.
    """
    display = os.fspath(path)
    absolute = os.path.abspath(display)
    overrides = tuple(overrides)
    recipe_path = Path(absolute)

    def failed(diagnostic: Diagnostic) -> LoadResult:
        _, override_problems = _parse_overrides(overrides)
        return LoadResult(
            recipe=None,
            diagnostics=(diagnostic, *override_problems),
            source=SourceMap(file=display),
            file=absolute,
            overrides=overrides,
        )

    try:
        is_folder = recipe_path.is_dir()
    except OSError as exc:  # e.g. a file name too long for the file system
        return failed(
            _file_problem(
                RECIPE_UNREADABLE,
                display,
                f"cannot read recipe file {clip(display)}: {exc.strerror or exc}",
                "check the path",
            )
        )
    if is_folder:
        return failed(
            _file_problem(
                RECIPE_IS_DIRECTORY,
                display,
                f"{display} is a folder, not a recipe file",
                _directory_hint(recipe_path, display),
            )
        )
    try:
        raw = read_regular_file(recipe_path, max_bytes=RECIPE_MAX_BYTES)
    except FileReadProblem as problem:
        return failed(_read_problem(problem, recipe_path, display))
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        return failed(_invalid_utf8(raw, exc, display))
    result = recipe_from_text(text, filename=display, overrides=overrides)
    return attrs.evolve(result, file=absolute)


def load_recipe(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> Recipe:
    """Load a recipe file plus overrides, or raise :class:`RecipeError` with every diagnostic."""
    result = load_recipe_with_diagnostics(path, overrides)
    if result.recipe is None or has_errors(result.diagnostics):
        errors = sum(1 for d in result.diagnostics if d.severity is Severity.ERROR)
        msg = f"recipe {os.fspath(path)} has {errors} error{'s' if errors != 1 else ''}"
        raise RecipeError(msg, result.diagnostics)
    return result.recipe


__all__ = [
    "LoadResult",
    "load_recipe",
    "load_recipe_with_diagnostics",
    "recipe_from_text",
]
