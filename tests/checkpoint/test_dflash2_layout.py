"""DFlash 2's torch-free layout facts and config checks (issue 37, first step)."""

from __future__ import annotations

from pathlib import Path

from testkit.released_layouts import (
    DFLASH2_CONFIG,
    DIMS,
    HIDDEN,
    TAPS,
    VOCAB,
    write_dflash2_checkpoint,
)

from dflash_recipes.checkpoint.kinds import dflash2
from dflash_recipes.checkpoint.safetensors_header import read_safetensors_header
from dflash_recipes.checkpoint.tensor_layout import LayoutSpec, backbone_layout


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
