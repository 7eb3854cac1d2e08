"""What one rank reads of a file tensor: the rows its (possibly sharded) tensor holds.

Shared by the target's sharded load (:mod:`~dflash_recipes.executor.model.meta_load`) and the
drafter's warm start (:func:`~dflash_recipes.executor.model.warmstart.stream_tensors`): a plain
tensor reads the whole file tensor; an FSDP2 DTensor reads, through ``safe_open``'s
``get_slice``, only its rank's rows, so the rest of the file is never read.

A model tensor is not always one file tensor: the MoE families whose checkpoints store each
expert apart while transformers' modules stack them (``mlp.experts.gate_up_proj`` of Qwen3-MoE,
Mixtral, DeepSeek-V3, Qwen3-Next, GLM-4-MoE) keep, for each expert, one or more file tensors
concatenated on their first dim. :class:`StoredAs` says which; :func:`fill_local` writes a rank's
part of either kind, reading only the experts (dim 0 of the stacked tensor, FSDP2's shard dim)
that rank keeps, one file tensor at a time.
"""

from __future__ import annotations

import math
from pathlib import Path

import attrs
import torch
from safetensors import safe_open

from dflash_recipes.errors import CheckpointError
from dflash_recipes.records import Record


def local_rows(tensor: torch.Tensor) -> tuple[slice, ...] | None:
    """The index into the full tensor of the part `tensor` holds on this rank.

    None for a plain tensor (it holds everything); for a DTensor on a one-dimensional mesh
    sharded on dim ``d`` (FSDP2's ``Shard(0)``), the range of that dim ``torch.chunk`` gives this
    rank (FSDP2's rule: chunks of ``ceil(n / world)``, the last ones shorter or empty).
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(tensor, DTensor):
        return None
    mesh = tensor.device_mesh
    placements = tensor.placements
    if mesh.ndim != 1 or len(placements) != 1:
        msg = f"cannot read a DTensor on a {mesh.ndim}-dimensional mesh slice by slice"
        raise CheckpointError(msg)
    placement = placements[0]
    if isinstance(placement, Replicate):
        return None
    if not isinstance(placement, Shard):
        msg = f"cannot read a DTensor placed as {placement} slice by slice"
        raise CheckpointError(msg)
    dim = placement.dim
    rows = tensor.shape[dim]
    world = mesh.size()
    chunk = math.ceil(rows / world) if rows else 0
    start = min(mesh.get_local_rank() * chunk, rows)
    stop = min(start + chunk, rows)
    return (slice(None),) * dim + (slice(start, stop),)


def read_local(handle: safe_open, stored: str, tensor: torch.Tensor) -> torch.Tensor:
    """The part of the file tensor `stored` that `tensor` holds on this rank (all of it for a
    plain tensor), read from the open `handle` without reading the rest."""
    index = local_rows(tensor)
    if index is None:
        read: torch.Tensor = handle.get_tensor(stored)  # type: ignore[no-untyped-call]
        return read
    part: torch.Tensor = handle.get_slice(stored)[index]  # type: ignore[no-untyped-call]
    return part


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """The storage this rank writes to fill `tensor`: its local shard for a DTensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        local: torch.Tensor = tensor.to_local()  # a view: writing it writes the shard
        return local
    return tensor


@attrs.frozen(repr=False, eq=False, slots=False)
class StoredAs(Record):
    """Where one model tensor's values are in the safetensors files.

    `parts` holds, for each index of the model tensor's dim 0 when `per_expert` (one expert of a
    stacked MoE tensor), the file tensors concatenated on their dim 0 to make it (Qwen's
    ``gate_proj`` and ``up_proj`` make one expert's ``gate_up_proj``); otherwise one tuple with
    the one file tensor that is the whole model tensor (its name may differ: Mixtral's
    ``block_sparse_moe.gate`` is the module ``mlp.gate``). `files` maps each file tensor to the
    file that holds it.
    """

    parts: tuple[tuple[str, ...], ...]
    per_expert: bool
    files: tuple[tuple[str, str], ...]

    @property
    def first_file(self) -> str:
        return self.files[0][1]


def fill_local(directory: Path, stored: StoredAs, tensor: torch.Tensor) -> None:
    """Write into `tensor` (its local shard for a DTensor) its values from the files.

    A plain tensor gets everything; a tensor sharded on dim ``d`` reads only its rows. A stacked
    MoE tensor (``per_expert``) must be sharded on dim 0: its rank reads the file tensors of the
    experts it keeps, each whole (one expert is one shard row), one at a time.
    """
    files = dict(stored.files)
    target = local_part(tensor)
    index = local_rows(tensor)
    with torch.no_grad():
        if not stored.per_expert:
            (name,) = stored.parts[0]
            with safe_open(str(directory / files[name]), framework="pt", device="cpu") as handle:
                part = read_local(handle, name, tensor)
            _check_shape(name, tuple(part.shape), tuple(target.shape))
            target.copy_(part)
            return
        if index is not None and len(index) != 1:
            msg = f"{stored.parts[0][0]}: a stacked expert tensor sharded on a dim other than 0"
            raise CheckpointError(msg)
        experts = range(len(stored.parts))
        if index is not None:
            experts = experts[index[0]]
        _check_shape(stored.parts[0][0], (len(experts),), tuple(target.shape[:1]))
        for row, expert in enumerate(experts):
            offset = 0
            for name in stored.parts[expert]:
                path = directory / files[name]
                # One mapping per file tensor: the touched pages are released before the next.
                with safe_open(str(path), framework="pt", device="cpu") as handle:
                    value: torch.Tensor = handle.get_tensor(name)
                stop = offset + value.shape[0]
                _check_shape(name, tuple(value.shape), tuple(target[row, offset:stop].shape))
                target[row, offset:stop].copy_(value)
                offset = stop
                del value


def _check_shape(name: str, read: tuple[int, ...], wanted: tuple[int, ...]) -> None:
    if read != wanted:
        msg = f"{name}: read {read} for this rank's part of shape {wanted}"
        raise CheckpointError(msg)


__all__ = ["StoredAs", "fill_local", "local_part", "local_rows", "read_local"]
