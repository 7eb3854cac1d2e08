"""`dflash-recipe export CKPT DIR` replaces only an earlier export (issue 10: no data loss)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from testkit.compiling import SMALL_BLOCKS, TINY_SCRATCH

from dflash_recipes.cli import main
from dflash_recipes.files.export_target import EXPORT_MARKER, is_earlier_export

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
    assert marker["files"] == ["config.json", "dflash.py", "model.safetensors"]
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
    (out / EXPORT_MARKER).unlink()
    assert is_earlier_export(out)
    (out / "dflash.py").write_text("# remote code\n", encoding="utf-8")
    assert is_earlier_export(out)  # exports with remote code but no marker
    result = _export(trained / "checkpoint-00000001", out)
    assert result.exit_code == 0, result.output
    (out / "README.md").write_text("user notes", encoding="utf-8")
    assert not is_earlier_export(out)  # the user's file makes it theirs
    assert _export(trained / "checkpoint-00000001", out).exit_code == 2
