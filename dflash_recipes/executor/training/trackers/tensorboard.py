"""TensorBoard: event files in training.logging_dir through ``torch.utils.tensorboard``.

Every metric is a scalar at its optimiser step. Each run (fresh or resumed) opens its event
file with a purge marker at step 1 (``purge_step``), so TensorBoard drops every earlier
attempt's events, and a resumed run writes the rows metrics.jsonl kept again before going on:
each step shows once, with the values metrics.jsonl has, even when a killed process had not
flushed its events. The plan is a text summary (``plan``), its fingerprint another
(``plan_fingerprint``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING

from dflash_recipes.executor.training.trackers.protocol import (
    ConfigValue,
    Outcome,
    TrackerContext,
    row_scalars,
    row_step,
)

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

NAME = "tensorboard"
#: The import that must succeed, and what provides it.
LIBRARY = "tensorboard"
PIP_EXTRA = "tensorboard"


def missing_library() -> str | None:
    """Why the tracker cannot start here (None: it can)."""
    from dflash_recipes.executor.training.trackers.registry import library_present

    if library_present(LIBRARY):
        return None
    return "the tensorboard package is not installed"


class TensorBoardLogger:
    """Scalars, a text plan and a text summary in one event directory."""

    name = NAME

    def __init__(self, context: TrackerContext) -> None:
        from torch.utils.tensorboard import SummaryWriter

        context.logging_dir.mkdir(parents=True, exist_ok=True)
        self._writer: SummaryWriter = SummaryWriter(log_dir=str(context.logging_dir), purge_step=1)
        self._config_step = (context.resumed_from or 0) + 1
        for row in context.earlier_rows:
            self.log_row(row)

    @property
    def resume_state(self) -> Mapping[str, str]:
        return {}

    def log_config(self, config: Mapping[str, ConfigValue], tags: Mapping[str, str]) -> None:
        table = "\n".join(f"| {key} | {json.dumps(value)} |" for key, value in config.items())
        self._writer.add_text("plan", f"| key | value |\n|---|---|\n{table}", self._config_step)
        for key, value in tags.items():
            self._writer.add_text(key, value, self._config_step)

    def log_row(self, row: Mapping[str, object]) -> None:
        step = row_step(row)
        if row.get("kind") == "summary":
            text = json.dumps(dict(row), sort_keys=True, indent=1)
            self._writer.add_text("summary", f"```\n{text}\n```", step)
            return
        for key, value in row_scalars(row).items():
            self._writer.add_scalar(key, value, global_step=step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self, outcome: Outcome) -> None:
        self._writer.close()


def open_logger(context: TrackerContext) -> TensorBoardLogger:
    return TensorBoardLogger(context)


__all__ = ["NAME", "TensorBoardLogger", "missing_library", "open_logger"]
