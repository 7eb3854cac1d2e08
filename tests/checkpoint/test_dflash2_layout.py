"""DFlash 2's torch-free facts: its layout against the released header, the sizes read back from
it, its config checks and its export config (issue 37)."""

from __future__ import annotations

from pathlib import Path

import pytest
from testkit.released_layouts import (
    DFLASH2_CONFIG,
    DIMS,
    HIDDEN,
    TAPS,
    VOCAB,
    write_dflash2_checkpoint,
)

from dflash_recipes.checkpoint.kinds import dflash2
from dflash_recipes.checkpoint.kinds.protocol import JsonValue
from dflash_recipes.checkpoint.kinds.registry import kind_from_tensors
from dflash_recipes.checkpoint.safetensors_header import read_safetensors_header
from dflash_recipes.checkpoint.tensor_layout import (
    LayoutSpec,
    backbone_layout,
    expected_layout,
    head_submodules,
    infer_architecture,
)
from dflash_recipes.recipe.sections import DFlashArchitectureConfig


def test_muse_layout_matches_the_released_header_shapes() -> None:
    # Muse-Glimmer-30B-DFlash2 (z-lab dflash2-safetensors-header.json): H 6656, 5 layers.
    shapes = dflash2.extra_layout(
        hidden=6656, vocab=202048, layers=5, kernel=2, group_size=16, rank=256
    )
    assert len(shapes) == 81 - 58
    assert shapes["layers.4.mlp_conv.kernel_projection.weight"] == (1664, 6656)
    assert shapes["layers.0.attention_conv.base_kernel"] == (2, 2, 6656)
    assert shapes["candidate_selector.predecessor_codebook"] == (202048, 256)
    assert "candidate_selector.successor_codebook.weight" not in shapes


def test_qwen38_extra_parameters() -> None:
    shapes = dflash2.extra_layout(
        hidden=5120, vocab=248320, layers=5, kernel=2, group_size=16, rank=256
    )
    convs = 10 * (2 * 2 * 5120 + 1280 * 5120)
    selector = 256 * 5120 + 2 * 248320 * 256
    assert dflash2.extra_parameters(shapes) == convs + selector


def test_config_checks() -> None:
    good = {
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 256,
        "selector_top_k": 16,
    }
    assert dflash2.config_problems(good, hidden=5120, vocab=248320, block_size=8) == []
    missing = {k: v for k, v in good.items() if k != "selector_rank"}
    assert (
        "selector_rank" in dflash2.config_problems(missing, hidden=5120, vocab=10, block_size=8)[0]
    )
    bad_group = {**good, "conv_group_size": 15}
    assert (
        "divide" in dflash2.config_problems(bad_group, hidden=5120, vocab=248320, block_size=8)[0]
    )
    bad_kernel = {**good, "conv_kernel_size": 9}
    assert (
        "block_size"
        in dflash2.config_problems(bad_kernel, hidden=5120, vocab=248320, block_size=8)[0]
    )
    bad_top = {**good, "selector_top_k": 0}
    assert (
        "selector_top_k"
        in dflash2.config_problems(bad_top, hidden=5120, vocab=248320, block_size=8)[0]
    )
    big_top = {**good, "selector_top_k": 11}
    assert dflash2.config_problems(big_top, hidden=5120, vocab=10, block_size=8)


