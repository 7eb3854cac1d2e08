"""The checkpoint field inventory (dflash_recipes/fields.py) and the checks it drives (issue 11).

One test per row of the issue's table of config.json edits that compiled silently before, the
refusals and warnings of the inventory, and an enumeration proving every field the code reads
has an inventory entry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from testkit.checkpoint_fields import compile_with_config, nested
from testkit.compiling import only
from testkit.st_fixtures import drafter_config, write_drafter_checkpoint

from dflash_recipes.checkpoint.hfconfig import checkpoint_config_from_mapping
from dflash_recipes.compiler.compilation import CompileResult, compile_recipe
from dflash_recipes.diagnostics import Severity
from dflash_recipes.recipe.sections import Recipe

RecipeFactory = Callable[..., Recipe]


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
    assert "dflash-recipes trains DFlash 1 drafters" in d.message
    assert (tensor or f"dflash_config.{next(iter(config_edit or {}))}") in d.message
    assert "DFlash 1 drafter" in (d.hint or "")


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
