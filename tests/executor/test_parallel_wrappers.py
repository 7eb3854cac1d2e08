"""DDP and FSDP2 wrappers: no-ops for one process, and a real 2-process gloo run.

The multi-process test starts this file as a script twice with the variables torchrun sets
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so `detect_dist_env` reads a real
launch environment; the workers write what they computed and the test compares.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from dflash_recipes.executor.collectives import barrier
from dflash_recipes.executor.dist_env import detect_dist_env, init_distributed, shutdown_distributed
from dflash_recipes.executor.parallel_wrappers import shard_target_fsdp2, wrap_ddp


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
