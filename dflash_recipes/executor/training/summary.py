"""What a training run reports at its end: the summary record and the line `run` prints.

:class:`TrainSummary` is what :func:`~dflash_recipes.executor.training.fit.run_plan` returns
(also written as the last row of metrics.jsonl); :func:`summary_line` is the one line the CLI
prints from it: finished, resumed-finished, or stopped, the held-out tau first when the run
measured one, then which trackers missed rows; :func:`held_out_gap_line` is the warning `run`
adds when the held-out tau says the drafter memorised its training conversations.
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


# The training-batch estimate is above the held-out tau on a healthy run too: it counts
# teacher-forced positions of text the drafter trains on, as if independent, where decoding
# starts each block right after a rejected draft. Measured on the demo's tiny target (the
# held-out tau's gain over 1 as a share of the estimate's): healthy runs on its 60 training
# conversations 0.21 (the warm-start fine-tune, 3.94 against 1.61) to 0.48 (the shipped
# tiny_scratch recipe, 1.83 against 1.40); runs that memorised 2 or 4 conversations 0.02
# (8.00 against 1.15; 16.00 against 1.27) to 0.05 (3.73 against 1.15).
#: The held-out tau says "memorised" when its gain over 1 is below this share of the
#: training-batch estimate's gain (:func:`held_out_gap_line`) ...
MEMORISED_GAIN_SHARE = 0.1
#: ... and the estimate is at least this: below it, the drafter has learned too little for the
#: two figures to disagree about anything.
MEMORISED_MIN_ESTIMATE = 2.0


def held_out_gain_share(summary: TrainSummary) -> float | None:
    """The held-out tau's gain over 1 as a share of the training-batch estimate's (None when
    no held-out tau was measured, or the estimate shows no gain)."""
    tau, estimate = summary.last_eval_tau, summary.acceptance_length_estimate
    if tau is None or not math.isfinite(tau) or not math.isfinite(estimate) or estimate <= 1.0:
        return None
    return (tau - 1.0) / (estimate - 1.0)


def held_out_gap_line(summary: TrainSummary) -> str | None:
    """One warning line when the held-out tau says the drafter memorised its training
    conversations: the estimate at least :data:`MEMORISED_MIN_ESTIMATE` and the held-out gain
    below :data:`MEMORISED_GAIN_SHARE` of it. None otherwise, or when nothing was measured."""
    share = held_out_gain_share(summary)
    estimate = summary.acceptance_length_estimate
    if share is None or estimate < MEMORISED_MIN_ESTIMATE or share >= MEMORISED_GAIN_SHARE:
        return None
    return (
        f"warning: the held-out tau {summary.last_eval_tau:.2f} gains only {share:.0%} of what "
        f"the training-batch estimate {estimate:.2f} gains over 1: the drafter predicts its "
        "training conversations far better than new ones, so it memorised them (too few "
        "distinct conversations for the steps trained); add conversations or train fewer "
        "steps, and judge the drafter by the held-out tau (what serving sees)"
    )


def _outcome_line(summary: TrainSummary) -> str:
    loss = "n/a" if math.isnan(summary.final_loss) else f"{summary.final_loss:.4f}"
    estimate = f"training-batch tau estimate {summary.acceptance_length_estimate:.2f}"
    tau = summary.last_eval_tau
    if tau is not None:  # the figure that predicts serving comes first
        figures = f"held-out tau {tau:.2f}, loss {loss}, {estimate}"
    else:
        figures = f"loss {loss}, {estimate} (no held-out tau measured)"
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


__all__ = [
    "MEMORISED_GAIN_SHARE",
    "MEMORISED_MIN_ESTIMATE",
    "TrainSummary",
    "held_out_gain_share",
    "held_out_gap_line",
    "summary_line",
]
