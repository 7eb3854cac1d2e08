"""Sliding-window drafter layers and rms_norm_eps at compile time: taken from the checkpoint like
the taps, compared when the recipe states them, and bad input rejected with one diagnostic each."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from testkit.compiling import (
    compile_in,
    only,
    recompile_after_checkpoint_without_drafter,
    text,
)
from testkit.st_fixtures import drafter_config, write_drafter_checkpoint

from dflash_recipes.compiler.compilation import compile_file
from dflash_recipes.diagnostics import Severity
from dflash_recipes.recipe.sections import Recipe

RecipeFactory = Callable[..., Recipe]
ARCH = "dflash.dflash_architecture_config"
SLIDING = ("sliding_attention", "full_attention")


def sliding_drafter(tmp_path: Path, window: int = 2048) -> Path:
    """`tmp_path/drafter` whose config.json says layer 0 is sliding with `window`."""
    config = drafter_config(target_layer_ids=[1, 5])
    config["layer_types"] = list(SLIDING)
    config["sliding_window"] = window
    config["use_sliding_window"] = True
    return write_drafter_checkpoint(tmp_path / "drafter", config=config)


def test_unset_layer_types_are_taken_from_the_checkpoint(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    sliding_drafter(tmp_path)
    result = compile_in(tmp_path, make_recipe())
    assert result.plan is not None, result.diagnostics
    arch = result.plan.draft.architecture
    assert (arch.layer_types, arch.sliding_window) == (SLIDING, 2048)
    spec = result.plan.resolved_draft()
    assert [spec.layer_window(i) for i in range(2)] == [2048, None]
    info = only(result, "layer-types-from-checkpoint")
    assert info.severity is Severity.INFO and info.path == f"{ARCH}.layer_types"
    assert "sliding_attention, full_attention" in info.message and "2048" in info.message
    assert "sliding_window: 2048" in info.hint


def test_recipe_layer_types_differing_from_the_checkpoint_warn_of_a_degraded_warm_start(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    sliding_drafter(tmp_path)
    recipe = make_recipe(arch={"layer_types": SLIDING, "sliding_window": 512})
    result = compile_in(tmp_path, recipe)
    assert result.plan is not None
    assert result.plan.draft.architecture.sliding_window == 512
    warning = only(result, "checkpoint-layer-types-differ")
    assert warning.severity is Severity.WARNING
    assert "degraded" in warning.message and "sliding_window 512" in warning.message
    assert "sliding_window: 2048" in warning.hint
    # full attention everywhere against a sliding checkpoint warns too
    full = make_recipe(arch={"layer_types": ("full_attention", "full_attention")})
    assert "sliding_attention" in text(
        only(compile_in(tmp_path, full), "checkpoint-layer-types-differ")
    )
    # the checkpoint's own values are quiet
    same = make_recipe(arch={"layer_types": SLIDING, "sliding_window": 2048})
    assert not [d for d in compile_in(tmp_path, same).diagnostics if "layer" in d.code]


def test_full_attention_checkpoint_keeps_full_attention(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path
) -> None:
    result = compile_in(tmp_path, make_recipe())
    assert result.plan is not None
    arch = result.plan.draft.architecture
    assert arch.sliding_window is None
    assert arch.layer_types in (None, ("full_attention", "full_attention"))


def test_layer_types_of_the_wrong_length_is_one_error_with_the_fix(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path
) -> None:
    recipe = make_recipe(arch={"layer_types": ("sliding_attention",), "sliding_window": 4})
    result = compile_in(tmp_path, recipe)
    assert result.plan is None
    error = only(result, "layer-types-length")
    assert error.path == f"{ARCH}.layer_types"
    assert "1 attention kinds" in error.message and "num_hidden_layers 2" in error.message
    assert "[sliding_attention, sliding_attention]" in error.hint


def test_sliding_layers_without_a_window_are_an_error(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path
) -> None:
    result = compile_in(tmp_path, make_recipe(arch={"layer_types": SLIDING}))
    error = only(result, "sliding-window-missing")
    assert error.path == f"{ARCH}.sliding_window"
    assert "set dflash_architecture_config.sliding_window" in error.hint


def test_unknown_layer_type_and_non_positive_window_are_reported_at_their_keys(
    tmp_path: Path,
    recipe_text: Callable[..., str],
    write_recipe: Callable[..., Path],
    drafter: Path,
) -> None:
    for arch, key, words in (
        ({"layer_types": ["full_attention", "local"]}, "layer_types", "layer_types[1] is 'local'"),
        ({"sliding_window": 0}, "sliding_window", "positive integer"),
        ({"sliding_window": -5}, "sliding_window", "positive integer"),
    ):
        result = compile_file(write_recipe(recipe_text(arch=arch)))
        assert result.plan is None
        (error,) = result.errors
        assert error.code == "invalid-value"
        assert error.path == f"{ARCH}.{key}"
        assert words in error.message
        assert error.hint and error.line is not None
        if key == "layer_types":
            assert "full_attention, sliding_attention" in error.message


def test_resume_keeps_the_windows_of_the_run_after_the_checkpoint_is_gone(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    drafter = sliding_drafter(tmp_path, window=64)
    recipe = make_recipe()
    result = recompile_after_checkpoint_without_drafter(tmp_path, recipe, drafter)
    assert result.plan is not None, result.diagnostics
    arch = result.plan.draft.architecture
    assert (arch.layer_types, arch.sliding_window) == (SLIDING, 64)
    assert "sliding_window 64" in only(result, "layer-types-from-previous-run").message


def test_checkpoint_with_sliding_layers_but_no_window_is_an_error_not_full_attention(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    config = drafter_config(target_layer_ids=[1, 5])
    config["layer_types"] = list(SLIDING)
    write_drafter_checkpoint(tmp_path / "drafter", config=config)
    result = compile_in(tmp_path, make_recipe())
    error = only(result, "sliding-window-missing")
    assert "from the init checkpoint" in error.message


def test_a_window_without_sliding_layers_is_a_warning(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path
) -> None:
    result = compile_in(tmp_path, make_recipe(arch={"sliding_window": 128}))
    assert result.plan is not None
    assert result.plan.draft.architecture.sliding_window is None
    warning = only(result, "sliding-window-unused")
    assert warning.path == f"{ARCH}.sliding_window" and "changes nothing" in warning.message


def test_unreadable_layer_types_in_the_checkpoint_are_named(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    config = drafter_config(target_layer_ids=[1, 5])
    config["layer_types"] = ["sliding_attention", "chunked_attention"]
    write_drafter_checkpoint(tmp_path / "drafter", config=config)
    result = compile_in(tmp_path, make_recipe())
    warning = only(result, "checkpoint-config-field")
    assert "`layer_types`" in warning.message and "chunked_attention" in warning.message


# ---------------------------------------------------------------------------------------------
# rms_norm_eps: unset -> the checkpoint's (info); stated and contradicted -> a warning
# ---------------------------------------------------------------------------------------------


def test_unset_rms_norm_eps_is_taken_from_the_checkpoint_with_an_info(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    write_drafter_checkpoint(tmp_path / "drafter", config=drafter_config(rms_norm_eps=1e-5))
    result = compile_in(tmp_path, make_recipe())
    assert result.plan is not None, result.diagnostics
    assert result.plan.draft.architecture.rms_norm_eps == 1e-5
    assert result.plan.resolved_draft().rms_norm_eps == 1e-5
    info = only(result, "rms-norm-eps-from-checkpoint")
    assert info.severity is Severity.INFO and info.path == f"{ARCH}.rms_norm_eps"
    assert "1e-05" in info.message and "rms_norm_eps: 1e-05" in info.hint
    assert "checkpoint-rms-norm-eps-differs" not in {d.code for d in result.diagnostics}


def test_a_recipe_eps_the_checkpoint_agrees_with_says_nothing(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    write_drafter_checkpoint(tmp_path / "drafter", config=drafter_config(rms_norm_eps=1e-5))
    result = compile_in(tmp_path, make_recipe(arch={"rms_norm_eps": 1e-5}))
    assert result.plan is not None
    assert not [d for d in result.diagnostics if "rms-norm-eps" in d.code]
    assert result.plan.draft.architecture.rms_norm_eps == 1e-5


def test_unset_rms_norm_eps_without_a_checkpoint_stating_one_is_the_default(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path
) -> None:
    config = drafter_config()
    del config["rms_norm_eps"]
    write_drafter_checkpoint(tmp_path / "drafter", config=config)
    for recipe in (make_recipe(), make_recipe(init=None, dflash={"dflash_mask_token_id": 250})):
        result = compile_in(tmp_path, recipe)
        assert result.plan is not None, result.diagnostics
        assert result.plan.draft.architecture.rms_norm_eps == 1e-6
        assert not [d for d in result.diagnostics if "rms-norm-eps" in d.code]


def test_resume_keeps_the_eps_of_the_run_after_the_checkpoint_is_gone(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    drafter = write_drafter_checkpoint(
        tmp_path / "drafter", config=drafter_config(rms_norm_eps=1e-5)
    )
    recipe = make_recipe()
    result = recompile_after_checkpoint_without_drafter(tmp_path, recipe, drafter)
    assert result.plan is not None, result.diagnostics
    assert result.plan.draft.architecture.rms_norm_eps == 1e-5
    info = only(result, "rms-norm-eps-from-previous-run")
    assert info.severity is Severity.INFO and "1e-05" in info.message


def test_unset_num_hidden_layers_is_one_error_not_also_a_layer_types_warning(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    write_drafter_checkpoint(tmp_path / "drafter")
    result = compile_in(tmp_path, make_recipe(arch={"num_hidden_layers": None}))
    assert [d.code for d in result.errors] == ["arch-dim-missing"]
    assert "checkpoint-layer-types-differ" not in {d.code for d in result.diagnostics}
