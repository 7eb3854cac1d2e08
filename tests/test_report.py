"""`dflash-recipe report`: PNG from metrics.jsonl, the plot-extra hint, malformed input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from testkit.compiling import TINY_SCRATCH
from testkit.metrics_runs import PNG_SIGNATURE, _write_run

from dflash_recipes.cli import main
from dflash_recipes.report import report_figure


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
    assert tau["warm (training-batch estimate)"] == (
        steps,
        pytest.approx([1.0 + 1.8 * s / 30 for s in steps]),
    )
    assert tau["scratch (training-batch estimate)"] == (
        steps,
        pytest.approx([1.0 + 0.6 * s / 30 for s in steps]),
    )
    assert tau["warm (held-out tau)"] == ([30.0], [2.5])
    assert "scratch (held-out tau)" not in tau  # that run never evaluated

    acc = _lines(ax_acc)
    # the last logged step's accuracies, position 0 (the anchor) left out
    assert acc["warm (step 30)"] == ([1.0, 2.0, 3.0], pytest.approx([0.8, 0.6, 0.4]))
    assert acc["scratch (step 30)"] == ([1.0, 2.0, 3.0], pytest.approx([0.3, 0.2, 0.1]))


def test_report_of_a_real_tiny_run(tmp_path: Path) -> None:
    """Render from what the trainer writes (a 2-step run of the tiny recipe)."""
    import torch

    from dflash_recipes.compiler.compilation import compile_file
    from dflash_recipes.executor.training.fit import run_plan

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


def test_matplotlibs_font_cache_log_stays_out_of_the_output(tmp_path: Path) -> None:
    """Issue 49: the first import on a machine logs "generated new fontManager", which landed
    inside the demo's summary. An empty MPLCONFIGDIR makes this import build the cache."""
    code = (
        "import logging; logging.basicConfig(level=logging.INFO)\n"
        "from dflash_recipes.report import _load_matplotlib\n"
        "_load_matplotlib()\n"
        "print(logging.getLogger('matplotlib.font_manager').level)\n"
    )
    env = {**os.environ, "MPLCONFIGDIR": str(tmp_path / "mpl")}
    child = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert child.returncode == 0, child.stderr
    assert (tmp_path / "mpl").is_dir()  # matplotlib did start afresh there
    said = child.stderr.lower()
    assert "fontmanager" not in said and "font cache" not in said, child.stderr
    assert child.stdout.strip() == "0"  # the logger's level is restored afterwards
