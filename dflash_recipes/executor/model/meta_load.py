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

Which file tensors make each parameter is :func:`stored_layout`'s answer, from transformers'
own conversion table for the model (what ``from_pretrained`` renames and converts): a renamed
tensor (Mixtral's ``block_sparse_moe`` is the module ``mlp``) is read under its file name, and
the MoE families whose checkpoints store each expert apart while the modules stack them
(``mlp.experts.gate_up_proj`` is each expert's ``gate_proj`` and ``up_proj`` concatenated, as in
Qwen3-MoE, Mixtral, DeepSeek-V3, Qwen3-Next and GLM-4-MoE) are read expert by expert: FSDP2
shards a stacked tensor on its expert dim, so a rank reads the file tensors of the experts it
keeps and no other. Every family of the matrix loads shard by shard, bit for bit a plain load's
(tests/executor/model/test_meta_load.py). A target made on load by any other conversion, or
whose files lack a parameter, is loaded whole, as before, with a warning naming why, and
:func:`materialize_target` finds nothing to do.
One process (no ``fsdp``, or one rank) never comes here: its load is unchanged.

The rule for "the rows of a file tensor that this rank's tensor holds" is
:func:`~dflash_recipes.executor.model.shard_reads.read_local`; the drafter's warm start uses it
too (:func:`~dflash_recipes.executor.model.warmstart.stream_tensors`), so a drafter sharded
before its warm start reads only its own rows as well.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
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
from dflash_recipes.executor.model.shard_reads import StoredAs, fill_local
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


def stored_layout(
    model: PreTrainedModel, weights: CheckpointWeights
) -> tuple[dict[str, StoredAs], list[str]]:
    """Where each of `model`'s meta parameters is in `weights`, and why some cannot be read.

    The files' names are mapped to the modules' by transformers' own conversion table for the
    model (``get_model_conversion_mapping``: the renamings and converters ``from_pretrained``
    applies), so a name the loader renames (Mixtral's ``block_sparse_moe`` is ``mlp``) is found,
    and the experts a converter stacks (each expert's ``gate_proj`` and ``up_proj`` into
    ``mlp.experts.gate_up_proj``, its ``down_proj`` into ``mlp.experts.down_proj``) are read
    expert by expert. Only converters that stack on dim 0 and concatenate on dim 1 are read so;
    a parameter made by any other conversion is a problem (the caller loads the target whole).
    Every meta parameter (each shared one once) must be found, with its shape. A transformers
    without that table (its loading internals moved) maps names one to one: what it would
    convert is then a problem, never a wrong read.
    """
    wanted = model.state_dict()
    plain: dict[str, str] = {}
    stacked: dict[str, dict[str, list[str]]] = {}
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )
    except ImportError:
        converter_of: dict[str, Any] = {}
        plain = {key: key for key in weights.tensors if key in wanted}
    else:
        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        converter_of = {pattern: c for c in converters for pattern in c.source_patterns}
        for key in sorted(weights.tensors, key=_natural):
            renamed, pattern = rename_source_key(
                key, renamings, converters, model.base_model_prefix, wanted
            )
            if renamed not in wanted and key in wanted:
                renamed, pattern = key, None
            if renamed not in wanted:
                continue  # a tensor the model has no use for (from_pretrained ignores it too)
            if pattern is None:
                plain[renamed] = key
            else:
                stacked.setdefault(renamed, {}).setdefault(pattern, []).append(key)
    layout: dict[str, StoredAs] = {}
    problems = []
    for name, param in model.named_parameters():
        if not param.is_meta:
            continue
        if name in plain:
            info = weights.tensors[plain[name]]
            if tuple(info.shape) != tuple(param.shape):
                problems.append(
                    f"{name}: {tuple(param.shape)} in the model, {info.shape} in the files"
                )
                continue
            layout[name] = StoredAs(
                parts=((plain[name],),),
                per_expert=False,
                files=((plain[name], weights.tensor_files[plain[name]]),),
            )
        elif name in stacked:
            by_pattern = stacked[name]
            converter = converter_of[next(iter(by_pattern))]
            problem = _stacking_problem(name, param, converter, by_pattern, weights)
            if problem:
                problems.append(problem)
                continue
            groups = [by_pattern[p] for p in converter.source_patterns]
            layout[name] = StoredAs(
                parts=tuple(zip(*groups, strict=True)),
                per_expert=True,
                files=tuple((k, weights.tensor_files[k]) for group in groups for k in group),
            )
        else:
            problems.append(f"{name}: not in the files")
    return layout, problems


def layout_problems(model: PreTrainedModel, weights: CheckpointWeights) -> list[str]:
    """Why `model`'s meta parameters cannot be read from `weights` (empty: they can)."""
    return stored_layout(model, weights)[1]


