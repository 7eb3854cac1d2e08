"""Distributed helpers: torchrun environment, launch command, and a real 2-process gloo run.

The multi-process test starts this file as a script twice with the variables torchrun sets
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so `detect_dist_env` reads a real
launch environment; the workers write what they computed and the test compares.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from dflash_recipes.errors import LaunchError
from dflash_recipes.executor.distributed import (
    DEFAULT_RDZV_ID,
    WORKER_SHUTDOWN_TIMEOUT_S,
    DistEnv,
    barrier,
    build_torchrun_argv,
    detect_dist_env,
    init_distributed,
    is_launched_process,
    is_main,
    launch_torchrun,
    shard_target_fsdp2,
    shutdown_distributed,
    wrap_ddp,
)

TORCHRUN_ENV = {
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}


# ---------------------------------------------------------------------------------------------
# detect_dist_env
# ---------------------------------------------------------------------------------------------


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


def test_single_process_helpers_are_no_ops() -> None:
    env = detect_dist_env("cpu", environ={})
    init_distributed(env)
    assert not torch.distributed.is_initialized()
    barrier(env)
    module = nn.Linear(2, 2)
    assert wrap_ddp(module, env) is module
    assert shard_target_fsdp2(module, env) is module
    shutdown_distributed()
    shutdown_distributed()


# ---------------------------------------------------------------------------------------------
# build_torchrun_argv / launch_torchrun
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# two processes, gloo
# ---------------------------------------------------------------------------------------------

GLOBAL_BATCH = 8
SGD_STEPS = 3
TEARDOWN_CYCLES = 5


class _Drafter(nn.Module):
    """A trainable head plus a frozen parameter standing in for the borrowed target weights."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.head = nn.Linear(4, 3)
        self.borrowed = nn.Parameter(torch.full((2,), float(rank)), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(x)
        return out


class _Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.norm = nn.LayerNorm(8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden: torch.Tensor = self.embed_tokens(ids)
        for layer in self.layers:
            hidden = torch.tanh(layer(hidden))
        out: torch.Tensor = self.norm(hidden)
        return out


class _Target(nn.Module):
    """Hugging Face shape: `model.layers` inside, `lm_head` outside."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _Decoder()
        self.lm_head = nn.Linear(8, 16, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lm_head(self.model(ids))
        return out


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(SGD_STEPS):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()


def _worker(out_dir: Path) -> None:
    from torch.distributed.tensor import DTensor

    env = detect_dist_env("cpu")
    init_distributed(env)
    init_distributed(env)  # idempotent
    result: dict[str, object] = {"rank": env.rank, "world_size": env.world_size}
    try:
        barrier(env)

        # DDP: each rank half of the global batch; start from different weights on purpose.
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(GLOBAL_BATCH, 4, generator=gen)
        y = torch.randn(GLOBAL_BATCH, 3, generator=gen)
        torch.manual_seed(100 + env.rank)
        ddp = wrap_ddp(_Drafter(env.rank), env)
        share = GLOBAL_BATCH // env.world_size
        lo = env.rank * share
        _train(ddp, x[lo : lo + share], y[lo : lo + share])
        drafter = ddp.module
        assert isinstance(drafter, _Drafter)
        torch.manual_seed(100)  # rank 0's initial weights, which DDP broadcast
        reference = _Drafter(0)
        _train(reference, x, y)
        result["ddp_weight"] = drafter.head.weight.tolist()
        result["ddp_bias"] = drafter.head.bias.tolist()
        result["single_weight"] = reference.head.weight.tolist()
        result["single_bias"] = reference.head.bias.tolist()
        result["borrowed_after_wrap"] = drafter.borrowed.tolist()

        # FSDP2: a frozen target sharded layer-wise gives the unsharded outputs.
        torch.manual_seed(0)
        target = _Target().requires_grad_(False)
        ids = torch.tensor([[1, 2, 3, 5, 8]])
        with torch.no_grad():
            expected = target(ids)
            shard_target_fsdp2(target, env)
            layer_weight = target.model.layers[0].weight
            result["layer_is_dtensor"] = isinstance(layer_weight, DTensor)
            result["layer_local_rows"] = (
                layer_weight.to_local().shape[0] if isinstance(layer_weight, DTensor) else None
            )
            result["embed_is_dtensor"] = isinstance(target.model.embed_tokens.weight, DTensor)
            result["fsdp_expected"] = expected.tolist()
            result["fsdp_got"] = target(ids).tolist()
            result["layer_resharded"] = isinstance(target.model.layers[0].weight, DTensor)
            # the drafter borrows these outside the target's forward
            result["borrowed_embed_shape"] = list(target.model.embed_tokens(ids).shape)
    finally:
        shutdown_distributed()
        shutdown_distributed()
    result["teardown_cycles"] = _teardown_cycles()
    (out_dir / f"rank{env.rank}.json").write_text(json.dumps(result), encoding="utf-8")


def _teardown_cycles() -> int:
    """Join, DDP backward, leave and drop the DDP module at once, several times.

    Without the drain in shutdown_distributed this hangs within a few cycles on torch 2.13:
    a gloo worker thread needs the GIL to release the backward's work item while the main
    thread, holding the GIL, joins it in the process group's destructor.
    """
    # The main thread keeps the GIL unless it blocks: the worst case, made the usual one.
    sys.setswitchinterval(5.0)
    done = 0
    for port in os.environ["TEARDOWN_PORTS"].split(","):
        os.environ["MASTER_PORT"] = port
        env = detect_dist_env("cpu")
        init_distributed(env)
        model = wrap_ddp(nn.Linear(64, 64), env)
        model(torch.randn(8, 64)).sum().backward()
        shutdown_distributed()
        del model
        done += 1
    return done


@pytest.mark.timing
def test_two_gloo_processes_match_one_process(tmp_path: Path) -> None:
    from testkit.numerics import assert_equal_up_to_rounding
    from testkit.ranks import free_port, run_ranks  # not at the top: ranks run this file

    env = {"TEARDOWN_PORTS": ",".join(str(free_port()) for _ in range(TEARDOWN_CYCLES))}
    argv = [sys.executable, __file__, str(tmp_path)]
    what = "the 2-process run (a process group teardown deadlock?)"
    ranks = run_ranks(argv, env=env, what=what)
    for rank, result in enumerate(ranks):
        assert result.returncode == 0, f"rank {rank} failed:\n{result.stdout}{result.stderr}"
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))

    assert (r0["rank"], r1["rank"], r0["world_size"]) == (0, 1, 2)
    for r in (r0, r1):
        # DDP's all-reduce sums the two halves' gradients in another order than one process
        # sums the whole batch: equal up to rounding (a wrong shard or scale is far off).
        for ddp, single in (("ddp_weight", "single_weight"), ("ddp_bias", "single_bias")):
            assert_equal_up_to_rounding(
                torch.tensor(r[ddp]), torch.tensor(r[single]), what=f"rank {r['rank']}'s {ddp}"
            )
        assert r["layer_is_dtensor"] and r["layer_resharded"]
        assert r["layer_local_rows"] == 4  # 8 rows split over 2 ranks
        assert not r["embed_is_dtensor"]
        assert_equal_up_to_rounding(
            torch.tensor(r["fsdp_got"]), torch.tensor(r["fsdp_expected"]), what="FSDP2's outputs"
        )
        assert r["borrowed_embed_shape"] == [1, 5, 8]
        assert r["teardown_cycles"] == TEARDOWN_CYCLES
    assert r0["ddp_weight"] == r1["ddp_weight"]
    assert r0["ddp_bias"] == r1["ddp_bias"]
    # frozen parameters are not broadcast by DDP (each rank loads them itself)
    assert r1["borrowed_after_wrap"] == [1.0, 1.0]


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