def test_the_layout_facts_account_for_every_tensor_of_the_released_header(tmp_path: Path) -> None:
    # z-lab/dflash tests/fixtures/dflash2-safetensors-header.json, rebuilt as a sparse file
    write_dflash2_checkpoint(tmp_path)
    header = read_safetensors_header(tmp_path / "model.safetensors")
    found = {name: tuple(info.shape) for name, info in header.tensors.items()}
    assert len(found) == 81
    dflash_config = DFLASH2_CONFIG["dflash_config"]
    assert isinstance(dflash_config, dict)
    spec = LayoutSpec(hidden_size=HIDDEN, n_taps=len(TAPS), vocab_size=VOCAB, **DIMS)
    expected = dict(backbone_layout(spec))
    expected.update(
        dflash2.extra_layout(
            hidden=HIDDEN,
            vocab=VOCAB,
            layers=DIMS["num_hidden_layers"],
            kernel=dflash_config["conv_kernel_size"],
            group_size=dflash_config["conv_group_size"],
            rank=dflash_config["selector_rank"],
        )
    )
    assert found == expected
    assert dflash2.config_problems(dflash_config, hidden=HIDDEN, vocab=VOCAB, block_size=16) == []
    assert all(info.dtype == "BF16" for info in header.tensors.values())


# -- the registered kind (projector_type: dflash2) ------------------------------------------------


def _released_spec() -> LayoutSpec:
    dflash_config = DFLASH2_CONFIG["dflash_config"]
    assert isinstance(dflash_config, dict)
    return LayoutSpec(
        hidden_size=HIDDEN,
        n_taps=len(TAPS),
        vocab_size=VOCAB,
        projector_type="dflash2",
        conv_kernel_size=dflash_config["conv_kernel_size"],
        conv_group_size=dflash_config["conv_group_size"],
        selector_rank=dflash_config["selector_rank"],
        **DIMS,
    )


def test_the_kinds_layout_is_the_released_header(tmp_path: Path) -> None:
    write_dflash2_checkpoint(tmp_path)
    header = read_safetensors_header(tmp_path / "model.safetensors")
    found = {name: tuple(info.shape) for name, info in header.tensors.items()}
    assert expected_layout(_released_spec()) == found
    groups = head_submodules(_released_spec())
    assert list(groups) == ["attention_conv", "mlp_conv", "candidate_selector"]
    assert len(groups["attention_conv"]) == len(groups["mlp_conv"]) == 2 * DIMS["num_hidden_layers"]
    assert kind_from_tensors(found) == "dflash2"


def test_the_sizes_are_read_back_from_the_released_tensors(tmp_path: Path) -> None:
    write_dflash2_checkpoint(tmp_path)
    header = read_safetensors_header(tmp_path / "model.safetensors")
    found = {name: tuple(info.shape) for name, info in header.tensors.items()}
    dims = infer_architecture(found)
    assert (dims["vocab_size"], dims["selector_rank"]) == (VOCAB, 256)
    assert (dims["conv_kernel_size"], dims["conv_group_size"]) == (2, 16)


def test_a_layout_without_the_dflash2_sizes_cannot_be_built() -> None:
    with pytest.raises(ValueError, match="needs conv_kernel_size, conv_group_size, selector_rank"):
        LayoutSpec(hidden_size=HIDDEN, n_taps=5, vocab_size=VOCAB, projector_type="dflash2", **DIMS)


def test_the_export_config_nests_every_dflash2_key_and_states_the_architecture() -> None:
    draft = DFlashArchitectureConfig(
        projector_type="dflash2",
        conv_kernel_size=2,
        conv_group_size=16,
        selector_rank=256,
        selector_top_k=16,
        final_logit_softcapping=20.0,
    )
    common: dict[str, JsonValue] = {
        "architectures": ["DFlashDraftModel"],
        "block_size": 16,
        "dflash_config": {"mask_token_id": 1, "target_layer_ids": [1, 2]},
    }
    config = dflash2.FACTS.export_config(draft, common)
    assert config["architectures"] == ["DFlash2DraftModel"] and config["is_causal"] is False
    assert config["dflash_config"] == {
        "mask_token_id": 1,
        "target_layer_ids": [1, 2],
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 256,
        "selector_top_k": 16,
        "final_logit_softcapping": 20.0,
    }
    assert dflash2.FACTS.describe(draft) == (
        "dflash2 (conv kernel 2, groups of 16; selector rank 256, top-16)"
    )
    assert dflash2.FACTS.serving_warnings(draft) == []
