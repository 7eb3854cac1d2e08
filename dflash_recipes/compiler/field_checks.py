"""The checks the checkpoint field inventory drives: every config.json field refused, compared or
read.

The inventory itself (which fields exist and what each means) is
:mod:`dflash_recipes.checkpoint.config_fields`; this module turns a checkpoint's config.json
into findings against the recipe and the base model.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

import attrs

from dflash_recipes.checkpoint.config_fields import (
    _DC,
    _DFLASH2_FIELDS,
    _DFLASH2_TENSOR_MARKERS,
    unknown_fields,
)
from dflash_recipes.checkpoint.kinds.registry import kind_facts
from dflash_recipes.checkpoint.tensor_layout import infer_architecture
from dflash_recipes.diagnostics import Severity, code_severity, register_code
from dflash_recipes.recipe.choices import MARKOV_HEAD_TYPES
from dflash_recipes.records import Record

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
    "the init checkpoint is a DFlash 2 drafter and the recipe's projector_type is not dflash2",
)


CHECKPOINT_CAUSAL_UNSTATED = "checkpoint-causal-unstated"  # registered in compiler/codes.py

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


CHECKPOINT_TRAINED_FOR = register_code(
    "checkpoint-trained-for",
    Severity.INFO,
    "the init checkpoint's head was trained with shift_label false (an earlier dflash-recipes "
    "export): what it was trained for",
)


_INIT = "dflash.dflash_init_checkpoint"
ARCH = "dflash.dflash_architecture_config"


@attrs.frozen(repr=False, eq=False, slots=False)
class HeadAlignment(Record):
    """What the recipe's Domino/DSpark head computes (dflash_architecture_config's fields)."""

    shift_label: bool = True
    pure_draft_prefix_len: int = 1
    markov_head_type: str = "vanilla"


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
        if head is not None and head[0] not in MARKOV_HEAD_TYPES:
            self.refuse(
                head[1],
                head[0],
                "asks for a DSpark Markov head dflash-recipes does not implement (it computes "
                f"{', '.join(MARKOV_HEAD_TYPES)} as ModelOpt does)",
                "warm-start from a DSpark drafter with one of those heads, or a plain DFlash one",
            )

    def causal_stated(self) -> None:
        """A DFlash 2 checkpoint with sliding layers states ``is_causal: false`` (engines make
        its sliding layers causal otherwise, the blocks it was trained on non-causal)."""
        types = _stated(self.config, "layer_types")
        sliding = (
            types is not None and isinstance(types[0], list) and "sliding_attention" in types[0]
        )
        causal = _stated(self.config, "is_causal")
        if not sliding or (causal is not None and causal[0] is False):
            return
        self.add(
            CHECKPOINT_CAUSAL_UNSTATED,
            Severity.WARNING,
            _INIT,
            "this DFlash 2 checkpoint has sliding_attention layers but its config.json does not "
            "state `is_causal: false`: z-lab, vLLM and SGLang then run those layers causal "
            "inside the block, while dflash-recipes trains and evaluates non-causal blocks",
            "check how the drafter was trained (every release states is_causal: false) and add "
            '`"is_causal": false` to its config.json if its blocks are non-causal',
        )

    def differences(self, projector_type: str, alignment: HeadAlignment) -> None:
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
        # The head's alignment fields (shift_label, Domino's prefix, DSpark's head kind) are
        # its kind's rules.
        kind = kind_facts(projector_type)
        for finding in kind.checkpoint_findings(_nested(config), alignment):
            severity = code_severity(finding.code)
            self.add(
                finding.code, severity, f"{ARCH}.{finding.field}", finding.message, finding.hint
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
                f"`{found[1]}: {_json_typed(found[0])}` but the tensors show {shown[key]}"
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
                    f"`{target_hidden[1]}: {_json_typed(value)}` but fc.weight takes {fc_in} "
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


def _json_typed(value: object) -> str:
    """`_json`, with a string quoted: a size given as the string "32" is not the number 32."""
    return json.dumps(value) if isinstance(value, str) else _json(value)


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
    alignment: HeadAlignment | None = None,
) -> list[FieldFinding]:
    """Every finding the inventory calls for on an init checkpoint's parsed config.json.

    `shapes` is the safetensors header (None when it could not be read); `where` names the
    config file in messages. A DFlash 2 checkpoint under a recipe of another projector type
    gives one `checkpoint-dflash2` error and nothing else; under a dflash2 recipe it is checked
    as any other (and for `is_causal: false` with sliding layers). Fields in no inventory entry
    give one `checkpoint-field-unknown` info.
    """
    checker = _Checker(config, where)
    tensors, fields = dflash2_markers(config, shapes or {})
    kind = kind_facts(projector_type)
    # a recipe whose kind reads every DFlash 2 field asks for a DFlash 2 drafter
    dflash2_recipe = set(_DFLASH2_FIELDS) <= set(kind.inherited_fields)
    if (tensors or fields) and not dflash2_recipe:
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
            f"a drafter of the recipe's projector_type {projector_type} cannot load its "
            "convolution and candidate-selector modules",
            f"set {ARCH}.projector_type: dflash2 to warm-start the DFlash 2 drafter it is; "
            "or warm-start from a DFlash 1 drafter trained for this base model (in one of the "
            "known checkpoint layouts of docs/dflash.md), or train without "
            "dflash_init_checkpoint",
        )
        return checker.findings
    if tensors or fields:
        checker.causal_stated()
    checker.refusals()
    checker.differences(projector_type, alignment or HeadAlignment())
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
