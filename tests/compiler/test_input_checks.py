"""`-o` of compile, schema and report: atomic for files, through symlinks and special files."""

from __future__ import annotations

import json
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from testkit.compiling import RecipeFactory, compile_in, only

from dflash_recipes.cli import main
from dflash_recipes.diagnostics import Severity
from dflash_recipes.files.crashsafe import write_output
from dflash_recipes.plan.run_plan import RunPlan

DEV_NULL = Path("/dev/null")


def _invoke(*args: str) -> str:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.skipif(not DEV_NULL.exists(), reason="needs /dev/null")
def test_schema_and_compile_to_dev_null_leave_it_a_device(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    write_recipe: Callable[..., Path],
    recipe_text: Callable[..., str],
    base_model: Path,
    drafter: Path,
    train_file: Path,
) -> None:
    monkeypatch.chdir(tmp_path)
    _invoke("schema", "-o", str(DEV_NULL))
    assert stat.S_ISCHR(DEV_NULL.stat().st_mode)
    write_recipe(recipe_text())
    _invoke("compile", "recipe.yaml", "-o", str(DEV_NULL))
    assert stat.S_ISCHR(DEV_NULL.stat().st_mode)
    assert not list(Path("/dev").glob(".null.tmp-*"))


def test_schema_through_a_symlink_keeps_the_link_and_fills_the_target(tmp_path: Path) -> None:
    target = tmp_path / "real" / "schema.json"
    target.parent.mkdir()
    target.write_text("old", encoding="utf-8")
    link = tmp_path / "schema.json"
    link.symlink_to(target)
    _invoke("schema", "-o", str(link))
    assert link.is_symlink() and link.resolve() == target
    assert json.loads(target.read_text(encoding="utf-8"))["title"]
    assert sorted(p.name for p in target.parent.iterdir()) == ["schema.json"]  # no temp file


def test_compile_through_a_dangling_symlink_creates_the_target(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    write_recipe: Callable[..., Path],
    recipe_text: Callable[..., str],
    base_model: Path,
    drafter: Path,
    train_file: Path,
) -> None:
    monkeypatch.chdir(tmp_path)
    write_recipe(recipe_text())
    target = tmp_path / "plans" / "plan.json"
    target.parent.mkdir()
    link = tmp_path / "plan.json"
    link.symlink_to(target)
    _invoke("compile", "recipe.yaml", "-o", str(link))
    assert link.is_symlink()
    assert RunPlan.from_json(target.read_text(encoding="utf-8")).fingerprint


def test_report_through_a_symlink_and_to_dev_null(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    row = {
        "kind": "train",
        "step": 1,
        "loss": 1.0,
        "lr": 1e-4,
        "accuracy_by_position": [0.0, 0.5],
        "acceptance_length_estimate": 1.5,
        "tokens_per_second": 1.0,
    }
    (run / "metrics.jsonl").write_text(json.dumps(row) + "\n", encoding="utf-8")
    target = tmp_path / "plots" / "r.png"
    target.parent.mkdir()
    link = tmp_path / "r.png"
    link.symlink_to(target)
    _invoke("report", str(run), "-o", str(link))
    assert link.is_symlink()
    assert target.read_bytes().startswith(b"\x89PNG")
    if DEV_NULL.exists():
        _invoke("report", str(run), "-o", str(DEV_NULL))
        assert stat.S_ISCHR(DEV_NULL.stat().st_mode)


def test_a_fifo_is_written_through_not_replaced(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()))
    reader.start()
    write_output(fifo, "hello\n")
    reader.join(timeout=10)
    assert received == [b"hello\n"]
    assert stat.S_ISFIFO(fifo.stat().st_mode)


def test_a_regular_file_is_replaced_atomically_and_a_directory_refused(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    out.write_text("old", encoding="utf-8")
    inode = out.stat().st_ino
    write_output(out, "new")
    assert out.read_text(encoding="utf-8") == "new"
    assert out.stat().st_ino != inode  # renamed into place, never rewritten in place
    with pytest.raises(IsADirectoryError):
        write_output(tmp_path, "x")
    result = CliRunner().invoke(main, ["schema", "-o", str(tmp_path)])
    assert result.exit_code == 2
    assert "is a directory" in result.output


# -- data inputs: formats, columns, hub ids (from the schema alone) ---------------------------


def test_a_hub_dataset_id_is_refused_with_the_download_command(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path
) -> None:
    result = compile_in(tmp_path, make_recipe(data={"data_path": "HuggingFaceH4/ultrachat_200k"}))
    d = only(result, "data-hub-id")
    assert d.severity is Severity.ERROR and d.path == "data.data_path"
    assert "Hugging Face Hub dataset id" in d.message and "never download" in d.message
    assert d.hint is not None
    assert "`hf download HuggingFaceH4/ultrachat_200k --repo-type dataset --local-dir" in d.hint
    assert "then set data.data_path to the folder" in d.hint


def test_an_input_without_a_conversation_column_names_its_columns(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path
) -> None:
    pq.write_table(pa.Table.from_pylist([{"prompt": "p", "response": "r"}]), tmp_path / "t.parquet")
    result = compile_in(tmp_path, make_recipe(data={"eval_data_path": "t.parquet"}))
    d = only(result, "data-columns-missing")
    assert d.path == "data.eval_data_path"
    assert "no 'messages' (OpenAI) or 'conversations' (ShareGPT) column" in d.message
    assert d.message.endswith("its columns: prompt, response")
    (tmp_path / "t.jsonl").write_text('{"text": "a"}\n', encoding="utf-8")
    result = compile_in(tmp_path, make_recipe(data={"data_path": "t.jsonl"}))
    assert only(result, "data-columns-missing").message.endswith("its columns: text")


def test_parquet_folders_and_save_to_disk_folders_compile(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path
) -> None:
    rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]
    (tmp_path / "parts").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "parts" / "train-0.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    for path in ("parts", "saved", "parts/train-0.parquet"):
        result = compile_in(tmp_path, make_recipe(data={"data_path": path}))
        assert result.ok, [(d.code, d.message) for d in result.diagnostics]


def test_a_truncated_parquet_file_is_a_compile_error(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path
) -> None:
    (tmp_path / "t.parquet").write_bytes(b"PAR1 not really")
    result = compile_in(tmp_path, make_recipe(data={"data_path": "t.parquet"}))
    d = only(result, "data-unreadable")
    assert "cannot be read as a Parquet file" in d.message and "\n" not in d.message
