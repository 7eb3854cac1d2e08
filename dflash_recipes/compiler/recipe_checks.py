"""Schema-level checks: cross-field rules on the recipe alone, no file read (what `lint` runs).

Each check is a function of the recipe (:class:`~dflash_recipes.compiler.state.CompileInputs`)
that reports to a :class:`~dflash_recipes.compiler.state.Report`; only :func:`check_dims_set`
reads more, the dims of the init checkpoint (for its hints), and so runs after the reading phase.
"""

from __future__ import annotations

from dflash_recipes.checkpoint.kinds.registry import (
    HEAD_FIELD_MEANING,
    KIND_FIELD_OWNERS,
    kind_facts,
)
from dflash_recipes.checkpoint.tensor_layout import ARCHITECTURE_FIELDS, CheckpointDims
from dflash_recipes.compiler.codes import (
    ARCH_DIM_MISSING,
    EVAL_DATA_TWICE,
    EVAL_DATA_UNSET,
    EVAL_GATE_UNMEASURED,
    EVAL_HOLDOUT_OFFLINE,
    EVAL_HOLDOUT_SMALL,
    HEAD_FIELD_MISSING,
    HEAD_FIELD_UNUSED,
    KV_HEADS_NOT_DIVISOR,
    LAYER_TYPES_LENGTH,
    TAPS_DUPLICATE,
)
from dflash_recipes.compiler.state import (
    ARCH_PATH,
    TAPS_PATH,
    CompileInputs,
    Report,
    WhatWasRead,
    format_ids,
)
from dflash_recipes.recipe.sections import DataSection, DFlashArchitectureConfig, TrainingSection


def check_schema(inputs: CompileInputs, dims: CheckpointDims, report: Report) -> None:
    """Grouped-query heads, head fields per projector, Domino's prefix, distinct taps, one
    attention kind per layer, and eval data for eval steps.

    `dims` are the init checkpoint's (empty when none was read): a missing head field's hint
    gives the checkpoint's value.
    """
    arch = inputs.arch
    check_attention(arch, report)
    check_head_fields(arch, dims, report)
    check_kind_rules(arch, inputs.recipe.dflash.dflash_block_size, report)
    check_taps_unique(arch, report)
    check_layer_types_length(arch, arch.layer_types, "", report)
    training, data = inputs.recipe.training, inputs.recipe.data
    if training.eval_steps and not data.has_eval_data:
        report.emit(
            EVAL_DATA_UNSET,
            "training.eval_steps",
            f"training.eval_steps is {training.eval_steps} but neither data.eval_data_path "
            "nor data.eval_holdout is set, so there is nothing to evaluate on",
            "set data.eval_data_path to a JSONL file of held-out conversations (or "
            "data.eval_holdout: N to hold N training conversations out), or set "
            "training.eval_steps: null",
        )
    check_eval_gate(inputs, report)
    check_eval_holdout(inputs, report)


def check_eval_holdout(inputs: CompileInputs, report: Report) -> None:
    """data.eval_holdout: one source of held-out conversations, an online run (a capture
    trains on every conversation it holds), and enough of them for eval_num_prompts."""
    training, data = inputs.recipe.training, inputs.recipe.data
    holdout = data.eval_holdout
    if holdout == 0:
        return
    if data.eval_data_path is not None:
        report.emit(
            EVAL_DATA_TWICE,
            "data.eval_holdout",
            f"data.eval_holdout is {holdout} and data.eval_data_path is set: the run would "
            "have two sets of held-out conversations",
            "keep one: data.eval_holdout: 0 to measure on data.eval_data_path, or remove "
            "data.eval_data_path to hold training conversations out",
        )
    if data.hidden_states_path is not None:
        report.emit(
            EVAL_HOLDOUT_OFFLINE,
            "data.eval_holdout",
            f"data.eval_holdout is {holdout} with data.hidden_states_path: offline training "
            "reads every conversation of the capture, so none would be held out",
            "write the held-out conversations to a file and set data.eval_data_path to it "
            "(and data.eval_holdout: 0), or train online (data.hidden_states_path: null)",
        )
    if holdout < training.eval_num_prompts:
        report.emit(
            EVAL_HOLDOUT_SMALL,
            "data.eval_holdout",
            f"data.eval_holdout is {holdout}, fewer than training.eval_num_prompts "
            f"({training.eval_num_prompts}): each measurement drafts on {holdout} prompt(s)",
            f"set data.eval_holdout to at least {training.eval_num_prompts}, or lower "
            "training.eval_num_prompts",
        )


def resolved_eval_steps(training: TrainingSection, data: DataSection) -> int | None:
    """The plan's training.eval_steps: the recipe's (0: never), or by default every save_steps
    when there is eval data (under training.fsdp too: every rank measures in step)."""
    if training.eval_steps is not None:
        return training.eval_steps or None
    if not data.has_eval_data:
        return None
    return training.save_steps


def check_eval_gate(inputs: CompileInputs, report: Report) -> None:
    """An acceptance gate needs a held-out measurement: eval_steps and eval data."""
    training, data = inputs.recipe.training, inputs.recipe.data
    if training.eval_min_tau is None:
        return
    # training.eval_steps null measures every save_steps (and the gate adds the final step)
    # when there is eval data; 0 never measures.
    missing = [
        name
        for name, unset in (
            ("training.eval_steps", training.eval_steps == 0),
            ("data.eval_data_path (or data.eval_holdout)", not data.has_eval_data),
        )
        if unset
    ]
    if missing:
        report.emit(
            EVAL_GATE_UNMEASURED,
            "training.eval_min_tau",
            f"training.eval_min_tau is {training.eval_min_tau} but {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set (or 0), so the run measures no "
            "held-out tau and would always fail the gate",
            "set data.eval_data_path or data.eval_holdout (the run then measures every "
            "training.eval_steps, by "
            "default every save_steps, and at its final step), or set training.eval_min_tau: "
            "null",
        )


