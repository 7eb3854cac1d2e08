"""Runs with trackers: their metrics rows, a child process's environment, and an action taken
when the trainer logs a given step (the moment a test kills a tracker or its server)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from dflash_recipes.executor.training.fit import run_plan
from dflash_recipes.executor.training.summary import TrainSummary
from dflash_recipes.plan.run_plan import RunPlan


def metrics_rows(run_dir: Path, kind: str) -> list[dict[str, object]]:
    """The rows of `kind` (train, eval, summary) in the run's metrics.jsonl."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, lines) if row["kind"] == kind]


def child_env() -> dict[str, str]:
    """This environment for a child process, without the W&B service an earlier test of this
    process started (its address is in WANDB_SERVICE): a killed child would leave its run open
    in that shared service; in real use the killed process's own service goes with it."""
    env = {key: value for key, value in os.environ.items() if key != "WANDB_SERVICE"}
    env["OMP_NUM_THREADS"] = "1"
    return env


def run_acting_at_step(
    plan: RunPlan, step: int, action: Callable[[], None], caplog: pytest.LogCaptureFixture
) -> TrainSummary:
    """Run `plan` here, calling `action` once when the trainer logs step `step`; the train
    log is captured in `caplog`."""
    done: list[bool] = []

    class ActAtStep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith(f"step {step} ") and not done:
                done.append(True)
                action()

    train_logger = logging.getLogger("dflash_recipes.train")
    handler = ActAtStep()
    train_logger.addHandler(handler)
    try:
        with caplog.at_level(logging.INFO, logger="dflash_recipes.train"):
            return run_plan(plan, progress=False)
    finally:
        train_logger.removeHandler(handler)
