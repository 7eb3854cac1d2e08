"""Names a package exports and imports on first use (PEP 562 module ``__getattr__``).

The package ``dflash_recipes`` and the executor re-export names from deep modules without
importing those modules when the package is imported: ``dflash-recipe --version`` does not load
the compiler, and a torch-free part of the executor does not load the model code.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def lazy_exports(
    package: str, homes: Mapping[str, str], aliases: Mapping[str, str] | None = None
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of `package`.

    `homes` maps each exported name to its module, relative to `package`; `aliases` maps a
    former name to the name it stands for in that module. A name is imported when first read,
    then kept in the package's namespace (later reads do not come here).
    """
    renamed = dict(aliases or {})

    def getattr_(name: str) -> object:
        home = homes.get(name)
        if home is None:
            msg = f"module {package!r} has no attribute {name!r}"
            raise AttributeError(msg)
        module = importlib.import_module(f"{package}.{home}")
        value = getattr(module, renamed.get(name, name))
        vars(sys.modules[package])[name] = value
        return value

    def dir_() -> list[str]:
        return sorted({*vars(sys.modules[package]), *homes})

    return getattr_, dir_


__all__ = ["lazy_exports"]
