"""`dflash-recipe report`: a PNG drawn from the `metrics.jsonl` of one or more runs.

The rows are read with :func:`dflash_recipes.files.metrics_rows.read_metrics` (their schema
lives there, shared with the trainer that writes them); rows of other kinds than train and
eval (the trainer's final `"summary"`) are not plotted.

:func:`render_report` draws loss, estimated and measured acceptance length over steps, and
accuracy by block position at the last logged step, one line per run (two runs: a warm-start
vs. from-scratch comparison). It needs matplotlib (`pip install 'dflash-recipes[plot]'`),
imported only when a report is drawn, without touching pyplot's global backend. No torch here.
"""

from __future__ import annotations

import io
import logging
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_recipes.errors import DFlashRecipeError
from dflash_recipes.files.metrics_rows import (
    EVAL_KEYS,
    KEY_ACCEPTANCE_LENGTH_ESTIMATE,
    KEY_ACCURACY_BY_POSITION,
    KEY_KIND,
    KEY_LOSS,
    KEY_LR,
    KEY_STEP,
    KEY_TAU,
    KEY_TOKENS_PER_SECOND,
    KIND_EVAL,
    KIND_TRAIN,
    TRAIN_KEYS,
    EvalMetricsRow,
    EvalPoint,
    MetricsRow,
    RunMetrics,
    TrainPoint,
    eval_row,
    metrics_json_line,
    metrics_path,
    read_metrics,
    train_row,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# -- the metrics schema ------------------------------------------------------------------------


PLOT_EXTRA_HINT = "pip install 'dflash-recipes[plot]'"


# -- reading -----------------------------------------------------------------------------------


# -- drawing -----------------------------------------------------------------------------------


def _load_matplotlib() -> type[Figure]:
    # The first import on a machine builds matplotlib's font cache and logs it ("generated new
    # fontManager", "building the font cache"), which landed inside the demo's summary: that
    # logger is held at ERROR for the import only.
    font_log = logging.getLogger("matplotlib.font_manager")
    level = font_log.level
    font_log.setLevel(logging.ERROR)
    try:
        import matplotlib  # noqa: F401  (a missing package fails here, not on a cached submodule)
        from matplotlib.figure import Figure
    except ImportError as exc:
        msg = f"the training report needs matplotlib: {PLOT_EXTRA_HINT}"
        raise DFlashRecipeError(msg) from exc
    finally:
        font_log.setLevel(level)
    return Figure


def default_labels(runs: Sequence[Path]) -> list[str]:
    """Directory names of the runs, made unique with their parents where two collide."""
    dirs = [metrics_path(r).parent.resolve() for r in runs]
    labels = [d.name or str(d) for d in dirs]
    if len(set(labels)) != len(labels):
        labels = [f"{d.parent.name}/{d.name}" for d in dirs]
    if len(set(labels)) != len(labels):
        labels = [str(d) for d in dirs]
    return labels


def render_report(runs: Sequence[Path], out: Path, *, labels: Sequence[str] | None = None) -> Path:
    """Draw the training report of `runs` (output dirs or metrics files) as a PNG at `out`.

    Panels: loss over steps; estimated (lines) and measured (markers) acceptance length over
    steps; accuracy by block position at each run's last logged step. With several runs they
    are overlaid with their labels (default: the directory names). The PNG is written to a
    temporary sibling and renamed, so `out` is never a partial image (a symlink's target gets
    it; a device or FIFO is written through). Returns `out`.
    """
    fig = report_figure(runs, labels=labels)
    _save_atomic(fig, out)
    return out


def report_figure(runs: Sequence[Path], *, labels: Sequence[str] | None = None) -> Figure:
    """The figure :func:`render_report` saves, unsaved: its three axes hold the plotted lines.

    Axes in order: loss; acceptance length (per run the training-batch estimate, then the
    held-out measured tau when the run evaluated); accuracy by block position 1.. at the last
    logged step.
    """
    if not runs:
        msg = "render_report needs at least one run directory"
        raise DFlashRecipeError(msg)
    if labels is not None and len(labels) != len(runs):
        msg = f"{len(labels)} label(s) given for {len(runs)} run(s); give one label per run"
        raise DFlashRecipeError(msg)
    figure_cls = _load_matplotlib()
    metrics = [read_metrics(Path(r)) for r in runs]
    names = list(labels) if labels is not None else default_labels([Path(r) for r in runs])
    fig = figure_cls(figsize=(15, 4.2), dpi=100, layout="constrained")
    _draw(fig, metrics, names)
    return fig


def _draw(fig: Figure, metrics: Sequence[RunMetrics], names: Sequence[str]) -> None:
    ax_loss, ax_tau, ax_acc = fig.subplots(1, 3)
    colors = [f"C{i % 10}" for i in range(len(metrics))]
    for run, name, color in zip(metrics, names, colors, strict=True):
        steps = [p.step for p in run.train]
        ax_loss.plot(steps, _nan(p.loss for p in run.train), color=color, label=name)
        ax_tau.plot(
            steps,
            _nan(p.acceptance_length_estimate for p in run.train),
            color=color,
            label=f"{name} (training-batch estimate)",
        )
        if run.evals:
            ax_tau.plot(
                [e.step for e in run.evals],
                _nan(e.tau for e in run.evals),
                color=color,
                linestyle="--",
                marker="o",
                label=f"{name} (held-out tau)",
            )
        last = run.train[-1]
        # position 0 is the anchor (given, never predicted): not plotted
        accuracies = last.accuracy_by_position[1:]
        ax_acc.plot(
            range(1, 1 + len(accuracies)),
            _nan(accuracies),
            color=color,
            marker="o",
            label=f"{name} (step {last.step})",
        )
    title = " vs ".join(names) if len(names) == 2 else None
    if title is not None:
        fig.suptitle(title)
    ax_loss.set(title="training loss", xlabel="step", ylabel="loss")
    ax_tau.set(title="acceptance length", xlabel="step", ylabel="tokens per target pass")
    ax_acc.set(
        title="accuracy by block position (last logged step)",
        xlabel="block position",
        ylabel="top-1 accuracy",
        ylim=(0.0, 1.02),
    )
    for ax in (ax_loss, ax_tau, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)


def _nan(values: Iterable[float | None]) -> list[float]:
    return [math.nan if v is None else v for v in values]


def _save_atomic(fig: Figure, out: Path) -> None:
    """PNG bytes to `out` as -o promises: atomic for files, through symlinks and devices."""
    from dflash_recipes.files.crashsafe import write_output

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    try:
        write_output(out, buffer.getvalue())
    except OSError as exc:
        msg = f"cannot write {out}: {exc.strerror or exc}; choose an -o path you can write to"
        raise DFlashRecipeError(msg) from exc


__all__ = [
    "EVAL_KEYS",
    "KEY_ACCEPTANCE_LENGTH_ESTIMATE",
    "KEY_ACCURACY_BY_POSITION",
    "KEY_KIND",
    "KEY_LOSS",
    "KEY_LR",
    "KEY_STEP",
    "KEY_TAU",
    "KEY_TOKENS_PER_SECOND",
    "KIND_EVAL",
    "KIND_TRAIN",
    "PLOT_EXTRA_HINT",
    "TRAIN_KEYS",
    "EvalMetricsRow",
    "EvalPoint",
    "MetricsRow",
    "RunMetrics",
    "TrainPoint",
    "default_labels",
    "eval_row",
    "metrics_json_line",
    "metrics_path",
    "read_metrics",
    "render_report",
    "report_figure",
    "train_row",
]
