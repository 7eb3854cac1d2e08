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
    write_drafter_checkpoint,
    write_raw_safetensors,
    write_safetensors,
)

from dflash_recipes.checkpoint import safetensors_header
from dflash_recipes.checkpoint.config_json import read_json_config
from dflash_recipes.checkpoint.model_paths import (
    CheckpointDirProblem,
    inspect_checkpoint_dir,
)
from dflash_recipes.checkpoint.safetensors_header import TensorInfo, read_safetensors_header
from dflash_recipes.checkpoint.weight_index import read_checkpoint_weights
from dflash_recipes.errors import SafetensorsHeaderError

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
    with pytest.raises(SafetensorsHeaderError) as caught:
        read_safetensors_header(path)
    assert str(caught.value) == (
        f"{path}: file is 3 bytes, too short for a safetensors file (it starts with an 8-byte "
        "header length)"
    )


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


# ---------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# resolving and inspecting directories
# ---------------------------------------------------------------------------------------------


def _problem(value: str, base: Path | None) -> CheckpointDirProblem:
    problem = inspect_checkpoint_dir(value, base_dir=base)
    assert problem is not None
    return problem


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

    tool = Path(__file__).resolve().parents[2] / "benchmarks" / "make_8b_fixture.py"
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


@pytest.mark.parametrize("past", range(1, 9))
def test_a_length_prefix_just_past_the_end_names_the_rule_it_breaks(
    tmp_path: Path, past: int
) -> None:
    # the boundary: a header claimed 1-8 bytes longer than what follows the prefix
    body = b'{"__metadata__":{}}'
    path = tmp_path / "short.safetensors"
    path.write_bytes(struct.pack("<Q", len(body) + past) + body)
    with pytest.raises(SafetensorsHeaderError) as info:
        read_safetensors_header(path)
    message = str(info.value)
    assert f"header length {len(body) + past} bytes runs past the end of the file" in message
    assert f"({len(body) + 8} bytes)" in message and "truncated" in message


# ---------------------------------------------------------------------------------------------
# each rule's whole message, and the boundaries of its bounds
# ---------------------------------------------------------------------------------------------

U64_MAX = 2**64 - 1

EXACT_REJECTIONS = [
    (
        "missing-and-unknown-keys",
        {"w": {"dtype": "F32", "stride": 1, "zz": 2}},
        0,
        "tensor 'w': entry must have exactly dtype, shape, data_offsets "
        "(missing data_offsets, shape; unknown keys 'stride', 'zz')",
    ),
    (
        "unknown-dtype",
        {"w": entry("F33", [1], 0, 4)},
        4,
        "tensor 'w': unknown dtype 'F33' (known: " + ", ".join(ALL_DTYPES) + ")",
    ),
    (
        "shape-not-a-list",
        {"w": entry("F32", {"a": 1}, 0, 4)},
        4,
        "tensor 'w': shape must be a list of integers >= 0, got {'a': 1}",
    ),
    (
        "negative-dimension",
        {"w": entry("F32", [-1], 0, 4)},
        4,
        "tensor 'w': shape must be a list of integers >= 0, got dimension -1",
    ),
    (
        "dimension-of-u64-max-is-a-size-not-a-type-error",
        {"w": entry("U8", [U64_MAX], 0, 4)},
        4,
        f"tensor 'w': shape [{U64_MAX}] of U8 needs {U64_MAX} bytes, but data_offsets [0, 4] "
        "span 4",
    ),
    (
        "offset-of-u64-max-runs-past-the-end",
        {"w": entry("U8", [4], 0, U64_MAX)},
        4,
        f"tensor 'w': data_offsets [0, {U64_MAX}] run past the end of the file (the data region "
        "holds 4 bytes; the file is truncated or the header lies)",
    ),
    (
        "offset-not-an-integer",
        {"w": {"dtype": "U8", "shape": [4], "data_offsets": [0, "4"]}},
        4,
        "tensor 'w': data_offsets must be two integers [begin, end] >= 0, got [0, '4']",
    ),
    (
        "end-before-begin",
        {"w": entry("U8", [0], 4, 2)},
        4,
        "tensor 'w': data_offsets [4, 2] end before they begin",
    ),
    (
        "span-differs-from-the-shape",
        {"w": entry("U8", [2], 1, 4), "v": entry("U8", [1], 0, 1)},
        4,
        "tensor 'w': shape [2] of U8 needs 2 bytes, but data_offsets [1, 4] span 3",
    ),
    (
        "overlap",
        {"a": entry("U8", [4], 0, 4), "b": entry("U8", [2], 2, 4)},
        4,
        "tensor 'b' data_offsets [2, 4] overlap tensor 'a' [0, 4]",
    ),
    (
        "gap-at-the-start",
        {"a": entry("U8", [4], 2, 6)},
        6,
        "tensor 'a' starts at byte 2 but the previous data ends at 0: a gap of 2 bytes at the "
        "start (tensors must be contiguous, the first starting at 0)",
    ),
    (
        "trailing-bytes",
        {"a": entry("U8", [4], 0, 4)},
        7,
        "the tensors cover 4 bytes of data but the file holds 7 bytes after the header "
        "(3 trailing bytes belong to no tensor)",
    ),
    (
        "metadata-not-an-object",
        {"__metadata__": [1]},
        0,
        "__metadata__ must be an object of string values, got [1]",
    ),
    (
        "metadata-value-not-a-string",
        {"__metadata__": {"k": 1}},
        0,
        "__metadata__['k'] must be a string, got 1",
    ),
    (
        "surrogate-in-a-metadata-value",
        b'{"__metadata__":{"k":"\\ud800"}}',
        0,
        "__metadata__['k'] contains an unpaired UTF-16 surrogate escape",
    ),
    (
        "surrogate-in-a-metadata-key",
        b'{"__metadata__":{"\\ud800":"v"}}',
        0,
        "__metadata__['\\ud800'] contains an unpaired UTF-16 surrogate escape",
    ),
    (
        "surrogate-in-a-tensor-name",
        b'{"\\udc00":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
        1,
        "tensor name '\\udc00' contains an unpaired UTF-16 surrogate escape",
    ),
    ("an-array-header", b"[1]", 0, "the header must be a JSON object (it starts with '[1]')"),
    # 8 bytes: the length prefix alone is not too short; an empty header is not an object
    ("eight-bytes", b"", 0, "the header must be a JSON object (it starts with '')"),
]


