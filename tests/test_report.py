"""`dflash-recipe report`: PNG from metrics.jsonl, the plot-extra hint, malformed input."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from testkit.compiling import TINY_SCRATCH

from dflash_recipes.cli import main
from dflash_recipes.errors import DFlashRecipeError
from dflash_recipes.report import render_report, report_figure

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write_run(run: Path, accuracies: list[float], *, with_eval: bool) -> Path:
    run.mkdir(parents=True)
    rows = []
    for step in (10, 20, 30):
        acc = [0.0] + [a * step / 30 for a in accuracies]
        rows.append(
            {
                "kind": "train",
                "step": step,
                "loss": 5.0 / step,
                "lr": 1e-4,
                "accuracy_by_position": acc,
                "acceptance_length_estimate": 1.0 + sum(acc[1:]),
                "tokens_per_second": 1000.0,
            }
        )
    if with_eval:
        rows.append({"kind": "eval", "step": 30, "tau": 2.5, "lossless": True})
    rows.append({"kind": "summary", "steps": 30})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_report_of_two_runs_is_a_png(tmp_path: Path) -> None:
    warm = _write_run(tmp_path / "warm", [0.8, 0.6, 0.4], with_eval=True)
    scratch = _write_run(tmp_path / "scratch", [0.3, 0.2, 0.1], with_eval=False)
    out = render_report([warm, scratch], tmp_path / "cmp.png", labels=["warm", "scratch"])
    data = out.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000
    import matplotlib.image

    height, width = matplotlib.image.imread(str(out)).shape[:2]
    assert (width, height) == (1500, 420)
    assert not list(tmp_path.glob(".cmp.png.tmp-*"))


def _lines(ax: object) -> dict[str, tuple[list[float], list[float]]]:
    """Label -> (x, y) of every line plotted on a matplotlib axes."""
    return {
        line.get_label(): (
            [float(x) for x in line.get_xdata()],
            [float(y) for y in line.get_ydata()],
        )
        for line in ax.get_lines()  # type: ignore[attr-defined]
    }


def test_report_plots_the_metrics_of_each_run(tmp_path: Path) -> None:
    warm = _write_run(tmp_path / "warm", [0.8, 0.6, 0.4], with_eval=True)
    scratch = _write_run(tmp_path / "scratch", [0.3, 0.2, 0.1], with_eval=False)
    fig = report_figure([warm, scratch], labels=["warm", "scratch"])
    ax_loss, ax_tau, ax_acc = fig.axes
    steps = [10.0, 20.0, 30.0]

    loss = _lines(ax_loss)
    assert loss.keys() == {"warm", "scratch"}
    for name in ("warm", "scratch"):
        assert loss[name][0] == steps
        assert loss[name][1] == pytest.approx([5.0 / s for s in steps])

    tau = _lines(ax_tau)
    # the estimate of each row is 1 + the sum of its accuracies at positions 1..
    assert tau["warm (estimate)"] == (steps, pytest.approx([1.0 + 1.8 * s / 30 for s in steps]))
    assert tau["scratch (estimate)"] == (steps, pytest.approx([1.0 + 0.6 * s / 30 for s in steps]))
    assert tau["warm (measured tau)"] == ([30.0], [2.5])
    assert "scratch (measured tau)" not in tau  # that run never evaluated

    acc = _lines(ax_acc)
    # the last logged step's accuracies, position 0 (the anchor) left out
    assert acc["warm (step 30)"] == ([1.0, 2.0, 3.0], pytest.approx([0.8, 0.6, 0.4]))
    assert acc["scratch (step 30)"] == ([1.0, 2.0, 3.0], pytest.approx([0.3, 0.2, 0.1]))


def test_report_of_a_real_tiny_run(tmp_path: Path) -> None:
    """Render from what the trainer writes (a 2-step run of the tiny recipe)."""
    import torch

    from dflash_recipes.compiler.compilation import compile_file
    from dflash_recipes.executor.training.trainer import run_plan

    torch.set_num_threads(1)
    result = compile_file(
        TINY_SCRATCH,
        overrides=(
            f"training.output_dir={tmp_path / 'run'}",
            "training.max_steps=2",
            "training.logging_steps=1",
            "dflash.dflash_num_anchors=4",
            "dflash.dflash_block_size=4",
        ),
    )
    assert result.plan is not None
    run_plan(result.plan, progress=False)
    cli = CliRunner().invoke(main, ["report", str(tmp_path / "run"), "-o", str(tmp_path / "r.png")])
    assert cli.exit_code == 0, cli.output
    assert (tmp_path / "r.png").read_bytes().startswith(PNG_SIGNATURE)
    # what is drawn is what the trainer logged
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    loss = _lines(report_figure([tmp_path / "run"], labels=["run"]).axes[0])
    assert loss["run"] == ([1.0, 2.0], pytest.approx([r["loss"] for r in train]))


def test_missing_matplotlib_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _write_run(tmp_path / "run", [0.5], with_eval=False)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(DFlashRecipeError, match=r"pip install 'dflash-recipes\[plot\]'"):
        render_report([run], tmp_path / "r.png")
    assert not (tmp_path / "r.png").exists()


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


def test_report_module_imports_neither_torch_nor_matplotlib() -> None:
    import subprocess

    code = (
        "import sys, dflash_recipes.report; "
        "print('torch' in sys.modules, 'matplotlib' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.split() == ["False", "False"]
