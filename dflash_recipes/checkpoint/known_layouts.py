"""The checkpoint layouts dflash-recipes reads, and how their tensor names map onto z-lab names.

A released drafter is a DFlash drafter whatever its maker called its tensors. The one table of
those names is :data:`KNOWN_LAYOUTS`: each entry renames stored tensor names onto the z-lab names
the drafter module (:func:`dflash_recipes.checkpoint.tensor_layout.expected_layout`) and the
export use. The compiler's cross-check, the `init` starter, the warm-start loader and the exact
loader of saved drafters all read a checkpoint through :func:`canonical_weights`, so a layout
added here is compiled, loaded and exported with no other change; the export always writes the
z-lab layout (the one vLLM and SGLang read), whatever layout the drafter was loaded from.

Nothing is dropped: a stored name no entry renames keeps its name, and the layout comparison
reports it as unexpected. Two stored tensors landing on one name (``fc.weight`` next to
``encoder.fc.weight``) are a clash, never a silent choice (:attr:`LayoutReading.clashes`).
The docs table of `docs/dflash.md` ("Known checkpoint layouts") is generated from the table.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs

from dflash_recipes.checkpoint.safetensors_header import TensorInfo
from dflash_recipes.checkpoint.weight_index import CheckpointWeights
from dflash_recipes.records import Record


@attrs.frozen(repr=False, eq=False, slots=False)
class KnownLayout(Record):
    """One checkpoint layout: its name, who writes it, and its renames onto the z-lab names."""

    #: Short name used in messages and reports (`museglimmer-assistant`).
    name: str
    #: Who writes it and how to recognise it, for the docs table.
    description: str
    #: Stored tensor name -> z-lab name, for names renamed whole.
    renames: Mapping[str, str] = attrs.field(factory=dict)
    #: A stored prefix removed from the submodules listed in `prefixed` (`markov_head.`).
    prefix: str = ""
    #: The z-lab submodules (first name component) that `prefix` nests.
    prefixed: tuple[str, ...] = ()

    def rename(self, stored: str) -> str | None:
        """The z-lab name of the stored tensor `stored`, or None when this layout leaves it."""
        if stored in self.renames:
            return self.renames[stored]
        if self.prefix and stored.startswith(self.prefix):
            rest = stored[len(self.prefix) :]
            if rest.split(".", 1)[0] in self.prefixed:
                return rest
        return None


#: Every checkpoint layout that is read, the z-lab one (no renames) first.
KNOWN_LAYOUTS: tuple[KnownLayout, ...] = (
    KnownLayout(
        name="z-lab",
        description=(
            "z-lab DFlash (`DFlashDraftModel`), what vLLM, SGLang, ModelOpt and this project's "
            "export write: `fc.weight`, `hidden_norm.weight`, `layers.{i}.*`, `norm.weight`"
        ),
    ),
    KnownLayout(
        name="museglimmer-assistant",
        description=(
            "`MuseGlimmerAssistantModel`: a DFlash drafter whose fusion tensors sit under "
            "`encoder.`; `mask_token_id`, `block_size` and `target_layer_ids` are read from the "
            "top level of its config.json"
        ),
        renames={
            "encoder.fc.weight": "fc.weight",
            "encoder.output_norm_enc.weight": "hidden_norm.weight",
        },
    ),
    KnownLayout(
        name="dspark-markov-head",
        description=(
            "DSpark head nested under `markov_head.` (released DSpark drafters); ModelOpt "
            "remaps it onto the unprefixed head names the same way"
        ),
        prefix="markov_head.",
        prefixed=("markov_w1", "markov_w2", "confidence_proj"),
    ),
)


@attrs.frozen(repr=False, eq=False, slots=False)
class LayoutReading(Record):
    """How a checkpoint's stored tensor names read as z-lab names."""

    #: The known layouts (beyond z-lab) whose renames apply, in table order.
    layouts: tuple[str, ...]
    #: Stored name -> z-lab name, for every stored tensor that is renamed.
    renamed: Mapping[str, str]
    #: z-lab name -> the stored tensors that would all land on it (each clash is an error).
    clashes: Mapping[str, tuple[str, ...]]

    def describe(self) -> str:
        """`museglimmer-assistant (encoder.fc.weight -> fc.weight, ...)`, for messages."""
        pairs = ", ".join(f"{old} -> {new}" for old, new in self.renamed.items())
        return f"{', '.join(self.layouts)} ({pairs})"

    def format_clashes(self) -> str:
        """One line per clash: which stored tensors would load into the same parameter."""
        lines = [
            f"  {target}: stored as {' and '.join(sorted(stored))}"
            for target, stored in self.clashes.items()
        ]
        return "\n".join(lines)


def read_layout(names: Iterable[str]) -> LayoutReading:
    """Read the stored tensor `names` against :data:`KNOWN_LAYOUTS`.

    A name takes the rename of the first entry that renames it; a clashing name keeps its
    stored name (so a layout comparison still lists it) and is reported in `clashes`.
    """
    stored = list(names)
    present = set(stored)
    targets: dict[str, list[str]] = {}
    layout_of: dict[str, str] = {}
    for name in stored:
        for layout in KNOWN_LAYOUTS:
            new = layout.rename(name)
            if new is not None:
                targets.setdefault(new, []).append(name)
                layout_of[name] = layout.name
                break
    clashes: dict[str, tuple[str, ...]] = {}
    renamed: dict[str, str] = {}
    for new, sources in targets.items():
        if len(sources) > 1 or new in present:
            clashes[new] = tuple(sources) + ((new,) if new in present else ())
            continue
        renamed[sources[0]] = new
    used = {layout_of[name] for name in renamed}
    return LayoutReading(
        layouts=tuple(layout.name for layout in KNOWN_LAYOUTS if layout.name in used),
        renamed=renamed,
        clashes=clashes,
    )


def canonical_weights(weights: CheckpointWeights) -> tuple[CheckpointWeights, LayoutReading]:
    """`weights` with every tensor under its z-lab name, and how the names were read.

    The returned table's `stored_names` maps each renamed z-lab name back to the name in the
    file (what a loader asks the safetensors file for). Unrenamed and clashing tensors keep
    their stored names.
    """
    reading = read_layout(weights.tensors)
    if not reading.renamed:
        return weights, reading
    tensors: dict[str, TensorInfo] = {}
    files: dict[str, str] = {}
    stored_names: dict[str, str] = dict(weights.stored_names)
    for name, info in weights.tensors.items():
        new = reading.renamed.get(name, name)
        tensors[new] = info
        files[new] = weights.tensor_files[name]
        if new != name:
            stored_names[new] = weights.stored_names.get(name, name)
    renamed = attrs.evolve(weights, tensors=tensors, tensor_files=files, stored_names=stored_names)
    return renamed, reading


def stored_name(weights: CheckpointWeights, name: str) -> str:
    """The name under which the tensor `name` (a z-lab name) is stored in its file."""
    return weights.stored_names.get(name, name)


__all__ = [
    "KNOWN_LAYOUTS",
    "KnownLayout",
    "LayoutReading",
    "canonical_weights",
    "read_layout",
    "stored_name",
]
