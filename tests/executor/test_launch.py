"""The torchrun launch command of `run`/`capture --nproc-per-node`, and its exit codes."""

from __future__ import annotations

import signal
import sys

import pytest

from dflash_recipes.errors import LaunchError
from dflash_recipes.executor.distributed import (
    DEFAULT_RDZV_ID,
    WORKER_SHUTDOWN_TIMEOUT_S,
    build_torchrun_argv,
    launch_torchrun,
)


def _parse_as_torchrun(argv: list[str]) -> dict[str, object]:
    """Parse our command with torchrun's own parser, so the flags are ones torchrun accepts."""
    from torch.distributed.run import get_args_parser

    assert argv[:3] == [sys.executable, "-m", "dflash_recipes.executor.torchrun"]
    return vars(get_args_parser().parse_args(argv[3:]))


def test_single_node_command_is_standalone() -> None:
    argv = build_torchrun_argv(["plan.json"], nproc_per_node=2)
    assert argv == [
        sys.executable,
        "-m",
        "dflash_recipes.executor.torchrun",
        "--nproc-per-node",
        "2",
        "--shutdown-timeout",
        str(WORKER_SHUTDOWN_TIMEOUT_S),
        "--standalone",
        "-m",
        "dflash_recipes.cli",
        "run",
        "plan.json",
    ]
    args = _parse_as_torchrun(argv)
    assert args["standalone"] is True
    assert args["shutdown_timeout"] == WORKER_SHUTDOWN_TIMEOUT_S
    assert args["nproc_per_node"] == "2"
    assert args["module"] is True
    assert args["training_script"] == "dflash_recipes.cli"
    assert args["training_script_args"] == ["run", "plan.json"]


def test_multi_node_command_uses_c10d_rendezvous() -> None:
    argv = build_torchrun_argv(
        ["recipe.yaml", "training.max_steps=10"],
        nproc_per_node=8,
        nnodes=4,
        rdzv_endpoint="node001:29500",
        rdzv_id="123456",
    )
    args = _parse_as_torchrun(argv)
    assert args["standalone"] is False
    assert (args["nnodes"], args["nproc_per_node"]) == ("4", "8")
    assert (args["rdzv_backend"], args["rdzv_endpoint"], args["rdzv_id"]) == (
        "c10d",
        "node001:29500",
        "123456",
    )
    assert args["training_script_args"] == ["run", "recipe.yaml", "training.max_steps=10"]
    default_id = build_torchrun_argv(["p.json"], nproc_per_node=1, rdzv_endpoint="[fd00::1]:29400")
    assert _parse_as_torchrun(default_id)["rdzv_id"] == DEFAULT_RDZV_ID


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"nproc_per_node": 0}, "--nproc-per-node must be a positive integer"),
        ({"nproc_per_node": 2, "nnodes": 0}, "--nnodes must be a positive integer"),
        ({"nproc_per_node": 2, "nnodes": 2}, "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
        ({"nproc_per_node": 2, "nnodes": 2, "rdzv_endpoint": "node001"}, "is not HOST:PORT"),
        ({"nproc_per_node": 2, "rdzv_endpoint": "node001:99999"}, "is not HOST:PORT"),
        ({"nproc_per_node": 2, "rdzv_endpoint": "bad host:1"}, "is not HOST:PORT"),
        ({"nproc_per_node": 2, "rdzv_id": "42"}, "--rdzv-id only applies with --rdzv-endpoint"),
        (
            {"nproc_per_node": 2, "rdzv_endpoint": "h:1", "rdzv_id": "a b"},
            "--rdzv-id 'a b' must be",
        ),
    ],
)
def test_invalid_launch_options_are_explained(kwargs: dict[str, object], expected: str) -> None:
    with pytest.raises(LaunchError) as info:
        build_torchrun_argv(["plan.json"], **kwargs)  # type: ignore[arg-type]
    assert expected in str(info.value)


def test_launch_options_are_not_forwarded_to_the_workers() -> None:
    with pytest.raises(LaunchError, match="would launch again"):
        build_torchrun_argv(["plan.json", "--nproc-per-node=2"], nproc_per_node=2)


def test_launch_returns_the_exit_code() -> None:
    assert launch_torchrun([sys.executable, "-c", "raise SystemExit(3)"]) == 0 + 3
    killed = "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"
    assert launch_torchrun([sys.executable, "-c", killed]) == 128 + signal.SIGTERM
    with pytest.raises(LaunchError, match="could not start"):
        launch_torchrun(["/nonexistent/torchrun-binary"])
