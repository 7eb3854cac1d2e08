"""Which module implements each name of ``training.report_to``, and whether it can start.

Adding a tracker: one module beside these (``NAME``, ``PIP_EXTRA``, ``missing_library()``,
``open_logger(context)``), one line in :data:`TRACKER_MODULES`, its name in the recipe's
``TrackerName`` and its package in ``TRACKER_LIBRARIES``. The tracker modules import their
library only when a logger is opened.

A tracker whose library is missing is refused before anything trains, twice: ``compile`` looks
for the package without importing it, and :func:`check_tracker_libraries` (``run``, at start)
looks again and, where the trackers run (rank 0), imports it in a fresh interpreter as the
tracker process will: an installed package that fails to import (a broken install, a missing
dependency) is refused too, rather than found out after the whole run.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from collections.abc import Sequence
from types import ModuleType

from dflash_recipes.echo import clip
from dflash_recipes.errors import TrackerError

#: How long importing a tracker's library may take in the probe (seconds; a cold import of
#: mlflow or wandb takes a few).
IMPORT_PROBE_SECONDS = 300.0

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


def import_problem(library: str) -> str | None:
    """Why ``import library`` fails in a fresh interpreter started as the tracker process is
    (this Python, this environment); None when it imports."""
    try:
        done = subprocess.run(
            [sys.executable, "-P", "-c", f"import {library}"],
            capture_output=True,
            text=True,
            errors="replace",
            timeout=IMPORT_PROBE_SECONDS,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"importing {library} did not finish within {IMPORT_PROBE_SECONDS:.0f} s"
    except OSError as exc:
        return f"{sys.executable} could not be started to import {library}: {exc}"
    if done.returncode == 0:
        return None
    lines = done.stderr.strip().splitlines()
    return f"importing {library} fails: {clip(lines[-1] if lines else f'exit {done.returncode}')}"


def _runs_trackers() -> bool:
    """True in the process that runs the trackers (rank 0, or no torchrun)."""
    return os.environ.get("RANK", "0") == "0"


def check_tracker_libraries(names: Sequence[str]) -> None:
    """Raise TrackerError naming the pip command for every tracker that cannot start.

    Every rank looks for each library (cheap, without importing it); rank 0, which runs the
    trackers, also imports it in a fresh interpreter (:func:`import_problem`), so a library
    that is installed but broken stops the run here, before anything trains.
    """
    problems: list[str] = []
    for name in names:
        module = tracker_module(name)
        why: str | None = module.missing_library()
        if why is None and _runs_trackers():
            why = import_problem(module.LIBRARY)
        if why is not None:
            problems.append(
                f"training.report_to names {name}, but {why}: "
                f"pip install 'dflash-recipes[{module.PIP_EXTRA}]'"
            )
    if problems:
        msg = "; ".join(problems) + " (or remove it from training.report_to)"
        raise TrackerError(msg)


__all__ = [
    "IMPORT_PROBE_SECONDS",
    "TRACKER_MODULES",
    "check_tracker_libraries",
    "import_problem",
    "library_present",
    "tracker_module",
]
