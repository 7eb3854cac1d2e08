"""A sharded checkpoint and its index, to break in the weight-index tests."""

from __future__ import annotations

import json
from pathlib import Path

from testkit.st_fixtures import (
    drafter_tensors,
    write_json,
    write_sharded_safetensors,
)


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
