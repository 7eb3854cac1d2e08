"""Reading safetensors headers, checkpoint directories and config.json without tensor data."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file
from testkit.st_fixtures import (
    drafter_tensors,
    write_drafter_checkpoint,
    write_json,
    write_raw_safetensors,
    write_safetensors,
    write_sharded_safetensors,
)

from dflash_recipes.checkpoint import safetensors_header
from dflash_recipes.checkpoint.config_json import read_json_config
from dflash_recipes.checkpoint.safetensors_header import TensorInfo, read_safetensors_header
from dflash_recipes.checkpoint.weight_index import read_checkpoint_weights
from dflash_recipes.compiler.model_paths import (
    CheckpointDirProblem,
    inspect_checkpoint_dir,
    inspect_model_dir,
    resolve_checkpoint_dir,
    resolve_local_path,
)
from dflash_recipes.errors import CheckpointError, SafetensorsHeaderError

ALL_DTYPES = sorted(safetensors_header.DTYPE_BITS)


def entry(dtype: object, shape: object, begin: object, end: object) -> dict[str, object]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


# ---------------------------------------------------------------------------------------------
# valid files: agreement with the safetensors library
# ---------------------------------------------------------------------------------------------


def test_reader_agrees_with_safetensors_for_every_dtype(tmp_path: Path) -> None:
    tensors = {f"t.{dt.lower()}": (dt, [2, 4]) for dt in ALL_DTYPES}
    tensors["scalar"] = ("F32", [])
    tensors["empty"] = ("BF16", [0, 3])
    path = write_safetensors(
        tmp_path / "all.safetensors", tensors, fill="random", metadata={"format": "pt"}
    )

    header = read_safetensors_header(path)

    with safe_open(path, framework="np") as oracle:
        assert sorted(oracle.keys()) == sorted(header.tensors)
        assert oracle.metadata() == dict(header.metadata)
        for name in oracle.keys():  # noqa: SIM118 (safe_open is not a dict)
            view = oracle.get_slice(name)
            assert header.tensors[name].dtype == view.get_dtype()
            assert list(header.tensors[name].shape) == list(view.get_shape())
    assert header.file_size == path.stat().st_size


def test_reads_a_file_written_by_the_safetensors_library(tmp_path: Path) -> None:
    path = tmp_path / "lib.safetensors"
    arrays: dict[str, npt.NDArray[Any]] = {
        "fc.weight": np.ones((4, 8), dtype=np.float32),
        "norm.weight": np.zeros((4,), dtype=np.float16),
        "ids": np.arange(6, dtype=np.int64).reshape(2, 3),
    }
    save_file(arrays, str(path), metadata={"note": "written by safetensors"})

    header = read_safetensors_header(path)

    assert {n: (t.dtype, t.shape) for n, t in header.tensors.items()} == {
        "fc.weight": ("F32", (4, 8)),
        "norm.weight": ("F16", (4,)),
        "ids": ("I64", (2, 3)),
    }
    assert header.metadata == {"note": "written by safetensors"}
    assert sum(t.nbytes for t in header.tensors.values()) == header.data_size


def test_tensor_info_offsets_are_the_files_own(tmp_path: Path) -> None:
    path = write_safetensors(
        tmp_path / "a.safetensors", {"a": ("F32", [3]), "b": ("U8", [5]), "c": ("BF16", [2])}
    )
    header = read_safetensors_header(path)
    assert header.tensors == {
        "a": TensorInfo("F32", (3,), (0, 12)),
        "b": TensorInfo("U8", (5,), (12, 17)),
        "c": TensorInfo("BF16", (2,), (17, 21)),
    }


def test_empty_header_is_a_valid_file_with_no_tensors(tmp_path: Path) -> None:
    path = write_raw_safetensors(tmp_path / "e.safetensors", b"{}  ")
    header = read_safetensors_header(path)
    assert header.tensors == {}
    assert header.metadata == {}


class _CountingFile:
    """Wraps a raw file and records every byte range read."""

    def __init__(self, inner: object, log: list[int]) -> None:
        self._inner = inner
        self._log = log

    def read(self, size: int = -1) -> bytes:
        data: bytes = self._inner.read(size)  # type: ignore[attr-defined]
        self._log.append(len(data))
        return data

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    def __enter__(self) -> _CountingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._inner.close()  # type: ignore[attr-defined]


def test_reads_nothing_but_the_header(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A 3 GB sparse file: its data region is never touched, and the read stops at the header.
    tensors = {f"layers.{i}.w": ("BF16", [1024, 1024 * 64]) for i in range(24)}
    path = write_safetensors(tmp_path / "big.safetensors", tensors, fill="sparse")
    assert path.stat().st_size > 3 * 2**30
    log: list[int] = []
    opened: list[tuple[object, ...]] = []

    def spy_open(*args: object, **kwargs: object) -> _CountingFile:
        opened.append((*args, *kwargs.items()))
        return _CountingFile(open(*args, **kwargs), log)  # type: ignore[call-overload]

    monkeypatch.setattr(safetensors_header, "open", spy_open, raising=False)

    header = read_safetensors_header(path)

    assert len(header.tensors) == 24
    assert sum(log) == 8 + header.header_size
    # Unbuffered: no read-ahead pulls tensor bytes into a buffer behind our back.
    assert ("buffering", 0) in opened[0]


# ---------------------------------------------------------------------------------------------
# one test per rejection rule, each asserting what the message tells the user
# ---------------------------------------------------------------------------------------------

GOOD = {"w": entry("F32", [2], 0, 8)}

# (id, header, data bytes, length prefix override, fragments the message must contain)
REJECTIONS: list[tuple[str, object, int, int | None, tuple[str, ...]]] = [
    ("invalid-json", b'{"w": ', 8, None, ("invalid JSON at line 1",)),
    ("header-is-a-list", b"[1, 2]", 0, None, ("must be a JSON object",)),
    ("header-is-a-string", b'"w"', 0, None, ("must be a JSON object",)),
    (
        "duplicate-tensor-name",
        b'{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
        b'"w":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}',
        2,
        None,
        ("duplicate key 'w'",),
    ),
    ("nan", b'{"w":{"dtype":"F32","shape":[NaN],"data_offsets":[0,8]}}', 8, None, ("NaN",)),
    (
        "infinity",
        b'{"w":{"dtype":"F32","shape":[Infinity],"data_offsets":[0,8]}}',
        8,
        None,
        ("Infinity",),
    ),
    (
        "minus-infinity",
        b'{"__metadata__":{"x":-Infinity}}',
        0,
        None,
        ("-Infinity",),
    ),
    (
        "unknown-dtype",
        {"w": entry("F128", [2], 0, 8)},
        8,
        None,
        ("tensor 'w'", "unknown dtype 'F128'", "BF16"),
    ),
    ("dtype-not-a-string", {"w": entry(3, [2], 0, 8)}, 8, None, ("unknown dtype 3",)),
    (
        "float-shape",
        {"w": entry("F32", [2.0], 0, 8)},
        8,
        None,
        ("tensor 'w'", "shape must be a list of integers >= 0", "2.0"),
    ),
    (
        "bool-shape",
        {"w": entry("F32", [True, 2], 0, 8)},
        8,
        None,
        ("tensor 'w'", "integers >= 0", "True"),
    ),
    (
        "negative-shape",
        {"w": entry("F32", [-2], 0, 8)},
        8,
        None,
        ("tensor 'w'", "integers >= 0", "-2"),
    ),
    (
        "shape-not-a-list",
        {"w": entry("F32", {"0": 2}, 0, 8)},
        8,
        None,
        ("tensor 'w'", "shape must be a list"),
    ),
    (
        "shape-dim-beyond-u64",
        {"w": entry("U8", [2**64], 0, 8)},
        8,
        None,
        ("tensor 'w'", "integers >= 0"),
    ),
    (
        "offsets-one-number",
        {"w": {"dtype": "F32", "shape": [2], "data_offsets": [8]}},
        8,
        None,
        ("tensor 'w'", "data_offsets must be two integers"),
    ),
    (
        "offsets-three-numbers",
        {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4, 8]}},
        8,
        None,
        ("tensor 'w'", "data_offsets must be two integers"),
    ),
    (
        "offsets-strings",
        {"w": entry("F32", [2], "0", 8)},
        8,
        None,
        ("tensor 'w'", "data_offsets must be two integers"),
    ),
    (
        "offsets-negative",
        {"w": entry("F32", [2], -8, 0)},
        8,
        None,
        ("tensor 'w'", "data_offsets must be two integers [begin, end] >= 0"),
    ),
    (
        "offsets-bool",
        {"w": entry("U8", [1], False, True)},
        1,
        None,
        ("tensor 'w'", "data_offsets must be two integers"),
    ),
    (
        "offsets-reversed",
        {"w": entry("F32", [0], 8, 0)},
        8,
        None,
        ("tensor 'w'", "end before they begin"),
    ),
    (
        "size-disagrees-with-shape",
        {"w": entry("F32", [3], 0, 8)},
        8,
        None,
        ("tensor 'w'", "shape [3] of F32 needs 12 bytes", "span 8"),
    ),
    (
        "offsets-past-end-of-file",
        {"w": entry("F32", [4], 0, 16)},
        8,
        None,
        ("tensor 'w'", "run past the end of the file", "holds 8 bytes"),
    ),
    (
        "overlap",
        {"a": entry("F32", [2], 0, 8), "b": entry("F32", [1], 4, 8)},
        8,
        None,
        ("'a'", "'b'", "overlap"),
    ),
    (
        "gap-at-start",
        {"w": entry("F32", [1], 4, 8)},
        8,
        None,
        ("tensor 'w' starts at byte 4", "gap of 4 bytes at the start"),
    ),
    (
        "gap-between",
        {"a": entry("F32", [1], 0, 4), "b": entry("F32", [1], 8, 12)},
        12,
        None,
        ("tensor 'b' starts at byte 8", "gap of 4 bytes after tensor 'a'"),
    ),
    (
        "trailing-bytes",
        GOOD,
        12,
        None,
        ("cover 8 bytes", "holds 12 bytes", "4 trailing bytes"),
    ),
    (
        "sub-byte-dtype-partial-byte",
        {"w": entry("F4", [3], 0, 2)},
        2,
        None,
        ("tensor 'w'", "sub-byte dtype F4", "whole bytes"),
    ),
    (
        "metadata-not-an-object",
        {"__metadata__": ["a"], **GOOD},
        8,
        None,
        ("__metadata__ must be an object of string values",),
    ),
    (
        "metadata-value-not-a-string",
        {"__metadata__": {"step": 3}, **GOOD},
        8,
        None,
        ("__metadata__['step'] must be a string", "3"),
    ),
    (
        "entry-missing-key",
        {"w": {"dtype": "F32", "shape": [2]}},
        8,
        None,
        ("tensor 'w'", "exactly dtype, shape, data_offsets", "missing data_offsets"),
    ),
    (
        "entry-extra-key",
        {"w": {**entry("F32", [2], 0, 8), "stride": [1]}},
        8,
        None,
        ("tensor 'w'", "unknown keys 'stride'"),
    ),
    ("entry-not-an-object", {"w": [0, 8]}, 8, None, ("tensor 'w'", "entry must be an object")),
    (
        "integer-with-too-many-digits",
        b'{"w":{"dtype":"U8","shape":[' + b"9" * 5000 + b'],"data_offsets":[0,1]}}',
        1,
        None,
        ("more than 20 digits",),
    ),
    (
        "nested-too-deeply",
        b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        0,
        None,
        ("nested too deeply",),
    ),
    (
        "surrogate-in-name",
        b'{"\\ud800":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
        1,
        None,
        ("unpaired UTF-16 surrogate",),
    ),
    ("invalid-utf8", b'{"\xff":1}', 0, None, ("not valid UTF-8", "byte 2")),
    (
        "length-past-end-of-file",
        GOOD,
        8,
        10_000,
        ("header length 10000 bytes runs past the end of the file",),
    ),
    (
        "length-over-the-cap",
        GOOD,
        8,
        2**63,
        (f"header length {2**63} bytes exceeds the limit of {100 * 2**20} bytes",),
    ),
]


@pytest.mark.parametrize(
    ("header", "data", "length", "fragments"),
    [pytest.param(*case[1:], id=case[0]) for case in REJECTIONS],
)
def test_rejects_with_a_message_naming_file_and_rule(
    tmp_path: Path, header: object, data: int, length: int | None, fragments: tuple[str, ...]
) -> None:
    path = write_raw_safetensors(
        tmp_path / "bad.safetensors",
        header,  # type: ignore[arg-type]
        data=data,
        length=length,
    )
    with pytest.raises(SafetensorsHeaderError) as caught:
        read_safetensors_header(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: ")
    for fragment in fragments:
        assert fragment in message


def test_rejects_a_file_too_short_for_the_length_prefix(tmp_path: Path) -> None:
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\x02\x00\x00")
    with pytest.raises(SafetensorsHeaderError, match="3 bytes, too short for a safetensors file"):
        read_safetensors_header(path)


def test_header_cap_is_configurable(tmp_path: Path) -> None:
    path = write_safetensors(tmp_path / "a.safetensors", {"w": ("F32", [2])})
    with pytest.raises(SafetensorsHeaderError, match="exceeds the limit of 16 bytes"):
        read_safetensors_header(path, max_header_bytes=16)


def test_missing_file_and_directory_raise_the_header_error(tmp_path: Path) -> None:
    with pytest.raises(SafetensorsHeaderError, match="cannot read the safetensors file"):
        read_safetensors_header(tmp_path / "absent.safetensors")
    with pytest.raises(SafetensorsHeaderError, match="not a regular file"):
        read_safetensors_header(tmp_path)


def test_safetensors_library_also_rejects_what_we_call_trailing_bytes(tmp_path: Path) -> None:
    # Our rule is the format's rule, not an extra strictness: the library refuses it too.
    path = write_raw_safetensors(tmp_path / "t.safetensors", GOOD, data=12)
    with pytest.raises(Exception, match="not fully covered"):
        safe_open(path, framework="np")
    with pytest.raises(SafetensorsHeaderError):
        read_safetensors_header(path)


# ---------------------------------------------------------------------------------------------
# checkpoint directories
# ---------------------------------------------------------------------------------------------


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


def _sharded(tmp_path: Path) -> Path:
    tensors = drafter_tensors(layers=1)
    write_sharded_safetensors(tmp_path, tensors, shards=2)
    return tmp_path


def _rewrite_index(directory: Path, weight_map: dict[str, object]) -> None:
    write_json(directory / "model.safetensors.index.json", {"weight_map": weight_map})


def _weight_map(directory: Path) -> dict[str, object]:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    weight_map: dict[str, object] = index["weight_map"]
    return weight_map


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


# ---------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------


def test_read_json_config_returns_the_object(tmp_path: Path) -> None:
    path = write_json(tmp_path / "config.json", {"hidden_size": 4096, "rope_theta": 1e6})
    assert read_json_config(path) == {"hidden_size": 4096, "rope_theta": 1e6}


def test_read_json_config_accepts_a_byte_order_mark(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(b'\xef\xbb\xbf{"a": 1}')
    assert read_json_config(path) == {"a": 1}


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b'{"rope_theta": NaN}', "NaN is not valid JSON"),
        (b'{"rope_theta": Infinity}', "Infinity is not valid JSON"),
        (b'{"a": 1, "a": 2}', "duplicate key 'a'"),
        (b"[1, 2]", "must be a JSON object, got list"),
        (b'{"a": ', "invalid JSON at line 1"),
        (b'{"a": "\xff"}', "not valid UTF-8"),
    ],
)
def test_read_json_config_rejects(tmp_path: Path, raw: bytes, fragment: str) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(raw)
    with pytest.raises(CheckpointError) as caught:
        read_json_config(path)
    assert str(caught.value).startswith(f"{path}: ")
    assert fragment in str(caught.value)


def test_read_json_config_is_bounded(tmp_path: Path) -> None:
    path = write_json(tmp_path / "config.json", {"pad": "x" * 200})
    with pytest.raises(CheckpointError, match="larger than the limit of 100 bytes"):
        read_json_config(path, max_bytes=100)


def test_read_json_config_missing_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="cannot read the config"):
        read_json_config(tmp_path / "config.json")


# ---------------------------------------------------------------------------------------------
# resolving and inspecting directories
# ---------------------------------------------------------------------------------------------


def _problem(value: str, base: Path | None) -> CheckpointDirProblem:
    problem = inspect_checkpoint_dir(value, base_dir=base)
    assert problem is not None
    return problem


def test_a_valid_checkpoint_has_no_problem(tmp_path: Path) -> None:
    write_drafter_checkpoint(tmp_path / "ck")
    assert inspect_checkpoint_dir(str(tmp_path / "ck"), base_dir=None) is None


def test_a_sharded_checkpoint_is_accepted(tmp_path: Path) -> None:
    write_drafter_checkpoint(tmp_path / "ck", shards=2)
    assert inspect_checkpoint_dir("ck", base_dir=tmp_path) is None


def test_relative_paths_resolve_against_the_recipe_folder_not_the_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipes = tmp_path / "recipes"
    write_drafter_checkpoint(recipes / "drafters" / "b16")
    monkeypatch.chdir(tmp_path)
    assert inspect_checkpoint_dir("drafters/b16", base_dir=recipes) is None
    assert resolve_checkpoint_dir("drafters/b16", base_dir=recipes, role="x") == (
        recipes / "drafters" / "b16"
    )
    # Without a recipe folder (a recipe built in Python) the working directory is the base.
    assert resolve_local_path("drafters/b16", base_dir=None) == tmp_path / "drafters" / "b16"


def test_home_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    write_drafter_checkpoint(tmp_path / "ck")
    assert inspect_checkpoint_dir("~/ck", base_dir=Path("/elsewhere")) is None
    assert resolve_local_path("~/ck", base_dir=Path("/elsewhere")) == tmp_path / "ck"


def test_hub_id_says_it_is_not_fetched_and_gives_the_staging_command(tmp_path: Path) -> None:
    problem = _problem("z-lab/Qwen3-8B-DFlash-b16", tmp_path)
    assert problem.kind == "hub-id"
    assert "hub ids are not fetched" in problem.message
    assert "hf download z-lab/Qwen3-8B-DFlash-b16 --local-dir <dir>" in problem.hint


def test_a_local_directory_named_like_a_hub_id_is_used(tmp_path: Path) -> None:
    write_drafter_checkpoint(tmp_path / "z-lab" / "Qwen3-8B-DFlash-b16")
    assert inspect_checkpoint_dir("z-lab/Qwen3-8B-DFlash-b16", base_dir=tmp_path) is None


def test_not_found_suggests_a_close_sibling(tmp_path: Path) -> None:
    write_drafter_checkpoint(tmp_path / "drafter-b16")
    problem = _problem(str(tmp_path / "drafter-b61"), None)
    assert problem.kind == "not-found"
    assert f"{tmp_path / 'drafter-b61'} does not exist" in problem.message
    assert f"did you mean {tmp_path / 'drafter-b16'}?" in problem.hint


def test_not_a_directory(tmp_path: Path) -> None:
    write_drafter_checkpoint(tmp_path / "ck")
    problem = _problem(str(tmp_path / "ck" / "model.safetensors"), None)
    assert problem.kind == "not-a-directory"
    assert "is a file, not a directory" in problem.message
    assert f"point it at the directory {tmp_path / 'ck'}" in problem.hint


def test_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "ck").mkdir()
    problem = _problem("ck", tmp_path)
    assert problem.kind == "empty-directory"
    assert "is empty" in problem.message
    assert "model.safetensors" in problem.message


def test_directory_without_weights_lists_its_files_and_what_is_expected(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    write_json(ck / "config.json", {})
    (ck / "pytorch_model.bin").write_bytes(b"")
    (ck / "runs").mkdir()
    problem = _problem("ck", tmp_path)
    assert problem.kind == "no-weights"
    assert "has no model.safetensors or model.safetensors.index.json" in problem.message
    assert "3 entries: config.json, pytorch_model.bin, runs/" in problem.message
    assert "expected an exported DFlash drafter: model.safetensors" in problem.hint


def test_weights_one_level_down_are_suggested(tmp_path: Path) -> None:
    write_drafter_checkpoint(tmp_path / "stage" / "export")
    problem = _problem("stage", tmp_path)
    assert problem.kind == "no-weights"
    assert f"did you mean {tmp_path / 'stage' / 'export'}?" in problem.hint


def test_broken_symlink_to_the_directory(tmp_path: Path) -> None:
    (tmp_path / "ck").symlink_to(tmp_path / "deleted")
    problem = _problem("ck", tmp_path)
    assert problem.kind == "broken-symlink"
    assert f"symbolic link to {tmp_path / 'deleted'}, which does not exist" in problem.message


def test_broken_symlink_for_the_weights_file(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "model.safetensors").symlink_to("../blobs/abc123")
    problem = _problem("ck", tmp_path)
    assert problem.kind == "broken-symlink"
    assert "model.safetensors is a symbolic link to ../blobs/abc123" in problem.message


def test_unlistable_directory_is_unreadable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "ck").mkdir()

    def refuse(self: Path) -> object:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "iterdir", refuse)
    problem = _problem("ck", tmp_path)
    assert problem.kind == "unreadable"
    assert "cannot be listed: Permission denied" in problem.message


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every file")
def test_unreadable_weights_file(tmp_path: Path) -> None:
    write_drafter_checkpoint(tmp_path / "ck")
    (tmp_path / "ck" / "model.safetensors").chmod(0)
    problem = _problem("ck", tmp_path)
    assert problem.kind == "unreadable"
    assert "chmod a+r" in problem.hint


def test_unreadable_weights_file_as_seen_by_access(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_drafter_checkpoint(tmp_path / "ck")
    real_access = os.access

    def no_read_for_weights(path: object, mode: int) -> bool:
        if str(path).endswith("model.safetensors"):
            return False
        return real_access(path, mode)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "access", no_read_for_weights)
    problem = _problem("ck", tmp_path)
    assert problem.kind == "unreadable"
    assert "is not readable by this user" in problem.message


def test_model_dir_needs_config_json(tmp_path: Path) -> None:
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "model.safetensors").write_bytes(b"")
    problem = inspect_model_dir("base", base_dir=tmp_path)
    assert problem is not None
    assert problem.kind == "no-config"
    assert "has no config.json" in problem.message
    write_json(tmp_path / "base" / "config.json", {})
    assert inspect_model_dir("base", base_dir=tmp_path) is None


def test_model_hub_id(tmp_path: Path) -> None:
    problem = inspect_model_dir("Qwen/Qwen3-8B", base_dir=tmp_path)
    assert problem is not None
    assert problem.kind == "hub-id"
    assert "hf download Qwen/Qwen3-8B --local-dir <dir>" in problem.hint


def test_resolve_checkpoint_dir_raises_with_role_and_fix(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as caught:
        resolve_checkpoint_dir(
            "z-lab/Qwen3-8B-DFlash-b16", base_dir=tmp_path, role="dflash.dflash_init_checkpoint"
        )
    message = str(caught.value)
    assert message.startswith("dflash.dflash_init_checkpoint: ")
    assert "\nfix: stage the drafter first: hf download z-lab/Qwen3-8B-DFlash-b16" in message


# ---------------------------------------------------------------------------------------------
# the compile path stays light
# ---------------------------------------------------------------------------------------------


def test_reading_checkpoints_imports_no_heavy_library(tmp_path: Path) -> None:
    write_drafter_checkpoint(tmp_path / "ck")
    code = (
        "import sys; from pathlib import Path\n"
        "from dflash_recipes.checkpoint.weight_index import read_checkpoint_weights\n"
        "from dflash_recipes.checkpoint.tensor_layout import expected_layout\n"
        f"read_checkpoint_weights(Path({str(tmp_path / 'ck')!r}))\n"
        "heavy = ('torch', 'transformers', 'safetensors', 'numpy')\n"
        "print(','.join(m for m in heavy if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == ""


def test_length_prefix_is_little_endian(tmp_path: Path) -> None:
    raw = json.dumps(GOOD).encode()
    path = tmp_path / "be.safetensors"
    path.write_bytes(struct.pack(">Q", len(raw)) + raw + bytes(8))
    with pytest.raises(SafetensorsHeaderError, match="exceeds the limit"):
        read_safetensors_header(path)


def test_leading_whitespace_is_accepted_like_the_library_does(tmp_path: Path) -> None:
    raw = b"  " + json.dumps(GOOD).encode()
    path = write_raw_safetensors(tmp_path / "lead.safetensors", raw, data=8)
    with safe_open(path, framework="np") as oracle:
        assert list(oracle.keys()) == ["w"]
    assert list(read_safetensors_header(path).tensors) == ["w"]


# ---------------------------------------------------------------------------------------------
# the 8B-scale fixture tool
# ---------------------------------------------------------------------------------------------


def test_make_8b_fixture_writes_the_qwen3_8b_drafter_layout_sparsely(tmp_path: Path) -> None:
    import yaml

    tool = Path(__file__).resolve().parents[1] / "benchmarks" / "make_8b_fixture.py"
    result = subprocess.run(
        [sys.executable, str(tool), str(tmp_path / "fx")],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert "58 tensors, BF16" in result.stdout

    drafter = tmp_path / "fx" / "drafter"
    weights = read_checkpoint_weights(drafter)
    assert len(weights.tensors) == 58
    assert weights.total_bytes == 2 * 1_048_626_432  # bf16, the published parameter count
    assert weights.shapes["fc.weight"] == (4096, 20480)
    with safe_open(drafter / "model.safetensors", framework="np") as oracle:
        assert sorted(oracle.keys()) == sorted(weights.tensors)

    config = read_json_config(drafter / "config.json")
    assert config["dflash_config"] == {
        "mask_token_id": 151669,
        "target_layer_ids": [1, 9, 17, 25, 33],
        "block_size": 16,
    }
    assert (config["num_target_layers"], config["rope_theta"]) == (36, 1_000_000.0)
    base = read_json_config(tmp_path / "fx" / "base" / "config.json")
    assert (base["num_hidden_layers"], base["hidden_size"], base["vocab_size"]) == (
        36,
        4096,
        151936,
    )

    recipe = yaml.safe_load((tmp_path / "fx" / "recipe.yaml").read_text())
    assert recipe["dflash"]["dflash_init_checkpoint"] == str(drafter)
    assert recipe["model"]["model_name_or_path"] == str(tmp_path / "fx" / "base")
    assert Path(recipe["data"]["data_path"]).is_file()
    assert recipe["dflash"]["dflash_architecture_config"]["intermediate_size"] == 12288

    # Last, as it may skip: the weights file must be a hole, not 2 GB of zeros.
    stat = (drafter / "model.safetensors").stat()
    assert stat.st_size > 2 * 10**9
    if stat.st_blocks * 512 >= stat.st_size:
        pytest.skip("this filesystem does not keep files sparse")
    assert stat.st_blocks * 512 < 10 * 2**20


def test_shape_larger_than_the_whole_file_is_reported_without_a_bogus_size(tmp_path: Path) -> None:
    header = {"w": entry("F32", [10**10, 10**10, 10**10], 0, 8)}
    path = write_raw_safetensors(tmp_path / "huge.safetensors", header, data=8)
    with pytest.raises(SafetensorsHeaderError) as caught:
        read_safetensors_header(path)
    message = str(caught.value)
    assert "tensor 'w': shape [10000000000, 10000000000, 10000000000] of F32" in message
    assert "needs more bytes than the whole data region of the file (8)" in message


def test_broken_weights_symlink_is_reported_by_read_checkpoint_weights(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").symlink_to(tmp_path / "blob")
    with pytest.raises(CheckpointError, match="cannot read the safetensors file"):
        read_checkpoint_weights(tmp_path)
