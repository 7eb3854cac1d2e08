"""Compile a recipe into a frozen, fingerprinted :class:`~dflash_recipes.plan.run_plan.RunPlan`.

Two levels, one code path:

- schema level (``resolve=False``, what `lint` runs): cross-field checks only, no file access;
- resolved (``resolve=True``, what `compile` runs): paths made absolute and checked, the base
  model's config.json read, a resume detected in `training.output_dir`, and the init
  checkpoint's config.json and safetensors header(s) cross-checked against the recipe.

:func:`compile_recipe` is the sequence of phases, top to bottom: read what the recipe points at,
check the recipe on its own, resolve the drafter's ids, cross-check what was read against them,
build the plan. The checks are functions of the values they are given
(:mod:`~dflash_recipes.compiler.state`), so a phase cannot run before the one whose result it
takes.

Every finding is a :class:`~dflash_recipes.diagnostics.Diagnostic` with a registered code, the
dotted recipe path it concerns, what is wrong and the fix. Nothing here raises for bad input
and nothing reads tensor data: a 2 GB drafter costs a few kilobytes of header.
"""

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from dflash_recipes.checkpoint.model_paths import resolve_local_path
from dflash_recipes.compiler.checkpoint_checks import (
    check_against_target,
    check_checkpoint_config,
    check_checkpoint_fields,
    check_layout,
    read_init_checkpoint,
)
from dflash_recipes.compiler.codes import (
    CHECKPOINT_LAYER_TYPES_DIFFER,
    CHECKPOINT_MASK_DIFFERS,
    CHECKPOINT_TAPS_DIFFER,
    HEADS_FROM_SCRATCH,
)
from dflash_recipes.compiler.id_checks import DraftIds, resolve_draft_ids, schema_draft_ids
from dflash_recipes.compiler.input_checks import (
    check_capture,
    check_data,
    check_tracker_libraries,
    resolve_base_model,
    resolve_output,
)
from dflash_recipes.compiler.output_checks import check_output_not_export
from dflash_recipes.compiler.recipe_checks import (
    check_dims_set,
    check_schema,
    resolved_eval_steps,
)
from dflash_recipes.compiler.state import (
    NOTHING_READ,
    CompileInputs,
    Report,
    WhatWasRead,
)
from dflash_recipes.diagnostics import Diagnostic, Severity, SourceMap, has_errors, sort_diagnostics
from dflash_recipes.files.data_cache import default_data_cache_dir
from dflash_recipes.files.run_dir import DATA_CACHE_DIR
from dflash_recipes.plan.run_plan import (
    ArchitecturePlan,
    BaseModelPlan,
    CardPlan,
    DataPlan,
    DraftPlan,
    InitCheckpointPlan,
    ObjectivePlan,
    RegeneratePlan,
    RunPlan,
    TargetServerPlan,
    TrainingPlan,
)
from dflash_recipes.recipe.loader import load_recipe_with_diagnostics
from dflash_recipes.recipe.sections import (
    CardSection,
    Recipe,
    RegenerateSection,
    default_loss_decay_factor,
)
from dflash_recipes.records import Record

#: The warnings about a warm start that the plan carries for `run` to log again when it loads
#: the checkpoint (``InitCheckpointPlan.warnings``).
_WARM_START_WARNINGS = frozenset(
    {
        CHECKPOINT_MASK_DIFFERS,
        CHECKPOINT_TAPS_DIFFER,
        CHECKPOINT_LAYER_TYPES_DIFFER,
        HEADS_FROM_SCRATCH,
    }
)


# ---------------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------------


@attrs.frozen(repr=False, eq=False, slots=False)
class CompileResult(Record):
    """A compiled plan (None when any diagnostic is an error) and every diagnostic, sorted."""

    plan: RunPlan | None
    diagnostics: tuple[Diagnostic, ...]

    @property
    def ok(self) -> bool:
        """True when a plan was produced (warnings and infos allowed)."""
        return self.plan is not None

    @property
    def errors(self) -> tuple[Diagnostic, ...]:
        """The error diagnostics only."""
        return tuple(d for d in self.diagnostics if d.severity is Severity.ERROR)


