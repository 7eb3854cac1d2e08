"""Training checkpoints: save and restore draft weights plus the trainer's state, atomically.

Layout and completeness rules are :mod:`dflash_recipes.files.run_dir`'s. A checkpoint is written
into ``output_dir/.tmp-checkpoint-XXXXXXXX-*``, flushed and renamed to
``checkpoint-XXXXXXXX``, so a crash leaves at most a staging directory that the next save
removes and that no reader looks at. Old checkpoints beyond ``save_total_limit`` are pruned
after the new one is in place, except the newest checkpoint written after a finite step: one
saved while steps were being skipped for a NaN or Inf gradient norm (its trainer state's
``nonfinite_streak`` above 0, :mod:`~dflash_recipes.executor.training.nonfinite`) never pushes
it out, so a run that diverges keeps its last good checkpoint (one more than the limit meanwhile).

Saving fails as one :class:`RunIOError` (full disk, permissions, I/O) that says which step and
where, after removing the staging directory: earlier checkpoints are never touched by a failed
save. Restoring reads every file before it changes the model or the optimizer, and a file that
cannot be read (a truncated ``optimizer.pt``, a corrupt header) is a :class:`CheckpointError`
naming it, so the trainer can fall back to an older checkpoint.

Restoring never looks at the plan, so it never reads ``dflash_init_checkpoint``: a resume
works after the init directory is gone. Weights are safetensors; the optimizer and scheduler
state is ``torch.save``'d and read back with ``weights_only=True`` (no arbitrary pickle).
"""

from __future__ import annotations

import json
import pickle
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import nn

from dflash_recipes.checkpoint.model_files import WEIGHTS_FILE
from dflash_recipes.checkpoint.weight_index import read_checkpoint_weights
from dflash_recipes.errors import CheckpointError, RunIOError
from dflash_recipes.executor.model.convert import dflash_module
from dflash_recipes.executor.model.warmstart import load_exact_weights
from dflash_recipes.files.crashsafe import remove_staging_dirs, staged_directory
from dflash_recipes.files.jsonio import read_json_file, shorten
from dflash_recipes.files.run_dir import (
    CHECKPOINT_FILES,
    CHECKPOINT_PREFIX,
    OPTIMIZER_STATE,
    PLAN_FILE,
    TMP_PREFIX,
    TRAINER_STATE,
    checkpoint_dir_name,
    checkpoint_step,
    complete_checkpoints,
    is_complete_checkpoint,
)

#: The trainer-state key of the skipped (non-finite) steps in a row that end at the saved step.
NONFINITE_STREAK = "nonfinite_streak"


class Stateful(Protocol):
    """Anything with ``state_dict`` / ``load_state_dict`` (optimizers, LR schedulers)."""

    def state_dict(self) -> Mapping[str, object]: ...

    def load_state_dict(self, state_dict: dict[str, object], /) -> None: ...


def prune_checkpoints(output_dir: Path, save_total_limit: int, *, keep: Path | None = None) -> None:
    """Delete the oldest complete checkpoints so that at most ``save_total_limit`` remain,
    never `keep` nor the newest one written after a finite step (module docstring)."""
    found = [path for _, path in complete_checkpoints(output_dir)]
    last_good = next((path for path in reversed(found) if not _after_nonfinite(path)), None)
    excess = len(found) - save_total_limit
    for path in found:
        if excess <= 0:
            break
        if path in (keep, last_good):
            continue
        shutil.rmtree(path)
        excess -= 1


def _after_nonfinite(path: Path) -> bool:
    """Whether the checkpoint was saved after a skipped (non-finite) step; an unreadable
    trainer state counts as a finite one (restoring it says what is wrong)."""
    try:
        state = read_json_file(
            path / TRAINER_STATE,
            what="trainer state",
            fix="delete the checkpoint",
            error=CheckpointError,
            max_bytes=2**20,
        )
    except CheckpointError:
        return False
    streak = state.get(NONFINITE_STREAK, 0) if isinstance(state, dict) else 0
    return isinstance(streak, int) and streak > 0


