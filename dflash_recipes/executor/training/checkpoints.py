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

A drafter sharded over the ranks (``training.fsdp``) is saved by every rank at once
(:func:`save_sharded_training_checkpoint`): rank 0 makes the staging directory, every rank
writes its part of the weights and AdamW's moments into its ``sharded/`` folder
(:mod:`~dflash_recipes.executor.model.sharded_state`, no gather to rank 0), then rank 0
adds the trainer state, the param groups and the scheduler, renames it into place and prunes,
by the same rules. Either layout restores into either drafter: a sharded checkpoint into one
process (or another number of ranks), a whole one into a sharded drafter (each rank cutting
its part), so a run continues on another world size as if uninterrupted.
"""

from __future__ import annotations

import json
import pickle
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.distributed.checkpoint.api import CheckpointException

from dflash_recipes.checkpoint.model_files import WEIGHTS_FILE
from dflash_recipes.checkpoint.tensor_layout import compare_layout, format_layout_diff
from dflash_recipes.checkpoint.weight_index import read_checkpoint_weights
from dflash_recipes.errors import CheckpointError, RunIOError
from dflash_recipes.executor.coordination import rank0_decides
from dflash_recipes.executor.dist_env import DistEnv
from dflash_recipes.executor.model.convert import dflash_module
from dflash_recipes.executor.model.sharded_state import (
    read_sharded_state,
    write_sharded_state,
)
from dflash_recipes.executor.model.warmstart import check_exact_copy, load_exact_weights
from dflash_recipes.executor.sharded_drafter import is_sharded, local_tensor, placed_like
from dflash_recipes.files.crashsafe import (
    publish_directory,
    remove_staging_dirs,
    staged_directory,
    staging_name,
)
from dflash_recipes.files.jsonio import read_json_file, shorten
from dflash_recipes.files.run_dir import (
    CHECKPOINT_PREFIX,
    OPTIMIZER_STATE,
    PLAN_FILE,
    SHARDED_DIR,
    TMP_PREFIX,
    TRAINER_STATE,
    checkpoint_dir_name,
    checkpoint_step,
    complete_checkpoints,
    is_complete_checkpoint,
    is_sharded_checkpoint,
    missing_checkpoint_files,
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
    state_text = _trainer_state_text(trainer_state, step)
    final = output_dir / checkpoint_dir_name(step)
    try:
        _write_checkpoint(final, drafter, optimizer, scheduler, state_text, plan_json)
    except (OSError, SafetensorError, RuntimeError) as exc:
        raise _save_failed(step, final, exc) from exc
    if save_total_limit is not None:
        prune_checkpoints(output_dir, save_total_limit, keep=final)
    return final


def save_sharded_training_checkpoint(
    output_dir: Path,
    step: int,
    drafter: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Stateful | None,
    trainer_state: Mapping[str, object],
    env: DistEnv,
    *,
    save_total_limit: int | None = None,
    plan_json: str | None = None,
) -> Path:
    """Write the sharded ``checkpoint-XXXXXXXX`` of `step` on every rank; returns its path.

    Every rank must call it at the same point: rank 0 removes old staging directories and makes
    a new one, every rank writes its part of `drafter` and `optimizer` into it (one collective
    DCP save), then rank 0 writes the trainer state, the param groups and the scheduler
    (``optimizer.pt``) and `plan_json`, renames the directory into place and prunes to
    `save_total_limit` (:func:`prune_checkpoints`). A failure anywhere removes the staging
    directory and raises RunIOError on every rank; earlier checkpoints are never touched.
    """
    output_dir = Path(output_dir)
    state_text = _trainer_state_text(trainer_state, step)
    final = output_dir / checkpoint_dir_name(step)

    def stage() -> str:
        output_dir.mkdir(parents=True, exist_ok=True)
        remove_staging_dirs(output_dir, TMP_PREFIX + CHECKPOINT_PREFIX)
        staging = staging_name(final, uuid.uuid4().hex[:8])
        staging.mkdir()
        return str(staging)

    try:
        staging = Path(rank0_decides(stage, env) or "")
    except Exception as exc:
        raise _save_failed(step, final, exc) from exc
    try:
        write_sharded_state(staging / SHARDED_DIR, drafter, optimizer)
    except (Exception, CheckpointException) as exc:  # DCP's, the same on every rank
        if env.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise _save_failed(step, final, exc) from exc
    groups = optimizer.state_dict()["param_groups"]  # the moments are in sharded/

    def publish() -> str:
        try:
            (staging / TRAINER_STATE).write_text(state_text, encoding="utf-8")
            if plan_json is not None:
                (staging / PLAN_FILE).write_text(plan_json, encoding="utf-8")
            torch.save(
                {
                    "optimizer": {"state": {}, "param_groups": groups},
                    "scheduler": scheduler.state_dict() if scheduler is not None else None,
                },
                staging / OPTIMIZER_STATE,
            )
            publish_directory(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        if save_total_limit is not None:
            prune_checkpoints(output_dir, save_total_limit, keep=final)
        return str(final)

    try:
        rank0_decides(publish, env)
    except (OSError, RuntimeError) as exc:
        raise _save_failed(step, final, exc) from exc
    return final


def _trainer_state_text(trainer_state: Mapping[str, object], step: int) -> str:
    state = dict(trainer_state)
    state["step"] = step
    try:
        return json.dumps(state, indent=2, sort_keys=True, allow_nan=False) + "\n"
    except (TypeError, ValueError) as exc:
        msg = f"trainer_state must be JSON-serialisable (no NaN): {exc}"
        raise ValueError(msg) from exc


def _save_failed(step: int, final: Path, exc: BaseException) -> RunIOError:
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    msg = (
        f"cannot save the checkpoint of step {step} to {final}: {reason}; no partial "
        f"checkpoint was left and the earlier checkpoints in {final.parent} are intact: "
        "free space or fix the permissions, then rerun to resume from the newest one"
    )
    return RunIOError(msg)


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
        missing = missing_checkpoint_files(path)
        msg = (
            f"{path} is not a complete training checkpoint (missing: {', '.join(missing)}); "
            "it was probably interrupted while saving: delete it to resume from the previous one"
        )
        raise CheckpointError(msg)
    drafter = dflash_module(module)
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
    mismatch = (
        f"training checkpoint {path} does not match this drafter (was the recipe's "
        "architecture changed since it was saved?)"
    )
    optimizer_state = blob.get("optimizer")
    assert optimizer_state is None or isinstance(optimizer_state, dict)
    if is_sharded_checkpoint(path):
        # Every tensor read before anything changes; the moments come from sharded/.
        adamw = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
        weights, moments = read_sharded_state(path / SHARDED_DIR, drafter, adamw, mismatch=mismatch)
        _copy_weights(drafter, weights)
        if optimizer_state is not None:
            optimizer_state = {**optimizer_state, "state": moments}
    elif is_sharded(drafter):
        _copy_weights(drafter, _read_whole_weights(path, drafter, mismatch=mismatch))
        if optimizer_state is not None and isinstance(optimizer, torch.optim.Optimizer):
            optimizer_state = _placed_optimizer_state(optimizer_state, optimizer)
    else:
        load_exact_weights(drafter, read_checkpoint_weights(path), mismatch=mismatch)
    if optimizer is not None and optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    if scheduler is not None and blob:
        scheduler.load_state_dict(blob["scheduler"])  # type: ignore[arg-type]
    return trainer_state


def _read_whole_weights(path: Path, drafter: nn.Module, *, mismatch: str) -> dict[str, Tensor]:
    """A whole checkpoint's weights (one model.safetensors), checked against `drafter`'s names,
    shapes and dtypes; for a sharded drafter (each rank reads them whole, then keeps its part)."""
    read_checkpoint_weights(path)  # the header's checks, with their messages
    try:
        weights = load_file(str(path / WEIGHTS_FILE), device="cpu")
    except (OSError, SafetensorError) as exc:
        msg = f"{path / WEIGHTS_FILE} is unreadable ({exc}); it is truncated or corrupt"
        raise CheckpointError(msg) from exc
    own = drafter.state_dict(keep_vars=True)
    shapes = {name: tuple(t.shape) for name, t in weights.items()}
    diff = compare_layout({name: tuple(t.shape) for name, t in own.items()}, shapes)
    if not diff.is_empty:
        raise CheckpointError(f"{mismatch}:\n" + format_layout_diff(diff))
    for name, tensor in weights.items():
        check_exact_copy(name, tensor.dtype, own[name].dtype, error=CheckpointError)
    return {name: placed_like(own[name], tensor) for name, tensor in weights.items()}


def _copy_weights(drafter: nn.Module, weights: Mapping[str, Tensor]) -> None:
    """Copy `weights` (placed as the drafter's tensors are) into the drafter, part by part."""
    own = drafter.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, value in weights.items():
            local_tensor(own[name]).copy_(local_tensor(value))


def _placed_optimizer_state(
    state: dict[str, object], optimizer: torch.optim.Optimizer
) -> dict[str, object]:
    """A whole checkpoint's AdamW state with each moment placed as its (sharded) parameter."""
    params = [param for group in optimizer.param_groups for param in group["params"]]
    saved = state.get("state")
    assert isinstance(saved, dict)
    placed: dict[int, dict[str, object]] = {}
    for index, values in saved.items():
        param = params[index]
        placed[index] = {
            key: placed_like(param, value)
            if isinstance(value, Tensor) and value.shape == param.shape
            else value
            for key, value in values.items()
        }
    return {**state, "state": placed}


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
    "save_sharded_training_checkpoint",
    "save_training_checkpoint",
]