# ---------------------------------------------------------------------------------------------
# the compilation
# ---------------------------------------------------------------------------------------------


def compile_recipe(
    recipe: Recipe,
    *,
    source: SourceMap | None = None,
    recipe_file: str | None = None,
    overrides: Sequence[str] = (),
    resolve: bool = True,
    base_dir: Path | None = None,
) -> CompileResult:
    """Compile `recipe` into a run plan plus diagnostics; never raises for bad input.

    `source` locates diagnostics in the recipe file. Relative paths resolve against
    `base_dir`, else the folder of `recipe_file`, else the working directory; the plan's
    paths are absolute. `resolve=False` is the schema-level compile of `lint`: cross-field
    checks only, no file is touched, and taps/mask stay as the recipe gives them.
    """
    inputs = CompileInputs(
        recipe=recipe,
        base_dir=_base_dir(base_dir, recipe_file),
        recipe_file=resolve_local_path(recipe_file, base_dir=None) if recipe_file else None,
    )
    report = Report(source or SourceMap(file=recipe_file))
    # 1. read what the recipe points at (a schema-level compile reads nothing)
    read = NOTHING_READ
    if resolve:
        facts = resolve_base_model(inputs, report)
        check_data(inputs, report)
        output = resolve_output(inputs, report)
        check_output_not_export(inputs, report)
        checkpoint = read_init_checkpoint(inputs, output.resume, report)
        read = WhatWasRead(facts=facts, output=output, checkpoint=checkpoint)
    # 2. the recipe on its own (hints name the checkpoint's dims when it was read)
    check_schema(inputs, read.checkpoint.dims, report)
    _check_regenerate(inputs, report, resolve=resolve)
    _check_target_server(inputs, read, report, resolve=resolve)
    check_dims_set(inputs, read, report)
    # 3. the drafter's ids, then what was read checked against them and each other
    heads_from_scratch: tuple[str, ...] = ()
    if resolve:
        ids = resolve_draft_ids(inputs, read, report)
        check_against_target(inputs, read.facts, ids, report)
        check_checkpoint_config(inputs, read, report)
        if check_checkpoint_fields(inputs, read.checkpoint, report):  # DFlash 2: no layout diff
            heads_from_scratch = check_layout(
                inputs, read, ids.taps, report, kind_fields=ids.kind_fields
            )
        check_capture(inputs, read.facts, ids.taps, report)
        check_tracker_libraries(inputs, report)
    else:
        ids = schema_draft_ids(inputs, report)
    # 4. a plan only when nothing is an error
    diagnostics = tuple(sort_diagnostics(report.diagnostics))
    if has_errors(diagnostics):
        return CompileResult(plan=None, diagnostics=diagnostics)
    plan = build_plan(
        inputs,
        read,
        ids,
        heads_from_scratch=heads_from_scratch,
        warm_start_warnings=report.messages_of(_WARM_START_WARNINGS),
        recipe_file=recipe_file,
        overrides=overrides,
        resolved=resolve,
    )
    return CompileResult(plan=plan, diagnostics=diagnostics)


def _base_dir(base_dir: Path | None, recipe_file: str | None) -> Path | None:
    """The absolute folder relative recipe paths resolve against (see compile_recipe)."""
    if base_dir is None and recipe_file is not None:
        return resolve_local_path(recipe_file, base_dir=None).parent
    if base_dir is not None:
        return resolve_local_path(str(base_dir), base_dir=None)
    return None


