"""`-o` of compile, schema and report: atomic for files, through symlinks and special files."""

from __future__ import annotations

import json
import os
import stat
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from testkit.compiling import RecipeFactory, codes, compile_in, make_training_checkpoint, only

from dflash_recipes.cli import main
from dflash_recipes.compiler.compilation import compile_recipe
from dflash_recipes.compiler.input_checks import output_dir_problem
from dflash_recipes.diagnostics import Severity
from dflash_recipes.files.crashsafe import write_output
from dflash_recipes.files.run_dir import PLAN_FILE
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
        "train_batch_tau_estimate": 1.5,
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


def test_supervised_parts_without_answer_only_loss_are_a_warning(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path
) -> None:
    data = {"answer_only_loss": False, "supervise": ["answer"]}
    d = only(compile_in(tmp_path, make_recipe(data=data)), "data-supervise-unused")
    assert d.severity is Severity.WARNING and d.path == "data.supervise"
    assert "data.supervise is ['answer'], but data.answer_only_loss is false" in d.message
    assert "set data.answer_only_loss: true" in d.hint  # type: ignore[operator]
    kept = {"answer_only_loss": True, "supervise": ["answer"]}
    assert "data-supervise-unused" not in codes(compile_in(tmp_path, make_recipe(data=kept)))
    every = {"answer_only_loss": False}
    assert "data-supervise-unused" not in codes(compile_in(tmp_path, make_recipe(data=every)))


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


def test_an_arrow_file_whose_column_name_is_not_utf8_is_a_compile_error(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path
) -> None:
    rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]
    table = pa.Table.from_pylist(rows)
    with (
        pa.OSFile(str(tmp_path / "t.arrow"), "wb") as sink,
        pa.ipc.new_file(sink, table.schema) as w,
    ):
        w.write_table(table)
    raw = bytearray((tmp_path / "t.arrow").read_bytes())
    raw[raw.rindex(b"messages")] = 0x80  # the footer's schema: pyarrow decodes names lazily
    (tmp_path / "t.arrow").write_bytes(bytes(raw))
    result = compile_in(tmp_path, make_recipe(data={"data_path": "t.arrow"}))
    d = only(result, "data-unreadable")
    assert d.path == "data.data_path"
    assert "t.arrow cannot be read as an Arrow file (a column name is not UTF-8: " in d.message
    assert d.message.endswith("the file is truncated or corrupt: write or download it again")
    assert d.hint == (
        "point data.data_path at a readable JSONL, Parquet or Arrow file, or a folder of them"
    )


def test_the_columns_finding_names_the_file_and_says_how_to_fix_it(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path
) -> None:
    (tmp_path / "parts").mkdir()
    pq.write_table(pa.Table.from_pylist([{"text": "a"}]), tmp_path / "parts" / "a.parquet")
    result = compile_in(tmp_path, make_recipe(data={"data_path": "parts"}))
    d = only(result, "data-columns-missing")
    assert d.message.startswith(f"{tmp_path / 'parts' / 'a.parquet'} has no 'messages'")
    assert d.hint == (
        "rename the column that holds the turns to 'messages' (role/content) or "
        "'conversations' (from/value), or point data.data_path at another input"
    )


def test_an_unreadable_input_is_named_by_its_setting(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path
) -> None:
    (tmp_path / "empty").mkdir()
    result = compile_in(tmp_path, make_recipe(data={"eval_data_path": "empty"}))
    d = only(result, "data-unreadable")
    assert d.path == "data.eval_data_path"
    assert "holds no .parquet, .arrow, .jsonl or .jsonl.gz file; set data.eval_data_path" in (
        d.message
    )


# -- data files that are missing, folders or unnamable ----------------------------------------


def test_every_missing_input_is_reported_not_only_the_first(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path
) -> None:
    (tmp_path / "templates").mkdir()
    long_name = "t" * 300 + ".jinja"  # the file system refuses the name: not there either
    data = {"chat_template": "templates", "eval_data_path": "org/held-out"}
    by_path = {d.path: d for d in compile_in(tmp_path, make_recipe(data=data)).diagnostics}
    template = by_path["data.chat_template"]
    assert template.code == "data-file-missing"
    assert template.message == (
        f"data.chat_template {tmp_path / 'templates'} is a directory, not a file "
        "(a .jinja chat template file expected)"
    )
    assert template.hint == (
        "point data.chat_template at a .jinja chat template file (a relative path is resolved "
        "against the recipe's folder)"
    )
    assert by_path["data.eval_data_path"].code == "data-hub-id"
    assert by_path["data.eval_data_path"].message == (
        "data.eval_data_path 'org/held-out' is not a local file or folder; it looks like a "
        "Hugging Face Hub dataset id, and runs never download data"
    )
    # a template path that looks like a hub id is a missing file: templates are never on the hub
    data = {"data_path": "org/train", "chat_template": long_name}
    by_path = {d.path: d for d in compile_in(tmp_path, make_recipe(data=data)).diagnostics}
    assert by_path["data.data_path"].code == "data-hub-id"
    assert by_path["data.chat_template"].code == "data-file-missing"
    assert by_path["data.chat_template"].message.endswith(
        "does not exist (a .jinja chat template file expected)"
    )
    # a template that looks like a hub id is still a missing file; a present one is not
    # where the checking stops
    (tmp_path / "chat.jinja").write_text("{{ messages }}", encoding="utf-8")
    for template, code in (("org/chat", "data-file-missing"), ("chat.jinja", None)):
        data = {"chat_template": template, "eval_data_path": "absent.jsonl"}
        by_path = {d.path: d for d in compile_in(tmp_path, make_recipe(data=data)).diagnostics}
        found = by_path.get("data.chat_template")
        assert (found.code if found else None) == code, template
        assert by_path["data.eval_data_path"].code == "data-file-missing"
    data = {"data_path": "absent.jsonl"}
    d = only(compile_in(tmp_path, make_recipe(data=data)), "data-file-missing")
    assert d.message.endswith("does not exist (a JSONL file of training conversations expected)")


