"""Fuzzing the eval prompt readers (JSON lists, Parquet columns): only a DataError comes out,
short and printable, for any bytes, depth, size or encoding (no torch is loaded here)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import event, given
from hypothesis import strategies as st
from testkit.fuzzing import FUZZ, json_values

from dflash_recipes.errors import DataError
from dflash_recipes.executor.evaluation import prompt_files
from dflash_recipes.executor.evaluation.prompt_files import read_json_prompts, read_parquet_prompts

HOSTILE = [
    b"[" * 50_000 + b"]" * 50_000,
    b'["ok", ' + b"[" * 50_000 + b"]" * 50_000 + b"]",
    b'["\\ud800"]',
    b'[[{"role": "\\udfff", "content": "x"}]]',
    b"[" + b"9" * 5000 + b"]",
    b"[NaN]",
    b"\xff\xfe",
    json.dumps(["x" * 3_000_000]).encode(),
    json.dumps([[{"role": "user", "content": "x"}] * 3]).encode(),
]


def _check(exc: DataError) -> None:
    message = str(exc)
    message.encode("utf-8")
    assert len(message) < 5000


@FUZZ
@given(
    raw=st.one_of(
        st.sampled_from(HOSTILE),
        st.binary(max_size=200),
        json_values.map(lambda v: json.dumps(v).encode()),
    )
)
def test_any_json_prompt_file_reads_or_is_a_data_error(tmp_path: Path, raw: bytes) -> None:
    path = tmp_path / "prompts.json"
    path.write_bytes(raw)
    try:
        read_json_prompts(path)
    except DataError as exc:
        event("refused")
        _check(exc)
        return
    event("read")


def test_a_json_prompt_file_over_the_bound_is_refused_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "prompts.json"
    path.write_text('["a", "b"]', encoding="utf-8")
    monkeypatch.setattr(prompt_files, "MAX_JSON_BYTES", 10)
    assert len(read_json_prompts(path)) == 2  # exactly at the bound
    monkeypatch.setattr(prompt_files, "MAX_JSON_BYTES", 9)
    with pytest.raises(DataError, match="larger than the limit of 9 bytes"):
        read_json_prompts(path)


def test_deep_json_prompts_are_a_data_error(tmp_path: Path) -> None:
    path = tmp_path / "prompts.json"
    path.write_bytes(b"[" * 50_000 + b"]" * 50_000)
    with pytest.raises(DataError, match=r"is not readable JSON: invalid JSON: nested too deeply$"):
        read_json_prompts(path)


def _parquet() -> bytes:
    table = pa.table({"prompt": ["one", "two" * 50, "three"], "other": [1, 2, 3]})
    sink = io.BytesIO()
    pq.write_table(table, sink, row_group_size=1)
    return sink.getvalue()


PARQUET = _parquet()


@FUZZ
@given(
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=4),
    cut=st.integers(0, 2048),
    column=st.one_of(st.none(), st.sampled_from(["prompt", "other", "x" * 3000, "\ud800"])),
)
def test_any_parquet_prompt_file_reads_or_is_a_data_error(
    tmp_path: Path, flips: list[tuple[int, int]], cut: int, column: str | None
) -> None:
    raw = bytearray(PARQUET)
    for at, byte in flips:
        raw[at % len(raw)] = byte
    path = tmp_path / "prompts.parquet"
    path.write_bytes(bytes(raw[: max(len(raw) - cut, 0)]))
    try:
        read_parquet_prompts(path, column)
    except DataError as exc:
        event("refused")
        _check(exc)
        return
    event("read")