def _check_regenerate(inputs: CompileInputs, report: Report, *, resolve: bool) -> None:
    """The `regenerate:` section, checked without a network (see server_checks)."""
    section, data = inputs.recipe.regenerate, inputs.recipe.data
    if section == RegenerateSection():
        return  # the defaults: nothing to check (and the checks' module stays unloaded)
    from dflash_recipes.compiler.server_checks import check_regenerate

    output = inputs.absolute(section.output_path) if section.output_path else None
    source = inputs.absolute(data.data_path) if data.data_path else None
    for item in check_regenerate(
        section,
        training_seq_len=inputs.recipe.training.training_seq_len,
        output=output,
        source=source,
        resolve=resolve,
    ):
        report.emit_as(item.severity, item.code, item.path, item.message, item.hint)


def _check_target_server(
    inputs: CompileInputs, read: WhatWasRead, report: Report, *, resolve: bool
) -> None:
    """The `target_server:` section, checked without a network (see server_checks)."""
    section = inputs.recipe.target_server
    if section is None:
        return  # the target runs in the trainer (and the checks' module stays unloaded)
    from dflash_recipes.compiler.server_checks import check_target_server

    for item in check_target_server(
        section,
        hidden_states_path=inputs.recipe.data.hidden_states_path,
        storage_dir=inputs.absolute(section.storage_dir),
        capture_dir_set=section.capture_dir is not None,
        training_seq_len=inputs.recipe.training.training_seq_len,
        facts=read.facts,
        resolve=resolve,
    ):
        report.emit_as(item.severity, item.code, item.path, item.message, item.hint)


# ---------------------------------------------------------------------------------------------
# the plan
# ---------------------------------------------------------------------------------------------


