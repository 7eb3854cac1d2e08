"""Property: whatever bytes or JSON values a file holds, a reader raises only our own errors.

Covers every compile-side reader behind a CLI command: the recipe loader, the plan loader
(bytes, and a real plan with one value replaced and the fingerprint recomputed), config.json
(as read and as interpreted), the safetensors header, the shard index and the metrics file.
The executor's readers (trainer_state.json, data and eval prompt lines) are in
tests/executor/test_readers_property.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import struct
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from testkit.fuzzing import FUZZ, json_values

from dflash_recipes.checkpoint.config_json import read_json_config
from dflash_recipes.checkpoint.hfconfig import read_checkpoint_config, read_target_config
from dflash_recipes.checkpoint.safetensors_header import read_safetensors_header
from dflash_recipes.checkpoint.weight_index import read_checkpoint_weights
from dflash_recipes.errors import DFlashRecipeError
from dflash_recipes.files.metrics_rows import read_metrics
from dflash_recipes.plan.run_plan import RunPlan, _canonical
from dflash_recipes.recipe.loader import load_recipe, load_recipe_with_diagnostics

#: Raw bytes, JSON text of any value, and a few shapes known to break naive parsers.
file_bytes = st.one_of(
    st.binary(max_size=512),
    json_values.map(lambda v: json.dumps(v).encode("utf-8")),
    st.sampled_from(
        [
            b"[" * 100_000 + b"]" * 100_000,
            b'{"a": ' + b"9" * 5000 + b"}",
            b'{"a": NaN, "b": -Infinity}',
            b'{"a": 1e999}',
            b'"\\ud800"',
            b"\xef\xbb\xbf{}",
        ]
    ),
)


def only_our_errors(call: Any, *args: Any) -> None:
    with contextlib.suppress(DFlashRecipeError):
        call(*args)


@FUZZ
@given(raw=file_bytes)
def test_recipe_loader(tmp_path: Path, raw: bytes) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_bytes(raw)
    load_recipe_with_diagnostics(path)  # never raises at all
    only_our_errors(load_recipe, path)


@FUZZ
@given(raw=file_bytes)
def test_plan_loader_bytes(raw: bytes) -> None:
    only_our_errors(RunPlan.from_json, raw)


def _leaf_paths(node: object, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if isinstance(node, dict):
        paths = [prefix] if prefix else []
        for key, value in node.items():
            paths += _leaf_paths(value, (*prefix, key))
        return paths
    return [prefix]


@FUZZ
@given(data=st.data(), value=json_values)
def test_plan_loader_values(plan_dict: dict[str, Any], data: st.DataObject, value: Any) -> None:
    paths = [p for p in _leaf_paths(plan_dict) if p != ("fingerprint",)]
    path = data.draw(st.sampled_from(paths))
    edited = json.loads(json.dumps(plan_dict))
    node = edited
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    del edited["fingerprint"]
    try:
        canonical = _canonical(edited)
    except ValueError:  # NaN/Infinity: json refuses to write it, so no forger can either
        return
    edited["fingerprint"] = hashlib.sha256(canonical).hexdigest()
    only_our_errors(RunPlan.from_dict, edited)
    only_our_errors(RunPlan.from_json, json.dumps(edited))


@FUZZ
@given(raw=file_bytes)
def test_config_json_readers(tmp_path: Path, raw: bytes) -> None:
    (tmp_path / "config.json").write_bytes(raw)
    only_our_errors(read_json_config, tmp_path / "config.json")
    only_our_errors(read_target_config, tmp_path)
    only_our_errors(read_checkpoint_config, tmp_path)


@FUZZ
@given(value=json_values)
def test_config_json_values(tmp_path: Path, value: Any) -> None:
    document = value if isinstance(value, dict) else {"hidden_size": value, "layer_types": value}
    (tmp_path / "config.json").write_text(json.dumps(document), encoding="utf-8")
    only_our_errors(read_target_config, tmp_path)
    only_our_errors(read_checkpoint_config, tmp_path)


@FUZZ
@given(header=file_bytes, tail=st.binary(max_size=64))
def test_safetensors_header_reader(tmp_path: Path, header: bytes, tail: bytes) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + tail)
    only_our_errors(read_safetensors_header, path)
    path.write_bytes(header + tail)  # no valid length prefix at all
    only_our_errors(read_safetensors_header, path)


@FUZZ
@given(raw=file_bytes)
def test_shard_index_reader(tmp_path: Path, raw: bytes) -> None:
    folder = tmp_path / "sharded"
    folder.mkdir(exist_ok=True)
    (folder / "model.safetensors.index.json").write_bytes(raw)
    only_our_errors(read_checkpoint_weights, folder)


@FUZZ
@given(raw=file_bytes)
def test_metrics_reader(tmp_path: Path, raw: bytes) -> None:
    (tmp_path / "metrics.jsonl").write_bytes(raw)
    only_our_errors(read_metrics, tmp_path)
