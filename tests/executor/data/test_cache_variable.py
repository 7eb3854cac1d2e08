"""A plan's cache folder wins at `run`, and a DFLASH_RECIPES_CACHE set for `run` alone is named
(issue 49: it was read at compile, frozen into the plan, and silently ignored at run)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from testkit.compiling import tiny_scratch_plan

from dflash_recipes.executor.data.train_dataset import build_dataset
from dflash_recipes.executor.model.convert import load_tokenizer
from dflash_recipes.files.data_cache import CACHE_ENV, variable_not_used


def test_the_plans_folder_is_used_and_the_variable_is_named_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "at-compile"))
    plan = tiny_scratch_plan(tmp_path / "run")
    assert plan.data.cache_dir == str(tmp_path / "at-compile" / "tokenized")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "at-run"))
    tokenizer = load_tokenizer(plan)
    with caplog.at_level(logging.INFO, logger="dflash_recipes"):
        dataset = build_dataset(plan, tokenizer)
        build_dataset(plan, tokenizer, split="eval")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [variable_not_used(plan.data.cache_dir)]
    assert str(tmp_path / "at-run" / "tokenized") in warned[0]
    assert dataset.examples.directory.parent == tmp_path / "at-compile" / "tokenized"
    assert not (tmp_path / "at-run").exists()
