"""Fuzzing the input readers (JSONL, gzip, Parquet, Arrow, `datasets` folders): whatever the
bytes, only a DataError comes out of resolving, sniffing the columns (compile) and reading the
rows (run), and a bad row is a skipped line with its number, never an exception.

Sizes, depths and encodings are taken at and beyond their bounds: lines at and over
MAX_LINE_BYTES, nesting far past the recursion limit, integers past the digit limit, lone
surrogates, bytes that are not UTF-8, truncated and bit-flipped columnar files.
"""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import event, example, given
from hypothesis import strategies as st
from testkit.fuzzing import FUZZ, json_values

from dflash_recipes.data import sources
from dflash_recipes.data.conversations import Conversation, SkippedLine, conversation_of
from dflash_recipes.data.sources import iter_rows, resolve_source, source_columns
from dflash_recipes.errors import DataError

GOOD = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
HOSTILE_LINES = [
    b"[" * 50_000 + b"]" * 50_000,
    b'{"messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    b'{"messages": ' + b"9" * 5000 + b"}",
    b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
    b'{"messages": [{"role": "\\udfff", "content": "x"}, {"role": "assistant", "content": "y"}]}',
    b'{"messages": NaN}',
    b'{"conversations": [{"from": "human", "value": 1e999}]}',
    b"\xff\xfe\x00garbage",
    b"\xef\xbb\xbf" + json.dumps(GOOD).encode(),
    json.dumps({"messages": [{"role": "user", "content": "x" * 3_000_000}]}).encode(),
]


def _read_all(path: Path) -> list[Conversation | SkippedLine]:
    """What compile (the column sniff) and run (every row) do with an input."""
    source = resolve_source(path, setting="data.data_path")
    source_columns(source)
    items = []
    for number, row in iter_rows(source):
        item = conversation_of(number, row, answer_only_loss=True)
        if item is not None:
            items.append(item)
    return items


lines = st.lists(
    st.one_of(
        st.sampled_from(HOSTILE_LINES),
        st.binary(max_size=64),
        json_values.map(lambda v: json.dumps(v).encode()),
        st.just(json.dumps(GOOD).encode()),
    ),
    max_size=8,
)


@FUZZ
@given(rows=lines, gzipped=st.booleans(), cut=st.integers(0, 64))
def test_jsonl_readers_raise_only_data_errors(
    tmp_path: Path, rows: list[bytes], gzipped: bool, cut: int
) -> None:
    raw = b"\n".join(row.replace(b"\n", b" ") for row in rows)
    if gzipped:
        raw = gzip.compress(raw)
        raw = raw[: len(raw) - cut] if cut else raw  # a truncated stream
    path = tmp_path / ("d.jsonl.gz" if gzipped else "d.jsonl")
    path.write_bytes(raw)
    try:
        items = _read_all(path)
    except DataError as exc:
        event("refused")
        str(exc).encode("utf-8")
        return
    event("read")
    numbers = [item.line for item in items]
    assert numbers == sorted(set(numbers))
    if not gzipped:
        good = json.dumps(GOOD).encode().replace(b"\n", b" ")
        used = [item.line for item in items if isinstance(item, Conversation)]
        expected = [
            n
            for n, row in enumerate(raw.split(b"\n"), start=1)
            if row in (good, b"\xef\xbb\xbf" + good)
        ]
        assert used == expected


def test_a_line_at_the_bound_is_read_and_one_beyond_it_is_skipped_by_number(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = json.dumps(GOOD).encode()
    monkeypatch.setattr(sources, "MAX_LINE_BYTES", len(good) + 1)  # the line and its newline
    long = json.dumps({**GOOD, "pad": "x" * 10}).encode()
    path = tmp_path / "d.jsonl"
    path.write_bytes(good + b"\n" + long + b"\n" + long + b"\n" + good)
    items = _read_all(path)
    assert [(item.line, type(item).__name__) for item in items] == [
        (1, "Conversation"),
        (2, "SkippedLine"),
        (3, "SkippedLine"),
        (4, "Conversation"),
    ]
    skipped = items[1]
    assert isinstance(skipped, SkippedLine)
    assert skipped.kind == "line too long"
    assert skipped.reason == f"the line holds {len(long) + 1} bytes, more than {len(good) + 1}"


def test_deep_json_is_skipped_by_number_at_compile_and_at_run(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"[" * 50_000 + b"]" * 50_000 + b"\n" + json.dumps(GOOD).encode() + b"\n")
    assert source_columns(resolve_source(path, setting="data.data_path")) == ("messages",)
    first, second = _read_all(path)
    assert isinstance(first, SkippedLine)
    assert (first.line, first.kind) == (1, "invalid JSON")
    assert first.reason == "invalid JSON: nested too deeply"
    assert isinstance(second, Conversation)


def test_the_column_sniff_reads_a_bounded_prefix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sources, "SCHEMA_BYTES", 100)
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"pad": "' + b"x" * 200 + b'"}\n' + json.dumps(GOOD).encode() + b"\n")
    # the first line is larger than the budget: nothing learned, the rows tell at run time
    assert source_columns(resolve_source(path, setting="data.data_path")) is None


