"""One set of value methods for the project's frozen attrs classes, written once.

For every class it decorates, attrs writes the source of ``__repr__``, ``__eq__`` and
``__hash__`` and ``compile()``s it: about a quarter of a millisecond per class, paid again by
every process at import, because generated code is never cached in ``.pyc`` files. The compile
path alone defines about 45 such classes, so that was a good part of the start-up of
``dflash-recipe compile`` (issue 15).

The project's value classes are therefore declared ::

    @attrs.frozen(repr=False, eq=False, slots=False)
    class Thing(Record):
        ...

attrs still writes the ``__init__`` (with the validators) and makes the class frozen;
:class:`Record` gives the three methods attrs would have written, with the same behaviour:

- ``repr``: ``Thing(a=1, b='x')``, fields with ``repr=False`` left out, a callable ``repr``
  applied to its value;
- ``==``: only between instances of exactly the same class (otherwise ``NotImplemented``),
  comparing the fields with ``eq=True`` in order;
- ``hash``: consistent with ``==`` (frozen instances are hashable; an unhashable field value
  makes the hash fail, as with attrs).

``slots=False`` because a slotted attrs class is built twice (and gets pickling methods the
project never uses): about 2 ms more over the compile path, for records that are few and small.

``tests/test_records.py`` checks these against the methods attrs generates, and that every value
class of the package uses them. Classes meant to compare by identity keep
``@attrs.frozen(eq=False)``; mutable ``@attrs.define`` classes keep attrs' own methods.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import attrs

#: Per class: the names compared by ``==`` and the (name, repr) pairs ``repr`` shows.
_Layout = tuple[tuple[str, ...], tuple[tuple[str, Callable[[Any], str]], ...]]
_LAYOUTS: dict[type, _Layout] = {}


def _layout(cls: type) -> _Layout:
    layout = _LAYOUTS.get(cls)
    if layout is None:
        fields = attrs.fields(cast("type[attrs.AttrsInstance]", cls))
        compared = tuple(field.name for field in fields if field.eq)
        shown = tuple(
            (field.name, field.repr if callable(field.repr) else repr)
            for field in fields
            if field.repr
        )
        layout = _LAYOUTS[cls] = (compared, shown)
    return layout


class Record:
    """Base of the project's frozen attrs value classes: attrs' repr, eq and hash, shared."""

    __slots__ = ()

    def __repr__(self) -> str:
        cls = type(self)
        shown = ", ".join(f"{name}={show(getattr(self, name))}" for name, show in _layout(cls)[1])
        return f"{cls.__qualname__.rsplit('>.', 1)[-1]}({shown})"

    def _compared(self) -> tuple[object, ...]:
        return tuple(getattr(self, name) for name in _layout(type(self))[0])

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        assert isinstance(other, Record)
        return self._compared() == other._compared()

    def __hash__(self) -> int:
        return hash((type(self), self._compared()))
