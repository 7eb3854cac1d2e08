"""What one rank reads of a file tensor: the rows its (possibly sharded) tensor holds.

Shared by the target's sharded load (:mod:`~dflash_recipes.executor.model.meta_load`) and the
drafter's warm start (:func:`~dflash_recipes.executor.model.warmstart.stream_tensors`): a plain
tensor reads the whole file tensor; an FSDP2 DTensor reads, through ``safe_open``'s
``get_slice``, only its rank's rows, so the rest of the file is never read.
"""

from __future__ import annotations

import math

import torch
from safetensors import safe_open

from dflash_recipes.errors import CheckpointError


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


__all__ = ["local_part", "local_rows", "read_local"]
