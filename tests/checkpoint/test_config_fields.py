"""The checkpoint field inventory: every field has one entry, every field read is in it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from testkit.checkpoint_fields import (
    _every_known_field,
    _keys_the_code_reads,
    compile_with_config,
    nested,
)
from testkit.compiling import only

from dflash_recipes.checkpoint import config_fields
from dflash_recipes.checkpoint.config_fields import CHECKPOINT_FIELDS, field_entry, unknown_fields
from dflash_recipes.diagnostics import Severity
from dflash_recipes.recipe.sections import Recipe

RecipeFactory = Callable[..., Recipe]


def test_a_field_in_no_entry_gets_one_info_naming_it(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    def edit(config: dict[str, Any]) -> None:
        config["draft_temperature"] = 0.7
        nested(config)["fancy_new_head"] = True

    result = compile_with_config(tmp_path, make_recipe, edit)
    assert result.ok
    d = only(result, "checkpoint-field-unknown")
    assert d.severity is Severity.INFO
    assert "2 field(s)" in d.message
    assert "dflash_config.fancy_new_head, draft_temperature" in d.message


def test_every_entry_has_one_status_a_reason_and_a_unique_key() -> None:
    keys = [field.key for field in CHECKPOINT_FIELDS]
    assert len(keys) == len(set(keys))
    for field in CHECKPOINT_FIELDS:
        assert field.status in ("honored", "refused", "compared", "irrelevant")
        assert len(field.reason) > 10, field


def test_every_field_the_code_reads_has_an_inventory_entry() -> None:
    # An empty config makes every reader probe each place it looks (nested, then flat);
    # a full one makes them read every value.
    read = _keys_the_code_reads({"dflash_config": {}}) | _keys_the_code_reads(_every_known_field())
    assert "hidden_act" in read and "dflash_config.is_causal" in read  # the recorder works
    missing = sorted(key for key in read if field_entry(key) is None)
    assert missing == [], f"fields read by the code without an inventory entry: {missing}"


def test_a_config_with_every_known_field_has_no_unknown_field() -> None:
    config = _every_known_field()
    assert unknown_fields(config) == []
    config["brand_new"] = 1
    assert unknown_fields(config) == ["brand_new"]


def test_an_entry_is_built_with_the_key_status_and_reason_given() -> None:
    entry = config_fields._f("logit_scale", "refused", "scales the draft logits")
    assert (entry.key, entry.status, entry.reason) == (
        "logit_scale",
        "refused",
        "scales the draft logits",
    )
    assert field_entry("dflash_config.is_causal") is not None
    assert field_entry("is_causal") is not None and field_entry("nope") is None


def test_unknown_fields_look_inside_dflash_config_only_when_it_is_an_object() -> None:
    assert unknown_fields({"dflash_config": ["x"], "zz": 1}) == ["zz"]
    assert unknown_fields({"dflash_config": {"yy": 1, "block_size": 4}}) == ["dflash_config.yy"]
