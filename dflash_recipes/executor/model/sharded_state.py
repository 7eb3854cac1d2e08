"""The tensors of a sharded training checkpoint, with torch.distributed.checkpoint (DCP).

A drafter sharded with FSDP2 (``training.fsdp`` on several ranks) is saved without gathering
it: :func:`write_sharded_state` is one collective DCP save into the checkpoint's ``sharded/``
folder (:data:`~dflash_recipes.files.run_dir.SHARDED_DIR`), in which each rank writes its part
of the weights and of AdamW's moments, and rank 0 writes ``.metadata`` last, once every part is
written. The directory around it (the trainer state, the param groups and the scheduler, the
staging and the rename into place) is :mod:`~dflash_recipes.executor.training.checkpoints`'s.

:func:`read_sharded_state` reads one back on each rank alone (``no_dist``: no collective, so
rank 0 can read first and fall back to an older checkpoint while the others wait, as for a
whole checkpoint): into a drafter sharded over any number of ranks, or into an unsharded one (a
resume on one rank), DCP reading from every rank's file what the tensors placed here need.
Everything is read into fresh buffers before the drafter changes.

Nothing is unpickled freely: DCP's ``.metadata`` is a pickle, read here by an unpickler that
finds only DCP's own metadata classes, torch's dtypes and sizes and paths
(:class:`_MetadataUnpickler`); the parts' tensors are read by DCP with ``weights_only=True``.

The keys: ``model/<z-lab name>`` for the weights, ``optim/<z-lab name>/<AdamW state key>`` for
the moments and the step counter.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save

from dflash_recipes.checkpoint.tensor_layout import compare_layout, format_layout_diff
from dflash_recipes.errors import CheckpointError
from dflash_recipes.executor.model.warmstart import check_exact_copy

MODEL_KEY = "model/"
OPTIM_KEY = "optim/"


def sharded_state(drafter: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Tensor]:
    """What a sharded checkpoint holds: the drafter's state dict and AdamW's tensors, by name
    (DTensors when sharded: each rank contributes its part)."""
    names = {id(param): name for name, param in drafter.named_parameters()}
    state = {MODEL_KEY + name: value for name, value in drafter.state_dict().items()}
    for param in _optimizer_params(optimizer):
        for key, value in optimizer.state.get(param, {}).items():
            if isinstance(value, Tensor):
                state[f"{OPTIM_KEY}{names[id(param)]}/{key}"] = value
    return state


def write_sharded_state(
    directory: Path, drafter: nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """Every rank writes its part of the drafter and AdamW's tensors into `directory` (one
    collective: every rank must call it; rank 0 writes ``.metadata`` when all parts are)."""
    writer = FileSystemWriter(directory, single_file_per_rank=True, sync_files=True)
    save(sharded_state(drafter, optimizer), storage_writer=writer)


def read_sharded_state(
    directory: Path, drafter: nn.Module, optimizer: torch.optim.Optimizer | None, *, mismatch: str
) -> tuple[dict[str, Tensor], dict[int, dict[str, Tensor]]]:
    """The drafter's weights (by name) and AdamW's state (by parameter index, as
    ``optimizer.state_dict()`` numbers them) read from `directory`, placed as this rank's
    parameters are (sharded or not), in new buffers; nothing is changed yet.

    CheckpointError for unreadable files, or (with `mismatch`) for tensors that are not this
    drafter's: other names or shapes, or a dtype the copy would round.
    """
    reader = _CheckedReader(directory)
    try:
        stored = reader.read_metadata().state_dict_metadata
    except Exception as exc:  # a missing or corrupt .metadata fails anywhere in the unpickler
        msg = f"{directory} is unreadable ({type(exc).__name__}: {_first_line(exc)})"
        raise CheckpointError(msg) from exc
    shapes: dict[str, TensorStorageMetadata] = {
        key: meta for key, meta in stored.items() if isinstance(meta, TensorStorageMetadata)
    }
    own = drafter.state_dict(keep_vars=True)
    saved = {
        key.removeprefix(MODEL_KEY): tuple(meta.size)
        for key, meta in shapes.items()
        if key.startswith(MODEL_KEY)
    }
    diff = compare_layout({name: tuple(t.shape) for name, t in own.items()}, saved)
    if not diff.is_empty:
        raise CheckpointError(f"{mismatch}:\n" + format_layout_diff(diff))
    buffers: dict[str, Tensor] = {}
    for name, value in own.items():
        meta = shapes[MODEL_KEY + name]
        check_exact_copy(name, meta.properties.dtype, value.dtype, error=CheckpointError)
        buffers[MODEL_KEY + name] = torch.zeros_like(value.detach())
    moments: dict[int, dict[str, Tensor]] = {}
    if optimizer is not None:
        names = {id(param): name for name, param in drafter.named_parameters()}
        for index, param in enumerate(_optimizer_params(optimizer)):
            prefix = f"{OPTIM_KEY}{names[id(param)]}/"
            state: dict[str, Tensor] = {}
            for key, meta in shapes.items():
                if not key.startswith(prefix):
                    continue
                size, dtype = tuple(meta.size), meta.properties.dtype
                if size == tuple(param.shape):  # a moment: placed as its parameter is
                    buffer = torch.zeros_like(param.detach(), dtype=dtype)
                else:  # the step counter: whole on every rank
                    buffer = torch.zeros(size, dtype=dtype)
                buffers[key] = state[key.removeprefix(prefix)] = buffer
            if state:
                moments[index] = state
    try:
        load(buffers, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as exc:  # a truncated or missing part
        msg = (
            f"{directory} cannot be read ({type(exc).__name__}: {_first_line(exc)}); it is "
            "truncated or corrupt"
        )
        raise CheckpointError(msg) from exc
    weights = {
        key.removeprefix(MODEL_KEY): value
        for key, value in buffers.items()
        if key.startswith(MODEL_KEY)
    }
    return weights, moments


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` and nothing else: a global outside DCP's metadata classes,
    torch's dtypes, ``torch.Size``, the tensor layout and paths is refused."""

    _ALLOWED = frozenset(
        {
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
            ("torch", "Size"),
            ("torch.serialization", "_get_layout"),
            ("pathlib", "PosixPath"),
            ("pathlib", "PurePosixPath"),
            ("collections", "OrderedDict"),
        }
    )

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            (module, name) in self._ALLOWED
            or module == "torch.distributed.checkpoint.metadata"
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        )
        if not allowed:
            msg = f"{module}.{name} is not part of a checkpoint's metadata: refused"
            raise pickle.UnpicklingError(msg)
        return super().find_class(module, name)


class _CheckedReader(FileSystemReader):
    """DCP's file reader whose ``.metadata`` goes through :class:`_MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with Path(self.path, ".metadata").open("rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
        if not isinstance(metadata, Metadata):
            msg = f"{self.path}/.metadata holds a {type(metadata).__name__}, not DCP metadata"
            raise pickle.UnpicklingError(msg)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The optimizer's parameters in the order its state dict numbers them."""
    return [param for group in optimizer.param_groups for param in group["params"]]


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [""])[0][:200]


__all__ = [
    "MODEL_KEY",
    "OPTIM_KEY",
    "read_sharded_state",
    "sharded_state",
    "write_sharded_state",
]
