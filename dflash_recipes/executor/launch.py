"""Starting torchrun for `run` / `capture --nproc-per-node`: the command and the launch.

:func:`build_torchrun_argv` turns the launch options into a ``torch.distributed.run`` command
(wrapped by :mod:`dflash_recipes.executor.torchrun`) that reruns the same `dflash-recipe`
command in every worker; :func:`launch_torchrun` runs it, passing on the signals the launcher
receives (:func:`~dflash_recipes.executor.signals.run_forwarding_signals`). The workers find
their rank in the torchrun environment (:mod:`dflash_recipes.executor.dist_env`).

The command uses only options the installed torchrun accepts, asked of torchrun's own argument
parser (:func:`torchrun_parser`), not of a table of torch versions. The one that differs
between releases is the stop grace: after forwarding a SIGTERM, torchrun SIGKILLs the workers
that have not exited within its shutdown timeout, 30 s unless ``--shutdown-timeout`` (torch
2.12 and newer) says otherwise, and a save can take longer. Where that option exists the
command sets it to :data:`WORKER_SHUTDOWN_TIMEOUT_S`; where it does not (torch 2.10 and
2.11), the command tells torchrun (``--signals-to-handle``) to leave SIGTERM and SIGINT alone,
and the wrapper takes them: it passes them on to the workers and waits for every worker to
exit, with no deadline of its own (:mod:`dflash_recipes.executor.torchrun`). Either way the
scheduler's grace period is the one that counts. torch 2.9's torchrun has neither option: the
launch is refused there (a LaunchError that names the torch to install).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from dflash_recipes.errors import LaunchError
from dflash_recipes.executor.versions import installed_version

if TYPE_CHECKING:
    from argparse import ArgumentParser

#: The module that runs torchrun (:mod:`dflash_recipes.executor.torchrun`).
TORCHRUN_MODULE = "dflash_recipes.executor.torchrun"

#: Seconds torchrun waits for its workers after forwarding a stop signal before SIGKILL.
WORKER_SHUTDOWN_TIMEOUT_S = 900

#: Rendezvous id used for multi-node runs when none is given (all nodes must agree on it).
DEFAULT_RDZV_ID = "dflash-recipes"

_HOST_PORT = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):(?P<port>\d{1,5})$")
_RDZV_ID = re.compile(r"^[A-Za-z0-9_.\-]+$")
_LAUNCH_OPTIONS = ("--nproc-per-node", "--nproc_per_node", "--nnodes", "--rdzv-endpoint")

#: The first torch whose torchrun has ``--signals-to-handle`` (torch 2.9's has neither it nor
#: ``--shutdown-timeout``; read in the 2.9.0, 2.9.1, 2.10.0 and 2.11.0 wheels' ``run.py``).
SIGNALS_TO_HANDLE_SINCE = "2.10"

#: The signals the wrapper takes from a torchrun without ``--shutdown-timeout`` (the stop
#: signals of :mod:`dflash_recipes.executor.signals`, by the names torchrun's option uses).
KEPT_STOP_SIGNALS: tuple[str, ...] = ("SIGTERM", "SIGINT")


def torchrun_parser() -> ArgumentParser:
    """The installed torchrun's own argument parser (``torch.distributed.run``)."""
    from torch.distributed.run import get_args_parser

    return get_args_parser()


def torchrun_accepts(parser: ArgumentParser, option: str, value: str) -> bool:
    """Whether torchrun, parsing as it does, takes `option value` (and not as a script name)."""
    # parse_known_args leaves an option it does not know in the unknown list; the script name
    # that follows keeps a missing option's value from being read as an error.
    try:
        _, unknown = parser.parse_known_args([option, value, "script.py"])
    except SystemExit:  # argparse refused the value (its message went to stderr)
        return False
    return option not in unknown


def stop_grace_options(parser: ArgumentParser) -> list[str]:
    """torchrun's options that keep a worker's save from being cut short after a SIGTERM.

    ``--shutdown-timeout`` where torchrun has it; else ``--signals-to-handle`` with torchrun's
    default list less :data:`KEPT_STOP_SIGNALS`, which the wrapper then takes. Raises
    LaunchError for a torchrun that has neither (torch 2.9's), naming the installed torch and
    :data:`SIGNALS_TO_HANDLE_SINCE`.
    """
    timeout = str(WORKER_SHUTDOWN_TIMEOUT_S)
    if torchrun_accepts(parser, "--shutdown-timeout", timeout):
        return ["--shutdown-timeout", timeout]
    if torchrun_accepts(parser, "--signals-to-handle", "SIGHUP"):
        default = str(parser.parse_known_args(["script.py"])[0].signals_to_handle)
        left = [
            s for s in (n.strip() for n in default.split(",")) if s and s not in KEPT_STOP_SIGNALS
        ]
        return ["--signals-to-handle", ",".join(left)]
    found = installed_version("torch")
    msg = (
        f"this torchrun (torch {found or 'unknown'}) accepts neither --shutdown-timeout nor "
        "--signals-to-handle, so it would SIGKILL the workers 30 s after a SIGTERM, in the "
        f"middle of a save: upgrade torch (pip install 'torch>={SIGNALS_TO_HANDLE_SINCE}'), "
        "or start torchrun yourself (torchrun ... -m dflash_recipes.cli run PLAN) and accept "
        "that 30 s"
    )
    raise LaunchError(msg)


def build_torchrun_argv(
    target_argv: Sequence[str],
    *,
    nproc_per_node: int,
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
    rdzv_id: str | None = None,
    command: str = "run",
    parser: ArgumentParser | None = None,
) -> list[str]:
    """The command that runs `dflash-recipe COMMAND TARGET_ARGV...` in N processes per node.

    Single node without an endpoint: `--standalone` (a local rendezvous on a free port).
    Multi-node (or any given endpoint): c10d rendezvous at HOST:PORT, the same command on every
    node, the same `rdzv_id` everywhere (default :data:`DEFAULT_RDZV_ID`; use the job id so two
    jobs on one endpoint do not mix). The stop grace comes from :func:`stop_grace_options`,
    asked of `parser` (default: the installed torchrun's, :func:`torchrun_parser`). Invalid
    values raise LaunchError.
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
    # torchrun SIGKILLs its workers its shutdown timeout after forwarding a SIGTERM: longer
    # than any save, or not torchrun's to keep, so that the scheduler's grace period counts.
    argv += stop_grace_options(parser if parser is not None else torchrun_parser())
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
    "KEPT_STOP_SIGNALS",
    "SIGNALS_TO_HANDLE_SINCE",
    "TORCHRUN_MODULE",
    "WORKER_SHUTDOWN_TIMEOUT_S",
    "build_torchrun_argv",
    "launch_torchrun",
    "stop_grace_options",
    "torchrun_accepts",
    "torchrun_parser",
]
