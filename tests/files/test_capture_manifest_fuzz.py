"""Fuzzing the capture manifest reader: whatever manifest.json holds, only a DataError comes out,
short and printable; what it accepts has every size within its bound (nothing is sized by more).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import event, given
from hypothesis import strategies as st
from testkit.fuzzing import FUZZ, json_values

from dflash_recipes.checkpoint.config_bounds import MAX_LAYER_INDEX, plausible_maximum
from dflash_recipes.errors import DataError
from dflash_recipes.files.capture_manifest import (
    MANIFEST_FILE,
    CaptureManifest,
    ShardEntry,
    chat_template_sha256,
    parse_manifest,
    read_manifest,
)

HEX = "0123456789abcdef" * 4
GOOD = CaptureManifest(
    base_model_path="/models/base",
    base_config_sha256=HEX,
    tokenizer_sha256=HEX,
    chat_template_sha256=None,
    data_path="train.jsonl",
    data_sha256=HEX,
    answer_only_loss=True,
    target_layer_ids=(1, 5),
    hidden_size=4,
    dtype="float32",
    training_seq_len=8,
    block_size=4,
    last_hidden_state=False,
    num_samples=2,
    num_tokens=5,
    num_truncated=0,
    bytes_per_token=37,
    estimated_bytes=761,
    shards=(ShardEntry("shard-00000.safetensors", 0, 2, 5, bytes=1, sha256=HEX),),
    complete=True,
).to_dict()
#: Values at and just beyond each bound, and far beyond it.
EDGES = [
    0,
    -1,
    MAX_LAYER_INDEX,
    MAX_LAYER_INDEX + 1,
    plausible_maximum("hidden_size"),
    plausible_maximum("hidden_size") + 1,
    2**24,
    2**24 + 1,
    2**63 - 1,
    2**63,
    10**19,
    "x" * 3_000_000,
    "\ud800",
    [0] * 5000,
    True,
]


def _replace_somewhere(draw: st.DrawFn, node: object, value: object, depth: int = 0) -> object:
    if isinstance(node, dict) and node and depth < 4 and draw(st.booleans()):
        key = draw(st.sampled_from(sorted(node)))
        return {**node, key: _replace_somewhere(draw, node[key], value, depth + 1)}
    if isinstance(node, list) and node and depth < 4 and draw(st.booleans()):
        index = draw(st.integers(0, len(node) - 1))
        copy = list(node)
        copy[index] = _replace_somewhere(draw, node[index], value, depth + 1)
        return copy
    return value


@st.composite
def manifests(draw: st.DrawFn) -> str:
    kind = draw(st.sampled_from(["edge", "structure", "deep", "text"]))
    if kind == "edge":
        return json.dumps(_replace_somewhere(draw, GOOD, draw(st.sampled_from(EDGES))))
    if kind == "structure":
        return json.dumps(_replace_somewhere(draw, GOOD, draw(json_values)))
    if kind == "deep":
        return '{"format": "dflash-capture", "shards": ' + "[" * 50_000 + "]" * 50_000 + "}"
    return draw(st.text(max_size=200))


@FUZZ
@given(text=manifests())
def test_any_manifest_text_is_read_or_refused_with_a_data_error(text: str) -> None:
    try:
        parsed = parse_manifest(text, "cap/manifest.json")
    except DataError as exc:
        event("refused")
        message = str(exc)
        assert message.startswith("cap/manifest.json: ")
        assert len(message) < 1000
        message.encode("utf-8")
        return
    event("read")
    assert parsed.hidden_size <= plausible_maximum("hidden_size")
    assert parsed.block_size <= plausible_maximum("block_size")
    assert parsed.training_seq_len <= 2**24
    assert max(parsed.target_layer_ids) <= MAX_LAYER_INDEX
    assert all(s.num_tokens < 2**63 for s in parsed.shards)


@FUZZ
@given(raw=st.one_of(st.binary(max_size=300), manifests().map(str.encode)))
def test_any_manifest_file_is_read_or_refused_with_a_data_error(tmp_path: Path, raw: bytes) -> None:
    (tmp_path / MANIFEST_FILE).write_bytes(raw)
    try:
        read_manifest(tmp_path)
    except DataError as exc:
        event("refused")
        str(exc).encode("utf-8")


def test_a_fifo_in_place_of_the_manifest_is_refused_not_waited_on(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / MANIFEST_FILE)
    with pytest.raises(DataError, match="not a regular file"):
        read_manifest(tmp_path)


@pytest.mark.parametrize(
    "content",
    [
        b"[" * 50_000,
        b'{"chat_template": "\\ud800"}',
        b"\xff",
        b'{"model_max_length": ' + b"9" * 31 + b"}",
    ],
)
def test_the_template_hash_reads_any_tokenizer_config(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "tokenizer_config.json").write_bytes(content)
    chat_template_sha256(None, tmp_path)  # a hash or None, never an exception


def test_the_template_hash_reads_a_config_with_a_30_digit_integer(tmp_path: Path) -> None:
    config = '{"model_max_length": 1000000000000000019884624838656, "chat_template": "t"}'
    (tmp_path / "tokenizer_config.json").write_text(config, encoding="utf-8")
    assert chat_template_sha256(None, tmp_path) is not None


@pytest.mark.parametrize(
    ("name", "bound"),
    [
        ("hidden_size", plausible_maximum("hidden_size")),
        ("block_size", plausible_maximum("block_size")),
        ("training_seq_len", 2**24),
        ("num_tokens", 2**63 - 1),
    ],
)
def test_a_size_at_its_bound_is_read_and_one_beyond_is_refused(name: str, bound: int) -> None:
    assert getattr(parse_manifest(json.dumps({**GOOD, name: bound}), "m"), name) == bound
    with pytest.raises(DataError) as caught:
        parse_manifest(json.dumps({**GOOD, name: bound + 1}), "m")
    assert str(caught.value).startswith(f"m: {name} must be at most {bound}, got {bound + 1}; ")


def test_taps_beyond_the_layer_bound_are_refused() -> None:
    with pytest.raises(
        DataError, match=r"target_layer_ids must be at most 4096 layer ids in \[0, 4095\]"
    ):
        parse_manifest(json.dumps({**GOOD, "target_layer_ids": [1, MAX_LAYER_INDEX + 1]}), "m")
