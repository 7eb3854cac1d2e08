"""Loading a drafter's weights from an export or a training checkpoint directory, exactly.

A Domino/DSpark export written by an earlier dflash-recipes (``shift_label`` false) still loads;
one line says what it was trained for and whether the plan drafts it that way
(:func:`trained_for_note`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from dflash_recipes.checkpoint.hfconfig import read_checkpoint_config
from dflash_recipes.checkpoint.kinds.registry import kind_facts
from dflash_recipes.checkpoint.model_files import WEIGHTS_FILE
from dflash_recipes.checkpoint.weight_index import read_checkpoint_weights
from dflash_recipes.errors import CheckpointError
from dflash_recipes.executor.model.draft import DFlashDraftModel
from dflash_recipes.executor.model.sharded_state import read_sharded_state
from dflash_recipes.executor.model.warmstart import load_exact_weights
from dflash_recipes.files.run_dir import (
    EXPORT_DIR,
    SHARDED_DIR,
    complete_checkpoints,
    is_sharded_checkpoint,
)
from dflash_recipes.plan.draft_spec import ResolvedDraft

logger = logging.getLogger(__name__)


def trained_for_note(checkpoint_dir: Path, spec: ResolvedDraft) -> tuple[str, bool] | None:
    """(one line, whether the plan differs) for a head checkpoint whose config.json says
    ``shift_label`` false or another head alignment than `spec`; None otherwise (plain
    DFlash, no config.json, or the alignment the plan drafts with ModelOpt's labels). The
    rule is the kind's (``KindFacts.trained_for``)."""
    config = read_checkpoint_config(checkpoint_dir)
    nested = config.raw.get("dflash_config") if config.readable else None
    if not isinstance(nested, Mapping):
        return None
    return kind_facts(spec.projector_type).trained_for(str(checkpoint_dir), nested, spec)


def load_drafter_weights(drafter: DFlashDraftModel, checkpoint_dir: Path) -> int:
    """Copy the z-lab weights of ``checkpoint_dir`` into ``drafter`` exactly; the tensor count.

    ``checkpoint_dir`` is an export or a training checkpoint (``model.safetensors`` or shards,
    or a sharded training checkpoint of ``training.fsdp``, read whole here with
    torch.distributed.checkpoint). CheckpointError when the weights are missing, any tensor
    name or shape differs from the drafter's, or a dtype would round (load before casting the
    drafter). A head checkpoint trained for another alignment than the drafter's plan logs
    :func:`trained_for_note`'s line (a warning when they differ, an info for an earlier export
    loaded as it was trained).
    """
    if not checkpoint_dir.is_dir():
        msg = f"checkpoint directory {checkpoint_dir} does not exist"
        raise CheckpointError(msg)
    mismatch = (
        f"{checkpoint_dir} does not hold the drafter the plan describes; evaluate it with "
        "the plan (or recipe) it was trained with"
    )
    if is_sharded_checkpoint(checkpoint_dir):
        weights_read, _ = read_sharded_state(
            checkpoint_dir / SHARDED_DIR, drafter, None, mismatch=mismatch
        )
        drafter.load_state_dict(weights_read, strict=True)
        return len(weights_read)
    if not (checkpoint_dir / WEIGHTS_FILE).is_file():
        candidates = [checkpoint_dir / EXPORT_DIR] if (checkpoint_dir / EXPORT_DIR).is_dir() else []
        candidates += [path for _, path in complete_checkpoints(checkpoint_dir)][-1:]
        if candidates:
            msg = (
                f"{checkpoint_dir} holds no {WEIGHTS_FILE}; it looks like a run's "
                "output_dir: pass " + " or ".join(str(c) for c in candidates)
            )
            raise CheckpointError(msg)
    weights = read_checkpoint_weights(checkpoint_dir)
    note = trained_for_note(checkpoint_dir, drafter.spec)
    if note is not None:
        logger.log(logging.WARNING if note[1] else logging.INFO, "%s", note[0])
    return load_exact_weights(drafter, weights, mismatch=mismatch)
