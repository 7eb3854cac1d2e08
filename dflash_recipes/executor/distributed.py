"""Data-parallel training on existing engines: torchrun environment, DDP, optional FSDP2.

A run is distributed when a launcher has set the torchrun environment (`RANK`, `WORLD_SIZE`,
`LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`): `dflash-recipe run --nproc-per-node N` relaunches
itself through `torch.distributed.run` (:mod:`dflash_recipes.executor.launch`), and any other
launcher that sets the same variables (Slurm + torchrun, Kubernetes operators) works too.
Without those variables the run is a single process and every helper here is a cheap no-op.

A trainer uses it like this::

    env = detect_dist_env(plan.training.device)
    init_distributed(env)
    try:
        drafter = wrap_ddp(drafter.to(env.device), env)     # trainable: DDP
        if plan.training.fsdp:
            target = shard_target_fsdp2(target, env)        # frozen: optional FSDP2
        ...                                                 # each rank: its share of the batch
        if is_main(env):
            ...                                             # only rank 0 logs, saves, exports
        barrier(env)
    finally:
        shutdown_distributed()

Gloo is the backend on CPU, NCCL on CUDA.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar

import attrs
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from transformers import PreTrainedModel

from dflash_recipes.errors import LaunchError
from dflash_recipes.executor.model.draft import DFlashDraftModel
from dflash_recipes.records import Record

DevicePreference = Literal["auto", "cpu", "cuda"]
Backend = Literal["nccl", "gloo"]

#: The variables torchrun sets for every worker; RANK and WORLD_SIZE decide "distributed".
TORCHRUN_ENV_VARS: tuple[str, ...] = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)

#: How long backend threads get to release finished work before the group is destroyed.
_DRAIN_SECONDS = 0.2

_LAUNCH_HINT = (
    "launch with `dflash-recipe run --nproc-per-node N PLAN` (torchrun sets RANK, WORLD_SIZE, "
    "LOCAL_RANK, MASTER_ADDR and MASTER_PORT for every process), or unset these variables "
    "for a single-process run"
)

_T = TypeVar("_T")
_M = TypeVar("_M", bound=nn.Module)


@attrs.frozen(repr=False, eq=False, slots=False)
class DistEnv(Record):
    """Where this process sits in the job, and which device and backend it uses."""

    rank: int
    world_size: int
    local_rank: int
    #: True when world_size > 1: collectives run and DDP wraps the drafter.
    is_distributed: bool
    backend: Backend
    device: torch.device


# ---------------------------------------------------------------------------------------------
# environment
# ---------------------------------------------------------------------------------------------


def is_launched_process(environ: Mapping[str, str] | None = None) -> bool:
    """True inside a worker started by torchrun (or a launcher that sets RANK and WORLD_SIZE).

    The CLI uses it so that `dflash-recipe run --nproc-per-node N` started by torchrun does not
    launch torchrun again.
    """
    env = os.environ if environ is None else environ
    return "RANK" in env and "WORLD_SIZE" in env


def detect_dist_env(
    device_pref: DevicePreference = "auto", environ: Mapping[str, str] | None = None
) -> DistEnv:
    """Read the torchrun environment (default: `os.environ`) and pick device and backend.

    No RANK/WORLD_SIZE: a single process. A partial or inconsistent environment, or
    `device_pref="cuda"` without a usable GPU, raises LaunchError saying how to fix it.
    """
    env = os.environ if environ is None else environ
    present = [name for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if name in env]
    if not present:
        device = _pick_device(device_pref, local_rank=0)
        return DistEnv(
            rank=0,
            world_size=1,
            local_rank=0,
            is_distributed=False,
            backend=_backend_for(device),
            device=device,
        )
    missing = [name for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if name not in env]
    if missing:
        msg = (
            f"incomplete distributed environment: {', '.join(present)} set but "
            f"{', '.join(missing)} not; {_LAUNCH_HINT}"
        )
        raise LaunchError(msg)
    rank = _int_var(env, "RANK")
    world_size = _int_var(env, "WORLD_SIZE")
    local_rank = _int_var(env, "LOCAL_RANK")
    if world_size < 1:
        msg = f"WORLD_SIZE={world_size} must be at least 1; {_LAUNCH_HINT}"
        raise LaunchError(msg)
    if not 0 <= rank < world_size:
        msg = (
            f"RANK={rank} is outside 0..{world_size - 1} (WORLD_SIZE={world_size}); {_LAUNCH_HINT}"
        )
        raise LaunchError(msg)
    if not 0 <= local_rank <= rank:
        msg = (
            f"LOCAL_RANK={local_rank} is inconsistent with RANK={rank} (expected "
            f"0 <= LOCAL_RANK <= RANK); {_LAUNCH_HINT}"
        )
        raise LaunchError(msg)
    is_distributed = world_size > 1
    if is_distributed:
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
        if missing:
            msg = (
                f"WORLD_SIZE={world_size} but {' and '.join(missing)} not set: the processes "
                f"cannot find each other; {_LAUNCH_HINT}"
            )
            raise LaunchError(msg)
        port = _int_var(env, "MASTER_PORT")
        if not 1 <= port <= 65535:
            msg = f"MASTER_PORT={port} is not a TCP port (1..65535); {_LAUNCH_HINT}"
            raise LaunchError(msg)
    device = _pick_device(device_pref, local_rank=local_rank)
    return DistEnv(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        is_distributed=is_distributed,
        backend=_backend_for(device),
        device=device,
    )


def _int_var(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    try:
        return int(raw.strip())
    except ValueError:
        msg = f"{name}={raw!r} is not an integer; {_LAUNCH_HINT}"
        raise LaunchError(msg) from None


def _pick_device(device_pref: DevicePreference, *, local_rank: int) -> torch.device:
    if device_pref not in ("auto", "cpu", "cuda"):
        msg = f"training.device must be auto, cpu or cuda, got {device_pref!r}"
        raise LaunchError(msg)
    if device_pref == "cpu":
        return torch.device("cpu")
    available = torch.cuda.is_available()
    if not available:
        if device_pref == "cuda":
            msg = (
                f"training.device is cuda but CUDA is not available (torch {torch.__version__}, "
                f"CUDA build {torch.version.cuda or 'none'}); set training.device: cpu (or auto), "
                "or install a CUDA build of torch on a machine with a visible GPU"
            )
            raise LaunchError(msg)
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        msg = (
            f"LOCAL_RANK={local_rank} needs GPU {local_rank} but only {count} CUDA device(s) are "
            "visible; use --nproc-per-node at most the GPUs per node, or check "
            "CUDA_VISIBLE_DEVICES"
        )
        raise LaunchError(msg)
    return torch.device("cuda", local_rank)


def _backend_for(device: torch.device) -> Backend:
    return "nccl" if device.type == "cuda" else "gloo"


# ---------------------------------------------------------------------------------------------
# process group and collectives
# ---------------------------------------------------------------------------------------------


def init_distributed(env: DistEnv) -> None:
    """Join the process group (env:// rendezvous). No-op when not distributed or already joined."""
    if not env.is_distributed:
        return
    if not dist.is_available():
        msg = f"torch {torch.__version__} was built without torch.distributed; run one process"
        raise LaunchError(msg)
    if dist.is_initialized():
        return
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)
    try:
        dist.init_process_group(
            backend=env.backend,
            init_method="env://",
            rank=env.rank,
            world_size=env.world_size,
            device_id=env.device if env.device.type == "cuda" else None,
        )
    except (RuntimeError, ValueError) as exc:
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        msg = (
            f"rank {env.rank} of {env.world_size} could not join the {env.backend} process "
            f"group at {where}: {exc}; check that every node reaches MASTER_ADDR on MASTER_PORT "
            "and that all processes were started with the same WORLD_SIZE"
        )
        raise LaunchError(msg) from exc


