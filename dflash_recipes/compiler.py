"""Compile a recipe into a frozen, fingerprinted :class:`~dflash_recipes.plan.RunPlan`.

Two levels, one code path:

- schema level (``resolve=False``, what `lint` runs): cross-field checks only, no file access;
- resolved (``resolve=True``, what `compile` runs): paths made absolute and checked, the base
  model's config.json read, a resume detected in `training.output_dir`, and the init
  checkpoint's config.json and safetensors header(s) cross-checked against the recipe.

Every finding is a :class:`~dflash_recipes.diagnostics.Diagnostic` with a registered code, the
dotted recipe path it concerns, what is wrong and the fix. Nothing here raises for bad input
and nothing reads tensor data: a 2 GB drafter costs a few kilobytes of header.
"""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs

from dflash_recipes.capture_manifest import (
    SEVERITIES as _CAPTURE_SEVERITIES,
)
from dflash_recipes.capture_manifest import (
    CaptureExpectation,
    base_config_sha256,
    chat_template_sha256,
    check_capture,
    file_sha256,
    needs_teacher,
    tokenizer_sha256,
)
from dflash_recipes.checkpoint import (
    CheckpointWeights,
    inspect_checkpoint_dir,
    inspect_model_dir,
    read_checkpoint_weights,
    resolve_local_path,
)
from dflash_recipes.diagnostics import (
    Diagnostic,
    Severity,
    SourceMap,
    has_errors,
    register_code,
    sort_diagnostics,
)
from dflash_recipes.draft_layout import (
    LayoutSpec,
    compare_layout,
    default_target_layer_ids,
    expected_layout,
    format_layout_diff,
    format_partial_heads,
    head_presence,
    head_submodules,
    infer_architecture,
)
from dflash_recipes.errors import DFlashRecipeError
from dflash_recipes.fields import CHECKPOINT_DFLASH2, check_checkpoint_fields
from dflash_recipes.hfconfig import (
    ARCHITECTURE_FIELDS,
    CheckpointConfigFacts,
    ConfigProblem,
    read_checkpoint_config,
    read_target_config,
)
from dflash_recipes.jsonio import FileReadProblem, clip, file_kind, read_regular_file
from dflash_recipes.loader import load_recipe_with_diagnostics
from dflash_recipes.plan import (
    ArchitecturePlan,
    BaseModelPlan,
    DataPlan,
    DraftPlan,
    InitCheckpointPlan,
    ObjectivePlan,
    ResumePlan,
    RunPlan,
    TargetFacts,
    TrainingPlan,
)
from dflash_recipes.recipe import DFlashArchitectureConfig, Recipe
from dflash_recipes.run_dir import PLAN_FILE, latest_complete_checkpoint

# ---------------------------------------------------------------------------------------------
# diagnostic codes (registered at import so the docs table is generated from them)
# ---------------------------------------------------------------------------------------------

_SEVERITY: dict[str, Severity] = {}


def _code(code: str, severity: Severity, summary: str) -> str:
    _SEVERITY[code] = severity
    return register_code(code, severity, summary)


_E, _W, _I = Severity.ERROR, Severity.WARNING, Severity.INFO
_SEVERITY.update(_CAPTURE_SEVERITIES)

ARCH_DIM_MISSING = _code(
    "arch-dim-missing", _E, "a draft dimension is unset; dims never inherit from the base model"
)
KV_HEADS_NOT_DIVISOR = _code(
    "kv-heads-not-divisor", _E, "num_key_value_heads does not divide num_attention_heads"
)
HEAD_FIELD_MISSING = _code(
    "head-field-missing", _E, "the projector type needs a head size that is unset"
)
HEAD_FIELD_UNUSED = _code(
    "head-field-unused", _W, "a head field is set for another projector type and is ignored"
)
TAPS_DUPLICATE = _code("taps-duplicate", _E, "target_layer_ids lists a target layer twice")
EVAL_DATA_UNSET = _code(
    "eval-data-unset", _W, "training.eval_steps is set but data.eval_data_path is not"
)

_DIR_KINDS: dict[str, str] = {
    "hub-id": "is a Hugging Face Hub id, which is not fetched; stage it with `hf download`",
    "not-found": "does not exist",
    "broken-symlink": "is (or holds) a symbolic link whose target does not exist",
    "not-a-directory": "is a file, not a directory",
    "unreadable": "cannot be read or listed",
    "empty-directory": "is an empty directory",
    "no-weights": "has no model.safetensors (or sharded index)",
    "no-config": "has no config.json",
}


def _register_directory_codes() -> None:
    """One code per way a directory value can be unusable, for the model and the checkpoint."""
    for kind, meaning in _DIR_KINDS.items():
        if kind != "no-weights":
            _code(f"base-model-{kind}", _E, f"model.model_name_or_path {meaning}")
        if kind != "no-config":
            _code(f"init-checkpoint-{kind}", _E, f"dflash.dflash_init_checkpoint {meaning}")


_register_directory_codes()

