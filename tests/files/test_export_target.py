"""`dflash-recipe export CKPT DIR` replaces only an earlier export (issue 10: no data loss)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from testkit.compiling import SMALL_BLOCKS, TINY_SCRATCH

from dflash_recipes.cli import main
from dflash_recipes.errors import ReplaceRefusedError
from dflash_recipes.files.export_target import (
    EXPORT_MARKER,
    check_export_target,
    export_marker_text,
    is_earlier_export,
    run_directory_evidence,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, one_thread: None) -> Path:
    """A finished 2-step tiny run (checkpoint-00000001, -00000002, export/)."""
    out = tmp_path_factory.mktemp("export-target") / "run"
    result = CliRunner().invoke(
        main,
        [
            "run",
            str(TINY_SCRATCH),
            f"training.output_dir={out}",
            "training.max_steps=2",
            "training.save_steps=1",
            "training.save_total_limit=null",
            *SMALL_BLOCKS,
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
    return out


def _export(checkpoint: Path, out_dir: Path | str, *extra: str) -> Result:
    result = CliRunner().invoke(main, ["export", str(checkpoint), str(out_dir), *extra])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result


def _tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def test_a_directory_with_other_files_is_refused_and_kept(trained: Path, tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("precious", encoding="utf-8")
    result = _export(trained / "checkpoint-00000001", mine)
    assert result.exit_code == 2
    assert f"refusing to export into {mine}: it is not empty and is not an earlier export" in (
        result.output
    )
    assert "--force" in result.output
    assert (mine / "notes.txt").read_text(encoding="utf-8") == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no staging left

    forced = _export(trained / "checkpoint-00000001", mine, "--force")
    assert forced.exit_code == 0, forced.output
    assert not (mine / "notes.txt").exists()
    assert is_earlier_export(mine)


def test_the_run_directory_is_never_replaced_even_with_force(trained: Path) -> None:
    before = _tree(trained)
    for extra in ((), ("--force",)):
        result = _export(trained / "checkpoint-00000002", trained, *extra)
        assert result.exit_code == 2
        assert f"refusing to export into {trained}" in result.output
        assert _tree(trained) == before
    # The checkpoint itself (the source) is refused as well.
    result = _export(trained / "checkpoint-00000002", trained / "checkpoint-00000002", "--force")
    assert result.exit_code == 2
    assert _tree(trained) == before


def test_a_run_directory_elsewhere_is_refused_with_force(trained: Path, tmp_path: Path) -> None:
    other = tmp_path / "other-run"
    shutil.copytree(trained, other)
    before = _tree(other)
    result = _export(trained / "checkpoint-00000001", other, "--force")
    assert result.exit_code == 2
    assert "is a training run directory (it holds" in result.output
    assert _tree(other) == before


def test_the_current_directory_is_refused(
    trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "data.txt").write_text("x", encoding="utf-8")
    monkeypatch.chdir(work)
    for target in (".", ".."):
        result = _export(trained / "checkpoint-00000001", target, "--force")
        assert result.exit_code == 2
        assert f"refusing to export into {target}: replacing it would delete" in result.output
    assert (work / "data.txt").exists()


def test_an_earlier_export_is_replaced_and_stale_staging_cleaned(
    trained: Path, tmp_path: Path
) -> None:
    out = tmp_path / "drafter"
    first = _export(trained / "checkpoint-00000001", out)
    assert first.exit_code == 0, first.output
    marker = json.loads((out / EXPORT_MARKER).read_text(encoding="utf-8"))
    assert marker["files"] == [
        ".dflash-card.json",
        "README.md",
        "config.json",
        "dflash.py",
        "model.safetensors",
    ]
    # A killed export's staging (dead pid), an older version's (no pid), and a live one's.
    dead = tmp_path / ".tmp-drafter-999999999-0123abcd"
    legacy = tmp_path / ".tmp-drafter-89abcdef"
    live = tmp_path / f".tmp-drafter-{os.getppid()}-fedcba98"
    for staging in (dead, legacy, live):
        staging.mkdir()
        (staging / "model.safetensors").write_bytes(b"partial")
    second = _export(trained / "checkpoint-00000002", out)
    assert second.exit_code == 0, second.output
    assert not dead.exists() and not legacy.exists()
    assert live.exists()  # a concurrent export still running is left alone
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["drafter", live.name])


def test_an_export_from_before_the_marker_is_recognised(trained: Path, tmp_path: Path) -> None:
    out = tmp_path / "old-export"
    shutil.copytree(trained / "export", out)
    for name in (EXPORT_MARKER, "README.md", ".dflash-card.json"):  # none before the marker
        (out / name).unlink()
    assert is_earlier_export(out)
    (out / "dflash.py").write_text("# remote code\n", encoding="utf-8")
    assert is_earlier_export(out)  # exports with remote code but no marker
    result = _export(trained / "checkpoint-00000001", out)
    assert result.exit_code == 0, result.output
    (out / "NOTES.md").write_text("user notes", encoding="utf-8")
    assert not is_earlier_export(out)  # the user's file makes it theirs
    assert _export(trained / "checkpoint-00000001", out).exit_code == 2


# ---------------------------------------------------------------------------------------------
# the rule itself, without a model: each refusal's words, and what is recognised as an export
# ---------------------------------------------------------------------------------------------


def _refusal(out_dir: Path, **kwargs: Any) -> str:
    with pytest.raises(ReplaceRefusedError) as caught:
        check_export_target(out_dir, **kwargs)
    return str(caught.value)


def _legacy_export(directory: Path, *, architecture: str = "DFlashDraftModel") -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    (directory / "model.safetensors").write_bytes(b"w")
    return directory


def test_a_new_or_empty_directory_may_be_exported_into(tmp_path: Path) -> None:
    check_export_target(tmp_path / "new")
    (tmp_path / "empty").mkdir()
    check_export_target(tmp_path / "empty")


def test_a_symlink_or_a_file_is_refused_with_what_to_pass(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    assert _refusal(tmp_path / "link", force=True) == (
        f"export directory {tmp_path / 'link'} is a symlink; pass the directory it points to "
        f"({real}) or a new path"
    )
    (tmp_path / "file").write_text("x")
    assert _refusal(tmp_path / "file", force=True) == (
        f"export directory {tmp_path / 'file'} exists and is not a directory; choose another path"
    )


def test_the_current_directory_its_parents_and_home_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    for target in (work, tmp_path / "a"):
        assert _refusal(target, force=True) == (
            f"refusing to export into {target}: replacing it would delete the current one and "
            "everything below it; pass a new directory, e.g. drafter-export/"
        )
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    assert "would delete the home directory and everything below it" in _refusal(home, force=True)
    check_export_target(work / "export")  # below the current directory is fine


def test_a_directory_holding_a_source_is_refused(tmp_path: Path) -> None:
    checkpoint = tmp_path / "out" / "run" / "checkpoint-00000002"
    checkpoint.mkdir(parents=True)
    for target in (tmp_path / "out", checkpoint):
        assert _refusal(target, force=True, sources=[checkpoint]) == (
            f"refusing to export into {target}: it holds {checkpoint}, which this export reads "
            "and replacing the directory would delete; pass a new directory"
        )
    check_export_target(tmp_path / "elsewhere", sources=[checkpoint])


@pytest.mark.parametrize(
    ("name", "evidence"),
    [
        ("plan.json", "it holds plan.json"),
        ("metrics.jsonl", "it holds metrics.jsonl"),
        (".dflash-lock", "it holds .dflash-lock"),
        ("trainer_state.json", "it holds trainer_state.json"),
        ("optimizer.pt", "it holds optimizer.pt"),
        ("checkpoint-00000007/", "it holds the training checkpoint checkpoint-00000007"),
        (
            ".tmp-checkpoint-00000007-1/",
            "it holds the training checkpoint .tmp-checkpoint-00000007-1",
        ),
    ],
)
def test_a_run_directory_is_refused_even_with_force(
    tmp_path: Path, name: str, evidence: str
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "model.safetensors").write_bytes(b"w")
    if name.endswith("/"):
        (run / name).mkdir()
    else:
        (run / name).write_text("{}")
    assert run_directory_evidence(run) == evidence
    assert _refusal(run, force=True) == (
        f"refusing to export into {run}: it is a training run directory ({evidence}) and an "
        "export replaces its whole target, even with --force; pass a new directory, e.g. its "
        "export/ subdirectory"
    )


def test_other_files_are_refused_unless_forced(tmp_path: Path) -> None:
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me")
    assert run_directory_evidence(notes) is None
    assert _refusal(notes) == (
        f"refusing to export into {notes}: it is not empty and is not an earlier export, and an "
        "export replaces the whole directory; pass a new or empty directory, or --force to "
        "delete what it holds"
    )
    check_export_target(notes, force=True)


def test_an_export_is_recognised_by_its_marker_and_nothing_else(tmp_path: Path) -> None:
    export = tmp_path / "export"
    export.mkdir()
    files = ["config.json", "model.safetensors"]
    assert export_marker_text(reversed(files)) == (
        '{\n  "dflash_export": 1,\n  "files": [\n    "config.json",\n    "model.safetensors"\n'
        "  ]\n}\n"
    )
    (export / EXPORT_MARKER).write_text(export_marker_text(files))
    for name in files:
        (export / name).write_text("{}")
    assert is_earlier_export(export)
    check_export_target(export)
    (export / "notes.txt").write_text("mine")  # a file the export did not write
    assert not is_earlier_export(export)
    (export / "notes.txt").unlink()
    (export / EXPORT_MARKER).write_text(json.dumps({"files": ["config.json", 7]}))
    assert not is_earlier_export(export)  # model.safetensors is not listed (7 is no name)
    (export / EXPORT_MARKER).write_text(" " * (64 * 1024 + 1))  # over the bound: not read
    assert not is_earlier_export(export)
    assert not is_earlier_export(tmp_path / "absent")


def test_an_export_from_before_the_marker_needs_exactly_its_files_and_architecture(
    tmp_path: Path,
) -> None:
    legacy = _legacy_export(tmp_path / "legacy")
    assert is_earlier_export(legacy)
    (legacy / "dflash.py").write_text("# remote code")
    assert is_earlier_export(legacy)
    (legacy / "README.md").write_text("notes")
    assert not is_earlier_export(legacy)
    assert not is_earlier_export(_legacy_export(tmp_path / "other", architecture="LlamaModel"))
    only_config = _legacy_export(tmp_path / "partial")
    (only_config / "model.safetensors").unlink()
    assert not is_earlier_export(only_config)
    big = _legacy_export(tmp_path / "big")
    config = {"architectures": ["DFlashDraftModel"], "pad": " " * (1024 * 1024)}
    (big / "config.json").write_text(json.dumps(config))
    assert not is_earlier_export(big)  # a config.json over 1 MiB is not read
    broken = _legacy_export(tmp_path / "broken")
    (broken / "config.json").write_text("{not json")
    assert not is_earlier_export(broken)


def test_a_deleted_current_directory_protects_nothing_and_refuses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def gone() -> Path:
        raise FileNotFoundError(2, "No such file or directory")

    monkeypatch.setattr(Path, "cwd", staticmethod(gone))
    check_export_target(tmp_path / "export")


def test_an_unlistable_directory_is_refused_with_the_os_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "out").mkdir()

    def denied(_self: Path) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "iterdir", denied)
    assert _refusal(tmp_path / "out") == (
        f"export directory {tmp_path / 'out'} cannot be listed: Permission denied"
    )


def test_a_marker_exactly_at_its_bound_is_read(tmp_path: Path) -> None:
    export = tmp_path / "export"
    export.mkdir()
    text = export_marker_text(["model.safetensors"])
    (export / EXPORT_MARKER).write_text(text + " " * (64 * 1024 - len(text)))
    (export / "model.safetensors").write_bytes(b"w")
    assert is_earlier_export(export)
