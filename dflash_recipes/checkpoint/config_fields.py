"""The inventory of drafter checkpoint `config.json` fields, and the checks it drives.

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

:func:`check_checkpoint_fields` holds the checks the inventory calls for beyond what
`hfconfig` reads: refusals (`hidden_act`, causal blocks, attention biases, DFlash 2 modules),
`max_position_embeddings` below the training length, and config values that contradict the
safetensors header. Pure data, no torch: it runs in `compile`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal

import attrs

from dflash_recipes.checkpoint.tensor_layout import infer_architecture
from dflash_recipes.diagnostics import Severity, register_code
from dflash_recipes.records import Record

FieldStatus = Literal["honored", "refused", "compared", "irrelevant"]

CHECKPOINT_FIELD_UNKNOWN = register_code(
    "checkpoint-field-unknown",
    Severity.INFO,
    "the init checkpoint's config.json has a field that no entry of the field inventory covers",
)
CHECKPOINT_FIELD_REFUSED = register_code(
    "checkpoint-field-refused",
    Severity.ERROR,
    "the init checkpoint's config.json asks for a computation dflash-recipes does not implement "
    "(another activation, causal blocks, attention biases, ...)",
)
CHECKPOINT_DFLASH2 = register_code(
    "checkpoint-dflash2",
    Severity.ERROR,
    "the init checkpoint is a DFlash 2 drafter; dflash-recipes trains DFlash 1 drafters",
)
CHECKPOINT_HEADER_CONTRADICTION = register_code(
    "checkpoint-config-contradicts-header",
    Severity.WARNING,
    "the init checkpoint's config.json states a size its safetensors header contradicts",
)
CHECKPOINT_POSITIONS_SHORT = register_code(
    "checkpoint-positions-short",
    Severity.WARNING,
    "the init checkpoint's max_position_embeddings is below training.training_seq_len",
)
CHECKPOINT_FIELD_DIFFERS = register_code(
    "checkpoint-field-differs",
    Severity.WARNING,
    "a field of the init checkpoint's config.json means another computation than the plan's "
    "(head alignment, taps an engine would read instead)",
)


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

_DFLASH2_FIELDS: tuple[str, ...] = (
    "conv_group_size",
    "conv_kernel_size",
    "selector_rank",
    "selector_top_k",
)
_DFLASH2_TENSOR_MARKERS: tuple[str, ...] = ("attention_conv", "mlp_conv", "candidate_selector")

_REFUSED_CAUSAL = (
    "true makes the draft blocks causal; dflash-recipes trains non-causal blocks (DFlash 1), "
    "so the error `checkpoint-field-refused` stops the compile"
)

#: Every field, in docs order: top level first, then `dflash_config`.
CHECKPOINT_FIELDS: tuple[CheckpointField, ...] = (
    # -- identity and loading ---------------------------------------------------------------
    _f(
        "architectures",
        "compared",
        "engines pick the model class from it; a DFlash 2 class name (`DFlash2DraftModel`) is "
        "the error `checkpoint-dflash2`; otherwise the tensors decide the layout",
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
        "compared",
        "warning `checkpoint-rms-norm-eps-differs` when the recipe's differs",
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
        "head alignment: false means block position k predicts the token at anchor + k (what "
        "dflash-recipes' Domino and DSpark heads compute); true (ModelOpt) means position k "
        "predicts anchor + k + 1: warning `checkpoint-field-differs`",
    ),
    _f(
        _DC + "pure_draft_prefix_len",
        "compared",
        "Domino: proposals at the block start left uncorrected; dflash-recipes corrects every "
        "proposal (0): warning `checkpoint-field-differs` for another value",
    ),
    _f(
        _DC + "markov_head_type",
        "refused",
        "DSpark head kind; only vanilla is implemented, gated and rnn are refused",
    ),
    *(
        _f(_DC + name, "refused", "a DFlash 2 field: the error `checkpoint-dflash2`")
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

_INIT = "dflash.dflash_init_checkpoint"


@attrs.frozen(repr=False, eq=False, slots=False)
class FieldFinding(Record):
    """One finding of :func:`check_checkpoint_fields`, at a dotted recipe path."""

    code: str
    severity: Severity
    path: str
    message: str
    hint: str


def _stated(config: Mapping[str, object], key: str) -> tuple[object, str] | None:
    """(value, dotted key) of `key`: `text_config` first, then the top level."""
    text = config.get("text_config")
    if isinstance(text, Mapping) and text.get(key) is not None:
        return text[key], f"text_config.{key}"
    if config.get(key) is not None:
        return config[key], key
    return None


def _nested(config: Mapping[str, object]) -> Mapping[str, object]:
    nested = config.get("dflash_config")
    return nested if isinstance(nested, Mapping) else {}


def _dflash_field(config: Mapping[str, object], key: str) -> tuple[object, str] | None:
    """(value, dotted key) of a DFlash field: `dflash_config` first, then the top level."""
    nested = _nested(config)
    if nested.get(key) is not None:
        return nested[key], _DC + key
    if config.get(key) is not None:
        return config[key], key
    return None


def dflash2_markers(
    config: Mapping[str, object], tensor_names: Iterable[str]
) -> tuple[list[str], list[str]]:
    """(DFlash 2 tensors, DFlash 2 config fields) found in a checkpoint; both empty for DFlash 1."""
    tensors = sorted(n for n in tensor_names if any(m in n for m in _DFLASH2_TENSOR_MARKERS))
    fields = [_DC + n for n in _DFLASH2_FIELDS if n in _nested(config)]
    architectures = config.get("architectures")
    if isinstance(architectures, list) and any(
        isinstance(a, str) and a.startswith("DFlash2") for a in architectures
    ):
        fields.insert(0, "architectures")
    return tensors, fields


def _names(items: list[str], limit: int = 4) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


class _Checker:
    def __init__(self, config: Mapping[str, object], where: str) -> None:
        self.config = config
        self.where = where
        self.findings: list[FieldFinding] = []

    def add(self, code: str, severity: Severity, path: str, message: str, hint: str) -> None:
        self.findings.append(FieldFinding(code, severity, path, f"{self.where}: {message}", hint))

    def refuse(self, key: str, value: object, why: str, fix: str) -> None:
        message = f"`{key}: {_json(value)}` {why}; dflash-recipes never ignores it"
        self.add(CHECKPOINT_FIELD_REFUSED, Severity.ERROR, _INIT, message, fix)

    def refusals(self) -> None:
        config = self.config
        act = _stated(config, "hidden_act")
        if act is not None and act[0] != "silu":
            self.refuse(
                act[1],
                act[0],
                "asks for another MLP activation than the SwiGLU (SiLU) the drafter computes",
                "warm-start from a drafter trained with hidden_act silu (every DFlash release), "
                "or train without dflash_init_checkpoint",
            )
        for found in (
            _stated(config, "is_causal"),
            _at(_nested(config), "is_causal"),
            _at(_nested(config), "causal"),
        ):
            if found is not None and found[0] is True:
                self.refuse(
                    found[1],
                    True,
                    "asks for causal attention inside the draft block; dflash-recipes trains "
                    "DFlash 1 drafters, whose blocks are bidirectional",
                    "warm-start from a non-causal DFlash 1 drafter (is_causal false or absent), "
                    "or train without dflash_init_checkpoint",
                )
        bias = _stated(config, "attention_bias")
        if bias is not None and bias[0] is True:
            self.refuse(
                bias[1],
                True,
                "asks for q/k/v/o projection biases, which the drafter does not have",
                "warm-start from a drafter without attention biases (attention_bias false, as "
                "every DFlash release), or train without dflash_init_checkpoint",
            )
        neox = _stated(config, "is_neox_style")
        if neox is not None and neox[0] is False:
            self.refuse(
                neox[1],
                False,
                "asks for interleaved RoPE; the drafter rotates in the neox (rotate-half) layout",
                "warm-start from a drafter trained with neox-style RoPE, or train from scratch",
            )
        scale = _stated(config, "logit_scale")
        if scale is not None and scale[0] != 1 and scale[0] != 1.0:
            self.refuse(
                scale[1],
                scale[0],
                "scales the draft logits; the drafter uses the target's lm_head unscaled",
                "warm-start from a drafter without logit_scale, or train from scratch",
            )
        for found in (
            _stated(config, "use_aux_hidden_state"),
            _at(_nested(config), "use_aux_hidden_state"),
        ):
            if found is not None and found[0] is False:
                self.refuse(
                    found[1],
                    False,
                    "drops the fc fusion of tapped target states that every DFlash drafter has",
                    "warm-start from a DFlash drafter with an fc layer, or train from scratch",
                )
        draft_vocab = _stated(config, "draft_vocab_size")
        vocab = _stated(config, "vocab_size")
        if draft_vocab is not None and (vocab is None or draft_vocab[0] != vocab[0]):
            self.refuse(
                draft_vocab[1],
                draft_vocab[0],
                "asks for a reduced draft vocabulary, which dflash-recipes does not train",
                "warm-start from a full-vocabulary drafter, or train from scratch",
            )
        quant = _stated(config, "quantization_config")
        if quant is not None:
            self.refuse(
                quant[1],
                quant[0],
                "marks a quantized drafter, which cannot be fine-tuned here",
                "warm-start from the unquantized release of the drafter",
            )
        swa = _at(_nested(config), "use_swa", _DC)
        if swa is not None and swa[0] is True:
            self.refuse(
                swa[1],
                True,
                "asks for sliding-window attention in every layer in ModelOpt's spelling",
                "state the windows as layer_types (one sliding_attention per layer) and "
                "sliding_window in config.json, or in the recipe's dflash_architecture_config",
            )
        head = _at(_nested(config), "markov_head_type")
        if head is not None and head[0] != "vanilla":
            self.refuse(
                head[1],
                head[0],
                "asks for a DSpark Markov head dflash-recipes does not implement (only vanilla)",
                "warm-start from a vanilla DSpark drafter or a plain DFlash drafter",
            )

    def differences(self, projector_type: str) -> None:
        config = self.config
        aux = _stated(config, "eagle_aux_hidden_state_layer_ids")
        if aux is not None:
            self.add(
                CHECKPOINT_FIELD_DIFFERS,
                Severity.WARNING,
                _INIT,
                f"`{aux[1]}: {_json(aux[0])}` is the list of taps vLLM reads in place of "
                "target_layer_ids; dflash-recipes trains with target_layer_ids and its export "
                "does not write this field",
                "check that both name the same target layers (vLLM's ids are target_layer_ids + 1)",
            )
        window = _at(_nested(config), "swa_window_size", _DC)
        sliding = _stated(config, "sliding_window")
        if window is not None and sliding is not None and window[0] != sliding[0]:
            self.add(
                CHECKPOINT_FIELD_DIFFERS,
                Severity.WARNING,
                _INIT,
                f"`{window[1]}: {_json(window[0])}` differs from `{sliding[1]}: "
                f"{_json(sliding[0])}`; vLLM uses the first, transformers and dflash-recipes the "
                "second",
                "correct config.json so both state the window the drafter was trained with",
            )
        if projector_type == "dflash":
            return
        shift = _at(_nested(config), "shift_label")
        if shift is not None and shift[0] is not False:
            self.add(
                CHECKPOINT_FIELD_DIFFERS,
                Severity.WARNING,
                "dflash.dflash_architecture_config.projector_type",
                f"`{shift[1]}: {_json(shift[0])}`: the checkpoint's head predicts the token "
                "after each block position (anchor + k + 1); dflash-recipes' heads predict "
                "anchor + k at position k, so the warm-started head starts misaligned",
                "warm-start the head from a checkpoint with shift_label false, or let it train "
                "from scratch from a plain DFlash checkpoint",
            )
        prefix = _at(_nested(config), "pure_draft_prefix_len")
        if projector_type == "domino" and prefix is not None and prefix[0] != 0:
            self.add(
                CHECKPOINT_FIELD_DIFFERS,
                Severity.WARNING,
                "dflash.dflash_architecture_config.projector_type",
                f"`{prefix[1]}: {_json(prefix[0])}`: the checkpoint's Domino head leaves the "
                "first proposals uncorrected; dflash-recipes' Domino corrects every proposal "
                "(pure_draft_prefix_len 0), so the warm-started head starts on positions it "
                "never learned",
                "expect the head to need more steps, or warm-start it from a checkpoint with "
                "pure_draft_prefix_len 0",
            )

    def positions(self, training_seq_len: int) -> None:
        found = _stated(self.config, "max_position_embeddings")
        if found is None or type(found[0]) is not int or found[0] >= training_seq_len:
            return
        self.add(
            CHECKPOINT_POSITIONS_SHORT,
            Severity.WARNING,
            "training.training_seq_len",
            f"`{found[1]}: {found[0]}` is below training.training_seq_len {training_seq_len}: "
            f"the drafter was built for positions below {found[0]} and will be trained on "
            "positions it never saw (the run and the export use the base model's limit)",
            f"set training.training_seq_len: {found[0]} or less, or accept that the warm "
            "start begins weaker on long sequences",
        )

    def header(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        shown = infer_architecture(shapes)
        contradictions: list[str] = []
        for key in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
        ):
            found = _stated(self.config, key)
            if found is None or key not in shown or found[0] == shown[key]:
                continue
            contradictions.append(
                f"`{found[1]}: {_json(found[0])}` but the tensors show {shown[key]}"
            )
        fc = shapes.get("fc.weight")
        target_hidden = _dflash_field(self.config, "target_hidden_size")
        taps = _dflash_field(self.config, "target_layer_ids")
        if fc is not None and len(fc) == 2 and target_hidden is not None:
            value = target_hidden[0]
            n_taps = len(taps[0]) if taps is not None and isinstance(taps[0], list) else None
            fc_in = fc[1]
            wrong = (
                type(value) is not int
                or value <= 0
                or (n_taps is not None and value * n_taps != fc_in)
                or (n_taps is None and fc_in % value != 0)
            )
            if wrong:
                per_tap = f" ({fc_in // n_taps} per tap for {n_taps} taps)" if n_taps else ""
                contradictions.append(
                    f"`{target_hidden[1]}: {_json(value)}` but fc.weight takes {fc_in} "
                    f"inputs{per_tap}"
                )
        if not contradictions:
            return
        self.add(
            CHECKPOINT_HEADER_CONTRADICTION,
            Severity.WARNING,
            _INIT,
            "config.json contradicts the safetensors header: "
            + "; ".join(contradictions)
            + ". The tensors are what loads; engines that size the model from config.json "
            "would build another drafter",
            "re-export the checkpoint, or correct config.json to the tensors' sizes",
        )


def _at(section: Mapping[str, object], key: str, prefix: str = _DC) -> tuple[object, str] | None:
    if section.get(key) is None:
        return None
    return section[key], prefix + key


def _json(value: object) -> str:
    if value is True:
        return "true"
    if value is False:
        return "false"
    if value is None:
        return "null"
    if isinstance(value, str):
        return value
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_checkpoint_fields(
    config: Mapping[str, object],
    shapes: Mapping[str, tuple[int, ...]] | None,
    *,
    where: str,
    training_seq_len: int,
    projector_type: str,
) -> list[FieldFinding]:
    """Every finding the inventory calls for on an init checkpoint's parsed config.json.

    `shapes` is the safetensors header (None when it could not be read); `where` names the
    config file in messages. A DFlash 2 checkpoint gives one `checkpoint-dflash2` error and
    nothing else. Fields in no inventory entry give one `checkpoint-field-unknown` info.
    """
    checker = _Checker(config, where)
    tensors, fields = dflash2_markers(config, shapes or {})
    if tensors or fields:
        found = []
        if tensors:
            found.append(f"{len(tensors)} DFlash 2 tensor(s) ({_names(tensors)})")
        if fields:
            found.append(f"DFlash 2 config field(s) {_names(fields)}")
        checker.add(
            CHECKPOINT_DFLASH2,
            Severity.ERROR,
            _INIT,
            "this is a DFlash 2 checkpoint: it holds " + " and ".join(found) + "; "
            "dflash-recipes trains DFlash 1 drafters and cannot load its convolution and "
            "candidate-selector modules",
            "warm-start from a DFlash 1 drafter (for example z-lab/Qwen3-8B-DFlash-b16), or "
            "train without dflash_init_checkpoint",
        )
        return checker.findings
    checker.refusals()
    checker.differences(projector_type)
    checker.positions(training_seq_len)
    if shapes is not None:
        checker.header(shapes)
    unknown = unknown_fields(config)
    if unknown:
        checker.add(
            CHECKPOINT_FIELD_UNKNOWN,
            Severity.INFO,
            _INIT,
            f"config.json has {len(unknown)} field(s) no entry of the checkpoint field "
            f"inventory covers: {', '.join(unknown)}; they are not read, so whatever they ask "
            "for is not trained or exported",
            "check what the field does in the drafter's model card; if it changes the "
            "computation, report it so the inventory can honor or refuse it",
        )
    return checker.findings


__all__ = [
    "CHECKPOINT_FIELDS",
    "CheckpointField",
    "FieldFinding",
    "FieldStatus",
    "check_checkpoint_fields",
    "dflash2_markers",
    "field_entry",
    "unknown_fields",
]
