"""The process group's timeout is the plan's ``training.distributed_timeout_s`` (issue 51)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from testkit.compiling import tiny_scratch_plan
from testkit.ranks import run_ranks

import dflash_recipes.executor.data.capture as capture_module
import dflash_recipes.executor.training.fit as fit_module

#: Rank 1 stays away from the barrier longer than the group's timeout; rank 0 reports how long
#: its barrier waited and how it ended.
_LATE_RANK = """
import json, sys, time
from dflash_recipes.executor.collectives import barrier
from dflash_recipes.executor.dist_env import detect_dist_env, init_distributed, shutdown_distributed
env = detect_dist_env("cpu")
init_distributed(env, timeout_s=float(sys.argv[1]))
if env.rank == 1:
    time.sleep(12)
    sys.exit(0)
began = time.monotonic()
try:
    barrier(env)
    outcome = "returned"
except Exception as exc:
    outcome = type(exc).__name__ + ": " + str(exc)[:300]
print(json.dumps({"waited": time.monotonic() - began, "outcome": outcome}))
"""


def test_a_collective_fails_after_the_plans_timeout_not_torchs_default() -> None:
    ranks = run_ranks([sys.executable, "-c", _LATE_RANK, "3"], what="the late-rank barrier")
    assert ranks[0].returncode == 0, ranks[0].stderr[-2000:]
    report = json.loads(ranks[0].stdout.strip().splitlines()[-1])
    # 3 s asked; without it gloo's default (30 min) would wait until rank 1 left, at 12 s
    assert report["outcome"] != "returned", report
    assert report["waited"] < 9, report


class _Joined(Exception):
    """Stops the command at the process group, once what it was given is recorded."""


def test_run_and_capture_give_the_plans_timeout_to_the_process_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = tiny_scratch_plan(tmp_path / "run", "training.distributed_timeout_s=77")
    assert plan.training.distributed_timeout_s == 77
    assert json.loads(plan.to_json())["training"]["distributed_timeout_s"] == 77
    given: list[Any] = []

    def joined(env: Any, *, timeout_s: float | None = None) -> None:
        given.append(timeout_s)
        raise _Joined

    monkeypatch.setattr(fit_module, "init_distributed", joined)
    monkeypatch.setattr(capture_module, "init_distributed", joined)
    with pytest.raises(_Joined):
        fit_module.run_plan(plan, progress=False)
    with pytest.raises(_Joined):
        capture_module.capture_plan(plan, tmp_path / "capture", progress=False)
    assert given == [77, 77]
    default = tiny_scratch_plan(tmp_path / "default")
    assert default.training.distributed_timeout_s == 1800
