"""The torchrun environment: what a worker reads from it, and how a wrong one is explained."""

from __future__ import annotations

import pytest
import torch

from dflash_recipes.errors import LaunchError
from dflash_recipes.executor.dist_env import (
    DistEnv,
    detect_dist_env,
    is_launched_process,
    is_main,
)

TORCHRUN_ENV = {
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}


def test_no_launcher_variables_is_a_single_cpu_process() -> None:
    env = detect_dist_env("cpu", environ={"MASTER_ADDR": "somehost"})
    assert env == DistEnv(
        rank=0,
        world_size=1,
        local_rank=0,
        is_distributed=False,
        backend="gloo",
        device=torch.device("cpu"),
    )
    assert is_main(env)


def test_torchrun_environment_is_read() -> None:
    env = detect_dist_env("cpu", environ=TORCHRUN_ENV)
    assert (env.rank, env.world_size, env.local_rank) == (1, 2, 1)
    assert env.is_distributed
    assert env.backend == "gloo"
    assert not is_main(env)
    assert is_launched_process(TORCHRUN_ENV)
    assert not is_launched_process({"LOCAL_RANK": "0"})


def test_world_size_one_under_torchrun_is_not_distributed() -> None:
    env = detect_dist_env("cpu", environ={"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    assert not env.is_distributed


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"RANK": "0"}, "WORLD_SIZE, LOCAL_RANK not"),
        ({"RANK": "0", "LOCAL_RANK": "0"}, "WORLD_SIZE not"),
        ({**TORCHRUN_ENV, "RANK": "2"}, "RANK=2 is outside 0..1"),
        ({**TORCHRUN_ENV, "WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE=0 must be at least 1"),
        ({**TORCHRUN_ENV, "RANK": "one"}, "RANK='one' is not an integer"),
        ({**TORCHRUN_ENV, "RANK": "0", "LOCAL_RANK": "1"}, "LOCAL_RANK=1 is inconsistent"),
        ({k: v for k, v in TORCHRUN_ENV.items() if k != "MASTER_ADDR"}, "MASTER_ADDR not set"),
        ({**TORCHRUN_ENV, "MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port"),
    ],
)
def test_partial_or_inconsistent_environment_says_how_to_launch(
    environ: dict[str, str], expected: str
) -> None:
    with pytest.raises(LaunchError) as info:
        detect_dist_env("cpu", environ=environ)
    assert expected in str(info.value)
    assert "--nproc-per-node" in str(info.value)


def test_cuda_requested_without_cuda_names_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(LaunchError, match=r"set training\.device: cpu"):
        detect_dist_env("cuda", environ={})
    assert detect_dist_env("auto", environ={}).device == torch.device("cpu")


def test_cuda_picks_the_local_rank_gpu_and_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    env = detect_dist_env("auto", environ=TORCHRUN_ENV)
    assert env.device == torch.device("cuda", 1)
    assert env.backend == "nccl"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(LaunchError, match="only 1 CUDA device"):
        detect_dist_env("cuda", environ=TORCHRUN_ENV)
