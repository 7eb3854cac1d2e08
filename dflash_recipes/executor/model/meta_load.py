"""Load the frozen target without a full host copy per process (``training.fsdp`` on several ranks).

Without this, every rank of a sharded run first loads the whole target into host memory
(:func:`~dflash_recipes.executor.model.convert.load_base_model`): a node needs one copy of the
target per rank before sharding starts. Here, as torchtune and TorchTitan do, the target is built
without tensor data and each rank reads from the safetensors files only what it keeps:

1. :func:`load_target_on_meta` builds the target from its ``config.json`` with every parameter on
   the meta device (buffers, such as RoPE's non-persistent ``inv_freq``, are computed by the
   constructors as a plain load computes them), then reads the tensors that stay whole on every
   rank (everything outside the decoder layers: embeddings, final norm, ``lm_head``) from the
   files, one tensor at a time. The decoder layers stay on meta.
2. The caller shards the decoder layers
   (:func:`~dflash_recipes.executor.parallel_wrappers.shard_target_fsdp2`, ``fully_shard``):
   a meta parameter becomes a meta DTensor whose local shard is a range of rows.
3. :func:`materialize_target` allocates each rank's shards on its device (``to_empty`` on each
   sharded module, which FSDP2 re-registers) and fills them from the files with
   ``safe_open(...).get_slice(name)[rows]``: each rank reads only the rows it keeps, one tensor
   and one file mapping at a time, so the touched pages of the memory-mapped files never add up
   to more than one tensor.

The values are the files' values cast to the parameter's dtype, as ``from_pretrained`` casts
them: bit for bit a plain load's (tests/executor/model/test_meta_load.py gathers and compares).

A target whose module names or shapes are not its files' (a family that transformers converts on
load: the MoE families whose checkpoints store each expert apart while the modules fuse them,
``mlp.experts.gate_up_proj``, such as Qwen3-MoE, Mixtral, DeepSeek-V3, Qwen3-Next and GLM-4-MoE)
cannot be read slice by slice: :func:`load_target_on_meta` then logs a warning and loads it
whole, as before, and :func:`materialize_target` finds nothing to do. The dense families (Llama,
Qwen2/3, Mistral, Gemma 2/3, Phi-3, OLMo 2, GLM, Granite, Llama 4's text model) and gpt-oss load
shard by shard (tests/executor/model/test_meta_load.py runs the family matrix).
One process (no ``fsdp``, or one rank) never comes here: its load is unchanged.

The rule for "the rows of a file tensor that this rank's tensor holds" is
:func:`~dflash_recipes.executor.model.shard_reads.read_local`; the drafter's warm start uses it
too (:func:`~dflash_recipes.executor.model.warmstart.stream_tensors`), so a drafter sharded
before its warm start reads only its own rows as well.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from dflash_recipes.checkpoint.model_files import CONFIG_FILE
from dflash_recipes.checkpoint.weight_index import CheckpointWeights, read_checkpoint_weights
from dflash_recipes.errors import CheckpointError
from dflash_recipes.executor.model.convert import (
    DRAFT_ATTRIBUTE,
    load_base_model,
    require_config,
    torch_dtype,
)
from dflash_recipes.executor.model.shard_reads import local_part, read_local
from dflash_recipes.plan.parts import BaseModelPlan
from dflash_recipes.plan.resources.target_dims import is_decoder_layer_tensor
from dflash_recipes.plan.run_plan import RunPlan

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# building without data
# ---------------------------------------------------------------------------------------------


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get every parameter on the meta device, their buffers as built.

    Parameters are created without initialisation (transformers' ``no_init_weights``) and moved
    to meta as they are registered, so at most one uninitialised (never touched) tensor exists
    at a time; buffers stay where the constructor made them, with the values it computed.
    Not thread-safe (it swaps ``nn.Module.register_parameter`` for the duration): build on the
    main thread.
    """
    from transformers.initialization import no_init_weights

    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign, assignment]
    try:
        with no_init_weights():
            yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def build_target_on_meta(base: BaseModelPlan) -> PreTrainedModel:
    """The target built from its config.json: parameters on meta, buffers computed.

    In the plan's dtype, with the attention implementation a plain load picks; runs custom
    modelling code only when the recipe set ``model.trust_remote_code``.
    """
    path = require_config(Path(base.path))
    try:
        config = AutoConfig.from_pretrained(
            str(path), local_files_only=True, trust_remote_code=base.trust_remote_code
        )
        with parameters_on_meta():
            model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                config, trust_remote_code=base.trust_remote_code, dtype=torch_dtype(base.dtype)
            )
    except (OSError, ValueError) as exc:
        msg = f"cannot build the base model from {path / CONFIG_FILE}: {exc}"
        raise CheckpointError(msg) from exc
    assert isinstance(model, PreTrainedModel)
    nn.Module.eval(model)
    return model


# ---------------------------------------------------------------------------------------------
# what the files hold, and what this rank reads of it
# ---------------------------------------------------------------------------------------------


def layout_problems(model: nn.Module, weights: CheckpointWeights) -> list[str]:
    """Why `model`'s meta parameters cannot be read by name from `weights` (empty: they can).

    Every meta parameter (each shared one once) must be a tensor of the files with its shape.
    """
    problems = []
    for name, param in model.named_parameters():
        if not param.is_meta:
            continue
        info = weights.tensors.get(name)
        if info is None:
            problems.append(f"{name}: not in the files")
        elif tuple(info.shape) != tuple(param.shape):
            problems.append(f"{name}: {tuple(param.shape)} in the model, {info.shape} in the files")
    return problems


