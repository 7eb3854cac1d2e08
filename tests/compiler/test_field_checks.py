"""The checkpoint field inventory (dflash_recipes/fields.py) and the checks it drives (issue 11).

One test per row of the issue's table of config.json edits that compiled silently before, the
refusals and warnings of the inventory, and an enumeration proving every field the code reads
has an inventory entry.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import pytest
from testkit.checkpoint_fields import compile_with_config, nested
from testkit.compiling import only
from testkit.st_fixtures import drafter_config, drafter_tensors, write_drafter_checkpoint

from dflash_recipes.checkpoint.config_fields import CHECKPOINT_FIELDS
from dflash_recipes.checkpoint.hfconfig import checkpoint_config_from_mapping
from dflash_recipes.compiler.compilation import CompileResult, compile_recipe
from dflash_recipes.compiler.field_checks import HeadAlignment, check_checkpoint_fields
from dflash_recipes.diagnostics import Severity, registered_codes
from dflash_recipes.recipe.sections import Recipe

RecipeFactory = Callable[..., Recipe]
REGISTERED_SEVERITY = {info.code: info.severity for info in registered_codes()}


def not_info(result: CompileResult) -> list[str]:
    return [d.code for d in result.diagnostics if d.severity is not Severity.INFO]


# ---------------------------------------------------------------------------------------------
# the table, one row each (each compiled with 0 errors and 0 warnings before)
# ---------------------------------------------------------------------------------------------


def test_the_untouched_tiny_checkpoint_compiles_without_findings(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    result = compile_with_config(tmp_path, make_recipe, lambda c: None)
    assert result.ok and not_info(result) == []
    assert "checkpoint-field-unknown" not in {d.code for d in result.diagnostics}


def test_hidden_act_gelu_is_refused(tmp_path: Path, make_recipe: RecipeFactory) -> None:
    result = compile_with_config(tmp_path, make_recipe, lambda c: c.update(hidden_act="gelu"))
    assert not result.ok
    d = only(result, "checkpoint-field-refused")
    assert d.severity is Severity.ERROR and d.path == "dflash.dflash_init_checkpoint"
    assert "`hidden_act: gelu`" in d.message and "SwiGLU (SiLU)" in d.message
    assert "config.json" in d.message
    assert "hidden_act silu" in (d.hint or "")


def test_is_causal_true_is_refused(tmp_path: Path, make_recipe: RecipeFactory) -> None:
    result = compile_with_config(tmp_path, make_recipe, lambda c: nested(c).update(is_causal=True))
    assert not result.ok
    d = only(result, "checkpoint-field-refused")
    assert "`dflash_config.is_causal: true`" in d.message
    assert "DFlash 1" in d.message and "bidirectional" in d.message
    assert "non-causal" in (d.hint or "")


@pytest.mark.parametrize(
    "edit",
    [
        lambda c: c.update(is_causal=True),
        lambda c: nested(c).update(causal=True),
    ],
    ids=["top-level is_causal", "dflash_config.causal"],
)
def test_the_other_causal_spellings_are_refused_too(
    tmp_path: Path, make_recipe: RecipeFactory, edit: Callable[[dict[str, Any]], None]
) -> None:
    result = compile_with_config(tmp_path, make_recipe, edit)
    assert only(result, "checkpoint-field-refused").severity is Severity.ERROR


def test_causal_false_is_accepted(tmp_path: Path, make_recipe: RecipeFactory) -> None:
    result = compile_with_config(
        tmp_path, make_recipe, lambda c: nested(c).update(causal=False, is_causal=False)
    )
    assert result.ok and not_info(result) == []


def test_max_position_embeddings_below_the_training_length_warns(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    result = compile_with_config(
        tmp_path,
        make_recipe,
        lambda c: c.update(max_position_embeddings=2048),
        training={"training_seq_len": 4096},
    )
    assert result.ok
    d = only(result, "checkpoint-positions-short")
    assert d.severity is Severity.WARNING and d.path == "training.training_seq_len"
    assert "`max_position_embeddings: 2048`" in d.message and "4096" in d.message
    assert "training.training_seq_len: 2048" in (d.hint or "")


def test_max_position_embeddings_at_the_training_length_is_quiet(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    result = compile_with_config(
        tmp_path,
        make_recipe,
        lambda c: c.update(max_position_embeddings=2048),
        training={"training_seq_len": 2048},
    )
    assert "checkpoint-positions-short" not in {d.code for d in result.diagnostics}


def test_target_hidden_size_contradicting_the_fc_width_warns(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    # the tiny fc.weight is [32, 64]: 2 taps of a 32-wide target; the config claims 16
    result = compile_with_config(tmp_path, make_recipe, lambda c: c.update(target_hidden_size=16))
    assert result.ok
    d = only(result, "checkpoint-config-contradicts-header")
    assert d.severity is Severity.WARNING
    assert "`target_hidden_size: 16` but fc.weight takes 64 inputs (32 per tap for 2 taps)" in (
        d.message
    )
    assert "re-export" in (d.hint or "")


def test_target_hidden_size_that_matches_is_quiet(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    result = compile_with_config(
        tmp_path, make_recipe, lambda c: nested(c).update(target_hidden_size=32)
    )
    assert result.ok and not_info(result) == []


def test_hidden_size_and_vocab_contradicting_the_header_warn(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    config = drafter_config(variant={"projector_type": "dspark", "markov_rank": 4})
    config["hidden_size"] = 64
    config["vocab_size"] = 300
    write_drafter_checkpoint(
        tmp_path / "drafter", projector_type="dspark", markov_rank=4, config=config
    )
    recipe = make_recipe(arch={"projector_type": "dspark", "markov_rank": 4})
    result = compile_recipe(recipe, base_dir=tmp_path)
    d = only(result, "checkpoint-config-contradicts-header")
    assert "`hidden_size: 64` but the tensors show 32" in d.message
    assert "`vocab_size: 300` but the tensors show 256" in d.message


# ---------------------------------------------------------------------------------------------
# the other refusals
# ---------------------------------------------------------------------------------------------


def test_attention_bias_true_is_refused(tmp_path: Path, make_recipe: RecipeFactory) -> None:
    result = compile_with_config(tmp_path, make_recipe, lambda c: c.update(attention_bias=True))
    d = only(result, "checkpoint-field-refused")
    assert "`attention_bias: true`" in d.message and "biases" in d.message
    assert "attention_bias false" in (d.hint or "")


def test_a_quantized_checkpoint_is_refused(tmp_path: Path, make_recipe: RecipeFactory) -> None:
    quantized = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    result = compile_with_config(
        tmp_path, make_recipe, lambda c: c.update(quantization_config=quantized)
    )
    d = only(result, "checkpoint-field-refused")
    assert "quantization_config" in d.message and "quantized drafter" in d.message
    assert "unquantized release" in (d.hint or "")


@pytest.mark.parametrize(
    ("tensor", "config_edit"),
    [
        ("layers.0.attention_conv.weight", None),
        ("layers.1.mlp_conv.weight", None),
        ("candidate_selector.weight", None),
        (None, {"conv_kernel_size": 2, "selector_rank": 4}),
        (None, {"final_logit_softcapping": 20.0}),
        (None, {"output_multiplier": 0.19611613513818404}),
    ],
    ids=[
        "attention_conv",
        "mlp_conv",
        "candidate_selector",
        "config fields",
        "softcapping",
        "output multiplier",
    ],
)
def test_a_dflash2_checkpoint_gets_one_error(
    tmp_path: Path,
    make_recipe: RecipeFactory,
    tensor: str | None,
    config_edit: Mapping[str, int] | None,
) -> None:
    config = drafter_config()
    nested(config).update(config_edit or {})
    nested(config)["is_causal"] = True  # DFlash 2 carries the flag: still one error only
    write_drafter_checkpoint(
        tmp_path / "drafter", config=config, extra={tensor: (32, 2)} if tensor else None
    )
    result = compile_recipe(make_recipe(), base_dir=tmp_path)
    assert not result.ok
    assert [d.code for d in result.errors] == ["checkpoint-dflash2"]
    d = result.errors[0]
    assert "this is a DFlash 2 checkpoint" in d.message
    assert "a drafter of the recipe's projector_type dflash cannot load" in d.message
    assert (tensor or f"dflash_config.{next(iter(config_edit or {}))}") in d.message
    assert "DFlash 1 drafter" in (d.hint or "")
    assert "set dflash.dflash_architecture_config.projector_type: dflash2" in (d.hint or "")


def test_use_swa_true_is_refused_with_the_layer_types_fix(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    result = compile_with_config(
        tmp_path, make_recipe, lambda c: nested(c).update(use_swa=True, swa_window_size=2048)
    )
    d = only(result, "checkpoint-field-refused")
    assert "`dflash_config.use_swa: true`" in d.message
    assert "layer_types" in (d.hint or "") and "sliding_window" in (d.hint or "")


# ---------------------------------------------------------------------------------------------
# unknown fields and the inventory itself
# ---------------------------------------------------------------------------------------------


def test_the_old_sink_key_still_loads_and_the_new_one_wins() -> None:
    old = drafter_config(variant={"attention_sink": True})
    assert checkpoint_config_from_mapping(old, "c").attention_sink is True
    both = drafter_config(variant={"attention_sink": True, "attention_sink_bias": False})
    assert checkpoint_config_from_mapping(both, "c").attention_sink is False


# ---------------------------------------------------------------------------------------------
# issue 25: Domino and DSpark as ModelOpt computes them (label shift, prefix, Markov head kinds)
# ---------------------------------------------------------------------------------------------

DOMINO_ARCH = {"projector_type": "domino", "emb_dim": 16, "gru_hidden_dim": 8}
#: What ModelOpt 0.47's DominoExporter writes (integration facts).
MODELOPT_DOMINO = {
    "projector_type": "domino",
    "shift_label": True,
    "pure_draft_prefix_len": 1,
    "gru_hidden_dim": 8,
    "emb_dim": 16,
}
MARKOV_TENSORS: dict[str, dict[str, list[int]]] = {
    "vanilla": {},
    "gated": {"gate_proj.weight": [4, 32 + 4], "gate_proj.bias": [4]},
    "rnn": {"joint_proj.weight": [12, 2 * 4 + 32], "joint_proj.bias": [12]},
}


def _warm_start(
    tmp_path: Path,
    make_recipe: RecipeFactory,
    variant: Mapping[str, Any],
    arch: Mapping[str, Any],
    **tensors: Any,
) -> CompileResult:
    config = drafter_config(variant=variant)
    if variant.get("projector_type") == "domino":
        config["emb_dim"] = variant["emb_dim"]
    write_drafter_checkpoint(tmp_path / "drafter", config=config, **tensors)
    return compile_recipe(make_recipe(arch=arch), base_dir=tmp_path)


def test_a_modelopt_domino_checkpoint_loads_every_tensor_without_a_warning(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    result = _warm_start(
        tmp_path,
        make_recipe,
        MODELOPT_DOMINO,
        DOMINO_ARCH,
        projector_type="domino",
        emb_dim=16,
        gru_hidden_dim=8,
    )
    assert result.ok and not_info(result) == [], result.diagnostics
    assert not any("misalign" in d.message for d in result.diagnostics)
    assert result.plan is not None and result.plan.init_checkpoint is not None
    assert result.plan.init_checkpoint.heads_from_scratch == ()
    assert result.plan.init_checkpoint.tensor_count == 25 + 4
    arch = result.plan.draft.architecture
    assert (arch.shift_label, arch.pure_draft_prefix_len) == (True, 1)


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_a_modelopt_dspark_checkpoint_loads_every_tensor_without_a_warning(
    tmp_path: Path, make_recipe: RecipeFactory, kind: str
) -> None:
    variant = {
        "projector_type": "dspark",
        "shift_label": True,
        "markov_rank": 4,
        "markov_head_type": kind,
        "use_confidence_head": True,
    }
    arch = {
        "projector_type": "dspark",
        "markov_rank": 4,
        "use_confidence_head": True,
        "markov_head_type": kind,
    }
    result = _warm_start(
        tmp_path,
        make_recipe,
        variant,
        arch,
        projector_type="dspark",
        markov_rank=4,
        use_confidence_head=True,
        extra=MARKOV_TENSORS[kind],
    )
    assert result.ok and not_info(result) == [], result.diagnostics
    assert result.plan is not None and result.plan.init_checkpoint is not None
    assert result.plan.init_checkpoint.tensor_count == 25 + 4 + len(MARKOV_TENSORS[kind])
    assert result.plan.draft.architecture.markov_head_type == kind


def test_another_markov_head_kind_in_the_checkpoint_warns_with_the_fix(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    variant = {"projector_type": "dspark", "shift_label": True, "markov_rank": 4}
    result = _warm_start(
        tmp_path,
        make_recipe,
        {**variant, "markov_head_type": "gated"},
        {"projector_type": "dspark", "markov_rank": 4},
        projector_type="dspark",
        markov_rank=4,
        extra=MARKOV_TENSORS["gated"],
    )
    d = only(result, "checkpoint-field-differs")
    assert d.path == "dflash.dflash_architecture_config.markov_head_type"
    assert "set dflash_architecture_config.markov_head_type: gated" in d.hint


def test_an_unknown_markov_head_kind_is_refused(tmp_path: Path, make_recipe: RecipeFactory) -> None:
    result = compile_with_config(
        tmp_path,
        make_recipe,
        lambda c: nested(c).update(projector_type="dspark", markov_head_type="fir"),
    )
    d = only(result, "checkpoint-field-refused")
    assert "`dflash_config.markov_head_type: fir`" in d.message
    assert "vanilla, gated, rnn" in d.message


def test_an_earlier_dflash_recipes_domino_export_loads_with_a_note_and_the_differences(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    """shift_label false and pure_draft_prefix_len 0: what this project exported before."""
    old = {**MODELOPT_DOMINO, "shift_label": False, "pure_draft_prefix_len": 0}
    tensors = {"projector_type": "domino", "emb_dim": 16, "gru_hidden_dim": 8}
    result = _warm_start(tmp_path, make_recipe, old, DOMINO_ARCH, **tensors)
    assert result.ok, result.diagnostics
    note = only(result, "checkpoint-trained-for")
    assert note.severity is Severity.INFO and "\n" not in note.message
    assert "trained with shift_label false" in note.message
    assert "position k predicts the token at anchor + k" in note.message
    assert "pure_draft_prefix_len 0" in note.message
    warned = {d.path: d for d in result.diagnostics if d.code == "checkpoint-field-differs"}
    assert set(warned) == {
        "dflash.dflash_architecture_config.shift_label",
        "dflash.dflash_architecture_config.pure_draft_prefix_len",
    }
    assert "starts misaligned" in warned["dflash.dflash_architecture_config.shift_label"].message
    assert (
        "set dflash_architecture_config.shift_label: false"
        in warned["dflash.dflash_architecture_config.shift_label"].hint
    )
    # The recipe can say it wants the checkpoint's alignment: then only the note remains.
    again = compile_recipe(
        make_recipe(arch={**DOMINO_ARCH, "shift_label": False, "pure_draft_prefix_len": 0}),
        base_dir=tmp_path,
    )
    assert again.ok and not_info(again) == [], again.diagnostics
    assert [d.code for d in again.diagnostics if d.code.startswith("checkpoint-")] == [
        "checkpoint-trained-for"
    ]
    assert again.plan is not None
    assert again.plan.resolved_draft().label_shift == 0


def test_a_modelopt_checkpoint_into_an_unshifted_recipe_is_warned_about(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    tensors = {"projector_type": "domino", "emb_dim": 16, "gru_hidden_dim": 8}
    result = _warm_start(
        tmp_path, make_recipe, MODELOPT_DOMINO, {**DOMINO_ARCH, "shift_label": False}, **tensors
    )
    d = only(result, "checkpoint-field-differs")
    assert "predicts anchor + k + 1 at block position k" in d.message
    assert "checkpoint-trained-for" not in [x.code for x in result.diagnostics]


# every refused and compared entry of the inventory has a case that fails without its rule
# ---------------------------------------------------------------------------------------------

_DOMINO = {"projector_type": "domino", "emb_dim": 16, "gru_hidden_dim": 8}
_QUANTIZED = {"quant_method": "fp8", "weight_block_size": [128, 128]}
_YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096}


@attrs.frozen
class FieldCase:
    """A config.json edit, the finding it must give (None: the tensors decide, no finding)."""

    edit: Mapping[str, object]
    code: str | None
    fragment: str = ""
    arch: Mapping[str, object] = attrs.field(factory=dict)
    #: the head tensors the checkpoint holds (its sizes, as `write_drafter_checkpoint` takes them)
    tensors: Mapping[str, object] = attrs.field(factory=dict)


def _case(edit: Mapping[str, object], code: str | None, fragment: str = "", **arch: Any) -> Any:
    return FieldCase(edit, code, fragment, arch)


def _head_case(edit: Mapping[str, object], code: str, fragment: str, **head: Any) -> Any:
    """A case for a head field: the recipe asks for the head and the checkpoint holds it."""
    return FieldCase(edit, code, fragment, head, head)


_REFUSED = "checkpoint-field-refused"
_HEADER = "checkpoint-config-contradicts-header"
_DIFFERS = "checkpoint-field-differs"
_DFLASH2 = "checkpoint-dflash2"

#: One case per refused or compared inventory key (dotted `dflash_config.` keys are nested).
FIELD_CASES: dict[str, FieldCase] = {
    "architectures": _case({"architectures": ["DFlash2DraftModel"]}, _DFLASH2, "architectures"),
    "hidden_size": _case({"hidden_size": 64}, _HEADER, "`hidden_size: 64` but the tensors show 32"),
    "num_hidden_layers": _case({"num_hidden_layers": 3}, _HEADER, "`num_hidden_layers: 3`"),
    "num_attention_heads": _case({"num_attention_heads": 8}, _HEADER, "`num_attention_heads: 8`"),
    "num_key_value_heads": _case({"num_key_value_heads": 4}, _HEADER, "`num_key_value_heads: 4`"),
    "head_dim": _case({"head_dim": 16}, _HEADER, "`head_dim: 16` but the tensors show 8"),
    "intermediate_size": _case({"intermediate_size": 96}, _HEADER, "`intermediate_size: 96`"),
    "vocab_size": _case({"vocab_size": 300}, "checkpoint-target-differs", "vocab_size 300"),
    "draft_vocab_size": _case({"draft_vocab_size": 128}, _REFUSED, "`draft_vocab_size: 128`"),
    "hidden_act": _case({"hidden_act": "gelu"}, _REFUSED, "`hidden_act: gelu`"),
    "attention_bias": _case({"attention_bias": True}, _REFUSED, "`attention_bias: true`"),
    "is_causal": _case({"is_causal": True}, _REFUSED, "`is_causal: true`"),
    "is_neox_style": _case({"is_neox_style": False}, _REFUSED, "`is_neox_style: false`"),
    "logit_scale": _case({"logit_scale": 2.0}, _REFUSED, "`logit_scale: 2.0`"),
    "use_aux_hidden_state": _case(
        {"use_aux_hidden_state": False}, _REFUSED, "`use_aux_hidden_state: false`"
    ),
    "quantization_config": _case(
        {"quantization_config": _QUANTIZED}, _REFUSED, "`quantization_config: {"
    ),
    "add_swa_attention_sink_bias": _case({"add_swa_attention_sink_bias": True}, None),
    "rope_theta": _case({"rope_theta": 10000.0}, "checkpoint-rope-differs", "10000.0"),
    "rope_scaling": _case({"rope_scaling": _YARN}, "checkpoint-rope-differs", "yarn"),
    "rope_parameters": _case(
        {"rope_parameters": {**_YARN, "rope_theta": 1_000_000.0}}, "checkpoint-rope-differs", "yarn"
    ),
    "max_position_embeddings": _case(
        {"max_position_embeddings": 1024},
        "checkpoint-positions-short",
        "`max_position_embeddings: 1024`",
    ),
    "eagle_aux_hidden_state_layer_ids": _case(
        {"eagle_aux_hidden_state_layer_ids": [2, 6]}, _DIFFERS, "`eagle_aux_hidden_state_layer_ids"
    ),
    "dflash_config.block_size": _case(
        {"block_size": 8, "dflash_config.block_size": 8}, "checkpoint-block-size-differs", "8"
    ),
    "dflash_config.num_target_layers": _case(
        {"num_target_layers": 12, "dflash_config.num_target_layers": 12},
        "checkpoint-target-differs",
        "num_target_layers 12",
    ),
    "dflash_config.target_hidden_size": _case(
        {"dflash_config.target_hidden_size": 16},
        _HEADER,
        "`dflash_config.target_hidden_size: 16` but fc.weight takes 64 inputs",
    ),
    "dflash_config.is_causal": _case(
        {"dflash_config.is_causal": True}, _REFUSED, "`dflash_config.is_causal: true`"
    ),
    "dflash_config.causal": _case(
        {"dflash_config.causal": True}, _REFUSED, "`dflash_config.causal: true`"
    ),
    "dflash_config.use_swa": _case(
        {"dflash_config.use_swa": True}, _REFUSED, "`dflash_config.use_swa: true`"
    ),
    "dflash_config.swa_window_size": _case(
        {"dflash_config.swa_window_size": 2048, "sliding_window": 1024},
        _DIFFERS,
        "`dflash_config.swa_window_size: 2048` differs from `sliding_window: 1024`",
    ),
    "dflash_config.use_aux_hidden_state": _case(
        {"dflash_config.use_aux_hidden_state": False},
        _REFUSED,
        "`dflash_config.use_aux_hidden_state: false`",
    ),
    "dflash_config.shift_label": _head_case(
        {"dflash_config.shift_label": False},
        _DIFFERS,
        "`dflash_config.shift_label: false`",
        **_DOMINO,
    ),
    "dflash_config.pure_draft_prefix_len": _head_case(
        {"dflash_config.pure_draft_prefix_len": 2},
        _DIFFERS,
        "`dflash_config.pure_draft_prefix_len: 2`",
        **_DOMINO,
    ),
    "dflash_config.markov_head_type": _case(
        {"dflash_config.markov_head_type": "fir"},
        _REFUSED,
        "`dflash_config.markov_head_type: fir`",
    ),
    **{
        f"dflash_config.{name}": _case({f"dflash_config.{name}": 2}, _DFLASH2, name)
        for name in (
            "conv_group_size",
            "conv_kernel_size",
            "final_logit_softcapping",
            "input_embedding_scale",
            "output_multiplier",
            "selector_rank",
            "selector_top_k",
        )
    },
    # The head and sink fields: the tensors decide, so a stale config.json value that
    # contradicts them changes nothing (a layout mismatch would name it as the fix).
    **{
        f"{prefix}{name}": _case({f"{prefix}{name}": value}, None)
        for prefix in ("", "dflash_config.")
        for name, value in (
            ("projector_type", "dspark"),
            ("emb_dim", 16),
            ("gru_hidden_dim", 8),
            ("markov_rank", 4),
            ("use_confidence_head", True),
            ("attention_sink_bias", True),
            ("attention_sink", True),
        )
    },
    # the flat fallbacks of the nested DFlash fields
    "block_size": _case({"block_size": 8}, "checkpoint-block-size-differs", "8"),
    "num_target_layers": _case(
        {"num_target_layers": 12},
        "checkpoint-target-differs",
        "num_target_layers 12",
    ),
    "target_hidden_size": _case(
        {"target_hidden_size": 16}, _HEADER, "`target_hidden_size: 16` but fc.weight takes 64"
    ),
}


def _apply(config: dict[str, Any], edit: Mapping[str, object]) -> None:
    for key, value in edit.items():
        top, _, inner = key.partition(".")
        if inner:
            nested(config)[inner] = value
        else:
            config[top] = value
            # a flat fallback is read only where the nested key is absent
            nested(config).pop(top, None)


def test_every_refused_and_compared_entry_has_a_case() -> None:
    guarded = {f.key for f in CHECKPOINT_FIELDS if f.status in ("refused", "compared")}
    assert set(FIELD_CASES) == guarded, (
        f"entries without a case: {sorted(guarded - set(FIELD_CASES))}; "
        f"cases without an entry: {sorted(set(FIELD_CASES) - guarded)}"
    )


@pytest.mark.parametrize("key", sorted(FIELD_CASES))
def test_each_refused_and_compared_entry_gives_its_finding(
    tmp_path: Path, make_recipe: RecipeFactory, key: str
) -> None:
    case = FIELD_CASES[key]
    result = compile_with_config(
        tmp_path,
        make_recipe,
        lambda c: _apply(c, case.edit),
        tensors=case.tensors,
        arch=case.arch or None,
    )
    found = [d for d in result.diagnostics if d.code == case.code]
    if case.code is None:
        # the tensors decide: the stale field neither refuses nor warns
        assert result.ok and not_info(result) == [], result.diagnostics
        return
    assert len(found) == 1, (case.code, [(d.code, d.message) for d in result.diagnostics])
    assert case.fragment in found[0].message, found[0].message
    if found[0].severity is Severity.ERROR:
        assert not result.ok
    assert REGISTERED_SEVERITY[case.code] is found[0].severity


GOLDEN = Path(__file__).with_name("field_findings.golden.json")


def _findings_text(tmp_path: Path, result: CompileResult, code: str) -> list[dict[str, str]]:
    return [
        {
            "severity": d.severity.value,
            "path": d.path or "",
            "message": d.message.replace(str(tmp_path), "<tmp>"),
            "hint": d.hint or "",
        }
        for d in result.diagnostics
        if d.code == code
    ]


def test_each_case_reads_exactly_as_the_pinned_text(
    tmp_path: Path, make_recipe: RecipeFactory, request: pytest.FixtureRequest
) -> None:
    """What a user reads for each inventory case: message and hint, word for word.

    The texts are pinned in field_findings.golden.json; after changing a message on purpose,
    rewrite it with `DFLASH_UPDATE_GOLDEN=1 python -m pytest -k pinned_text` and review the diff.
    """
    seen: dict[str, list[dict[str, str]]] = {}
    for key, case in sorted(FIELD_CASES.items()):
        if case.code is None:
            continue
        where = tmp_path / key  # a folder per case, beside the same base model and data
        where.mkdir()
        for shared in ("base", "train.jsonl"):
            (where / shared).symlink_to(tmp_path / shared)
        result = compile_with_config(
            where,
            make_recipe,
            lambda c, case=case: _apply(c, case.edit),
            tensors=case.tensors,
            arch=case.arch or None,
        )
        seen[key] = _findings_text(where, result, case.code)
    if os.environ.get("DFLASH_UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps(seen, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    pinned = json.loads(GOLDEN.read_text(encoding="utf-8"))
    for key in sorted(seen):
        assert seen[key] == pinned.get(key), key
    assert sorted(seen) == sorted(pinned)


def test_long_values_and_long_lists_are_shortened_in_messages(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    quantized = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation": "dynamic"}
    result = compile_with_config(
        tmp_path, make_recipe, lambda c: c.update(quantization_config=quantized)
    )
    shown = repr(quantized)[:57] + "..."
    assert f"`quantization_config: {shown}` marks a quantized drafter" in (
        only(result, "checkpoint-field-refused").message
    )


def test_a_dflash2_checkpoint_lists_four_names_then_counts_the_rest(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    config = drafter_config()
    extra = {f"layers.{i}.attention_conv.weight": (32, 2) for i in range(2)}
    extra |= {f"layers.{i}.mlp_conv.weight": (32, 2) for i in range(2)}
    extra["candidate_selector.weight"] = (32, 2)
    write_drafter_checkpoint(tmp_path / "drafter", config=config, extra=extra)
    d = only(compile_recipe(make_recipe(), base_dir=tmp_path), "checkpoint-dflash2")
    assert "it holds 5 DFlash 2 tensor(s) (" in d.message and ", ... (1 more));" in d.message
    assert sum(name in d.message for name in extra) == 4, d.message


def test_exactly_four_dflash2_names_are_all_listed(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    extra = {f"layers.{i}.attention_conv.weight": (32, 2) for i in range(4)}
    write_drafter_checkpoint(tmp_path / "drafter", config=drafter_config(), extra=extra)
    d = only(compile_recipe(make_recipe(), base_dir=tmp_path), "checkpoint-dflash2")
    listed = ", ".join(sorted(extra))
    assert f"it holds 4 DFlash 2 tensor(s) ({listed}); a drafter of" in d.message


def test_a_multimodal_config_is_read_through_text_config_first(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    def edit(config: dict[str, Any]) -> None:
        config["text_config"] = {"hidden_act": "gelu", "attention_bias": None}
        config["attention_bias"] = True  # the top level counts where text_config is silent

    result = compile_with_config(tmp_path, make_recipe, edit)
    refused = sorted(d.message for d in result.diagnostics if d.code == "checkpoint-field-refused")
    assert len(refused) == 2, refused
    assert "`attention_bias: true`" in refused[0]
    assert "`text_config.hidden_act: gelu`" in refused[1]


def test_a_dflash_config_that_is_not_an_object_is_read_as_empty() -> None:
    config = drafter_config()
    config["dflash_config"] = ["is_causal", True]
    findings = check_checkpoint_fields(
        config, None, where="c", training_seq_len=64, projector_type="domino"
    )
    assert [f.code for f in findings if f.code != "checkpoint-field-unknown"] == []


# ---------------------------------------------------------------------------------------------
# the inventory's checks called directly, word for word: boundaries and the head alignment
# ---------------------------------------------------------------------------------------------

SCENARIO_GOLDEN = Path(__file__).with_name("field_scenarios.golden.json")


@attrs.frozen
class Scenario:
    """Top-level config.json edits, `dflash_config` edits, the head the tensors hold, the
    recipe's projector and head alignment (None: drop the key)."""

    top: Mapping[str, object] = attrs.field(factory=dict)
    dc: Mapping[str, object] = attrs.field(factory=dict)
    head: Mapping[str, object] = attrs.field(factory=dict)
    projector: str = "dflash"
    alignment: Mapping[str, object] = attrs.field(factory=dict)
    extra_tensors: Mapping[str, tuple[int, ...]] = attrs.field(factory=dict)