@pytest.mark.parametrize(
    ("header", "data", "message"),
    [pytest.param(*case[1:], id=case[0]) for case in EXACT_REJECTIONS],
)
def test_each_rejection_says_exactly_which_rule_and_values(
    tmp_path: Path, header: Any, data: int, message: str
) -> None:
    path = write_raw_safetensors(tmp_path / "bad.safetensors", header, data=data)
    with pytest.raises(SafetensorsHeaderError) as caught:
        read_safetensors_header(path)
    assert str(caught.value) == f"{path}: {message}"


def test_a_header_exactly_at_the_cap_is_read(tmp_path: Path) -> None:
    path = write_raw_safetensors(tmp_path / "a.safetensors", {"w": entry("U8", [2], 0, 2)}, data=2)
    size = len(json.dumps({"w": entry("U8", [2], 0, 2)}).encode())
    assert read_safetensors_header(path, max_header_bytes=size).header_size == size
    with pytest.raises(SafetensorsHeaderError) as caught:
        read_safetensors_header(path, max_header_bytes=size - 1)
    assert str(caught.value) == (
        f"{path}: header length {size} bytes exceeds the limit of {size - 1} bytes "
        "(corrupt file or not a safetensors file)"
    )


def test_tensors_are_in_offset_order_then_by_name(tmp_path: Path) -> None:
    header = {
        "z": entry("U8", [4], 0, 4),
        "b": entry("U8", [0], 4, 4),
        "a": entry("U8", [0], 4, 4),
        "c": entry("U8", [2], 4, 6),
    }
    path = write_raw_safetensors(tmp_path / "a.safetensors", header, data=6)
    assert list(read_safetensors_header(path).tensors) == ["z", "a", "b", "c"]


def test_unreadable_files_name_the_os_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    absent = tmp_path / "absent.safetensors"
    with pytest.raises(SafetensorsHeaderError) as caught:
        read_safetensors_header(absent)
    assert str(caught.value) == (
        f"{absent}: cannot read the safetensors file: No such file or directory"
    )
    path = write_safetensors(tmp_path / "a.safetensors", {"w": ("F32", [2])})

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(safetensors_header, "open", refuse, raising=False)
    with pytest.raises(SafetensorsHeaderError) as caught:
        read_safetensors_header(path)
    assert str(caught.value) == f"{path}: cannot read the safetensors file: Permission denied"


class _Trickle:
    """A file that returns one byte per read, then ends."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def read(self, size: int, /) -> bytes:
        chunk, self.data = self.data[:1], self.data[1:]
        return chunk


def test_short_reads_are_joined_and_an_early_end_says_how_far_it_got() -> None:
    read_exact = safetensors_header._read_exact
    assert read_exact(_Trickle(b"abcdef"), 4, "f") == b"abcd"
    with pytest.raises(SafetensorsHeaderError) as caught:
        read_exact(_Trickle(b"abc"), 5, "f")
    assert str(caught.value) == "f: file ended while reading the header (3 of 5)"


def test_a_file_that_shrinks_while_read_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a file truncated between the size check and the reads (another writer, a network mount)
    real_fstat = os.fstat

    class Grown:
        def __init__(self, fd: int) -> None:
            self.st_size = real_fstat(fd).st_size + 100

    monkeypatch.setattr(os, "fstat", Grown)
    stub = tmp_path / "stub.safetensors"
    stub.write_bytes(b"\x02\x00\x00")
    with pytest.raises(SafetensorsHeaderError) as caught:
        read_safetensors_header(stub)
    assert str(caught.value) == f"{stub}: file ended while reading the header (3 of 8)"
    cut = write_raw_safetensors(tmp_path / "cut.safetensors", b"{}", length=40)
    with pytest.raises(SafetensorsHeaderError) as caught:
        read_safetensors_header(cut)
    assert str(caught.value) == f"{cut}: file ended while reading the header (2 of 40)"
