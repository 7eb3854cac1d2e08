"""The inventory of drafter checkpoint `config.json` fields: what each one means here.

Every field that z-lab's `dflash/model.py`, vLLM, SGLang, vllm-project/speculators or
ModelOpt reads from a DFlash drafter's `config.json` (top level and `dflash_config`) has one
:class:`CheckpointField` entry in :data:`CHECKPOINT_FIELDS`, with what dflash-recipes does with
it:

- *honored*: the plan carries it and the executor uses it;
- *refused*: a value the project cannot compute is an error, with the reason and what to do;
- *compared*: checked against the recipe, the base model or the safetensors header, with a
  warning (or info) when they disagree;
- *irrelevant*: it cannot change what is trained or served from this project's export (why is
  in the entry).

A field of an init checkpoint's config.json that is in no entry gets one info diagnostic
naming it (:func:`unknown_fields`), so nothing passes unseen. The docs table of
`docs/dflash.md` is generated from :data:`CHECKPOINT_FIELDS` (`tools/gen_docs.py`).

:func:`dflash_recipes.compiler.field_checks.check_checkpoint_fields` holds the checks the
inventory calls for beyond what `hfconfig` reads: refusals (`hidden_act`, causal blocks, attention
biases, DFlash 2 modules under another projector type),
`max_position_embeddings` below the training length, and config values that contradict the
safetensors header. Pure data, no torch: it runs in `compile`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import attrs

from dflash_recipes.records import Record

FieldStatus = Literal["honored", "refused", "compared", "irrelevant"]


@attrs.frozen(repr=False, eq=False, slots=False)
class CheckpointField(Record):
    """One config.json field: where it is (dotted), what dflash-recipes does with it, and why."""

    #: `hidden_act`, `dflash_config.is_causal`, ...
    key: str
    status: FieldStatus
    reason: str


def _f(key: str, status: FieldStatus, reason: str) -> CheckpointField:
    return CheckpointField(key=key, status=status, reason=reason)


_DC = "dflash_config."

#: DFlash fields read from `dflash_config` first and from the top level as a fallback (older
#: exports write them flat): one entry each place.
_NESTED_WITH_FLAT_FALLBACK: tuple[CheckpointField, ...] = (
    _f(
        "block_size",
        "compared",
        "info `checkpoint-block-size-differs` when the recipe's dflash_block_size differs "
        "(allowed: the weights do not depend on the block size)",
    ),
    _f(
        "mask_token_id",
        "honored",
        "taken as dflash_mask_token_id when the recipe sets none; a different recipe value "
        "warns (`checkpoint-mask-differs`)",
    ),
    _f(
        "target_layer_ids",
        "honored",
        "taken as the taps when the recipe sets none; different recipe taps warn "
        "(`checkpoint-taps-differ`)",
    ),
    _f(
        "num_target_layers",
        "compared",
        "warning `checkpoint-target-differs` when it is not the base model's layer count",
    ),
    _f(
        "projector_type",
        "compared",
        "the head variant; a layout mismatch names it as the fix",
    ),
    _f(
        "emb_dim",
        "compared",
        "Domino head width; the tensors decide, a layout mismatch names it as the fix",
    ),
    _f(
        "gru_hidden_dim",
        "compared",
        "Domino GRU width; the tensors decide, a layout mismatch names it as the fix",
    ),
    _f(
        "markov_rank",
        "compared",
        "DSpark rank; the tensors decide, a layout mismatch names it as the fix",
    ),
    _f(
        "use_confidence_head",
        "compared",
        "DSpark confidence head; the tensors decide (confidence_proj present or not)",
    ),
    _f(
        "attention_sink_bias",
        "compared",
        "the sink flag vLLM and SGLang read; the tensors decide "
        "(layers.{i}.self_attn.attention_sink_bias present or not)",
    ),
    _f(
        "attention_sink",
        "compared",
        "the sink flag under its old name (dflash-recipes exports before 0.2); read when "
        "attention_sink_bias is absent; the tensors decide",
    ),
    _f(
        "target_hidden_size",
        "compared",
        "width of each tapped target state (fc.weight takes n_taps * target_hidden_size); "
        "warning `checkpoint-config-contradicts-header` when the fc width says otherwise",
    ),
)

#: The `dflash_config` keys only DFlash 2 drafters have (the recipe fields of the same names).
_DFLASH2_FIELDS: tuple[str, ...] = (
    "conv_group_size",
    "conv_kernel_size",
    "final_logit_softcapping",
    "input_embedding_scale",
    "output_multiplier",
    "selector_rank",
    "selector_top_k",
)
_DFLASH2_TENSOR_MARKERS: tuple[str, ...] = ("attention_conv", "mlp_conv", "candidate_selector")

_REFUSED_CAUSAL = (
    "true makes the draft blocks causal; dflash-recipes trains non-causal blocks, so the error "
    "`checkpoint-field-refused` stops the compile (a DFlash 2 checkpoint with sliding layers "
    "that does not state false warns: `checkpoint-causal-unstated`)"
)

#: Every field, in docs order: top level first, then `dflash_config`.
CHECKPOINT_FIELDS: tuple[CheckpointField, ...] = (
    # -- identity and loading ---------------------------------------------------------------
    _f(
        "architectures",
        "compared",
        "engines pick the model class from it; a DFlash 2 class name (`DFlash2DraftModel`) "
        "under a projector_type other than dflash2 is the error `checkpoint-dflash2`; "
        "otherwise the tensors decide the layout",
    ),
    _f("model_type", "irrelevant", "the export always writes qwen3; the tensors decide"),
    _f(
        "auto_map",
        "irrelevant",
        "names the remote code for AutoModel; the export writes its own",
    ),
    _f("transformers_version", "irrelevant", "bookkeeping of the writer"),
    _f("_name_or_path", "irrelevant", "bookkeeping of the writer"),
    _f(
        "dtype",
        "irrelevant",
        "the stored dtype; the header's dtypes are what is loaded, the plan's dtype is trained",
    ),
    _f("torch_dtype", "irrelevant", "older spelling of dtype"),
    _f(
        "text_config",
        "honored",
        "a multimodal config's language model: its fields are read before the top level",
    ),
    # -- draft dimensions -------------------------------------------------------------------
    _f(
        "hidden_size",
        "compared",
        "must equal the base model's (error `hidden-size-mismatch`); warning "
        "`checkpoint-config-contradicts-header` when the tensors are another width",
    ),
    _f(
        "num_hidden_layers",
        "compared",
        "draft layers: the recipe's dims are checked against the tensors; warning when the "
        "tensors hold another count",
    ),
    _f(
        "num_attention_heads",
        "compared",
        "checked through the q_proj shape; warning when the tensors say otherwise",
    ),
    _f(
        "num_key_value_heads",
        "compared",
        "checked through the k_proj/v_proj shapes; warning when the tensors say otherwise",
    ),
    _f(
        "head_dim",
        "compared",
        "checked through the q_norm/k_norm shapes; warning when the tensors say otherwise",
    ),
    _f(
        "intermediate_size",
        "compared",
        "checked through the MLP shapes; warning when the tensors say otherwise",
    ),
    _f(
        "vocab_size",
        "compared",
        "warning `checkpoint-target-differs` when it is not the base model's; warning when a "
        "head's vocabulary-sized tensor says otherwise",
    ),
    _f(
        "draft_vocab_size",
        "refused",
        "a reduced draft vocabulary (vLLM's draft-to-target map) is not trained here: a value "
        "other than vocab_size is refused",
    ),
    _f(
        "rms_norm_eps",
        "honored",
        "taken as rms_norm_eps when the recipe sets none (info `rms-norm-eps-from-checkpoint`); "
        "a different recipe value warns (`checkpoint-rms-norm-eps-differs`)",
    ),
    # -- what the layers compute ------------------------------------------------------------
    _f(
        "hidden_act",
        "refused",
        "the MLP is SwiGLU with SiLU; any other activation is refused",
    ),
    _f(
        "attention_bias",
        "refused",
        "true adds q/k/v/o biases, which the drafter does not have: refused",
    ),
    _f(
        "attention_dropout",
        "irrelevant",
        "dropout is off at inference, and dflash-recipes fine-tunes without attention dropout",
    ),
    _f("is_causal", "refused", _REFUSED_CAUSAL),
    _f(
        "is_neox_style",
        "refused",
        "false means interleaved RoPE; the drafter uses the neox (rotate-half) layout, so "
        "false is refused",
    ),
    _f(
        "logit_scale",
        "refused",
        "vLLM scales the draft logits by it; the drafter uses the target's lm_head unscaled, "
        "so a value other than 1 is refused",
    ),
    _f(
        "use_aux_hidden_state",
        "refused",
        "false drops the fc fusion of tapped target states; DFlash always fuses them, so false "
        "is refused",
    ),
    _f(
        "quantization_config",
        "refused",
        "a quantized drafter cannot be fine-tuned here; warm-start from the unquantized release",
    ),
    _f(
        "layer_types",
        "honored",
        "full_attention or sliding_attention per draft layer; the plan carries it",
    ),
    _f(
        "sliding_window",
        "honored",
        "the window of sliding_attention layers; the plan carries it",
    ),
    _f(
        "use_sliding_window",
        "irrelevant",
        "transformers derives layer_types from it only when layer_types is absent; DFlash "
        "configs state layer_types",
    ),
    _f(
        "max_window_layers",
        "irrelevant",
        "as use_sliding_window: only a fallback for a missing layer_types",
    ),
    _f(
        "add_swa_attention_sink_bias",
        "compared",
        "vLLM's fallback sink flag (MiMo-style configs); the tensors decide",
    ),
    _f(
        "tie_word_embeddings",
        "irrelevant",
        "the drafter has no embeddings or lm_head of its own (it borrows the target's)",
    ),
    _f("initializer_range", "irrelevant", "only initialises weights the checkpoint replaces"),
    _f("use_cache", "irrelevant", "a generation default"),
    _f("bos_token_id", "irrelevant", "the target's tokenizer decides"),
    _f("eos_token_id", "irrelevant", "the target's tokenizer decides"),
    _f("pad_token_id", "irrelevant", "the target's tokenizer decides"),
    # -- positions --------------------------------------------------------------------------
    _f(
        "rope_theta",
        "compared",
        "warning `checkpoint-rope-differs` when it is not the base model's (the base model's "
        "is used)",
    ),
    _f(
        "rope_scaling",
        "compared",
        "RoPE type and parameters, compared with the base model's like rope_theta",
    ),
    _f(
        "rope_parameters",
        "compared",
        "transformers 5 spelling of rope_theta/rope_scaling, compared the same way",
    ),
    _f(
        "max_position_embeddings",
        "compared",
        "warning `checkpoint-positions-short` when it is below training.training_seq_len; the "
        "export writes the base model's",
    ),
    # -- taps an engine may read instead ----------------------------------------------------
    _f(
        "eagle_aux_hidden_state_layer_ids",
        "compared",
        "vLLM reads these taps in place of target_layer_ids: warning "
        "`checkpoint-field-differs` when present (the export does not write it)",
    ),
    # -- DFlash fields, nested and flat -----------------------------------------------------
    _f("dflash_config", "honored", "the section of the DFlash fields below"),
    *(attrs.evolve(field, key=_DC + field.key) for field in _NESTED_WITH_FLAT_FALLBACK),
    *(
        attrs.evolve(field, reason=f"flat fallback of dflash_config.{field.key}: {field.reason}")
        for field in _NESTED_WITH_FLAT_FALLBACK
    ),
    _f(_DC + "is_causal", "refused", _REFUSED_CAUSAL),
    _f(_DC + "causal", "refused", _REFUSED_CAUSAL),
    _f(
        _DC + "use_swa",
        "refused",
        "ModelOpt's all-layers sliding-window switch; true is refused: state the windows as "
        "layer_types and sliding_window",
    ),
    _f(
        _DC + "swa_window_size",
        "compared",
        "ModelOpt's window; vLLM prefers it over sliding_window: warning "
        "`checkpoint-field-differs` when the two differ",
    ),
    _f(
        _DC + "use_aux_hidden_state",
        "refused",
        "as the top-level use_aux_hidden_state: false is refused",
    ),
    _f(
        _DC + "shift_label",
        "compared",
        "head alignment: true (ModelOpt, SGLang) means block position k predicts the token at "
        "anchor + k + 1, false (earlier dflash-recipes exports) anchor + k; against the "
        "recipe's dflash_architecture_config.shift_label: warning `checkpoint-field-differs`, "
        "and false gets the note `checkpoint-trained-for`",
    ),
    _f(
        _DC + "pure_draft_prefix_len",
        "compared",
        "Domino: proposals at the block start left uncorrected; against the recipe's "
        "pure_draft_prefix_len: warning `checkpoint-field-differs` for another value",
    ),
    _f(
        _DC + "markov_head_type",
        "compared",
        "DSpark head kind (vanilla, gated, rnn); against the recipe's markov_head_type: warning "
        "`checkpoint-field-differs`; another kind is refused",
    ),
    *(
        _f(
            _DC + name,
            "compared",
            f"a DFlash 2 field: taken as dflash_architecture_config.{name} when the recipe sets "
            "none (info `kind-field-from-checkpoint`), a different recipe value is the error "
            "`checkpoint-kind-field-differs`; with a projector_type other than dflash2 the "
            "error `checkpoint-dflash2`",
        )
        for name in _DFLASH2_FIELDS
    ),
)

_BY_KEY: dict[str, CheckpointField] = {field.key: field for field in CHECKPOINT_FIELDS}


def field_entry(key: str) -> CheckpointField | None:
    """The inventory entry of a dotted config.json key, or None."""
    return _BY_KEY.get(key)


def unknown_fields(config: Mapping[str, object]) -> list[str]:
    """Dotted keys of `config` (top level and `dflash_config`) that no entry covers, sorted.

    The inside of `text_config`, `rope_parameters`, `rope_scaling`, `quantization_config`
    and `auto_map` is not enumerated: those entries cover the section as a whole.
    """
    found = [key for key in config if key not in _BY_KEY]
    nested = config.get("dflash_config")
    if isinstance(nested, Mapping):
        found += [_DC + key for key in nested if _DC + key not in _BY_KEY]
    return sorted(found)


# ---------------------------------------------------------------------------------------------
# the checks
# ---------------------------------------------------------------------------------------------


__all__ = [
    "CHECKPOINT_FIELDS",
    "CheckpointField",
    "FieldStatus",
    "field_entry",
    "unknown_fields",
]
