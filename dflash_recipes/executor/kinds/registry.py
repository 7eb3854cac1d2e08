"""The drafter kinds' torch halves, by ``projector_type``: the one registry of this half.

Adding a kind: its module beside this one (a :class:`~dflash_recipes.executor.kinds.protocol.
KindModules`) and one entry in :data:`KIND_MODULES`; its torch-free half is registered the
same way in :mod:`dflash_recipes.checkpoint.kinds.registry`.
"""

from __future__ import annotations

from collections.abc import Mapping

from dflash_recipes.executor.kinds import dflash, dflash2, domino, dspark
from dflash_recipes.executor.kinds.protocol import KindModules

#: projector_type -> the kind's torch half, in the recipe's order.
KIND_MODULES: Mapping[str, KindModules] = {
    kind.name: kind
    for kind in (
        dflash.MODULES,
        domino.MODULES,
        dspark.MODULES,
        dflash2.MODULES,
    )
}


def kind_modules(projector_type: str) -> KindModules:
    """The torch half of the kind `projector_type` names; ValueError for an unknown one."""
    kind = KIND_MODULES.get(projector_type)
    if kind is None:
        msg = f"projector_type must be one of {', '.join(KIND_MODULES)}, got {projector_type!r}"
        raise ValueError(msg)
    return kind


__all__ = ["KIND_MODULES", "kind_modules"]
