"""Every input format reads as the same conversations; bad inputs are one-line DataErrors."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_recipes.data.conversations import read_conversations
from dflash_recipes.data.sources import (
    content_sha256,
    hub_id_hint,
    resolve_source,
    source_columns,
)
from dflash_recipes.errors import DataError

ROWS = [
    {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
    for i in range(7)
]


def _jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _messages(path: Path) -> list[object]:
    return [c.messages for c in read_conversations(path).conversations]


def test_every_format_reads_as_the_same_conversations(tmp_path: Path) -> None:
    expected = _messages(_jsonl(tmp_path / "d.jsonl", ROWS))
    table = pa.Table.from_pylist(ROWS)
    with gzip.open(tmp_path / "d.jsonl.gz", "wt", encoding="utf-8") as handle:
        handle.write("".join(json.dumps(r) + "\n" for r in ROWS))
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=3)
    with (
        pa.OSFile(str(tmp_path / "d.arrow"), "wb") as sink,
        pa.ipc.new_file(sink, table.schema) as writer,
    ):
        writer.write_table(table)
    folder = tmp_path / "parts"
    folder.mkdir()
    pq.write_table(pa.Table.from_pylist(ROWS[:4]), folder / "train-00000.parquet")
    _jsonl(folder / "train-00001.jsonl", ROWS[4:])
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    for name in ("d.jsonl.gz", "d.parquet", "d.arrow", "parts", "saved"):
        assert _messages(tmp_path / name) == expected, name


def test_rows_are_numbered_across_the_files_of_a_folder(tmp_path: Path) -> None:
    folder = tmp_path / "parts"
    folder.mkdir()
    _jsonl(folder / "a.jsonl", ROWS[:2])
    _jsonl(folder / "b.jsonl", [{"text": "no turns"}, *ROWS[2:3]])
    file = read_conversations(folder)
    assert [c.line for c in file.conversations] == [1, 2, 4]
    assert [(s.line, s.kind) for s in file.skipped] == [(3, "no conversation key")]


def test_a_system_column_becomes_the_first_message(tmp_path: Path) -> None:
    rows = [{**ROWS[0], "system": "be brief"}, {**ROWS[1], "system": None}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "s.parquet")
    first, second = read_conversations(tmp_path / "s.parquet").conversations
    assert (first.messages[0].role, first.messages[0].content) == ("system", "be brief")
    assert second.messages[0].role == "user"


def test_columns_come_from_the_schema_alone(tmp_path: Path) -> None:
    pq.write_table(pa.Table.from_pylist([{"prompt": "x", "answer": "y"}]), tmp_path / "p.parquet")
    assert source_columns(resolve_source(tmp_path / "p.parquet", setting="s")) == (
        "prompt",
        "answer",
    )
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    assert source_columns(resolve_source(tmp_path / "saved", setting="s")) == ("messages",)
    _jsonl(tmp_path / "j.jsonl", [{"conversations": []}, {"system": "x"}])
    assert source_columns(resolve_source(tmp_path / "j.jsonl", setting="s")) == (
        "conversations",
        "system",
    )


def test_truncated_parquet_and_arrow_are_one_line_errors(tmp_path: Path) -> None:
    table = pa.Table.from_pylist(ROWS)
    pq.write_table(table, tmp_path / "d.parquet")
    raw = (tmp_path / "d.parquet").read_bytes()
    (tmp_path / "d.parquet").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(DataError, match=r"cannot be read as a Parquet file .*truncated or corrupt"):
        read_conversations(tmp_path / "d.parquet")
    datasets.Dataset.from_list(ROWS * 50).save_to_disk(str(tmp_path / "saved"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[:300])
    with pytest.raises(DataError, match=r"cannot be read as an Arrow file") as info:
        read_conversations(tmp_path / "saved")
    assert "\n" not in str(info.value)


def test_unusable_folders_say_what_to_point_at(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"holds no \.parquet, \.arrow, \.jsonl"):
        resolve_source(tmp_path / "empty", setting="data.data_path")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(
        str(tmp_path / "dd")
    )
    with pytest.raises(
        DataError, match=r"DatasetDict folder \(splits: train\); set data.data_path"
    ):
        resolve_source(tmp_path / "dd", setting="data.data_path")


def test_hub_ids_get_the_download_command() -> None:
    hint = hub_id_hint("HuggingFaceH4/ultrachat_200k", "data.data_path")
    assert hint is not None
    assert "`hf download HuggingFaceH4/ultrachat_200k --repo-type dataset --local-dir" in hint
    assert "set data.data_path to" in hint
    assert hub_id_hint("data/train.jsonl", "data.data_path") is None
    assert hub_id_hint("/abs/path", "data.data_path") is None


def test_the_content_hash_sees_an_edit_that_keeps_size_and_mtime(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", ROWS)
    source = resolve_source(path, setting="s")
    before, stat = content_sha256(source), path.stat()
    path.write_bytes(path.read_bytes().replace(b"q1", b"q9"))
    import os

    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns
    assert content_sha256(source) != before
