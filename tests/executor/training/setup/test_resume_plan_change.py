"""A resume with a changed plan says what changed and refuses what cannot be continued (issue 49:
max_steps 4 -> 6 resumed with a higher learning rate and no word)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from testkit.compiling import tiny_scratch_plan

from dflash_recipes.errors import PlanError
from dflash_recipes.executor.training.fit import run_plan
from dflash_recipes.executor.training.setup.optimizer import build_optimization, lr_factor
from dflash_recipes.executor.training.setup.resume import plan_change, saved_plan
from dflash_recipes.files.run_dir import OPTIMIZER_STATE, PLAN_FILE, checkpoint_dir_name
from dflash_recipes.plan.resume_changes import ARCHITECTURE, SCHEDULE, TAPS

pytestmark = pytest.mark.usefixtures("one_thread")

#: Four steps with a checkpoint after two; no warmup, a cosine schedule.
FOUR = ("training.save_steps=2", "training.warmup_ratio=0.0", "training.learning_rate=0.001")


def _stopped_after_two(run: Path, *overrides: str) -> Path:
    """A run of `FOUR` with max_steps 4 stopped (and saved) after step 2; its checkpoint."""
    run_plan(tiny_scratch_plan(run, *FOUR, "training.max_steps=4", *overrides), progress=False,
             stop_after=2)  # fmt: skip
    return run / checkpoint_dir_name(2)


def test_a_changed_max_steps_is_resumed_with_a_warning_that_names_the_new_rate(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    checkpoint = _stopped_after_two(run)
    assert (checkpoint / PLAN_FILE).read_text() == (run / PLAN_FILE).read_text()
    with caplog.at_level(logging.INFO, logger="dflash_recipes.train"):
        summary = run_plan(tiny_scratch_plan(run, *FOUR, "training.max_steps=6"), progress=False)
    assert summary.steps == 6
    before = 0.001 * lr_factor(2, total_steps=4, warmup_ratio=0.0, kind="cosine")
    after = 0.001 * lr_factor(2, total_steps=6, warmup_ratio=0.0, kind="cosine")
    said = [r.getMessage() for r in caplog.records if "changed plan" in r.getMessage()]
    assert said == [
        f"warning: resuming {checkpoint} (step 2) with a changed plan (the checkpoint's: "
        f"{checkpoint / PLAN_FILE}): training.max_steps 4 -> 6 changes {SCHEDULE}; the next "
        f"step's learning rate is {after:.3g} (it was to be {before:.3g})"
    ]
    assert f"{after:.3g}" == "0.00075" and f"{before:.3g}" == "0.0005"


def test_the_same_plan_resumed_says_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    _stopped_after_two(run)
    with caplog.at_level(logging.INFO, logger="dflash_recipes.train"):
        run_plan(tiny_scratch_plan(run, *FOUR, "training.max_steps=4"), progress=False)
    assert not [r for r in caplog.records if "changed plan" in r.getMessage()]


def test_a_changed_architecture_is_refused_before_anything_loads(tmp_path: Path) -> None:
    run = tmp_path / "run"
    checkpoint = _stopped_after_two(run)
    plan = tiny_scratch_plan(
        run,
        *FOUR,
        "training.max_steps=4",
        "dflash.dflash_architecture_config.num_hidden_layers=1",
        "dflash.dflash_architecture_config.target_layer_ids=[3]",
    )
    with pytest.raises(PlanError) as caught:
        plan_change(plan, checkpoint, run)
    assert str(caught.value) == (
        f"cannot resume {checkpoint} (step 2) with this plan: "
        f"draft.architecture.num_hidden_layers 2 -> 1 changes {ARCHITECTURE}; "
        f"draft.target_layer_ids [1,3] -> [3] changes {TAPS}; to resume, give these fields "
        f"the values of the plan that saved it ({checkpoint / PLAN_FILE}); to train the changed "
        "drafter, point training.output_dir at a new directory (a fresh run)"
    )
    metrics = (run / "metrics.jsonl").read_text()
    with pytest.raises(PlanError, match="cannot resume"):
        run_plan(plan, progress=False)
    assert (run / "metrics.jsonl").read_text() == metrics  # nothing trained, nothing logged


def test_a_checkpoint_without_its_copy_uses_the_run_directorys_plan_only_if_it_saved_it(
    tmp_path: Path,
) -> None:
    """Checkpoints saved before the copy was kept: plan.json counts when its fingerprint is the
    checkpoint's; otherwise the warning says the change cannot be named."""
    run = tmp_path / "run"
    checkpoint = _stopped_after_two(run)
    (checkpoint / PLAN_FILE).unlink()
    new = tiny_scratch_plan(run, *FOUR, "training.max_steps=6")
    assert saved_plan(checkpoint, run)[1] == str(run / PLAN_FILE)
    assert "training.max_steps 4 -> 6" in (plan_change(new, checkpoint, run) or "")
    other = tiny_scratch_plan(tmp_path / "other", *FOUR, "training.max_steps=5")
    shutil.copy(run / PLAN_FILE, tmp_path / "saved.json")
    (run / PLAN_FILE).write_text(other.to_json())
    line = plan_change(new, checkpoint, run)
    assert line is not None and line.startswith(f"warning: resuming {checkpoint} (step 2), saved")
    assert line.endswith(
        f"with plan {new.fingerprint[:16]}: {checkpoint.name} holds no copy of its plan and "
        f"{run / PLAN_FILE} is not the plan that saved it, so what changed cannot be said; "
        "compare the recipe with the one that started the run"
    )


