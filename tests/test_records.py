"""Record gives the repr, == and hash attrs would write, and every value class uses it."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

import attrs
import pytest

import dflash_recipes
from dflash_recipes.records import Record


def _pair(shared: bool) -> Any:
    """The same two classes, with attrs' generated methods or with Record's."""
    decorate: Any = attrs.frozen(repr=False, eq=False, slots=False) if shared else attrs.frozen
    bases: tuple[type, ...] = (Record,) if shared else ()

    @decorate
    class Inner(*bases):  # type: ignore[misc]
        x: int

    @decorate
    class Thing(*bases):  # type: ignore[misc]
        number: int
        text: str
        items: tuple[int, ...] = ()
        ignored: str = attrs.field(default="", eq=False)
        hidden: str = attrs.field(default="", repr=False)
        shown: int = attrs.field(default=0, repr=lambda value: f"<{value}>")
        inner: Inner | None = None
        loose: object = None

    return Thing, Inner


def _generated() -> Any:
    return _pair(shared=False)


def _shared() -> Any:
    return _pair(shared=True)


CASES: list[dict[str, Any]] = [
    {"number": 1, "text": "a"},
    {"number": 1, "text": "a", "items": (1, 2)},
    {"number": 1, "text": "a", "ignored": "differs only where eq=False"},
    {"number": 1, "text": "a", "hidden": "not shown but compared"},
    {"number": 2, "text": "a", "shown": 7},
    {"number": 1, "text": "b", "inner": 3},
    {"number": 1, "text": "b", "inner": 4},
    {"number": 1, "text": 'it\'s "quoted"\n', "loose": 2.5},
]


def _build(pair: Any, case: dict[str, Any]) -> Any:
    thing, inner = pair
    values = dict(case)
    if "inner" in values:
        values["inner"] = inner(values["inner"])
    return thing(**values)


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_repr_is_what_attrs_writes(case: dict[str, Any]) -> None:
    assert repr(_build(_shared(), case)) == repr(_build(_generated(), case))


def test_equality_and_hash_agree_with_attrs_on_every_pair() -> None:
    generated, shared = _generated(), _shared()
    for left in CASES:
        for right in CASES:
            expected = _build(generated, left) == _build(generated, right)
            a, b = _build(shared, left), _build(shared, right)
            assert (a == b) is expected, (left, right)
            assert (a != b) is (not expected), (left, right)
            if expected:
                assert hash(a) == hash(b)


def test_equality_is_only_between_instances_of_the_same_class() -> None:
    thing, inner = _shared()
    other_thing, _ = _shared()  # same fields, another class
    assert thing(1, "a") != other_thing(1, "a")
    assert thing(1, "a") != (1, "a")
    assert thing.__eq__(thing(1, "a"), (1, "a")) is NotImplemented
    assert inner(1) == inner(1) and {inner(1), inner(1)} == {inner(1)}


def test_an_unhashable_field_value_makes_hash_fail_like_attrs() -> None:
    for thing, _ in (_generated(), _shared()):
        with pytest.raises(TypeError, match="unhashable"):
            hash(thing(1, "a", loose=[1]))


def _package_attrs_classes() -> list[type]:
    found: dict[str, type] = {}
    for module_info in pkgutil.walk_packages(dflash_recipes.__path__, "dflash_recipes."):
        if module_info.name.endswith(".__main__"):
            continue  # a program, not a library module: importing it runs the CLI
        module = importlib.import_module(module_info.name)
        for value in vars(module).values():
            if isinstance(value, type) and attrs.has(value) and value.__module__ == module.__name__:
                found[f"{value.__module__}.{value.__qualname__}"] = value
    return list(found.values())


def _generated_by_attrs(cls: type, name: str) -> bool:
    method = cls.__dict__.get(name)
    code = getattr(method, "__code__", None)
    return code is not None and code.co_filename.startswith("<attrs generated")


def _is_frozen(cls: type) -> bool:
    return getattr(cls.__setattr__, "__name__", "") == "_frozen_setattrs"


def test_every_frozen_value_class_of_the_package_shares_records_methods() -> None:
    classes = _package_attrs_classes()
    assert len(classes) > 60  # the walk found the package's classes
    records = [cls for cls in classes if issubclass(cls, Record)]
    assert len(records) > 50
    for cls in classes:
        generated = [
            name for name in ("__repr__", "__eq__", "__hash__") if _generated_by_attrs(cls, name)
        ]
        compares_by_value = vars(cls).get("__eq__", cls.__eq__) is not vars(object)["__eq__"]
        if _is_frozen(cls) and compares_by_value:
            # a frozen value class: it must take Record's methods, not attrs' per-class code
            assert issubclass(cls, Record), cls
            assert generated == [], (cls, generated)
            assert cls.__repr__ is Record.__repr__
            assert cls.__eq__ is Record.__eq__
            assert cls.__hash__ is Record.__hash__
        elif _is_frozen(cls):
            # declared eq=False: compares by identity on purpose
            assert not issubclass(cls, Record), cls
