"""The compiler's diagnostic codes: one constant per finding a compile can report.

Registered with :func:`~dflash_recipes.diagnostics.register_code` at import, which gives each
code its one severity; the compiler's checks emit by code and read the severity back from the
registry (:func:`~dflash_recipes.diagnostics.code_severity`).
"""

from __future__ import annotations

from dflash_recipes.diagnostics import Severity, register_code

_code = register_code
_E, _W, _I = Severity.ERROR, Severity.WARNING, Severity.INFO

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
PURE_DRAFT_PREFIX_RANGE = _code(
    "pure-draft-prefix-range",
    _E,
    "Domino's pure_draft_prefix_len is outside [0, dflash_block_size - 1]",
)
TAPS_DUPLICATE = _code("taps-duplicate", _E, "target_layer_ids lists a target layer twice")
EVAL_DATA_UNSET = _code(
    "eval-data-unset", _W, "training.eval_steps is set but data.eval_data_path is not"
)
EVAL_DATA_TWICE = _code(
    "eval-data-twice", _E, "data.eval_holdout and data.eval_data_path are both set"
)
EVAL_HOLDOUT_OFFLINE = _code(
    "eval-holdout-offline",
    _E,
    "data.eval_holdout with data.hidden_states_path: a capture trains on every conversation",
)
EVAL_HOLDOUT_SMALL = _code(
    "eval-holdout-small",
    _W,
    "data.eval_holdout is smaller than training.eval_num_prompts",
)
EVAL_GATE_UNMEASURED = _code(
    "eval-gate-unmeasured",
    _E,
    "training.eval_min_tau is set but the run measures no held-out tau to compare with it",
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
DATA_HUB_ID = _code(
    "data-hub-id", _E, "a data path is a Hugging Face Hub dataset id; nothing is downloaded"
)
DATA_UNREADABLE = _code(
    "data-unreadable", _E, "a data input cannot be read (corrupt Parquet/Arrow, bad folder)"
)
PACKING_OFFLINE = _code(
    "packing-offline", _E, "data.packing is on with offline training (data.hidden_states_path)"
)
PACKING_RECURRENT_LAYERS = _code(
    "packing-recurrent-layers",
    _E,
    "data.packing with a target whose layers carry a state across tokens (linear attention, "
    "state-space layers): no mask keeps its documents apart",
)
TARGET_LAYER_TYPE_UNKNOWN = _code(
    "target-layer-type-unknown",
    _W,
    "the target declares a layer type dflash-recipes does not know; a packed run checks it",
)
TARGET_ATTN_IMPLEMENTATION = _code(
    "target-attn-implementation",
    _E,
    "the target's config.json asks for an attention implementation that cannot load offline",
)
TARGET_NO_DECODER = _code(
    "target-no-decoder",
    _E,
    "the target has no decoder stack to tap (reported by `run`, `capture` and `eval`)",
)
DATA_COLUMNS_MISSING = _code(
    "data-columns-missing", _E, "a data input has no 'messages' or 'conversations' column"
)
OUTPUT_DIR_UNUSABLE = _code(
    "output-dir-unusable", _E, "training.output_dir is a file or cannot be listed"
)
OUTPUT_DIR_HOLDS_EXPORT = _code(
    "output-dir-holds-export",
    _E,
    "training.output_dir holds a drafter export (model.safetensors + config.json): the run would "
    "make it a run directory that export can never replace",
)
TRACKER_LIBRARY_MISSING = _code(
    "tracker-library-missing",
    _E,
    "training.report_to names a tracker whose library is not installed (nothing would be tracked)",
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
CHECKPOINT_LAYOUT_RENAMED = _code(
    "checkpoint-layout-renamed",
    _I,
    "the init checkpoint is in a known layout whose tensor names are read as the z-lab names",
)
CHECKPOINT_NAME_CLASH = _code(
    "checkpoint-name-clash",
    _E,
    "two tensors of the init checkpoint would load into the same parameter (known layouts)",
)
HEAD_PARTLY_PRESENT = _code(
    "head-partly-present", _E, "a head submodule is only partly in the init checkpoint"
)
HEADS_FROM_SCRATCH = _code(
    "heads-from-scratch", _W, "head submodules absent from the init checkpoint train from scratch"
)
KIND_FIELD_FROM_CHECKPOINT = _code(
    "kind-field-from-checkpoint",
    _I,
    "a DFlash 2 field (conv_kernel_size, selector_top_k, ...) taken from the init checkpoint's "
    "dflash_config",
)
CHECKPOINT_KIND_FIELD_DIFFERS = _code(
    "checkpoint-kind-field-differs",
    _E,
    "a DFlash 2 field of the recipe contradicts the init checkpoint's dflash_config",
)
DFLASH2_SETTING_INVALID = _code(
    "dflash2-setting-invalid",
    _E,
    "a DFlash 2 field breaks its rule (conv_group_size divides the hidden size, "
    "conv_kernel_size <= dflash_block_size, selector_top_k <= vocab)",
)
DFLASH2_NOT_YET = _code(
    "dflash2-not-yet",
    _E,
    "projector_type dflash2 is checked, but this version cannot train DFlash 2 drafters yet",
)
CHECKPOINT_CAUSAL_UNSTATED = _code(
    "checkpoint-causal-unstated",
    _W,
    "a DFlash 2 init checkpoint with sliding layers does not state is_causal: false "
    "(engines would run those layers causal)",
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
RMS_NORM_EPS_FROM_CHECKPOINT = _code(
    "rms-norm-eps-from-checkpoint",
    _I,
    "rms_norm_eps taken from the init checkpoint's config.json",
)
RMS_NORM_EPS_FROM_PREVIOUS_RUN = _code(
    "rms-norm-eps-from-previous-run",
    _I,
    "rms_norm_eps taken from the plan of the run being resumed",
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


RESOURCES_EXCEED_DEVICE = _code(
    "resources-exceed-device",
    _E,
    "the estimated memory per rank exceeds `compile --device-memory` (docs: Will it fit?)",
)

__all__ = [
    "ARCH_DIM_MISSING",
    "CHECKPOINT_BLOCK_SIZE_DIFFERS",
    "CHECKPOINT_CAUSAL_UNSTATED",
    "CHECKPOINT_CONFIG_MISSING",
    "CHECKPOINT_KIND_FIELD_DIFFERS",
    "CHECKPOINT_LAYER_TYPES_DIFFER",
    "CHECKPOINT_LAYOUT_MISMATCH",
    "CHECKPOINT_LAYOUT_RENAMED",
    "CHECKPOINT_MASK_DIFFERS",
    "CHECKPOINT_NAME_CLASH",
    "CHECKPOINT_RMS_NORM_EPS_DIFFERS",
    "CHECKPOINT_ROPE_DIFFERS",
    "CHECKPOINT_TAPS_DIFFER",
    "CHECKPOINT_TARGET_DIFFERS",
    "DATA_COLUMNS_MISSING",
    "DATA_FILE_MISSING",
    "DATA_HUB_ID",
    "DATA_PATH_UNSET",
    "DATA_UNREADABLE",
    "DFLASH2_NOT_YET",
    "DFLASH2_SETTING_INVALID",
    "EVAL_DATA_UNSET",
    "HEADS_FROM_SCRATCH",
    "HEAD_FIELD_MISSING",
    "HEAD_FIELD_UNUSED",
    "HEAD_PARTLY_PRESENT",
    "HIDDEN_SIZE_MISMATCH",
    "INIT_CHECKPOINT_BAD_WEIGHTS",
    "INIT_CHECKPOINT_IGNORED",
    "KIND_FIELD_FROM_CHECKPOINT",
    "KV_HEADS_NOT_DIVISOR",
    "LAYER_TYPES_FROM_CHECKPOINT",
    "LAYER_TYPES_FROM_PREVIOUS_RUN",
    "LAYER_TYPES_LENGTH",
    "MASK_FROM_CHECKPOINT",
    "MASK_FROM_PREVIOUS_RUN",
    "MASK_TOKEN_MISSING",
    "MASK_TOKEN_OUT_OF_RANGE",
    "OUTPUT_DIR_HOLDS_EXPORT",
    "OUTPUT_DIR_UNUSABLE",
    "PURE_DRAFT_PREFIX_RANGE",
    "RESOURCES_EXCEED_DEVICE",
    "RESUME_FROM_CHECKPOINT",
    "RMS_NORM_EPS_FROM_CHECKPOINT",
    "RMS_NORM_EPS_FROM_PREVIOUS_RUN",
    "SLIDING_WINDOW_MISSING",
    "SLIDING_WINDOW_UNUSED",
    "TAPS_DEFAULT",
    "TAPS_DUPLICATE",
    "TAPS_FROM_CHECKPOINT",
    "TAPS_FROM_PREVIOUS_RUN",
    "TAPS_OUT_OF_RANGE",
    "TAPS_UNKNOWN",
]