def _table_bytes(kind: str) -> bytes:
    table = pa.Table.from_pylist([GOOD, {"messages": [{"role": "user", "content": "ü" * 40}]}])
    sink = io.BytesIO()
    if kind == "parquet":
        pq.write_table(table, sink, row_group_size=1)
    else:
        with pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
    return sink.getvalue()


TABLES = {kind: _table_bytes(kind) for kind in ("parquet", "arrow")}


@FUZZ
@given(
    kind=st.sampled_from(["parquet", "arrow"]),
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=4),
    cut=st.integers(0, 4096),
)
# found by CI: a column name in the Parquet footer made not UTF-8 (pyarrow: UnicodeDecodeError)
@example(kind="parquet", flips=[(380885, 128)], cut=0)
# found in a fresh clone: a column name in the Arrow schema made not UTF-8 (pyarrow decodes it
# only when `Schema.names` is read: UnicodeDecodeError)
@example(kind="arrow", flips=[(1894, 128)], cut=0)
def test_columnar_readers_raise_only_data_errors(
    tmp_path: Path, kind: str, flips: list[tuple[int, int]], cut: int
) -> None:
    raw = bytearray(TABLES[kind])
    for at, byte in flips:
        raw[at % len(raw)] = byte
    path = tmp_path / f"d.{kind}"
    path.write_bytes(bytes(raw[: max(len(raw) - cut, 0)]))
    try:
        _read_all(path)
    except DataError as exc:
        event("refused")
        str(exc).encode("utf-8")
        return
    event("read")


@FUZZ
@given(
    state=st.one_of(
        json_values.map(lambda v: json.dumps(v).encode()),
        st.sampled_from([b"[" * 50_000, b'{"_data_files": ' + b"[" * 50_000, b"\xff"]),
        st.lists(st.text(max_size=20), max_size=4).map(
            lambda names: json.dumps({"_data_files": [{"filename": n} for n in names]}).encode()
        ),
    ),
    info=st.one_of(
        st.none(),
        json_values.map(lambda v: json.dumps(v).encode()),
        st.just(b"{" * 50_000),
    ),
)
def test_datasets_folders_raise_only_data_errors(
    tmp_path: Path, state: bytes, info: bytes | None
) -> None:
    folder = tmp_path / "saved"
    folder.mkdir(exist_ok=True)
    (folder / "data-00000-of-00001.arrow").write_bytes(TABLES["arrow"])
    (folder / "state.json").write_bytes(state)
    if info is not None:
        (folder / "dataset_info.json").write_bytes(info)
    try:
        _read_all(folder)
    except DataError as exc:
        event("refused")
        str(exc).encode("utf-8")
        return
    event("read")


def test_a_parquet_footer_whose_column_name_is_not_utf8_is_a_data_error(tmp_path: Path) -> None:
    raw = bytearray(TABLES["parquet"])
    name_at = raw.index(b"messages")  # the footer's schema element (later copies: column paths)
    raw[name_at] = 0x80
    path = tmp_path / "d.parquet"
    path.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"cannot be read as a Parquet file .*write or download"):
        source_columns(resolve_source(path, setting="data.data_path"))


def test_an_arrow_schema_whose_column_name_is_not_utf8_is_a_data_error(tmp_path: Path) -> None:
    raw = bytearray(TABLES["arrow"])
    name_at = raw.rindex(b"messages")  # the footer's schema, which the file reader reads
    raw[name_at] = 0x80
    path = tmp_path / "d.arrow"
    path.write_bytes(bytes(raw))
    with pytest.raises(DataError) as info:
        source_columns(resolve_source(path, setting="data.data_path"))
    assert str(info.value) == (
        f"{path} cannot be read as an Arrow file (a column name is not UTF-8: 'utf-8' codec "
        "can't decode byte 0x80 in position 0: invalid start byte); the file is truncated or "
        "corrupt: write or download it again"
    )
