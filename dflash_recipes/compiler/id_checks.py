"""Taps, mask token id, attention kinds and rms_norm_eps: from the recipe, else the resumed run,
else the init checkpoint, else the default formula (taps) or the documented default (rms_norm_eps,
1e-6); the mask id is never guessed.

Each resolver is a function of the recipe and of what the reading phase found
(:class:`~dflash_recipes.compiler.state.WhatWasRead`); :func:`resolve_draft_ids` runs them in the
order their findings are reported and returns the :class:`DraftIds` the plan gets.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import attrs

from dflash_recipes.checkpoint.kinds.registry import HEAD_FIELD_MEANING, kind_facts
from dflash_recipes.checkpoint.tensor_layout import default_target_layer_ids
from dflash_recipes.compiler.codes import (
    CHECKPOINT_KIND_FIELD_DIFFERS,
    CHECKPOINT_LAYER_TYPES_DIFFER,
    CHECKPOINT_MASK_DIFFERS,
    CHECKPOINT_TAPS_DIFFER,
    HEAD_FIELD_MISSING,
    KIND_FIELD_FROM_CHECKPOINT,
    LAYER_TYPES_FROM_CHECKPOINT,
    LAYER_TYPES_FROM_PREVIOUS_RUN,
    MASK_FROM_CHECKPOINT,
    MASK_FROM_PREVIOUS_RUN,
    MASK_TOKEN_MISSING,
    RMS_NORM_EPS_FROM_CHECKPOINT,
    RMS_NORM_EPS_FROM_PREVIOUS_RUN,
    SLIDING_WINDOW_MISSING,
    SLIDING_WINDOW_UNUSED,
    TAPS_DEFAULT,
    TAPS_FROM_CHECKPOINT,
    TAPS_FROM_PREVIOUS_RUN,
    TAPS_OUT_OF_RANGE,
    TAPS_UNKNOWN,
)
from dflash_recipes.compiler.recipe_checks import check_layer_types_length
from dflash_recipes.compiler.state import (
    ARCH_PATH,
    MASK_PATH,
    NOTHING_READ,
    TAPS_PATH,
    CompileInputs,
    Report,
    WhatWasRead,
    format_ids,
)
from dflash_recipes.recipe.sections import DFlashArchitectureConfig
from dflash_recipes.records import Record

#: rms_norm_eps of a drafter when neither the recipe nor a checkpoint states one (Qwen3's).
DEFAULT_RMS_NORM_EPS = 1.0e-6


@attrs.frozen(repr=False, eq=False, slots=False)
class DraftIds(Record):
    """The drafter's ids as the plan gets them: taps, mask id, attention kinds, rms_norm_eps,
    and the kind's fields a checkpoint may give (``KindFacts.inherited_fields``)."""

    taps: tuple[int, ...] | None
    mask: int | None
    layer_types: tuple[str, ...] | None
    sliding_window: int | None
    rms_norm_eps: float
    #: Each of the kind's inherited fields -> the recipe's value, else the checkpoint's (None:
    #: neither states one); empty for a kind without such fields.
    kind_fields: Mapping[str, object] = attrs.field(factory=dict)


def resolve_draft_ids(inputs: CompileInputs, read: WhatWasRead, report: Report) -> DraftIds:
    """Each id from the recipe, else the resumed run, else the init checkpoint, else its default
    (taps: the formula; rms_norm_eps: 1e-6; the mask id: none, reported), in this order."""
    taps = resolve_taps(inputs, read, report)
    mask = resolve_mask(inputs, read, report)
    layer_types, sliding_window = resolve_layer_types(inputs, read, report)
    eps = resolve_rms_norm_eps(inputs, read, report)
    fields = resolve_kind_fields(inputs, read, report)
    return DraftIds(taps, mask, layer_types, sliding_window, eps, fields)


def _stated_kind_fields(
    raw: Mapping[str, object], names: tuple[str, ...]
) -> dict[str, tuple[object, str]]:
    """name -> (value, dotted key) of each of `names` a config.json states: ``dflash_config``
    first, then the top level (z-lab's reading)."""
    nested = raw.get("dflash_config")
    nested = nested if isinstance(nested, Mapping) else {}
    stated: dict[str, tuple[object, str]] = {}
    for name in names:
        if nested.get(name) is not None:
            stated[name] = (nested[name], f"dflash_config.{name}")
        elif raw.get(name) is not None:
            stated[name] = (raw[name], name)
    return stated


