"""Decisions the ranks share: rank 0 decides and every rank receives, on real 2-rank gloo groups.

The helpers first (an answer, a refusal, a crash, a measurement, a failure on one rank, plans
that differ), then the two rules a run relies on: a rank whose view of ``output_dir`` is stale
still resumes at rank 0's step, and ranks that compiled different plans stop before any work,
every one of them with the message naming each rank's fingerprint.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from testkit.compiling import tiny_scratch_plan
from testkit.ranks import run_ranks

from dflash_recipes.executor.coordination import (
    rank0_decides,
    rank0_measurement,
    require_same_plan,
    stop_if_any_rank_failed,
)
from dflash_recipes.executor.dist_env import detect_dist_env
from dflash_recipes.executor.training.fit import run_plan
from dflash_recipes.files.run_dir import checkpoint_dir_name, complete_checkpoints

pytestmark = pytest.mark.usefixtures("one_thread")

_HELPERS = """
import json
from dflash_recipes.errors import CheckpointError, PlanError
from dflash_recipes.executor.coordination import (
    rank0_decides, rank0_measurement, require_same_plan, stop_if_any_rank_failed,
)
from dflash_recipes.executor.dist_env import detect_dist_env, init_distributed, shutdown_distributed
env = detect_dist_env("cpu")
init_distributed(env)
out = {}
out["answer"] = rank0_decides(lambda: f"rank {env.rank}'s view", env)
out["none"] = rank0_decides(lambda: None, env)
def refuse():
    raise CheckpointError(f"refused on rank {env.rank}")
def crash():
    raise ValueError("boom")
for name, decide in (("refusal", refuse), ("crash", crash)):
    try:
        rank0_decides(decide, env)
    except Exception as exc:
        out[name] = [type(exc).__name__, str(exc)]
out["tau"] = rank0_measurement(2.5 if env.rank == 0 else None, env)
out["no tau"] = rank0_measurement(None if env.rank == 0 else 3.0, env)
try:
    problem = CheckpointError("rank 1's own reason") if env.rank == 1 else None
    stop_if_any_rank_failed(problem, env, what="read x", error=CheckpointError)
except CheckpointError as exc:
    out["failed"] = str(exc)
stop_if_any_rank_failed(None, env, what="read y")
try:
    require_same_plan(("a" if env.rank == 0 else "b") * 64, env)
except PlanError as exc:
    out["plans"] = str(exc)
require_same_plan("c" * 64, env)
shutdown_distributed()
print(json.dumps(out))
"""


def _reports(argv: list[str], what: str) -> list[dict[str, object]]:
    reports = []
    for rank, result in enumerate(run_ranks(argv, what=what, timeout=240)):
        assert result.returncode == 0, f"rank {rank}:\n{result.stderr[-3000:]}"
        reports.append(json.loads(result.stdout.strip().splitlines()[-1]))
    return reports


def test_rank_0_decides_and_every_rank_receives_its_answer_or_its_error() -> None:
    r0, r1 = _reports([sys.executable, "-c", _HELPERS], "the coordination helpers")
    assert r0["answer"] == r1["answer"] == "rank 0's view"
    assert r0["none"] is None and r1["none"] is None
    # rank 0's refusal is every rank's, same class and message; no rank is left waiting
    assert r0["refusal"] == r1["refusal"] == ["CheckpointError", "refused on rank 0"]
    assert r0["crash"] == ["ValueError", "boom"]
    assert r1["crash"] == ["DFlashRecipeError", "rank 0 stopped (ValueError): boom"]
    assert r0["tau"] == r1["tau"] == 2.5
    assert r0["no tau"] is None and r1["no tau"] is None
    assert r1["failed"] == "rank 1's own reason"
    assert r0["failed"] == "rank 1 could not read x; its own error says why"
    for report in (r0, r1):
        assert f"rank 0 {'a' * 16}, rank 1 {'b' * 16}" in str(report["plans"])
        assert "dflash-recipe compile RECIPE -o plan.json" in str(report["plans"])


def test_a_single_process_decides_alone() -> None:
    env = detect_dist_env("cpu", {})
    assert rank0_decides(lambda: "mine", env) == "mine"
    assert rank0_measurement(1.5, env) == 1.5
    stop_if_any_rank_failed(None, env, what="anything")
    require_same_plan("a" * 64, env)


_RANK_RUN = """
import json, os, sys
from pathlib import Path
from dflash_recipes.errors import CheckpointError, DFlashRecipeError
from dflash_recipes.executor.training.fit import run_plan
from dflash_recipes.executor.training.setup import resume
from dflash_recipes.plan.run_plan import RunPlan
rank = int(os.environ["RANK"])
plan = RunPlan.from_json(Path(sys.argv[1].replace("RANK", str(rank))).read_bytes())
if sys.argv[2] == "disagreeing views":
    if rank == 0:  # a read error on this node for the newest checkpoint
        real_restore = resume.restore_training_checkpoint
        def failing(path, *args):
            if path.name == sys.argv[3]:
                raise CheckpointError(f"{path}: Input/output error")
            return real_restore(path, *args)
        resume.restore_training_checkpoint = failing
    else:  # a stale view of output_dir on this node: no checkpoint listed yet
        resume.latest_complete_checkpoint = lambda output_dir: None
try:
    summary = run_plan(plan, progress=False)
except DFlashRecipeError as exc:
    print(json.dumps({"error": str(exc)}))
else:
    print(json.dumps({"resumed": summary.resumed_from_step, "steps": summary.steps}))
"""


def _small_run(*extra: str) -> list[str]:
    return [
        "training.max_steps=4",
        "training.save_steps=1",
        "training.save_total_limit=null",
        "training.per_device_train_batch_size=1",
        *extra,
    ]


@pytest.mark.slow
def test_ranks_that_see_the_checkpoints_differently_all_start_at_rank_0s_step(
    tmp_path: Path,
) -> None:
    # A requeued job reusing its plan: it continues the checkpoints this plan wrote. Rank 0
    # cannot read the newest (3) and falls back to 2; rank 1 lists no checkpoint at all.
    out = tmp_path / "run"
    plan = tiny_scratch_plan(out, *_small_run())
    run_plan(plan, progress=False, stop_after=3)
    newest = complete_checkpoints(out)[-1][1]
    assert newest.name == checkpoint_dir_name(3)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.to_json(), encoding="utf-8")

    argv = [sys.executable, "-c", _RANK_RUN, str(plan_file), "disagreeing views", newest.name]
    r0, r1 = _reports(argv, "ranks that resumed from different steps")
    assert r0 == r1 == {"resumed": 2, "steps": 4}


@pytest.mark.slow
def test_ranks_that_compiled_different_plans_stop_before_any_work(tmp_path: Path) -> None:
    out = tmp_path / "run"
    plans = [
        tiny_scratch_plan(out, *_small_run(), f"training.learning_rate={lr}")
        for lr in ("0.001", "0.002")
    ]
    for rank, plan in enumerate(plans):
        (tmp_path / f"plan{rank}.json").write_text(plan.to_json(), encoding="utf-8")
    argv = [sys.executable, "-c", _RANK_RUN, str(tmp_path / "planRANK.json"), "same view"]
    r0, r1 = _reports(argv, "ranks holding different plans")
    names = f"rank 0 {plans[0].fingerprint[:16]}, rank 1 {plans[1].fingerprint[:16]}"
    for report in (r0, r1):
        assert names in str(report.get("error")), report
    assert not out.exists()  # nothing was loaded, trained or written
