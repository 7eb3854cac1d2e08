"""JSON Schema and field documentation generated from the recipe classes.

The descriptions are the `#:` comments written above each field in
:mod:`dflash_recipes.recipe.sections`;
Python drops comments at runtime, so the module source is parsed (``ast``) to find them. Types,
enums, nullability, required keys and defaults come from the attrs classes; numeric and
string bounds come from the single-field validators, so the schema and the loader agree.
"""

from __future__ import annotations

import ast
import functools
import inspect
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, get_args, get_origin

import attrs

from dflash_recipes.recipe import sections as recipe_module
from dflash_recipes.recipe import validators as rules
from dflash_recipes.recipe.sections import Recipe

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"

JsonObject = dict[str, object]


@functools.cache
def class_field_docs() -> dict[tuple[str, str], str]:
    """`(class name, field name) -> description` from the `#:` comments of recipe.py.

    Consecutive `#:` lines above a field are joined with spaces. Empty when the source is not
    available (an installation without .py files); the schema is still complete, only undocumented.
    """
    try:
        source = inspect.getsource(recipe_module)
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    docs: dict[tuple[str, str], str] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for statement in node.body:
            if not (
                isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
            ):
                continue
            comment: list[str] = []
            index = statement.lineno - 2  # the line above, 0-based
            while index >= 0 and lines[index].strip().startswith("#:"):
                comment.insert(0, lines[index].strip()[2:].strip())
                index -= 1
            if comment:
                docs[(node.name, statement.target.id)] = " ".join(comment)
    return docs


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """The resolved type of each field of a recipe class, worked out once per process.

    recipe.py does not use postponed annotations, so this reads type objects, not strings.
    """
    return typing.get_type_hints(cls)


def _section_class(tp: object) -> type | None:
    return tp if isinstance(tp, type) and attrs.has(tp) else None


def _optional_section_class(tp: object) -> type | None:
    """The section class of `tp` or of `tp | None` (an optional section: target_server)."""
    if get_origin(tp) in (typing.Union, types.UnionType):
        members = [arg for arg in get_args(tp) if arg is not type(None)]
        return _section_class(members[0]) if len(members) == 1 else None
    return _section_class(tp)


@functools.cache
def field_docs() -> dict[str, str]:
    """Dotted path -> description, for every documented recipe field (sections included)."""
    docs = class_field_docs()
    result: dict[str, str] = {}

    def walk(cls: type, prefix: str) -> None:
        hints = field_types(cls)
        for field in attrs.fields(cls):
            path = f"{prefix}{field.name}"
            doc = docs.get((cls.__name__, field.name))
            if doc:
                result[path] = doc
            nested = _optional_section_class(hints[field.name])
            if nested is not None:
                walk(nested, f"{path}.")

    walk(Recipe, "")
    return result


