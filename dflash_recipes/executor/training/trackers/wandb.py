"""Weights & Biases through ``wandb``: one W&B run per training run, resumed by its id.

W&B's own variables apply: ``WANDB_PROJECT`` (default ``dflash-recipes``), ``WANDB_ENTITY``,
``WANDB_MODE=offline`` (no server, files only), ``WANDB_DIR`` (default: the run directory).
The run id is kept in trackers.json; a resumed run calls ``wandb.init(id=..., resume="allow")``,
sends the rows metrics.jsonl kept from the step the run continues at (``run.starting_step``:
what the server holds online, 0 offline, where a killed process's buffered rows are lost and
``wandb sync`` drops steps the server already has) and skips live rows of steps it holds. The
plan is the run config (flattened), its fingerprint a tag and the config key
``plan_fingerprint``; the run summary goes into ``run.summary``.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from typing import Any

from dflash_recipes.executor.training.trackers.protocol import (
    ConfigValue,
    Outcome,
    TrackerContext,
    row_scalars,
    row_step,
)
from dflash_recipes.recipe.choices import TRACKER_LIBRARIES

NAME = "wandb"
LIBRARY = TRACKER_LIBRARIES[NAME]
PIP_EXTRA = NAME
DEFAULT_PROJECT = "dflash-recipes"


def missing_library() -> str | None:
    """Why the tracker cannot start here (None: it can)."""
    from dflash_recipes.executor.training.trackers.registry import library_present

    return None if library_present(LIBRARY) else "the wandb package is not installed"


class WandbLogger:
    """History rows by step, config, tags and summary of one W&B run."""

    name = NAME

    def __init__(self, context: TrackerContext) -> None:
        import wandb

        resuming = context.resumed_from is not None and "id" in context.kept
        run_id = context.kept["id"] if resuming else secrets.token_hex(4)  # [a-z0-9], as W&B ids
        directory = os.environ.get("WANDB_DIR") or str(context.run_dir)
        os.makedirs(directory, exist_ok=True)
        self._run: Any = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
            name=context.run_name,
            id=run_id,
            resume="allow",
            dir=directory,
            settings=wandb.Settings(
                console="off", silent=True, disable_git=True, x_disable_stats=True
            ),
        )
        self.run_id: str = run_id
        #: Steps below this one are in the W&B run already (W&B cannot replace history rows).
        self._next = int(self._run.starting_step) if resuming else 0
        for row in context.earlier_rows:
            self.log_row(row)

    @property
    def resume_state(self) -> Mapping[str, str]:
        return {"id": self.run_id}

    def log_config(self, config: Mapping[str, ConfigValue], tags: Mapping[str, str]) -> None:
        self._run.config.update(dict(config), allow_val_change=True)
        self._run.config.update(dict(tags), allow_val_change=True)
        self._run.tags = tuple(sorted({*self._run.tags, *tags.values()}))

    def log_row(self, row: Mapping[str, object]) -> None:
        step = row_step(row)
        if row.get("kind") == "summary":
            plain = {k: v for k, v in row.items() if k != "kind" and _plain(v)}
            self._run.summary.update({f"summary/{k}": v for k, v in plain.items()})
            return
        if step is None or step < self._next:
            return
        self._run.log(row_scalars(row), step=step)

    def flush(self) -> None:
        """Nothing to wait for here: wandb's service holds the rows and writes them."""

    def close(self, outcome: Outcome) -> None:
        self._run.finish(exit_code=1 if outcome == "failed" else 0)


def _plain(value: object) -> bool:
    return value is None or isinstance(value, (str, int, float, bool, list, tuple))


def open_logger(context: TrackerContext) -> WandbLogger:
    return WandbLogger(context)


__all__ = ["NAME", "WandbLogger", "missing_library", "open_logger"]