_DOM = {"projector_type": "domino", "emb_dim": 16, "gru_hidden_dim": 8}
_DSP = {"projector_type": "dspark", "markov_rank": 4}

FIELD_SCENARIOS: dict[str, Scenario] = {
    "dflash2-tensor-and-field": Scenario(
        dc={"selector_top_k": 4}, extra_tensors={"candidate_selector.weight": (32, 2)}
    ),
    "dflash2-architectures-listed-first": Scenario(
        top={"architectures": ["DFlash2DraftModel"]}, dc={"conv_kernel_size": 3}
    ),
    "unknown-field": Scenario(top={"my_new_field": 1}),
    "swa-window-as-sliding-window": Scenario(
        top={"sliding_window": 2048}, dc={"swa_window_size": 2048}
    ),
    "swa-window-not-sliding-window": Scenario(
        top={"sliding_window": 2048}, dc={"swa_window_size": 1024}
    ),
    "plain-recipe-ignores-head-fields": Scenario(dc={"shift_label": False}),
    "domino-unshifted-prefix-0": Scenario(
        dc={"shift_label": False, "pure_draft_prefix_len": 0}, head=_DOM, projector="domino"
    ),
    "domino-unshifted-as-the-recipe": Scenario(
        dc={"shift_label": False, "pure_draft_prefix_len": 1},
        head=_DOM,
        projector="domino",
        alignment={"shift_label": False},
    ),
    "domino-shifted-into-unshifted-recipe": Scenario(
        dc={"shift_label": True}, head=_DOM, projector="domino", alignment={"shift_label": False}
    ),
    "dspark-ignores-a-prefix": Scenario(
        dc={"shift_label": False, "pure_draft_prefix_len": 0}, head=_DSP, projector="dspark"
    ),
    "dspark-head-kind-differs": Scenario(
        dc={"markov_head_type": "gated"}, head=_DSP, projector="dspark"
    ),
    "dspark-vanilla-head": Scenario(
        dc={"markov_head_type": "vanilla"}, head=_DSP, projector="dspark"
    ),
    "draft-vocab-is-the-vocab": Scenario(top={"draft_vocab_size": 256}),
    "draft-vocab-reduced": Scenario(top={"draft_vocab_size": 128}),
    "draft-vocab-without-vocab": Scenario(top={"draft_vocab_size": 256, "vocab_size": None}),
    "target-hidden-without-taps-divides": Scenario(
        dc={"target_layer_ids": None, "target_hidden_size": 32}
    ),
    "target-hidden-without-taps-not-a-divisor": Scenario(
        dc={"target_layer_ids": None, "target_hidden_size": 48}
    ),
    "target-hidden-zero": Scenario(dc={"target_hidden_size": 0}),
    "target-hidden-negative": Scenario(dc={"target_hidden_size": -32}),
    "target-hidden-one-without-taps": Scenario(
        dc={"target_layer_ids": None, "target_hidden_size": 1}
    ),
    "target-hidden-a-bool": Scenario(dc={"target_hidden_size": True}),
    "target-hidden-a-string": Scenario(dc={"target_hidden_size": "32"}),
    "target-hidden-zero-without-taps": Scenario(
        dc={"target_layer_ids": None, "target_hidden_size": 0}
    ),
    "two-header-contradictions": Scenario(top={"hidden_size": 64, "num_hidden_layers": 3}),
    "header-size-a-string": Scenario(top={"hidden_size": "32"}),
    "value-of-60-characters": Scenario(top={"quantization_config": {"quant_method": "q" * 40}}),
    "value-of-61-characters": Scenario(top={"quantization_config": {"quant_method": "q" * 41}}),
}


