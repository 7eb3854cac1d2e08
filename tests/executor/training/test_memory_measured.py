"""The compile-time memory estimate against real CPU training steps, for what issue 51 added:
activation checkpointing (one process) and the drafter sharded with FSDP2 (two gloo ranks).

The estimate's exact parts (weights, gradients, AdamW's states) must equal the bytes the
process holds, and its activations the peak of the bytes allocated over a micro-step within
:data:`TOLERANCE`, as ``benchmarks/bench_memory.py`` holds them for the rest.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from testkit.memory_measure import Shape, measure_sharded_rank, measured_step, measurement_plan

from dflash_recipes.plan.resources.estimate import estimate_resources

TOLERANCE = 0.15
#: bench_memory's `medium`: long enough rows and enough anchors that activations dominate.
MEDIUM = Shape(seq=1024, batch=2, anchors=128, block=16, width=256, target_layers=8, heads=4)
TESTS = Path(__file__).resolve().parents[2]


def _within(estimate: int, measured: int) -> bool:
    return abs(estimate / measured - 1) <= TOLERANCE


@pytest.mark.slow
def test_activation_checkpointing_is_sized_as_a_real_step_holds_it(tmp_path: Path) -> None:
    plan = measurement_plan(tmp_path, MEDIUM, "training.activation_checkpointing=true")
    estimate = estimate_resources(plan, device="cpu")
    measured = measured_step(plan)
    assert estimate.activation_checkpointing
    memory = estimate.memory
    assert memory.target_weights == measured.target_bytes
    assert memory.drafter_weights == measured.drafter_bytes
    assert estimate.gradient_bytes == measured.grad_bytes
    assert memory.optimizer_states == measured.optimizer_bytes
    ratio = memory.activations / measured.peak_bytes
    assert _within(memory.activations, measured.peak_bytes), f"estimate / measured {ratio:.3f}"
    # and the same step without it holds more, as the estimate says
    plain = measurement_plan(tmp_path, MEDIUM)
    off = measured_step(plain)
    assert off.peak_bytes > measured.peak_bytes
    assert estimate_resources(plain, device="cpu").memory.activations > memory.activations


@pytest.mark.slow
def test_a_sharded_drafter_is_sized_as_each_rank_holds_it(tmp_path: Path) -> None:
    from testkit.ranks import run_ranks

    plan = measurement_plan(tmp_path, MEDIUM, "training.fsdp=true")  # writes the target once
    estimate = estimate_resources(plan, world_size=2, device="cpu")
    env = {"PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, __file__, str(tmp_path)]
    for rank, done in enumerate(run_ranks(argv, env=env, what="the sharded measurement")):
        assert done.returncode == 0, f"rank {rank} failed:\n{done.stdout}{done.stderr}"
    single = estimate_resources(plan, world_size=1, device="cpu")
    assert estimate.drafter_sharded and estimate.fsdp_sharded
    assert estimate.memory.drafter_weights * 2 == single.memory.drafter_weights  # even dims
    for rank in range(2):
        measured = json.loads((tmp_path / f"rank{rank}.json").read_text())
        memory = estimate.memory
        assert memory.target_weights == measured["target_bytes"], f"rank {rank}"
        assert memory.drafter_weights == measured["drafter_bytes"], f"rank {rank}"
        assert estimate.gradient_bytes == measured["grad_bytes"], f"rank {rank}"
        assert memory.optimizer_states == measured["optimizer_bytes"], f"rank {rank}"
        ratio = memory.activations / measured["peak_bytes"]
        assert _within(memory.activations, measured["peak_bytes"]), (
            f"rank {rank}: estimate / measured {ratio:.3f}"
        )


def _worker(folder: Path) -> None:
    measure_sharded_rank(folder, MEDIUM)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
