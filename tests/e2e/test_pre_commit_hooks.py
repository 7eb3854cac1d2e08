"""The shipped pre-commit hook: `.pre-commit-hooks.yaml` runs `dflash-recipe lint` on recipes."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from dflash_recipes.cli import main

ROOT = Path(__file__).resolve().parents[2]


def hook() -> dict[str, Any]:
    hooks = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text(encoding="utf-8"))
    assert isinstance(hooks, list)
    (only,) = [h for h in hooks if h["id"] == "dflash-recipe-lint"]
    assert isinstance(only, dict)
    return only


def test_hook_runs_the_lint_command_of_the_console_script() -> None:
    found = hook()
    assert found["entry"] == "dflash-recipe lint"
    assert found["language"] == "python"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    program = shlex.split(found["entry"])[0]
    assert program in pyproject["project"]["scripts"]


@pytest.mark.parametrize(
    ("path", "selected"),
    [
        ("recipes/Qwen/Qwen3-8B/hf_online_dflash_finetune.yaml", True),
        ("recipes/tiny/tiny_scratch.yml", True),
        ("team/recipes/llama.yaml", True),
        (".github/workflows/ci.yml", False),
        (".pre-commit-config.yaml", False),
        ("recipes/README.md", False),
        ("myrecipes.yaml", False),
    ],
)
def test_hook_selects_recipe_yaml_files_only(path: str, selected: bool) -> None:
    # pre-commit matches `files` with re.search against the repository-relative path
    assert bool(re.search(hook()["files"], path)) is selected


def test_hook_passes_on_this_repositorys_recipes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("GITHUB_ACTIONS", raising=False)
    pattern = hook()["files"]
    files = sorted(
        p.relative_to(ROOT).as_posix()
        for p in ROOT.rglob("*")
        if ".git" not in p.parts and re.search(pattern, p.relative_to(ROOT).as_posix())
    )
    assert files, "no recipe matched the hook's files pattern"
    # pre-commit appends the staged file names to the entry's arguments
    args = [*shlex.split(hook()["entry"])[1:], *files]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert f"linted {len(files)} recipe file(s): 0 errors" in result.output