INIT_CHECKPOINT_BAD_WEIGHTS = _code(
    "init-checkpoint-bad-weights",
    _E,
    "the init checkpoint's safetensors header or shard index is malformed or inconsistent",
)
CHECKPOINT_CONFIG_MISSING = _code(
    "checkpoint-config-missing",
    _W,
    "the init checkpoint has no config.json, so mask/taps/block/RoPE checks are skipped",
)
DATA_PATH_UNSET = _code("data-path-unset", _W, "data.data_path is unset; `run` needs it")
DATA_FILE_MISSING = _code(
    "data-file-missing", _E, "a data file named by the recipe does not exist or is not a file"
)
OUTPUT_DIR_UNUSABLE = _code(
    "output-dir-unusable", _E, "training.output_dir is a file or cannot be listed"
)
RESUME_FROM_CHECKPOINT = _code(
    "resume-from-checkpoint",
    _I,
    "training.output_dir holds a complete checkpoint: the run resumes",
)
INIT_CHECKPOINT_IGNORED = _code(
    "init-checkpoint-ignored", _I, "the run resumes, so dflash_init_checkpoint is not read"
)
CHECKPOINT_LAYOUT_MISMATCH = _code(
    "checkpoint-layout-mismatch",
    _E,
    "the init checkpoint's tensors differ from the drafter the recipe describes",
)
HEAD_PARTLY_PRESENT = _code(
    "head-partly-present", _E, "a head submodule is only partly in the init checkpoint"
)
HEADS_FROM_SCRATCH = _code(
    "heads-from-scratch", _W, "head submodules absent from the init checkpoint train from scratch"
)
HIDDEN_SIZE_MISMATCH = _code(
    "hidden-size-mismatch", _E, "the init checkpoint's width differs from the base model's"
)
CHECKPOINT_TARGET_DIFFERS = _code(
    "checkpoint-target-differs",
    _W,
    "the init checkpoint was trained against a target with other layer count or vocabulary",
)
TAPS_OUT_OF_RANGE = _code(
    "taps-out-of-range", _E, "a target_layer_ids entry is not a layer of the base model"
)
TAPS_FROM_CHECKPOINT = _code(
    "taps-from-checkpoint", _I, "target_layer_ids taken from the init checkpoint's config.json"
)
TAPS_FROM_PREVIOUS_RUN = _code(
    "taps-from-previous-run", _I, "target_layer_ids taken from the plan of the run being resumed"
)
TAPS_DEFAULT = _code(
    "taps-default",
    _I,
    "target_layer_ids from the default formula (no checkpoint to take them from)",
)
TAPS_UNKNOWN = _code(
    "taps-unknown", _E, "target_layer_ids unset and the checkpoint does not state them (no guess)"
)
CHECKPOINT_TAPS_DIFFER = _code(
    "checkpoint-taps-differ",
    _W,
    "target_layer_ids differ from the checkpoint's: degraded warm start",
)
MASK_TOKEN_MISSING = _code(
    "mask-token-missing", _E, "dflash_mask_token_id unset and no checkpoint states it (no guess)"
)
MASK_FROM_CHECKPOINT = _code(
    "mask-from-checkpoint",
    _I,
    "dflash_mask_token_id taken from the init checkpoint's config.json",
)
MASK_FROM_PREVIOUS_RUN = _code(
    "mask-from-previous-run",
    _I,
    "dflash_mask_token_id taken from the plan of the run being resumed",
)
CHECKPOINT_MASK_DIFFERS = _code(
    "checkpoint-mask-differs",
    _W,
    "dflash_mask_token_id differs from the checkpoint's: degraded warm start",
)
MASK_TOKEN_OUT_OF_RANGE = _code(
    "mask-token-out-of-range", _E, "dflash_mask_token_id is not below the target's vocab_size"
)
CHECKPOINT_ROPE_DIFFERS = _code(
    "checkpoint-rope-differs", _W, "the checkpoint's RoPE settings differ from the base model's"
)
CHECKPOINT_RMS_NORM_EPS_DIFFERS = _code(
    "checkpoint-rms-norm-eps-differs", _W, "rms_norm_eps differs from the checkpoint's"
)
CHECKPOINT_BLOCK_SIZE_DIFFERS = _code(
    "checkpoint-block-size-differs",
    _I,
    "dflash_block_size differs from the checkpoint's (allowed: weights are block-size agnostic)",
)

LAYER_TYPES_LENGTH = _code(
    "layer-types-length", _E, "layer_types does not name one attention kind per draft layer"
)
SLIDING_WINDOW_MISSING = _code(
    "sliding-window-missing", _E, "layer_types has sliding_attention layers but no sliding_window"
)
SLIDING_WINDOW_UNUSED = _code(
    "sliding-window-unused", _W, "sliding_window is set but no layer is sliding_attention"
)
LAYER_TYPES_FROM_CHECKPOINT = _code(
    "layer-types-from-checkpoint",
    _I,
    "layer_types / sliding_window taken from the init checkpoint's config.json",
)
LAYER_TYPES_FROM_PREVIOUS_RUN = _code(
    "layer-types-from-previous-run",
    _I,
    "layer_types / sliding_window taken from the plan of the run being resumed",
)
CHECKPOINT_LAYER_TYPES_DIFFER = _code(
    "checkpoint-layer-types-differ",
    _W,
    "layer_types or sliding_window differ from the checkpoint's: degraded warm start",
)

_ARCH = "dflash.dflash_architecture_config"
_TAPS = f"{_ARCH}.target_layer_ids"
_MASK = "dflash.dflash_mask_token_id"
_INIT = "dflash.dflash_init_checkpoint"
_MODEL = "model.model_name_or_path"

_HEAD_FIELDS: dict[str, tuple[str, ...]] = {
    "dflash": (),
    "domino": ("emb_dim", "gru_hidden_dim"),
    "dspark": ("markov_rank",),
}
_HEAD_FIELD_MEANING: dict[str, str] = {
    "emb_dim": "the width of Domino's correction embedding",
    "gru_hidden_dim": "the hidden width of Domino's prefix GRU",
    "markov_rank": "the rank of DSpark's low-rank Markov transition bias",
}

# Paper guidance for the decay gamma (reference section 4): block size -> gamma.
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


@attrs.frozen
class CompileResult:
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


@attrs.frozen
class CheckpointDims:
    """A checkpoint's draft dims (recipe field names, plus hidden_size and n_taps) and where
    each came from, for messages and fixes."""

    values: Mapping[str, int]
    sources: Mapping[str, str]

    def fix(self, name: str) -> str:
        """`set dflash_architecture_config.NAME: VALUE, as the checkpoint's config.json says`."""
        return f"set dflash_architecture_config.{name}: {self.values[name]}, {self.sources[name]}"


