"""The optimiser builder: the schedule's shape and how many optimiser steps a run takes."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
from testkit.compiling import tiny_scratch_plan
from torch import nn

from dflash_recipes.executor.training.setup.optimizer import (
    build_optimization,
    lr_factor,
    total_optimizer_steps,
)


def test_schedule_warmup_then_cosine() -> None:
    factors = [lr_factor(s, total_steps=10, warmup_ratio=0.2, kind="cosine") for s in range(10)]
    assert factors[0] == pytest.approx(0.5) and factors[1] == pytest.approx(1.0)
    assert factors[2] == pytest.approx(1.0)
    assert factors[-1] == pytest.approx(0.5 * (1 + math.cos(math.pi * 7 / 8)))
    assert all(a >= b for a, b in itertools.pairwise(factors[1:]))
    assert lr_factor(5, total_steps=10, warmup_ratio=0.0, kind="constant") == 1.0
    assert lr_factor(5, total_steps=10, warmup_ratio=0.0, kind="linear") == pytest.approx(0.5)


def test_steps_are_epochs_times_whole_accumulated_batches_unless_max_steps(
    tmp_path: Path,
) -> None:
    by_epochs = tiny_scratch_plan(
        tmp_path / "run",
        "training.max_steps=null",
        "training.num_train_epochs=3",
        "training.gradient_accumulation_steps=2",
    )
    # 7 batches per epoch make 3 optimiser steps (the 7th micro-batch starts no step)
    assert total_optimizer_steps(by_epochs, 7) == 9
    assert total_optimizer_steps(by_epochs, 1) == 1  # never 0 steps
    capped = tiny_scratch_plan(tmp_path / "run", "training.max_steps=5")
    assert total_optimizer_steps(capped, 1000) == 5


def test_the_built_schedule_spans_the_runs_steps(tmp_path: Path) -> None:
    plan = tiny_scratch_plan(
        tmp_path / "run",
        "training.max_steps=4",
        "training.warmup_ratio=0.0",
        "training.lr_scheduler_type=linear",
        "training.learning_rate=0.01",
    )
    layer = nn.Linear(2, 2)
    built = build_optimization(plan, list(layer.parameters()), batches_per_epoch=1)
    assert built.total_steps == 4
    rates = []
    for _ in range(4):
        rates.append(built.scheduler.get_last_lr()[0])
        built.optimizer.step()
        built.scheduler.step()
    assert rates == pytest.approx([0.01, 0.0075, 0.005, 0.0025])
