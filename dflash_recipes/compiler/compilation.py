"""Compile a recipe into a frozen, fingerprinted :class:`~dflash_recipes.plan.run_plan.RunPlan`.

Two levels, one code path:

- schema level (``resolve=False``, what `lint` runs): cross-field checks only, no file access;
- resolved (``resolve=True``, what `compile` runs): paths made absolute and checked, the base
  model's config.json read, a resume detected in `training.output_dir`, and the init
  checkpoint's config.json and safetensors header(s) cross-checked against the recipe.

Every finding is a :class:`~dflash_recipes.diagnostics.Diagnostic` with a registered code, the
dotted recipe path it concerns, what is wrong and the fix. Nothing here raises for bad input
and nothing reads tensor data: a 2 GB drafter costs a few kilobytes of header.
"""

from collections.abc import Sequence
from pathlib import Path

import attrs

from dflash_recipes.compiler.checkpoint_checks import CheckpointChecks
from dflash_recipes.compiler.codes import (
    CHECKPOINT_LAYER_TYPES_DIFFER,
    CHECKPOINT_MASK_DIFFERS,
    CHECKPOINT_TAPS_DIFFER,
    HEADS_FROM_SCRATCH,
)
from dflash_recipes.compiler.id_checks import DEFAULT_RMS_NORM_EPS, DraftIdChecks
from dflash_recipes.compiler.input_checks import InputChecks, check_tracker_libraries
from dflash_recipes.compiler.model_paths import resolve_local_path
from dflash_recipes.compiler.recipe_checks import SchemaChecks
from dflash_recipes.diagnostics import Diagnostic, Severity, SourceMap, has_errors, sort_diagnostics
from dflash_recipes.files.data_cache import default_data_cache_dir
from dflash_recipes.files.run_dir import DATA_CACHE_DIR
from dflash_recipes.plan.run_plan import (
    ArchitecturePlan,
    BaseModelPlan,
    DataPlan,
    DraftPlan,
    InitCheckpointPlan,
    ObjectivePlan,
    RegeneratePlan,
    RunPlan,
    TrainingPlan,
)
from dflash_recipes.recipe.loader import load_recipe_with_diagnostics
from dflash_recipes.recipe.sections import Recipe, RegenerateSection
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

# Paper guidance for the decay gamma, block size -> gamma (docs/dflash.md, "Block size and the
# decay gamma").
_DECAY_POINTS: tuple[tuple[int, float], ...] = ((8, 4.0), (10, 5.0), (16, 7.0))


def default_loss_decay_factor(block_size: int) -> float:
    """gamma for `exp(-(k-1)/gamma)`: 4 for B=8, 5 for B=10, 7 for B=16.

    Other block sizes interpolate linearly through those points, extrapolating from the
    nearest pair outside them, and never go below 1.0.
    """
    (b0, g0), (b1, g1) = _DECAY_POINTS[:2] if block_size <= 10 else _DECAY_POINTS[1:]
    return max(1.0, g0 + (block_size - b0) * (g1 - g0) / (b1 - b0))


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


