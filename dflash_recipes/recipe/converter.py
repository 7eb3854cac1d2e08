"""Recipe structuring (plain data to the attrs classes): the strict policy lives here.

Policy, applied at every level of a recipe:

- unknown keys are errors, with a did-you-mean (or the section the key belongs to);
- nothing is coerced: ``"false"`` is not a bool, ``2.7`` and ``true`` are not ints, ``5`` and
  null are not strings (null is accepted only by Optional fields); the one widening is that an
  int is accepted where a float is expected; YAML lists become tuples for ``tuple[int, ...]``;
- Literal fields accept only their listed values;
- the single-field validators (:mod:`dflash_recipes.recipe.validators`) run on every field, and
  each failure is reported at the field's dotted path;
- every problem is collected, so one run reports all of them.

The rules raise :class:`StructureProblems` (with dotted paths); :func:`structure_recipe` turns
them into diagnostics located through a :class:`~dflash_recipes.diagnostics.SourceMap`.

This was a cattrs converter; every rule was already the project's own, and cattrs only chose
the rule by type. :func:`structure` now does that dispatch itself (a recipe has five kinds of
field type), so `compile` and `lint` no longer import cattrs or generate hooks at start-up
(issue 15). Plans are still read through cattrs (:mod:`dflash_recipes.plan.run_plan`).
"""

from __future__ import annotations

import contextlib
import functools
import re
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from typing import Any, Literal, NoReturn, get_args, get_origin

import attr
import attrs

from dflash_recipes.diagnostics import (
    Diagnostic,
    Severity,
    SourceMap,
    register_code,
    sort_diagnostics,
)
from dflash_recipes.recipe.json_schema import class_field_docs, field_types
from dflash_recipes.recipe.sections import Recipe
from dflash_recipes.records import Record

UNKNOWN_KEY = register_code(
    "unknown-key",
    Severity.ERROR,
    "A key the recipe schema does not define (a typo or the wrong section).",
)
WRONG_TYPE = register_code(
    "wrong-type",
    Severity.ERROR,
    "A value of the wrong type; recipes never convert one type into another.",
)
MISSING_FIELD = register_code(
    "missing-field",
    Severity.ERROR,
    "A required key or section is absent (model.model_name_or_path).",
)
INVALID_VALUE = register_code(
    "invalid-value",
    Severity.ERROR,
    "A value of the right type that breaks the field's rule (range, allowed choices, parity).",
)
NOT_A_MAPPING = register_code(
    "not-a-mapping", Severity.ERROR, "The recipe or one of its sections is not a mapping of keys."
)


@attrs.frozen(repr=False, eq=False, slots=False)
class Problem(Record):
    """One structuring problem, before it is located in a source file."""

    code: str
    path: str
    message: str
    hint: str | None = None


class StructureProblems(ValueError):
    """Raised by the converter's structure hooks: every problem found below a value."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        self.problems: tuple[Problem, ...] = tuple(problems)
        super().__init__("; ".join(f"{p.path or '<recipe>'}: {p.message}" for p in self.problems))


# The dotted path being structured. A context variable rather than a hook argument because
# the rules take only (value, type); it is thread- and task-safe.
_PATH: ContextVar[tuple[str, ...]] = ContextVar("dflash_recipes_structure_path", default=())


@contextlib.contextmanager
def _inside(key: str) -> Iterator[None]:
    token = _PATH.set((*_PATH.get(), key))
    try:
        yield
    finally:
        _PATH.reset(token)


def _here() -> str:
    return ".".join(_PATH.get())


def _fail(code: str, message: str, hint: str | None) -> NoReturn:
    raise StructureProblems([Problem(code=code, path=_here(), message=message, hint=hint)])


# ---------------------------------------------------------------------------------------------
# words for messages
# ---------------------------------------------------------------------------------------------


def closest_name(word: str, candidates: Iterable[str]) -> str | None:
    """The candidate a typo most likely meant (case-insensitive first), or None."""
    options = sorted(candidates)
    for option in options:
        if option.lower() == word.lower():
            return option
    import difflib  # only on an error path: kept off the start-up of every command

    matches = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return matches[0] if matches else None


def _yaml_text(value: object) -> str:
    """How a value is written in YAML (for hints)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_yaml_text(item) for item in value) + "]"
    return str(value)


