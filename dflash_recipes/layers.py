"""The package's layers, top to bottom: a module imports its own room and the layers below it.

A room is a folder or a module, named by its dotted path below ``dflash_recipes`` (``""`` is the
package's own ``__init__``); a module belongs to the room with the longest name that contains it,
so ``executor.demo`` is a room of its own inside ``executor``. Rooms in one layer do not import
each other (the compiler and the executor meet only in the plan). ``tests/test_architecture.py``
enforces it over every import, those inside functions and under ``TYPE_CHECKING`` included, and
``tools/gen_docs.py`` prints this table in docs/dflash.md ("Architecture"). Nothing imports this
module at run time.
"""

from __future__ import annotations

from typing import NamedTuple


class Layer(NamedTuple):
    """One layer: its rooms and what they hold."""

    rooms: tuple[str, ...]
    holds: str


#: Top to bottom. A new top-level folder or module needs a row here (a test says so).
LAYERS: tuple[Layer, ...] = (
    Layer(("", "__main__"), "the entry points: the public names, `python -m dflash_recipes`"),
    Layer(("cli",), "the `dflash-recipe` commands, a thin shell over the library"),
    Layer(("executor.demo",), "the demo: compiles recipes and trains on them as a user would"),
    Layer(
        ("compiler", "executor", "report"),
        "recipe -> plan (no torch); plan -> trained drafter (the only torch); the metrics PNG",
    ),
    Layer(
        ("card",),
        "the export's model card and the acceptance gate: rendered from the plan and the "
        "measurements, torch-free",
    ),
    Layer(
        ("plan",),
        "the contract between compiler and executor: the run plan, what it costs, the resolved "
        "drafter, the regenerate settings",
    ),
    Layer(("recipe", "data"), "what a user writes; the training conversations it points at"),
    Layer(("files",), "what lives in a run directory: names, locks, crash-safe writes, manifests"),
    Layer(("checkpoint",), "torch-free readers of model directories: config.json, headers, layout"),
    Layer(("errors",), "the exception tree"),
    Layer(("diagnostics",), "findings and their renderers"),
    Layer(
        ("records", "lazy", "layers", "recipe.choices", "files.jsonio"),
        "leaves every layer reads, importing nothing of the package: value methods, lazy exports, "
        "this table, every enumeration (`recipe/choices.py`), bounded file and JSON reads "
        "(`files/jsonio.py`)",
    ),
    Layer(
        ("echo",),
        "the bound on what is echoed to a user (every diagnostic and error message goes through "
        "it): imports nothing",
    ),
)


def room_of(module: str) -> str:
    """The room of `module` (dotted below ``dflash_recipes``, ``""`` for the package itself):
    the longest room name in :data:`LAYERS` equal to it or containing it; ValueError if none."""
    best: str | None = None
    for layer in LAYERS:
        for room in layer.rooms:
            inside = module == room or (room != "" and module.startswith(room + "."))
            if inside and (best is None or len(room) > len(best)):
                best = room
    if best is None:
        msg = f"module {module!r} is in no room of dflash_recipes.layers.LAYERS: add it to a layer"
        raise ValueError(msg)
    return best


def layer_index(room: str) -> int:
    """The position of `room`'s layer in :data:`LAYERS` (0 is the top)."""
    for index, layer in enumerate(LAYERS):
        if room in layer.rooms:
            return index
    msg = f"{room!r} is not a room of dflash_recipes.layers.LAYERS"
    raise ValueError(msg)


def may_import(importer: str, imported: str) -> bool:
    """True when module `importer` may import module `imported`: same room, or a lower layer."""
    mine, theirs = room_of(importer), room_of(imported)
    return mine == theirs or layer_index(theirs) > layer_index(mine)


__all__ = ["LAYERS", "Layer", "layer_index", "may_import", "room_of"]
