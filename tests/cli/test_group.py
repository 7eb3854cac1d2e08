"""The command group: version, help, unknown commands, and the console script's clean errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
from click.testing import Result
from testkit.cli_runner import cli

from dflash_recipes.cli import main


def json_out(result: Result) -> dict[str, Any]:
    """stdout parsed as exactly one JSON object (json.loads refuses trailing output)."""
    data = json.loads(result.stdout)
    assert isinstance(data, dict)
    return data


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every command runs from tmp_path (where the fixtures are), outside GitHub Actions."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GITHUB_ACTIONS", raising=False)


ALIAS_BOMB = "\n".join(
    ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    + [f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]" for i in range(9)]
)


@pytest.mark.parametrize(
    ("content", "code", "line"),
    [
        (b"", "empty-recipe", None),
        (b"# only a comment\n", "empty-recipe", None),
        (b"- model\n- dflash\n", "not-a-mapping", None),
        (b"model:\n  dtype: \xff\xfe\n", "invalid-utf8", 2),
        (b"model:\n  dtype: [bfloat16\n", "yaml-syntax", 3),
        (b"model:\n\tdtype: bfloat16\n", "yaml-syntax", 2),
        (ALIAS_BOMB.encode() + b"\n", "yaml-alias", 2),
        (b"model: {model_name_or_path: /m}\n---\nmodel: {}\n", "yaml-syntax", 2),
        (b"\x00\x01\x02binary", "yaml-syntax", 1),
        (b"model: !!python/object/apply:os.system ['true']\n", "yaml-tag", 1),
    ],
    ids=[
        "empty",
        "comment-only",
        "list-top-level",
        "invalid-utf8",
        "unclosed-bracket",
        "tab-indent",
        "alias-bomb",
        "two-documents",
        "binary",
        "python-tag",
    ],
)
@pytest.mark.parametrize("fmt", ["text", "json"])
def test_bad_input_is_one_clear_diagnostic_and_exit_1_never_a_traceback(
    tmp_path: Path, content: bytes, code: str, line: int | None, fmt: str
) -> None:
    (tmp_path / "r.yaml").write_bytes(content)
    result = cli("compile", "r.yaml", "--format", fmt)
    assert result.exit_code == 1
    if fmt == "json":
        payload = json_out(result)
        assert payload["ok"] is False and payload["plan"] is None
        (only,) = payload["diagnostics"]
        assert (only["code"], only["file"], only["line"]) == (code, "r.yaml", line)
        assert only["message"] and only["hint"]
    else:
        assert f"error[{code}]" in result.stderr
        assert result.stderr.count("error[") == 1
        assert "compile failed: 1 error, 0 warnings, 0 infos" in result.stderr


ENTRY_POINT = "from dflash_recipes.cli import run_cli; run_cli()"


def test_console_script_reports_bad_input_without_a_traceback(tmp_path: Path) -> None:
    """The installed entry point (`run_cli`), whole process: JSON on stdout, nothing on stderr."""
    (tmp_path / "r.yaml").write_bytes(b"model:\n  dtype: \xff\n")
    done = subprocess.run(
        [sys.executable, "-c", ENTRY_POINT, "compile", "r.yaml", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert done.stderr == ""
    assert json.loads(done.stdout)["diagnostics"][0]["code"] == "invalid-utf8"


def test_version_is_the_installed_distributions() -> None:
    result = cli("--version")
    assert result.exit_code == 0
    assert result.stdout == f"dflash-recipe, version {version('dflash-recipes')}\n"


def test_top_level_help_lists_the_commands_and_an_example() -> None:
    result = cli("--help")
    assert result.exit_code == 0
    for name in ("compile", "lint", "schema", "init"):
        assert re.search(rf"^\s+{name}\s", result.stdout, re.MULTILINE)
    assert "dflash-recipe compile recipes/" in result.stdout


@pytest.mark.parametrize("command", sorted(main.commands))  # type: ignore[attr-defined]
def test_every_command_help_shows_an_example(command: str) -> None:
    for flag in ("--help", "-h"):
        result = cli(command, flag)
        assert result.exit_code == 0
        assert "Example" in result.stdout
        assert re.search(rf"^\s+dflash-recipe {command}\b", result.stdout, re.MULTILINE), (
            result.stdout
        )


def test_unknown_command_is_a_usage_error() -> None:
    result = cli("compil", "recipe.yaml")
    assert result.exit_code == 2
    assert "No such command 'compil'" in result.stderr
