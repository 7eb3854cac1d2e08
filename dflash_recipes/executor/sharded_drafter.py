"""The drafter sharded over the ranks with FSDP2 (``training.fsdp``), and what reads it whole.

:func:`shard_drafter_fsdp2` applies ``fully_shard`` to each drafter decoder layer and at the
root, the training step module (:class:`~dflash_recipes.executor.training.step.DraftStep`,
whose forward is the only place the root's own parameters, ``fc``, the norms and a kind's
head, are used in training). Each rank then holds ``1 / world_size`` of the drafter's
parameters, of their gradients and of AdamW's moments (built over the sharded parameters).
The mixed precision policy computes in the plan's autocast dtype (bfloat16 or float16 on CUDA
for such a target, :func:`~dflash_recipes.executor.training.setup.precision.autocast_dtype`;
none on the CPU, so a CPU run computes what DDP computes), reduces gradients in float32 and
keeps the master weights in ``training.drafter_master_dtype``. The target's ``embed_tokens`` and
``lm_head``, which the drafter borrows, are not in the drafter's module tree (the step holds
``lm_head`` outside it), so they are never sharded with it; a frozen parameter that is in the
tree is left out of the sharding (``ignored_params``) as the target's sharding does.

A sharded module forwards only on every rank at once (each forward all-gathers). What reads
the drafter outside the training step therefore runs on every rank, in step:

- :func:`whole_drafter`: an unsharded copy of the drafter on every rank (held-out evaluation
  calls the layers' attention directly, outside the forwards FSDP hooks), gathered one tensor
  at a time into a copy built on meta: one whole drafter per rank, in the master dtype.
- :func:`full_state_on_rank0`: the drafter's state dict whole, tensor by tensor, on rank 0's
  CPU; :func:`whole_drafter_on_rank0` makes it an unsharded drafter there (the export).
- :func:`placed_like`: a whole tensor placed as a sharded parameter is (a single-process
  checkpoint loaded into a sharded drafter), this rank's part cut locally, with no collective.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from dflash_recipes.errors import LaunchError
from dflash_recipes.executor.dist_env import DistEnv, joined
from dflash_recipes.executor.model.draft import DFlashDraftModel


def shard_drafter_fsdp2(
    step: nn.Module, layers: nn.ModuleList, env: DistEnv, *, param_dtype: torch.dtype | None
) -> None:
    """Shard `layers` (the drafter's decoder layers) and then `step` (the root) in place.

    `param_dtype`: the dtype the all-gathered parameters compute in (None: the master dtype,
    as stored). Gradients reduce in float32. Call it after the drafter is on `env.device` in
    its master dtype, and build the optimizer over ``step.parameters()`` afterwards: sharding
    replaces every parameter with a DTensor.
    """
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError as exc:
        msg = (
            f"training.fsdp needs FSDP2 (torch.distributed.fsdp.fully_shard, torch >= 2.6); "
            f"torch {torch.__version__} does not provide it: upgrade torch or set "
            "training.fsdp: false"
        )
        raise LaunchError(msg) from exc
    if not joined(env):
        msg = "shard_drafter_fsdp2 needs the process group: call init_distributed(env) first"
        raise LaunchError(msg)
    mesh = init_device_mesh(env.device.type, (env.world_size,))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    frozen = {p for p in step.parameters() if not p.requires_grad}
    for layer in layers:
        fully_shard(
            layer,
            mesh=mesh,
            mp_policy=policy,
            reshard_after_forward=True,
            ignored_params={p for p in layer.parameters() if p in frozen} or None,
        )
    # The root's parameters are gathered for the whole step (its post-forward reshards them).
    fully_shard(step, mesh=mesh, mp_policy=policy, ignored_params=frozen or None)


def fill_from_rank0(
    step: nn.Module, drafter: nn.Module, whole: Mapping[str, Tensor] | None, env: DistEnv
) -> None:
    """Give every rank its part of rank 0's drafter, after :func:`shard_drafter_fsdp2`.

    Rank 0 passes its drafter's whole parameters, taken before sharding (`whole`, by name); the
    other ranks pass None: their drafter was built with its parameters on meta
    (:func:`~dflash_recipes.executor.model.meta_load.parameters_on_meta`), and here `step` is
    allocated on ``env.device`` (its buffers kept as built). Then one broadcast per tensor,
    each rank keeping its part: no rank but rank 0 ever holds the whole drafter, and every
    rank's parts are rank 0's values (its initialisation and warm start)."""
    import torch.distributed as dist

    from dflash_recipes.executor.model.meta_load import to_empty_keeping_buffers
    from dflash_recipes.executor.model.shard_reads import local_part

    if whole is None:
        to_empty_keeping_buffers(step, env.device)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if whole is not None:
                full = whole[name].to(env.device).contiguous()
            else:
                full = torch.empty(param.shape, dtype=param.dtype, device=env.device)
            dist.broadcast(full, src=0)
            part = placed_like(param, full)
            local_part(param).copy_(local_part(part))


def is_sharded(module: nn.Module) -> bool:
    """Whether `module` (or a submodule) is sharded by ``fully_shard``."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return any(isinstance(sub, FSDPModule) for sub in module.modules())


def whole_drafter(drafter: DFlashDraftModel, device: torch.device) -> DFlashDraftModel:
    """An unsharded copy of a sharded `drafter` on `device`, on every rank (every rank must
    call it at the same point: each tensor is all-gathered in turn).

    For code that calls the drafter's submodules outside their forwards (held-out evaluation
    builds each layer's context keys and values with ``self_attn.context_kv``), where FSDP's
    hooks would not gather them. The copy is separate from the sharded drafter, whose FSDP
    state stays as training left it. It is built with its parameters on meta (its buffers
    computed on `device`) and each gathered tensor becomes its parameter as it arrives, in the
    sharded parameters' dtype (the master dtype): one whole drafter per rank while it lives,
    plus one gathered tensor in flight, never a second copy (the resource plan counts it:
    :mod:`~dflash_recipes.plan.resources.rank_memory`).
    """
    from torch.distributed.tensor import DTensor

    from dflash_recipes.executor.model.meta_load import parameters_on_meta

    dtype = next(iter(drafter.parameters())).dtype
    with torch.device(device), parameters_on_meta():
        copy = DFlashDraftModel(drafter.spec)
    copy.to(dtype)  # the buffers, as the drafter's (its parameters are still on meta)
    for name, value in drafter.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value.detach().clone()
        # assign: the gathered tensor becomes the parameter (no copy of it is made)
        found = copy.load_state_dict(
            {name: full.to(device=device, dtype=dtype)}, strict=False, assign=True
        )
        if found.unexpected_keys:
            msg = f"whole_drafter: the copy has no {name!r}"
            raise RuntimeError(msg)
        del full
    left = [name for name, param in copy.named_parameters() if param.is_meta]
    if left:
        msg = f"whole_drafter: the sharded drafter gave no value for {left}"
        raise RuntimeError(msg)
    copy.train(drafter.training)
    return copy


def full_state_on_rank0(module: nn.Module, env: DistEnv) -> dict[str, Tensor]:
    """`module`'s state dict whole on rank 0's CPU, gathered one tensor at a time (every rank
    must call it; the other ranks get an empty dict)."""
    from torch.distributed.tensor import DTensor

    whole: dict[str, Tensor] = {}
    for name, value in module.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if env.rank == 0:
            whole[name] = full.detach().to("cpu")
        del full
    return whole


def placed_like(like: Tensor, full: Tensor) -> Tensor:
    """`full` (a whole tensor) placed as `like` (a DTensor parameter) is: a DTensor whose part
    on this rank is cut from `full` here (no collective); a plain `like`: `full` itself."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(like, DTensor):
        return full
    return distribute_tensor(
        full.to(like.device), like.device_mesh, like.placements, src_data_rank=None
    )


def whole_drafter_on_rank0(drafter: DFlashDraftModel, env: DistEnv) -> DFlashDraftModel | None:
    """An unsharded copy of a sharded `drafter` on rank 0's CPU, for the export (every rank
    must call it; the other ranks get None). Built on the meta device and given the gathered
    tensors, so rank 0 holds one whole copy, never two."""
    whole = full_state_on_rank0(drafter, env)
    if env.rank != 0:
        return None
    with torch.device("meta"):
        copy = DFlashDraftModel(drafter.spec)
    copy.load_state_dict(whole, strict=True, assign=True)
    return copy


def local_tensor(value: Tensor) -> Tensor:
    """The tensor this rank stores for `value` (its shard for a DTensor)."""
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


__all__ = [
    "full_state_on_rank0",
    "is_sharded",
    "local_tensor",
    "placed_like",
    "shard_drafter_fsdp2",
    "whole_drafter",
    "whole_drafter_on_rank0",
]
