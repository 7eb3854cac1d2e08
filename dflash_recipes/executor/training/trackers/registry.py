"""Which module implements each name of ``training.report_to``, and whether it can start.

Adding a tracker: one module beside these (``NAME``, ``PIP_EXTRA``, ``missing_library()``,
``open_logger(context)``), one line in :data:`TRACKER_MODULES`, and its name in the recipe's
``TrackerName``. The tracker modules import their library only when a logger is opened.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Sequence
from types import ModuleType

from dflash_recipes.errors import TrackerError

#: report_to name -> the module of its logger.
TRACKER_MODULES: dict[str, str] = {
    "tensorboard": "dflash_recipes.executor.training.trackers.tensorboard",
    "mlflow": "dflash_recipes.executor.training.trackers.mlflow",
    "wandb": "dflash_recipes.executor.training.trackers.wandb",
}


def tracker_module(name: str) -> ModuleType:
    """The module implementing tracker `name` (a name the recipe validated)."""
    return importlib.import_module(TRACKER_MODULES[name])


def library_present(name: str) -> bool:
    """Whether top-level package `name` can be imported here (without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # ValueError: a module blocked as sys.modules[name] = None
        return False


def check_tracker_libraries(names: Sequence[str]) -> None:
    """Raise TrackerError naming the pip command for every tracker that cannot start."""
    problems: list[str] = []
    for name in names:
        module = tracker_module(name)
        why: str | None = module.missing_library()
        if why is not None:
            problems.append(
                f"training.report_to names {name}, but {why}: "
                f"pip install 'dflash-recipes[{module.PIP_EXTRA}]'"
            )
    if problems:
        msg = "; ".join(problems) + " (or remove it from training.report_to)"
        raise TrackerError(msg)


__all__ = ["TRACKER_MODULES", "check_tracker_libraries", "library_present", "tracker_module"]