def test_without_a_recipe_folder_relative_inputs_are_resolved_against_the_working_directory(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    result = compile_recipe(make_recipe(data={"eval_data_path": "absent.jsonl"}))
    d = only(result, "data-file-missing")
    assert d.hint is not None and d.hint.endswith("resolved against the working directory)")


# -- the output directory ---------------------------------------------------------------------


def test_an_output_dir_that_cannot_be_a_directory_says_why(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    assert output_dir_problem(tmp_path / "new" / "deeper") is None
    assert output_dir_problem(tmp_path) is None
    assert output_dir_problem(tmp_path / "a\0b") == (
        "contains a NUL byte, which no file system accepts"
    )
    assert output_dir_problem(tmp_path / "file") == "exists and is a regular file, not a directory"
    assert output_dir_problem(tmp_path / "file" / "run" / "deeper") == (
        f"lies below {tmp_path / 'file'}, which is a regular file, not a directory"
    )
    assert output_dir_problem(tmp_path / ("n" * 300)) == "cannot be used: File name too long"


def test_an_output_dir_that_cannot_be_listed_is_one_error(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "out").mkdir()
    listdir = os.listdir

    def refuse(path: str | os.PathLike[str] = ".") -> list[str]:
        if Path(path) == tmp_path / "out":
            raise PermissionError(13, "Permission denied", str(path))
        return listdir(path)

    monkeypatch.setattr(os, "listdir", refuse)
    result = compile_in(tmp_path, make_recipe(training={"output_dir": "out"}))
    d = only(result, "output-dir-unusable")
    assert d.path == "training.output_dir"
    assert d.message == (
        f"training.output_dir {tmp_path / 'out'} cannot be listed: Permission denied"
    )
    assert d.hint == "make it readable and writable by this user, or choose another directory"


def test_a_previous_plan_over_the_size_bound_is_not_read(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path
) -> None:
    first = compile_in(tmp_path, make_recipe(training={"output_dir": "out"}))
    assert first.plan is not None
    make_training_checkpoint(tmp_path / "out", 10)
    plan_text = first.plan.to_json()
    recipe = make_recipe(init=None, training={"output_dir": "out"})
    for size, read in ((16 * 2**20, True), (16 * 2**20 + 1, False)):
        padded = plan_text + " " * (size - len(plan_text.encode()))
        (tmp_path / "out" / PLAN_FILE).write_text(padded, encoding="utf-8")
        taken = "taps-from-previous-run" in codes(compile_in(tmp_path, recipe))
        assert taken is read, size


# -- the capture cross-check's inputs ---------------------------------------------------------


def test_a_capture_with_a_missing_base_model_or_without_taps_is_not_cross_checked(
    tmp_path: Path, make_recipe: RecipeFactory, drafter: Path
) -> None:
    (tmp_path / "capture").mkdir()
    data = {"hidden_states_path": "capture"}
    result = compile_in(tmp_path, make_recipe(model="nowhere", data=data))
    assert "base-model-not-found" in codes(result)
    assert not [d for d in result.diagnostics if d.path == "data.hidden_states_path"]
    config = json.loads((drafter / "config.json").read_text())
    del config["dflash_config"]["target_layer_ids"]
    (drafter / "config.json").write_text(json.dumps(config))
    result = compile_in(tmp_path, make_recipe(data=data))
    assert "taps-unknown" in codes(result)
    assert not [d for d in result.diagnostics if d.path == "data.hidden_states_path"]


def test_a_tracker_library_that_is_not_installed_is_a_compile_error(
    make_recipe: RecipeFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # sys.modules[name] = None is how Python marks a package as unimportable: find_spec sees it
    monkeypatch.setitem(sys.modules, "wandb", None)
    result = compile_in(tmp_path, make_recipe(training={"report_to": ("tensorboard", "wandb")}))
    finding = only(result, "tracker-library-missing")
    assert result.plan is None and finding.severity is Severity.ERROR
    assert finding.path == "training.report_to"
    assert finding.message == (
        f"training.report_to names wandb, but the wandb package is not installed in this "
        f"Python ({sys.executable}): the run would train without tracking"
    )
    assert (
        finding.hint
        == "pip install 'dflash-recipes[wandb]', or remove wandb from training.report_to"
    )
    lint = compile_recipe(make_recipe(training={"report_to": ("wandb",)}), resolve=False)
    assert "tracker-library-missing" not in codes(lint)  # lint checks the recipe, not the Python
