"""Where this process sits in a data-parallel job: the torchrun environment and the process group.

A run is distributed when a launcher has set the torchrun environment (`RANK`, `WORLD_SIZE`,
`LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`): `dflash-recipe run --nproc-per-node N` relaunches
itself through `torch.distributed.run` (the launcher:
:mod:`dflash_recipes.executor.launch`), and any other launcher that sets the same
variables (Slurm + torchrun, Kubernetes operators) works too. Without those variables the run
is a single process and every helper of the executor's distributed modules is a cheap no-op.
A worker uses this module like this::

    env = detect_dist_env(plan.training.device)
    init_distributed(env)
    try:
        ...                         # collectives (:mod:`.collectives`), DDP/FSDP2
        if is_main(env):            # (:mod:`.parallel_wrappers`), shared decisions
            ...                     # (:mod:`.coordination`); only rank 0 logs, saves, exports
    finally:
        shutdown_distributed()

Gloo is the backend on CPU, NCCL on CUDA.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Literal

import attrs
import torch
import torch.distributed as dist

from dflash_recipes.errors import LaunchError
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
# the torchrun environment
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
# the process group
# ---------------------------------------------------------------------------------------------


def init_distributed(env: DistEnv, *, timeout_s: float | None = None) -> None:
    """Join the process group (env:// rendezvous). No-op when not distributed or already joined.

    `timeout_s` (the plan's ``training.distributed_timeout_s``) is how long a collective waits
    for the other ranks before it fails; None: torch's default for the backend."""
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
            timeout=None if timeout_s is None else timedelta(seconds=timeout_s),
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


def joined(env: DistEnv) -> bool:
    """True when `env` is distributed and this process has joined its process group."""
    return env.is_distributed and dist.is_available() and dist.is_initialized()


__all__ = [
    "TORCHRUN_ENV_VARS",
    "Backend",
    "DevicePreference",
    "DistEnv",
    "detect_dist_env",
    "init_distributed",
    "is_launched_process",
    "is_main",
    "joined",
    "shutdown_distributed",
]
