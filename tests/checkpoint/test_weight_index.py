"""A checkpoint's tensor table: one model.safetensors or a sharded index, checked like the
library."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from testkit.sharded import _rewrite_index, _sharded, _weight_map
from testkit.st_fixtures import (
    drafter_tensors,
    write_drafter_checkpoint,
    write_json,
    write_raw_safetensors,
    write_safetensors,
)

from dflash_recipes.checkpoint.weight_index import read_checkpoint_weights
from dflash_recipes.errors import CheckpointError, SafetensorsHeaderError


def test_single_file_checkpoint(tmp_path: Path) -> None:
    directory = write_drafter_checkpoint(tmp_path / "ck", layers=5)
    weights = read_checkpoint_weights(directory)
    assert weights.weight_files == ("model.safetensors",)
    assert len(weights.tensors) == 58
    assert set(weights.tensor_files.values()) == {"model.safetensors"}
    assert weights.dtypes == ("BF16",)
    assert weights.total_bytes == sum(
        2 * int(np.prod(shape)) for _, shape in drafter_tensors(layers=5).values()
    )
    assert weights.shapes["fc.weight"] == (32, 64)


def test_sharded_checkpoint_merges_shards_like_the_library(tmp_path: Path) -> None:
    directory = write_drafter_checkpoint(tmp_path / "ck", layers=3, shards=3)
    weights = read_checkpoint_weights(directory)

    assert weights.weight_files == (
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
    )
    oracle: dict[str, tuple[str, list[int]]] = {}
    for shard in weights.weight_files:
        with safe_open(directory / shard, framework="np") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                oracle[name] = (shard, list(f.get_slice(name).get_shape()))
    assert {n: (weights.tensor_files[n], list(t.shape)) for n, t in weights.tensors.items()} == (
        oracle
    )
    assert weights.tensors.keys() == drafter_tensors(layers=3).keys()


def test_single_file_wins_over_an_index(tmp_path: Path) -> None:
    directory = write_drafter_checkpoint(tmp_path / "ck")
    write_json(directory / "model.safetensors.index.json", {"weight_map": {"x": "gone"}})
    assert read_checkpoint_weights(directory).weight_files == ("model.safetensors",)


def test_directory_without_weights_lists_what_it_holds(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError) as caught:
        read_checkpoint_weights(tmp_path)
    message = str(caught.value)
    assert "no model.safetensors or model.safetensors.index.json" in message
    assert "config.json, pytorch_model.bin" in message


def test_a_bad_header_surfaces_as_checkpoint_error_caused_by_the_header_error(
    tmp_path: Path,
) -> None:
    write_raw_safetensors(tmp_path / "model.safetensors", b"[]")
    with pytest.raises(CheckpointError, match="must be a JSON object") as caught:
        read_checkpoint_weights(tmp_path)
    assert isinstance(caught.value.__cause__, SafetensorsHeaderError)


@pytest.mark.parametrize(
    ("shard", "why"),
    [
        ("sub/model-00001-of-00002.safetensors", "not a plain file name"),
        ("../model-00001-of-00002.safetensors", "not a plain file name"),
        ("..", "not a plain file name"),
        ("/etc/passwd", "not a plain file name"),
        ("", "not a plain file name"),
        (7, "must be a shard file name"),
    ],
)
def test_shard_names_must_be_plain_basenames(tmp_path: Path, shard: object, why: str) -> None:
    directory = _sharded(tmp_path)
    weight_map = _weight_map(directory)
    weight_map["fc.weight"] = shard
    _rewrite_index(directory, weight_map)
    with pytest.raises(CheckpointError) as caught:
        read_checkpoint_weights(directory)
    assert why in str(caught.value)
    assert "'fc.weight'" in str(caught.value)


def test_index_tensor_missing_from_its_shard(tmp_path: Path) -> None:
    directory = _sharded(tmp_path)
    weight_map = _weight_map(directory)
    weight_map["layers.7.ghost.weight"] = "model-00002-of-00002.safetensors"
    _rewrite_index(directory, weight_map)
    with pytest.raises(CheckpointError) as caught:
        read_checkpoint_weights(directory)
    message = str(caught.value)
    assert "1 tensor(s) the index places in model-00002-of-00002.safetensors" in message
    assert "not in its header: layers.7.ghost.weight" in message


def test_shard_tensor_missing_from_the_index(tmp_path: Path) -> None:
    directory = _sharded(tmp_path)
    weight_map = _weight_map(directory)
    del weight_map["norm.weight"]
    _rewrite_index(directory, weight_map)
    with pytest.raises(CheckpointError) as caught:
        read_checkpoint_weights(directory)
    assert "holds tensor 'norm.weight', which the index does not list" in str(caught.value)


def test_tensor_stored_in_two_shards(tmp_path: Path) -> None:
    tensors = {"a": ("F32", [2]), "b": ("F32", [2])}
    write_safetensors(tmp_path / "s1.safetensors", tensors)
    write_safetensors(tmp_path / "s2.safetensors", {"b": ("F32", [2])})
    _rewrite_index(tmp_path, {"a": "s1.safetensors", "b": "s2.safetensors"})
    with pytest.raises(CheckpointError) as caught:
        read_checkpoint_weights(tmp_path)
    assert "tensor 'b' is stored in two shards, s1.safetensors and s2.safetensors" in str(
        caught.value
    )


def test_shard_file_named_by_the_index_is_missing(tmp_path: Path) -> None:
    directory = _sharded(tmp_path)
    (directory / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError) as caught:
        read_checkpoint_weights(directory)
    message = str(caught.value)
    assert "model-00002-of-00002.safetensors named by the index are missing" in message
    assert "model-00001-of-00002.safetensors" in message  # what the directory does hold


@pytest.mark.parametrize(
    ("index_text", "fragment"),
    [
        ('{"weight_map": {"a": "s.safetensors"', "invalid JSON"),
        ('{"weight_map": {"a": "s1", "a": "s2"}}', "duplicate key 'a'"),
        ('{"metadata": {"total_size": NaN}, "weight_map": {}}', "NaN"),
        ("[]", "must be a JSON object"),
        ('{"metadata": {}}', "must have a weight_map object"),
        ('{"weight_map": {}}', "weight_map is empty"),
    ],
)
def test_malformed_index(tmp_path: Path, index_text: str, fragment: str) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(index_text)
    with pytest.raises(CheckpointError) as caught:
        read_checkpoint_weights(tmp_path)
    assert fragment in str(caught.value)
    assert "model.safetensors.index.json" in str(caught.value)


def test_index_size_is_bounded(tmp_path: Path) -> None:
    _sharded(tmp_path)
    with pytest.raises(CheckpointError, match="larger than the limit of 64 bytes"):
        read_checkpoint_weights(tmp_path, max_index_bytes=64)


def test_broken_weights_symlink_is_reported_by_read_checkpoint_weights(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").symlink_to(tmp_path / "blob")
    with pytest.raises(CheckpointError, match="cannot read the safetensors file"):
        read_checkpoint_weights(tmp_path)
