"""The console's progress line, the logged learning rate and the throughput window (issue 36)."""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import pytest
import torch
from testkit.compiling import tiny_scratch_plan

from dflash_recipes.executor.dist_env import detect_dist_env
from dflash_recipes.executor.training import fit as fit_module
from dflash_recipes.executor.training.eval_policy import EvalPolicy
from dflash_recipes.executor.training.fit import run_plan
from dflash_recipes.executor.training.loss import LossOutput
from dflash_recipes.executor.training.metrics import (
    MetricWindow,
    log_train_window,
    progress_line,
)
from dflash_recipes.executor.training.save_policy import SavePolicy
from dflash_recipes.executor.training.setup.optimizer import lr_factor
from dflash_recipes.executor.training.trackers.fanout import TrackerSet
from dflash_recipes.files.metrics_rows import train_row


def test_the_line_of_a_plain_head_starts_at_position_1() -> None:
    row = train_row(
        step=10,
        loss=4.89,
        lr=0.00162,
        accuracy_by_position=[None, 0.4125, 0.22, 0.1],
        acceptance_length_estimate=1.7531,
        tokens_per_second=5120.4,
        grad_norm=0.5,
    )
    assert progress_line(row) == (
        "step 10 loss 4.8900 lr 0.00162 acc[1..] 0.41 0.22 0.10 train-batch tau~1.75 tok/s 5120"
    )


def test_the_line_of_a_label_shifted_head_starts_at_position_0() -> None:
    row = train_row(
        step=300,
        loss=0.0312,
        lr=3e-6,
        accuracy_by_position=[0.99, 0.97, 0.955],
        acceptance_length_estimate=3.9,
        tokens_per_second=812.0,
        grad_norm=None,
    )
    assert progress_line(row) == (
        "step 300 loss 0.0312 lr 3e-06 acc[0..] 0.99 0.97 0.95 train-batch tau~3.90 tok/s 812"
    )


def test_a_null_figure_shows_as_nan() -> None:
    row = train_row(
        step=1,
        loss=float("nan"),
        lr=0.001,
        accuracy_by_position=[None, 0.5],
        acceptance_length_estimate=None,
        tokens_per_second=10.0,
        grad_norm=None,
    )
    expected = "step 1 loss nan lr 0.001 acc[1..] 0.50 train-batch tau~nan tok/s 10"
    assert progress_line(row) == expected


def _train_rows(run_dir: Path) -> list[dict[str, object]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"]


@pytest.mark.usefixtures("one_thread")
def test_a_run_prints_each_row_s_line_and_the_rate_each_step_used(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The console shows metrics.jsonl's figures, and a cosine run's last row shows the rate
    its last step used (not the 0.0 the scheduler moves to after it)."""
    plan = tiny_scratch_plan(
        tmp_path / "run",
        "training.max_steps=4",
        "training.save_steps=4",
        "training.warmup_ratio=0.25",
        "training.lr_scheduler_type=cosine",
    )
    with caplog.at_level(logging.INFO, logger="dflash_recipes.train"):
        run_plan(plan, progress=False)
    rows = _train_rows(tmp_path / "run")
    printed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert printed == [progress_line(row) for row in rows]
    peak = plan.training.learning_rate
    expected = [
        peak * lr_factor(k, total_steps=4, warmup_ratio=0.25, kind="cosine") for k in range(4)
    ]
    assert [row["lr"] for row in rows] == pytest.approx(expected, rel=1e-12)
    assert isinstance(rows[-1]["lr"], float) and rows[-1]["lr"] > 0.0


class _FakeClock:
    """A clock that moves one second per reading, plus what a test adds."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_a_paused_window_does_not_count_the_pause() -> None:
    clock = _FakeClock()
    window = MetricWindow(4, clock=clock)  # reads 1
    with window.paused():  # reads 2, then 1e6 more, then reads once more
        clock.now += 1e6
    assert window.elapsed() == 2.0  # read at 1e6 + 4, started at 1, paused 1e6 + 1


@pytest.mark.usefixtures("one_thread")
def test_checkpoint_time_is_not_in_the_next_window_s_throughput(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = _FakeClock()
    monkeypatch.setattr(fit_module, "MetricWindow", functools.partial(MetricWindow, clock=clock))
    save = SavePolicy.save

    def slow_save(self: SavePolicy, *args: object, **kwargs: object) -> None:
        save(self, *args, **kwargs)  # type: ignore[arg-type]
        clock.now += 1e6  # a checkpoint that takes "forever"

    monkeypatch.setattr(SavePolicy, "save", slow_save)
    plan = tiny_scratch_plan(tmp_path / "run", "training.max_steps=4", "training.save_steps=2")
    run_plan(plan, progress=False)
    rates = [float(str(row["tokens_per_second"])) for row in _train_rows(tmp_path / "run")]
    # Every window holds one step of a fixed-size batch and a few clock readings: the rates
    # are of one size. Step 3's window, after step 2's checkpoint, would be 1e5 times smaller.
    assert max(rates) / min(rates) < 10, rates


def test_evaluation_time_is_not_in_the_next_window_s_throughput(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = _FakeClock()
    monkeypatch.setattr(fit_module, "MetricWindow", functools.partial(MetricWindow, clock=clock))
    measure = EvalPolicy.measure

    def slow_measure(self: EvalPolicy, step: int) -> float | None:
        tau = measure(self, step)
        clock.now += 1e6  # a held-out measurement that takes "forever"
        return tau

    monkeypatch.setattr(EvalPolicy, "measure", slow_measure)
    plan = tiny_scratch_plan(
        tmp_path / "run",
        "training.max_steps=4",
        "training.save_steps=100",
        "training.eval_steps=2",
        "training.eval_num_prompts=1",
        "training.eval_max_new_tokens=2",
    )
    run_plan(plan, progress=False)
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [2, 4]
    rates = [float(str(row["tokens_per_second"])) for row in _train_rows(tmp_path / "run")]
    assert len(rates) == 4
    # step 3's window follows step 2's measurement: counted, it would be 1e5 times smaller
    assert max(rates) / min(rates) < 10, rates


def _micro_batch(loss: float, weight: float) -> LossOutput:
    zeros = torch.zeros(4, dtype=torch.long)
    return LossOutput(
        loss=torch.tensor(loss),
        ce=torch.tensor(loss),
        per_position_correct=zeros,
        per_position_count=zeros,
        weight_sum=torch.tensor(weight),
    )


def test_the_logged_loss_weighs_each_micro_batch_by_its_supervised_weight() -> None:
    """As the gradient does: 1 position at loss 1.0 and 3 at loss 4.0 log 3.25, not the mean
    of the two micro-batches' means (2.5)."""
    window = MetricWindow(4, clock=_FakeClock())
    window.add(_micro_batch(1.0, 1.0), torch.tensor(10))
    window.add(_micro_batch(4.0, 3.0), torch.tensor(10))
    window.settle()
    row = log_train_window(
        window, step=1, lr=0.1, trackers=TrackerSet.silent(), env=detect_dist_env("cpu", {})
    )
    assert row["loss"] == pytest.approx(3.25)
