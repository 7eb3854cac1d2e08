"""Cross-checks of the init checkpoint: its config.json and safetensors header against the
recipe and the base model (width, taps range, mask row, RoPE, rms_norm_eps, block size, the
field inventory, the tensor layout and head presence). Reads headers only, never tensor data.

:func:`read_init_checkpoint` belongs to the reading phase and returns what it read (an
:class:`~dflash_recipes.compiler.state.InitCheckpoint`); the cross-checks take it, with the taps
and mask the id checks resolved, and :func:`check_layout` returns the heads that train from
scratch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, cast

import attrs

from dflash_recipes.checkpoint.hfconfig import read_checkpoint_config
from dflash_recipes.checkpoint.kinds.registry import kind_facts
from dflash_recipes.checkpoint.known_layouts import KNOWN_LAYOUTS, canonical_weights
from dflash_recipes.checkpoint.model_paths import inspect_checkpoint_dir
from dflash_recipes.checkpoint.target_facts import TargetFacts
from dflash_recipes.checkpoint.tensor_layout import (
    ARCHITECTURE_FIELDS,
    LayoutSpec,
    checkpoint_dims,
    compare_layout,
    expected_layout,
    format_layout_diff,
    format_partial_heads,
    head_presence,
    head_submodules,
    layout_fixes,
    layout_spec_for,
)
from dflash_recipes.checkpoint.weight_index import CheckpointWeights, read_checkpoint_weights
from dflash_recipes.compiler import field_checks
from dflash_recipes.compiler.codes import (
    CHECKPOINT_BLOCK_SIZE_DIFFERS,
    CHECKPOINT_CONFIG_MISSING,
    CHECKPOINT_LAYOUT_MISMATCH,
    CHECKPOINT_LAYOUT_RENAMED,
    CHECKPOINT_NAME_CLASH,
    CHECKPOINT_RMS_NORM_EPS_DIFFERS,
    CHECKPOINT_ROPE_DIFFERS,
    CHECKPOINT_TARGET_DIFFERS,
    HEAD_PARTLY_PRESENT,
    HEADS_FROM_SCRATCH,
    HIDDEN_SIZE_MISMATCH,
    INIT_CHECKPOINT_BAD_WEIGHTS,
    MASK_TOKEN_OUT_OF_RANGE,
    TAPS_OUT_OF_RANGE,
)
from dflash_recipes.compiler.id_checks import DraftIds
from dflash_recipes.compiler.state import (
    ARCH_PATH,
    INIT_PATH,
    MASK_PATH,
    TAPS_PATH,
    CompileInputs,
    InitCheckpoint,
    Report,
    WhatWasRead,
    format_ids,
)
from dflash_recipes.errors import DFlashRecipeError
from dflash_recipes.plan.parts import ResumePlan
from dflash_recipes.recipe.sections import DFlashArchitectureConfig


def read_init_checkpoint(
    inputs: CompileInputs, resume: ResumePlan | None, report: Report
) -> InitCheckpoint:
    """The init checkpoint's tensor table (under z-lab names) and config.json, and the dims they
    show; nothing is read for a resumed run (the checkpoint is ignored, said by resolve_output)."""
    value = inputs.recipe.dflash.dflash_init_checkpoint
    if value is None or resume is not None:
        return InitCheckpoint()
    checkpoint_dir = inputs.absolute(value)
    problem = inspect_checkpoint_dir(value, base_dir=inputs.base_dir)
    if problem is not None:
        report.emit(
            f"init-checkpoint-{problem.kind}",
            INIT_PATH,
            problem.message,
            inputs.folder_fix(problem),
        )
        return InitCheckpoint(broken=True)
    broken, weights, name_clash = False, None, False
    try:
        weights, name_clash = _read_known_layout(read_checkpoint_weights(checkpoint_dir), report)
    except DFlashRecipeError as exc:
        broken = True
        report.emit(
            INIT_CHECKPOINT_BAD_WEIGHTS,
            INIT_PATH,
            f"the init checkpoint's weights cannot be used: {exc}",
            "download or export the checkpoint again (compile reads only the safetensors "
            "header, so this file is damaged, truncated or not a safetensors file)",
        )
    config = read_checkpoint_config(checkpoint_dir)
    if not config.present:
        report.emit(
            CHECKPOINT_CONFIG_MISSING,
            INIT_PATH,
            f"{checkpoint_dir} has no config.json, so its mask token id, taps, block "
            "size, RoPE theta and rms_norm_eps cannot be checked (the tensor layout still is)",
            "copy the drafter's config.json next to its weights (`hf download` fetches it), "
            "or set dflash_mask_token_id and target_layer_ids explicitly",
        )
    for item in config.problems:
        report.emit_problem(item, INIT_PATH, f"init checkpoint {config.path}")
    if not config.readable and config.present:
        broken = True  # its taps and mask are unknown, not absent
    found = weights.shapes if weights is not None else None
    stated = config.stated_dims() if config.readable else None
    return InitCheckpoint(
        weights=weights,
        config=config,
        dims=checkpoint_dims(stated, found),
        broken=broken,
        name_clash=name_clash,
    )


def _read_known_layout(
    weights: CheckpointWeights, report: Report
) -> tuple[CheckpointWeights, bool]:
    """The checkpoint's tensor table under z-lab names (docs: Known checkpoint layouts), saying
    which renames apply, and whether two stored tensors clash (an error, reported here)."""
    canonical, reading = canonical_weights(weights)
    if reading.renamed:
        report.emit(
            CHECKPOINT_LAYOUT_RENAMED,
            INIT_PATH,
            f"the init checkpoint is in the known layout {reading.describe()}; its tensors "
            "load under those names, and the export writes the z-lab layout",
            "nothing to change",
        )
    if reading.clashes:
        report.emit(
            CHECKPOINT_NAME_CLASH,
            INIT_PATH,
            "two tensors of the init checkpoint would load into the same drafter parameter "
            f"(names of two known layouts mixed):\n{reading.format_clashes()}\n"
            f"(checkpoint: {weights.directory})",
            "keep one tensor per parameter: re-export the checkpoint, or delete the stale "
            "copy (`safetensors` can rewrite the file without it)",
        )
    return canonical, bool(reading.clashes)


# -- checks against the base model ----------------------------------------------------------------


def check_against_target(
    inputs: CompileInputs, facts: TargetFacts | None, ids: DraftIds, report: Report
) -> None:
    """The taps are layers of the base model, and the mask id a row of its embedding table."""
    if facts is None:
        return
    taps, mask = ids.taps, ids.mask
    if taps is not None:
        bad = [t for t in taps if t >= facts.num_hidden_layers]
        if bad:
            origin = "" if inputs.arch.target_layer_ids is not None else " (not set in the recipe)"
            report.emit(
                TAPS_OUT_OF_RANGE,
                TAPS_PATH,
                f"target_layer_ids {format_ids(taps)}{origin} include {format_ids(bad)}, but "
                f"the base model has {facts.num_hidden_layers} decoder layers, so valid taps "
                f"are 0..{facts.num_hidden_layers - 1} (id k taps the output of layer k, "
                "hidden_states[k + 1])",
                "use taps inside the base model, or check that model.model_name_or_path is "
                "the target the drafter was trained for",
            )
    if mask is not None and mask >= facts.vocab_size:
        report.emit(
            MASK_TOKEN_OUT_OF_RANGE,
            MASK_PATH,
            f"dflash_mask_token_id {mask} is not a row of the target's embedding table "
            f"(vocab_size {facts.vocab_size}, rows 0..{facts.vocab_size - 1})",
            f"set dflash_mask_token_id to an unused row below {facts.vocab_size} (Qwen3: "
            "151669), or check model.model_name_or_path",
        )


# -- checks against the checkpoint's config.json --------------------------------------------------


def check_checkpoint_config(inputs: CompileInputs, read: WhatWasRead, report: Report) -> None:
    """The checkpoint's config.json against the recipe (block size, rms_norm_eps) and the base
    model (RoPE, target depth and vocabulary)."""
    config, facts = read.checkpoint.readable_config, read.facts
    if config is None:
        return
    block = inputs.recipe.dflash.dflash_block_size
    if config.block_size is not None and config.block_size != block:
        report.emit(
            CHECKPOINT_BLOCK_SIZE_DIFFERS,
            "dflash.dflash_block_size",
            f"dflash_block_size {block} differs from the checkpoint's trained block size "
            f"{config.block_size}; this is allowed (the weights do not depend on the block "
            "size) and the fine-tune adapts the drafter to the new size",
            f"nothing to change; set dflash_block_size: {config.block_size} to keep the "
            "trained size",
        )
    eps = inputs.arch.rms_norm_eps  # unset: the checkpoint's is taken (resolve_rms_norm_eps)
    if (
        eps is not None
        and config.rms_norm_eps is not None
        and not math.isclose(config.rms_norm_eps, eps, rel_tol=1e-9)
    ):
        report.emit(
            CHECKPOINT_RMS_NORM_EPS_DIFFERS,
            f"{ARCH_PATH}.rms_norm_eps",
            f"rms_norm_eps {eps!r} differs from the checkpoint's {config.rms_norm_eps!r}; the "
            "warm-started norms would compute other values than the ones they learned with",
            f"set dflash_architecture_config.rms_norm_eps: {config.rms_norm_eps!r}, as the "
            "checkpoint's config.json says",
        )
    if facts is None:
        return
    rope = facts.rope
    theta_differs = config.rope_theta is not None and config.rope_theta != rope.rope_theta
    type_differs = config.rope_type is not None and config.rope_type != rope.rope_type
    if theta_differs or type_differs:
        report.emit(
            CHECKPOINT_ROPE_DIFFERS,
            INIT_PATH,
            f"the checkpoint's config.json states RoPE theta {config.rope_theta!r} "
            f"(type {config.rope_type}) but the base model's is {rope.rope_theta!r} "
            f"(type {rope.rope_type}); the run uses the base model's, so the warm-started "
            "drafter sees positions other than the ones it was trained with",
            "check that the checkpoint was trained for this base model (a drafter trained "
            "with a class-default theta of 10000 is a known mistake); the plan keeps the "
            "base model's RoPE settings",
        )
    mismatches = []
    if config.num_target_layers is not None and config.num_target_layers != (
        facts.num_hidden_layers
    ):
        mismatches.append(
            f"num_target_layers {config.num_target_layers} (base model: {facts.num_hidden_layers})"
        )
    if config.vocab_size is not None and config.vocab_size != facts.vocab_size:
        mismatches.append(f"vocab_size {config.vocab_size} (base model: {facts.vocab_size})")
    if mismatches:
        report.emit(
            CHECKPOINT_TARGET_DIFFERS,
            INIT_PATH,
            "the init checkpoint was trained against another target: its config.json states "
            + " and ".join(mismatches),
            "point model.model_name_or_path at the base model the drafter was trained for, "
            "or expect a weak warm start",
        )


def check_checkpoint_fields(
    inputs: CompileInputs, checkpoint: InitCheckpoint, report: Report
) -> bool:
    """The field inventory's checks (dflash_recipes.checkpoint.config_fields); False for a
    DFlash 2 checkpoint (one error said, its tensor layout not compared)."""
    config = checkpoint.readable_config
    if config is None:
        return True
    arch = inputs.arch
    findings = field_checks.check_checkpoint_fields(
        config.raw,
        checkpoint.weights.shapes if checkpoint.weights is not None else None,
        where=f"init checkpoint {config.path}",
        training_seq_len=inputs.recipe.training.training_seq_len,
        projector_type=arch.projector_type,
        alignment=field_checks.HeadAlignment(
            shift_label=arch.shift_label,
            pure_draft_prefix_len=arch.pure_draft_prefix_len,
            markov_head_type=arch.markov_head_type,
        ),
    )
    for item in findings:
        report.emit_as(item.severity, item.code, item.path, item.message, item.hint)
    return not any(item.code == field_checks.CHECKPOINT_DFLASH2 for item in findings)


# -- checks against the safetensors header --------------------------------------------------------


def check_layout(
    inputs: CompileInputs,
    read: WhatWasRead,
    taps: tuple[int, ...] | None,
    report: Report,
    *,
    kind_fields: Mapping[str, object] | None = None,
) -> tuple[str, ...]:
    """The checkpoint's tensors against the layout the recipe describes (width first, then every
    name and shape, then the heads); returns the head submodules that train from scratch.

    `kind_fields` are the kind's inherited fields as resolved (the recipe's, else the
    checkpoint's: ``DraftIds.kind_fields``); the layout is built with them."""
    checkpoint, facts = read.checkpoint, read.facts
    weights = checkpoint.weights
    if weights is None or facts is None:
        return ()
    if checkpoint.name_clash:
        return ()  # which of the clashing tensors is meant is unknown: said once, above
    found = weights.shapes
    width = checkpoint.dims.values.get("hidden_size")
    if width is not None and width != facts.hidden_size:
        report.emit(
            HIDDEN_SIZE_MISMATCH,
            INIT_PATH,
            f"the init checkpoint's drafter is {width} wide "
            f"({checkpoint.dims.sources['hidden_size']}) but the base model's hidden_size is "
            f"{facts.hidden_size}; a drafter is always as wide as its target (it uses the "
            "target's embeddings and lm_head), so the tensor comparison was skipped",
            "use a drafter trained for this base model, or point model.model_name_or_path at "
            "the base model the drafter was trained for",
        )
        return ()
    arch = inputs.arch
    if kind_fields:
        try:
            arch = attrs.evolve(arch, **cast(dict[str, Any], kind_fields))
        except (ValueError, TypeError):
            return ()  # a checkpoint value of the wrong type: reported by resolve_kind_fields
    spec = _layout_spec(arch, facts, len(taps) if taps is not None else None)
    if spec is None:
        return ()
    presence = head_presence(spec, found)
    skipped: set[str] = set()
    heads = head_submodules(spec)
    for module in (*presence.absent, *presence.partial):
        skipped.update(heads[module])
    expected = {n: s for n, s in expected_layout(spec).items() if n not in skipped}
    diff = compare_layout(expected, {n: s for n, s in found.items() if n not in skipped})
    if not diff.is_empty:
        config = checkpoint.config
        fixes = layout_fixes(
            spec,
            checkpoint.dims,
            found,
            stated_taps=config.target_layer_ids if config is not None else None,
            stated_projector=config.projector_type if config is not None else None,
        )
        hint = "\n".join(fixes) if fixes else _unfixable_hint(bool(diff.unexpected))
        report.emit(
            CHECKPOINT_LAYOUT_MISMATCH,
            ARCH_PATH,
            f"{format_layout_diff(diff)}\n(checkpoint: {weights.directory})",
            hint,
        )
    if presence.partial:
        report.emit(
            HEAD_PARTLY_PRESENT,
            f"{ARCH_PATH}.projector_type",
            f"{format_partial_heads(presence)}\na head submodule is loaded whole or trained "
            "from scratch, never half-loaded",
            "use a checkpoint that holds the complete head, or one without it (the head then "
            "trains from scratch)",
        )
        return ()
    if presence.absent:
        kind = kind_facts(spec.projector_type)
        report.emit(
            HEADS_FROM_SCRATCH,
            f"{ARCH_PATH}.projector_type",
            f"the init checkpoint has no {spec.projector_type} head: "
            f"{', '.join(presence.absent)} {kind.fresh_start} while the backbone "
            "warm-starts",
            f"nothing to change when warm-starting a {spec.projector_type} drafter from a "
            "plain DFlash checkpoint; expect the head to need more steps than the backbone"
            + (
                " (and the backbone, trained to predict anchor + k at position k, to "
                "relearn anchor + k + 1 under shift_label true; shift_label: false keeps "
                "its alignment)"
                if inputs.arch.shift_label and kind.shifts_labels
                else ""
            ),
        )
    return presence.absent


