"""The recipe's single-field validators: each raises ValueError with a message that names the rule.

Every field of :mod:`~dflash_recipes.recipe.sections` is checked by one of these (the converter
runs them at the field's dotted path, the plan's value checks run them again on a plan); the JSON
Schema takes its bounds from them (:mod:`~dflash_recipes.recipe.json_schema`), so schema, loader
and plan agree. Cross-field rules are the compiler's.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from typing import Any

import attrs

from dflash_recipes.files.jsonio import shorten
from dflash_recipes.recipe.choices import LAYER_TYPES
from dflash_recipes.records import Record

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]

#: No integer field accepts more than this (int64: what tensors, seeds and counters hold).
INT_FIELD_MAX = 2**63 - 1
#: The largest target layer index a tap may name.
MAX_LAYER_ID = 4095


def _name(attribute: attrs.Attribute[Any]) -> str:
    return attribute.name


def positive_int(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """Value must be an int > 0 (None passes; use on Optional fields too)."""
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= INT_FIELD_MAX:
        msg = f"{_name(attribute)} must be a positive integer, got {shorten(value)}"
        raise ValueError(msg)


def non_negative_int(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """Value must be an int >= 0 (None passes)."""
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= INT_FIELD_MAX:
        msg = f"{_name(attribute)} must be an integer >= 0, got {shorten(value)}"
        raise ValueError(msg)


def positive_float(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """Value must be a finite number > 0 (None passes)."""
    if value is None:
        return
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value <= 0
    ):
        msg = f"{_name(attribute)} must be a finite number > 0, got {shorten(value)}"
        raise ValueError(msg)


def non_negative_float(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """Value must be a finite number >= 0."""
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value < 0
    ):
        msg = f"{_name(attribute)} must be a finite number >= 0, got {shorten(value)}"
        raise ValueError(msg)


def fraction_half_open(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """Value must lie in [0, 1)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < 1:
        msg = f"{_name(attribute)} must be in [0, 1), got {shorten(value)}"
        raise ValueError(msg)


