"""What a target's config.json says about its layers, for packing and taps (torch-free).

A packed row holds several conversations; each must get the target states it would get alone.
Attention layers can be kept apart per document by their masks (the executor builds them per
layer type from per-document positions). Layers that carry a state from token to token
(linear attention, state-space and convolution layers) cannot: their state crosses the
document boundary whatever the mask says. :func:`read_target_layers` reads the declared layer
types (``layer_types``, a multimodal config's ``text_config`` first) and the families that
are recurrent without declaring it, and :meth:`TargetLayers.packing_blockers` names what
stops packing. The executor proves isolation on the real target before a packed run trains,
so a family this table does not know is caught there too.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from dflash_recipes.records import Record

#: Attention layer types whose per-document masks transformers builds from positions.
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
#: Declared layer types that carry a state across tokens, with what they are.
RECURRENT_LAYER_TYPES: Mapping[str, str] = {
    "linear_attention": "linear-attention layers (a recurrent state)",
    "mamba": "Mamba state-space layers",
    "mamba2": "Mamba-2 state-space layers",
    "conv": "short-convolution layers",
    "recurrent": "recurrent layers",
    "rwkv": "RWKV layers",
}
#: Families whose layers are recurrent without a ``layer_types`` list that says so.
RECURRENT_MODEL_TYPES: Mapping[str, str] = {
    "mamba": "Mamba state-space layers",
    "mamba2": "Mamba-2 state-space layers",
    "falcon_mamba": "Mamba state-space layers",
    "falcon_h1": "parallel Mamba-2 state-space layers",
    "jamba": "Mamba state-space layers",
    "bamba": "Mamba-2 state-space layers",
    "zamba": "Mamba state-space layers",
    "zamba2": "Mamba-2 state-space layers",
    "nemotron_h": "Mamba-2 state-space layers",
    "plamo2": "Mamba state-space layers",
    "recurrent_gemma": "recurrent (RG-LRU) layers",
    "rwkv": "RWKV layers",
    "xlstm": "xLSTM layers",
}
#: Attention implementations of transformers that run offline (no hub kernel download).
KNOWN_ATTENTION_IMPLEMENTATIONS = (
    "eager",
    "sdpa",
    "flex_attention",
    "flash_attention_2",
    "flash_attention_3",
)


@attrs.frozen(repr=False, eq=False, slots=False)
class TargetLayers(Record):
    """The target's family, declared layer types and attention implementation."""

    #: The config's `model_type` (the text model's for a multimodal config), "" when unstated.
    model_type: str = ""
    #: `layer_types` as declared (one per layer), None when the config lists none.
    layer_types: tuple[str, ...] | None = None
    #: `attn_implementation` (or `_attn_implementation`) when config.json states one.
    attn_implementation: str | None = None
    #: The dotted key the layer types were read from (``layer_types`` or
    #: ``text_config.layer_types``).
    where: str = "layer_types"

    def packing_blockers(self) -> tuple[str, ...]:
        """What in this target no per-document mask can isolate (empty: packing is possible)."""
        found: dict[str, str] = {}
        for layer_type in self.layer_types or ():
            if layer_type in RECURRENT_LAYER_TYPES:
                found[layer_type] = RECURRENT_LAYER_TYPES[layer_type]
        if not found and self.model_type in RECURRENT_MODEL_TYPES:
            found[self.model_type] = RECURRENT_MODEL_TYPES[self.model_type]
        return tuple(f"{what} ({name!r})" for name, what in found.items())

    def unknown_layer_types(self) -> tuple[str, ...]:
        """Declared layer types that are neither attention nor known recurrent layers."""
        known = set(ATTENTION_LAYER_TYPES) | set(RECURRENT_LAYER_TYPES)
        return tuple(dict.fromkeys(t for t in self.layer_types or () if t not in known))


def read_target_layers(config: Mapping[str, object]) -> TargetLayers:
    """The :class:`TargetLayers` of a parsed config.json (`text_config` first when present)."""
    text = config.get("text_config")
    section: Mapping[str, object] = config
    prefix = ""
    if isinstance(text, Mapping):
        section, prefix = text, "text_config."
    model_type = section.get("model_type", config.get("model_type"))
    raw_types = section.get("layer_types")
    layer_types = (
        tuple(raw_types)
        if isinstance(raw_types, list) and all(isinstance(t, str) for t in raw_types)
        else None
    )
    implementation = None
    for key in ("attn_implementation", "_attn_implementation"):
        value = section.get(key, config.get(key))
        if isinstance(value, str):
            implementation = value
            break
    return TargetLayers(
        model_type=model_type if isinstance(model_type, str) else "",
        layer_types=layer_types,
        attn_implementation=implementation,
        where=f"{prefix}layer_types",
    )


__all__ = [
    "ATTENTION_LAYER_TYPES",
    "KNOWN_ATTENTION_IMPLEMENTATIONS",
    "RECURRENT_LAYER_TYPES",
    "RECURRENT_MODEL_TYPES",
    "TargetLayers",
    "read_target_layers",
]
