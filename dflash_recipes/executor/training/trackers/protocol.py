"""The metric-logger seam: what every tracker implements and what it is opened with.

The trainer hands each metrics row (``kind`` train, eval or summary; the rows of
metrics.jsonl) to a :class:`~dflash_recipes.executor.training.trackers.fanout.TrackerSet`,
which passes it to every :class:`MetricLogger`. A logger turns rows into its library's calls;
the helpers here give all of them the same metric names (:func:`row_scalars`) and the same
flattened plan (:func:`flat_config`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Literal, Protocol

import attrs

from dflash_recipes.records import Record

#: How a run ended, for the trackers that record it (MLflow's run status, W&B's exit code).
Outcome = Literal["finished", "stopped", "failed"]
#: A value of the flattened plan.
ConfigValue = str | int | float | bool | None

#: List-valued row keys sent per draft position (key -> the position of index 0).
_PER_POSITION = {
    "accuracy_by_position": 0,
    "per_position_acceptance": 1,
    "reached_per_position": 1,
}


@attrs.frozen(repr=False, eq=False, slots=False)
class TrackerContext(Record):
    """What a tracker is opened with (rank 0 only)."""

    #: The run's output directory (where trackers.json and default local stores live).
    run_dir: Path
    run_name: str
    #: TensorBoard's event directory (the plan's training.logging_dir).
    logging_dir: Path
    #: The checkpoint step this run resumed from; None for a fresh run.
    resumed_from: int | None
    #: On resume, the train and eval rows metrics.jsonl keeps from the earlier attempts (steps
    #: up to the checkpoint). A tracker sends those beyond what it already holds, then skips
    #: live rows of steps it holds, so each step reaches it once even when a killed process
    #: lost rows it had buffered.
    earlier_rows: tuple[Mapping[str, object], ...]
    #: What this tracker kept in trackers.json to continue its run (its run id), or {}.
    kept: Mapping[str, str]


class MetricLogger(Protocol):
    """One destination of the metrics rows. Methods may raise: the caller contains failures."""

    #: The name in training.report_to (``metrics.jsonl`` for the file itself).
    name: str

    @property
    def resume_state(self) -> Mapping[str, str]:
        """What to keep in the run directory so that a resumed run continues this run."""
        ...

    def log_config(self, config: Mapping[str, ConfigValue], tags: Mapping[str, str]) -> None:
        """Record the flattened plan (params/config) and tags (the plan fingerprint)."""
        ...

    def log_row(self, row: Mapping[str, object]) -> None:
        """Record one metrics row (``kind`` train, eval or summary)."""
        ...

    def flush(self) -> None:
        """Deliver every row logged so far (a background sender raises :class:`RowsLost`)."""
        ...

    def close(self, outcome: Outcome) -> None:
        """Flush and end the run."""
        ...


class RowsLost(Exception):
    """A tracker that sends in the background lost `rows` rows (the one being logged included)."""

    def __init__(self, rows: int, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.rows = rows


def row_step(row: Mapping[str, object]) -> int | None:
    """The optimiser step of a train or eval row; a summary's ``steps``; else None."""
    step = row.get("step", row.get("steps"))
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def row_scalars(row: Mapping[str, object]) -> dict[str, float]:
    """The row's numbers as ``<kind>/<key>`` metrics (per-position lists as ``<key>/<k>``).

    Nulls and non-finite values are left out; booleans are 0/1; strings and other lists
    (per-prompt figures, mismatch indices) stay in metrics.jsonl only.
    """
    kind = str(row.get("kind", "row"))
    out: dict[str, float] = {}
    for key, value in row.items():
        if key in ("kind", "step"):
            continue
        if key in _PER_POSITION and isinstance(value, (list, tuple)):
            first = _PER_POSITION[key]
            for index, item in enumerate(value):
                number = _number(item)
                if number is not None:
                    out[f"{kind}/{key}/{first + index}"] = number
            continue
        number = _number(value)
        if number is not None:
            out[f"{kind}/{key}"] = number
    return out


def _number(value: object) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


def flat_config(plan: Mapping[str, object], prefix: str = "") -> dict[str, ConfigValue]:
    """The plan as dotted keys (``training.learning_rate``); lists as JSON text."""
    out: dict[str, ConfigValue] = {}
    for key, value in plan.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flat_config(value, f"{name}."))
        elif isinstance(value, (list, tuple)):
            out[name] = json.dumps(value, sort_keys=True)
        elif value is None or isinstance(value, (str, int, float, bool)):
            out[name] = value
        else:
            out[name] = str(value)
    return out


__all__ = [
    "ConfigValue",
    "MetricLogger",
    "Outcome",
    "RowsLost",
    "TrackerContext",
    "flat_config",
    "row_scalars",
    "row_step",
]