def check_dims_set(inputs: CompileInputs, read: WhatWasRead, report: Report) -> None:
    """Every architecture dim is set in the recipe (dims never inherit); the hint gives the
    init checkpoint's value when it was read."""
    dims = read.checkpoint.dims
    warm_start = inputs.recipe.dflash.dflash_init_checkpoint is not None and read.resume is None
    for name in ARCHITECTURE_FIELDS:
        if getattr(inputs.arch, name) is not None:
            continue
        message = (
            f"dflash_architecture_config.{name} is not set; dims never inherit: set "
            f"dflash_architecture_config.{name} (the base model's value is not used)"
        )
        if name in dims.values:
            hint = dims.fix(name)
        elif warm_start:
            hint = (
                f"set dflash_architecture_config.{name} to the init checkpoint's value "
                "(`dflash-recipe init --base-model DIR --init-checkpoint DIR` writes them all)"
            )
        else:
            hint = (
                f"set dflash_architecture_config.{name} to the drafter's own value "
                "(`dflash-recipe init --base-model DIR` writes a from-scratch starting point)"
            )
        report.emit(ARCH_DIM_MISSING, f"{ARCH_PATH}.{name}", message, hint)


def check_attention(arch: DFlashArchitectureConfig, report: Report) -> None:
    """num_key_value_heads divides num_attention_heads."""
    heads, kv = arch.num_attention_heads, arch.num_key_value_heads
    if heads is None or kv is None or heads % kv == 0:
        return
    divisors = [d for d in range(1, heads + 1) if heads % d == 0 and d <= kv]
    report.emit(
        KV_HEADS_NOT_DIVISOR,
        f"{ARCH_PATH}.num_key_value_heads",
        f"num_key_value_heads {kv} does not divide num_attention_heads {heads}; grouped-query "
        "attention shares each key/value head among a whole number of query heads",
        f"set dflash_architecture_config.num_key_value_heads to a divisor of {heads}, "
        f"e.g. {divisors[-1]}",
    )


def check_head_fields(arch: DFlashArchitectureConfig, dims: CheckpointDims, report: Report) -> None:
    """The head fields the projector needs are set, and no other projector's are."""
    projector = arch.projector_type
    for name in kind_facts(projector).head_fields:
        if getattr(arch, name) is not None:
            continue
        found = dims.values.get(name)
        if found is not None:
            hint = dims.fix(name)
        else:
            hint = f"set dflash_architecture_config.{name} ({HEAD_FIELD_MEANING[name]})"
        report.emit(
            HEAD_FIELD_MISSING,
            f"{ARCH_PATH}.{name}",
            f"projector_type {projector} needs dflash_architecture_config.{name} "
            f"({HEAD_FIELD_MEANING[name]}), which is not set",
            hint,
        )
    # Head sizes and switches (use_confidence_head) another kind owns.
    owners = KIND_FIELD_OWNERS
    unused = [n for n, owner in owners.items() if owner != projector and getattr(arch, n)]
    for name in unused:
        owner = owners[name]
        report.emit(
            HEAD_FIELD_UNUSED,
            f"{ARCH_PATH}.{name}",
            f"dflash_architecture_config.{name} belongs to projector_type {owner} and is "
            f"ignored with projector_type {projector}",
            f"delete {name}, or set dflash_architecture_config.projector_type: {owner}",
        )


def check_kind_rules(arch: DFlashArchitectureConfig, block: int, report: Report) -> None:
    """The projector type's own rules (Domino: the uncorrected prefix leaves the block at least
    one corrected position)."""
    for finding in kind_facts(arch.projector_type).recipe_findings(arch, block):
        report.emit(finding.code, f"{ARCH_PATH}.{finding.field}", finding.message, finding.hint)


def check_taps_unique(arch: DFlashArchitectureConfig, report: Report) -> None:
    """Each tap names a different target layer."""
    taps = arch.target_layer_ids
    if taps is None or len(set(taps)) == len(taps):
        return
    repeated = sorted({t for t in taps if taps.count(t) > 1})
    unique = list(dict.fromkeys(taps))
    report.emit(
        TAPS_DUPLICATE,
        TAPS_PATH,
        f"target_layer_ids {format_ids(taps)} list layer(s) {format_ids(repeated)} more than "
        "once; each tap must be a different target layer",
        f"list each layer once, e.g. target_layer_ids: {format_ids(unique)}",
    )


def check_layer_types_length(
    arch: DFlashArchitectureConfig, types: tuple[str, ...] | None, origin: str, report: Report
) -> bool:
    """`types` name one attention kind per draft layer (False, reported, when not).

    `origin` says where the types came from in the message (`""`: the recipe); the id checks
    use it for types taken from a resumed run's plan.
    """
    layers = arch.num_hidden_layers
    if types is None or layers is None or len(types) == layers:
        return True
    if len(types) < layers:
        example = list(types) + [types[-1]] * (layers - len(types))
    else:
        example = list(types[:layers])
    report.emit(
        LAYER_TYPES_LENGTH,
        f"{ARCH_PATH}.layer_types",
        f"layer_types{origin} lists {len(types)} attention kinds, but the drafter has "
        f"num_hidden_layers {layers}; layer_types needs exactly one entry per draft layer",
        f"set dflash_architecture_config.layer_types to {layers} entries, e.g. "
        f"[{', '.join(example)}]",
    )
    return False


__all__ = [
    "check_attention",
    "check_dims_set",
    "check_head_fields",
    "check_kind_rules",
    "check_layer_types_length",
    "check_schema",
    "check_taps_unique",
]
