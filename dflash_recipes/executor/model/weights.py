"""Loading a drafter's weights from an export or a training checkpoint directory, exactly."""

from __future__ import annotations

from pathlib import Path

from dflash_recipes.checkpoint.model_files import WEIGHTS_FILE
from dflash_recipes.checkpoint.weight_index import read_checkpoint_weights
from dflash_recipes.errors import CheckpointError
from dflash_recipes.executor.model.draft import DFlashDraftModel
from dflash_recipes.executor.model.warmstart import load_exact_weights
from dflash_recipes.files.run_dir import EXPORT_DIR, complete_checkpoints


def load_drafter_weights(drafter: DFlashDraftModel, checkpoint_dir: Path) -> int:
    """Copy the z-lab weights of ``checkpoint_dir`` into ``drafter`` exactly; the tensor count.

    ``checkpoint_dir`` is an export or a training checkpoint (``model.safetensors`` or shards).
    CheckpointError when the weights are missing, any tensor name or shape differs from the
    drafter's, or a dtype would round (load before casting the drafter).
    """
    if not checkpoint_dir.is_dir():
        msg = f"checkpoint directory {checkpoint_dir} does not exist"
        raise CheckpointError(msg)
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
    return load_exact_weights(
        drafter,
        weights,
        mismatch=(
            f"{checkpoint_dir} does not hold the drafter the plan describes; evaluate it with "
            "the plan (or recipe) it was trained with"
        ),
    )
