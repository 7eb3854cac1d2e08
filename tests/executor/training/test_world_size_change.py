"""Resuming on another number of ranks says what changes (issue 36, "Ranks that disagree")."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from testkit.compiling import tiny_scratch_plan

from dflash_recipes.executor.training.fit import run_plan
from dflash_recipes.executor.training.setup.resume import ResumePoint, world_size_change
from dflash_recipes.files.run_dir import TRAINER_STATE, checkpoint_dir_name

CKPT = Path("/runs/x/checkpoint-100")


def _point(saved: int | None) -> ResumePoint:
    return ResumePoint(step=100, epoch=0, next_index=800, checkpoint=CKPT, saved_world_size=saved)


def test_the_same_world_size_or_an_old_checkpoint_says_nothing(tmp_path: Path) -> None:
    plan = tiny_scratch_plan(tmp_path / "run")
    assert world_size_change(plan, _point(2), world_size=2, num_examples=1000) is None
    assert world_size_change(plan, _point(None), world_size=2, num_examples=1000) is None


def test_with_max_steps_the_schedule_stays_and_the_batch_grows(tmp_path: Path) -> None:
    plan = tiny_scratch_plan(tmp_path / "run", "training.max_steps=400")
    line = world_size_change(plan, _point(2), world_size=4, num_examples=1000)
    assert line == (
        f"warning: resuming {CKPT} (step 100, trained on 2 rank(s)) on 4 rank(s): each "
        "optimiser step now takes 8 sequences instead of 4; the run's total stays 400 steps "
        "(training.max_steps) and so does the learning-rate schedule, so the remaining steps "
        "cover more data than planned"
    )


def test_without_max_steps_the_total_and_the_rate_change(tmp_path: Path) -> None:
    plan = tiny_scratch_plan(
        tmp_path / "run",
        "training.max_steps=null",
        "training.num_train_epochs=2",
        "training.warmup_ratio=0.0",
        "training.lr_scheduler_type=linear",
        "training.learning_rate=0.001",
    )
    # 1000 sequences, 2 per rank: 250 steps per epoch on 2 ranks, 125 on 4.
    line = world_size_change(plan, _point(2), world_size=4, num_examples=1000)
    assert line == (
        f"warning: resuming {CKPT} (step 100, trained on 2 rank(s)) on 4 rank(s): each "
        "optimiser step now takes 8 sequences instead of 4; the run's total goes from 500 to "
        "250 optimiser steps (2 epoch(s)), so the learning-rate schedule is spread over 250 "
        "steps: the next step's rate is 0.0006 (it was to be 0.0008); resume on 2 rank(s) to "
        "keep the old schedule, or set training.max_steps to fix the total"
    )


@pytest.mark.usefixtures("one_thread")
def test_a_resume_on_another_world_size_logs_the_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The checkpoint records its world size; a resume that differs logs the line once."""
    overrides = ("training.max_steps=3", "training.save_steps=2")
    run_plan(tiny_scratch_plan(tmp_path / "run", *overrides), progress=False, stop_after=2)
    state_file = tmp_path / "run" / checkpoint_dir_name(2) / TRAINER_STATE
    state = json.loads(state_file.read_text())
    assert state["world_size"] == 1
    state["world_size"] = 2  # as if two ranks had trained it
    state_file.write_text(json.dumps(state))
    with caplog.at_level(logging.INFO, logger="dflash_recipes.train"):
        run_plan(tiny_scratch_plan(tmp_path / "run", *overrides), progress=False)
    said = [r.getMessage() for r in caplog.records if "trained on 2 rank(s)" in r.getMessage()]
    assert len(said) == 1 and "on 1 rank(s)" in said[0], said
