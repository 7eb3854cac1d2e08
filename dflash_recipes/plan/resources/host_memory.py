"""Host memory of one process while it loads: the target as read and the drafter as built.

Not a device figure: ``compile`` states it beside the table (``host memory per process while
loading``). Without ``training.fsdp`` (or on one rank) every process reads the whole target; with
it on several ranks the target is built on meta and read shard by shard
(:mod:`~dflash_recipes.executor.model.meta_load`): what stays whole on every rank (embeddings,
final norm, ``lm_head``) plus one decoder tensor's rows in flight at most, so a node needs about
one copy of the target in total. The drafter is built whole on the host in the master dtype
before it moves to the device; under ``training.fsdp`` on several ranks only rank 0 builds it
whole, and the other ranks build it on meta and receive their part once it is sharded
(:func:`~dflash_recipes.executor.sharded_drafter.fill_from_rank0`): the per-process figure is
rank 0's, and a node holds one whole drafter, not one per rank.
"""

from __future__ import annotations

import math

import attrs

from dflash_recipes.plan.resources.target_dims import TargetDims, is_decoder_layer_tensor
from dflash_recipes.records import Record


@attrs.frozen(repr=False, eq=False, slots=False)
class HostMemory(Record):
    """Bytes one process holds in host memory while it loads, at most (not the device's)."""

    #: The target as read into the host: all of it, or with a sharded load the tensors kept
    #: whole on every rank plus one decoder tensor's rows.
    target: int
    #: The drafter, built whole on the host in the master dtype before it moves (on rank 0
    #: only when it is sharded).
    drafter: int
    #: The target is read shard by shard (``training.fsdp`` on several ranks, decoder loaded).
    sharded_load: bool
    #: What each other rank holds of a sharded drafter (its part); None: every rank builds it
    #: whole.
    drafter_other_ranks: int | None = None

    @property
    def total(self) -> int:
        """Both together."""
        return self.target + self.drafter


#: A plan that says nothing of loading (the default of a resource plan made by hand).
NOTHING_LOADED = HostMemory(target=0, drafter=0, sharded_load=False)


def host_memory(
    target: TargetDims,
    pd: int,
    drafter_bytes: int,
    *,
    decoder_loaded: bool,
    fsdp: bool,
    world_size: int = 1,
) -> HostMemory:
    """What one process holds in host memory while it loads the target (`target`'s tensors in
    `pd` bytes each) and the drafter (`drafter_bytes`, built whole): the target whole, or under
    a sharded load (`fsdp` with the decoder loaded) what stays whole plus one decoder tensor's
    rows; without the decoder only what stays whole. A sharded drafter (`fsdp` over
    `world_size` ranks) is whole on rank 0 only, each other rank holding its part."""
    whole = 0
    layer_tensors = []
    for name, shape in target.shapes.items():
        if is_decoder_layer_tensor(name):
            layer_tensors.append(math.prod(shape))
        else:
            whole += math.prod(shape)
    sharded_load = fsdp and decoder_loaded
    if not decoder_loaded:
        read = whole
    elif sharded_load:
        read = whole + max(layer_tensors, default=0)  # one tensor's rows in flight, at most
    else:
        read = whole + sum(layer_tensors)
    others = -(-drafter_bytes // world_size) if fsdp and world_size > 1 else None
    return HostMemory(
        target=read * pd,
        drafter=drafter_bytes,
        sharded_load=sharded_load,
        drafter_other_ranks=others,
    )


__all__ = ["NOTHING_LOADED", "HostMemory", "host_memory"]