def checkpoint_dims(
    config: CheckpointConfigFacts | None, found: Mapping[str, tuple[int, ...]] | None
) -> CheckpointDims:
    """Merge config.json dims with dims read off the tensor shapes (the tensors win)."""
    inferred = infer_architecture(found) if found is not None else {}
    stated = config.architecture() if config is not None else {}
    if config is not None:
        for name in ("hidden_size", "emb_dim", "gru_hidden_dim", "markov_rank"):
            value = getattr(config, name)
            if value is not None:
                stated[name] = value
    values: dict[str, int] = {}
    sources: dict[str, str] = {}
    for name in sorted(set(inferred) | set(stated)):
        said, shown = stated.get(name), inferred.get(name)
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


def _format_ids(ids: Sequence[int]) -> str:
    return "[" + ", ".join(str(i) for i in ids) + "]"


# ---------------------------------------------------------------------------------------------
# the compilation
# ---------------------------------------------------------------------------------------------


class _Compilation:
    """State of one compile: the recipe, what was read, and the diagnostics so far."""

    def __init__(self, recipe: Recipe, source: SourceMap, base_dir: Path | None) -> None:
        self.recipe = recipe
        self.arch: DFlashArchitectureConfig = recipe.dflash.dflash_architecture_config
        self.source = source
        self.base_dir = base_dir
        self.diagnostics: list[Diagnostic] = []
        # filled by the resolving steps
        self.facts: TargetFacts | None = None
        self.resume: ResumePlan | None = None
        self.previous_plan: RunPlan | None = None
        self.checkpoint_dir: Path | None = None
        #: True when the init checkpoint (weights or config.json) exists but cannot be read.
        self.checkpoint_broken = False
        self.weights: CheckpointWeights | None = None
        self.config: CheckpointConfigFacts | None = None
        self.dims = CheckpointDims(values={}, sources={})
        self.heads_from_scratch: tuple[str, ...] = ()

    # -- emitting ---------------------------------------------------------------------------

    def emit(self, code: str, path: str, message: str, hint: str | None = None) -> None:
        self.emit_as(_SEVERITY[code], code, path, message, hint)

    def emit_as(
        self, severity: Severity, code: str, path: str, message: str, hint: str | None
    ) -> None:
        self.diagnostics.append(self.source.diagnostic(severity, code, path, message, hint))

    def emit_problem(self, problem: ConfigProblem, path: str, what: str) -> None:
        message = f"{what}: {problem.message}"
        self.emit_as(problem.severity, problem.code, path, message, problem.hint)

    def absolute(self, value: str) -> Path:
        return resolve_local_path(value, base_dir=self.base_dir)

    # -- schema level ------------------------------------------------------------------------

    def check_schema(self) -> None:
        self.check_attention()
        self.check_head_fields()
        self.check_taps_unique()
        self.check_layer_types_length(self.arch.layer_types, "")
        training, data = self.recipe.training, self.recipe.data
        if training.eval_steps is not None and data.eval_data_path is None:
            self.emit(
                EVAL_DATA_UNSET,
                "training.eval_steps",
                f"training.eval_steps is {training.eval_steps} but data.eval_data_path is not "
                "set, so there is nothing to evaluate on",
                "set data.eval_data_path to a JSONL file of held-out conversations, or set "
                "training.eval_steps: null",
            )

    def check_dims_set(self) -> None:
        for name in ARCHITECTURE_FIELDS:
            if getattr(self.arch, name) is not None:
                continue
            message = (
                f"dflash_architecture_config.{name} is not set; dims never inherit: set "
                f"dflash_architecture_config.{name} (the base model's value is not used)"
            )
            if name in self.dims.values:
                hint = self.dims.fix(name)
            elif self.recipe.dflash.dflash_init_checkpoint is not None and self.resume is None:
                hint = (
                    f"set dflash_architecture_config.{name} to the init checkpoint's value "
                    "(`dflash-recipe init --base-model DIR --init-checkpoint DIR` writes them all)"
                )
            else:
                hint = (
                    f"set dflash_architecture_config.{name} to the drafter's own value "
                    "(`dflash-recipe init --base-model DIR` writes a from-scratch starting point)"
                )
            self.emit(ARCH_DIM_MISSING, f"{_ARCH}.{name}", message, hint)

    def check_attention(self) -> None:
        heads, kv = self.arch.num_attention_heads, self.arch.num_key_value_heads
        if heads is None or kv is None or heads % kv == 0:
            return
        divisors = [d for d in range(1, heads + 1) if heads % d == 0 and d <= kv]
        self.emit(
            KV_HEADS_NOT_DIVISOR,
            f"{_ARCH}.num_key_value_heads",
            f"num_key_value_heads {kv} does not divide num_attention_heads {heads}; grouped-query "
            "attention shares each key/value head among a whole number of query heads",
            f"set dflash_architecture_config.num_key_value_heads to a divisor of {heads}, "
            f"e.g. {divisors[-1]}",
        )

    def check_head_fields(self) -> None:
        projector = self.arch.projector_type
        for name in _HEAD_FIELDS[projector]:
            if getattr(self.arch, name) is not None:
                continue
            found = self.dims.values.get(name)
            if found is not None:
                hint = self.dims.fix(name)
            else:
                hint = f"set dflash_architecture_config.{name} ({_HEAD_FIELD_MEANING[name]})"
            self.emit(
                HEAD_FIELD_MISSING,
                f"{_ARCH}.{name}",
                f"projector_type {projector} needs dflash_architecture_config.{name} "
                f"({_HEAD_FIELD_MEANING[name]}), which is not set",
                hint,
            )
        owners = {"emb_dim": "domino", "gru_hidden_dim": "domino", "markov_rank": "dspark"}
        unused = [n for n, owner in owners.items() if owner != projector and getattr(self.arch, n)]
        if self.arch.use_confidence_head and projector != "dspark":
            unused.append("use_confidence_head")
        for name in unused:
            owner = owners.get(name, "dspark")
            self.emit(
                HEAD_FIELD_UNUSED,
                f"{_ARCH}.{name}",
                f"dflash_architecture_config.{name} belongs to projector_type {owner} and is "
                f"ignored with projector_type {projector}",
                f"delete {name}, or set dflash_architecture_config.projector_type: {owner}",
            )

    def check_taps_unique(self) -> None:
        taps = self.arch.target_layer_ids
        if taps is None or len(set(taps)) == len(taps):
            return
        repeated = sorted({t for t in taps if taps.count(t) > 1})
        unique = list(dict.fromkeys(taps))
        self.emit(
            TAPS_DUPLICATE,
            _TAPS,
            f"target_layer_ids {_format_ids(taps)} list layer(s) {_format_ids(repeated)} more than "
            "once; each tap must be a different target layer",
            f"list each layer once, e.g. target_layer_ids: {_format_ids(unique)}",
        )

    # -- resolving paths ----------------------------------------------------------------------

    def resolve_base_model(self) -> None:
        value = self.recipe.model.model_name_or_path
        problem = inspect_model_dir(value, base_dir=self.base_dir)
        if problem is not None:
            self.emit(f"base-model-{problem.kind}", _MODEL, problem.message, problem.hint)
            return
        read = read_target_config(self.absolute(value))
        for item in read.problems:
            self.emit_problem(item, _MODEL, f"base model {read.path}")
        self.facts = read.facts

    def resolve_data(self) -> None:
        data = self.recipe.data
        if data.data_path is None and data.hidden_states_path is None:
            self.emit(
                DATA_PATH_UNSET,
                "data.data_path",
                "data.data_path is not set; the plan compiles, but `dflash-recipe run` needs a "
                "JSONL file of training conversations",
                "set data.data_path: /path/to/train.jsonl (one conversation per line)",
            )
        fields = (
            ("data_path", data.data_path, "a JSONL file of training conversations"),
            ("chat_template", data.chat_template, "a .jinja chat template file"),
            ("eval_data_path", data.eval_data_path, "a JSONL file of held-out conversations"),
        )
        for name, value, what in fields:
            if value is None:
                continue
            path = self.absolute(value)
            try:
                exists, is_file = path.exists(), path.is_file()
            except OSError:
                exists, is_file = False, False
            if is_file:
                continue
            problem = "is a directory, not a file" if exists else "does not exist"
            base = "the recipe's folder" if self.base_dir is not None else "the working directory"
            self.emit(
                DATA_FILE_MISSING,
                f"data.{name}",
                f"data.{name} {path} {problem} ({what} expected)",
                f"point data.{name} at {what} (a relative path is resolved against {base})",
            )

    def check_capture(self, taps: Sequence[int] | None) -> None:
        """data.hidden_states_path against the plan: manifest and shard headers only."""
        data, facts = self.recipe.data, self.facts
        if data.hidden_states_path is None or taps is None or facts is None:
            return
        objective = self.recipe.dflash
        base = self.absolute(self.recipe.model.model_name_or_path)
        template = self.absolute(data.chat_template) if data.chat_template else None
        expect = CaptureExpectation(
            target_layer_ids=tuple(taps),
            hidden_size=facts.hidden_size,
            dtype=self.recipe.model.dtype,
            training_seq_len=self.recipe.training.training_seq_len,
            answer_only_loss=data.answer_only_loss,
            needs_last_hidden=needs_teacher(
                self_logit_distillation=objective.dflash_self_logit_distillation,
                projector_type=self.arch.projector_type,
                dspark_tv_weight=float(objective.dflash_dspark_tv_weight),
            ),
            base_config_sha256=base_config_sha256(base),
            tokenizer_sha256=tokenizer_sha256(base),
            chat_template_sha256=chat_template_sha256(str(template) if template else None, base),
            data_sha256=_data_sha256(self.absolute(data.data_path)) if data.data_path else None,
            block_size=objective.dflash_block_size,
        )
        directory = self.absolute(data.hidden_states_path)
        for finding in check_capture(directory, expect):
            self.emit(finding.code, "data.hidden_states_path", finding.message, finding.hint)

    def resolve_output(self) -> None:
        output_dir = self.absolute(self.recipe.training.output_dir)
        unusable = output_dir_problem(output_dir)
        if unusable is not None:
            self.emit(
                OUTPUT_DIR_UNUSABLE,
                "training.output_dir",
                f"training.output_dir {clip(str(output_dir))} {unusable}; checkpoints, "
                "metrics and the export are written into a directory",
                "point training.output_dir at a new or existing directory",
            )
            return
        try:
            if output_dir.exists() and not output_dir.is_dir():
                self.emit(
                    OUTPUT_DIR_UNUSABLE,
                    "training.output_dir",
                    f"training.output_dir {output_dir} is a file; checkpoints, metrics and the "
                    "export are written into a directory",
                    "point training.output_dir at a new or existing directory",
                )
                return
            latest = latest_complete_checkpoint(output_dir)
        except OSError as exc:
            self.emit(
                OUTPUT_DIR_UNUSABLE,
                "training.output_dir",
                f"training.output_dir {output_dir} cannot be listed: {exc.strerror or exc}",
                "make it readable and writable by this user, or choose another directory",
            )
            return
        if latest is None:
            return
        step, checkpoint = latest
        self.resume = ResumePlan(checkpoint_dir=str(checkpoint), step=step)
        self.emit(
            RESUME_FROM_CHECKPOINT,
            "training.output_dir",
            f"training.output_dir holds a complete training checkpoint at step {step} "
            f"({checkpoint}); the run resumes from it",
            "to start a new run instead, point training.output_dir at another directory",
        )
        self.previous_plan = _read_previous_plan(output_dir / PLAN_FILE)
        if self.recipe.dflash.dflash_init_checkpoint is not None:
            self.emit(
                INIT_CHECKPOINT_IGNORED,
                _INIT,
                f"dflash_init_checkpoint is ignored because the run resumes from {checkpoint}; "
                "it is not read and need not exist any more",
                "nothing to do; to warm-start a new run from it, change training.output_dir",
            )

    def resolve_init_checkpoint(self) -> None:
        value = self.recipe.dflash.dflash_init_checkpoint
        if value is None or self.resume is not None:
            return
        self.checkpoint_dir = self.absolute(value)
        problem = inspect_checkpoint_dir(value, base_dir=self.base_dir)
        if problem is not None:
            self.checkpoint_broken = True
            self.emit(f"init-checkpoint-{problem.kind}", _INIT, problem.message, problem.hint)
            return
        try:
            self.weights = read_checkpoint_weights(self.checkpoint_dir)
        except DFlashRecipeError as exc:
            self.checkpoint_broken = True
            self.emit(
                INIT_CHECKPOINT_BAD_WEIGHTS,
                _INIT,
                f"the init checkpoint's weights cannot be used: {exc}",
                "download or export the checkpoint again (compile reads only the safetensors "
                "header, so this file is damaged, truncated or not a safetensors file)",
            )
        self.config = read_checkpoint_config(self.checkpoint_dir)
        if not self.config.present:
            self.emit(
                CHECKPOINT_CONFIG_MISSING,
                _INIT,
                f"{self.checkpoint_dir} has no config.json, so its mask token id, taps, block "
                "size, RoPE theta and rms_norm_eps cannot be checked (the tensor layout still is)",
                "copy the drafter's config.json next to its weights (`hf download` fetches it), "
                "or set dflash_mask_token_id and target_layer_ids explicitly",
            )
        for item in self.config.problems:
            self.emit_problem(item, _INIT, f"init checkpoint {self.config.path}")
        if not self.config.readable and self.config.present:
            self.checkpoint_broken = True  # its taps and mask are unknown, not absent
        found = self.weights.shapes if self.weights is not None else None
        self.dims = checkpoint_dims(self.config if self.config.readable else None, found)

    # -- taps and mask: never guessed ---------------------------------------------------------

    def resolve_taps(self) -> tuple[int, ...] | None:
        taps = self.arch.target_layer_ids
        stated = self.config.target_layer_ids if self.config is not None else None
        if taps is not None:
            if stated is not None and stated != taps:
                self.emit(
                    CHECKPOINT_TAPS_DIFFER,
                    _TAPS,
                    f"target_layer_ids {_format_ids(taps)} differ from the init checkpoint's "
                    f"{_format_ids(stated)}; the warm start loads, but its fused context is "
                    "built from other target layers, so it starts degraded",
                    f"set target_layer_ids: {_format_ids(stated)} (or delete the field to take "
                    "the checkpoint's), unless retapping is intended",
                )
            return taps
        previous = self.previous_plan.draft.target_layer_ids if self.previous_plan else None
        if self.resume is not None and previous is not None:
            self.emit(
                TAPS_FROM_PREVIOUS_RUN,
                _TAPS,
                f"target_layer_ids not set: using {_format_ids(previous)}, the taps of the run "
                "being resumed (its plan.json)",
                f"set target_layer_ids: {_format_ids(previous)} to pin them in the recipe",
            )
            return previous
        if stated is not None:
            self.emit(
                TAPS_FROM_CHECKPOINT,
                _TAPS,
                f"target_layer_ids not set: using the init checkpoint's {_format_ids(stated)} "
                "(its config.json)",
                f"set target_layer_ids: {_format_ids(stated)} to pin them in the recipe",
            )
            return stated
        if self.recipe.dflash.dflash_init_checkpoint is not None:
            if self.checkpoint_broken:
                return None
            n_taps = self.dims.values.get("n_taps")
            count = f" (its fc.weight takes {n_taps} taps)" if n_taps else ""
            where = "the run being resumed" if self.resume is not None else "the init checkpoint"
            self.emit(
                TAPS_UNKNOWN,
                _TAPS,
                f"target_layer_ids not set, and {where} does not state the taps it was trained "
                f"with{count}; taps are never guessed",
                "set dflash_architecture_config.target_layer_ids to the drafter's taps (its "
                "model card or original config.json)",
            )
            return None
        layers = self.arch.num_hidden_layers
        if self.facts is None or layers is None:
            return None
        target_layers = self.facts.num_hidden_layers
        try:
            taps = default_target_layer_ids(target_layers, layers)
        except ValueError as exc:
            self.emit(
                TAPS_OUT_OF_RANGE,
                _TAPS,
                f"target_layer_ids not set and {exc}",
                f"set target_layer_ids to distinct layers in 0..{target_layers - 1}",
            )
            return None
        self.emit(
            TAPS_DEFAULT,
            _TAPS,
            f"target_layer_ids not set: using the default formula for a {target_layers}-layer "
            f"target and {layers} draft layers: {_format_ids(taps)}",
            f"set target_layer_ids: {_format_ids(taps)} to pin them in the recipe",
        )
        return taps

    def resolve_mask(self) -> int | None:
        mask = self.recipe.dflash.dflash_mask_token_id
        stated = self.config.mask_token_id if self.config is not None else None
        if mask is not None:
            if stated is not None and stated != mask:
                self.emit(
                    CHECKPOINT_MASK_DIFFERS,
                    _MASK,
                    f"dflash_mask_token_id {mask} differs from the init checkpoint's {stated}; the "
                    "warm start loads, but the drafter learned to read token "
                    f"{stated} as the mask, so it starts degraded",
                    f"set dflash_mask_token_id: {stated} (or delete it to take the checkpoint's), "
                    "unless the change is intended",
                )
            return mask
        previous = self.previous_plan.draft.mask_token_id if self.previous_plan else None
        if self.resume is not None and previous is not None:
            self.emit(
                MASK_FROM_PREVIOUS_RUN,
                _MASK,
                f"dflash_mask_token_id not set: using {previous}, the mask id of the run being "
                "resumed (its plan.json)",
                f"set dflash_mask_token_id: {previous} to pin it in the recipe",
            )
            return previous
        if stated is not None:
            self.emit(
                MASK_FROM_CHECKPOINT,
                _MASK,
                f"dflash_mask_token_id not set: using the init checkpoint's {stated} "
                "(its config.json)",
                f"set dflash_mask_token_id: {stated} to pin it in the recipe",
            )
            return stated
        if self.checkpoint_broken:
            return None
        if self.resume is not None:
            source = "the run being resumed has no plan.json stating one"
        elif self.recipe.dflash.dflash_init_checkpoint is not None:
            source = "the init checkpoint's config.json does not state one"
        else:
            source = "there is no init checkpoint to take it from"
        vocab = f" below the target's vocab_size {self.facts.vocab_size}" if self.facts else ""
        self.emit(
            MASK_TOKEN_MISSING,
            _MASK,
            f"dflash_mask_token_id is not set and {source}; the mask id is never guessed",
            f"set dflash.dflash_mask_token_id to an embedding row{vocab} that the tokenizer "
            "never produces; for Qwen3 use 151669, the first unused embedding row (the Qwen3 "
            "tokenizer has no mask token)",
        )
        return None

    # -- attention kinds per layer: taken from the checkpoint like the taps ----------------------

    def check_layer_types_length(self, types: tuple[str, ...] | None, origin: str) -> bool:
        layers = self.arch.num_hidden_layers
        if types is None or layers is None or len(types) == layers:
            return True
        if len(types) < layers:
            example = list(types) + [types[-1]] * (layers - len(types))
        else:
            example = list(types[:layers])
        self.emit(
            LAYER_TYPES_LENGTH,
            f"{_ARCH}.layer_types",
            f"layer_types{origin} lists {len(types)} attention kinds, but the drafter has "
            f"num_hidden_layers {layers}; layer_types needs exactly one entry per draft layer",
            f"set dflash_architecture_config.layer_types to {layers} entries, e.g. "
            f"[{', '.join(example)}]",
        )
        return False

    def resolve_layer_types(self) -> tuple[tuple[str, ...] | None, int | None]:
        """The plan's (layer_types, sliding_window): recipe, else resumed run, else checkpoint."""
        types, window = self.arch.layer_types, self.arch.sliding_window
        config = self.config if self.config is not None and self.config.readable else None
        stated_types = config.layer_types if config is not None else None
        stated_window = config.sliding_window if config is not None else None
        if stated_types is None or "sliding_attention" not in stated_types:
            stated_window = None  # a window without sliding layers means nothing
        previous = self.previous_plan.draft.architecture if self.previous_plan else None
        taken: list[str] = []
        origin = ""
        if types is None and window is None and self.resume is not None and previous:
            types, window = previous.layer_types, previous.sliding_window
            if types is not None:
                self.emit(
                    LAYER_TYPES_FROM_PREVIOUS_RUN,
                    f"{_ARCH}.layer_types",
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
                self.emit(
                    LAYER_TYPES_FROM_CHECKPOINT,
                    f"{_ARCH}.layer_types",
                    f"{' and '.join(taken)} not set in the recipe: using the init checkpoint's "
                    "(its config.json)",
                    "set "
                    + " and ".join(t.replace(" ", ": ", 1) for t in taken)
                    + " to pin them in the recipe",
                )
            self.compare_layer_types(types, window, stated_types, stated_window)
        layers = self.arch.num_hidden_layers
        if origin and not self.check_layer_types_length(types, origin):
            return None, None
        if types is not None and layers is not None and len(types) != layers:
            return None, None  # reported by check_schema
        sliding = types is not None and "sliding_attention" in types
        if sliding and window is None:
            self.emit(
                SLIDING_WINDOW_MISSING,
                f"{_ARCH}.sliding_window",
                f"layer_types{origin} has sliding_attention layers, but no sliding_window says "
                "how many keys they see",
                "set dflash_architecture_config.sliding_window (a positive number of keys, the "
                "query itself included, e.g. 2048), or make every layer full_attention",
            )
            return None, None
        if not sliding and window is not None:
            if self.arch.sliding_window is not None:
                self.emit(
                    SLIDING_WINDOW_UNUSED,
                    f"{_ARCH}.sliding_window",
                    f"sliding_window {window} is set, but no layer is sliding_attention, so it "
                    "changes nothing",
                    "delete sliding_window, or set some layer_types entries to sliding_attention",
                )
            window = None
        return types, window

    def compare_layer_types(
        self,
        types: tuple[str, ...] | None,
        window: int | None,
        stated_types: tuple[str, ...] | None,
        stated_window: int | None,
    ) -> None:
        if self.config is None or not self.config.readable:
            return
        full = ("full_attention",) * (self.arch.num_hidden_layers or 0)
        mine = types if types is not None else full
        theirs = stated_types if stated_types is not None else full
        if mine == theirs and (stated_window is None or window == stated_window):
            return
        said = f"[{', '.join(theirs)}]" + (
            f" with sliding_window {stated_window}" if stated_window is not None else ""
        )
        got = f"[{', '.join(mine)}]" + (f" with sliding_window {window}" if window else "")
        fix = f"set layer_types: [{', '.join(theirs)}]" + (
            f" and sliding_window: {stated_window}" if stated_window is not None else ""
        )
        self.emit(
            CHECKPOINT_LAYER_TYPES_DIFFER,
            f"{_ARCH}.layer_types",
            f"the recipe's attention kinds {got} differ from the init checkpoint's {said}; the "
            "warm start loads, but its layers learned to attend over other keys, so it starts "
            "degraded",
            f"{fix} (or delete the fields to take the checkpoint's), unless the change is intended",
        )

    # -- checks against the base model ----------------------------------------------------------

    def check_against_target(self, taps: tuple[int, ...] | None, mask: int | None) -> None:
        facts = self.facts
        if facts is None:
            return
        if taps is not None:
            bad = [t for t in taps if t >= facts.num_hidden_layers]
            if bad:
                origin = (
                    "" if self.arch.target_layer_ids is not None else " (not set in the recipe)"
                )
                self.emit(
                    TAPS_OUT_OF_RANGE,
                    _TAPS,
                    f"target_layer_ids {_format_ids(taps)}{origin} include {_format_ids(bad)}, but "
                    f"the base model has {facts.num_hidden_layers} decoder layers, so valid taps "
                    f"are 0..{facts.num_hidden_layers - 1} (id k taps the output of layer k, "
                    "hidden_states[k + 1])",
                    "use taps inside the base model, or check that model.model_name_or_path is "
                    "the target the drafter was trained for",
                )
        if mask is not None and mask >= facts.vocab_size:
            self.emit(
                MASK_TOKEN_OUT_OF_RANGE,
                _MASK,
                f"dflash_mask_token_id {mask} is not a row of the target's embedding table "
                f"(vocab_size {facts.vocab_size}, rows 0..{facts.vocab_size - 1})",
                f"set dflash_mask_token_id to an unused row below {facts.vocab_size} (Qwen3: "
                "151669), or check model.model_name_or_path",
            )

    # -- checks against the checkpoint's config.json --------------------------------------------

    def check_checkpoint_config(self) -> None:
        config, facts = self.config, self.facts
        if config is None or not config.readable:
            return
        block = self.recipe.dflash.dflash_block_size
        if config.block_size is not None and config.block_size != block:
            self.emit(
                CHECKPOINT_BLOCK_SIZE_DIFFERS,
                "dflash.dflash_block_size",
                f"dflash_block_size {block} differs from the checkpoint's trained block size "
                f"{config.block_size}; this is allowed (the weights do not depend on the block "
                "size) and the fine-tune adapts the drafter to the new size",
                f"nothing to change; set dflash_block_size: {config.block_size} to keep the "
                "trained size",
            )
        eps = self.arch.rms_norm_eps
        if config.rms_norm_eps is not None and not math.isclose(
            config.rms_norm_eps, eps, rel_tol=1e-9
        ):
            self.emit(
                CHECKPOINT_RMS_NORM_EPS_DIFFERS,
                f"{_ARCH}.rms_norm_eps",
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
            self.emit(
                CHECKPOINT_ROPE_DIFFERS,
                _INIT,
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
                f"num_target_layers {config.num_target_layers} (base model: "
                f"{facts.num_hidden_layers})"
            )
        if config.vocab_size is not None and config.vocab_size != facts.vocab_size:
            mismatches.append(f"vocab_size {config.vocab_size} (base model: {facts.vocab_size})")
        if mismatches:
            self.emit(
                CHECKPOINT_TARGET_DIFFERS,
                _INIT,
                "the init checkpoint was trained against another target: its config.json states "
                + " and ".join(mismatches),
                "point model.model_name_or_path at the base model the drafter was trained for, "
                "or expect a weak warm start",
            )

    def check_checkpoint_fields(self) -> bool:
        """The field inventory's checks (dflash_recipes.fields); False for a DFlash 2 checkpoint."""
        config = self.config
        if config is None or not config.readable:
            return True
        findings = check_checkpoint_fields(
            config.raw,
            self.weights.shapes if self.weights is not None else None,
            where=f"init checkpoint {config.path}",
            training_seq_len=self.recipe.training.training_seq_len,
            projector_type=self.arch.projector_type,
        )
        for item in findings:
            self.emit_as(item.severity, item.code, item.path, item.message, item.hint)
        return not any(item.code == CHECKPOINT_DFLASH2 for item in findings)

    # -- checks against the safetensors header --------------------------------------------------

    def check_layout(self, taps: tuple[int, ...] | None) -> None:
        weights, facts = self.weights, self.facts
        if weights is None or facts is None:
            return
        found = weights.shapes
        width = self.dims.values.get("hidden_size")
        if width is not None and width != facts.hidden_size:
            self.emit(
                HIDDEN_SIZE_MISMATCH,
                _INIT,
                f"the init checkpoint's drafter is {width} wide "
                f"({self.dims.sources['hidden_size']}) but the base model's hidden_size is "
                f"{facts.hidden_size}; a drafter is always as wide as its target (it uses the "
                "target's embeddings and lm_head), so the tensor comparison was skipped",
                "use a drafter trained for this base model, or point model.model_name_or_path at "
                "the base model the drafter was trained for",
            )
            return
        spec = self.layout_spec(len(taps) if taps is not None else None)
        if spec is None:
            return
        presence = head_presence(spec, found)
        skipped: set[str] = set()
        heads = head_submodules(spec)
        for module in (*presence.absent, *presence.partial):
            skipped.update(heads[module])
        expected = {n: s for n, s in expected_layout(spec).items() if n not in skipped}
        diff = compare_layout(expected, {n: s for n, s in found.items() if n not in skipped})
        if not diff.is_empty:
            fixes = self.layout_fixes(spec, found, taps)
            hint = (
                "\n".join(fixes)
                if fixes
                else (
                    "make dflash_architecture_config match the checkpoint, or use a checkpoint "
                    "exported for this architecture"
                )
            )
            self.emit(
                CHECKPOINT_LAYOUT_MISMATCH,
                _ARCH,
                f"{format_layout_diff(diff)}\n(checkpoint: {weights.directory})",
                hint,
            )
        if presence.partial:
            self.emit(
                HEAD_PARTLY_PRESENT,
                f"{_ARCH}.projector_type",
                f"{format_partial_heads(presence)}\na head submodule is loaded whole or trained "
                "from scratch, never half-loaded",
                "use a checkpoint that holds the complete head, or one without it (the head then "
                "trains from scratch)",
            )
        elif presence.absent:
            self.heads_from_scratch = presence.absent
            self.emit(
                HEADS_FROM_SCRATCH,
                f"{_ARCH}.projector_type",
                f"the init checkpoint has no {spec.projector_type} head: "
                f"{', '.join(presence.absent)} will train from scratch while the backbone "
                "warm-starts",
                f"nothing to change when warm-starting a {spec.projector_type} drafter from a "
                "plain DFlash checkpoint; expect the head to need more steps than the backbone",
            )

    def layout_spec(self, n_taps: int | None) -> LayoutSpec | None:
        arch, facts = self.arch, self.facts
        if facts is None or n_taps is None:
            return None
        dims = [getattr(arch, name) for name in ARCHITECTURE_FIELDS]
        if any(value is None for value in dims):
            return None
        layers, heads, kv, head_dim, inter = dims
        try:
            return LayoutSpec(
                hidden_size=facts.hidden_size,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=kv,
                head_dim=head_dim,
                intermediate_size=inter,
                n_taps=n_taps,
                vocab_size=facts.vocab_size,
                projector_type=arch.projector_type,
                emb_dim=arch.emb_dim,
                gru_hidden_dim=arch.gru_hidden_dim,
                markov_rank=arch.markov_rank,
                use_confidence_head=arch.use_confidence_head,
                attention_sink=arch.attention_sink,
            )
        except ValueError:
            return None  # a head field is missing: reported by check_head_fields

    def layout_fixes(
        self,
        spec: LayoutSpec,
        found: Mapping[str, tuple[int, ...]],
        taps: tuple[int, ...] | None,
    ) -> list[str]:
        fixes: list[str] = []
        for name in (*ARCHITECTURE_FIELDS, *_HEAD_FIELDS[spec.projector_type]):
            value = self.dims.values.get(name)
            if value is not None and value != getattr(spec, name):
                fixes.append(self.dims.fix(name))
        n_taps = self.dims.values.get("n_taps")
        if n_taps is not None and n_taps != spec.n_taps:
            stated = self.config.target_layer_ids if self.config is not None else None
            if stated is not None and len(stated) == n_taps:
                fixes.append(
                    f"set dflash_architecture_config.target_layer_ids: {_format_ids(stated)}, "
                    "as the checkpoint's config.json says"
                )
            else:
                fixes.append(
                    f"set dflash_architecture_config.target_layer_ids to the {n_taps} taps the "
                    f"checkpoint was trained with (its fc.weight takes {n_taps}, the recipe "
                    f"gives {len(taps or ())})"
                )
        has_sink = any(n.endswith(".self_attn.attention_sink_bias") for n in found)
        if has_sink != spec.attention_sink:
            fixes.append(
                f"set dflash_architecture_config.attention_sink: {str(has_sink).lower()}, as the "
                "checkpoint's tensors show"
            )
        stated_projector = self.config.projector_type if self.config is not None else None
        if stated_projector is not None and stated_projector != spec.projector_type:
            fixes.append(
                f"set dflash_architecture_config.projector_type: {stated_projector}, as the "
                "checkpoint's config.json says"
            )
        return fixes

    # -- the plan ---------------------------------------------------------------------------------

    def build_plan(
        self,
        *,
        taps: tuple[int, ...] | None,
        mask: int | None,
        layer_types: tuple[tuple[str, ...] | None, int | None] = (None, None),
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
                    rms_norm_eps=float(arch.rms_norm_eps),
                    projector_type=arch.projector_type,
                    emb_dim=arch.emb_dim,
                    gru_hidden_dim=arch.gru_hidden_dim,
                    markov_rank=arch.markov_rank,
                    use_confidence_head=arch.use_confidence_head,
                    attention_sink=arch.attention_sink,
                    layer_types=layer_types[0],
                    sliding_window=layer_types[1],
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
        )


def output_dir_problem(path: Path) -> str | None:
    """Why `run` could not create or use `path` as its output directory, or None.

    Checked without creating anything: a NUL byte, a folder (or the path itself) that is a
    file or another non-directory, or a path the file system refuses (e.g. a name too long).
    """
    text = os.fspath(path)
    if "\0" in text:
        return "contains a NUL byte, which no file system accepts"
    probe = path
    while True:
        try:
            info = os.stat(probe)
        except FileNotFoundError:
            if probe.parent == probe:
                return None
            probe = probe.parent
            continue
        except NotADirectoryError:
            probe = probe.parent
            continue
        except OSError as exc:
            return f"cannot be used: {exc.strerror or exc}"
        if stat.S_ISDIR(info.st_mode):
            return None
        if probe == path:
            return f"exists and is {file_kind(info.st_mode)}, not a directory"
        return f"lies below {probe}, which is {file_kind(info.st_mode)}, not a directory"


def _data_sha256(path: Path) -> str | None:
    try:
        return file_sha256(path)
    except OSError:
        return None  # data-file-missing reports it


def _read_previous_plan(path: Path) -> RunPlan | None:
    """The plan a resumed run was started with, or None when absent or unreadable."""
    try:
        return RunPlan.from_json(read_regular_file(path, max_bytes=16 * 2**20))
    except (FileReadProblem, DFlashRecipeError):
        return None


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
    if resolve:
        work.resolve_base_model()
        work.resolve_data()
        work.resolve_output()
        work.resolve_init_checkpoint()
    work.check_schema()
    work.check_dims_set()
    if resolve:
        taps = work.resolve_taps()
        mask = work.resolve_mask()
        layer_types = work.resolve_layer_types()
        work.check_against_target(taps, mask)
        work.check_checkpoint_config()
        if work.check_checkpoint_fields():  # a DFlash 2 checkpoint gets one error, no layout diff
            work.check_layout(taps)
        work.check_capture(taps)
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
    "CheckpointDims",
    "CompileResult",
    "checkpoint_dims",
    "compile_file",
    "compile_recipe",
    "default_loss_decay_factor",
]
