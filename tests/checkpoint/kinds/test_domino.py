"""Domino's torch-free half: its tensors, export fields, serving warning and checks."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from dflash_recipes.checkpoint.kinds.alignment import FIELD_DIFFERS, TRAINED_FOR
from dflash_recipes.checkpoint.kinds.domino import FACTS, PURE_DRAFT_PREFIX_RANGE
from dflash_recipes.checkpoint.tensor_layout import LayoutSpec, expected_layout, head_submodules
from dflash_recipes.recipe.sections import DFlashArchitectureConfig

RECIPE = DFlashArchitectureConfig(projector_type="domino", emb_dim=48, gru_hidden_dim=24)


def _spec(**changes: Any) -> LayoutSpec:
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


def test_domino_head_tensors() -> None:
    spec = _spec(projector_type="domino", emb_dim=48, gru_hidden_dim=24)
    layout = expected_layout(spec)
    assert len(layout) == 3 + 11 * 3 + 4
    assert layout["prefix_gru.weight_ih_l0"] == (72, 32)
    assert layout["prefix_gru.weight_hh_l0"] == (72, 24)
    assert layout["embed_proj.0.weight"] == (48, 56)
    assert layout["embed_proj.2.weight"] == (256, 48)
    assert head_submodules(spec) == {
        "prefix_gru": ("prefix_gru.weight_ih_l0", "prefix_gru.weight_hh_l0"),
        "embed_proj": ("embed_proj.0.weight", "embed_proj.2.weight"),
    }
    assert FACTS.infer_dims(layout) == {"vocab_size": 256, "emb_dim": 48, "gru_hidden_dim": 24}


def test_export_writes_modelopts_head_fields_and_emb_dim_after_the_block_size() -> None:
    common: dict[str, Any] = {
        "vocab_size": 256,
        "block_size": 16,
        "dflash_config": {"block_size": 16, "projector_type": "domino"},
        "dtype": "bfloat16",
    }
    config = FACTS.export_config(RECIPE, common)
    assert list(config) == ["vocab_size", "block_size", "emb_dim", "dflash_config", "dtype"]
    assert config["emb_dim"] == 48
    assert config["dflash_config"] == {
        "block_size": 16,
        "projector_type": "domino",
        "shift_label": True,
        "pure_draft_prefix_len": 1,
        "gru_hidden_dim": 24,
        "emb_dim": 48,
    }
    assert common["dflash_config"] == {"block_size": 16, "projector_type": "domino"}  # a copy


def test_only_a_prefix_sglang_refuses_makes_the_export_warn() -> None:
    assert FACTS.serving_warnings(RECIPE) == []
    (warning,) = FACTS.serving_warnings(attrs.evolve(RECIPE, pure_draft_prefix_len=3))
    assert "leaves 3 proposals uncorrected" in warning
    assert "SGLang's Domino runtime accepts only pure_draft_prefix_len 1" in warning


@pytest.mark.parametrize(("prefix", "refused"), [(0, False), (15, False), (16, True)])
def test_the_prefix_must_leave_a_position_to_correct(prefix: int, refused: bool) -> None:
    findings = FACTS.recipe_findings(attrs.evolve(RECIPE, pure_draft_prefix_len=prefix), 16)
    assert bool(findings) == refused
    if refused:
        (finding,) = findings
        assert (finding.code, finding.field) == (PURE_DRAFT_PREFIX_RANGE, "pure_draft_prefix_len")
        assert "must lie in [0, 15] (dflash_block_size 16 minus 1)" in finding.message


def test_an_earlier_export_with_every_proposal_corrected_is_said_and_compared() -> None:
    nested = {"shift_label": False, "pure_draft_prefix_len": 0}
    findings = FACTS.checkpoint_findings(nested, RECIPE)
    assert [(f.code, f.field) for f in findings] == [
        (TRAINED_FOR, "shift_label"),
        (FIELD_DIFFERS, "shift_label"),
        (FIELD_DIFFERS, "pure_draft_prefix_len"),
    ]
    assert "every proposal corrected (pure_draft_prefix_len 0)" in findings[0].message
    assert "shift_label: false, pure_draft_prefix_len: 0 to keep" in findings[0].hint
    assert "leaves 0 proposal(s) uncorrected" in findings[2].message
    # a prefix that is not an integer is not read
    assert FACTS.checkpoint_findings({"pure_draft_prefix_len": True}, RECIPE) == []


def test_the_trained_for_note_names_the_checkpoints_prefix() -> None:
    note = FACTS.trained_for("ckpt", {"shift_label": True, "pure_draft_prefix_len": 2}, RECIPE)
    assert note is not None and note[1]
    assert (
        "shift_label true (block position k predicts anchor + k + 1, pure_draft_prefix_len 2)"
        in (note[0])
    )
    assert "drafts it as domino (shift_label true, pure_draft_prefix_len 1)" in note[0]
    assert note[0].endswith("and pure_draft_prefix_len: 2 to use it as trained")
    aligned = {"shift_label": True, "pure_draft_prefix_len": 1}
    assert FACTS.trained_for("ckpt", aligned, RECIPE) is None
