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
- :func:`plan_change`: resuming with another plan than the checkpoint's (recorded in the
  checkpoint as ``plan.json``, else the run directory's when it is the one that saved it): a
  change the checkpoint cannot honestly continue (the drafter's architecture, taps, mask token,
  the target) is refused, any other is warned about, saying what it does to the run
  (:mod:`dflash_recipes.plan.resume_changes` holds the policy).
- :func:`world_size_change`: the warning for resuming on another number of ranks (what
  changes: the global batch, and without ``training.max_steps`` the total steps and the
  learning-rate schedule).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import attrs
from torch import nn

from dflash_recipes.errors import CheckpointError, PlanError, WarmStartError
from dflash_recipes.executor.coordination import (
    rank0_decides,
    stop_if_any_rank_failed,
    wait_for_rank0,
)
from dflash_recipes.executor.data.train_dataset import batches_per_epoch
from dflash_recipes.executor.dist_env import DistEnv, is_main
from dflash_recipes.executor.training.checkpoints import Stateful, restore_training_checkpoint
from dflash_recipes.executor.training.setup.optimizer import lr_factor, total_optimizer_steps
from dflash_recipes.files.jsonio import FileReadProblem, JsonProblem, parse_json, read_regular_file
from dflash_recipes.files.locking import LOCK_FILE, hold_directory_lock
from dflash_recipes.files.metrics_rows import drop_metrics_after
from dflash_recipes.files.run_dir import (
    METRICS_FILE,
    PLAN_FILE,
    TRAINER_STATE,
    checkpoint_step,
    complete_checkpoints,
    latest_complete_checkpoint,
)
from dflash_recipes.plan.resume_changes import SCHEDULE, PlanChange, grouped, plan_changes
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
        path = latest[1]
    elif not path.is_dir():
        msg = (
            f"the plan resumes from {path}, which no longer exists; recompile the recipe "
            "to resume from what output_dir holds now"
        )
        raise CheckpointError(msg)
    change = plan_change(plan, path, output_dir)  # raises PlanError for a refused change
    if change is not None:
        logger.warning("%s", change)
    return path


def saved_plan(checkpoint: Path, output_dir: Path) -> tuple[RunPlan | None, str]:
    """The plan that saved `checkpoint` and where it was read; (None, why) when unknown.

    The checkpoint's own copy of plan.json first; else the run directory's plan.json when its
    fingerprint is the one the checkpoint records (a checkpoint saved before copies were kept).
    """
    copy = checkpoint / PLAN_FILE
    if copy.is_file():
        plan = _read_plan(copy)
        if plan is not None:
            return plan, str(copy)
        return None, f"{copy} cannot be read as a plan by this version"
    recorded = _saved_by(checkpoint)
    run_dir_plan = _read_plan(output_dir / PLAN_FILE)
    if run_dir_plan is not None and recorded == run_dir_plan.fingerprint:
        return run_dir_plan, str(output_dir / PLAN_FILE)
    return None, (
        f"{checkpoint.name} holds no copy of its plan and {output_dir / PLAN_FILE} is not the "
        "plan that saved it"
    )


def _read_plan(path: Path) -> RunPlan | None:
    try:
        return RunPlan.from_json(read_regular_file(path, max_bytes=16 * 2**20))
    except (FileReadProblem, PlanError):
        return None


def plan_change(plan: RunPlan, checkpoint: Path, output_dir: Path) -> str | None:
    """The warning for resuming `checkpoint` with `plan` when the plan that saved it differs:
    each changed field (``training.max_steps 4 -> 6``) and what the change does to the run.
    None when nothing that reaches training changed.

    A change the checkpoint cannot honestly continue (the drafter's architecture, taps or mask
    token, another target: :data:`~dflash_recipes.plan.resume_changes.RULES`) is a PlanError
    naming each field, with the fix: the checkpoint's values, or a new training.output_dir.
    """
    step = checkpoint_step(checkpoint)
    saved, where = saved_plan(checkpoint, output_dir)
    if saved is None:
        recorded = _saved_by(checkpoint)
        if recorded is None or recorded == plan.fingerprint:
            return None
        return (
            f"warning: resuming {checkpoint} (step {step}), saved by plan {recorded[:16]}, with "
            f"plan {plan.fingerprint[:16]}: {where}, so what changed cannot be said; compare "
            "the recipe with the one that started the run"
        )
    changes = plan_changes(saved, plan)
    refused = tuple(change for change in changes if change.rule.verdict == "refuse")
    if refused:
        msg = (
            f"cannot resume {checkpoint} (step {step}) with this plan: "
            + _by_effect(refused)
            + f"; to resume, give these fields the values of the plan that saved it ({where}); "
            "to train the changed drafter, point training.output_dir at a new directory (a "
            "fresh run)"
        )
        raise PlanError(msg)
    if not changes:
        return None
    line = (
        f"warning: resuming {checkpoint} (step {step}) with a changed plan (the checkpoint's: "
        f"{where}): {_by_effect(changes)}"
    )
    rates = _next_rates(saved, plan, step or 0)
    if rates is not None and any(change.rule.effect == SCHEDULE for change in changes):
        line += f"; the next step's learning rate is {rates[1]:.3g} (it was to be {rates[0]:.3g})"
    return line


