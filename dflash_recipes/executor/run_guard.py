"""What keeps a run directory consistent: the run lock, resume fallback, metrics after resume.

- :func:`locked_run_directory`: the trainer's rank 0 holds the directory's exclusive lock
  (:mod:`dflash_recipes.locking`) from before the first file is written until after the final
  export, so a second `run` on the same ``output_dir`` fails at once, naming the holder.
- :func:`restore_newest_readable`: a resume tries the chosen checkpoint, then older complete
  ones, newest first, and says in a warning which one it used and why it skipped the others.
- :func:`drop_metrics_after`: rows of steps that a resumed run will redo are removed from
  ``metrics.jsonl`` (atomically) so that each step appears once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

from dflash_recipes.crashsafe import write_bytes_atomic
from dflash_recipes.errors import CheckpointError, WarmStartError
from dflash_recipes.executor.training_checkpoints import Stateful, restore_training_checkpoint
from dflash_recipes.locking import LOCK_FILE, hold_directory_lock
from dflash_recipes.run_dir import checkpoint_step, complete_checkpoints

if TYPE_CHECKING:
    from dflash_recipes.executor.train import TrainSummary

logger = logging.getLogger("dflash_recipes.train")

#: metrics.jsonl larger than this is not rewritten on resume (rows are then left as they are).
_MAX_METRICS_REWRITE_BYTES = 512 * 2**20


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


def _parse_row(line: bytes) -> dict[str, object] | None:
    try:
        row = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return row if isinstance(row, dict) else None


def _row_step(row: dict[str, object] | None) -> int | None:
    step = row.get("step") if row is not None else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _read_lines(path: Path) -> list[bytes]:
    try:
        if not path.is_file() or path.stat().st_size > _MAX_METRICS_REWRITE_BYTES:
            return []
        return path.read_bytes().splitlines(keepends=True)
    except OSError:
        return []


def drop_metrics_after(path: Path, step: int) -> int:
    """Remove the rows of steps after `step` from a metrics file, atomically; how many.

    A resumed run redoes those steps and logs them again. Lines without a step (summaries,
    lines that do not parse) are kept byte for byte.
    """
    lines = _read_lines(path)
    kept = [line for line in lines if (_row_step(_parse_row(line)) or 0) <= step]
    removed = len(lines) - len(kept)
    if removed:
        write_bytes_atomic(path, b"".join(kept))
    return removed


def last_train_row(path: Path, up_to: int) -> dict[str, object] | None:
    """The last ``kind: train`` row of a metrics file at a step <= `up_to` (None if none)."""
    found: dict[str, object] | None = None
    for line in _read_lines(path):
        row = _parse_row(line)
        step = _row_step(row)
        if row is not None and step is not None and step <= up_to and row.get("kind") == "train":
            found = row
    return found


def summary_line(summary: TrainSummary) -> str:
    """The one line `dflash-recipe run` prints at the end: finished, resumed-finished, stopped."""
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


__all__ = [
    "drop_metrics_after",
    "last_train_row",
    "locked_run_directory",
    "restore_newest_readable",
    "summary_line",
]
