"""The top-level `dflash_recipes` import: its `__all__`, typed use, and that it stays light."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import attrs
import jsonschema
import pytest

import dflash_recipes
from dflash_recipes import (
    CompileResult,
    DFlashArchitectureConfig,
    DFlashSection,
    ModelSection,
    Recipe,
    RecipeError,
    TrainingSection,
    compile_file,
    compile_recipe,
    load_recipe,
    load_recipe_with_diagnostics,
    recipe_json_schema,
)

HEAVY = ("torch", "transformers", "safetensors", "numpy")

QWEN3_8B_DRAFT = DFlashArchitectureConfig(
    num_hidden_layers=5,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=12288,
    target_layer_ids=(1, 9, 17, 25, 33),
)


def test_all_names_the_entry_points_and_each_resolves() -> None:
    for name in (
        "load_recipe",
        "load_recipe_with_diagnostics",
        "compile_recipe",
        "compile_file",
        "CompileResult",
        "recipe_json_schema",
        "Recipe",
        "RunPlan",
    ):
        assert name in dflash_recipes.__all__
    missing = [name for name in dflash_recipes.__all__ if not hasattr(dflash_recipes, name)]
    assert missing == []
    assert len(set(dflash_recipes.__all__)) == len(dflash_recipes.__all__)


def test_importing_the_package_imports_no_heavy_module() -> None:
    script = (
        "import json, sys\n"
        "import dflash_recipes\n"
        "from dflash_recipes import *\n"
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    assert json.loads(done.stdout) == []


def test_typed_recipe_compiles_at_schema_level_from_the_top_level_import() -> None:
    recipe = Recipe(
        model=ModelSection(model_name_or_path="/hf-local/Qwen/Qwen3-8B"),
        training=TrainingSection(learning_rate=1e-4),
        dflash=DFlashSection(
            dflash_block_size=16,
            dflash_mask_token_id=151669,
            dflash_architecture_config=QWEN3_8B_DRAFT,
        ),
    )
    result = compile_recipe(recipe, resolve=False)
    assert isinstance(result, CompileResult)
    assert result.ok and result.errors == ()
    plan = result.plan
    assert plan is not None
    assert plan.draft.block_size == 16
    assert plan.draft.mask_token_id == 151669
    assert plan.draft.target_layer_ids == (1, 9, 17, 25, 33)
    assert plan.init_checkpoint is None
    assert plan.to_dict()["fingerprint"] == plan.fingerprint

    # the same recipe with one field changed through attrs.evolve: another plan
    smaller = attrs.evolve(recipe, dflash=attrs.evolve(recipe.dflash, dflash_block_size=10))
    other = compile_recipe(smaller, resolve=False).plan
    assert other is not None
    assert other.draft.block_size == 10
    assert other.fingerprint != plan.fingerprint


def test_typed_recipe_with_a_cross_field_error_gives_no_plan() -> None:
    recipe = Recipe(
        model=ModelSection(model_name_or_path="/m"),
        dflash=DFlashSection(
            dflash_mask_token_id=1,
            dflash_architecture_config=attrs.evolve(QWEN3_8B_DRAFT, num_key_value_heads=5),
        ),
    )
    result = compile_recipe(recipe, resolve=False)
    assert result.plan is None
    assert [d.code for d in result.errors] == ["kv-heads-not-divisor"]


def test_file_entry_points_from_the_top_level_import(
    write_recipe: Callable[..., Path], recipe_text: Callable[..., str]
) -> None:
    path = write_recipe(recipe_text(init=None, dflash={"dflash_mask_token_id": 250}))
    recipe = load_recipe(path)
    assert recipe.dflash.dflash_mask_token_id == 250
    loaded = load_recipe_with_diagnostics(path, overrides=["dflash.dflash_block_size=10"])
    assert loaded.ok and loaded.recipe is not None
    assert loaded.recipe.dflash.dflash_block_size == 10
    schema_level = compile_file(path, resolve=False)
    assert schema_level.ok and schema_level.plan is not None
    assert schema_level.plan.draft.mask_token_id == 250

    bad = write_recipe("dflash:\n  dflash_blok_size: 16\n", name="bad.yaml")
    with pytest.raises(RecipeError) as info:
        load_recipe(bad)
    assert "unknown-key" in {d.code for d in info.value.diagnostics}


def test_recipe_json_schema_from_the_top_level_import_is_valid() -> None:
    schema = recipe_json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert set(schema["properties"]) == {
        "model",
        "data",
        "training",
        "dflash",
        "regenerate",
        "card",
        "target_server",
    }
