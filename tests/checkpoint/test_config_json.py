"""config.json read as one strict, bounded JSON object."""

from __future__ import annotations

from pathlib import Path

import pytest
from testkit.st_fixtures import (
    write_json,
)

from dflash_recipes.checkpoint.config_json import read_json_config
from dflash_recipes.errors import CheckpointError


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