def describe(value: object) -> str:
    """A value as a message shows it: `2.7 (a number)`, `the string 'yes'`, `null`."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{_yaml_text(value)} (a boolean)"
    if isinstance(value, int):
        return f"{value} (an integer)"
    if isinstance(value, float):
        return f"{value!r} (a number)"
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, Mapping):
        return "a mapping"
    return f"a {type(value).__name__}"


def _optional_member(tp: object) -> object | None:
    """X for `X | None`, else None."""
    if get_origin(tp) in (typing.Union, types.UnionType):
        members = [arg for arg in get_args(tp) if arg is not type(None)]
        if len(members) == 1:
            member: object = members[0]
            return member
    return None


def expected(tp: object) -> str:
    """What a type accepts, in words: `an integer`, `one of cosine, linear, constant`."""
    member = _optional_member(tp)
    if member is not None:
        return f"{expected(member)} or null"
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(str(arg) for arg in get_args(tp))
    if get_origin(tp) is tuple:
        return f"a list of {_plural(get_args(tp)[0])}"
    words: dict[object, str] = {
        bool: "true or false",
        int: "an integer",
        float: "a number",
        str: "a string",
    }
    if tp in words:
        return words[tp]
    return "a mapping"


def _plural(tp: object) -> str:
    words: dict[object, str] = {int: "integers", float: "numbers", str: "strings", bool: "booleans"}
    return words.get(tp, "values")


# Patterns are kept as strings: `re` compiles one on its first use (and caches it), so a
# process that never needs it does not pay for it at import.
_NUMBER_TEXT = r"^[-+]?(?:\.[0-9]+|[0-9][0-9_]*(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?$"
_INT_TEXT = r"^[-+]?[0-9][0-9_]*$"
_TRUE_WORDS = frozenset({"yes", "y", "on"})
_FALSE_WORDS = frozenset({"no", "n", "off"})


# ---------------------------------------------------------------------------------------------
# strict hooks
# ---------------------------------------------------------------------------------------------


def _structure_str(value: object) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool | int | float):
        hint = f'quote it to make it text: "{_yaml_text(value)}"'
    elif value is None:
        hint = "write a value (null is allowed only where a field says so)"
    else:
        hint = "write a single string value"
    _fail(WRONG_TYPE, f"expected a string, got {describe(value)}", hint)


def _structure_int(value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        hint = f"write {int(value)} without the decimal point"
    elif isinstance(value, float):
        hint = f"write a whole number; {value!r} is not rounded for you"
    elif isinstance(value, str) and re.match(_INT_TEXT, value.strip()):
        digits = value.strip().replace("_", "")
        hint = f"write the number without quotes or underscores: {digits}"
    else:
        hint = "write a whole number such as 16"
    _fail(WRONG_TYPE, f"expected an integer, got {describe(value)}", hint)


def _structure_float(value: object) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            digits = len(str(abs(int(value))))
            _fail(
                INVALID_VALUE,
                f"an integer with {digits} digits is too large to be a number",
                "write a number between -1.7e308 and 1.7e308",
            )
    if isinstance(value, str) and re.match(_NUMBER_TEXT, value.strip()):
        number = value.strip().replace("_", "")
        hint = f"write the number without quotes or underscores: {number}"
    else:
        hint = "write a number such as 1.0e-4"
    _fail(WRONG_TYPE, f"expected a number, got {describe(value)}", hint)


def _structure_bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip() in ("true", "false"):
        hint = f"write {value.strip()} without quotes"
    elif isinstance(value, str) and value.strip().lower() in ("true", "false"):
        hint = (
            f"use true or false: only lowercase {value.strip().lower()} is a boolean in "
            f"recipes ({value.strip()!r} is a string)"
        )
    elif isinstance(value, str) and value.strip().lower() in _TRUE_WORDS:
        hint = f"write true ({value.strip()!r} is a string in recipes, not a boolean)"
    elif isinstance(value, str) and value.strip().lower() in _FALSE_WORDS:
        hint = f"write false ({value.strip()!r} is a string in recipes, not a boolean)"
    else:
        hint = "write true or false"
    _fail(WRONG_TYPE, f"expected true or false, got {describe(value)}", hint)


def _is_literal(tp: object) -> bool:
    return get_origin(tp) is Literal


def _structure_literal(value: object, tp: object) -> str:
    choices = get_args(tp)
    listed = ", ".join(str(choice) for choice in choices)
    if isinstance(value, str) and value in choices:
        return value
    if not isinstance(value, str):
        _fail(
            WRONG_TYPE, f"expected one of {listed}, got {describe(value)}", f"use one of: {listed}"
        )
    guess = closest_name(value, [str(choice) for choice in choices])
    hint = f"did you mean {guess}?" if guess else f"use one of: {listed}"
    _fail(INVALID_VALUE, f"{value!r} is not one of {listed}", hint)


def _is_optional(tp: object) -> bool:
    return _optional_member(tp) is not None


def _is_homogeneous_tuple(tp: object) -> bool:
    args = get_args(tp)
    return get_origin(tp) is tuple and len(args) == 2 and args[1] is Ellipsis


def _list_example(item_type: object) -> str:
    examples: dict[object, str] = {int: "[1, 9, 17]", float: "[0.5, 1.0]", str: '["a", "b"]'}
    return examples.get(item_type, "[...]")


def _is_section(tp: object) -> bool:
    return isinstance(tp, type) and attrs.has(tp)


def _section_name() -> str:
    here = _here()
    return here if here else "the recipe"


def structure(value: object, tp: object) -> object:
    """`value` (plain data) as type `tp` under the strict policy; raises StructureProblems.

    The dispatch over the few kinds of type a recipe field has: the four scalars, Literal,
    ``X | None``, ``tuple[X, ...]`` and a nested section (an attrs class).
    """
    scalar = _SCALAR_HOOKS.get(tp)
    if scalar is not None:
        return scalar(value)
    if _is_literal(tp):
        return _structure_literal(value, tp)
    member = _optional_member(tp)
    if member is not None:
        return None if value is None else structure(value, member)
    if _is_homogeneous_tuple(tp):
        return _structure_tuple(value, tp)
    if _is_section(tp):
        assert isinstance(tp, type)
        return _section_structurer(tp)(value)
    raise TypeError(f"recipe fields of type {tp!r} have no structuring rule")


_SCALAR_HOOKS: dict[object, Callable[[object], object]] = {
    str: _structure_str,
    int: _structure_int,
    float: _structure_float,
    bool: _structure_bool,
}


def _structure_tuple(value: object, tp: object) -> tuple[object, ...]:
    item_type = get_args(tp)[0]
    if isinstance(value, str) or not isinstance(value, list | tuple):
        _fail(
            WRONG_TYPE,
            f"expected {expected(tp)}, got {describe(value)}",
            f"write a list such as {_list_example(item_type)}",
        )
    items: list[object] = []
    problems: list[Problem] = []
    for index, item in enumerate(value):
        with _inside(str(index)):
            try:
                items.append(structure(item, item_type))
            except StructureProblems as exc:
                problems.extend(exc.problems)
    if problems:
        raise StructureProblems(problems)
    return tuple(items)


@functools.cache
def _section_structurer(cls: type) -> Callable[[object], object]:
    """Structuring of one attrs class: unknown keys, missing keys, types, validators."""
    hints = field_types(cls)
    fields: tuple[attrs.Attribute[Any], ...] = attrs.fields(cls)
    names = [field.name for field in fields]

    def structure_section(value: object) -> object:
        if not isinstance(value, Mapping):
            _fail(NOT_A_MAPPING, _not_a_mapping_message(names, value), _mapping_hint(names))
        problems: list[Problem] = []
        for key in value:
            if not (isinstance(key, str) and key in names):
                problems.append(_unknown_key(key, names))
        kwargs: dict[str, object] = {}
        for field in fields:
            with _inside(field.name):
                if field.name not in value:
                    if field.default is attrs.NOTHING:
                        # Parsed from recipe.py only for a missing key (an error path).
                        doc = class_field_docs().get((cls.__name__, field.name))
                        problems.append(_missing(field, hints[field.name], doc))
                    continue
                try:
                    kwargs[field.name] = _structure_field(
                        value[field.name], hints[field.name], field
                    )
                except StructureProblems as exc:
                    problems.extend(exc.problems)
        if problems:
            raise StructureProblems(problems)
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:  # a rule beyond single fields, if one is added
            _fail(INVALID_VALUE, str(exc), f"fix the values of {_section_name()}")

    return structure_section


def _structure_field(raw: object, tp: object, field: attrs.Attribute[Any]) -> object:
    if raw is None and _is_section(tp):
        _fail(
            NOT_A_MAPPING,
            "this section is empty (null); expected a mapping of keys",
            _null_hint(tp, field),
        )
    if raw is None and not _is_optional(tp):
        _fail(WRONG_TYPE, f"expected {expected(tp)}, got null", _null_hint(tp, field))
    value = structure(raw, tp)
    validator = field.validator
    if validator is not None:
        try:
            # Single-field validators ignore the instance, which does not exist yet.
            validator(None, field, value)
        except (TypeError, ValueError) as exc:
            _fail(INVALID_VALUE, str(exc), _validator_hint(field))
    return value


def _default_text(field: attrs.Attribute[Any]) -> str | None:
    default = field.default
    if default is attrs.NOTHING or isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        return None
    return _yaml_text(default)


def _null_hint(tp: object, field: attrs.Attribute[Any]) -> str:
    required = field.default is attrs.NOTHING
    if _is_section(tp):
        if required:
            return f"write the keys of {field.name} indented below `{field.name}:`"
        return f"write the keys of {field.name} indented below it, or delete the empty section"
    default = _default_text(field)
    if default is not None:
        return f"write {expected(tp)}, or delete the key to use the default ({default})"
    return f"write {expected(tp)}"


def _validator_hint(field: attrs.Attribute[Any]) -> str:
    default = _default_text(field)
    if default == "null":
        return "change the value, or delete the key to leave it unset (null)"
    if default is not None:
        return f"change the value, or delete the key to use the default ({default})"
    return "change the value so that it satisfies this rule"


def _missing(field: attrs.Attribute[Any], tp: object, doc: str | None) -> Problem:
    parent = _here().rpartition(".")[0]
    about = f" {doc}" if doc else ""
    if _is_section(tp):
        assert isinstance(tp, type)
        required = [f.name for f in attrs.fields(tp) if f.default is attrs.NOTHING]
        inner = "".join(f"\n  {name}: ..." for name in required)
        message = f"required section {field.name!r} is missing"
        hint = f"add the {field.name} section:\n{field.name}:{inner}"
    else:
        where = f" under `{parent}:`" if parent else ""
        message = f"required key {field.name!r} is missing"
        hint = f"add `{field.name}: ...` ({expected(tp)}){where}.{about}"
    return Problem(code=MISSING_FIELD, path=_here(), message=message, hint=hint)


def _unknown_key(key: object, names: Sequence[str]) -> Problem:
    parent = _here()
    where = f"in {parent}" if parent else "at the top level"
    if not isinstance(key, str):
        return Problem(
            code=UNKNOWN_KEY,
            path=parent,
            message=f"unknown key {key!r} {where} (keys must be strings)",
            hint=f"valid keys here: {', '.join(names)}",
        )
    path = f"{parent}.{key}" if parent else key
    guess = closest_name(key, names)
    if "." in key and path in recipe_field_paths():
        head, _, rest = key.partition(".")
        hint = f"YAML keys are not split at dots; nest it:\n{head}:\n  {rest}: ..."
    elif guess is not None:
        hint = f"did you mean {guess}?"
    else:
        elsewhere = sorted(p for p in recipe_field_paths() if p.rpartition(".")[2] == key)
        if elsewhere:
            hint = f"{key} belongs elsewhere: move it to {' or '.join(elsewhere)}"
        else:
            hint = f"valid keys here: {', '.join(names)}"
    return Problem(code=UNKNOWN_KEY, path=path, message=f"unknown key {key!r} {where}", hint=hint)


def _not_a_mapping_message(names: Sequence[str], value: object) -> str:
    if not _here():
        return f"a recipe must be a mapping of sections ({', '.join(names)}), got {describe(value)}"
    return f"{_here()} must be a mapping of keys, got {describe(value)}"


def _mapping_hint(names: Sequence[str]) -> str:
    here = _here()
    if not here:
        return "start the file with `model:` and put each setting under its section"
    last = here.rpartition(".")[2]
    return f"write `key: value` lines indented below `{last}:` (keys: {', '.join(names)})"


def structure_recipe(data: object, *, source: SourceMap) -> tuple[Recipe | None, list[Diagnostic]]:
    """Structure plain data (from YAML or Python) into a Recipe, reporting every problem.

    Returns `(recipe, [])` or `(None, diagnostics)`: every diagnostic is an error with a
    registered code, the dotted path, a message, a hint and its location from `source`.
    """
    token = _PATH.set(())
    try:
        recipe = structure(data, Recipe)
        assert isinstance(recipe, Recipe)
    except StructureProblems as exc:
        diagnostics = [
            source.diagnostic(Severity.ERROR, p.code, p.path, p.message, p.hint)
            for p in exc.problems
        ]
        return None, sort_diagnostics(diagnostics)
    finally:
        _PATH.reset(token)
    return recipe, []


def unstructure_recipe(recipe: Recipe) -> dict[str, object]:
    """The recipe as plain data (tuples become lists) that :func:`structure_recipe` accepts."""
    return attr.asdict(recipe, retain_collection_types=False)  # tuples become lists


@functools.cache
def _field_paths() -> frozenset[str]:
    paths: set[str] = set()

    def walk(cls: type, prefix: str) -> None:
        hints = field_types(cls)
        for field in attrs.fields(cls):
            path = f"{prefix}{field.name}"
            paths.add(path)
            tp = hints[field.name]
            nested = _optional_member(tp) or tp
            if _is_section(nested):  # an optional section (target_server) too
                assert isinstance(nested, type)
                walk(nested, f"{path}.")

    walk(Recipe, "")
    return frozenset(paths)


def recipe_field_paths() -> set[str]:
    """Every valid dotted path: sections (`dflash`) and fields (`dflash.dflash_block_size`)."""
    return set(_field_paths())


__all__ = [
    "INVALID_VALUE",
    "MISSING_FIELD",
    "NOT_A_MAPPING",
    "UNKNOWN_KEY",
    "WRONG_TYPE",
    "Problem",
    "StructureProblems",
    "closest_name",
    "describe",
    "expected",
    "recipe_field_paths",
    "structure",
    "structure_recipe",
    "unstructure_recipe",
]
