"""Known checkpoint layouts: each rename of the table, no silent drop, clashes refused, and two
released layouts (z-lab/dflash's verbatim fixtures, rebuilt sparse) compiled end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
from testkit.compiling import RecipeFactory, codes, compile_in, only, text
from testkit.released_layouts import (
    DIMS,
    assistant_tensors,
    write_assistant_checkpoint,
    write_dflash2_checkpoint,
    write_target,
)
from testkit.st_fixtures import drafter_config, drafter_tensors, write_json, write_safetensors

from dflash_recipes.checkpoint.known_layouts import KNOWN_LAYOUTS, read_layout
from dflash_recipes.checkpoint.tensor_layout import LayoutSpec, expected_layout
from dflash_recipes.diagnostics import Severity
from dflash_recipes.recipe.sections import Recipe

ARCH = "dflash.dflash_architecture_config"
DSPARK = {"projector_type": "dspark", "markov_rank": 4, "use_confidence_head": True}
DSPARK_HEAD = (
    "markov_w1.weight",
    "markov_w2.weight",
    "confidence_proj.weight",
    "confidence_proj.bias",
)


# ---------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stored", "zlab", "layout"),
    [
        ("encoder.fc.weight", "fc.weight", "museglimmer-assistant"),
        ("encoder.output_norm_enc.weight", "hidden_norm.weight", "museglimmer-assistant"),
        ("markov_head.markov_w1.weight", "markov_w1.weight", "dspark-markov-head"),
        ("markov_head.markov_w2.weight", "markov_w2.weight", "dspark-markov-head"),
        ("markov_head.confidence_proj.weight", "confidence_proj.weight", "dspark-markov-head"),
        ("markov_head.confidence_proj.bias", "confidence_proj.bias", "dspark-markov-head"),
    ],
)
def test_each_rename_of_the_table(stored: str, zlab: str, layout: str) -> None:
    reading = read_layout([stored, "norm.weight"])
    assert reading.renamed == {stored: zlab}
    assert reading.layouts == (layout,)
    assert not reading.clashes


def test_z_lab_names_and_unknown_names_are_left_as_stored() -> None:
    names = [*expected_layout(_spec()), "encoder.other.weight", "markov_head.gate_proj.weight"]
    reading = read_layout(names)
    assert reading.renamed == {} and reading.layouts == () and not reading.clashes
    assert KNOWN_LAYOUTS[0].name == "z-lab" and not KNOWN_LAYOUTS[0].renames


@pytest.mark.parametrize(
    ("names", "target"),
    [
        (["fc.weight", "encoder.fc.weight"], "fc.weight"),
        (["markov_w1.weight", "markov_head.markov_w1.weight"], "markov_w1.weight"),
    ],
)
def test_two_tensors_for_one_parameter_are_a_clash(names: list[str], target: str) -> None:
    reading = read_layout(names)
    assert set(reading.clashes[target]) == set(names)
    assert reading.renamed == {}
    assert f"{target}: stored as {' and '.join(sorted(names))}" in reading.format_clashes()


# ---------------------------------------------------------------------------------------------
# compiling against tiny checkpoints in each layout
# ---------------------------------------------------------------------------------------------


def _spec(**variant: object) -> LayoutSpec:
    return LayoutSpec(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        n_taps=2,
        vocab_size=256,
        **variant,  # type: ignore[arg-type]
    )


def _write_renamed(
    directory: Path,
    renames: dict[str, str],
    *,
    drop: tuple[str, ...] = (),
    **variant: object,
) -> Path:
    """A tiny drafter whose tensors are stored under `renames` (z-lab name -> stored name)."""
    tensors = drafter_tensors(**variant)  # type: ignore[arg-type]
    stored = {renames.get(n, n): spec for n, spec in tensors.items() if n not in drop}
    write_safetensors(directory / "model.safetensors", stored)
    write_json(directory / "config.json", drafter_config(variant=dict(variant) or None))
    return directory


MUSE = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}
NESTED_HEAD = {name: f"markov_head.{name}" for name in DSPARK_HEAD}


def test_a_tiny_museglimmer_layout_compiles_with_every_tensor_accounted_for(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    _write_renamed(tmp_path / "drafter", MUSE)
    result = compile_in(tmp_path, make_recipe())
    assert result.plan is not None, result.diagnostics
    assert result.plan.init_checkpoint is not None
    assert result.plan.init_checkpoint.tensor_count == 25
    info = only(result, "checkpoint-layout-renamed")
    assert info.severity is Severity.INFO
    assert "museglimmer-assistant" in info.message
    assert "encoder.fc.weight -> fc.weight" in info.message
    assert "encoder.output_norm_enc.weight -> hidden_norm.weight" in info.message


def test_an_unknown_extra_tensor_is_never_dropped(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    tensors = drafter_tensors()
    tensors["encoder.extra_gate.weight"] = ("BF16", (32,))
    write_safetensors(tmp_path / "drafter" / "model.safetensors", tensors)
    write_json(tmp_path / "drafter" / "config.json", drafter_config())
    result = compile_in(tmp_path, make_recipe())
    d = only(result, "checkpoint-layout-mismatch")
    assert "unexpected: encoder.extra_gate.weight" in d.message
    assert "known checkpoint layouts" in (d.hint or "")
    assert "z-lab, museglimmer-assistant, dspark-markov-head" in (d.hint or "")


def test_a_clash_is_one_error_naming_both_tensors(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    tensors = drafter_tensors()
    tensors["encoder.fc.weight"] = tensors["fc.weight"]
    write_safetensors(tmp_path / "drafter" / "model.safetensors", tensors)
    write_json(tmp_path / "drafter" / "config.json", drafter_config())
    result = compile_in(tmp_path, make_recipe())
    assert [d.code for d in result.errors] == ["checkpoint-name-clash"]
    d = result.errors[0]
    assert "fc.weight: stored as encoder.fc.weight and fc.weight" in d.message


def test_a_dspark_head_under_markov_head_warm_starts_whole(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    _write_renamed(tmp_path / "drafter", NESTED_HEAD, **DSPARK)
    result = compile_in(tmp_path, make_recipe(arch=DSPARK))
    assert result.plan is not None, result.diagnostics
    assert "heads-from-scratch" not in codes(result)
    assert "checkpoint-layout-mismatch" not in codes(result)
    assert result.plan.init_checkpoint is not None
    assert result.plan.init_checkpoint.heads_from_scratch == ()
    info = only(result, "checkpoint-layout-renamed")
    assert "dspark-markov-head" in info.message
    assert "markov_head.markov_w2.weight -> markov_w2.weight" in info.message


@pytest.mark.parametrize("renames", [NESTED_HEAD, {}], ids=["markov_head-names", "z-lab-names"])
def test_a_partly_present_head_is_an_error_under_either_naming(
    tmp_path: Path, make_recipe: RecipeFactory, renames: dict[str, str]
) -> None:
    _write_renamed(tmp_path / "drafter", renames, drop=("confidence_proj.bias",), **DSPARK)
    result = compile_in(tmp_path, make_recipe(arch=DSPARK))
    assert result.plan is None
    d = only(result, "head-partly-present")
    assert "confidence_proj: has confidence_proj.weight; lacks confidence_proj.bias" in d.message


# ---------------------------------------------------------------------------------------------
# the released layouts, rebuilt sparse behind a 52-layer, 6656-wide target
# ---------------------------------------------------------------------------------------------


def _released_recipe(make_recipe: RecipeFactory, **arch: object) -> Recipe:
    return make_recipe(init="released", model="target", arch={**DIMS, **arch})


def test_the_museglimmer_assistant_compiles_from_its_own_config(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    write_target(tmp_path / "target")
    write_assistant_checkpoint(tmp_path / "released")
    result = compile_in(tmp_path, _released_recipe(make_recipe))
    assert result.plan is not None, [(d.code, d.message) for d in result.diagnostics]
    assert not [d for d in result.diagnostics if d.severity is not Severity.INFO]
    plan = result.plan
    init = plan.init_checkpoint
    assert init is not None
    assert init.tensor_count == len(assistant_tensors()) == 58  # every tensor accounted for
    assert init.heads_from_scratch == ()
    assert (init.trained_block_size, init.mask_token_id) == (16, 201818)
    assert init.target_layer_ids == (1, 13, 25, 37, 49)
    draft = plan.draft
    assert draft.target_layer_ids == (1, 13, 25, 37, 49)
    assert draft.mask_token_id == 201818
    assert draft.block_size == 16
    assert draft.architecture.layer_types == ("sliding_attention",) * 5
    assert draft.architecture.sliding_window == 2048
    assert draft.architecture.rms_norm_eps == 1e-05
    said = codes(result)
    for code in (
        "checkpoint-layout-renamed",
        "taps-from-checkpoint",
        "mask-from-checkpoint",
        "layer-types-from-checkpoint",
        "rms-norm-eps-from-checkpoint",
    ):
        assert code in said, code
    assert "checkpoint-field-unknown" not in said


def test_the_museglimmer_assistant_with_a_stated_eps_it_contradicts_warns(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    write_target(tmp_path / "target")
    write_assistant_checkpoint(tmp_path / "released")
    result = compile_in(tmp_path, _released_recipe(make_recipe, rms_norm_eps=1e-6))
    d = only(result, "checkpoint-rms-norm-eps-differs")
    assert d.severity is Severity.WARNING and "rms_norm_eps: 1e-05" in (d.hint or "")
    assert result.plan is not None and result.plan.draft.architecture.rms_norm_eps == 1e-6


def test_the_released_dflash2_drafter_is_read_whole_under_projector_type_dflash2(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    # z-lab's verbatim Muse-Glimmer-30B-DFlash2 config and 81-tensor header: every tensor and
    # DFlash 2 field accounted for, the whole drafter warm-starts (nothing from scratch)
    write_target(tmp_path / "target")
    write_dflash2_checkpoint(tmp_path / "released")
    result = compile_in(tmp_path, _released_recipe(make_recipe, projector_type="dflash2"))
    assert [d.code for d in result.errors] == []
    assert result.plan is not None and result.plan.init_checkpoint is not None
    assert result.plan.init_checkpoint.tensor_count == 81
    assert result.plan.init_checkpoint.heads_from_scratch == ()
    assert not [d for d in result.diagnostics if d.severity is Severity.WARNING]
    taken = {
        d.path.rsplit(".", 1)[1]: d.message
        for d in result.diagnostics
        if d.code == "kind-field-from-checkpoint"
    }
    assert sorted(taken) == [
        "conv_group_size",
        "conv_kernel_size",
        "final_logit_softcapping",
        "output_multiplier",
        "selector_rank",
        "selector_top_k",
    ]
    assert "using the init checkpoint's 0.19611613513818404" in taken["output_multiplier"]
    said = codes(result)
    for code in ("taps-from-checkpoint", "mask-from-checkpoint", "layer-types-from-checkpoint"):
        assert code in said, code
    for code in (
        "checkpoint-dflash2",
        "checkpoint-layout-mismatch",
        "heads-from-scratch",
        "checkpoint-field-unknown",
        "checkpoint-causal-unstated",
    ):
        assert code not in said, code


def test_dflash2_is_still_refused_with_one_clear_error(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    write_target(tmp_path / "target")
    write_dflash2_checkpoint(tmp_path / "released")
    result = compile_in(tmp_path, _released_recipe(make_recipe))
    assert [d.code for d in result.errors] == ["checkpoint-dflash2"]
    d = result.errors[0]
    said = text(d)
    assert "this is a DFlash 2 checkpoint" in said
    assert "23 DFlash 2 tensor(s)" in said  # 3 candidate-selector + 5 layers x 4 conv tensors
    assert "architectures" in said and "dflash_config.conv_group_size" in said
    assert "cannot load its convolution and candidate-selector modules" in said
    assert "projector_type: dflash2" in said  # the fix for a recipe of another kind
    assert "Qwen3-8B" not in said  # no drafter for another target is suggested
    assert "trained for this base model" in said
    assert "checkpoint-layout-mismatch" not in codes(result)
