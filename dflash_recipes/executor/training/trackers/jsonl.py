"""metrics.jsonl as a metric logger: the run's own record, always written (rank 0).

Unlike the other trackers its failures are not contained: a row that cannot be written stops
the run (:class:`~dflash_recipes.errors.RunIOError`), because metrics.jsonl is the source of
truth that reports, resumes and the trackers' de-duplication rely on.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from dflash_recipes.executor.training.metrics import append_jsonl
from dflash_recipes.executor.training.trackers.protocol import ConfigValue, Outcome

NAME = "metrics.jsonl"


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


__all__ = ["NAME", "MetricsJsonl"]
