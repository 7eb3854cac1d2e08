"""`dflash-recipe demo --fresh` deletes only the run directories the demo created."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_recipes.cli import main
from dflash_recipes.errors import DFlashRecipeError
from dflash_recipes.executor.demo import runner as demo


def _stop_before_training(name: str, overrides: list[str], echo: object) -> None:
    msg = f"test stop before compiling {name}"
    raise DFlashRecipeError(msg)


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # Stop the demo right after its set-up; --fresh's deletions happen before that.
    monkeypatch.setattr(demo, "_compile", _stop_before_training)
    work = tmp_path / "W"
    mine = work / "runs" / "mine" / "checkpoint-00000010"
    mine.mkdir(parents=True)
    (mine / "model.safetensors").write_bytes(b"user weights")
    (work / "runs" / "notes.md").write_text("my notes", encoding="utf-8")
    return work


def _demo(work: Path, *extra: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["demo", "--workdir", str(work), *extra])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, result.output


def test_fresh_keeps_the_users_runs_and_deletes_the_demos(workdir: Path) -> None:
    runs = workdir / "runs"
    code, output = _demo(workdir)
    assert code == 1 and "test stop before compiling tiny_released.yaml" in output
    for name in demo.DEMO_RUNS:  # the demo marked what it created
        assert (runs / name / demo.DEMO_MARKER).is_file()
    (runs / "released" / "metrics.jsonl").write_text("{}\n", encoding="utf-8")

    code, output = _demo(workdir, "--fresh")
    assert code == 1 and "test stop" in output
    assert not (runs / "released" / "metrics.jsonl").exists()  # the demo's own run: gone
    assert (runs / "mine" / "checkpoint-00000010" / "model.safetensors").read_bytes() == (
        b"user weights"
    )
    assert (runs / "notes.md").read_text(encoding="utf-8") == "my notes"


def test_a_users_directory_with_a_demo_name_is_refused_not_deleted(workdir: Path) -> None:
    runs = workdir / "runs"
    _demo(workdir)
    (runs / "released" / "metrics.jsonl").write_text("{}\n", encoding="utf-8")
    users = runs / "scratch"
    (users / demo.DEMO_MARKER).unlink()
    (users / "plan.json").write_text("{}", encoding="utf-8")  # now the user's own run

    code, output = _demo(workdir, "--fresh")
    assert code == 1
    assert f"{users} exists but was not created by the demo" in output
    assert "move it away or pass another --workdir" in output
    assert (users / "plan.json").exists()
    assert (runs / "released" / "metrics.jsonl").exists()  # refused before deleting anything
