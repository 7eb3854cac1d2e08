"""How the target and a replicated drafter are spread over the ranks: DDP and FSDP2.

:func:`wrap_ddp` averages the drafter's gradients over the ranks (each rank trains on its share
of the global batch; ``training.fsdp: false``); :func:`shard_target_fsdp2` (``training.fsdp``)
shards the frozen target's decoder layers when the target does not fit on one device beside the
drafter. Both return the module unchanged for a single process. Under ``training.fsdp`` the
drafter is sharded too, instead of DDP: :mod:`dflash_recipes.executor.sharded_drafter`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from transformers import PreTrainedModel

from dflash_recipes.errors import LaunchError
from dflash_recipes.executor.dist_env import DistEnv, joined
from dflash_recipes.executor.model.target_states import decoder_stack

_M = TypeVar("_M", bound=nn.Module)


def wrap_ddp(module: nn.Module, env: DistEnv, *, find_unused_parameters: bool = False) -> nn.Module:
    """Wrap the trainable drafter in DDP (returned unchanged for a single process).

    The module must already be on `env.device`. Gradients of trainable parameters are averaged
    over ranks, so each rank takes an equal share of the global batch. Parameters with
    `requires_grad=False` (the target's embeddings and lm_head that the drafter borrows) are
    neither broadcast at construction nor reduced: every rank loads them from the same files.
    Set `find_unused_parameters` only when some trainable parameter gets no gradient in a step
    (it costs a graph traversal per step). Keep a reference to the unwrapped module for
    saving; wrap accumulation micro-steps in `model.no_sync()`.
    """
    if not env.is_distributed:
        return module
    frozen = [name for name, p in module.named_parameters() if not p.requires_grad]
    if frozen:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(  # type: ignore[no-untyped-call]
            module, frozen
        )
    device_ids = [env.local_rank] if env.device.type == "cuda" else None
    return DistributedDataParallel(
        module, device_ids=device_ids, find_unused_parameters=find_unused_parameters
    )


def shard_target_fsdp2(model: _M, env: DistEnv) -> _M:
    """Shard the frozen target's decoder layers over all ranks with FSDP2 (`training.fsdp`).

    Returns the same module, sharded in place (unchanged for a single process). Load the target
    on CPU and call this before moving it: each decoder layer goes to `env.device` already
    sharded, so no GPU ever holds the whole target; the other parameters and buffers are moved
    to `env.device` here.

    Limitations:

    - Only the decoder layers (the ``layers`` of the decoder stack the taps are read from,
      :func:`~dflash_recipes.executor.model.target_states.decoder_stack`) are sharded.
      Embeddings, the final norm and `lm_head` stay whole on every rank, because the drafter
      calls `embed_tokens` and `lm_head` outside the target's forward, where FSDP-sharded
      weights are not gathered.
    - Inference only: run the target under `torch.no_grad()`; it is never trained or saved
      through FSDP state dicts.
    - Every target forward all-gathers each layer's weights (communication per step); use it
      only when the target does not fit on one device next to the drafter.
    - A target loaded whole (a plain load) is held whole by each process until it is sharded;
      ``build_models`` builds it on meta and reads each rank's rows after this call instead
      (:mod:`~dflash_recipes.executor.model.meta_load`).
    - One flat mesh over all ranks (no hybrid sharding); needs torch >= 2.6.
    """
    if not env.is_distributed:
        return model
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor
    except ImportError as exc:
        msg = (
            f"training.fsdp needs FSDP2 (torch.distributed.fsdp.fully_shard, torch >= 2.6); "
            f"torch {torch.__version__} does not provide it: upgrade torch or set "
            f"training.fsdp: false"
        )
        raise LaunchError(msg) from exc
    if not joined(env):
        msg = "shard_target_fsdp2 needs the process group: call init_distributed(env) first"
        raise LaunchError(msg)
    # The decoder stack the taps are read from (a converted target's drafter is not part of it).
    parent = decoder_stack(model)
    layers = parent.layers
    assert isinstance(layers, nn.ModuleList)
    restore_recording = _keep_output_recording(model)
    mesh = init_device_mesh(env.device.type, (env.world_size,))
    for layer in layers:
        # reshard_after_forward=True explicitly: FSDP2 would otherwise keep the root's
        # gathered weights after forward, which for a frozen target is the whole point lost.
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    layer_params = {id(p) for p in layers.parameters()}
    kept_whole = {p for p in parent.parameters() if id(p) not in layer_params}
    fully_shard(parent, mesh=mesh, reshard_after_forward=True, ignored_params=kept_whole)
    restore_recording()
    # FSDP moves what it shards; everything left whole (ignored params, modules outside the
    # parent such as lm_head) is moved here.
    for sub in model.modules():
        for param in sub.parameters(recurse=False):
            # a meta parameter (a drafter built on meta) is allocated when it is sharded
            if not isinstance(param, DTensor) and not param.is_meta and param.device != env.device:
                param.data = param.data.to(env.device)
        for name, buf in sub.named_buffers(recurse=False):
            if buf.device != env.device:
                setattr(sub, name, buf.to(env.device))
    return model


def _keep_output_recording(model: nn.Module) -> Callable[[], None]:
    """Keep transformers' hidden-state recording working across ``fully_shard``.

    transformers >= 5 records ``output_hidden_states`` through hooks chosen by a registry keyed
    on the model's class name; ``fully_shard`` swaps each sharded module's class
    (``Qwen3Model`` -> ``FSDPQwen3Model``), after which the lookup finds nothing and
    ``hidden_states`` is None. Returns the function that registers the new class names.
    """
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:  # transformers < 5 returns hidden states without this registry
        return lambda: None
    # typed as the newest release's registry class; 5.17's is a plain dict (checked below)
    registry: Any = _CAN_RECORD_REGISTRY

    def key(module: nn.Module) -> object:
        # transformers 5.17's registry is a plain dict keyed by str(class); later releases use a
        # dict subclass that takes the module (and keys by its class itself)
        return str(type(module)) if type(registry) is dict else module

    modules = [m for m in model.modules() if isinstance(m, PreTrainedModel)]
    saved = [(m, registry.get(key(m))) for m in modules]

    def restore() -> None:
        for module, records in saved:
            if records and not registry.get(key(module)):
                registry[key(module)] = records

    return restore


__all__ = ["shard_target_fsdp2", "wrap_ddp"]
