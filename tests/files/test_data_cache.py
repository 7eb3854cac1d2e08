"""The tokenized-data cache's folder (per user, shared by every run) and its entries as
`dflash-recipe cache` lists and removes them: only what the project made, under its lock."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from dflash_recipes.compiler.compilation import compile_file
from dflash_recipes.errors import DataError
from dflash_recipes.files.data_cache import (
    CACHE_ENV,
    LOCK_NAME,
    cache_root,
    default_data_cache_dir,
    format_bytes,
    list_entries,
    remove_entries,
    variable_not_used,
)
from dflash_recipes.files.locking import hold_directory_lock

NAME_A = "0123456789abcdef01234567"
NAME_B = "fedcba9876543210fedcba98"


# ---------------------------------------------------------------------------------------------
# where
# ---------------------------------------------------------------------------------------------


def test_the_variable_wins_then_xdg_then_the_home_cache(tmp_path: Path) -> None:
    home = str(tmp_path / "home")
    assert cache_root({CACHE_ENV: "/data/c", "XDG_CACHE_HOME": "/x", "HOME": home}) == Path(
        "/data/c"
    )
    assert cache_root({"XDG_CACHE_HOME": "/x", "HOME": home}) == Path("/x/dflash-recipes")
    # a relative XDG_CACHE_HOME is ignored, as the XDG rules say
    assert cache_root({"XDG_CACHE_HOME": "rel", "HOME": home}) == Path(home) / ".cache" / (
        "dflash-recipes"
    )
    assert default_data_cache_dir({CACHE_ENV: "/data/c"}) == Path("/data/c/tokenized")


def test_a_relative_variable_is_made_absolute_and_an_empty_one_is_unset(tmp_path: Path) -> None:
    assert cache_root({CACHE_ENV: "rel/c"}) == Path.cwd() / "rel" / "c"
    assert cache_root({CACHE_ENV: "  ", "XDG_CACHE_HOME": "/x"}) == Path("/x/dflash-recipes")


def test_the_suite_never_writes_to_the_real_cache() -> None:
    # conftest points the variable at a temporary folder for the session and for each test;
    # every compile, run and subprocess of the suite resolves the cache there
    chosen = Path(os.environ[CACHE_ENV])
    assert chosen.is_relative_to(Path(tempfile.gettempdir()))
    real = cache_root({k: v for k, v in os.environ.items() if k != CACHE_ENV})
    assert real is None or not chosen.is_relative_to(real)
    assert default_data_cache_dir() == chosen / "tokenized"
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "from dflash_recipes.files.data_cache import default_data_cache_dir as d; print(d())",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert child.stdout.strip() == str(chosen / "tokenized")


def test_compile_records_the_shared_folder_in_the_plan(
    good_recipe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "shared"))
    plans = [
        compile_file(good_recipe, overrides=(f"training.output_dir={tmp_path / name}",)).plan
        for name in ("first", "second")
    ]
    assert [p.data.cache_dir for p in plans if p] == [str(tmp_path / "shared" / "tokenized")] * 2
    pinned = compile_file(good_recipe, overrides=("data.cache_dir=mine",)).plan
    assert pinned is not None and pinned.data.cache_dir == str(tmp_path / "mine")


# ---------------------------------------------------------------------------------------------
# entries
# ---------------------------------------------------------------------------------------------


def _entry(cache: Path, name: str, *, size: int = 100, source: str = "/d/train.jsonl") -> Path:
    folder = cache / name
    folder.mkdir(parents=True)
    meta = {
        "format": "dflash-token-cache",
        "key": {},
        "source": source,
        "stats": {"conversations_used": 7, "num_tokens": 900, "skipped": []},
    }
    (folder / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    (folder / "input_ids.bin").write_bytes(bytes(size))
    return folder


def _foreign(cache: Path) -> list[Path]:
    """What a cache folder may hold besides entries: none of it is ever listed or removed."""
    other_format = cache / "aaaaaaaaaaaaaaaaaaaaaaaa"
    other_format.mkdir(parents=True)
    (other_format / "meta.json").write_text('{"format": "something-else"}', encoding="utf-8")
    no_meta = cache / "bbbbbbbbbbbbbbbbbbbbbbbb"
    no_meta.mkdir()
    named_otherwise = cache / "notes"
    named_otherwise.mkdir()
    (cache / "README").write_text("mine", encoding="utf-8")
    return [other_format, no_meta, named_otherwise, cache / "README"]


def test_only_entries_the_project_made_are_listed(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    _entry(cache, NAME_A, size=1000)
    _foreign(cache)
    stale = cache / f".tmp-{NAME_B}-4242-0badc0de"
    stale.mkdir()
    (stale / "input_ids.bin").write_bytes(bytes(10))
    entries = {e.name: e for e in list_entries(cache)}
    assert sorted(entries) == sorted([NAME_A, stale.name])
    ready = entries[NAME_A]
    assert (ready.state, ready.source, ready.conversations, ready.tokens) == (
        "ready",
        "/d/train.jsonl",
        7,
        900,
    )
    assert ready.size == 1000 + (cache / NAME_A / "meta.json").stat().st_size
    assert entries[stale.name].state == "incomplete"
    assert list_entries(tmp_path / "absent") == []


def test_removing_named_entries_leaves_everything_else(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    _entry(cache, NAME_A)
    _entry(cache, NAME_B)
    foreign = _foreign(cache)
    removed = remove_entries(cache, [NAME_A])
    assert [e.name for e in removed] == [NAME_A]
    assert not (cache / NAME_A).exists() and (cache / NAME_B).is_dir()
    assert all(p.exists() for p in foreign)
    assert sorted(p.name for p in cache.iterdir() if p.name.startswith(".old")) == []


def test_an_unknown_name_removes_nothing(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    _entry(cache, NAME_A)
    foreign = _foreign(cache)
    with pytest.raises(DataError) as caught:
        remove_entries(cache, [NAME_A, "notes"])
    assert str(caught.value) == (
        f"notes: not an entry of the tokenized data cache {cache} (its entries: {NAME_A}); "
        "nothing was removed (`dflash-recipe cache list` lists them)"
    )
    assert (cache / NAME_A).is_dir() and all(p.exists() for p in foreign)


def test_removing_all_removes_every_entry_and_only_those(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    _entry(cache, NAME_A)
    _entry(cache, NAME_B)
    foreign = _foreign(cache)
    assert sorted(e.name for e in remove_entries(cache, every=True)) == [NAME_A, NAME_B]
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [*(p.name for p in foreign), LOCK_NAME]
    )
    assert remove_entries(tmp_path / "absent", every=True) == []
    assert not (tmp_path / "absent").exists()


def test_nothing_is_removed_while_a_build_holds_the_lock(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    _entry(cache, NAME_A)
    held = hold_directory_lock(cache, purpose="data tokenization", lock_name=LOCK_NAME)
    refused = pytest.raises(DataError, match=r"is being built into: .* data tokenization \(pid")
    with held, refused:
        remove_entries(cache, [NAME_A])
    assert (cache / NAME_A).is_dir()


def test_a_symlink_to_an_entry_is_not_followed(tmp_path: Path) -> None:
    elsewhere = _entry(tmp_path / "elsewhere", NAME_A)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / NAME_B).symlink_to(elsewhere, target_is_directory=True)
    assert list_entries(cache) == []
    with pytest.raises(DataError):
        remove_entries(cache, [NAME_B])
    assert elsewhere.is_dir()


def test_sizes_read_as_a_person_writes_them() -> None:
    assert [format_bytes(n) for n in (812, 2048, 3_500_000, 5 * 2**30)] == [
        "812 B",
        "2.00 KiB",
        "3.34 MiB",
        "5.00 GiB",
    ]


def test_a_variable_set_for_run_alone_is_named_with_the_plans_folder(tmp_path: Path) -> None:
    """Issue 49: DFLASH_RECIPES_CACHE set for `run` only was ignored without a word."""
    plan_dir = str(tmp_path / "compiled" / "tokenized")
    line = variable_not_used(plan_dir, {CACHE_ENV: str(tmp_path / "run")})
    assert line == (
        f"warning: DFLASH_RECIPES_CACHE is set ({tmp_path / 'run'}, tokenized data in "
        f"{tmp_path / 'run' / 'tokenized'}), but this run reads and writes the plan's "
        f"data.cache_dir, {plan_dir}: the folder is decided when the plan is compiled; to use "
        f"{tmp_path / 'run' / 'tokenized'}, compile the plan again with DFLASH_RECIPES_CACHE "
        "set (`dflash-recipe run RECIPE` compiles in the run's environment), or set "
        "data.cache_dir"
    )
    assert variable_not_used(plan_dir, {CACHE_ENV: str(tmp_path / "compiled")}) is None
    assert variable_not_used(plan_dir, {"HOME": str(tmp_path)}) is None  # not set: nothing
    assert variable_not_used(None, {CACHE_ENV: str(tmp_path / "run")}) is None  # read at run