def _stacking_problem(
    name: str,
    param: torch.Tensor,
    converter: Any,
    by_pattern: Mapping[str, list[str]],
    weights: CheckpointWeights,
) -> str | None:
    """Why `param` is not the files' tensors stacked expert by expert (None: it is)."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    operations = list(converter.operations)
    patterns = list(converter.source_patterns)
    merges = (
        len(operations) in (1, 2)
        and isinstance(operations[0], MergeModulelist)
        and operations[0].dim == 0
        and (len(operations) == 1) == (len(patterns) == 1)
        and all(isinstance(op, Concatenate) and op.dim == 1 for op in operations[1:])
    )
    if not merges:
        return f"{name}: made on load by {operations!r}, which is not read expert by expert"
    if set(by_pattern) != set(patterns):
        return f"{name}: the files lack {sorted(set(patterns) - set(by_pattern))}"
    experts = {len(keys) for keys in by_pattern.values()}
    if experts != {param.shape[0]}:
        return f"{name}: {param.shape[0]} experts in the model, {sorted(experts)} in the files"
    for expert in range(param.shape[0]):
        shapes = [tuple(weights.tensors[by_pattern[p][expert]].shape) for p in patterns]
        rows = sum(shape[0] for shape in shapes if shape)
        if any(shape[1:] != tuple(param.shape[2:]) for shape in shapes) or (rows != param.shape[1]):
            return (
                f"{name}: expert {expert} is {shapes} in the files, "
                f"{tuple(param.shape[1:])} in the model"
            )
    return None


def _natural(key: str) -> list[tuple[int, int | str]]:
    """Sort key: dotted names with their numbers in numeric order (expert 10 after expert 9)."""
    return [(0, int(part)) if part.isdigit() else (1, part) for part in key.split(".")]


# ---------------------------------------------------------------------------------------------
# the two steps around the sharding
# ---------------------------------------------------------------------------------------------


def load_target_on_meta(plan: RunPlan) -> PreTrainedModel:
    """The plan's target with its decoder layers on meta and everything else read from the files.

    What stays whole on every rank (embeddings, final norm, ``lm_head``, and every other tensor
    outside the decoder layers) is read here, one tensor at a time, into host memory; shard the
    model (``shard_target_fsdp2``) and then call :func:`materialize_target`. A target whose
    files cannot be read tensor by tensor (:func:`stored_layout` names why) is loaded whole
    instead, with a warning (nothing is left on meta then).
    """
    path = Path(plan.base_model.path)
    model = build_target_on_meta(plan.base_model)
    weights = read_checkpoint_weights(path)
    layout, problems = stored_layout(model, weights)
    if problems:
        more = f"; and {len(problems) - 4} more" if problems[4:] else ""
        shown = "; ".join(problems[:4]) + more
        logger.warning(
            "training.fsdp: the target's files cannot be read tensor by tensor into its modules "
            "(%s), so each process loads the whole target into host memory before sharding",
            shown,
        )
        return load_base_model(plan)
    _LAYOUTS[model] = layout
    whole = {
        name: param
        for name, param in model.named_parameters()
        if param.is_meta and not _in_decoder_layers(name)
    }
    _fill_whole(model, weights.directory, layout, whole)
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
    layout = _LAYOUTS.get(model)
    if layout is None:
        msg = "materialize_target: the model was not built by load_target_on_meta"
        raise CheckpointError(msg)
    directory = Path(plan.base_model.path)
    _empty_sharded_modules(model, device)
    leftover = {
        name: param for name, param in model.named_parameters() if param.is_meta and name in meta
    }
    if leftover:
        _fill_whole(model, directory, layout, leftover, device=device)
    params = dict(model.named_parameters())
    # One file mapping per file tensor (fill_local): a rank's touched pages of a file are
    # released before the next tensor, so its resident set never holds more than one tensor's
    # rows (or one expert's tensors) beyond what it keeps.
    ordered = sorted(meta - set(leftover), key=lambda n: (layout[n].first_file, n))
    for name in ordered:
        fill_local(directory, layout[name], params[name])
    return len(ordered) + len(leftover)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

#: Where each meta parameter of a target from :func:`load_target_on_meta` is in its files, kept
#: for :func:`materialize_target` (after sharding, the model's classes are FSDP's, not the ones
#: transformers' conversion table is looked up by).
_LAYOUTS: weakref.WeakKeyDictionary[nn.Module, dict[str, StoredAs]] = weakref.WeakKeyDictionary()


def _in_decoder_layers(name: str) -> bool:
    # The resource plan's rule (what it counts as sharded), which is shard_target_fsdp2's: the
    # decoder layers are the ModuleList named `layers`.
    return is_decoder_layer_tensor(name)


def _fill_whole(
    model: nn.Module,
    directory: Path,
    layout: Mapping[str, StoredAs],
    params: Mapping[str, nn.Parameter],
    *,
    device: torch.device | None = None,
) -> None:
    """Replace each meta parameter in `params` with its values from the files (cast to its
    dtype), in every module that holds it (a tied ``lm_head`` shares the embeddings')."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for key, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((module, key))
    for name, param in params.items():
        value = torch.empty(param.shape, dtype=param.dtype, device=device)
        fill_local(directory, layout[name], value)
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
        to_empty_keeping_buffers(module, device)
        done.add(id(module))


def to_empty_keeping_buffers(module: nn.Module, device: torch.device) -> None:
    """``module.to_empty(device=device)`` for its parameters (allocated, values unset), its
    buffers moved with their values (RoPE's ``inv_freq``, computed when it was built on meta)."""
    kept = [
        (sub, key, buf)
        for sub in module.modules()
        for key, buf in sub._buffers.items()
        if buf is not None
    ]
    module.to_empty(device=device)
    for sub, key, buf in kept:
        sub._buffers[key] = buf if buf.is_meta else buf.to(device)


__all__ = [
    "build_target_on_meta",
    "layout_problems",
    "load_target_on_meta",
    "materialize_target",
    "parameters_on_meta",
    "stored_layout",
    "to_empty_keeping_buffers",
]