def _scenario_findings(scenario: Scenario) -> list[dict[str, str]]:
    config = drafter_config(variant=dict(scenario.head) or None)
    for key, value in scenario.top.items():
        config.pop(key) if value is None else config.__setitem__(key, value)
    for key, value in scenario.dc.items():
        section = nested(config)
        section.pop(key) if value is None else section.__setitem__(key, value)
    tensors = drafter_tensors(**scenario.head)  # type: ignore[arg-type]
    shapes = {name: tuple(shape) for name, (_, shape) in tensors.items()}
    shapes.update(scenario.extra_tensors)
    findings = check_checkpoint_fields(
        config,
        shapes,
        where="init checkpoint c/config.json",
        training_seq_len=64,
        projector_type=scenario.projector,
        alignment=HeadAlignment(**scenario.alignment),  # type: ignore[arg-type]
    )
    return [
        {
            "code": f.code,
            "severity": f.severity.value,
            "path": f.path,
            "text": f"{f.message} | {f.hint}",
        }
        for f in findings
    ]


@pytest.mark.parametrize("name", sorted(FIELD_SCENARIOS))
def test_each_field_scenario_reads_as_pinned(name: str) -> None:
    found = _scenario_findings(FIELD_SCENARIOS[name])
    pinned = (
        json.loads(SCENARIO_GOLDEN.read_text(encoding="utf-8")) if SCENARIO_GOLDEN.is_file() else {}
    )
    if os.environ.get("DFLASH_UPDATE_GOLDEN"):
        pinned[name] = found
        SCENARIO_GOLDEN.write_text(
            json.dumps(pinned, indent=1, sort_keys=True) + "\n", encoding="utf-8"
        )
    assert found == pinned.get(name)


def test_every_pinned_field_scenario_still_exists() -> None:
    pinned = json.loads(SCENARIO_GOLDEN.read_text(encoding="utf-8"))
    assert sorted(pinned) == sorted(FIELD_SCENARIOS)
