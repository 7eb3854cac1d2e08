"""The metrics.jsonl rows: written by the schema's helpers, read back with located errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from testkit.metrics_runs import _write_run

from dflash_recipes.cli import main
from dflash_recipes.errors import DFlashRecipeError
from dflash_recipes.report import render_report


def test_malformed_line_is_named(tmp_path: Path) -> None:
    run = _write_run(tmp_path / "run", [0.5], with_eval=False)
    with (run / "metrics.jsonl").open("a") as handle:
        handle.write("{broken\n")
    with pytest.raises(DFlashRecipeError, match=r"metrics\.jsonl:5: not a JSON object"):
        render_report([run], tmp_path / "r.png")


def test_missing_metrics_file(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["report", str(tmp_path), "-o", str(tmp_path / "r.png")])
    assert result.exit_code == 1
    assert "metrics.jsonl does not exist" in result.output
    assert "Traceback" not in result.output


def test_schema_helpers_round_trip(tmp_path: Path) -> None:
    """Rows built with the schema helpers are what the reader reads back (NaN -> missing)."""
    from dflash_recipes.files.metrics_rows import (
        KIND_TRAIN,
        TRAIN_KEYS,
        eval_row,
        metrics_json_line,
        read_metrics,
        train_row,
    )

    row = train_row(
        step=5,
        loss=float("nan"),
        lr=1e-4,
        accuracy_by_position=[None, 0.5, 0.25],
        acceptance_length_estimate=1.6,
        tokens_per_second=123.0,
    )
    assert set(row) == {"kind", *TRAIN_KEYS} and row["kind"] == KIND_TRAIN
    line = metrics_json_line(row)
    assert "NaN" not in line and line.endswith("\n")
    evaluated = metrics_json_line(eval_row(step=5, tau=2.25, per_position_acceptance=[0.5]))
    (tmp_path / "metrics.jsonl").write_text(line + evaluated, encoding="utf-8")
    metrics = read_metrics(tmp_path)
    (point,) = metrics.train
    assert point.loss is None
    assert point.accuracy_by_position == (None, 0.5, 0.25)
    assert [(e.step, e.tau) for e in metrics.evals] == [(5, 2.25)]


def test_row_without_a_required_key_names_line_and_key(tmp_path: Path) -> None:
    run = _write_run(tmp_path / "run", [0.5], with_eval=False)
    with (run / "metrics.jsonl").open("a") as handle:
        handle.write(json.dumps({"kind": "train", "step": 40, "loss": 0.1}) + "\n")
    with pytest.raises(DFlashRecipeError) as info:
        render_report([run], tmp_path / "r.png")
    message = str(info.value)
    assert "metrics.jsonl:5:" in message
    assert "lr" in message and "accuracy_by_position" in message
    assert not (tmp_path / "r.png").exists()


def test_the_training_batch_estimate_is_named_as_such_and_the_old_name_still_reads(
    tmp_path: Path,
) -> None:
    """The row (and so every tracker, `train/<key>`) names the estimate from training batches
    apart from the measured `tau`; a metrics file written under the old key still reads."""
    from dflash_recipes.files.metrics_rows import metrics_json_line, read_metrics, train_row

    row = train_row(
        step=1,
        loss=1.0,
        lr=1e-4,
        accuracy_by_position=[None, 0.5],
        acceptance_length_estimate=1.5,
        tokens_per_second=10.0,
    )
    assert row["train_batch_tau_estimate"] == 1.5
    assert "acceptance_length_estimate" not in row
    old = json.loads(metrics_json_line(row))
    old["acceptance_length_estimate"] = old.pop("train_batch_tau_estimate")
    (tmp_path / "metrics.jsonl").write_text(json.dumps(old) + "\n", encoding="utf-8")
    (point,) = read_metrics(tmp_path).train
    assert point.acceptance_length_estimate == 1.5