def fraction_open_closed(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """Value must lie in (0, 1]."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 1:
        msg = f"{_name(attribute)} must be in (0, 1], got {shorten(value)}"
        raise ValueError(msg)


def one_of(choices: tuple[str, ...]) -> Validator:
    """Validator: the value must be one of `choices` (None passes)."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None:
            return
        if value not in choices:
            msg = f"{_name(attribute)} must be one of {', '.join(choices)}; got {shorten(value)}"
            raise ValueError(msg)

    return check


def even_positive_int(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """Value must be a positive even int (RoPE rotates pairs of dimensions)."""
    positive_int(instance, attribute, value)
    if value is not None and isinstance(value, int) and value % 2 != 0:
        msg = (
            f"{_name(attribute)} must be even (RoPE rotates pairs of dimensions), "
            f"got {shorten(value)}"
        )
        raise ValueError(msg)


def layer_id_list(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A non-empty tuple of integers >= 0 (None passes: resolved by the compiler)."""
    if value is None:
        return
    if not isinstance(value, tuple) or not value:
        msg = f"{_name(attribute)} must be a non-empty list of layer indices, got {shorten(value)}"
        raise ValueError(msg)
    for item in value:
        if not isinstance(item, int) or isinstance(item, bool) or not 0 <= item <= MAX_LAYER_ID:
            msg = (
                f"{_name(attribute)} entries must be integers in [0, {MAX_LAYER_ID}], "
                f"got {shorten(item)}"
            )
            raise ValueError(msg)


def layer_type_list(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A non-empty tuple of LAYER_TYPES names (None passes: resolved by the compiler)."""
    if value is None:
        return
    if not isinstance(value, tuple) or not value:
        msg = (
            f"{_name(attribute)} must be a non-empty list with one of "
            f"{' | '.join(LAYER_TYPES)} per draft layer, got {value!r}"
        )
        raise ValueError(msg)
    for index, item in enumerate(value):
        if item not in LAYER_TYPES:
            msg = (
                f"{_name(attribute)}[{index}] is {item!r}; each entry must be one of "
                f"{', '.join(LAYER_TYPES)}"
            )
            raise ValueError(msg)


def block_size_range(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A DFlash block needs the anchor plus at least one masked position."""
    if not isinstance(value, int) or isinstance(value, bool) or not 2 <= value <= 128:
        msg = f"{_name(attribute)} must be an integer in [2, 128], got {shorten(value)}"
        raise ValueError(msg)


def non_empty_str(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A non-empty string (None passes)."""
    if value is None:
        return
    if not isinstance(value, str) or not value.strip():
        msg = f"{_name(attribute)} must be a non-empty string, got {shorten(value)}"
        raise ValueError(msg)


def path_str(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A non-empty string that can name a file (None passes): encodable for the file system, so
    a lone surrogate ("\\ud800" in YAML) is refused here, with its place, rather than by the
    first os.stat() as a UnicodeEncodeError. (A NUL byte is the path checks' to refuse.)"""
    non_empty_str(instance, attribute, value)
    if value is None:
        return
    try:
        os.fsencode(value)
    except UnicodeError:
        # os.fsencode passes the surrogates that stand for undecodable bytes (U+DC80 to U+DCFF,
        # how Python spells a non-UTF-8 file name); any other one has no bytes to be
        msg = (
            f"{_name(attribute)} cannot name a file: it holds a lone surrogate, which no file "
            f"name can hold; got {shorten(value)}"
        )
        raise ValueError(msg) from None


def server_url_list(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A non-empty tuple of non-empty strings (None passes); the compiler checks each is an
    http(s) URL and that no two name the same server, at the entry's own place."""
    if value is None:
        return
    if not isinstance(value, tuple) or not value:
        msg = (
            f"{_name(attribute)} must be a non-empty list of server URLs such as "
            f"[http://localhost:8000], got {shorten(value)}"
        )
        raise ValueError(msg)
    for item in value:
        if not isinstance(item, str) or not item.strip():
            msg = f"{_name(attribute)} entries must be non-empty URLs, got {shorten(item)}"
            raise ValueError(msg)


def distinct_items(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A tuple that names nothing twice."""
    seen: set[object] = set()
    for item in value:
        if item in seen:
            msg = f"{_name(attribute)} names {shorten(item)} twice; list each once"
            raise ValueError(msg)
        seen.add(item)


def non_empty_distinct_items(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A non-empty tuple that names nothing twice."""
    if not value:
        msg = f"{_name(attribute)} must name at least one item; list what to keep"
        raise ValueError(msg)
    distinct_items(instance, attribute, value)


@attrs.frozen(repr=False, eq=False, slots=False)
class IntRange(Record):
    """Validator: an int in [minimum, maximum] (None passes); `even` also requires evenness.

    The JSON Schema takes its bounds from the attributes, so schema and loader agree.
    """

    minimum: int
    maximum: int
    even: bool = False

    def __call__(self, instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None:
            return
        if (
            not isinstance(value, int)
            or isinstance(value, bool)
            or not self.minimum <= value <= self.maximum
        ):
            lower = "a positive integer" if self.minimum == 1 else f"an integer >= {self.minimum}"
            msg = (
                f"{_name(attribute)} must be {lower} no larger than {self.maximum}, "
                f"got {shorten(value)}"
            )
            raise ValueError(msg)
        if self.even and value % 2:
            msg = (
                f"{_name(attribute)} must be even (RoPE rotates pairs of dimensions), "
                f"got {shorten(value)}"
            )
            raise ValueError(msg)


def env_var_name(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """The name of an environment variable (letters, digits, underscores; None passes)."""
    if value is None:
        return
    if not isinstance(value, str) or not re.fullmatch(_ENV_NAME, value):
        msg = (
            f"{_name(attribute)} must be the NAME of an environment variable (letters, digits "
            f"and underscores, e.g. OPENAI_API_KEY), never the key itself; got {value!r}"
        )
        raise ValueError(msg)


_ENV_NAME = r"[A-Za-z_][A-Za-z0-9_]{0,127}"

#: A Hugging Face Hub repository id (OWNER/NAME), as a model card's metadata names one.
HUB_REPO_ID = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$"
#: A license identifier as the Hub's model-card metadata writes one (apache-2.0, mit, other).
HUB_LICENSE = r"^[a-z0-9][a-z0-9.+-]{0,63}$"


def _check_hub_id(attribute: attrs.Attribute[Any], item: object) -> None:
    if not isinstance(item, str) or not re.fullmatch(HUB_REPO_ID, item):
        msg = (
            f"{_name(attribute)} must name Hugging Face Hub repositories as OWNER/NAME "
            f"(e.g. Qwen/Qwen3-8B), never a local path; got {shorten(item)}"
        )
        raise ValueError(msg)


def hub_repo_id(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A Hub repository id, OWNER/NAME (None passes)."""
    if value is not None:
        _check_hub_id(attribute, value)


def hub_repo_id_list(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A non-empty tuple of Hub repository ids (None passes)."""
    if value is None:
        return
    if not isinstance(value, tuple) or not value:
        msg = f"{_name(attribute)} must be a non-empty list of OWNER/NAME ids, got {shorten(value)}"
        raise ValueError(msg)
    for item in value:
        _check_hub_id(attribute, item)


def hub_license(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A Hub license id: lowercase letters, digits, dots, plus and dashes (None passes)."""
    if value is None:
        return
    if not isinstance(value, str) or not re.fullmatch(HUB_LICENSE, value):
        msg = (
            f"{_name(attribute)} must be a license id as the Hub writes it (lowercase, e.g. "
            f"apache-2.0, mit, cc-by-4.0, other); got {shorten(value)}"
        )
        raise ValueError(msg)


__all__ = [
    "HUB_LICENSE",
    "HUB_REPO_ID",
    "INT_FIELD_MAX",
    "MAX_LAYER_ID",
    "IntRange",
    "Validator",
    "block_size_range",
    "distinct_items",
    "env_var_name",
    "even_positive_int",
    "fraction_half_open",
    "fraction_open_closed",
    "hub_license",
    "hub_repo_id",
    "hub_repo_id_list",
    "layer_id_list",
    "layer_type_list",
    "non_empty_str",
    "non_negative_float",
    "non_negative_int",
    "one_of",
    "path_str",
    "positive_float",
    "positive_int",
    "server_url_list",
]
