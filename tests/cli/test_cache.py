"""`dflash-recipe cache list | rm` as a user sees them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from testkit.cli_runner import cli

from dflash_recipes.files.data_cache import CACHE_ENV

NAME_A = "0123456789abcdef01234567"
NAME_B = "fedcba9876543210fedcba98"


def _entry(cache: Path, name: str, size: int) -> Path:
    folder = cache / name
    folder.mkdir(parents=True)
    meta = {
        "format": "dflash-token-cache",
        "source": "/data/train.jsonl",
        "stats": {"conversations_used": 1200, "num_tokens": 345678},
    }
    (folder / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    (folder / "input_ids.bin").write_bytes(bytes(size))
    return folder


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "c"))
    folder = tmp_path / "c" / "tokenized"
    _entry(folder, NAME_A, 3 * 2**20)
    _entry(folder, NAME_B, 2**20)
    (folder / "mine").mkdir()  # not an entry: never listed or removed
    return folder


def test_list_shows_each_entry_with_its_size_and_input(cache: Path) -> None:
    result = cli("cache", "list")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"tokenized-data cache {cache}: 2 entries, 4.00 MiB")
    assert len(lines) == 3
    assert any(
        line.startswith(f"  {NAME_A}    3.00 MiB")
        and line.endswith("1,200 conversations, 345,678 tokens of /data/train.jsonl")
        for line in lines
    )


def test_list_as_json(cache: Path) -> None:
    data = json.loads(cli("cache", "list", "--json").stdout)
    assert data["cache_dir"] == str(cache)
    assert sorted(e["name"] for e in data["entries"]) == [NAME_A, NAME_B]


def test_rm_removes_the_named_entry_and_says_what_was_freed(cache: Path) -> None:
    result = cli("cache", "rm", NAME_A)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1] == "removed 1 entry, 3.00 MiB freed"
    assert not (cache / NAME_A).exists() and (cache / NAME_B).is_dir()
    assert (cache / "mine").is_dir()


def test_rm_all_and_cache_dir(cache: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    _entry(other, NAME_A, 10)
    assert cli("cache", "rm", "--all", "--cache-dir", str(other)).exit_code == 0
    assert not (other / NAME_A).exists()
    assert (cache / NAME_A).is_dir()  # the default folder was not touched
    result = cli("cache", "rm", "--all")
    assert result.stdout.splitlines()[-1] == "removed 2 entries, 4.00 MiB freed"
    assert (cache / "mine").is_dir()


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (["rm"], 2, "name the entries to remove"),
        (["rm", NAME_A, "--all"], 2, "name the entries to remove"),
        (["rm", "mine"], 1, "mine: not an entry of the tokenized data cache"),
    ],
)
def test_rm_refusals(cache: Path, args: list[str], code: int, says: str) -> None:
    result = cli("cache", *args)
    assert result.exit_code == code
    assert says in result.stderr
    assert (cache / NAME_A).is_dir() and (cache / "mine").is_dir()
