"""The tensor layout of a DFlash drafter: its fields, names and shapes, and how to compare them.

The one home of the layout facts: which recipe fields decide a drafter's tensors
(:data:`ARCHITECTURE_FIELDS`, :data:`DRAFT_SPEC_FIELDS`; each kind's head sizes are its own,
:mod:`dflash_recipes.checkpoint.kinds`), building the
:class:`LayoutSpec` from a drafter's settings (:func:`layout_spec_for`), and turning a layout
difference into recipe fixes (:func:`layout_fixes`). One definition serves the compiler
(checking a checkpoint's header before a GPU is touched) and the warm-start loader (checking
the tensors it is about to copy), so both report a mismatch with the same words
(:func:`format_layout_diff`, :func:`layout_fixes`).

The layout is the z-lab one that serving engines load: unprefixed keys, no embedding table,
no output head, no rotary buffer (docs/dflash.md, "What a run writes, and the export layout").
The backbone is here (:func:`backbone_layout`); the tensors a kind adds are its kind module's
(``KindFacts.layout``), which :func:`head_layout` asks for.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence, Set
from typing import Any

import attrs

from dflash_recipes.checkpoint.kinds.protocol import Shape, dim
from dflash_recipes.checkpoint.kinds.registry import (
    HEAD_FIELD_OWNERS,
    KINDS,
    kind_facts,
)
from dflash_recipes.recipe.choices import PROJECTOR_TYPES, ProjectorType
from dflash_recipes.records import Record

_PROJECTORS: tuple[str, ...] = PROJECTOR_TYPES

#: The draft dims every drafter sets (recipe names under dflash_architecture_config); never
#: inherited from the base model.
ARCHITECTURE_FIELDS: tuple[str, ...] = (
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
)

#: Every dimension a checkpoint's tensor shapes can settle (dims, then head sizes).
SHAPE_FIELDS: tuple[str, ...] = (*ARCHITECTURE_FIELDS, *HEAD_FIELD_OWNERS)

#: The drafter settings (recipe / plan names) a :class:`LayoutSpec` takes as they are; the
#: target gives hidden_size and vocab_size, the taps give n_taps. A new field that changes
#: the tensors is added here and to :class:`LayoutSpec`.
DRAFT_SPEC_FIELDS: tuple[str, ...] = (
    *SHAPE_FIELDS,
    "projector_type",
    "use_confidence_head",
    "markov_head_type",
    "attention_sink",
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
)

#: Per-layer tensor names, after `layers.{i}.`, in the order a drafter defines them.
LAYER_TENSORS: tuple[str, ...] = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)

# Messages list at most this many grouped lines per kind; the LayoutDiff keeps everything.
_MAX_LINES_PER_KIND = 40


def _positive(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        msg = f"{attribute.name} must be a positive integer, got {value!r}"
        raise ValueError(msg)


def _projector(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value not in _PROJECTORS:
        msg = f"{attribute.name} must be one of {', '.join(_PROJECTORS)}, got {value!r}"
        raise ValueError(msg)


@attrs.frozen(repr=False, eq=False, slots=False)
class LayoutSpec(Record):
    """Everything that decides a drafter's tensor names and shapes.

    Construction checks that the fields the kind needs are set (``KindFacts.layout_needs``;
    ValueError otherwise): domino needs vocab_size, emb_dim and gru_hidden_dim; dspark needs
    vocab_size and markov_rank; dflash2 needs vocab_size, conv_kernel_size, conv_group_size and
    selector_rank. The compiler reports missing fields as diagnostics first.
    """

    hidden_size: int = attrs.field(validator=_positive)
    num_hidden_layers: int = attrs.field(validator=_positive)
    num_attention_heads: int = attrs.field(validator=_positive)
    num_key_value_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    intermediate_size: int = attrs.field(validator=_positive)
    #: Number of tapped target layers (fc input width is n_taps * hidden_size).
    n_taps: int = attrs.field(validator=_positive)
    #: The target's vocabulary; only head variants have vocab-sized tensors.
    vocab_size: int | None = attrs.field(default=None, validator=_positive)
    projector_type: ProjectorType = attrs.field(default="dflash", validator=_projector)
    emb_dim: int | None = attrs.field(default=None, validator=_positive)
    gru_hidden_dim: int | None = attrs.field(default=None, validator=_positive)
    markov_rank: int | None = attrs.field(default=None, validator=_positive)
    use_confidence_head: bool = False
    #: DSpark: vanilla, gated (adds gate_proj) or rnn (adds joint_proj).
    markov_head_type: str = "vanilla"
    attention_sink: bool = False
    #: DFlash 2: convolution taps, channels per coefficient group, selector codebook rank.
    conv_kernel_size: int | None = attrs.field(default=None, validator=_positive)
    conv_group_size: int | None = attrs.field(default=None, validator=_positive)
    selector_rank: int | None = attrs.field(default=None, validator=_positive)

    def __attrs_post_init__(self) -> None:
        needed = kind_facts(self.projector_type).layout_needs
        missing = [name for name in needed if getattr(self, name) is None]
        if missing:
            msg = f"projector_type {self.projector_type} needs {', '.join(missing)} to be set"
            raise ValueError(msg)


def backbone_layout(spec: LayoutSpec) -> dict[str, Shape]:
    """The plain DFlash tensors (the export layout in docs/dflash.md): 3 + 11 * layers (+ sinks)."""
    hidden = spec.hidden_size
    q_rows = spec.num_attention_heads * spec.head_dim
    kv_rows = spec.num_key_value_heads * spec.head_dim
    inter = spec.intermediate_size
    per_layer: dict[str, Shape] = {
        "input_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q_rows, hidden),
        "self_attn.k_proj.weight": (kv_rows, hidden),
        "self_attn.v_proj.weight": (kv_rows, hidden),
        "self_attn.o_proj.weight": (hidden, q_rows),
        "self_attn.q_norm.weight": (spec.head_dim,),
        "self_attn.k_norm.weight": (spec.head_dim,),
        "post_attention_layernorm.weight": (hidden,),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }
    layout: dict[str, Shape] = {
        "fc.weight": (hidden, spec.n_taps * hidden),
        "hidden_norm.weight": (hidden,),
    }
    for index in range(spec.num_hidden_layers):
        for suffix in LAYER_TENSORS:
            layout[f"layers.{index}.{suffix}"] = per_layer[suffix]
        if spec.attention_sink:
            layout[f"layers.{index}.self_attn.attention_sink_bias"] = (spec.num_attention_heads,)
    layout["norm.weight"] = (hidden,)
    return layout


def head_layout(spec: LayoutSpec) -> dict[str, Shape]:
    """The tensors the kind adds to the backbone (its ``KindFacts.layout``); empty for DFlash.

    See docs/dflash.md, "Domino and DSpark from a plain DFlash checkpoint".
    """
    return kind_facts(spec.projector_type).layout(spec)


def expected_layout(spec: LayoutSpec) -> dict[str, Shape]:
    """Every tensor name -> shape a drafter with `spec` stores: backbone, then head."""
    layout = backbone_layout(spec)
    layout.update(head_layout(spec))
    return layout


def head_submodules(spec: LayoutSpec) -> dict[str, tuple[str, ...]]:
    """Head submodule name -> its tensor names (a submodule loads whole or not at all)."""
    return kind_facts(spec.projector_type).tensor_groups(spec)


@attrs.frozen(repr=False, eq=False, slots=False)
class HeadPresence(Record):
    """Which head submodules a checkpoint holds wholly, not at all, or only partly."""

    complete: tuple[str, ...]
    absent: tuple[str, ...]
    #: Submodule -> (its tensors the checkpoint has, its tensors the checkpoint lacks).
    partial: Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]]


def head_presence(spec: LayoutSpec, found: Mapping[str, Shape]) -> HeadPresence:
    """Sort the head submodules of `spec` by how much of each `found` contains.

    Absent submodules train from scratch; a partial one is an error (never a half load).
    """
    complete: list[str] = []
    absent: list[str] = []
    partial: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
    for module, names in head_submodules(spec).items():
        have = tuple(n for n in names if n in found)
        lack = tuple(n for n in names if n not in found)
        if not lack:
            complete.append(module)
        elif not have:
            absent.append(module)
        else:
            partial[module] = (have, lack)
    return HeadPresence(complete=tuple(complete), absent=tuple(absent), partial=partial)


def format_partial_heads(presence: HeadPresence) -> str:
    """One message naming each partly present head submodule, what it has and what it lacks."""
    lines = ["head submodules are only partly present in the checkpoint (no half loads):"]
    for module, (have, lack) in presence.partial.items():
        lines.append(f"  {module}: has {', '.join(have)}; lacks {', '.join(lack)}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# comparing layouts
# ---------------------------------------------------------------------------------------------


@attrs.frozen(repr=False, eq=False, slots=False)
class LayoutDiff(Record):
    """Differences between an expected layout and what a checkpoint holds."""

    #: Expected but absent: name -> expected shape.
    missing: Mapping[str, Shape]
    #: Present but not expected: name -> found shape.
    unexpected: Mapping[str, Shape]
    #: Present with another shape: name -> (expected, found).
    mismatched: Mapping[str, tuple[Shape, Shape]]
    #: Present with the expected shape (lets messages tell a wholly absent layer).
    matched: tuple[str, ...] = ()

    @property
    def is_empty(self) -> bool:
        """True when the layouts agree exactly."""
        return not (self.missing or self.unexpected or self.mismatched)

    @property
    def count(self) -> int:
        """Number of offending tensors."""
        return len(self.missing) + len(self.unexpected) + len(self.mismatched)


_NUMBER_RE = r"([0-9]+)"


def _is_number(part: str) -> bool:
    # ASCII only: "²".isdigit() is True but int("²") fails, and names come from any header.
    return part.isascii() and part.isdigit()


def _natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    return tuple((0, int(p)) if _is_number(p) else (1, p) for p in re.split(_NUMBER_RE, name))


def compare_layout(expected: Mapping[str, Shape], found: Mapping[str, Shape]) -> LayoutDiff:
    """Missing, unexpected and shape-mismatched tensors, each sorted naturally by name."""
    missing = {n: tuple(expected[n]) for n in expected if n not in found}
    unexpected = {n: tuple(found[n]) for n in found if n not in expected}
    mismatched = {
        n: (tuple(expected[n]), tuple(found[n]))
        for n in expected
        if n in found and tuple(expected[n]) != tuple(found[n])
    }
    return LayoutDiff(
        missing=dict(sorted(missing.items(), key=lambda i: _natural_key(i[0]))),
        unexpected=dict(sorted(unexpected.items(), key=lambda i: _natural_key(i[0]))),
        mismatched=dict(sorted(mismatched.items(), key=lambda i: _natural_key(i[0]))),
        matched=tuple(n for n in expected if n in found and n not in mismatched),
    )


def format_indices(indices: Sequence[int]) -> str:
    """`{0..4}` for a run, `{0,2,5}` for scattered indices, `{0..3,7}` mixed, `{5}` alone.

    Runs of three or more collapse to `a..b`; shorter runs are listed.
    """
    values = sorted(set(indices))
    parts: list[str] = []
    start = 0
    while start < len(values):
        end = start
        while end + 1 < len(values) and values[end + 1] == values[end] + 1:
            end += 1
        if end - start >= 2:
            parts.append(f"{values[start]}..{values[end]}")
        else:
            parts.extend(str(v) for v in values[start : end + 1])
        start = end + 1
    return "{" + ",".join(parts) + "}"


def _format_shape(shape: Shape | None) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]" if shape is not None else "none"


def _split_index(name: str) -> tuple[str, int, str] | None:
    """Split at the first dotted component that is a number: `layers.3.mlp...` -> 3."""
    parts = name.split(".")
    for position, part in enumerate(parts):
        if _is_number(part) and len(part) <= 9:
            prefix = ".".join(parts[:position])
            suffix = ".".join(parts[position + 1 :])
            return prefix, int(part), suffix
    return None


def _whole_blocks(names: Sequence[str], others: Sequence[str]) -> set[tuple[str, int]]:
    """(prefix, index) blocks of two or more `names` that share no index with `others`.

    A layer the checkpoint lacks entirely (or has in excess) reads better as one line.
    """
    counts: dict[tuple[str, int], int] = {}
    for name in names:
        split = _split_index(name)
        if split is not None:
            counts[split[:2]] = counts.get(split[:2], 0) + 1
    taken = {split[:2] for name in others if (split := _split_index(name)) is not None}
    return {block for block, count in counts.items() if count >= 2 and block not in taken}


def _grouped_lines(
    items: Mapping[str, tuple[Shape | None, Shape | None]],
    label: str,
    whole: Set[tuple[str, int]] = frozenset(),
) -> list[str]:
    """One line per (name pattern, expected shape, found shape), indices collapsed."""
    groups: dict[tuple[str, str, Shape | None, Shape | None], list[int]] = {}
    block_sizes: dict[tuple[str, int], int] = {}
    singles: list[tuple[str, Shape | None, Shape | None]] = []
    for name, (want, have) in items.items():
        split = _split_index(name)
        if split is None:
            singles.append((name, want, have))
            continue
        prefix, index, suffix = split
        if (prefix, index) in whole:
            block_sizes[prefix, index] = block_sizes.get((prefix, index), 0) + 1
            continue
        groups.setdefault((prefix, suffix, want, have), []).append(index)
    rows: list[tuple[tuple[tuple[int, int | str], ...], str]] = []
    for name, want, have in singles:
        rows.append((_natural_key(name), _line(label, name, want, have)))
    for (prefix, suffix, want, have), indices in groups.items():
        lead = f"{prefix}." if prefix else ""
        tail = f".{suffix}" if suffix else ""
        pattern = f"{lead}{format_indices(indices)}{tail}"
        key = _natural_key(f"{lead}{min(indices)}{tail}")
        rows.append((key, _line(label, pattern, want, have)))
    by_prefix: dict[str, list[int]] = {}
    for prefix, index in block_sizes:
        by_prefix.setdefault(prefix, []).append(index)
    for prefix, indices in by_prefix.items():
        lead = f"{prefix}." if prefix else ""
        total = sum(block_sizes[prefix, i] for i in indices)
        noun = "layers" if prefix.rpartition(".")[2] == "layers" else "blocks"
        if label == "missing":
            tail = f"whole {noun} the checkpoint lacks"
        else:
            tail = f"whole {noun} the recipe does not expect"
        text = f"  {label}: {lead}{format_indices(indices)}.*: {total} tensors, {tail}"
        rows.append((_natural_key(f"{lead}{min(indices)}"), text))
    rows.sort(key=lambda row: row[0])
    lines = [text for _, text in rows]
    if len(lines) > _MAX_LINES_PER_KIND:
        hidden = len(lines) - _MAX_LINES_PER_KIND
        lines = [
            *lines[:_MAX_LINES_PER_KIND],
            f"  ... and {hidden} more {label or 'with another shape'}",
        ]
    return lines


def _line(label: str, pattern: str, want: Shape | None, have: Shape | None) -> str:
    lead = f"  {label}: " if label else "  "
    if want is None:
        return f"{lead}{pattern}: checkpoint has {_format_shape(have)}, recipe expects none"
    if have is None:
        return f"{lead}{pattern}: recipe expects {_format_shape(want)}, checkpoint has none"
    return f"{lead}{pattern}: recipe expects {_format_shape(want)}, checkpoint has " + (
        _format_shape(have)
    )


def format_layout_diff(diff: LayoutDiff, *, fixes: Sequence[str] = ()) -> str:
    """One message listing every offending tensor, grouped by layer pattern, then the fixes.

    ::

        checkpoint tensors do not match the drafter the recipe describes (5 shapes differ):
          layers.{0..4}.mlp.gate_proj.weight: recipe expects [22016, 4096], checkpoint has ...
          missing: layers.{5}.input_layernorm.weight: recipe expects [4096], checkpoint has none
        fix: set dflash_architecture_config.intermediate_size: 12288
    """
    counts: list[str] = []
    if diff.mismatched:
        counts.append(f"{len(diff.mismatched)} with another shape")
    if diff.missing:
        counts.append(f"{len(diff.missing)} missing")
    if diff.unexpected:
        counts.append(f"{len(diff.unexpected)} unexpected")
    summary = ", ".join(counts) if counts else "no differences"
    lines = [f"checkpoint tensors do not match the drafter the recipe describes ({summary}):"]
    lines += _grouped_lines({n: (w, h) for n, (w, h) in diff.mismatched.items()}, "")
    present = [*diff.matched, *diff.mismatched]
    missing_blocks = _whole_blocks(list(diff.missing), present)
    extra_blocks = _whole_blocks(list(diff.unexpected), [*present, *diff.missing])
    lines += _grouped_lines(
        {n: (w, None) for n, w in diff.missing.items()}, "missing", missing_blocks
    )
    lines += _grouped_lines(
        {n: (None, h) for n, h in diff.unexpected.items()}, "unexpected", extra_blocks
    )
    lines += [f"fix: {fix}" for fix in fixes]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# reading dimensions back from a header
# ---------------------------------------------------------------------------------------------

_LAYER_RE = r"^layers\.([0-9]{1,9})\."


def infer_architecture(found: Mapping[str, Shape]) -> dict[str, int]:
    """Drafter dimensions implied by tensor shapes; fields it cannot tell are left out.

    Keys (when derivable): num_hidden_layers, hidden_size, n_taps, head_dim,
    num_attention_heads, num_key_value_heads, intermediate_size, and what each kind's
    ``infer_dims`` shows (vocab_size, emb_dim, gru_hidden_dim, markov_rank). Never raises on
    odd shapes.
    """
    dims: dict[str, int] = {}
    layers = sorted({int(m.group(1)) for n in found if (m := re.match(_LAYER_RE, n))})
    if layers:
        dims["num_hidden_layers"] = layers[-1] + 1
    hidden = (
        dim(found, "norm.weight", 1, 0)
        or dim(found, "hidden_norm.weight", 1, 0)
        or dim(found, "fc.weight", 2, 0)
    )
    if hidden:
        dims["hidden_size"] = hidden
        fc_in = dim(found, "fc.weight", 2, 1)
        if fc_in and fc_in % hidden == 0:
            dims["n_taps"] = fc_in // hidden
    if layers:
        first = f"layers.{layers[0]}."
        head_dim = dim(found, first + "self_attn.q_norm.weight", 1, 0)
        if head_dim:
            dims["head_dim"] = head_dim
            for key, tensor in (
                ("num_attention_heads", "self_attn.q_proj.weight"),
                ("num_key_value_heads", "self_attn.k_proj.weight"),
            ):
                rows = dim(found, first + tensor, 2, 0)
                if rows and rows % head_dim == 0:
                    dims[key] = rows // head_dim
        inter = dim(found, first + "mlp.gate_proj.weight", 2, 0)
        if inter:
            dims["intermediate_size"] = inter
    # Each kind reads its own sizes; a later kind's vocab_size wins (DSpark's over Domino's).
    for kind in KINDS.values():
        dims.update(kind.infer_dims(found))
    return dims


# ---------------------------------------------------------------------------------------------
# building the spec, and fixing a difference
# ---------------------------------------------------------------------------------------------


def layout_spec_for(
    draft: object, *, hidden_size: int, n_taps: int, vocab_size: int | None
) -> LayoutSpec:
    """The :class:`LayoutSpec` of a drafter whose settings `draft` holds as attributes.

    `draft` is a recipe's ``dflash_architecture_config`` or a plan's ``ResolvedDraft``: any
    object with the :data:`DRAFT_SPEC_FIELDS` attributes. Raises ValueError when a head size
    the projector type needs is unset (the compiler reports that as a diagnostic first).
    """
    values: dict[str, Any] = {name: getattr(draft, name) for name in DRAFT_SPEC_FIELDS}
    return LayoutSpec(hidden_size=hidden_size, n_taps=n_taps, vocab_size=vocab_size, **values)


@attrs.frozen(repr=False, eq=False, slots=False)
class CheckpointDims(Record):
    """A checkpoint's draft dims (recipe field names, plus hidden_size and n_taps) and where
    each came from, for messages and fixes."""

    values: Mapping[str, int]
    sources: Mapping[str, str]

    def fix(self, name: str) -> str:
        """`set dflash_architecture_config.NAME: VALUE, as the checkpoint's config.json says`."""
        return f"set dflash_architecture_config.{name}: {self.values[name]}, {self.sources[name]}"


def checkpoint_dims(
    stated: Mapping[str, int] | None, found: Mapping[str, Shape] | None
) -> CheckpointDims:
    """Merge the dims a config.json states with those the tensor shapes show (tensors win)."""
    inferred = infer_architecture(found) if found is not None else {}
    said_dims = dict(stated or {})
    values: dict[str, int] = {}
    sources: dict[str, str] = {}
    for name in sorted(set(inferred) | set(said_dims)):
        said, shown = said_dims.get(name), inferred.get(name)
        if shown is not None and said is not None and said != shown:
            values[name] = shown
            sources[name] = (
                f"as the checkpoint's tensors show (its config.json says {said}, which is stale)"
            )
        elif said is not None:
            values[name] = said
            sources[name] = "as the checkpoint's config.json says"
        elif shown is not None:
            values[name] = shown
            sources[name] = "as the checkpoint's tensor shapes show"
    return CheckpointDims(values=values, sources=sources)


def layout_fixes(
    spec: LayoutSpec,
    dims: CheckpointDims,
    found: Mapping[str, Shape],
    *,
    stated_taps: Sequence[int] | None = None,
    stated_projector: str | None = None,
) -> list[str]:
    """The recipe settings that would make `spec` match a checkpoint: the one wording of fixes.

    `dims` are the checkpoint's dims (:func:`checkpoint_dims`), `found` its tensor shapes;
    `stated_taps` / `stated_projector` what its config.json says, when it has one.
    """
    fixes: list[str] = []
    for name in (*ARCHITECTURE_FIELDS, *kind_facts(spec.projector_type).head_fields):
        value = dims.values.get(name)
        if value is not None and value != getattr(spec, name):
            fixes.append(dims.fix(name))
    n_taps = dims.values.get("n_taps")
    if n_taps is not None and n_taps != spec.n_taps:
        if stated_taps is not None and len(stated_taps) == n_taps:
            taps = "[" + ", ".join(str(t) for t in stated_taps) + "]"
            fixes.append(
                f"set dflash_architecture_config.target_layer_ids: {taps}, as the checkpoint's "
                "config.json says"
            )
        else:
            fixes.append(
                f"set dflash_architecture_config.target_layer_ids to the {n_taps} taps the "
                f"checkpoint was trained with (its fc.weight takes {n_taps}, the recipe "
                f"gives {spec.n_taps})"
            )
    has_sink = any(n.endswith(".self_attn.attention_sink_bias") for n in found)
    if has_sink != spec.attention_sink:
        fixes.append(
            f"set dflash_architecture_config.attention_sink: {str(has_sink).lower()}, as the "
            "checkpoint's tensors show"
        )
    if stated_projector is not None and stated_projector != spec.projector_type:
        fixes.append(
            f"set dflash_architecture_config.projector_type: {stated_projector}, as the "
            "checkpoint's config.json says"
        )
    for name in ("hidden_size", "vocab_size"):
        have, want = dims.values.get(name), getattr(spec, name)
        if have is not None and want is not None and have != want:
            fixes.append(
                f"the checkpoint was trained for a target with {name} {have}, the base model has "
                f"{want}: use the target the drafter was trained for"
            )
    return fixes


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """Default taps (docs/dflash.md, "Taps"): one layer -> N // 2, else spread over 1 .. N - 3.

    `round(1 + i * (N - 4) / (L - 1))` with Python's round (half to even). Raises ValueError
    when the target is too shallow for the formula to give distinct layers inside it.
    """
    n, count = num_target_layers, num_draft_layers
    if n < 1 or count < 1:
        msg = f"need at least one target and one draft layer, got N={n}, L={count}"
        raise ValueError(msg)
    if count == 1:
        return (n // 2,)
    ids = tuple(round(1 + i * (n - 4) / (count - 1)) for i in range(count))
    if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= n:
        msg = (
            f"the default taps formula gives {list(ids)} for a {n}-layer target and {count} "
            "draft layers (out of range or repeated); set target_layer_ids explicitly"
        )
        raise ValueError(msg)
    return ids


__all__ = [
    "ARCHITECTURE_FIELDS",
    "DRAFT_SPEC_FIELDS",
    "LAYER_TENSORS",
    "SHAPE_FIELDS",
    "CheckpointDims",
    "HeadPresence",
    "LayoutDiff",
    "LayoutSpec",
    "ProjectorType",
    "Shape",
    "backbone_layout",
    "checkpoint_dims",
    "compare_layout",
    "default_target_layer_ids",
    "expected_layout",
    "format_indices",
    "format_layout_diff",
    "format_partial_heads",
    "head_layout",
    "head_presence",
    "head_submodules",
    "infer_architecture",
    "layout_fixes",
    "layout_spec_for",
]
