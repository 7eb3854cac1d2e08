"""Experiment trackers: metrics.jsonl, TensorBoard, MLflow and W&B behind one protocol.

The trainer knows only :class:`TrackerSet` (rows in, one destination) and the protocol
:class:`MetricLogger` (log the config, log a row, close). One module per tracker
(``jsonl``, ``tensorboard``, ``mlflow``, ``wandb``), registered in
:data:`~dflash_recipes.executor.training.trackers.registry.TRACKER_MODULES`; each imports its
library only when opened, and only on rank 0.
"""

from __future__ import annotations

from dflash_recipes.executor.training.trackers.fanout import (
    TRACKERS_FILE,
    TrackerSet,
    open_trackers,
)
from dflash_recipes.executor.training.trackers.protocol import MetricLogger, Outcome, TrackerContext
from dflash_recipes.executor.training.trackers.registry import (
    TRACKER_MODULES,
    check_tracker_libraries,
)

__all__ = [
    "TRACKERS_FILE",
    "TRACKER_MODULES",
    "MetricLogger",
    "Outcome",
    "TrackerContext",
    "TrackerSet",
    "check_tracker_libraries",
    "open_trackers",
]
