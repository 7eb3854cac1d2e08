"""metrics.jsonl as a metric logger: the run's own record, always written (rank 0).

Unlike the other trackers its failures are not contained: a row that cannot be written stops
the run (:class:`~dflash_recipes.errors.RunIOError`), because metrics.jsonl is the source of
truth that reports, resumes and the trackers' de-duplication rely on.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

from dflash_recipes.executor.training.trackers.protocol import ConfigValue, Outcome

NAME = "metrics.jsonl"


def _strict(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    return value


def metrics_line(row: Mapping[str, object]) -> str:
    """`row` as one strict-JSON line without its newline (non-finite numbers as null)."""
    return json.dumps(_strict(dict(row)), allow_nan=False, sort_keys=True)


def append_jsonl(path: Path, row: Mapping[str, object]) -> str:
    """Append `row` as one strict-JSON line, like the report's rows; returns the line."""
    line = metrics_line(row)
    with path.open("a", encoding="utf-8") as handle:
        handle.write(line + "\n")
    return line


class MetricsJsonl:
    """Appends each row as one strict-JSON line (sorted keys, non-finite numbers as null)."""

    name = NAME

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def resume_state(self) -> Mapping[str, str]:
        return {}

    def log_config(self, config: Mapping[str, ConfigValue], tags: Mapping[str, str]) -> None:
        """Nothing: plan.json beside it is the run's config."""

    def log_row(self, row: Mapping[str, object]) -> None:
        self.write(row)

    def write(self, row: Mapping[str, object]) -> str:
        """Append `row`; returns its line (what the tracker process is sent)."""
        return append_jsonl(self.path, row)

    def flush(self) -> None:
        """Nothing waits: every row is written when it is logged."""

    def close(self, outcome: Outcome) -> None:
        """Nothing to flush: every row is written when it is logged."""


__all__ = ["NAME", "MetricsJsonl", "append_jsonl", "metrics_line"]