def _validator_bounds() -> dict[Callable[..., None], JsonObject]:
    # Each single-field validator of recipe.py, as the JSON Schema keywords that say the same.
    return {
        rules.positive_int: {"minimum": 1, "maximum": rules.INT_FIELD_MAX},
        rules.non_negative_int: {"minimum": 0, "maximum": rules.INT_FIELD_MAX},
        rules.positive_float: {"exclusiveMinimum": 0},
        rules.non_negative_float: {"minimum": 0},
        rules.fraction_half_open: {"minimum": 0, "exclusiveMaximum": 1},
        rules.fraction_open_closed: {"exclusiveMinimum": 0, "maximum": 1},
        rules.even_positive_int: {"minimum": 2, "multipleOf": 2},
        rules.block_size_range: {"minimum": 2, "maximum": 128},
        rules.non_empty_str: {"minLength": 1, "pattern": r"\S"},
        rules.path_str: {"minLength": 1, "pattern": r"\S"},
        rules.layer_id_list: {
            "minItems": 1,
            "items": {"type": "integer", "minimum": 0, "maximum": rules.MAX_LAYER_ID},
        },
        rules.env_var_name: {"pattern": r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"},
        rules.hub_repo_id: {"pattern": rules.HUB_REPO_ID},
        rules.hub_repo_id_list: {
            "minItems": 1,
            "items": {"type": "string", "pattern": rules.HUB_REPO_ID},
        },
        rules.hub_license: {"pattern": rules.HUB_LICENSE},
        rules.server_url_list: {
            "minItems": 1,
            "items": {"type": "string", "minLength": 1, "pattern": r"\S"},
        },
    }


def _int_range_bounds(rule: rules.IntRange) -> JsonObject:
    bounds: JsonObject = {"minimum": rule.minimum, "maximum": rule.maximum}
    if rule.even:
        bounds["multipleOf"] = 2
    return bounds


def _type_schema(tp: object) -> JsonObject:
    """Schema of a field type, nullability included."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        members = [arg for arg in get_args(tp) if arg is not type(None)]
        if len(members) != 1:
            msg = f"recipe schema supports only `X | None` unions, got {tp!r}"
            raise TypeError(msg)
        inner = _type_schema(members[0])
        if "enum" in inner:
            inner["enum"] = [*typing.cast(list[object], inner["enum"]), None]
        kind = inner.get("type")
        if isinstance(kind, str):
            inner["type"] = [kind, "null"]
        else:
            inner = {"anyOf": [inner, {"type": "null"}]}
        return inner
    if origin is Literal:
        return {"type": "string", "enum": list(get_args(tp))}
    if origin is tuple:
        args = get_args(tp)
        if len(args) != 2 or args[1] is not Ellipsis:
            msg = f"recipe schema supports only `tuple[X, ...]`, got {tp!r}"
            raise TypeError(msg)
        return {"type": "array", "items": _type_schema(args[0])}
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer"}
    if tp is float:
        return {"type": "number"}
    if tp is str:
        return {"type": "string"}
    section = _section_class(tp)
    if section is not None:
        return _class_schema(section)
    msg = f"no JSON Schema for recipe field type {tp!r}"
    raise TypeError(msg)


def _merge_bounds(schema: JsonObject, bounds: JsonObject) -> None:
    for key, value in bounds.items():
        if key == "items" and isinstance(schema.get("items"), dict):
            items = typing.cast(JsonObject, schema["items"])
            items.update(typing.cast(JsonObject, value))
        else:
            schema[key] = value


def _class_schema(cls: type) -> JsonObject:
    docs = class_field_docs()
    hints = field_types(cls)
    bounds = _validator_bounds()
    properties: JsonObject = {}
    required: list[str] = []
    for field in attrs.fields(cls):
        schema = _type_schema(hints[field.name])
        validator = field.validator
        if isinstance(validator, rules.IntRange):
            _merge_bounds(schema, _int_range_bounds(validator))
        elif validator is not None and validator in bounds:
            _merge_bounds(schema, bounds[validator])
        doc = docs.get((cls.__name__, field.name))
        if doc:
            # The field's own comment describes it better than its class docstring.
            schema = {"description": doc, **{k: v for k, v in schema.items() if k != "description"}}
        default = field.default
        if default is attrs.NOTHING:
            required.append(field.name)
        elif not isinstance(default, attrs.Factory):  # type: ignore[arg-type]
            schema["default"] = list(default) if isinstance(default, tuple) else default
        properties[field.name] = schema
    result: JsonObject = {"type": "object"}
    if cls.__doc__:
        result["description"] = inspect.cleandoc(cls.__doc__).splitlines()[0]
    result["properties"] = properties
    if required:
        result["required"] = required
    result["additionalProperties"] = False
    return result


def recipe_json_schema() -> JsonObject:
    """JSON Schema (draft 2020-12) of a recipe file, for validators and editor completion."""
    schema: JsonObject = {
        "$schema": JSON_SCHEMA_DIALECT,
        "title": "dflash-recipes recipe",
    }
    schema.update(_class_schema(Recipe))
    return schema


__all__ = ["class_field_docs", "field_docs", "recipe_json_schema"]
