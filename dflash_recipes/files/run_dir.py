"""Where a run keeps its files inside `training.output_dir` (pure pathlib, no torch).

Both the compiler (to detect a resume) and the executor (to write checkpoints) use these
names, so there is one definition of what a *complete* training checkpoint is.

```
output_dir/
  checkpoint-00000100/        complete training checkpoints (renamed into place when whole)
    model.safetensors         draft weights, z-lab keys
    trainer_state.json        step, data position, RNG seeds, plan fingerprint
    optimizer.pt              optimizer + scheduler state (torch.save, loaded weights_only)
  checkpoint-00000200/        a sharded one (training.fsdp on several ranks): no model.safetensors
    sharded/                  torch.distributed.checkpoint: each rank's part of the weights and
                              AdamW's moments (.metadata written last, when every part is)
    trainer_state.json        as above
    optimizer.pt              the param groups and the scheduler (the moments are in sharded/)
  .tmp-checkpoint-*/          being written; never read, removed on the next save
  metrics.jsonl               one JSON object per logging step
  plan.json                   the plan the run used
  .dflash-lock                the run lock (dflash_recipes.files.locking), held while a run writes
  export/                     the final drafter in the z-lab layout (+ .dflash-export.json)
```
"""

from __future__ import annotations

import re
from pathlib import Path

from dflash_recipes.checkpoint.model_files import WEIGHTS_FILE

CHECKPOINT_PREFIX = "checkpoint-"
TMP_PREFIX = ".tmp-"
TRAINER_STATE = "trainer_state.json"
OPTIMIZER_STATE = "optimizer.pt"
CHECKPOINT_FILES: tuple[str, ...] = (WEIGHTS_FILE, TRAINER_STATE, OPTIMIZER_STATE)
#: The folder of a sharded checkpoint's torch.distributed.checkpoint files.
SHARDED_DIR = "sharded"
#: The file torch.distributed.checkpoint writes last, once every rank's part is written.
SHARDED_METADATA = f"{SHARDED_DIR}/.metadata"
SHARDED_CHECKPOINT_FILES: tuple[str, ...] = (SHARDED_METADATA, TRAINER_STATE, OPTIMIZER_STATE)
METRICS_FILE = "metrics.jsonl"
PLAN_FILE = "plan.json"
EXPORT_DIR = "export"
#: The tokenized-data cache inside the output directory when data.cache_dir is not set.
DATA_CACHE_DIR = "data_cache"

_CHECKPOINT_RE = r"^checkpoint-(\d{1,12})$"


def checkpoint_dir_name(step: int) -> str:
    """`checkpoint-00000100` for step 100 (zero padded so names sort by step)."""
    return f"{CHECKPOINT_PREFIX}{step:08d}"


def checkpoint_step(path: Path) -> int | None:
    """The step encoded in a checkpoint directory name, or None for other names."""
    match = re.match(_CHECKPOINT_RE, path.name)
    return int(match.group(1)) if match else None


def is_complete_checkpoint(path: Path) -> bool:
    """A checkpoint directory with every file the trainer needs to resume, whole or sharded."""
    if checkpoint_step(path) is None or not path.is_dir():
        return False
    return any(
        all((path / name).is_file() for name in files)
        for files in (CHECKPOINT_FILES, SHARDED_CHECKPOINT_FILES)
    )


def is_sharded_checkpoint(path: Path) -> bool:
    """A checkpoint whose weights are sharded (torch.distributed.checkpoint), not one
    model.safetensors."""
    return (path / SHARDED_METADATA).is_file() and not (path / WEIGHTS_FILE).is_file()


def missing_checkpoint_files(path: Path) -> list[str]:
    """The files an incomplete checkpoint lacks (of the sharded layout when it has begun one)."""
    files = SHARDED_CHECKPOINT_FILES if (path / SHARDED_DIR).is_dir() else CHECKPOINT_FILES
    return [name for name in files if not (path / name).is_file()]


def complete_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in `output_dir`, oldest first. Missing directory: empty list."""
    if not output_dir.is_dir():
        return []
    found: list[tuple[int, Path]] = []
    for child in output_dir.iterdir():
        step = checkpoint_step(child)
        if step is not None and is_complete_checkpoint(child):
            found.append((step, child))
    found.sort()
    return found


def latest_complete_checkpoint(output_dir: Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint, or None."""
    found = complete_checkpoints(output_dir)
    return found[-1] if found else None


__all__ = [
    "CHECKPOINT_FILES",
    "CHECKPOINT_PREFIX",
    "DATA_CACHE_DIR",
    "EXPORT_DIR",
    "METRICS_FILE",
    "OPTIMIZER_STATE",
    "PLAN_FILE",
    "SHARDED_CHECKPOINT_FILES",
    "SHARDED_DIR",
    "SHARDED_METADATA",
    "TMP_PREFIX",
    "TRAINER_STATE",
    "checkpoint_dir_name",
    "checkpoint_step",
    "complete_checkpoints",
    "is_complete_checkpoint",
    "is_sharded_checkpoint",
    "latest_complete_checkpoint",
    "missing_checkpoint_files",
]