def shutdown_distributed() -> None:
    """Leave the process group if one is active; safe to call twice or when never joined.

    Call it on every rank after the last collective (the trainer does, in a `finally`).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    # A collective issued during backward holds a Python object (the autograd context torch
    # stashes in thread-local state), and the backend thread that finishes the op needs the
    # GIL to drop it. If the process group is destroyed while the main thread holds the GIL,
    # or the interpreter exits first, the process hangs or aborts ("terminate called without
    # an active exception"; seen with gloo on torch 2.13). Give those threads a moment
    # (sleeping releases the GIL) before tearing down; it costs nothing at the end of a run.
    time.sleep(_DRAIN_SECONDS)
    dist.destroy_process_group()


def is_main(env: DistEnv) -> bool:
    """True on rank 0, the only rank that logs, saves checkpoints and exports."""
    return env.rank == 0


def _active(env: DistEnv) -> bool:
    return env.is_distributed and dist.is_available() and dist.is_initialized()


def barrier(env: DistEnv) -> None:
    """Wait for every rank (no-op for a single process)."""
    if not _active(env):
        return
    if env.backend == "nccl":
        dist.barrier(device_ids=[env.local_rank])
    else:
        dist.barrier()


_DIGEST_CHARS = 64

#: The longest text :func:`broadcast_text` carries (a message longer than this is cut).
TEXT_LIMIT = 4096


def _coordination_device(env: DistEnv) -> torch.device:
    return env.device if env.backend == "nccl" else torch.device("cpu")


def broadcast_text(text: str | None, env: DistEnv) -> str | None:
    """Rank 0's `text` (None when it has none) on every rank; the other ranks wait for it.

    UTF-8, cut to :data:`TEXT_LIMIT` bytes (on a character boundary). Returns `text` itself
    for a single process and on rank 0. Every rank takes part whatever rank 0 holds, so none
    is left waiting; nothing is pickled."""
    if not _active(env):
        return text
    device = _coordination_device(env)
    # [has text, length (2 bytes, big-endian), the UTF-8 bytes...]
    buffer = torch.zeros(3 + TEXT_LIMIT, dtype=torch.uint8, device=device)
    if env.rank == 0 and text is not None:
        raw = text.encode("utf-8")[:TEXT_LIMIT].decode("utf-8", errors="ignore").encode("utf-8")
        header = bytes([1]) + len(raw).to_bytes(2, "big")
        buffer[: 3 + len(raw)] = torch.tensor(list(header + raw), dtype=torch.uint8)
    dist.broadcast(buffer, src=0)
    if env.rank == 0:
        return text
    values = bytes(buffer.cpu().tolist())
    if values[0] != 1:
        return None
    return values[3 : 3 + int.from_bytes(values[1:3], "big")].decode("utf-8")


def broadcast_digest(digest: str | None, env: DistEnv) -> str | None:
    """Rank 0's sha256 hex digest (None when it has none) on every rank; the other ranks wait
    for it. Returns `digest` itself for a single process. Every rank takes part whatever rank
    0 holds (what is not a 64-character ASCII digest reaches the others as None), so none
    is left waiting."""
    ok = digest is not None and len(digest) == _DIGEST_CHARS and digest.isascii()
    shared = broadcast_text(digest if ok else None, env)
    if env.rank == 0 or not _active(env):
        return digest
    return shared


def first_rank_where(flag: bool, env: DistEnv) -> int | None:
    """The lowest rank whose `flag` is true, on every rank; None when no rank's is. A single
    process: 0 when `flag`, else None."""
    if not _active(env):
        return 0 if flag else None
    mine = env.rank if flag else env.world_size
    lowest = torch.tensor([mine], dtype=torch.int64, device=_coordination_device(env))
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    found = int(lowest.item())
    return found if found < env.world_size else None


# ---------------------------------------------------------------------------------------------
# DDP for the drafter
# ---------------------------------------------------------------------------------------------


def all_reduce_sum(tensor: Tensor, env: DistEnv) -> Tensor:
    """Sum a tensor over all ranks, in place (identity for a single process)."""
    if env.is_distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def global_batch_loss(loss: Tensor, weight_sum: Tensor, env: DistEnv) -> Tensor:
    """`loss` (this rank's, normalised by its own `weight_sum`) renormalised by the weight sum
    of the whole global batch, times the world size: DDP's gradient average then equals the
    single-process gradient over the global batch. One process: `loss` unchanged."""
    if not env.is_distributed:
        return loss  # the scale is local / local = 1 exactly
    total = all_reduce_sum(weight_sum.clone(), env)
    # No host sync: where() instead of a Python test of the total.
    positive = total > 0
    safe_total = torch.where(positive, total, torch.ones_like(total))
    scale = torch.where(positive, weight_sum * env.world_size / safe_total, 1.0)
    return loss * scale


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


# ---------------------------------------------------------------------------------------------
# FSDP2 for a large frozen target
# ---------------------------------------------------------------------------------------------


def shard_target_fsdp2(model: _M, env: DistEnv) -> _M:
    """Shard the frozen target's decoder layers over all ranks with FSDP2 (`training.fsdp`).

    Returns the same module, sharded in place (unchanged for a single process). Load the target
    on CPU and call this before moving it: each decoder layer goes to `env.device` already
    sharded, so no GPU ever holds the whole target; the other parameters and buffers are moved
    to `env.device` here.

    Limitations:

    - Only the decoder layers (the `nn.ModuleList` named `layers`, as in Hugging Face
      Qwen3/Llama models) are sharded. Embeddings, the final norm and `lm_head` stay whole on
      every rank, because the drafter calls `embed_tokens` and `lm_head` outside the target's
      forward, where FSDP-sharded weights are not gathered.
    - Inference only: run the target under `torch.no_grad()`; it is never trained or saved
      through FSDP state dicts.
    - Every target forward all-gathers each layer's weights (communication per step); use it
      only when the target does not fit on one device next to the drafter.
    - While loading, each process holds a full copy of the target in host memory.
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
    if not _active(env):
        msg = "shard_target_fsdp2 needs the process group: call init_distributed(env) first"
        raise LaunchError(msg)
    parent, layers = _find_decoder_layers(model)
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
            if not isinstance(param, DTensor) and param.device != env.device:
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


def _find_decoder_layers(model: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    found: list[tuple[str, nn.Module, nn.ModuleList]] = []
    # A converted target carries its drafter (`dflash_module.layers`): that is not the target's.
    drafter_parts = {
        id(part)
        for sub in model.modules()
        if isinstance(sub, DFlashDraftModel)
        for part in sub.modules()
    }
    for name, module in model.named_modules():
        if id(module) in drafter_parts:
            continue
        for child_name, child in module.named_children():
            if child_name == "layers" and isinstance(child, nn.ModuleList) and len(child) > 0:
                found.append((f"{name}.{child_name}" if name else child_name, module, child))
    if len(found) != 1:
        names = ", ".join(n for n, _, _ in found) or "none"
        msg = (
            "training.fsdp: cannot tell which modules are the target's decoder layers "
            f"(expected exactly one nn.ModuleList named `layers`, found: {names}); "
            "set training.fsdp: false"
        )
        raise LaunchError(msg)
    _, parent, layers = found[0]
    return parent, layers


__all__ = [
    "TEXT_LIMIT",
    "TORCHRUN_ENV_VARS",
    "Backend",
    "DevicePreference",
    "DistEnv",
    "all_reduce_sum",
    "barrier",
    "broadcast_digest",
    "broadcast_text",
    "detect_dist_env",
    "first_rank_where",
    "global_batch_loss",
    "init_distributed",
    "is_launched_process",
    "is_main",
    "shard_target_fsdp2",
    "shutdown_distributed",
    "wrap_ddp",
]
