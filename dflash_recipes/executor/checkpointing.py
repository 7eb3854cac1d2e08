"""Training checkpoints: save and restore draft weights plus the trainer's state, atomically.

Layout and completeness rules are :mod:`dflash_recipes.run_layout`'s. A checkpoint is written
into ``output_dir/.tmp-checkpoint-XXXXXXXX-*``, flushed and renamed to
``checkpoint-XXXXXXXX``, so a crash leaves at most a staging directory that the next save
removes and that no reader looks at. Old checkpoints beyond ``save_total_limit`` are pruned
after the new one is in place.

Restoring never looks at the plan, so it never reads ``dflash_init_checkpoint``: a resume
works after the init directory is gone. Weights are safetensors; the optimizer and scheduler
state is ``torch.save``'d and read back with ``weights_only=True`` (no arbitrary pickle).
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import save_file
from torch import nn

from dflash_recipes.checkpoint import read_checkpoint_weights
from dflash_recipes.errors import CheckpointError
from dflash_recipes.executor.convert import dflash_module
from dflash_recipes.executor.export import publish_directory
from dflash_recipes.executor.warmstart import load_exact_weights
from dflash_recipes.jsonio import read_json_file, shorten
from dflash_recipes.run_layout import (
    CHECKPOINT_FILES,
    CHECKPOINT_PREFIX,
    CHECKPOINT_WEIGHTS,
    OPTIMIZER_STATE,
    TMP_PREFIX,
    TRAINER_STATE,
    checkpoint_dir_name,
    checkpoint_step,
    complete_checkpoints,
    is_complete_checkpoint,
)


class Stateful(Protocol):
    """Anything with ``state_dict`` / ``load_state_dict`` (optimizers, LR schedulers)."""

    def state_dict(self) -> Mapping[str, object]: ...

    def load_state_dict(self, state_dict: dict[str, object], /) -> None: ...


def _remove_staging(output_dir: Path) -> None:
    for child in output_dir.iterdir():
        if child.name.startswith(TMP_PREFIX + CHECKPOINT_PREFIX) and child.is_dir():
            shutil.rmtree(child, ignore_errors=True)


def prune_checkpoints(output_dir: Path, save_total_limit: int, *, keep: Path | None = None) -> None:
    """Delete the oldest complete checkpoints so that at most ``save_total_limit`` remain."""
    found = [path for _, path in complete_checkpoints(output_dir)]
    excess = len(found) - save_total_limit
    for path in found:
        if excess <= 0:
            break
        if keep is not None and path == keep:
            continue
        shutil.rmtree(path)
        excess -= 1


def save_training_checkpoint(
    output_dir: Path,
    step: int,
    module: nn.Module,
    optimizer: Stateful,
    scheduler: Stateful | None,
    trainer_state: Mapping[str, object],
    *,
    save_total_limit: int | None = None,
) -> Path:
    """Write ``checkpoint-XXXXXXXX`` for ``step`` and return its path.

    ``module`` is the converted model or the drafter; its weights are saved in their current
    dtype. ``trainer_state`` must be JSON-serialisable; ``step`` is recorded in it.
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    _remove_staging(output_dir)
    drafter = dflash_module(module)
    state = dict(trainer_state)
    state["step"] = step
    try:
        state_text = json.dumps(state, indent=2, sort_keys=True, allow_nan=False) + "\n"
    except (TypeError, ValueError) as exc:
        msg = f"trainer_state must be JSON-serialisable (no NaN): {exc}"
        raise ValueError(msg) from exc

    final = output_dir / checkpoint_dir_name(step)
    staging = output_dir / f"{TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        tensors = {
            name: t.detach().to("cpu").contiguous() for name, t in drafter.state_dict().items()
        }
        save_file(tensors, str(staging / CHECKPOINT_WEIGHTS), metadata={"format": "pt"})
        del tensors
        (staging / TRAINER_STATE).write_text(state_text, encoding="utf-8")
        torch.save(
            {
                "optimizer": optimizer.state_dict(),
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
    return final


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

    load_exact_weights(
        drafter,
        weights,
        mismatch=(
            f"training checkpoint {path} does not match this drafter (was the recipe's "
            "architecture changed since it was saved?)"
        ),
    )
    if optimizer is not None or scheduler is not None:
        blob = torch.load(path / OPTIMIZER_STATE, map_location="cpu", weights_only=True)
        if not isinstance(blob, dict):
            msg = f"{path / OPTIMIZER_STATE} does not hold optimizer and scheduler state"
            raise CheckpointError(msg)
        if optimizer is not None:
            optimizer.load_state_dict(blob["optimizer"])
        if scheduler is not None:
            if blob.get("scheduler") is None:
                msg = f"{path / OPTIMIZER_STATE} holds no scheduler state"
                raise CheckpointError(msg)
            scheduler.load_state_dict(blob["scheduler"])
    return trainer_state


__all__ = [
    "Stateful",
    "prune_checkpoints",
    "restore_training_checkpoint",
    "save_training_checkpoint",
]