def _same(a: object, b: object) -> bool:
    """Equal values; floats within a relative 1e-9 (a value read back from JSON)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9)
    return a == b


def resolve_kind_fields(
    inputs: CompileInputs, read: WhatWasRead, report: Report
) -> dict[str, object]:
    """The projector type's inherited fields (``KindFacts.inherited_fields``; DFlash 2's
    convolution and selector settings): the recipe's, else the resumed run's, else the init
    checkpoint's (an info each); a recipe value the checkpoint contradicts is an error; a
    required one that nothing states is ``head-field-missing``. Then the kind's rules
    (``KindFacts.settings_findings``) on the values the plan gets, when the target is read."""
    arch = inputs.arch
    kind = kind_facts(arch.projector_type)
    if not kind.inherited_fields:
        return {}
    previous_plan = read.output.previous_plan
    config = read.checkpoint.readable_config
    stated: dict[str, tuple[object, str]] = {}
    origin = "the init checkpoint's"
    if read.resume is not None:
        if previous_plan is not None:
            previous = previous_plan.draft.architecture
            origin = "the resumed run's"
            for name in kind.inherited_fields:
                value = getattr(previous, name, None)
                if value is not None:
                    stated[name] = (value, f"draft.architecture.{name} of its plan.json")
    elif config is not None:
        stated = _stated_kind_fields(config.raw, kind.inherited_fields)
    fields: dict[str, object] = {}
    for name in kind.inherited_fields:
        value = getattr(arch, name)
        path = f"{ARCH_PATH}.{name}"
        said = stated.get(name)
        if value is not None:
            if said is not None and not _same(said[0], value):
                report.emit(
                    CHECKPOINT_KIND_FIELD_DIFFERS,
                    path,
                    f"{name} {value!r} contradicts {origin} {said[0]!r} ({said[1]}); the "
                    f"{arch.projector_type} drafter loaded from it was trained with "
                    f"{said[0]!r}",
                    f"set dflash_architecture_config.{name}: {said[0]!r} (or delete it to take "
                    f"{origin}), or warm-start from a checkpoint trained with {value!r}",
                )
            fields[name] = value
        elif said is not None:
            report.emit(
                KIND_FIELD_FROM_CHECKPOINT,
                path,
                f"{name} not set: using {origin} {said[0]!r} ({said[1]})",
                f"set dflash_architecture_config.{name}: {said[0]!r} to pin it in the recipe",
            )
            fields[name] = said[0]
        else:
            fields[name] = None
    unread = inputs.recipe.dflash.dflash_init_checkpoint is not None and (
        read.checkpoint.broken or (read is NOTHING_READ)
    )
    for name in kind.required_fields:
        if fields[name] is not None or unread:
            continue
        if config is not None and read.resume is None:
            why = (
                "and the init checkpoint's config.json does not state it (a DFlash 1 drafter "
                "warm-starts only the backbone)"
            )
        elif read.resume is not None:
            why = "and the run being resumed has no plan.json stating it"
        else:
            why = "and there is no init checkpoint of this kind to take it from"
        report.emit(
            HEAD_FIELD_MISSING,
            f"{ARCH_PATH}.{name}",
            f"projector_type {arch.projector_type} needs dflash_architecture_config.{name} "
            f"({HEAD_FIELD_MEANING[name]}), which is not set, {why}",
            f"set dflash_architecture_config.{name} ({HEAD_FIELD_MEANING[name]})",
        )
    facts = read.facts
    if facts is not None:
        for finding in kind.settings_findings(
            fields,
            hidden=facts.hidden_size,
            vocab=facts.vocab_size,
            block_size=inputs.recipe.dflash.dflash_block_size,
        ):
            report.emit(finding.code, f"{ARCH_PATH}.{finding.field}", finding.message, finding.hint)
    return fields


def schema_draft_ids(inputs: CompileInputs, report: Report) -> DraftIds:
    """The ids a schema-level compile (`lint`) can know: the recipe's, nothing read. An unset
    mask id without an init checkpoint to take it from is reported already."""
    arch, dflash = inputs.arch, inputs.recipe.dflash
    mask = dflash.dflash_mask_token_id
    if mask is None and dflash.dflash_init_checkpoint is None:
        mask = resolve_mask(inputs, NOTHING_READ, report)
    eps = float(arch.rms_norm_eps) if arch.rms_norm_eps is not None else DEFAULT_RMS_NORM_EPS
    fields = resolve_kind_fields(inputs, NOTHING_READ, report)
    return DraftIds(arch.target_layer_ids, mask, arch.layer_types, arch.sliding_window, eps, fields)


def resolve_rms_norm_eps(inputs: CompileInputs, read: WhatWasRead, report: Report) -> float:
    """The plan's rms_norm_eps: recipe, else resumed run, else checkpoint, else 1e-6.

    A recipe value the checkpoint contradicts is warned about by check_checkpoint_config.
    """
    eps = inputs.arch.rms_norm_eps
    if eps is not None:
        return float(eps)
    path = f"{ARCH_PATH}.rms_norm_eps"
    previous_plan = read.output.previous_plan
    previous = previous_plan.draft.architecture if previous_plan else None
    if read.resume is not None and previous is not None:
        report.emit(
            RMS_NORM_EPS_FROM_PREVIOUS_RUN,
            path,
            f"rms_norm_eps not set: using {previous.rms_norm_eps!r}, the epsilon of the run "
            "being resumed (its plan.json)",
            f"set rms_norm_eps: {previous.rms_norm_eps!r} to pin it in the recipe",
        )
        return previous.rms_norm_eps
    config = read.checkpoint.readable_config
    stated = config.rms_norm_eps if config is not None else None
    if read.resume is None and stated is not None:
        report.emit(
            RMS_NORM_EPS_FROM_CHECKPOINT,
            path,
            f"rms_norm_eps not set: using the init checkpoint's {stated!r} (its config.json)",
            f"set rms_norm_eps: {stated!r} to pin it in the recipe",
        )
        return stated
    return DEFAULT_RMS_NORM_EPS


def resolve_taps(
    inputs: CompileInputs, read: WhatWasRead, report: Report
) -> tuple[int, ...] | None:
    """The plan's target_layer_ids: recipe, else resumed run, else checkpoint, else the default
    formula (never guessed for a checkpoint that does not state them)."""
    arch, config = inputs.arch, read.checkpoint.config
    taps = arch.target_layer_ids
    stated = config.target_layer_ids if config is not None else None
    if taps is not None:
        if stated is not None and stated != taps:
            report.emit(
                CHECKPOINT_TAPS_DIFFER,
                TAPS_PATH,
                f"target_layer_ids {format_ids(taps)} differ from the init checkpoint's "
                f"{format_ids(stated)}; the warm start loads, but its fused context is "
                "built from other target layers, so it starts degraded",
                f"set target_layer_ids: {format_ids(stated)} (or delete the field to take "
                "the checkpoint's), unless retapping is intended",
            )
        return taps
    previous_plan = read.output.previous_plan
    previous = previous_plan.draft.target_layer_ids if previous_plan else None
    if read.resume is not None and previous is not None:
        report.emit(
            TAPS_FROM_PREVIOUS_RUN,
            TAPS_PATH,
            f"target_layer_ids not set: using {format_ids(previous)}, the taps of the run "
            "being resumed (its plan.json)",
            f"set target_layer_ids: {format_ids(previous)} to pin them in the recipe",
        )
        return previous
    if stated is not None:
        report.emit(
            TAPS_FROM_CHECKPOINT,
            TAPS_PATH,
            f"target_layer_ids not set: using the init checkpoint's {format_ids(stated)} "
            "(its config.json)",
            f"set target_layer_ids: {format_ids(stated)} to pin them in the recipe",
        )
        return stated
    if inputs.recipe.dflash.dflash_init_checkpoint is not None:
        if read.checkpoint.broken:
            return None
        n_taps = read.checkpoint.dims.values.get("n_taps")
        count = f" (its fc.weight takes {n_taps} taps)" if n_taps else ""
        where = "the run being resumed" if read.resume is not None else "the init checkpoint"
        report.emit(
            TAPS_UNKNOWN,
            TAPS_PATH,
            f"target_layer_ids not set, and {where} does not state the taps it was trained "
            f"with{count}; taps are never guessed",
            "set dflash_architecture_config.target_layer_ids to the drafter's taps (its "
            "model card or original config.json)",
        )
        return None
    layers = arch.num_hidden_layers
    if read.facts is None or layers is None:
        return None
    target_layers = read.facts.num_hidden_layers
    try:
        taps = default_target_layer_ids(target_layers, layers)
    except ValueError as exc:
        report.emit(
            TAPS_OUT_OF_RANGE,
            TAPS_PATH,
            f"target_layer_ids not set and {exc}",
            f"set target_layer_ids to distinct layers in 0..{target_layers - 1}",
        )
        return None
    report.emit(
        TAPS_DEFAULT,
        TAPS_PATH,
        f"target_layer_ids not set: using the default formula for a {target_layers}-layer "
        f"target and {layers} draft layers: {format_ids(taps)}",
        f"set target_layer_ids: {format_ids(taps)} to pin them in the recipe",
    )
    return taps


def resolve_mask(inputs: CompileInputs, read: WhatWasRead, report: Report) -> int | None:
    """The plan's dflash_mask_token_id: recipe, else resumed run, else checkpoint; never guessed
    (None, reported, when nothing states it)."""
    mask = inputs.recipe.dflash.dflash_mask_token_id
    config = read.checkpoint.config
    stated = config.mask_token_id if config is not None else None
    if mask is not None:
        if stated is not None and stated != mask:
            report.emit(
                CHECKPOINT_MASK_DIFFERS,
                MASK_PATH,
                f"dflash_mask_token_id {mask} differs from the init checkpoint's {stated}; the "
                "warm start loads, but the drafter learned to read token "
                f"{stated} as the mask, so it starts degraded",
                f"set dflash_mask_token_id: {stated} (or delete it to take the checkpoint's), "
                "unless the change is intended",
            )
        return mask
    previous_plan = read.output.previous_plan
    previous = previous_plan.draft.mask_token_id if previous_plan else None
    if read.resume is not None and previous is not None:
        report.emit(
            MASK_FROM_PREVIOUS_RUN,
            MASK_PATH,
            f"dflash_mask_token_id not set: using {previous}, the mask id of the run being "
            "resumed (its plan.json)",
            f"set dflash_mask_token_id: {previous} to pin it in the recipe",
        )
        return previous
    if stated is not None:
        report.emit(
            MASK_FROM_CHECKPOINT,
            MASK_PATH,
            f"dflash_mask_token_id not set: using the init checkpoint's {stated} (its config.json)",
            f"set dflash_mask_token_id: {stated} to pin it in the recipe",
        )
        return stated
    if read.checkpoint.broken:
        return None
    if read.resume is not None:
        source = "the run being resumed has no plan.json stating one"
    elif inputs.recipe.dflash.dflash_init_checkpoint is not None:
        source = "the init checkpoint's config.json does not state one"
    else:
        source = "there is no init checkpoint to take it from"
    facts = read.facts
    vocab = f" below the target's vocab_size {facts.vocab_size}" if facts else ""
    report.emit(
        MASK_TOKEN_MISSING,
        MASK_PATH,
        f"dflash_mask_token_id is not set and {source}; the mask id is never guessed",
        f"set dflash.dflash_mask_token_id to an embedding row{vocab} that the tokenizer "
        "never produces; for Qwen3 use 151669, the first unused embedding row (the Qwen3 "
        "tokenizer has no mask token)",
    )
    return None


def resolve_layer_types(
    inputs: CompileInputs, read: WhatWasRead, report: Report
) -> tuple[tuple[str, ...] | None, int | None]:
    """The plan's (layer_types, sliding_window): recipe, else resumed run, else checkpoint."""
    arch = inputs.arch
    types, window = arch.layer_types, arch.sliding_window
    config = read.checkpoint.readable_config
    stated_types = config.layer_types if config is not None else None
    stated_window = config.sliding_window if config is not None else None
    if stated_types is None or "sliding_attention" not in stated_types:
        stated_window = None  # a window without sliding layers means nothing
    previous_plan = read.output.previous_plan
    previous = previous_plan.draft.architecture if previous_plan else None
    taken: list[str] = []
    origin = ""
    if types is None and window is None and read.resume is not None and previous:
        types, window = previous.layer_types, previous.sliding_window
        if types is not None:
            report.emit(
                LAYER_TYPES_FROM_PREVIOUS_RUN,
                f"{ARCH_PATH}.layer_types",
                f"layer_types not set: using [{', '.join(types)}]"
                + (f" with sliding_window {window}" if window is not None else "")
                + ", the attention kinds of the run being resumed (its plan.json)",
                "set layer_types (and sliding_window) to pin them in the recipe",
            )
        origin = " (from the resumed run's plan)"
    else:
        if types is None and stated_types and "sliding_attention" in stated_types:
            # only a checkpoint with sliding layers says more than the default
            types, origin = stated_types, " (from the init checkpoint)"
            taken.append(f"layer_types [{', '.join(stated_types)}]")
        if window is None and stated_window is not None:
            window = stated_window
            taken.append(f"sliding_window {stated_window}")
        if taken:
            report.emit(
                LAYER_TYPES_FROM_CHECKPOINT,
                f"{ARCH_PATH}.layer_types",
                f"{' and '.join(taken)} not set in the recipe: using the init checkpoint's "
                "(its config.json)",
                "set "
                + " and ".join(t.replace(" ", ": ", 1) for t in taken)
                + " to pin them in the recipe",
            )
        if config is not None:
            compare_layer_types(arch, (types, window), (stated_types, stated_window), report)
    layers = arch.num_hidden_layers
    if origin and not check_layer_types_length(arch, types, origin, report):
        return None, None
    if types is not None and layers is not None and len(types) != layers:
        return None, None  # reported by check_schema
    sliding = types is not None and "sliding_attention" in types
    if sliding and window is None:
        report.emit(
            SLIDING_WINDOW_MISSING,
            f"{ARCH_PATH}.sliding_window",
            f"layer_types{origin} has sliding_attention layers, but no sliding_window says "
            "how many keys they see",
            "set dflash_architecture_config.sliding_window (a positive number of keys, the "
            "query itself included, e.g. 2048), or make every layer full_attention",
        )
        return None, None
    if not sliding and window is not None:
        if arch.sliding_window is not None:
            report.emit(
                SLIDING_WINDOW_UNUSED,
                f"{ARCH_PATH}.sliding_window",
                f"sliding_window {window} is set, but no layer is sliding_attention, so it "
                "changes nothing",
                "delete sliding_window, or set some layer_types entries to sliding_attention",
            )
        window = None
    return types, window


