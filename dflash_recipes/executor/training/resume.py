"""What keeps a run directory consistent: the run lock, what to resume, metrics after resume.

- :func:`locked_run_directory`: the trainer's rank 0 holds the directory's exclusive lock
  (:mod:`dflash_recipes.files.locking`) from before the first file is written until after the final
  export, so a second `run` on the same ``output_dir`` fails at once, naming the holder.
- :func:`checkpoint_to_resume`: the checkpoint the plan resumes from; a checkpoint the plan
  does not know about is refused, never overwritten.
- :func:`restore_newest_readable`: a resume tries the chosen checkpoint, then older complete
  ones, newest first, and says in a warning which one it used and why it skipped the others.
- :func:`drop_metrics_after`: rows of steps that a resumed run will redo are removed from
  ``metrics.jsonl`` (atomically) so that each step appears once.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

from dflash_recipes.errors import CheckpointError, PlanError, WarmStartError
from dflash_recipes.executor.training.checkpoints import Stateful, restore_training_checkpoint
from dflash_recipes.files.jsonio import FileReadProblem, JsonProblem, parse_json, read_regular_file
from dflash_recipes.files.locking import LOCK_FILE, hold_directory_lock
from dflash_recipes.files.metrics_rows import drop_metrics_after, last_train_row
from dflash_recipes.files.run_dir import (
    TRAINER_STATE,
    checkpoint_step,
    complete_checkpoints,
    latest_complete_checkpoint,
)

if TYPE_CHECKING:
    from dflash_recipes.executor.training.trainer import TrainSummary
    from dflash_recipes.plan.run_plan import RunPlan

logger = logging.getLogger("dflash_recipes.train")


@contextlib.contextmanager
def locked_run_directory(output_dir: Path, *, main: bool) -> Iterator[None]:
    """Hold `output_dir`'s run lock for the body (only on the main rank; others just run).

    When the directory did not exist and the body fails before writing anything but the lock
    file, the directory is removed again: a refused run leaves nothing behind.
    """
    if not main:
        yield
        return
    created = not output_dir.exists()
    failed = True
    try:
        with hold_directory_lock(output_dir, purpose="run"):
            yield
            failed = False
    finally:
        if created and failed:
            _remove_if_only_lock(output_dir)


def _remove_if_only_lock(directory: Path) -> None:
    try:
        if {child.name for child in directory.iterdir()} == {LOCK_FILE}:
            (directory / LOCK_FILE).unlink()
            directory.rmdir()
    except OSError:
        pass


def restore_newest_readable(
    chosen: Path,
    output_dir: Path,
    module: nn.Module,
    optimizer: Stateful,
    scheduler: Stateful,
) -> tuple[Path, dict[str, object]]:
    """Restore `chosen`, or else the newest older complete checkpoint that reads cleanly.

    Returns the checkpoint used and its trainer state. A checkpoint whose tensors do not match
    the drafter (WarmStartError) is not a corrupt file: it is raised at once. CheckpointError
    naming every unreadable checkpoint when none can be read.
    """
    chosen_step = checkpoint_step(chosen)
    older = [
        path
        for step, path in reversed(complete_checkpoints(output_dir))
        if chosen_step is not None and step < chosen_step and path != chosen
    ]
    problems: list[str] = []
    for path in [chosen, *older]:
        try:
            state = restore_training_checkpoint(path, module, optimizer, scheduler)
        except WarmStartError:
            raise
        except CheckpointError as exc:
            problems.append(f"{path.name}: {exc}")
            logger.warning("warning: checkpoint %s cannot be read: %s", path, exc)
            continue
        if path != chosen:
            logger.warning(
                "warning: resuming from %s, the newest readable checkpoint (skipped: %s)",
                path,
                ", ".join(p.split(":", 1)[0] for p in problems),
            )
        return path, state
    msg = (
        f"no checkpoint in {output_dir} can be read to resume from ("
        + "; ".join(problems)
        + "); delete the unreadable checkpoint directories to start afresh, or restore them"
    )
    raise CheckpointError(msg)


def summary_line(summary: TrainSummary) -> str:
    """The one line `dflash-recipe run` prints at the end: finished, resumed-finished, stopped;
    then which trackers missed rows, if any did."""
    line = _summary_line(summary)
    if summary.tracker_problems:
        line += "; trackers: " + "; ".join(summary.tracker_problems) + " (metrics.jsonl has all)"
    return line


def _summary_line(summary: TrainSummary) -> str:
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


def checkpoint_to_resume(plan: RunPlan, output_dir: Path) -> Path | None:
    """The checkpoint a run of `plan` resumes from (None: a fresh run), as the plan says.

    A checkpoint the plan does not know about is refused (PlanError), never overwritten;
    checkpoints this very plan wrote (a requeued job reusing its plan.json) are continued.
    """
    latest = latest_complete_checkpoint(output_dir)
    resume = plan.resume
    if resume is None:
        if latest is not None and _saved_by(latest[1]) == plan.fingerprint:
            # Checkpoints this very plan wrote (a requeued job reusing its plan.json):
            # continuing them is what the plan asked for, not a new decision.
            logger.info("continuing this plan's own checkpoint %s", latest[1].name)
            return latest[1]
        if latest is not None:
            msg = (
                f"{output_dir} already holds training checkpoint {latest[1].name}, "
                "but this plan was compiled as a fresh run; recompile the recipe "
                "(`dflash-recipe compile` or `dflash-recipe run RECIPE`) so the plan "
                "resumes from it, or choose another training.output_dir"
            )
            raise PlanError(msg)
        return None
    path = Path(resume.checkpoint_dir)
    if latest is not None and latest[0] > resume.step:
        logger.warning(
            "plan resumes from step %d but %s is newer; resuming from the newer one",
            resume.step,
            latest[1].name,
        )
        return latest[1]
    if not path.is_dir():
        msg = (
            f"the plan resumes from {path}, which no longer exists; recompile the recipe "
            "to resume from what output_dir holds now"
        )
        raise CheckpointError(msg)
    return path


def _saved_by(checkpoint: Path) -> str | None:
    """The plan fingerprint a training checkpoint records (None if unreadable)."""
    try:
        state = parse_json(read_regular_file(checkpoint / TRAINER_STATE, max_bytes=2**20))
    except (FileReadProblem, JsonProblem):
        return None
    value = state.get("plan_fingerprint") if isinstance(state, dict) else None
    return value if isinstance(value, str) else None


__all__ = [
    "checkpoint_to_resume",
    "drop_metrics_after",
    "last_train_row",
    "locked_run_directory",
    "restore_newest_readable",
    "summary_line",
]