def test_a_resume_trains_at_the_plans_learning_rate_and_weight_decay(tmp_path: Path) -> None:
    """load_state_dict brings back the checkpoint's lr, initial_lr, weight_decay and base_lrs:
    follow_plan puts the new plan's back (before it, a changed learning_rate was logged and
    not used)."""
    params = [torch.nn.Parameter(torch.ones(3))]
    old = tiny_scratch_plan(tmp_path / "a", "training.max_steps=4", "training.learning_rate=0.001")
    new = tiny_scratch_plan(
        tmp_path / "a",
        "training.max_steps=4",
        "training.learning_rate=0.002",
        "training.weight_decay=0.1",
    )
    first = build_optimization(old, params, batches_per_epoch=10)
    for _ in range(2):
        params[0].grad = torch.ones(3)
        first.optimizer.step()
        first.scheduler.step()
    second = build_optimization(new, params, batches_per_epoch=10)
    second.optimizer.load_state_dict(first.optimizer.state_dict())
    second.scheduler.load_state_dict(first.scheduler.state_dict())
    assert second.optimizer.param_groups[0]["lr"] == first.optimizer.param_groups[0]["lr"]
    second.follow_plan(2)
    group = second.optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(second.lr_at(2))
    assert group["lr"] == pytest.approx(2 * first.optimizer.param_groups[0]["lr"])
    assert group["weight_decay"] == 0.1
    second.optimizer.step()
    second.scheduler.step()
    assert group["lr"] == pytest.approx(second.lr_at(3))
    assert second.optimizer.state_dict()["state"][0]["step"].item() == 3  # Adam's count kept


def test_a_resumed_run_saves_the_new_plans_rate_and_decay(tmp_path: Path) -> None:
    """The run itself applies follow_plan: the last checkpoint's optimiser state holds the new
    peak rate and weight decay, not the first run's."""
    run = tmp_path / "run"
    _stopped_after_two(run)
    run_plan(
        tiny_scratch_plan(
            run, *FOUR, "training.max_steps=4", "training.learning_rate=0.002",
            "training.weight_decay=0.1",
        ),
        progress=False,
    )  # fmt: skip
    state = torch.load(run / checkpoint_dir_name(4) / OPTIMIZER_STATE, weights_only=True)
    (group,) = state["optimizer"]["param_groups"]
    assert (group["initial_lr"], group["weight_decay"]) == (0.002, 0.1)
    assert state["scheduler"]["base_lrs"] == [0.002]
