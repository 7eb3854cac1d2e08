"""Fuzzing the safetensors header reader: only SafetensorsHeaderError may come out.

Valid headers are generated, then mutated at the byte, token and structure level (and in
the length prefix and data size). Whatever the reader accepts, the `safetensors` library
must accept too, with the same names, dtypes and shapes.
"""

from __future__ import annotations

import json
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from dflash_recipes.checkpoint.safetensors_header import DTYPE_BITS, read_safetensors_header
from dflash_recipes.errors import SafetensorsHeaderError

WHOLE_BYTE_DTYPES = sorted(d for d, bits in DTYPE_BITS.items() if bits % 8 == 0)

# Tokens that a hostile or corrupt header might hold where a number or string belongs.
NASTY_TOKENS = [
    "NaN",
    "Infinity",
    "-Infinity",
    "1e999",
    "-1",
    "1.5",
    "2.0",
    "true",
    "false",
    "null",
    "18446744073709551616",
    "9" * 30,
    '"8"',
    '"F32"',
    '"BF17"',
    "[]",
    "{}",
    "[0]",
    '"\\ud800"',
    '{"dtype":"F32"}',
    "[" * 50 + "]" * 50,
]


NAME_POOL = [
    "fc.weight",
    "norm.weight",
    "layers.0.mlp.up_proj.weight",
    "layers.10.self_attn.q_norm.weight",
    "",
    "__metadata",
    "a",
    "ü.λ",
    "x" * 40,
    "with space",
    'quote"d',
    "back\\slash",
]


@st.composite
def valid_headers(draw: st.DrawFn) -> tuple[dict[str, object], int]:
    names = draw(st.lists(st.sampled_from(NAME_POOL), max_size=5, unique=True))
    header: dict[str, object] = {}
    if draw(st.booleans()):
        header["__metadata__"] = draw(
            st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3)
        )
    offset = 0
    for name in names:
        dtype = draw(st.sampled_from(WHOLE_BYTE_DTYPES))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        size = DTYPE_BITS[dtype] // 8
        for dim in shape:
            size *= dim
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    return header, offset


def _replace_random_value(
    draw: st.DrawFn, node: object, replacement: object, depth: int = 0
) -> object:
    """Replace one randomly chosen value somewhere inside `node` with `replacement`."""
    if isinstance(node, dict) and node and depth < 4 and draw(st.booleans()):
        key = draw(st.sampled_from(sorted(node)))
        return {**node, key: _replace_random_value(draw, node[key], replacement, depth + 1)}
    if isinstance(node, list) and node and depth < 4 and draw(st.booleans()):
        index = draw(st.integers(0, len(node) - 1))
        copy = list(node)
        copy[index] = _replace_random_value(draw, node[index], replacement, depth + 1)
        return copy
    return replacement


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3)
    ),
    max_leaves=6,
)


@st.composite
def mutated_files(draw: st.DrawFn) -> tuple[bytes, int, int | None]:
    """(header bytes, data size, length prefix or None for the true length)."""
    header, data_size = draw(valid_headers())
    kind = draw(
        st.sampled_from(["none", "structure", "token", "bytes", "duplicate", "garbage", "drop"])
    )
    if kind == "structure":
        header = _replace_random_value(draw, header, draw(json_values))  # type: ignore[assignment]
    text = json.dumps(header)
    if kind == "token":
        spots = [i for i, ch in enumerate(text) if ch.isdigit() or ch == '"']
        if spots:
            at = draw(st.sampled_from(spots))
            end = at + 1
            while end < len(text) and text[end].isdigit():
                end += 1
            text = text[:at] + draw(st.sampled_from(NASTY_TOKENS)) + text[end:]
    raw = text.encode("utf-8")
    if kind == "bytes" and raw:
        for _ in range(draw(st.integers(1, 4))):
            at = draw(st.integers(0, max(len(raw) - 1, 0)))
            action = draw(st.sampled_from(["flip", "insert", "delete"]))
            byte = bytes([draw(st.integers(0, 255))])
            if action == "flip":
                raw = raw[:at] + byte + raw[at + 1 :]
            elif action == "insert":
                raw = raw[:at] + byte + raw[at:]
            else:
                raw = raw[:at] + raw[at + 1 :]
    if kind == "duplicate" and isinstance(header, dict) and len(header) > 0:
        name = draw(st.sampled_from(sorted(header)))
        raw = raw[:-1] + b", " + json.dumps({name: header[name]}).encode()[1:]
    if kind == "garbage":
        raw = draw(st.binary(max_size=64))
    if kind == "drop" and raw:
        raw = raw[: draw(st.integers(0, len(raw) - 1))]
    raw += b" " * draw(st.integers(0, 7))
    data_size += draw(st.sampled_from([0, 0, 0, -1, 1, 7]))
    length = draw(
        st.none()
        | st.integers(0, 2**64 - 1)
        | st.integers(-3, 3).map(lambda d: max(len(raw) + d, 0))
    )
    return raw, max(data_size, 0), length


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as name:
        yield Path(name)


@settings(
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(case=mutated_files())
def test_reader_raises_only_its_own_error(
    scratch: Path, case: tuple[bytes, int, int | None]
) -> None:
    raw, data_size, length = case
    path = scratch / "fuzz.safetensors"
    prefix = struct.pack("<Q", len(raw) if length is None else length)
    path.write_bytes(prefix + raw + bytes(data_size))
    try:
        header = read_safetensors_header(path, max_header_bytes=1 << 20)
    except SafetensorsHeaderError as exc:
        event("rejected")
        message = str(exc)
        assert message.startswith(f"{path}: ")
        message.encode("utf-8")  # printable as is: no lone surrogates leak into messages
        return
    # Accepted: the reference implementation must agree on every tensor.
    event("accepted")
    with safe_open(path, framework="np") as oracle:
        assert sorted(oracle.keys()) == sorted(header.tensors)
        for name in oracle.keys():  # noqa: SIM118 (safe_open is not a dict)
            view = oracle.get_slice(name)
            assert view.get_dtype() == header.tensors[name].dtype
            assert list(view.get_shape()) == list(header.tensors[name].shape)
