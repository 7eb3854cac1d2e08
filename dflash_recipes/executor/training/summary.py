"""What a training run reports at its end: the summary record and the line `run` prints.

:class:`TrainSummary` is what :func:`~dflash_recipes.executor.training.fit.run_plan` returns
(also written as the last row of metrics.jsonl); :func:`summary_line` is the one line the CLI
prints from it: finished, resumed-finished, or stopped, then which trackers missed rows.
"""

from __future__ import annotations

import math

import attrs

from dflash_recipes.records import Record


@attrs.frozen(repr=False, eq=False, slots=False)
class TrainSummary(Record):
    """What a finished run reports (also written as the last line of metrics.jsonl).

    ``steps`` is the optimiser step the run reached (fewer than ``planned_steps`` when it
    stopped early); ``steps_this_run`` is 0 when a finished run was resumed.
    """

    steps: int
    resumed_from_step: int | None
    final_loss: float
    accuracy_by_position: tuple[float, ...]
    acceptance_length_estimate: float
    tokens_per_second: float
    export_dir: str | None
    warm_start: str | None
    data_summary: str
    last_eval_tau: float | None = None
    planned_steps: int = 0
    steps_this_run: int = 0
    #: One line per tracker of training.report_to that missed rows in this run.
    tracker_problems: tuple[str, ...] = ()


def summary_line(summary: TrainSummary) -> str:
    """The one line `dflash-recipe run` prints at the end: finished, resumed-finished, stopped;
    then which trackers missed rows, if any did."""
    line = _outcome_line(summary)
    if summary.tracker_problems:
        line += "; trackers: " + "; ".join(summary.tracker_problems) + " (metrics.jsonl has all)"
    return line


def _outcome_line(summary: TrainSummary) -> str:
    loss = "n/a" if math.isnan(summary.final_loss) else f"{summary.final_loss:.4f}"
    figures = f"loss {loss}, estimated acceptance length {summary.acceptance_length_estimate:.2f}"
    if summary.steps < summary.planned_steps:
        return (
            f"stopped after {summary.steps} of {summary.planned_steps} steps, {figures}; "
            "no export (rerun to resume)"
        )
    if summary.steps_this_run == 0 and summary.resumed_from_step is not None:
        return (
            f"already finished: {summary.steps} of {summary.planned_steps} steps were done "
            f"before, nothing left to train; {figures} (last logged), export "
            f"{summary.export_dir}"
        )
    return f"done: {summary.steps} steps, {figures}, export {summary.export_dir}"


__all__ = ["TrainSummary", "summary_line"]