def build_plan(
    inputs: CompileInputs,
    read: WhatWasRead,
    ids: DraftIds,
    *,
    heads_from_scratch: tuple[str, ...],
    warm_start_warnings: tuple[str, ...],
    recipe_file: str | None,
    overrides: Sequence[str],
    resolved: bool,
) -> RunPlan:
    """The run plan of a compile without errors: the recipe's values with every path absolute
    and every default resolved, plus what was read and what the checks decided."""
    recipe, arch, absolute = inputs.recipe, inputs.arch, inputs.absolute
    dflash, data, training = recipe.dflash, recipe.data, recipe.training

    def optional(value: str | None) -> str | None:
        return str(absolute(value)) if value is not None else None

    decay = dflash.dflash_loss_decay_factor
    plan = RunPlan(
        base_model=BaseModelPlan(
            path=str(absolute(recipe.model.model_name_or_path)),
            dtype=recipe.model.dtype,
            trust_remote_code=recipe.model.trust_remote_code,
            facts=read.facts,
        ),
        data=DataPlan(
            data_path=optional(data.data_path),
            chat_template=optional(data.chat_template),
            answer_only_loss=data.answer_only_loss,
            eval_data_path=optional(data.eval_data_path),
            hidden_states_path=optional(data.hidden_states_path),
            cache_dir=str(
                absolute(data.cache_dir)
                if data.cache_dir is not None
                else default_data_cache_dir()
                or absolute(training.output_dir) / DATA_CACHE_DIR  # no home folder
            ),
            num_proc=data.num_proc,
            packing=data.packing,
            eval_holdout=data.eval_holdout,
            supervise=data.supervise,
            unrenderable_rows=data.unrenderable_rows,
        ),
        training=TrainingPlan(
            output_dir=str(absolute(training.output_dir)),
            learning_rate=training.learning_rate,
            num_train_epochs=training.num_train_epochs,
            max_steps=training.max_steps,
            per_device_train_batch_size=training.per_device_train_batch_size,
            gradient_accumulation_steps=training.gradient_accumulation_steps,
            training_seq_len=training.training_seq_len,
            warmup_ratio=training.warmup_ratio,
            lr_scheduler_type=training.lr_scheduler_type,
            max_grad_norm=training.max_grad_norm,
            weight_decay=training.weight_decay,
            seed=training.seed,
            save_steps=training.save_steps,
            save_total_limit=training.save_total_limit,
            logging_steps=training.logging_steps,
            eval_steps=resolved_eval_steps(training, recipe.data),
            device=training.device,
            fsdp=training.fsdp,
            report_to=training.report_to,
            run_name=training.run_name or absolute(training.output_dir).name,
            logging_dir=str(
                absolute(training.logging_dir)
                if training.logging_dir is not None
                else absolute(training.output_dir) / "tensorboard"
            ),
            eval_min_tau=training.eval_min_tau,
            eval_num_prompts=training.eval_num_prompts,
            eval_max_new_tokens=training.eval_max_new_tokens,
            tf32=training.tf32,
            drafter_master_dtype=training.drafter_master_dtype,
            max_nonfinite_steps=training.max_nonfinite_steps,
            distributed_timeout_s=training.distributed_timeout_s,
            activation_checkpointing=training.activation_checkpointing,
        ),
        draft=DraftPlan(
            block_size=dflash.dflash_block_size,
            mask_token_id=ids.mask,
            target_layer_ids=ids.taps,
            architecture=ArchitecturePlan(
                num_hidden_layers=arch.num_hidden_layers,
                num_attention_heads=arch.num_attention_heads,
                num_key_value_heads=arch.num_key_value_heads,
                head_dim=arch.head_dim,
                intermediate_size=arch.intermediate_size,
                rms_norm_eps=ids.rms_norm_eps,
                projector_type=arch.projector_type,
                emb_dim=arch.emb_dim,
                gru_hidden_dim=arch.gru_hidden_dim,
                markov_rank=arch.markov_rank,
                use_confidence_head=arch.use_confidence_head,
                attention_sink=arch.attention_sink,
                layer_types=ids.layer_types,
                sliding_window=ids.sliding_window,
                shift_label=arch.shift_label,
                pure_draft_prefix_len=arch.pure_draft_prefix_len,
                markov_head_type=arch.markov_head_type,
                **_kind_fields(ids),
            ),
            objective=ObjectivePlan(
                num_anchors=dflash.dflash_num_anchors,
                loss_objective=dflash.dflash_loss_objective,
                loss_decay_factor=(
                    float(decay)
                    if decay is not None
                    else default_loss_decay_factor(dflash.dflash_block_size)
                ),
                dpace_alpha=float(dflash.dflash_dpace_alpha),
                self_logit_distillation=dflash.dflash_self_logit_distillation,
                domino_backbone_loss_weight=float(dflash.dflash_domino_backbone_loss_weight),
                dspark_tv_weight=float(dflash.dflash_dspark_tv_weight),
                dspark_confidence_weight=float(dflash.dflash_dspark_confidence_weight),
                selector_loss_alpha=float(dflash.dflash_selector_loss_alpha),
                selector_missing_gold=dflash.dflash_selector_missing_gold,
            ),
        ),
        init_checkpoint=_init_checkpoint_plan(
            inputs, read, heads_from_scratch, warm_start_warnings
        ),
        resume=read.resume,
        recipe_file=str(resolve_local_path(recipe_file, base_dir=None)) if recipe_file else None,
        overrides=tuple(overrides),
        resolved=resolved,
        regenerate=(
            _regenerate_plan(
                recipe.regenerate,
                absolute(recipe.regenerate.output_path) if recipe.regenerate.output_path else None,
                training_seq_len=training.training_seq_len,
            )
            if recipe.regenerate != RegenerateSection()
            else None
        ),
        card=_card_plan(recipe.card),
    )
    if recipe.target_server is None:
        return plan
    return attrs.evolve(plan, target_server=_target_server_plan(inputs, plan))


