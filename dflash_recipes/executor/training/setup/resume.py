"""The resume builder: the run lock, which checkpoint to resume, restoring it on every rank.

- :func:`locked_run_directory`: rank 0 holds the directory's exclusive lock
  (:mod:`dflash_recipes.files.locking`) from before the first file is written until after the
  final export, so a second `run` on the same ``output_dir`` fails at once, naming the holder.
- :func:`resume_checkpoint`: the checkpoint the plan resumes from, as rank 0 sees
  ``output_dir`` (:func:`checkpoint_to_resume`), received by every rank; a checkpoint the plan
  does not know about is refused, never overwritten.
- :func:`restore`: rank 0 restores that checkpoint, or else the newest older complete one
  that reads cleanly (:func:`restore_newest_readable`, with a warning saying which and why),
  and every other rank restores the very checkpoint rank 0 read: a stale view of the
  directory on one node cannot start the ranks at different steps. Rows of steps the resumed
  run will redo are removed from ``metrics.jsonl`` (atomically) so that each step appears once.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import attrs
from torch import nn

from dflash_recipes.errors import CheckpointError, PlanError, WarmStartError
from dflash_recipes.executor.coordination import rank0_decides, stop_if_any_rank_failed
from dflash_recipes.executor.dist_env import DistEnv, is_main
from dflash_recipes.executor.training.checkpoints import Stateful, restore_training_checkpoint
from dflash_recipes.files.jsonio import FileReadProblem, JsonProblem, parse_json, read_regular_file
from dflash_recipes.files.locking import LOCK_FILE, hold_directory_lock
from dflash_recipes.files.metrics_rows import drop_metrics_after
from dflash_recipes.files.run_dir import (
    METRICS_FILE,
    TRAINER_STATE,
    checkpoint_step,
    complete_checkpoints,
    latest_complete_checkpoint,
)
from dflash_recipes.plan.run_plan import RunPlan
from dflash_recipes.records import Record

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


@attrs.frozen(repr=False, eq=False, slots=False)
class ResumePoint(Record):
    """Where training starts: the optimiser step and the data position of the next batch."""

    #: Optimiser steps already done (0 for a fresh run).
    step: int
    #: The epoch and the index into its order of the next batch.
    epoch: int
    next_index: int
    #: The checkpoint restored; None for a fresh run.
    checkpoint: Path | None

    @property
    def resumed_from(self) -> int | None:
        """The step of the restored checkpoint; None for a fresh run."""
        return self.step if self.checkpoint is not None else None


FRESH = ResumePoint(step=0, epoch=0, next_index=0, checkpoint=None)


def resume_checkpoint(plan: RunPlan, env: DistEnv) -> Path | None:
    """The checkpoint every rank resumes from (None: a fresh run), decided by rank 0 alone.

    Rank 0 looks at ``output_dir`` (:func:`checkpoint_to_resume`), every other rank receives its
    answer, or its refusal as the same error: one node's stale view of a network filesystem
    cannot make the ranks disagree.
    """
    output_dir = Path(plan.training.output_dir)

    def decide() -> str | None:
        chosen = checkpoint_to_resume(plan, output_dir)
        return None if chosen is None else str(chosen)

    answer = rank0_decides(decide, env)
    return None if answer is None else Path(answer)


def restore(
    chosen: Path | None,
    output_dir: Path,
    module: nn.Module,
    optimizer: Stateful,
    scheduler: Stateful,
    env: DistEnv,
) -> ResumePoint:
    """Restore `chosen` (from :func:`resume_checkpoint`) into every rank; :data:`FRESH` for None.

    Rank 0 restores it, or the newest older complete checkpoint that reads cleanly
    (:func:`restore_newest_readable`); the other ranks wait, then restore the checkpoint rank 0
    read. A rank that cannot read it stops every rank (CheckpointError naming the rank). On
    rank 0 the rows of steps after the checkpoint leave ``metrics.jsonl``: they are redone.
    """
    if chosen is None:
        return FRESH
    point = FRESH

    def read_on_rank0() -> str:
        nonlocal point
        used, state = restore_newest_readable(chosen, output_dir, module, optimizer, scheduler)
        point = _resume_point(used, state)
        return str(used)

    used = Path(rank0_decides(read_on_rank0, env) or chosen)
    problem: CheckpointError | None = None
    if env.rank != 0:
        try:
            point = _resume_point(
                used, restore_training_checkpoint(used, module, optimizer, scheduler)
            )
        except CheckpointError as exc:
            problem = exc
    stop_if_any_rank_failed(
        problem, env, what=f"restore {used}, the checkpoint rank 0 resumes from",
        error=CheckpointError,
    )  # fmt: skip
    if is_main(env):
        logger.info(
            "resumed from %s (step %d); dflash_init_checkpoint is ignored", used, point.step
        )
        # The steps after the checkpoint are redone: their old rows go.
        drop_metrics_after(output_dir / METRICS_FILE, point.step)
    return point


def _resume_point(checkpoint: Path, state: dict[str, object]) -> ResumePoint:
    return ResumePoint(
        step=_int(state, "step"),
        epoch=_int(state, "epoch"),
        next_index=_int(state, "next_index"),
        checkpoint=checkpoint,
    )


def _int(state: dict[str, object], key: str) -> int:
    value = state.get(key)
    if not isinstance(value, int):
        msg = f"trainer_state.json has no integer {key!r}; the checkpoint is from another tool"
        raise CheckpointError(msg)
    return value


__all__ = [
    "FRESH",
    "ResumePoint",
    "checkpoint_to_resume",
    "locked_run_directory",
    "restore",
    "restore_newest_readable",
    "resume_checkpoint",
]
