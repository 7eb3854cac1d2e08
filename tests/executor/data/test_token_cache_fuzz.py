"""Fuzzing the tokenized-data cache's readers: an entry's meta.json and its index (offsets).

Whatever meta.json holds, :func:`entry_problem` says why the entry cannot be used (it is then
rebuilt) and never raises; whatever the arrays hold, reading the examples raises only a
DataError naming the damaged folder (a bad offset never sizes a read).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import event, given
from hypothesis import strategies as st
from testkit.cache_data import cache_tokenizer, write_cache_data
from testkit.fuzzing import FUZZ, json_values

from dflash_recipes.data.sources import resolve_source
from dflash_recipes.errors import DataError
from dflash_recipes.executor.data.token_build import prepared_examples
from dflash_recipes.executor.data.token_cache import (
    META_FILE,
    CachedExamples,
    TokenizeSettings,
    cache_key,
    entry_problem,
)
from dflash_recipes.executor.demo.tiny_tokenizer import TINY_CHAT_TEMPLATE

SETTINGS = TokenizeSettings(TINY_CHAT_TEMPLATE, True, 64, 4)


@pytest.fixture(scope="module")
def entry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, object]]]:
    """A real entry (folder) and the key it was made for."""
    root = tmp_path_factory.mktemp("cache")
    data = write_cache_data(root / "d.jsonl", 12)
    source = resolve_source(data, setting="data.data_path")
    cache = root / "cache"
    prepared_examples(source, cache_tokenizer(), SETTINGS, cache_dir=cache, num_proc=1)
    (folder,) = (p for p in cache.iterdir() if p.is_dir())
    yield folder, cache_key(source, cache_tokenizer(), SETTINGS)


def _copy(folder: Path, into: Path) -> Path:
    target = into / "entry"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(folder, target)
    return target


def _replace_somewhere(draw: st.DrawFn, node: object, value: object, depth: int = 0) -> object:
    if isinstance(node, dict) and node and depth < 4 and draw(st.booleans()):
        key = draw(st.sampled_from(sorted(node)))
        return {**node, key: _replace_somewhere(draw, node[key], value, depth + 1)}
    if isinstance(node, list) and node and depth < 4 and draw(st.booleans()):
        index = draw(st.integers(0, len(node) - 1))
        return [
            *node[:index],
            _replace_somewhere(draw, node[index], value, depth + 1),
            *node[index + 1 :],
        ]
    return value


@st.composite
def hostile_meta(draw: st.DrawFn, meta: dict[str, object]) -> bytes:
    kind = draw(st.sampled_from(["structure", "bytes", "deep", "huge int", "surrogate"]))
    if kind == "structure":
        return json.dumps(_replace_somewhere(draw, meta, draw(json_values))).encode()
    if kind == "deep":
        return b'{"format": "dflash-token-cache", "key": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    if kind == "huge int":
        return json.dumps({**meta, "stats": {**meta["stats"], "num_tokens": 10**30}}).encode()  # type: ignore[dict-item]
    if kind == "surrogate":
        return json.dumps({**meta, "source": "\ud800"}).encode()
    return draw(st.binary(max_size=256))


@FUZZ
@given(data=st.data())
def test_any_meta_json_is_a_reason_to_rebuild_never_an_exception(
    tmp_path: Path, entry: tuple[Path, dict[str, object]], data: st.DataObject
) -> None:
    folder, key = entry
    meta = json.loads((folder / META_FILE).read_text(encoding="utf-8"))
    target = _copy(folder, tmp_path)
    (target / META_FILE).write_bytes(data.draw(hostile_meta(meta)))
    problem, _ = entry_problem(target, key)
    event("usable" if problem is None else "rebuilt")
    if problem is not None:
        problem.encode("utf-8")
        assert len(problem) < 1000


@FUZZ
@given(
    offsets=st.lists(
        st.one_of(
            st.integers(-(2**63), 2**63 - 1),
            st.integers(-3, 400),
            st.sampled_from([2**62, 2**40, -1]),
        ),
        min_size=1,
        max_size=16,
    ),
    cut=st.sampled_from(["", "input_ids.bin", "loss_mask.bin", "offsets.bin"]),
)
def test_any_index_reads_as_examples_or_a_data_error(
    tmp_path: Path, entry: tuple[Path, dict[str, object]], offsets: list[int], cut: str
) -> None:
    folder, _ = entry
    target = _copy(folder, tmp_path)
    (target / "offsets.bin").write_bytes(np.array(offsets, dtype=np.int64).tobytes())
    (target / "truncated.bin").write_bytes(bytes(len(offsets) - 1))
    if cut:
        raw = (target / cut).read_bytes()
        (target / cut).write_bytes(raw[: len(raw) // 2])
    try:
        examples = CachedExamples(target)
        try:
            for example in examples:
                assert len(example.input_ids) == len(example.loss_mask)
            examples.lengths()
        finally:
            examples.close()
    except DataError as exc:
        event("refused")
        assert str(exc).startswith(f"the tokenized data cache {target} ")
        return
    event("read")