def _layout_spec(
    arch: DFlashArchitectureConfig, facts: TargetFacts, n_taps: int | None
) -> LayoutSpec | None:
    """The layout the recipe describes, or None when a dim it needs is unset (reported by
    check_dims_set and check_head_fields)."""
    if n_taps is None:
        return None
    if any(getattr(arch, name) is None for name in ARCHITECTURE_FIELDS):
        return None  # reported by check_dims_set
    try:
        return layout_spec_for(
            arch, hidden_size=facts.hidden_size, n_taps=n_taps, vocab_size=facts.vocab_size
        )
    except ValueError:
        return None  # a head field is missing: reported by check_head_fields (or as unset
        # by resolve_kind_fields)


def _unfixable_hint(unexpected_names: bool) -> str:
    """The hint of a layout mismatch no recipe setting fixes."""
    if not unexpected_names:
        return "make dflash_architecture_config match the checkpoint's tensors listed above"
    layouts = ", ".join(layout.name for layout in KNOWN_LAYOUTS)
    return (
        "the checkpoint stores tensors under names none of the known checkpoint layouts "
        f"({layouts}; docs/dflash.md, Known checkpoint layouts) reads: rename them to the z-lab "
        "names listed as missing, or report the layout so it can be added to that table"
    )


__all__ = [
    "check_against_target",
    "check_checkpoint_config",
    "check_checkpoint_fields",
    "check_layout",
    "read_init_checkpoint",
]