def _target_server_plan(inputs: CompileInputs, plan: RunPlan) -> TargetServerPlan:
    """The served target's settings, derived from the plan it serves (taps, dtype, length)."""
    from dflash_recipes.plan.target_server_settings import KEPT_STATES_DIR, target_server_plan

    section = inputs.recipe.target_server
    assert section is not None
    capture_dir = None
    if section.keep_files == "capture":
        capture_dir = (
            inputs.absolute(section.capture_dir)
            if section.capture_dir is not None
            else Path(plan.training.output_dir) / KEPT_STATES_DIR
        )
    return target_server_plan(
        section,
        storage_dir=inputs.absolute(section.storage_dir),
        capture_dir=capture_dir,
        base_model=plan.base_model,
        training=plan.training,
        draft=plan.draft,
    )


def _kind_fields(ids: DraftIds) -> dict[str, Any]:
    """The plan's values of the kind's inherited fields (DFlash 2's): the recipe's, else the
    checkpoint's, as resolve_kind_fields found them; a float field stays a float."""
    floats = {
        field.name
        for field in attrs.fields(ArchitecturePlan)
        if field.type in ("float | None", float | None)
    }
    return {
        name: float(value) if name in floats and isinstance(value, int) else value
        for name, value in ids.kind_fields.items()
    }


def _init_checkpoint_plan(
    inputs: CompileInputs,
    read: WhatWasRead,
    heads_from_scratch: tuple[str, ...],
    warnings: tuple[str, ...],
) -> InitCheckpointPlan | None:
    """The warm start and what its header and config.json said (None without one, or when the
    run resumes and the checkpoint is not read)."""
    value = inputs.recipe.dflash.dflash_init_checkpoint
    if value is None or read.resume is not None:
        return None
    init = InitCheckpointPlan(path=str(inputs.absolute(value)))
    weights, config = read.checkpoint.weights, read.checkpoint.readable_config
    if weights is not None:
        init = attrs.evolve(
            init,
            weight_files=weights.weight_files,
            tensor_count=len(weights.tensors),
            dtypes=weights.dtypes,
            heads_from_scratch=heads_from_scratch,
        )
    if config is not None:
        init = attrs.evolve(
            init,
            config_present=True,
            trained_block_size=config.block_size,
            target_layer_ids=config.target_layer_ids,
            mask_token_id=config.mask_token_id,
        )
    return attrs.evolve(init, warnings=warnings)


def _regenerate_plan(
    section: RegenerateSection, output: Path | None, *, training_seq_len: int
) -> RegeneratePlan:
    from dflash_recipes.plan.regenerate_settings import regenerate_plan

    return regenerate_plan(section, output, training_seq_len=training_seq_len)


def _card_plan(section: CardSection) -> CardPlan | None:
    """The recipe's `card:` section as the plan carries it (None: left at its defaults)."""
    if section == CardSection():
        return None
    return CardPlan(
        description=section.description,
        license=section.license,
        base_model=section.base_model,
        datasets=section.datasets,
    )


# ---------------------------------------------------------------------------------------------
# public entry points
# ---------------------------------------------------------------------------------------------


def compile_file(
    path: Path | str, overrides: Sequence[str] = (), *, resolve: bool = True
) -> CompileResult:
    """Load a recipe file (with `a.b.c=value` overrides) and compile it.

    Load diagnostics come first in the same result; a recipe that cannot be loaded gives
    no plan and only those diagnostics.
    """
    loaded = load_recipe_with_diagnostics(Path(path), overrides=tuple(overrides))
    load_diagnostics = tuple(loaded.diagnostics)
    if loaded.recipe is None:
        return CompileResult(plan=None, diagnostics=tuple(sort_diagnostics(load_diagnostics)))
    result = compile_recipe(
        loaded.recipe,
        source=loaded.source,
        recipe_file=loaded.file,
        overrides=tuple(loaded.overrides),
        resolve=resolve,
    )
    merged = tuple(sort_diagnostics(load_diagnostics + result.diagnostics))
    plan = None if has_errors(merged) else result.plan
    return CompileResult(plan=plan, diagnostics=merged)


__all__ = [
    "CompileResult",
    "compile_file",
    "compile_recipe",
]
