"""What every kind's torch-free half shares: config fields in place, submodule groups, sizes."""

from __future__ import annotations

from typing import Any

from dflash_recipes.checkpoint.kinds.protocol import dim, group_by_submodule, with_kind_fields


def test_kind_fields_go_after_the_block_size_and_at_the_end_of_dflash_config() -> None:
    config: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "block_size": 16,
        "dflash_config": {"mask_token_id": 7},
        "auto_map": {},
    }
    out = with_kind_fields(config, top={"x": 1}, nested={"y": 2, "z": 3})
    assert list(out) == ["architectures", "block_size", "x", "dflash_config", "auto_map"]
    assert list(out["dflash_config"]) == ["mask_token_id", "y", "z"]
    assert config["dflash_config"] == {"mask_token_id": 7}
    assert with_kind_fields(config) == config


def test_tensors_group_by_their_top_level_submodule_in_order() -> None:
    names = ["a.weight", "b.weight", "a.bias", "c"]
    assert group_by_submodule(names) == {
        "a": ("a.weight", "a.bias"),
        "b": ("b.weight",),
        "c": ("c",),
    }


def test_a_size_is_read_only_from_a_tensor_of_the_right_rank() -> None:
    found = {"w": (4, 3), "v": (5,), "z": (0, 2)}
    assert dim(found, "w", 2, 1) == 3
    assert dim(found, "v", 2, 0) is None
    assert dim(found, "z", 2, 0) is None
    assert dim(found, "missing", 1, 0) is None