def save_training_checkpoint(
    output_dir: Path,
    step: int,
    module: nn.Module,
    optimizer: Stateful,
    scheduler: Stateful | None,
    trainer_state: Mapping[str, object],
    *,
    save_total_limit: int | None = None,
    plan_json: str | None = None,
) -> Path:
    """Write ``checkpoint-XXXXXXXX`` for ``step`` and return its path.

    ``module`` is the converted model or the drafter; its weights are saved in their current
    dtype. ``trainer_state`` must be JSON-serialisable; ``step`` is recorded in it.
    ``plan_json``, the plan that trained up to this step, is kept beside it as ``plan.json``
    (a resume with another plan compares the two).
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    remove_staging_dirs(output_dir, TMP_PREFIX + CHECKPOINT_PREFIX)
    drafter = dflash_module(module)
    state = dict(trainer_state)
    state["step"] = step
    try:
        state_text = json.dumps(state, indent=2, sort_keys=True, allow_nan=False) + "\n"
    except (TypeError, ValueError) as exc:
        msg = f"trainer_state must be JSON-serialisable (no NaN): {exc}"
        raise ValueError(msg) from exc

    final = output_dir / checkpoint_dir_name(step)
    try:
        _write_checkpoint(final, drafter, optimizer, scheduler, state_text, plan_json)
    except (OSError, SafetensorError, RuntimeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        msg = (
            f"cannot save the checkpoint of step {step} to {final}: {reason}; no partial "
            f"checkpoint was left and the earlier checkpoints in {output_dir} are intact: "
            "free space or fix the permissions, then rerun to resume from the newest one"
        )
        raise RunIOError(msg) from exc
    if save_total_limit is not None:
        prune_checkpoints(output_dir, save_total_limit, keep=final)
    return final


def _write_checkpoint(
    final: Path,
    drafter: nn.Module,
    optimizer: Stateful,
    scheduler: Stateful | None,
    state_text: str,
    plan_json: str | None = None,
) -> None:
    with staged_directory(final) as staging:
        tensors = {
            name: t.detach().to("cpu").contiguous() for name, t in drafter.state_dict().items()
        }
        save_file(tensors, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
        del tensors
        (staging / TRAINER_STATE).write_text(state_text, encoding="utf-8")
        if plan_json is not None:
            (staging / PLAN_FILE).write_text(plan_json, encoding="utf-8")
        torch.save(
            {
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
            },
            staging / OPTIMIZER_STATE,
        )


def restore_training_checkpoint(
    path: Path,
    module: nn.Module,
    optimizer: Stateful | None = None,
    scheduler: Stateful | None = None,
) -> dict[str, object]:
    """Load a training checkpoint into ``module`` (and the optimizer/scheduler); return the
    trainer state. Raises CheckpointError for an incomplete or mismatched checkpoint."""
    path = Path(path)
    if not is_complete_checkpoint(path):
        missing = [name for name in CHECKPOINT_FILES if not (path / name).is_file()]
        msg = (
            f"{path} is not a complete training checkpoint (missing: {', '.join(missing)}); "
            "it was probably interrupted while saving: delete it to resume from the previous one"
        )
        raise CheckpointError(msg)
    drafter = dflash_module(module)
    weights = read_checkpoint_weights(path)

    trainer_state = read_json_file(
        path / TRAINER_STATE,
        what="trainer state",
        fix="the checkpoint is damaged: delete it to resume from the previous one",
        error=CheckpointError,
        max_bytes=2**20,
    )
    if not isinstance(trainer_state, dict):
        msg = f"{path / TRAINER_STATE} must hold a JSON object"
        raise CheckpointError(msg)
    if trainer_state.get("step") != checkpoint_step(path):
        msg = (
            f"{path / TRAINER_STATE} records step {shorten(trainer_state.get('step'))}, "
            f"the directory name says {checkpoint_step(path)}"
        )
        raise CheckpointError(msg)

    blob: dict[str, object] = {}
    if optimizer is not None or scheduler is not None:
        blob = _read_optimizer_state(path / OPTIMIZER_STATE, scheduler=scheduler is not None)
    load_exact_weights(
        drafter,
        weights,
        mismatch=(
            f"training checkpoint {path} does not match this drafter (was the recipe's "
            "architecture changed since it was saved?)"
        ),
    )
    if blob:
        if optimizer is not None:
            optimizer.load_state_dict(blob["optimizer"])  # type: ignore[arg-type]
        if scheduler is not None:
            scheduler.load_state_dict(blob["scheduler"])  # type: ignore[arg-type]
    return trainer_state


def _read_optimizer_state(path: Path, *, scheduler: bool) -> dict[str, object]:
    """The optimizer and scheduler state of ``optimizer.pt``; CheckpointError if unreadable."""
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        msg = (
            f"{path} holds objects other than tensors and plain containers; it was not "
            "written by dflash-recipe and is refused (loaded with weights_only=True)"
        )
        raise CheckpointError(msg) from exc
    except Exception as exc:  # a corrupt stream fails anywhere in the unpickler (IndexError...)
        first = (str(exc).splitlines() or [""])[0][:160]
        msg = f"{path} is unreadable ({type(exc).__name__}: {first}); it is truncated or corrupt"
        raise CheckpointError(msg) from exc
    if not isinstance(blob, dict) or not isinstance(blob.get("optimizer"), dict):
        msg = f"{path} does not hold optimizer and scheduler state"
        raise CheckpointError(msg)
    if scheduler and not isinstance(blob.get("scheduler"), dict):
        msg = f"{path} holds no scheduler state"
        raise CheckpointError(msg)
    return blob


__all__ = [
    "NONFINITE_STREAK",
    "Stateful",
    "prune_checkpoints",
    "restore_training_checkpoint",
    "save_training_checkpoint",
]
