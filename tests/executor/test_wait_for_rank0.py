"""A rank that waits for rank 0's solitary work past training.distributed_timeout_s says which
rank it waited for and what that rank was doing (issue 51, "every rank in step")."""

from __future__ import annotations

import json
import sys

from testkit.ranks import run_ranks

#: Rank 0 works alone for longer than the timeout; rank 1 reports how its wait ended.
_SLOW_RANK0 = """
import json, sys, time
from dflash_recipes.executor.coordination import wait_for_rank0
from dflash_recipes.executor.dist_env import detect_dist_env, init_distributed
env = detect_dist_env("cpu")
init_distributed(env, timeout_s=float(sys.argv[1]))
if env.rank == 0:
    time.sleep(float(sys.argv[2]))
began = time.monotonic()
try:
    wait_for_rank0(env, "save the checkpoint of step 7", timeout_s=float(sys.argv[1]))
    outcome = "returned"
except Exception as exc:
    outcome = type(exc).__name__ + ": " + str(exc)
print(json.dumps({"waited": time.monotonic() - began, "outcome": outcome}))
sys.stdout.flush()
import os
os._exit(0)
"""


def test_a_rank_that_waits_too_long_for_rank_0_says_for_what() -> None:
    ranks = run_ranks([sys.executable, "-c", _SLOW_RANK0, "2", "12"], what="the slow rank 0")
    assert ranks[1].returncode == 0, ranks[1].stderr[-2000:]
    report = json.loads(ranks[1].stdout.strip().splitlines()[-1])
    assert report["waited"] < 10, report
    outcome = report["outcome"]
    assert outcome.startswith(
        "RanksOutOfStepError: rank 1 stopped waiting for rank 0 to save the checkpoint of step 7"
    ), outcome
    assert "training.distributed_timeout_s: 2" in outcome
    # rank 0, back from its work to find rank 1 gone, does not blame itself
    assert ranks[0].returncode == 0, ranks[0].stderr[-2000:]
    own = json.loads(ranks[0].stdout.strip().splitlines()[-1])["outcome"]
    assert own.startswith(
        "RanksOutOfStepError: rank 0 stopped waiting for the other ranks to meet it after its "
        "solitary work (save the checkpoint of step 7)"
    ), own


def test_ranks_that_meet_in_time_go_on() -> None:
    ranks = run_ranks([sys.executable, "-c", _SLOW_RANK0, "30", "1"], what="rank 0 in time")
    for result in ranks:
        assert result.returncode == 0, result.stderr[-2000:]
        assert json.loads(result.stdout.strip().splitlines()[-1])["outcome"] == "returned"
