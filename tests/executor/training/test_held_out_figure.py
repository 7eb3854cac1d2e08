"""The held-out acceptance figure during training, and the training-batch estimate named as
what it is (issue 36, "An acceptance figure that does not flatter")."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import attrs
import pytest
from testkit.compiling import tiny_scratch_plan

from dflash_recipes.executor.training.eval_policy import EvalPolicy
from dflash_recipes.executor.training.fit import run_plan
from dflash_recipes.executor.training.summary import (
    TrainSummary,
    held_out_gap_line,
    summary_line,
)


def _summary(**changes: Any) -> TrainSummary:
    base = TrainSummary(
        steps=300,
        resumed_from_step=None,
        final_loss=0.0312,
        accuracy_by_position=(0.0, 0.99, 0.97),
        acceptance_length_estimate=7.65,
        tokens_per_second=100.0,
        export_dir="/runs/x/export",
        warm_start=None,
        data_summary="",
        last_eval_tau=None,
        planned_steps=300,
        steps_this_run=300,
    )
    return attrs.evolve(base, **changes)


def test_the_summary_line_puts_the_held_out_tau_first() -> None:
    line = summary_line(_summary(last_eval_tau=1.06))
    assert line == (
        "done: 300 steps, held-out tau 1.06, loss 0.0312, training-batch tau estimate 7.65, "
        "export /runs/x/export"
    )


def test_without_a_measurement_the_summary_line_says_so() -> None:
    line = summary_line(_summary())
    assert line == (
        "done: 300 steps, loss 0.0312, training-batch tau estimate 7.65 (no held-out tau "
        "measured), export /runs/x/export"
    )


def test_a_held_out_tau_far_below_the_estimate_gets_one_warning() -> None:
    line = held_out_gap_line(_summary(last_eval_tau=1.06))
    assert line is not None and "\n" not in line
    assert line.startswith("warning: the held-out tau 1.06 is far below the training-batch")
    assert "memorised" in line and "add conversations or train fewer steps" in line


@pytest.mark.parametrize("tau", [None, 6.0, 4.4, float("nan")])
def test_a_held_out_tau_near_the_estimate_or_none_gets_no_warning(tau: float | None) -> None:
    # 4.4: its gain over 1 (3.4) is more than half the estimate's (6.65 / 2 = 3.325)
    assert held_out_gap_line(_summary(last_eval_tau=tau)) is None


def test_just_under_half_the_estimate_s_gain_warns() -> None:
    assert held_out_gap_line(_summary(last_eval_tau=4.3)) is not None


def test_exactly_half_the_estimate_s_gain_is_not_far_below() -> None:
    # gain 1.0 against the estimate's 2.0: "far below" starts under half, not at it
    assert held_out_gap_line(_summary(last_eval_tau=2.0, acceptance_length_estimate=3.0)) is None
    assert held_out_gap_line(_summary(last_eval_tau=1.99, acceptance_length_estimate=3.0))


def _policy(tmp_path: Path, *overrides: str) -> EvalPolicy:
    plan = tiny_scratch_plan(tmp_path / "run", "training.max_steps=60", *overrides)
    unused: Any = None
    return EvalPolicy(plan, unused, unused, unused, unused, final_step=60)


def test_eval_data_without_eval_steps_measures_every_save_steps(tmp_path: Path) -> None:
    policy = _policy(tmp_path, "training.eval_steps=null", "training.save_steps=20")
    assert policy.plan.training.eval_steps == 20
    assert [s for s in range(1, 61) if policy.due(s, stopping=False)] == [20, 40, 60]
    assert not policy.due(20, stopping=True)


def test_eval_steps_0_never_measures(tmp_path: Path) -> None:
    policy = _policy(tmp_path, "training.eval_steps=0")
    assert policy.plan.training.eval_steps is None
    assert not any(policy.due(s, stopping=False) for s in range(1, 61))


def test_the_gate_adds_the_final_step(tmp_path: Path) -> None:
    gated = _policy(tmp_path, "training.eval_steps=25", "training.eval_min_tau=2.0")
    assert [s for s in range(1, 61) if gated.due(s, stopping=False)] == [25, 50, 60]
    plain = _policy(tmp_path, "training.eval_steps=25")
    assert [s for s in range(1, 61) if plain.due(s, stopping=False)] == [25, 50]


@pytest.mark.usefixtures("one_thread")
def test_a_gated_run_measures_its_final_weights_with_the_recipe_s_sizes_and_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plan = tiny_scratch_plan(
        tmp_path / "run",
        "training.max_steps=2",
        "training.save_steps=2",
        "training.eval_steps=100",
        "training.eval_min_tau=99",
        "training.eval_num_prompts=1",
        "training.eval_max_new_tokens=5",
    )
    with caplog.at_level(logging.INFO, logger="dflash_recipes.train"):
        summary = run_plan(plan, progress=False)
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [(r["step"], r["num_prompts"], r["max_new_tokens"]) for r in evals] == [(2, 1, 5)]
    assert summary.last_eval_tau == evals[0]["tau"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("is below training.eval_min_tau 99" in w for w in warnings), warnings
    measured = [r.getMessage() for r in caplog.records if "held-out tau" in r.getMessage()]
    assert measured and "(measured on 1 prompt(s) x 5 new tokens)" in measured[0]
