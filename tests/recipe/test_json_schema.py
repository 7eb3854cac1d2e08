"""The JSON Schema and field docs generated from the recipe classes and their `#:` comments."""

from __future__ import annotations

import copy
from typing import Any

import jsonschema
import pytest
from testkit.recipe_samples import EXAMPLE_YAML, MINIMAL_YAML

from dflash_recipes.diagnostics import SourceMap
from dflash_recipes.recipe.converter import recipe_field_paths, structure_recipe, unstructure_recipe
from dflash_recipes.recipe.json_schema import field_docs, recipe_json_schema
from dflash_recipes.recipe.loader import recipe_from_text
from dflash_recipes.recipe.sections import ModelSection, Recipe
from dflash_recipes.recipe.yamlio import load_yaml


def schema() -> dict[str, Any]:
    return recipe_json_schema()


def prop(*path: str) -> dict[str, Any]:
    node: dict[str, Any] = schema()
    for key in path:
        node = node["properties"][key]
    return node


def validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(schema())


def test_schema_is_a_valid_draft_2020_12_schema() -> None:
    generated = schema()
    assert generated["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(generated)


def test_example_recipe_validates() -> None:
    data, _ = load_yaml(EXAMPLE_YAML, filename="example.yaml")
    assert list(validator().iter_errors(data)) == []


def test_a_full_default_recipe_validates() -> None:
    data = unstructure_recipe(Recipe(model=ModelSection(model_name_or_path="/m")))
    assert list(validator().iter_errors(data)) == []


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("dflash", "dflash_blok_size", 16),  # unknown key
        ("dflash", "dflash_block_size", 1),  # below the validator's range
        ("dflash", "dflash_block_size", "16"),  # wrong type
        ("training", "lr_scheduler_type", "cosin"),  # not in the enum
        ("training", "warmup_ratio", 1.0),  # [0, 1)
        ("model", "trust_remote_code", "false"),
        ("data", "data_path", ""),
    ],
)
def test_invalid_recipes_fail_in_the_schema_and_in_the_loader(
    section: str, key: str, value: object
) -> None:
    data, _ = load_yaml(EXAMPLE_YAML, filename="example.yaml")
    assert isinstance(data, dict)
    broken = copy.deepcopy(data)
    broken[section][key] = value
    assert list(validator().iter_errors(broken)) != []
    # The loader agrees: the same data is refused when structured.
    recipe, found = structure_recipe(broken, source=SourceMap())
    assert recipe is None and found


def test_missing_model_fails() -> None:
    assert list(validator().iter_errors({"training": {}})) != []
    assert list(validator().iter_errors({"model": {}})) != []


def test_objects_forbid_additional_properties_at_every_level() -> None:
    def objects(node: dict[str, Any]) -> list[dict[str, Any]]:
        found = [node] if node.get("type") == "object" else []
        for child in node.get("properties", {}).values():
            found += objects(child)
        return found

    every = objects(schema())
    assert len(every) == 8  # recipe, six sections, dflash_architecture_config
    assert all(node["additionalProperties"] is False for node in every)


def test_types_enums_nullability_required_and_defaults() -> None:
    assert schema()["required"] == ["model"]
    assert prop("model")["required"] == ["model_name_or_path"]
    assert prop("training", "lr_scheduler_type")["enum"] == ["cosine", "linear", "constant"]
    assert prop("training", "max_steps")["type"] == ["integer", "null"]
    assert prop("training", "learning_rate")["type"] == "number"
    assert prop("training", "learning_rate")["default"] == pytest.approx(1e-4)
    assert prop("dflash", "dflash_block_size")["default"] == 16
    assert prop("dflash", "dflash_block_size")["minimum"] == 2
    ids = prop("dflash", "dflash_architecture_config", "target_layer_ids")
    assert ids["type"] == ["array", "null"]
    assert ids["items"] == {"type": "integer", "minimum": 0, "maximum": 4095}
    assert prop("training", "max_steps")["maximum"] == 10**9
    assert "default" not in prop("dflash", "dflash_architecture_config")  # a factory default


def test_descriptions_come_from_the_hash_colon_comments() -> None:
    assert prop("dflash", "dflash_block_size")["description"] == (
        "Tokens drafted per block (the anchor plus block_size - 1 masked positions)."
    )
    # Two `#:` lines are joined into one description.
    checkpoint = prop("dflash", "dflash_init_checkpoint")["description"]
    assert checkpoint.startswith("Local directory of an exported drafter")
    assert checkpoint.endswith("--local-dir <dir>` first.")


def test_every_field_is_documented() -> None:
    docs = field_docs()
    assert set(docs) == recipe_field_paths()
    assert all(text and not text.startswith("#") for text in docs.values())


def test_a_document_that_passes_the_schema_also_loads() -> None:
    # The schema is what editors enforce; it must not accept what the loader refuses.
    text = MINIMAL_YAML + "training:\n  learning_rate: 3\n  eval_steps: 100\n"
    data, _ = load_yaml(text, filename="r.yaml")
    assert list(validator().iter_errors(data)) == []
    assert recipe_from_text(text).ok