def compare_layer_types(
    arch: DFlashArchitectureConfig,
    recipe: tuple[tuple[str, ...] | None, int | None],
    checkpoint: tuple[tuple[str, ...] | None, int | None],
    report: Report,
) -> None:
    """Warn when the (layer_types, sliding_window) the plan gets differ from those of a readable
    checkpoint config.json (unset types are full attention in every layer)."""
    (types, window), (stated_types, stated_window) = recipe, checkpoint
    layers = arch.num_hidden_layers
    full = ("full_attention",) * layers if layers is not None else None
    mine = types if types is not None else full
    theirs = stated_types if stated_types is not None else full
    if mine is None or theirs is None:
        return  # the default needs num_hidden_layers, whose absence is arch-dim-missing
    if mine == theirs and (stated_window is None or window == stated_window):
        return
    said = f"[{', '.join(theirs)}]" + (
        f" with sliding_window {stated_window}" if stated_window is not None else ""
    )
    got = f"[{', '.join(mine)}]" + (f" with sliding_window {window}" if window else "")
    fix = f"set layer_types: [{', '.join(theirs)}]" + (
        f" and sliding_window: {stated_window}" if stated_window is not None else ""
    )
    report.emit(
        CHECKPOINT_LAYER_TYPES_DIFFER,
        f"{ARCH_PATH}.layer_types",
        f"the recipe's attention kinds {got} differ from the init checkpoint's {said}; the "
        "warm start loads, but its layers learned to attend over other keys, so it starts "
        "degraded",
        f"{fix} (or delete the fields to take the checkpoint's), unless the change is intended",
    )


__all__ = [
    "DEFAULT_RMS_NORM_EPS",
    "DraftIds",
    "compare_layer_types",
    "resolve_draft_ids",
    "resolve_kind_fields",
    "resolve_layer_types",
    "resolve_mask",
    "resolve_rms_norm_eps",
    "resolve_taps",
    "schema_draft_ids",
]
