"""Where a recipe's model paths point: local resolution, hub ids refused with the staging command,
directory checks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from testkit.st_fixtures import (
    write_drafter_checkpoint,
    write_json,
)

from dflash_recipes.checkpoint.model_paths import (
    CheckpointDirProblem,
    inspect_checkpoint_dir,
    inspect_model_dir,
    resolve_checkpoint_dir,
    resolve_local_path,
)
from dflash_recipes.errors import CheckpointError


def _problem(value: str, base: Path | None) -> CheckpointDirProblem:
    problem = inspect_checkpoint_dir(value, base_dir=base)
    assert problem is not None
    return problem


def test_a_valid_checkpoint_has_no_problem(tmp_path: Path) -> None:
    write_drafter_checkpoint(tmp_path / "ck")
    assert inspect_checkpoint_dir(str(tmp_path / "ck"), base_dir=None) is None


def test_a_sharded_checkpoint_is_accepted(tmp_path: Path) -> None:
    write_drafter_checkpoint(tmp_path / "ck", shards=2)
    assert inspect_checkpoint_dir("ck", base_dir=tmp_path) is None


def test_relative_paths_resolve_against_the_recipe_folder_not_the_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipes = tmp_path / "recipes"
    write_drafter_checkpoint(recipes / "drafters" / "b16")
    monkeypatch.chdir(tmp_path)
    assert inspect_checkpoint_dir("drafters/b16", base_dir=recipes) is None
    assert resolve_checkpoint_dir("drafters/b16", base_dir=recipes, role="x") == (
        recipes / "drafters" / "b16"
    )
    # Without a recipe folder (a recipe built in Python) the working directory is the base.
    assert resolve_local_path("drafters/b16", base_dir=None) == tmp_path / "drafters" / "b16"


def test_home_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    write_drafter_checkpoint(tmp_path / "ck")
    assert inspect_checkpoint_dir("~/ck", base_dir=Path("/elsewhere")) is None
    assert resolve_local_path("~/ck", base_dir=Path("/elsewhere")) == tmp_path / "ck"


def test_hub_id_says_it_is_not_fetched_and_gives_the_staging_command(tmp_path: Path) -> None:
    problem = _problem("z-lab/Qwen3-8B-DFlash-b16", tmp_path)
    assert problem.kind == "hub-id"
    assert "hub ids are not fetched" in problem.message
    assert "hf download z-lab/Qwen3-8B-DFlash-b16 --local-dir <dir>" in problem.hint


def test_a_local_directory_named_like_a_hub_id_is_used(tmp_path: Path) -> None:
    write_drafter_checkpoint(tmp_path / "z-lab" / "Qwen3-8B-DFlash-b16")
    assert inspect_checkpoint_dir("z-lab/Qwen3-8B-DFlash-b16", base_dir=tmp_path) is None


def test_not_found_suggests_a_close_sibling(tmp_path: Path) -> None:
    write_drafter_checkpoint(tmp_path / "drafter-b16")
    problem = _problem(str(tmp_path / "drafter-b61"), None)
    assert problem.kind == "not-found"
    assert f"{tmp_path / 'drafter-b61'} does not exist" in problem.message
    assert f"did you mean {tmp_path / 'drafter-b16'}?" in problem.hint


def test_not_a_directory(tmp_path: Path) -> None:
    write_drafter_checkpoint(tmp_path / "ck")
    problem = _problem(str(tmp_path / "ck" / "model.safetensors"), None)
    assert problem.kind == "not-a-directory"
    assert "is a file, not a directory" in problem.message
    assert f"point it at the directory {tmp_path / 'ck'}" in problem.hint


def test_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "ck").mkdir()
    problem = _problem("ck", tmp_path)
    assert problem.kind == "empty-directory"
    assert "is empty" in problem.message
    assert "model.safetensors" in problem.message


def test_directory_without_weights_lists_its_files_and_what_is_expected(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    write_json(ck / "config.json", {})
    (ck / "pytorch_model.bin").write_bytes(b"")
    (ck / "runs").mkdir()
    problem = _problem("ck", tmp_path)
    assert problem.kind == "no-weights"
    assert "has no model.safetensors or model.safetensors.index.json" in problem.message
    assert "3 entries: config.json, pytorch_model.bin, runs/" in problem.message
    assert "expected an exported DFlash drafter: model.safetensors" in problem.hint


def test_weights_one_level_down_are_suggested(tmp_path: Path) -> None:
    write_drafter_checkpoint(tmp_path / "stage" / "export")
    problem = _problem("stage", tmp_path)
    assert problem.kind == "no-weights"
    assert f"did you mean {tmp_path / 'stage' / 'export'}?" in problem.hint


def test_broken_symlink_to_the_directory(tmp_path: Path) -> None:
    (tmp_path / "ck").symlink_to(tmp_path / "deleted")
    problem = _problem("ck", tmp_path)
    assert problem.kind == "broken-symlink"
    assert f"symbolic link to {tmp_path / 'deleted'}, which does not exist" in problem.message


def test_broken_symlink_for_the_weights_file(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "model.safetensors").symlink_to("../blobs/abc123")
    problem = _problem("ck", tmp_path)
    assert problem.kind == "broken-symlink"
    assert "model.safetensors is a symbolic link to ../blobs/abc123" in problem.message


def test_unlistable_directory_is_unreadable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "ck").mkdir()

    def refuse(self: Path) -> object:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "iterdir", refuse)
    problem = _problem("ck", tmp_path)
    assert problem.kind == "unreadable"
    assert "cannot be listed: Permission denied" in problem.message


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every file")
def test_unreadable_weights_file(tmp_path: Path) -> None:
    write_drafter_checkpoint(tmp_path / "ck")
    (tmp_path / "ck" / "model.safetensors").chmod(0)
    problem = _problem("ck", tmp_path)
    assert problem.kind == "unreadable"
    assert "chmod a+r" in problem.hint


def test_unreadable_weights_file_as_seen_by_access(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_drafter_checkpoint(tmp_path / "ck")
    real_access = os.access

    def no_read_for_weights(path: object, mode: int) -> bool:
        if str(path).endswith("model.safetensors"):
            return False
        return real_access(path, mode)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "access", no_read_for_weights)
    problem = _problem("ck", tmp_path)
    assert problem.kind == "unreadable"
    assert "is not readable by this user" in problem.message


def test_model_dir_needs_config_json(tmp_path: Path) -> None:
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "model.safetensors").write_bytes(b"")
    problem = inspect_model_dir("base", base_dir=tmp_path)
    assert problem is not None
    assert problem.kind == "no-config"
    assert "has no config.json" in problem.message
    write_json(tmp_path / "base" / "config.json", {})
    assert inspect_model_dir("base", base_dir=tmp_path) is None


def test_model_hub_id(tmp_path: Path) -> None:
    problem = inspect_model_dir("Qwen/Qwen3-8B", base_dir=tmp_path)
    assert problem is not None
    assert problem.kind == "hub-id"
    assert "hf download Qwen/Qwen3-8B --local-dir <dir>" in problem.hint


def test_resolve_checkpoint_dir_raises_with_role_and_fix(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as caught:
        resolve_checkpoint_dir(
            "z-lab/Qwen3-8B-DFlash-b16", base_dir=tmp_path, role="dflash.dflash_init_checkpoint"
        )
    message = str(caught.value)
    assert message.startswith("dflash.dflash_init_checkpoint: ")
    assert "\nfix: stage the drafter first: hf download z-lab/Qwen3-8B-DFlash-b16" in message


def test_a_missing_absolute_path_is_not_called_relative(tmp_path: Path) -> None:
    """Issue 49: the fix said "a relative path is resolved against ..." for an absolute one."""
    absolute = tmp_path / "no-parent" / "Qwen3-8B"
    problem = inspect_model_dir(str(absolute), base_dir=tmp_path / "recipes")
    assert problem is not None and problem.kind == "not-found"
    assert problem.hint == (
        f"check the path, or stage the base model there: hf download <repo> --local-dir {absolute}"
    )
    relative = inspect_model_dir("no-parent/models/Qwen3-8B", base_dir=tmp_path / "recipes")
    assert relative is not None and relative.hint == (
        "check the path (a relative path is resolved against the recipe's folder, here "
        f"{tmp_path / 'recipes' / 'no-parent' / 'models' / 'Qwen3-8B'})"
    )
