"""projector_type dflash2 at compile: its fields read from a DFlash 2 init checkpoint (an info
each) or the recipe, contradictions and unset fields refused with the fix, its rules, the
DFlash 1 warm start, the layout, the resource plan, and the ``<kind>-not-yet`` error a kind's
``trains = False`` gives (DFlash 2 trains in this version)."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
from testkit.compiling import RecipeFactory, codes, compile_in, only, text
from testkit.dflash2_fixtures import (
    TINY_DFLASH2,
    TINY_DFLASH2_EXTRA_PARAMETERS,
    dflash2_config,
    dflash2_tensors,
    write_tiny_dflash2_checkpoint,
)

from dflash_recipes.checkpoint.kinds import dflash2
from dflash_recipes.compiler.compilation import CompileResult, compile_recipe
from dflash_recipes.diagnostics import Severity
from dflash_recipes.plan.resources.estimate import estimate_resources

ARCH = "dflash.dflash_architecture_config"
D2 = {"projector_type": "dflash2"}


def _d2(tmp_path: Path, make_recipe: RecipeFactory, **arch: object) -> CompileResult:
    """A dflash2 recipe warm-starting the tiny DFlash 2 checkpoint at tmp_path/d2."""
    return compile_in(tmp_path, make_recipe(init="d2", arch={**D2, **arch}))


def _errors(result: CompileResult) -> list[str]:
    return [d.code for d in result.errors]


# -- the DFlash 2 checkpoint ---------------------------------------------------------------------


def test_a_dflash2_checkpoint_under_a_dflash2_recipe_compiles_with_every_tensor_accounted_for(
    tmp_path: Path, make_recipe: RecipeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_tiny_dflash2_checkpoint(tmp_path / "d2")
    result = _d2(tmp_path, make_recipe)
    assert _errors(result) == [] and result.plan is not None
    init = result.plan.init_checkpoint
    assert init is not None and init.heads_from_scratch == ()
    assert init.tensor_count == len(dflash2_tensors()) == 36  # backbone 25, conv 8, selector 3
    # a kind whose torch half is not registered ends its compile with one <kind>-not-yet error
    monkeypatch.setattr(dflash2.FACTS, "trains", False)
    result = _d2(tmp_path, make_recipe)
    assert _errors(result) == ["dflash2-not-yet"]
    not_yet = result.errors[0]
    assert not_yet.path == f"{ARCH}.projector_type"
    assert "the recipe and its init checkpoint are checked" in not_yet.message
    assert "cannot train DFlash 2 drafters yet" in not_yet.message
    assert "projector_type: dflash" in (not_yet.hint or "")
    # every tensor accounted for: no layout difference, no head from scratch, no unknown field
    said = codes(result)
    for code in (
        "checkpoint-dflash2",
        "checkpoint-layout-mismatch",
        "heads-from-scratch",
        "checkpoint-field-unknown",
    ):
        assert code not in said, code
    assert not [d for d in result.diagnostics if d.severity is Severity.WARNING]


def test_each_unset_dflash2_field_is_taken_from_the_checkpoint_with_one_info(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    write_tiny_dflash2_checkpoint(tmp_path / "d2", config=dflash2_config(output_multiplier=0.5))
    result = _d2(tmp_path, make_recipe, selector_top_k=4)  # set, and the same: no info
    taken = [d for d in result.diagnostics if d.code == "kind-field-from-checkpoint"]
    assert sorted(d.path.rsplit(".", 1)[1] for d in taken) == [
        "conv_group_size",
        "conv_kernel_size",
        "output_multiplier",
        "selector_rank",
    ]
    assert all(d.severity is Severity.INFO for d in taken)
    group = only_at(result, "kind-field-from-checkpoint", "conv_group_size")
    assert "conv_group_size not set: using the init checkpoint's 8 (dflash_config." in group.message
    assert group.hint == "set dflash_architecture_config.conv_group_size: 8 to pin it in the recipe"


def only_at(result: CompileResult, code: str, field: str):  # type: ignore[no-untyped-def]
    found = [d for d in result.diagnostics if d.code == code and d.path == f"{ARCH}.{field}"]
    assert len(found) == 1, [(d.code, d.path) for d in result.diagnostics]
    return found[0]


@pytest.mark.parametrize(
    ("field", "mine", "theirs"),
    [("selector_top_k", 8, "4"), ("output_multiplier", 0.25, "0.5")],
)
def test_a_recipe_value_the_checkpoint_contradicts_is_an_error_with_both_values(
    tmp_path: Path, make_recipe: RecipeFactory, field: str, mine: object, theirs: str
) -> None:
    write_tiny_dflash2_checkpoint(tmp_path / "d2", config=dflash2_config(output_multiplier=0.5))
    result = _d2(tmp_path, make_recipe, **{field: mine})
    d = only(result, "checkpoint-kind-field-differs")
    assert d.severity is Severity.ERROR and d.path == f"{ARCH}.{field}"
    assert f"{field} {mine!r} contradicts the init checkpoint's {theirs}" in d.message
    assert f"set dflash_architecture_config.{field}: {theirs}" in (d.hint or "")
    assert _errors(result) == ["checkpoint-kind-field-differs"]


def test_a_dflash2_checkpoint_under_another_kind_names_projector_type_dflash2(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    write_tiny_dflash2_checkpoint(tmp_path / "d2")
    result = compile_in(tmp_path, make_recipe(init="d2"))
    assert _errors(result) == ["checkpoint-dflash2"]
    d = result.errors[0]
    assert "a drafter of the recipe's projector_type dflash cannot load" in d.message
    assert "set dflash.dflash_architecture_config.projector_type: dflash2" in (d.hint or "")


def test_sliding_layers_without_is_causal_false_warn(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    config = dflash2_config()
    config["layer_types"] = ["sliding_attention"] * 2
    config["sliding_window"] = 64
    write_tiny_dflash2_checkpoint(tmp_path / "d2", config=config)
    assert "checkpoint-causal-unstated" not in codes(_d2(tmp_path, make_recipe))
    del config["is_causal"]
    write_tiny_dflash2_checkpoint(tmp_path / "d2", config=config)
    d = only(_d2(tmp_path, make_recipe), "checkpoint-causal-unstated")
    assert d.severity is Severity.WARNING
    assert "does not state `is_causal: false`" in d.message
    assert '"is_causal": false' in (d.hint or "")


def test_a_checkpoint_missing_a_selector_tensor_is_refused_as_a_partial_head(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    write_tiny_dflash2_checkpoint(tmp_path / "d2", drop=["candidate_selector.successor_codebook"])
    d = only(_d2(tmp_path, make_recipe), "head-partly-present")
    assert "candidate_selector: has" in d.message
    assert "lacks candidate_selector.successor_codebook" in d.message


def test_a_stated_field_the_tensors_contradict_is_a_layout_mismatch(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    write_tiny_dflash2_checkpoint(tmp_path / "d2", config=dflash2_config(selector_rank=8))
    d = only(_d2(tmp_path, make_recipe), "checkpoint-layout-mismatch")
    assert "candidate_selector.predecessor_codebook: recipe expects [256, 8]" in d.message


# -- the rules ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "said", "fix"),
    [
        (
            "conv_group_size",
            5,
            "conv_group_size 5 must divide the hidden size 32",
            "to a divisor of 32",
        ),
        (
            "conv_kernel_size",
            17,
            "conv_kernel_size 17 must be in 1..block_size (16)",
            "conv_kernel_size to at most 16",
        ),
        (
            "selector_top_k",
            257,
            "selector_top_k 257 must be in 1..vocab (256)",
            "selector_top_k to at most 256",
        ),
    ],
)
def test_each_rule_of_the_dflash2_fields(
    tmp_path: Path,
    make_recipe: RecipeFactory,
    field: str,
    value: int,
    said: str,
    fix: str,
) -> None:
    write_tiny_dflash2_checkpoint(tmp_path / "d2", config=dflash2_config(**{field: value}))
    result = _d2(tmp_path, make_recipe)
    d = only_at(result, "dflash2-setting-invalid", field)
    assert said in d.message and fix in (d.hint or "")
    # the same value set in the recipe over a DFlash 1 checkpoint breaks the same rule
    result = compile_in(tmp_path, make_recipe(arch={**D2, **TINY_DFLASH2, field: value}))
    assert said in only_at(result, "dflash2-setting-invalid", field).message


def test_a_value_of_the_wrong_type_in_the_checkpoint_is_refused(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    write_tiny_dflash2_checkpoint(tmp_path / "d2", config=dflash2_config(selector_top_k="16"))
    d = only_at(_d2(tmp_path, make_recipe), "dflash2-setting-invalid", "selector_top_k")
    assert "selector_top_k '16' must be a positive integer" in d.message


def test_the_config_problems_of_a_dflash_config_use_the_same_rules() -> None:
    good = dict(TINY_DFLASH2)
    assert dflash2.config_problems(good, hidden=32, vocab=256, block_size=16) == []
    assert dflash2.config_problems(
        {**good, "conv_group_size": 5}, hidden=32, vocab=256, block_size=16
    ) == ["conv_group_size 5 must divide the hidden size 32"]


# -- warm-starting from DFlash 1, and from scratch ------------------------------------------------


def test_a_dflash1_checkpoint_needs_the_dflash2_fields_in_the_recipe(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path
) -> None:
    result = compile_in(tmp_path, make_recipe(arch=D2))
    missing = [d for d in result.errors if d.code == "head-field-missing"]
    assert sorted(d.path.rsplit(".", 1)[1] for d in missing) == sorted(TINY_DFLASH2)
    d = only_at(result, "head-field-missing", "selector_rank")
    assert "does not state it (a DFlash 1 drafter warm-starts only the backbone)" in d.message
    assert d.hint == (
        "set dflash_architecture_config.selector_rank (the rank of DFlash 2's candidate-selector "
        "codebooks; releases use 256)"
    )


def test_a_dflash1_checkpoint_warm_starts_the_backbone_with_one_warning_naming_the_new_parts(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path
) -> None:
    result = compile_in(tmp_path, make_recipe(arch={**D2, **TINY_DFLASH2}))
    assert _errors(result) == []
    warnings = [d for d in result.diagnostics if d.severity is Severity.WARNING]
    assert [d.code for d in warnings] == ["heads-from-scratch"]
    said = text(warnings[0])
    assert "attention_conv, mlp_conv, candidate_selector are new" in said
    assert "identity convolutions and a zero successor codebook" in said
    assert "the drafter computes what the DFlash 1 checkpoint computes" in said
    assert "shift_label" not in said  # DFlash 2 has no label shift


def test_lint_of_a_dflash2_recipe_without_a_checkpoint_asks_for_each_field(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    recipe = make_recipe(init=None, arch=D2, dflash={"dflash_mask_token_id": 250})
    result = compile_recipe(recipe, base_dir=tmp_path, resolve=False)
    assert _errors(result) == ["head-field-missing"] * 4
    assert "there is no init checkpoint of this kind to take it from" in text(
        only_at(result, "head-field-missing", "conv_kernel_size")
    )


def test_a_dflash2_field_set_for_another_kind_is_unused(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path
) -> None:
    result = compile_in(tmp_path, make_recipe(arch={"selector_top_k": 16}))
    d = only(result, "head-field-unused")
    assert "belongs to projector_type dflash2" in d.message and result.ok


# -- the plan and the resource estimate ----------------------------------------------------------


def test_once_trained_the_plan_carries_the_fields_and_the_estimate_counts_them(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = compile_in(tmp_path, make_recipe())
    assert plain.plan is not None
    write_tiny_dflash2_checkpoint(tmp_path / "d2", config=dflash2_config(output_multiplier=0.5))
    monkeypatch.setattr(dflash2.FACTS, "trains", False)
    assert _errors(_d2(tmp_path, make_recipe)) == ["dflash2-not-yet"]
    monkeypatch.setattr(dflash2.FACTS, "trains", True)  # as this version ships it
    recipe = make_recipe(init="d2", arch=D2, dflash={"dflash_selector_loss_alpha": 0.1})
    result = compile_in(tmp_path, recipe)
    assert result.plan is not None, [(d.code, d.message) for d in result.diagnostics]
    arch = result.plan.draft.architecture
    assert (arch.projector_type, arch.conv_kernel_size, arch.conv_group_size) == ("dflash2", 2, 8)
    assert (arch.selector_rank, arch.selector_top_k) == (4, 4)
    assert arch.output_multiplier == 0.5 and arch.final_logit_softcapping is None
    objective = result.plan.draft.objective
    assert (objective.selector_loss_alpha, objective.selector_missing_gold) == (0.1, "skip")
    # the estimate counts DFlash 2's parameters: codebooks 2 x 256 x 4, convolutions, projection
    assert TINY_DFLASH2_EXTRA_PARAMETERS == 4736
    before, after = estimate_resources(plain.plan), estimate_resources(result.plan)
    extra = TINY_DFLASH2_EXTRA_PARAMETERS
    assert after.memory.drafter_weights - before.memory.drafter_weights == 4 * extra
    assert after.gradient_bytes - before.gradient_bytes == 4 * extra
    # two float32 moments per parameter and a step counter per tensor (2 layers x 4 + 3 new)
    assert after.memory.optimizer_states - before.memory.optimizer_states == 8 * extra + 4 * 11


def test_the_plan_fields_default_to_nothing_for_other_kinds(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path
) -> None:
    plan = compile_in(tmp_path, make_recipe()).plan
    assert plan is not None
    arch = plan.draft.architecture
    assert attrs.asdict(arch)["selector_rank"] is None and arch.conv_kernel_size is None
