"""The acceptance gate's one rule, the measurements it judges, and `run`'s gate
(training.eval_min_tau) on a run's metrics (issue 38)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import attrs
import pytest
from testkit.tiny import tiny_plan

from dflash_recipes.card.acceptance import (
    acceptance_shortfall,
    eval_step_gate_note,
    last_training_measurement,
    measurement_from_report,
    run_gate_line,
)
from dflash_recipes.plan.run_plan import RunPlan


def test_below_the_requirement_fails_with_measured_and_required() -> None:
    line = acceptance_shortfall(2.5, 3.0, setting="--min-tau")
    assert line == "acceptance gate failed: measured tau 2.5 is below the required 3 (--min-tau)"


def test_at_or_above_the_requirement_passes() -> None:
    assert acceptance_shortfall(3.0, 3.0, setting="--min-tau") is None
    assert acceptance_shortfall(3.25, 3.0, setting="--min-tau") is None


@pytest.mark.parametrize("measured", [None, math.nan, math.inf])
def test_nothing_finite_measured_fails(measured: float | None) -> None:
    line = acceptance_shortfall(measured, 1.5, setting="training.eval_min_tau")
    assert line == (
        "acceptance gate failed: no held-out tau was measured, training.eval_min_tau requires "
        "tau >= 1.5"
    )


def test_numbers_that_differ_never_read_as_equal() -> None:
    line = acceptance_shortfall(2.99996, 3.0, setting="--min-tau")
    assert line is not None and "measured tau 2.99996 is below the required 3 " in line


def test_a_measurement_keeps_names_and_hashes_never_paths() -> None:
    report = {
        "tau": 2.25,
        "tau_per_prompt_mean": 2.5,
        "block_size": 16,
        "drafted_tokens": 15,
        "max_new_tokens": 64,
        "num_prompts": 8,
        "lossless": True,
        "head": "dflash (no head)",
        "settings": {
            "prompt_file": "/data/bench/prompts.json",
            "prompt_file_sha256": "a" * 64,
            "thinking_mode": "off",
            "chat_template_source": "data.chat_template /home/me/templates/qwen.jinja",
            "chat_template_sha256": "b" * 64,
        },
    }
    measured = measurement_from_report(report, source="eval")
    assert measured is not None
    assert (measured.tau, measured.tau_per_prompt_mean, measured.block_size) == (2.25, 2.5, 16)
    assert measured.prompts_file == "prompts.json" and measured.prompts_sha256 == "a" * 64
    assert measured.chat_template == "data.chat_template qwen.jinja"
    assert (measured.thinking_mode, measured.lossless, measured.step) == ("off", True, None)
    assert measurement_from_report({"tau": None, "block_size": 4}, source="eval") is None


def _metrics(plan: RunPlan, *rows: object) -> Path:
    path = Path(plan.training.output_dir) / "metrics.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(row if isinstance(row, str) else json.dumps(row) + "\n" for row in rows),
        encoding="utf-8",
    )
    return path


def test_the_last_training_measurement_up_to_a_step(tmp_path: Path) -> None:
    plan = tiny_plan(tmp_path)
    _metrics(
        plan,
        {"kind": "train", "step": 1, "loss": 1.0},
        {"kind": "eval", "step": 2, "tau": 1.5, "block_size": 4},
        "not json\n",
        {"kind": "eval", "step": 4, "tau": 2.5, "block_size": 4},
    )
    run = Path(plan.training.output_dir)
    last = last_training_measurement(run)
    assert last is not None and (last.step, last.tau, last.source) == (4, 2.5, "training")
    earlier = last_training_measurement(run, up_to_step=3)
    assert earlier is not None and (earlier.step, earlier.tau) == (2, 1.5)
    assert last_training_measurement(run, up_to_step=1) is None
    assert last_training_measurement(tmp_path / "nowhere") is None


def _gated(tmp_path: Path, required: float | None) -> RunPlan:
    plan = tiny_plan(tmp_path, eval_steps=2)
    return attrs.evolve(plan, training=attrs.evolve(plan.training, eval_min_tau=required))


def test_run_gate_judges_the_last_held_out_measurement(tmp_path: Path) -> None:
    assert run_gate_line(_gated(tmp_path, None)) is None  # no gate, nothing read
    plan = _gated(tmp_path, 2.0)
    assert run_gate_line(plan) == (
        "acceptance gate failed: no held-out tau was measured in this run (training.eval_steps "
        "2), training.eval_min_tau requires tau >= 2"
    )
    _metrics(
        plan,
        {"kind": "eval", "step": 2, "tau": 2.5, "block_size": 4},
        {"kind": "eval", "step": 4, "tau": 1.75, "block_size": 4},
    )
    assert run_gate_line(plan) == (
        "acceptance gate failed: measured tau 1.75 is below the required 2 "
        "(training.eval_min_tau, held-out eval at step 4)"
    )
    assert run_gate_line(_gated(tmp_path, 1.75)) is None


def test_the_eval_step_note_says_the_run_goes_on(tmp_path: Path) -> None:
    plan = _gated(tmp_path, 3.0)
    note = eval_step_gate_note(plan, 2.0, step=10)
    assert note == (
        "eval at step 10: tau 2 is below training.eval_min_tau 3; the run goes on and ends "
        "with exit 1 after its export unless a later eval reaches it"
    )
    assert eval_step_gate_note(plan, 3.0, step=10) is None
    assert eval_step_gate_note(_gated(tmp_path, None), 1.0, step=10) is None
