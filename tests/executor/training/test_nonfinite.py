"""A step whose gradient norm is NaN or Inf never reaches the weights (issue 51).

NaN is injected into one parameter's gradient just before the loop clips (the step's gradients
are all there then), at chosen 1-based optimiser steps of the real trainer on the tiny target.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from testkit.compiling import tiny_scratch_plan
from torch import Tensor, nn

import dflash_recipes.executor.training.fit as fit_module
import dflash_recipes.executor.training.train_step as train_step_module
from dflash_recipes.errors import TrainingDivergedError
from dflash_recipes.executor.training.checkpoints import prune_checkpoints
from dflash_recipes.files.run_dir import checkpoint_dir_name, complete_checkpoints

pytestmark = pytest.mark.usefixtures("one_thread")


def _inject_nan(monkeypatch: pytest.MonkeyPatch, steps: Collection[int]) -> None:
    """Make the gradient of the first trainable parameter NaN at `steps` (1-based)."""
    clip = train_step_module.clip_gradients
    calls = [0]

    def clip_with_nan(params: list[nn.Parameter], max_norm: float) -> Tensor:
        calls[0] += 1
        if calls[0] in steps:
            grad = params[0].grad
            assert grad is not None
            grad.fill_(float("nan"))
        return clip(params, max_norm)

    monkeypatch.setattr(train_step_module, "clip_gradients", clip_with_nan)


def _weights(checkpoint: Path) -> dict[str, Tensor]:
    return load_file(str(checkpoint / "model.safetensors"))


def _optimizer(checkpoint: Path) -> dict[str, object]:
    blob = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert isinstance(blob, dict)
    return blob


def _same_tensors(a: dict[str, Tensor], b: dict[str, Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_nan_step_is_skipped_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "run"
    plan = tiny_scratch_plan(
        out,
        "training.max_steps=3",
        "training.save_steps=1",
        "training.save_total_limit=null",
        "training.eval_steps=null",
    )
    _inject_nan(monkeypatch, {2})
    with caplog.at_level(logging.INFO, logger="dflash_recipes.train"):
        summary = fit_module.run_plan(plan, progress=False)
    assert summary.steps == 3
    one, two, three = (out / checkpoint_dir_name(step) for step in (1, 2, 3))
    # the skipped step changed no weight, and the next one trained again
    assert _same_tensors(_weights(one), _weights(two))
    assert not _same_tensors(_weights(two), _weights(three))
    assert all(torch.isfinite(t).all() for t in _weights(three).values())
    # AdamW's moments and step counters did not take it; the scheduler moved on (as GradScaler)
    before, after = _optimizer(one), _optimizer(two)
    states_before = before["optimizer"]["state"]  # type: ignore[index]
    states_after = after["optimizer"]["state"]  # type: ignore[index]
    for index, state in states_after.items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], states_before[index][key]), (index, key)
    assert after["scheduler"]["last_epoch"] == before["scheduler"]["last_epoch"] + 1  # type: ignore[index]
    # recorded in the trainer state, so pruning knows
    states = [json.loads((c / "trainer_state.json").read_text()) for c in (one, two, three)]
    assert [s["nonfinite_streak"] for s in states] == [0, 1, 0]
    # counted in metrics.jsonl and on the console at the logging step
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [(r["step"], r["skipped_steps"]) for r in train] == [(1, 0), (2, 1), (3, 0)]
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("step 2 ") and "skipped 1" in line for line in lines), lines
    assert not any(line.startswith("step 3 ") and "skipped" in line for line in lines)
    assert any("1 step(s) up to step 2 skipped" in line for line in lines), lines


def test_too_many_nan_steps_in_a_row_stop_the_run_keeping_the_last_good_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"
    plan = tiny_scratch_plan(
        out,
        "training.max_steps=8",
        "training.save_steps=1",
        "training.save_total_limit=1",
        "training.logging_steps=100",  # only the saves read the counters here
        "training.max_nonfinite_steps=3",
        "training.eval_steps=null",
    )
    _inject_nan(monkeypatch, {3, 4, 5})
    with pytest.raises(TrainingDivergedError) as caught:
        fit_module.run_plan(plan, progress=False)
    message = str(caught.value)
    assert "steps 3..5" in message and "training.max_nonfinite_steps: 3" in message
    assert "those of step 2" in message and "rerun" in message
    # nothing saved after the limit; the last good checkpoint outlived save_total_limit
    kept = [step for step, _ in complete_checkpoints(out)]
    assert kept == [2, 4]
    two, four = out / checkpoint_dir_name(2), out / checkpoint_dir_name(4)
    assert json.loads((two / "trainer_state.json").read_text())["nonfinite_streak"] == 0
    assert _same_tensors(_weights(two), _weights(four))  # the skipped steps changed nothing


def test_the_logging_step_stops_the_run_after_writing_its_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"
    plan = tiny_scratch_plan(
        out,
        "training.max_steps=6",
        "training.save_steps=100",
        "training.max_nonfinite_steps=2",
        "training.eval_steps=null",
    )
    _inject_nan(monkeypatch, {2, 3})
    with pytest.raises(TrainingDivergedError, match=r"after step 3: .*\(steps 2\.\.3;"):
        fit_module.run_plan(plan, progress=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["skipped_steps"]) for r in rows if r["kind"] == "train"] == [
        (1, 0),
        (2, 1),
        (3, 1),
    ]
    assert complete_checkpoints(out) == []


def test_pruning_keeps_the_newest_checkpoint_of_a_finite_step(tmp_path: Path) -> None:
    for step, streak in ((1, 0), (2, 0), (3, 1), (4, 2)):
        folder = tmp_path / checkpoint_dir_name(step)
        folder.mkdir()
        for name in ("model.safetensors", "optimizer.pt"):
            (folder / name).write_bytes(b"x")
        state = {"step": step, "nonfinite_streak": streak}
        (folder / "trainer_state.json").write_text(json.dumps(state))
    prune_checkpoints(tmp_path, 1, keep=tmp_path / checkpoint_dir_name(4))
    assert [step for step, _ in complete_checkpoints(tmp_path)] == [2, 4]
