"""Expected drafter layouts, layout comparison messages and reading dims back from shapes."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import attrs
import pytest
from testkit.st_fixtures import write_drafter_checkpoint

from dflash_recipes.checkpoint.tensor_layout import (
    DRAFT_SPEC_FIELDS,
    LayoutSpec,
    checkpoint_dims,
    compare_layout,
    default_target_layer_ids,
    expected_layout,
    format_indices,
    format_layout_diff,
    format_partial_heads,
    head_presence,
    head_submodules,
    infer_architecture,
    layout_fixes,
    layout_spec_for,
)
from dflash_recipes.checkpoint.weight_index import read_checkpoint_weights

# Qwen3-8B-DFlash-b16 (its published config.json and tensor shapes).
QWEN3_8B_B16 = LayoutSpec(
    hidden_size=4096,
    num_hidden_layers=5,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=12288,
    n_taps=5,
    vocab_size=151936,
)


def _spec(**changes: Any) -> LayoutSpec:
    """A tiny drafter spec with `changes` applied (validated like any construction)."""
    fields: dict[str, Any] = {
        "hidden_size": 32,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 64,
        "n_taps": 2,
        "vocab_size": 256,
        **changes,
    }
    return LayoutSpec(**fields)


# ---------------------------------------------------------------------------------------------
# expected layouts
# ---------------------------------------------------------------------------------------------


def test_qwen3_8b_drafter_has_58_tensors_and_the_published_parameter_count() -> None:
    layout = expected_layout(QWEN3_8B_B16)
    assert len(layout) == 58
    assert sum(math.prod(shape) for shape in layout.values()) == 1_048_626_432
    assert layout["fc.weight"] == (4096, 20480)
    assert layout["layers.0.self_attn.q_proj.weight"] == (4096, 4096)
    assert layout["layers.4.self_attn.o_proj.weight"] == (4096, 4096)
    assert layout["layers.2.self_attn.k_proj.weight"] == (1024, 4096)
    assert layout["layers.2.self_attn.v_proj.weight"] == (1024, 4096)
    assert layout["layers.3.mlp.gate_proj.weight"] == (12288, 4096)
    assert layout["layers.3.mlp.up_proj.weight"] == (12288, 4096)
    assert layout["layers.3.mlp.down_proj.weight"] == (4096, 12288)
    assert layout["layers.1.self_attn.q_norm.weight"] == (128,)
    assert layout["norm.weight"] == layout["hidden_norm.weight"] == (4096,)
    # The drafter owns no embedding, no output head and no rotary buffer.
    assert not [n for n in layout if "embed" in n or "lm_head" in n or "inv_freq" in n]


@pytest.mark.parametrize("layers", [1, 2, 5, 8])
def test_tensor_count_is_3_plus_11_per_layer(layers: int) -> None:
    layout = expected_layout(_spec(num_hidden_layers=layers))
    assert len(layout) == 3 + 11 * layers
    assert f"layers.{layers - 1}.mlp.down_proj.weight" in layout
    assert f"layers.{layers}.mlp.down_proj.weight" not in layout


def test_attention_sink_adds_one_bias_per_layer_sized_by_heads() -> None:
    plain = expected_layout(_spec())
    sink = expected_layout(_spec(attention_sink=True))
    added = {n: s for n, s in sink.items() if n not in plain}
    assert added == {f"layers.{i}.self_attn.attention_sink_bias": (4,) for i in range(3)}


def test_plain_dflash_has_no_head_submodules() -> None:
    assert head_submodules(_spec()) == {}


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"projector_type": "domino", "gru_hidden_dim": 8}, "domino needs emb_dim"),
        ({"projector_type": "dspark", "vocab_size": None}, "dspark needs vocab_size, markov_rank"),
        ({"projector_type": "medusa"}, "projector_type must be one of dflash, domino, dspark"),
        ({"head_dim": 0}, "head_dim must be a positive integer"),
    ],
)
def test_layout_spec_rejects_incomplete_or_invalid_fields(
    changes: dict[str, object], fragment: str
) -> None:
    with pytest.raises(ValueError, match=fragment):
        _spec(**changes)


# ---------------------------------------------------------------------------------------------
# comparing and formatting
# ---------------------------------------------------------------------------------------------


def test_identical_layouts_have_no_diff() -> None:
    layout = expected_layout(_spec())
    diff = compare_layout(layout, dict(layout))
    assert diff.is_empty
    assert diff.count == 0


def test_diff_sorts_offenders_into_missing_unexpected_and_mismatched() -> None:
    expected = expected_layout(_spec())
    found = dict(expected)
    del found["layers.1.mlp.up_proj.weight"]
    found["layers.0.mlp.gate_proj.weight"] = (99, 32)
    found["lm_head.weight"] = (256, 32)
    diff = compare_layout(expected, found)
    assert diff.missing == {"layers.1.mlp.up_proj.weight": (64, 32)}
    assert diff.unexpected == {"lm_head.weight": (256, 32)}
    assert diff.mismatched == {"layers.0.mlp.gate_proj.weight": ((64, 32), (99, 32))}
    assert diff.count == 3


def test_message_groups_layers_with_the_same_mismatch_like_the_issue_example() -> None:
    recipe = expected_layout(
        LayoutSpec(
            hidden_size=4096,
            num_hidden_layers=5,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=22016,
            n_taps=5,
        )
    )
    diff = compare_layout(recipe, expected_layout(QWEN3_8B_B16))
    message = format_layout_diff(
        diff, fixes=["set dflash_architecture_config.intermediate_size: 12288"]
    )
    lines = message.splitlines()
    assert lines[0].startswith("checkpoint tensors do not match")
    assert "15 with another shape" in lines[0]
    assert (
        "  layers.{0..4}.mlp.gate_proj.weight: recipe expects [22016, 4096], "
        "checkpoint has [12288, 4096]"
    ) in lines
    assert (
        "  layers.{0..4}.mlp.down_proj.weight: recipe expects [4096, 22016], "
        "checkpoint has [4096, 12288]"
    ) in lines
    assert len(lines) == 1 + 3 + 1  # header, gate/up/down, one fix
    assert lines[-1] == "fix: set dflash_architecture_config.intermediate_size: 12288"


def test_whole_missing_layers_collapse_to_one_line() -> None:
    recipe = expected_layout(_spec(num_hidden_layers=5))
    found = expected_layout(_spec(num_hidden_layers=3))
    message = format_layout_diff(compare_layout(recipe, found))
    assert "22 missing" in message
    assert "  missing: layers.{3,4}.*: 22 tensors, whole layers the checkpoint lacks" in message
    assert len(message.splitlines()) == 2


def test_whole_extra_layers_collapse_to_one_line() -> None:
    recipe = expected_layout(_spec(num_hidden_layers=2))
    found = expected_layout(_spec(num_hidden_layers=6))
    message = format_layout_diff(compare_layout(recipe, found))
    assert (
        "  unexpected: layers.{2..5}.*: 44 tensors, whole layers the recipe does not expect"
        in message
    )


def test_scattered_missing_tensors_list_their_layers_and_shapes() -> None:
    recipe = expected_layout(_spec(num_hidden_layers=6))
    found = {
        n: s
        for n, s in recipe.items()
        if n not in {f"layers.{i}.self_attn.k_norm.weight" for i in (0, 2, 5)}
    }
    message = format_layout_diff(compare_layout(recipe, found))
    assert (
        "  missing: layers.{0,2,5}.self_attn.k_norm.weight: recipe expects [8], checkpoint has none"
    ) in message.splitlines()


def test_unexpected_tensors_outside_layers_are_listed_by_name() -> None:
    recipe = expected_layout(_spec())
    found = {**recipe, "embed_tokens.weight": (256, 32), "lm_head.weight": (256, 32)}
    lines = format_layout_diff(compare_layout(recipe, found)).splitlines()
    assert (
        "  unexpected: embed_tokens.weight: checkpoint has [256, 32], recipe expects none" in lines
    )
    assert "  unexpected: lm_head.weight: checkpoint has [256, 32], recipe expects none" in lines


def test_prefixed_full_model_names_group_too() -> None:
    recipe = expected_layout(_spec(num_hidden_layers=1))
    found = {
        f"model.layers.{i}.mlp.{proj}.weight": (64, 32)
        for i in range(36)
        for proj in ("up_proj", "gate_proj")
    }
    message = format_layout_diff(compare_layout(recipe, found))
    assert "model.layers.{0..35}.*: 72 tensors, whole layers the recipe does not expect" in message


def test_message_stays_short_for_a_completely_different_checkpoint() -> None:
    recipe = expected_layout(_spec())
    found = {f"block_{i}_w": (i + 1,) for i in range(500)}
    message = format_layout_diff(compare_layout(recipe, found))
    assert "... and 460 more unexpected" in message
    assert len(message.splitlines()) < 100


@pytest.mark.parametrize(
    ("indices", "text"),
    [
        ([5], "{5}"),
        ([0, 1, 2, 3, 4], "{0..4}"),
        ([0, 2, 5], "{0,2,5}"),
        ([3, 4], "{3,4}"),
        ([7, 0, 1, 2, 3], "{0..3,7}"),
        ([1, 1, 2, 3], "{1..3}"),
    ],
)
def test_format_indices(indices: list[int], text: str) -> None:
    assert format_indices(indices) == text


def test_the_message_is_the_same_for_a_checkpoint_on_disk(tmp_path: Path) -> None:
    write_drafter_checkpoint(tmp_path / "ck", layers=3, intermediate=96)
    found = read_checkpoint_weights(tmp_path / "ck").shapes
    spec = _spec(num_hidden_layers=3)
    fixes = layout_fixes(spec, checkpoint_dims(None, found), found)
    message = format_layout_diff(compare_layout(expected_layout(spec), found), fixes=fixes)
    assert "layers.{0..2}.mlp.up_proj.weight: recipe expects [64, 32], checkpoint has [96, 32]" in (
        message
    )
    assert message.endswith(
        "fix: set dflash_architecture_config.intermediate_size: 96, "
        "as the checkpoint's tensor shapes show"
    )


# ---------------------------------------------------------------------------------------------
# heads: whole, absent or partly present
# ---------------------------------------------------------------------------------------------


def test_head_presence_from_a_plain_checkpoint_marks_every_head_absent() -> None:
    spec = _spec(projector_type="domino", emb_dim=48, gru_hidden_dim=24)
    found = expected_layout(_spec())
    presence = head_presence(spec, found)
    assert presence.absent == ("prefix_gru", "embed_proj")
    assert presence.complete == ()
    assert presence.partial == {}


def test_head_presence_finds_a_partly_present_head() -> None:
    spec = _spec(projector_type="dspark", markov_rank=8, use_confidence_head=True)
    found = dict(expected_layout(spec))
    del found["confidence_proj.bias"]
    del found["markov_w2.weight"]
    presence = head_presence(spec, found)
    assert presence.complete == ("markov_w1",)
    assert presence.absent == ("markov_w2",)
    assert presence.partial == {
        "confidence_proj": (("confidence_proj.weight",), ("confidence_proj.bias",))
    }
    assert (
        "confidence_proj: has confidence_proj.weight; lacks confidence_proj.bias"
        in format_partial_heads(presence)
    )


# ---------------------------------------------------------------------------------------------
# reading dims back
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        QWEN3_8B_B16,
        _spec(num_hidden_layers=1, n_taps=3),
        _spec(num_hidden_layers=7, num_attention_heads=8, num_key_value_heads=8, head_dim=4),
        _spec(projector_type="domino", emb_dim=48, gru_hidden_dim=24),
        _spec(projector_type="dspark", markov_rank=16, use_confidence_head=True),
    ],
)
def test_infer_architecture_reads_back_every_dim(spec: LayoutSpec) -> None:
    dims = infer_architecture(expected_layout(spec))
    for name in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "n_taps",
        "emb_dim",
        "gru_hidden_dim",
        "markov_rank",
    ):
        assert dims.get(name) == getattr(spec, name), name
    if spec.projector_type != "dflash":
        assert dims["vocab_size"] == spec.vocab_size


def test_infer_architecture_skips_what_odd_shapes_cannot_tell() -> None:
    found = {
        "norm.weight": (32, 2),
        "fc.weight": (32, 70),
        "layers.0.self_attn.q_norm.weight": (8,),
        "layers.0.self_attn.q_proj.weight": (30, 32),
        "layers.3.mlp.gate_proj.weight": (),
    }
    assert infer_architecture(found) == {
        "num_hidden_layers": 4,
        "hidden_size": 32,
        "head_dim": 8,
    }
    assert infer_architecture({}) == {}


def test_fixes_name_fields_and_the_hidden_size_of_the_target() -> None:
    found = expected_layout(_spec(num_hidden_layers=4, hidden_size=48, n_taps=3))
    fixes = layout_fixes(_spec(), checkpoint_dims(None, found), found)
    assert fixes[0] == (
        "set dflash_architecture_config.num_hidden_layers: 4, as the checkpoint's tensor "
        "shapes show"
    )
    assert fixes[-1] == (
        "the checkpoint was trained for a target with hidden_size 48, the base model has 32: "
        "use the target the drafter was trained for"
    )


def test_fixes_for_the_tap_count_prefer_the_checkpoints_stated_taps() -> None:
    found = expected_layout(_spec(n_taps=5))
    dims = checkpoint_dims(None, found)
    assert layout_fixes(_spec(n_taps=3), dims, found) == [
        "set dflash_architecture_config.target_layer_ids to the 5 taps the checkpoint was "
        "trained with (its fc.weight takes 5, the recipe gives 3)"
    ]
    stated = layout_fixes(_spec(n_taps=3), dims, found, stated_taps=(1, 2, 3, 4, 5))
    assert stated == [
        "set dflash_architecture_config.target_layer_ids: [1, 2, 3, 4, 5], as the "
        "checkpoint's config.json says"
    ]


def test_checkpoint_dims_prefer_the_tensors_over_a_stale_config() -> None:
    found = expected_layout(_spec(num_hidden_layers=4))
    dims = checkpoint_dims({"num_hidden_layers": 6, "head_dim": 8}, found)
    assert dims.values["num_hidden_layers"] == 4
    assert dims.fix("num_hidden_layers") == (
        "set dflash_architecture_config.num_hidden_layers: 4, as the checkpoint's tensors show "
        "(its config.json says 6, which is stale)"
    )
    assert dims.sources["head_dim"] == "as the checkpoint's config.json says"


def test_layout_spec_for_reads_every_draft_spec_field() -> None:
    spec = _spec()
    rebuilt = layout_spec_for(
        spec, hidden_size=spec.hidden_size, n_taps=spec.n_taps, vocab_size=spec.vocab_size
    )
    assert rebuilt == spec
    assert set(DRAFT_SPEC_FIELDS) | {"hidden_size", "n_taps", "vocab_size"} == {
        a.name for a in attrs.fields(LayoutSpec)
    }


# ---------------------------------------------------------------------------------------------
# default taps
# ---------------------------------------------------------------------------------------------


def test_default_taps_for_qwen3_targets() -> None:
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(28, 5) == (1, 7, 13, 19, 25)


def test_default_taps_for_one_draft_layer_is_the_middle_layer() -> None:
    assert default_target_layer_ids(36, 1) == (18,)
    assert default_target_layer_ids(7, 1) == (3,)


def test_default_taps_round_half_to_even() -> None:
    # 1 + 1 * 5 / 2 = 3.5 -> 4 (Python round), 1 + 2 * 5 / 2 = 6.
    assert default_target_layer_ids(9, 3) == (1, 4, 6)


def test_default_taps_refuse_a_target_too_shallow() -> None:
    with pytest.raises(ValueError, match="set target_layer_ids explicitly"):
        default_target_layer_ids(5, 4)
    with pytest.raises(ValueError, match="at least one target and one draft layer"):
        default_target_layer_ids(0, 1)


def test_odd_names_from_a_foreign_checkpoint_do_not_break_the_message() -> None:
    recipe = expected_layout(_spec(num_hidden_layers=1))
    found = {"a.².b": (1,), "layers.٣.w": (2,), "layers.99999999999.w": (3,), "": (4,)}
    message = format_layout_diff(compare_layout(recipe, found))
    for name in found:
        assert f"unexpected: {name}: checkpoint has" in message
    assert infer_architecture(found) == {}
