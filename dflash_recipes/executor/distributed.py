"""Starting torchrun for `run` / `capture --nproc-per-node`: the command and the launch.

:func:`build_torchrun_argv` turns the launch options into a ``torch.distributed.run`` command
(wrapped by :mod:`dflash_recipes.executor.torchrun`) that reruns the same `dflash-recipe`
command in every worker; :func:`launch_torchrun` runs it, passing on the signals the launcher
receives. The workers find their rank in the torchrun environment
(:mod:`dflash_recipes.executor.dist_env`); the collectives, the DDP/FSDP2 wrappers and the
decisions the ranks share are :mod:`~dflash_recipes.executor.collectives`,
:mod:`~dflash_recipes.executor.parallel_wrappers` and
:mod:`~dflash_recipes.executor.coordination`.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence

from dflash_recipes.errors import LaunchError

#: The module that runs torchrun (:mod:`dflash_recipes.executor.torchrun`).
TORCHRUN_MODULE = "dflash_recipes.executor.torchrun"

#: Seconds torchrun waits for its workers after forwarding a stop signal before SIGKILL.
WORKER_SHUTDOWN_TIMEOUT_S = 900

#: Rendezvous id used for multi-node runs when none is given (all nodes must agree on it).
DEFAULT_RDZV_ID = "dflash-recipes"

_HOST_PORT = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):(?P<port>\d{1,5})$")
_RDZV_ID = re.compile(r"^[A-Za-z0-9_.\-]+$")
_LAUNCH_OPTIONS = ("--nproc-per-node", "--nproc_per_node", "--nnodes", "--rdzv-endpoint")


def build_torchrun_argv(
    target_argv: Sequence[str],
    *,
    nproc_per_node: int,
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
    rdzv_id: str | None = None,
    command: str = "run",
) -> list[str]:
    """The command that runs `dflash-recipe COMMAND TARGET_ARGV...` in N processes per node.

    Single node without an endpoint: `--standalone` (a local rendezvous on a free port).
    Multi-node (or any given endpoint): c10d rendezvous at HOST:PORT, the same command on every
    node, the same `rdzv_id` everywhere (default :data:`DEFAULT_RDZV_ID`; use the job id so two
    jobs on one endpoint do not mix). Invalid values raise LaunchError.
    """
    if (
        isinstance(nproc_per_node, bool)
        or not isinstance(nproc_per_node, int)
        or nproc_per_node < 1
    ):
        msg = f"--nproc-per-node must be a positive integer (processes), got {nproc_per_node!r}"
        raise LaunchError(msg)
    if isinstance(nnodes, bool) or not isinstance(nnodes, int) or nnodes < 1:
        msg = f"--nnodes must be a positive integer, got {nnodes!r}"
        raise LaunchError(msg)
    if nnodes > 1 and rdzv_endpoint is None:
        msg = (
            f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT, an address of the first node "
            "that every node can reach (for example --rdzv-endpoint node001:29500)"
        )
        raise LaunchError(msg)
    if rdzv_endpoint is not None:
        match = _HOST_PORT.match(rdzv_endpoint)
        if match is None or not 1 <= int(match.group("port")) <= 65535:
            msg = (
                f"--rdzv-endpoint {rdzv_endpoint!r} is not HOST:PORT (a host name or IP address "
                "and a TCP port 1..65535, for example node001:29500 or [fd00::1]:29500)"
            )
            raise LaunchError(msg)
    if rdzv_id is not None:
        if rdzv_endpoint is None:
            msg = "--rdzv-id only applies with --rdzv-endpoint (multi-node rendezvous)"
            raise LaunchError(msg)
        if not _RDZV_ID.match(rdzv_id):
            msg = f"--rdzv-id {rdzv_id!r} must be letters, digits, '.', '_' or '-' (e.g. a job id)"
            raise LaunchError(msg)
    clashing = [a for a in target_argv if a.split("=", 1)[0] in _LAUNCH_OPTIONS]
    if clashing:
        msg = (
            f"launch options {clashing} must not be passed to the processes torchrun starts "
            "(they would launch again); pass only the plan or recipe and its overrides"
        )
        raise LaunchError(msg)
    # torch.distributed.run itself, minus its traceback when a stop signal ends it
    argv = [sys.executable, "-m", TORCHRUN_MODULE, "--nproc-per-node", str(nproc_per_node)]
    # torchrun SIGKILLs its workers this long after forwarding a SIGTERM: longer than any
    # save, so that the scheduler's own grace period is the one that counts.
    argv += ["--shutdown-timeout", str(WORKER_SHUTDOWN_TIMEOUT_S)]
    if rdzv_endpoint is None:
        argv.append("--standalone")
    else:
        argv += [
            "--nnodes",
            str(nnodes),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            rdzv_endpoint,
            "--rdzv-id",
            rdzv_id if rdzv_id is not None else DEFAULT_RDZV_ID,
        ]
    argv += ["-m", "dflash_recipes.cli", command, *target_argv]
    return argv


def launch_torchrun(argv: Sequence[str]) -> int:
    """Run the torchrun command and return its exit code (128+N when killed by signal N).

    The signals this launcher receives are passed on
    (:func:`~dflash_recipes.executor.signals.run_forwarding_signals`): a SIGTERM sent to it
    stops the workers at a step boundary with a checkpoint, exactly as one sent to a worker.
    """
    from dflash_recipes.executor.signals import run_forwarding_signals

    try:
        return run_forwarding_signals(argv)
    except OSError as exc:
        msg = f"could not start {argv[0] if argv else '(empty command)'}: {exc}"
        raise LaunchError(msg) from exc


__all__ = [
    "DEFAULT_RDZV_ID",
    "TORCHRUN_MODULE",
    "WORKER_SHUTDOWN_TIMEOUT_S",
    "build_torchrun_argv",
    "launch_torchrun",
]