def _by_effect(changes: tuple[PlanChange, ...]) -> str:
    return "; ".join(
        ", ".join(change.describe() for change in group) + f" changes {effect}"
        for effect, group in grouped(changes)
    )


def _next_rates(saved: RunPlan, plan: RunPlan, step: int) -> tuple[float, float] | None:
    """The learning rate step `step` was to take under `saved` and takes under `plan`; None
    when a total depends on the data (no training.max_steps)."""
    rates = []
    for training in (saved.training, plan.training):
        if training.max_steps is None:
            return None
        factor = lr_factor(
            step,
            total_steps=training.max_steps,
            warmup_ratio=training.warmup_ratio,
            kind=training.lr_scheduler_type,
        )
        rates.append(training.learning_rate * factor)
    return rates[0], rates[1]


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
    #: How many ranks trained up to the checkpoint (None: fresh, or not recorded).
    saved_world_size: int | None = None

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
    *,
    timeout_s: float | None = None,
) -> ResumePoint:
    """Restore `chosen` (from :func:`resume_checkpoint`) into every rank; :data:`FRESH` for None.

    Rank 0 restores it, or the newest older complete checkpoint that reads cleanly
    (:func:`restore_newest_readable`); the other ranks wait (past `timeout_s`,
    ``training.distributed_timeout_s``, with a message saying so), then restore the checkpoint
    rank 0 read. A rank that cannot read it stops every rank (CheckpointError naming the rank).
    Neither layout needs a collective to read: a sharded checkpoint is read by each rank alone
    (:mod:`~dflash_recipes.executor.model.sharded_state`), into a sharded drafter or
    not, so this order holds for both. On rank 0 the rows of steps after the checkpoint leave
    ``metrics.jsonl``: they are redone.
    """
    if chosen is None:
        return FRESH
    point = FRESH
    read: str | Exception = str(chosen)
    if env.rank == 0:  # alone, before the others read what it read
        try:
            used, state = restore_newest_readable(chosen, output_dir, module, optimizer, scheduler)
            point, read = _resume_point(used, state), str(used)
        except Exception as exc:  # every rank hears of it, below
            read = exc
    wait_for_rank0(env, f"read checkpoint {chosen}", timeout_s=timeout_s)

    def read_on_rank0() -> str:
        if isinstance(read, Exception):
            raise read
        return read

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
    saved = state.get("world_size")
    return ResumePoint(
        step=_int(state, "step"),
        epoch=_int(state, "epoch"),
        next_index=_int(state, "next_index"),
        checkpoint=checkpoint,
        saved_world_size=saved if isinstance(saved, int) and saved >= 1 else None,
    )


def world_size_change(
    plan: RunPlan, start: ResumePoint, *, world_size: int, num_examples: int
) -> str | None:
    """The warning for resuming on another number of ranks than the checkpoint's: what
    changes (the global batch; without training.max_steps the run's total steps and with them
    the learning-rate schedule) and how to keep the old run's. None when nothing changes."""
    saved = start.saved_world_size
    if saved is None or saved == world_size:
        return None
    training = plan.training
    per_rank = training.per_device_train_batch_size * training.gradient_accumulation_steps
    head = (
        f"warning: resuming {start.checkpoint} (step {start.step}, trained on {saved} "
        f"rank(s)) on {world_size} rank(s): each optimiser step now takes "
        f"{per_rank * world_size} sequences instead of {per_rank * saved}"
    )
    if training.max_steps is not None:
        return (
            f"{head}; the run's total stays {training.max_steps} steps (training.max_steps) "
            "and so does the learning-rate schedule, so the remaining steps cover "
            f"{'more' if world_size > saved else 'less'} data than planned"
        )

    def total(ranks: int) -> int:
        per_epoch = batches_per_epoch(
            num_examples, batch_size=training.per_device_train_batch_size, world_size=ranks
        )
        return total_optimizer_steps(plan, per_epoch)

    before, now = total(saved), total(world_size)
    if before == now:
        return f"{head}; the run's total stays {now} steps"

    def rate(steps: int) -> float:
        return training.learning_rate * lr_factor(
            start.step,
            total_steps=steps,
            warmup_ratio=training.warmup_ratio,
            kind=training.lr_scheduler_type,
        )

    return (
        f"{head}; the run's total goes from {before} to {now} optimiser steps "
        f"({training.num_train_epochs} epoch(s)), so the learning-rate schedule is spread over "
        f"{now} steps: the next step's rate is {rate(now):.3g} (it was to be "
        f"{rate(before):.3g}); resume on {saved} rank(s) to keep the old schedule, or set "
        "training.max_steps to fix the total"
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
    "plan_change",
    "restore",
    "restore_newest_readable",
    "resume_checkpoint",
    "saved_plan",
    "world_size_change",
]