class _Compilation(SchemaChecks, InputChecks, DraftIdChecks, CheckpointChecks):
    """One compile: every check mixin over one shared compile state (the plan is built here)."""

    # -- the plan ---------------------------------------------------------------------------------

    def build_plan(
        self,
        *,
        taps: tuple[int, ...] | None,
        mask: int | None,
        layer_types: tuple[tuple[str, ...] | None, int | None] = (None, None),
        rms_norm_eps: float = DEFAULT_RMS_NORM_EPS,
        recipe_file: str | None,
        overrides: Sequence[str],
        resolved: bool,
    ) -> RunPlan:
        recipe, arch = self.recipe, self.arch
        dflash, data, training = recipe.dflash, recipe.data, recipe.training

        def optional(value: str | None) -> str | None:
            return str(self.absolute(value)) if value is not None else None

        init: InitCheckpointPlan | None = None
        if dflash.dflash_init_checkpoint is not None and self.resume is None:
            init = InitCheckpointPlan(path=str(self.absolute(dflash.dflash_init_checkpoint)))
            if self.weights is not None:
                init = attrs.evolve(
                    init,
                    weight_files=self.weights.weight_files,
                    tensor_count=len(self.weights.tensors),
                    dtypes=self.weights.dtypes,
                    heads_from_scratch=self.heads_from_scratch,
                )
            if self.config is not None and self.config.readable:
                init = attrs.evolve(
                    init,
                    config_present=True,
                    trained_block_size=self.config.block_size,
                    target_layer_ids=self.config.target_layer_ids,
                    mask_token_id=self.config.mask_token_id,
                )
        if init is not None:
            said = tuple(d.message for d in self.diagnostics if d.code in _WARM_START_WARNINGS)
            init = attrs.evolve(init, warnings=said)
        decay = dflash.dflash_loss_decay_factor
        return RunPlan(
            base_model=BaseModelPlan(
                path=str(self.absolute(recipe.model.model_name_or_path)),
                dtype=recipe.model.dtype,
                trust_remote_code=recipe.model.trust_remote_code,
                facts=self.facts,
            ),
            data=DataPlan(
                data_path=optional(data.data_path),
                chat_template=optional(data.chat_template),
                answer_only_loss=data.answer_only_loss,
                eval_data_path=optional(data.eval_data_path),
                hidden_states_path=optional(data.hidden_states_path),
                cache_dir=str(
                    self.absolute(data.cache_dir)
                    if data.cache_dir is not None
                    else default_data_cache_dir()
                    or self.absolute(training.output_dir) / DATA_CACHE_DIR  # no home folder
                ),
                num_proc=data.num_proc,
            ),
            training=TrainingPlan(
                output_dir=str(self.absolute(training.output_dir)),
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
                eval_steps=training.eval_steps,
                device=training.device,
                fsdp=training.fsdp,
                report_to=training.report_to,
                run_name=training.run_name or self.absolute(training.output_dir).name,
                logging_dir=str(
                    self.absolute(training.logging_dir)
                    if training.logging_dir is not None
                    else self.absolute(training.output_dir) / "tensorboard"
                ),
            ),
            draft=DraftPlan(
                block_size=dflash.dflash_block_size,
                mask_token_id=mask,
                target_layer_ids=taps,
                architecture=ArchitecturePlan(
                    num_hidden_layers=arch.num_hidden_layers,
                    num_attention_heads=arch.num_attention_heads,
                    num_key_value_heads=arch.num_key_value_heads,
                    head_dim=arch.head_dim,
                    intermediate_size=arch.intermediate_size,
                    rms_norm_eps=rms_norm_eps,
                    projector_type=arch.projector_type,
                    emb_dim=arch.emb_dim,
                    gru_hidden_dim=arch.gru_hidden_dim,
                    markov_rank=arch.markov_rank,
                    use_confidence_head=arch.use_confidence_head,
                    attention_sink=arch.attention_sink,
                    layer_types=layer_types[0],
                    sliding_window=layer_types[1],
                    shift_label=arch.shift_label,
                    pure_draft_prefix_len=arch.pure_draft_prefix_len,
                    markov_head_type=arch.markov_head_type,
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
                ),
            ),
            init_checkpoint=init,
            resume=self.resume,
            recipe_file=str(resolve_local_path(recipe_file, base_dir=None))
            if recipe_file
            else None,
            overrides=tuple(overrides),
            resolved=resolved,
            regenerate=(
                _regenerate_plan(
                    recipe.regenerate,
                    self.absolute(recipe.regenerate.output_path)
                    if recipe.regenerate.output_path
                    else None,
                    training_seq_len=training.training_seq_len,
                )
                if recipe.regenerate != RegenerateSection()
                else None
            ),
        )

    def check_regenerate(self, *, resolve: bool) -> None:
        """The `regenerate:` section, checked without a network (see regenerate_settings)."""
        section, data = self.recipe.regenerate, self.recipe.data
        if section == RegenerateSection():
            return  # the defaults: nothing to check (and the checks' module stays unloaded)
        from dflash_recipes.compiler.regenerate_checks import check_regenerate

        output = self.absolute(section.output_path) if section.output_path else None
        source = self.absolute(data.data_path) if data.data_path else None
        for item in check_regenerate(
            section,
            training_seq_len=self.recipe.training.training_seq_len,
            output=output,
            source=source,
            resolve=resolve,
        ):
            self.emit_as(item.severity, item.code, item.path, item.message, item.hint)


def _regenerate_plan(
    section: RegenerateSection, output: Path | None, *, training_seq_len: int
) -> RegeneratePlan:
    from dflash_recipes.compiler.regenerate_checks import regenerate_plan

    return regenerate_plan(section, output, training_seq_len=training_seq_len)


# ---------------------------------------------------------------------------------------------
# public entry points
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
    if base_dir is None and recipe_file is not None:
        base_dir = resolve_local_path(recipe_file, base_dir=None).parent
    elif base_dir is not None:
        base_dir = resolve_local_path(str(base_dir), base_dir=None)
    work = _Compilation(recipe, source or SourceMap(file=recipe_file), base_dir)
    taps, mask = recipe.dflash.dflash_architecture_config.target_layer_ids, None
    arch = recipe.dflash.dflash_architecture_config
    layer_types = (arch.layer_types, arch.sliding_window)
    eps = float(arch.rms_norm_eps) if arch.rms_norm_eps is not None else DEFAULT_RMS_NORM_EPS
    if resolve:
        work.resolve_base_model()
        work.resolve_data()
        work.resolve_output()
        work.resolve_init_checkpoint()
    work.check_schema()
    work.check_regenerate(resolve=resolve)
    work.check_dims_set()
    if resolve:
        taps = work.resolve_taps()
        mask = work.resolve_mask()
        layer_types = work.resolve_layer_types()
        eps = work.resolve_rms_norm_eps()
        work.check_against_target(taps, mask)
        work.check_checkpoint_config()
        if work.check_checkpoint_fields():  # a DFlash 2 checkpoint gets one error, no layout diff
            work.check_layout(taps)
        work.check_capture(taps)
        check_tracker_libraries(work)
    else:
        mask = recipe.dflash.dflash_mask_token_id
        if mask is None and recipe.dflash.dflash_init_checkpoint is None:
            mask = work.resolve_mask()
    diagnostics = tuple(sort_diagnostics(work.diagnostics))
    if has_errors(diagnostics):
        return CompileResult(plan=None, diagnostics=diagnostics)
    plan = work.build_plan(
        taps=taps,
        mask=mask,
        layer_types=layer_types,
        rms_norm_eps=eps,
        recipe_file=recipe_file,
        overrides=overrides,
        resolved=resolve,
    )
    return CompileResult(plan=plan, diagnostics=diagnostics)


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
    "default_loss_decay_factor",
]
