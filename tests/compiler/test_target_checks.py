"""Compile says what it knows about the target's layers: recurrent layers refuse packing,
unknown layer types warn, an attention implementation that cannot load offline is an error."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from testkit.compiling import codes, only, text

from dflash_recipes.checkpoint.target_layers import read_target_layers
from dflash_recipes.compiler.compilation import compile_file
from dflash_recipes.diagnostics import Severity


def _edit_config(base_model: Path, **fields: object) -> None:
    path = base_model / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config.update(fields)
    path.write_text(json.dumps(config), encoding="utf-8")


@pytest.fixture
def recipe(
    base_model: Path,
    drafter: Path,
    train_file: Path,
    recipe_text: Callable[..., str],
    write_recipe: Callable[..., Path],
) -> Path:
    return write_recipe(recipe_text())


HYBRID = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"model_type": "qwen3_next", "layer_types": HYBRID}, "linear-attention layers"),
        ({"model_type": "lfm2", "layer_types": ["conv", "full_attention"] * 4}, "short-conv"),
        ({"model_type": "falcon_h1"}, "Mamba-2 state-space layers ('falcon_h1')"),
    ],
)
def test_packing_is_refused_for_a_target_with_recurrent_layers(
    recipe: Path, base_model: Path, fields: dict[str, object], named: str
) -> None:
    _edit_config(base_model, **fields)
    assert compile_file(recipe).ok  # unpacked, the same target compiles
    refused = compile_file(recipe, ["data.packing=true"])
    found = only(refused, "packing-recurrent-layers")
    assert found.severity is Severity.ERROR and found.path == "data.packing"
    assert named in found.message and str(fields["model_type"]) in found.message
    assert "never produces" in found.message
    assert found.hint == "set data.packing=false (one conversation per row, padded)"


@pytest.mark.parametrize(
    "layer_types",
    [["full_attention"] * 8, ["sliding_attention", "full_attention"] * 4, None],
)
def test_attention_only_targets_pack(
    recipe: Path, base_model: Path, layer_types: list[str] | None
) -> None:
    if layer_types is not None:
        _edit_config(base_model, layer_types=layer_types, sliding_window=8)
    result = compile_file(recipe, ["data.packing=true"])
    assert result.ok and not codes(result) & {
        "packing-recurrent-layers",
        "target-layer-type-unknown",
    }


def test_a_multimodal_configs_text_layers_are_the_ones_read() -> None:
    config = {"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text"}}
    config["text_config"]["layer_types"] = HYBRID  # type: ignore[index]
    layers = read_target_layers(config)
    assert layers.where == "text_config.layer_types"
    assert layers.packing_blockers() == (
        "linear-attention layers (a recurrent state) ('linear_attention')",
    )


def test_an_unknown_layer_type_warns_and_names_the_run_start_check(
    recipe: Path, base_model: Path
) -> None:
    _edit_config(base_model, layer_types=["full_attention", "hyena"] * 4)
    result = compile_file(recipe, ["data.packing=true"])
    assert result.ok  # a warning: the run's isolation check decides
    found = only(result, "target-layer-type-unknown")
    assert found.severity is Severity.WARNING
    assert "'hyena'" in found.message and "`layer_types`" in found.message
    assert "checks at start-up" in text(found)


def test_an_attention_implementation_that_cannot_load_offline_is_an_error(
    recipe: Path, base_model: Path
) -> None:
    _edit_config(base_model, attn_implementation="kernels-community/vllm-flash-attn3")
    found = only(compile_file(recipe), "target-attn-implementation")
    assert found.severity is Severity.ERROR
    assert "'kernels-community/vllm-flash-attn3'" in found.message
    assert "delete `attn_implementation`" in (found.hint or "")
    _edit_config(base_model, attn_implementation="sdpa")
    assert "target-attn-implementation" not in codes(compile_file(recipe))