# ---------------------------------------------------------------------------------------------
# the two steps around the sharding
# ---------------------------------------------------------------------------------------------


def load_target_on_meta(plan: RunPlan) -> PreTrainedModel:
    """The plan's target with its decoder layers on meta and everything else read from the files.

    What stays whole on every rank (embeddings, final norm, ``lm_head``, and every other tensor
    outside the decoder layers) is read here, one tensor at a time, into host memory; shard the
    model (``shard_target_fsdp2``) and then call :func:`materialize_target`. A target whose
    files cannot be read by module name is loaded whole instead, with a warning (nothing is left
    on meta then).
    """
    path = Path(plan.base_model.path)
    model = build_target_on_meta(plan.base_model)
    weights = read_checkpoint_weights(path)
    problems = layout_problems(model, weights)
    if problems:
        more = f"; and {len(problems) - 4} more" if problems[4:] else ""
        shown = "; ".join(problems[:4]) + more
        logger.warning(
            "training.fsdp: the target's files are not its modules' tensors by name (%s), so "
            "each process loads the whole target into host memory before sharding",
            shown,
        )
        return load_base_model(plan)
    whole = {
        name: param
        for name, param in model.named_parameters()
        if param.is_meta and not _in_decoder_layers(name)
    }
    _fill_whole(model, weights, whole)
    return model


def materialize_target(model: nn.Module, plan: RunPlan, device: torch.device) -> int:
    """Allocate the target's sharded meta parameters on `device` and fill each rank's rows.

    Call after sharding a model from :func:`load_target_on_meta`. Only parameters still on meta
    are touched (the drafter, and what was read whole, are left alone); each sharded module
    (FSDP2's) gets ``to_empty``, which FSDP2 follows by registering the new shards, and its
    buffers are kept as they were. A meta parameter left outside any sharded module is read
    whole. Returns the number of tensors read; 0 when nothing was on meta.
    """
    drafter = f"{DRAFT_ATTRIBUTE}."  # a drafter on meta is filled from rank 0 once sharded
    meta = {
        name
        for name, param in model.named_parameters()
        if param.is_meta and not name.startswith(drafter)
    }
    if not meta:
        return 0
    _empty_sharded_modules(model, device)
    leftover = {
        name: param for name, param in model.named_parameters() if param.is_meta and name in meta
    }
    weights = read_checkpoint_weights(Path(plan.base_model.path))
    if leftover:
        _fill_whole(model, weights, leftover, device=device)
    params = dict(model.named_parameters())
    read = 0
    with torch.no_grad():
        for name in sorted(meta - set(leftover), key=lambda n: weights.tensor_files[n]):
            param = params[name]
            path = weights.directory / weights.tensor_files[name]
            # One mapping per tensor: a rank's touched pages of the file are released before the
            # next tensor, so its resident set never holds more than one tensor's rows.
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                part = read_local(handle, name, param)
            target = local_part(param)
            if tuple(part.shape) != tuple(target.shape):
                msg = (
                    f"{name}: read {tuple(part.shape)} for this rank's shard of shape "
                    f"{tuple(target.shape)}"
                )
                raise CheckpointError(msg)
            target.copy_(part)
            del part
            read += 1
    return read + len(leftover)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def _in_decoder_layers(name: str) -> bool:
    # The resource plan's rule (what it counts as sharded), which is shard_target_fsdp2's: the
    # decoder layers are the ModuleList named `layers`.
    return is_decoder_layer_tensor(name)


def _fill_whole(
    model: nn.Module,
    weights: CheckpointWeights,
    params: Mapping[str, nn.Parameter],
    *,
    device: torch.device | None = None,
) -> None:
    """Replace each meta parameter in `params` with the files' tensor (cast to its dtype), in
    every module that holds it (a tied ``lm_head`` shares the embeddings' parameter)."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for key, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((module, key))
    for name, param in params.items():
        path = weights.directory / weights.tensor_files[name]
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            value = handle.get_tensor(name).to(dtype=param.dtype)
        if device is not None:
            value = value.to(device)
        loaded = nn.Parameter(value, requires_grad=param.requires_grad)
        for module, key in owners.get(id(param), []):
            module._parameters[key] = loaded


def _empty_sharded_modules(model: nn.Module, device: torch.device) -> None:
    """``to_empty`` on each FSDP2 module whose subtree holds only meta parameters, deepest
    first, keeping its buffers' values."""
    from torch.distributed.fsdp import FSDPModule

    done: set[int] = set()
    for module in reversed(list(model.modules())):
        if not isinstance(module, FSDPModule) or not isinstance(module, nn.Module):
            continue
        params = list(module.parameters())
        if not params or not all(p.is_meta for p in params):
            continue
        if any(id(sub) in done for sub in module.modules()):
            continue
        kept = [
            (sub, key, buf)
            for sub in module.modules()
            for key, buf in sub._buffers.items()
            if buf is not None
        ]
        module.to_empty(device=device)
        for sub, key, buf in kept:
            sub._buffers[key] = buf if buf.is_meta else buf.to(device)
        done.add(id(module))


__all__ = [
    "build_target_on_meta",
    "layout_problems",
    "load_target_on_meta",
    "materialize_target",
    "parameters_on_meta",
]
