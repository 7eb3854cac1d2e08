"""`run` says at start which mode training.eval_steps is in (issue 49: `null` measures every
save_steps and `0` never, and nothing told a run's reader which it had)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from testkit.compiling import tiny_scratch_plan

from dflash_recipes.executor.training.eval_policy import EVAL_STEPS_MODES, schedule_line
from dflash_recipes.executor.training.fit import run_plan
from dflash_recipes.recipe.sections import TrainingSection


def test_null_zero_and_a_number_are_named(tmp_path: Path) -> None:
    eval_file = tiny_scratch_plan(tmp_path / "r").data.eval_data_path
    null = tiny_scratch_plan(tmp_path / "r", "training.save_steps=20", "training.eval_steps=null")
    assert schedule_line(null) == (
        f"evaluation: held-out acceptance every 20 step(s) (training.eval_steps 20) on "
        f"{eval_file}; training.eval_steps modes: {EVAL_STEPS_MODES}"
    )
    never = tiny_scratch_plan(tmp_path / "r", "training.eval_steps=0")
    assert schedule_line(never) == (
        f"evaluation: held-out acceptance never during training (training.eval_steps: 0) on "
        f"{eval_file}; training.eval_steps modes: {EVAL_STEPS_MODES}"
    )
    none = tiny_scratch_plan(tmp_path / "r", "data.eval_data_path=null")
    assert schedule_line(none).startswith(
        "evaluation: none during training (no data.eval_data_path or data.eval_holdout)"
    )
    assert EVAL_STEPS_MODES == "N: every N steps; null (the default): every save_steps; 0: never"


def test_the_fields_comment_names_the_three_modes() -> None:
    import inspect

    source = inspect.getsource(TrainingSection)
    comment = source[: source.index("    eval_steps:")].rsplit("logging_steps", 1)[1]
    assert "Three modes: N, every N optimiser steps; null (the default), every" in comment
    assert "0, never (null does not turn it off)" in comment


@pytest.mark.usefixtures("one_thread")
def test_run_logs_the_mode_at_start(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    plan = tiny_scratch_plan(tmp_path / "run", "training.max_steps=1", "training.eval_steps=0")
    with caplog.at_level(logging.INFO, logger="dflash_recipes.train"):
        run_plan(plan, progress=False)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("evaluation:")]
    assert said == [schedule_line(plan)]
