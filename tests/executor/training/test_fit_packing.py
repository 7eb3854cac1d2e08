"""Training on packed rows end to end: a resume mid-epoch continues with the very rows (and so
the very weights) of an uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from testkit.compiling import tiny_scratch_plan

from dflash_recipes.executor.training.fit import run_plan
from dflash_recipes.plan.run_plan import RunPlan

pytestmark = pytest.mark.usefixtures("one_thread")


def _plan(tmp_path: Path, name: str) -> RunPlan:
    return tiny_scratch_plan(
        tmp_path / name,
        "training.max_steps=4",
        "training.save_steps=2",
        "training.save_total_limit=null",
        "data.packing=true",
    )


def test_a_packed_run_resumed_mid_epoch_trains_the_same_rows_as_an_uninterrupted_one(
    tmp_path: Path,
) -> None:
    straight = _plan(tmp_path, "straight")
    assert straight.data.packing  # 60 conversations: 60 rows of 64, 30 batches an epoch
    run_plan(straight, progress=False)
    half = _plan(tmp_path, "halves")
    run_plan(half, progress=False, stop_after=2)
    resumed = _plan(tmp_path, "halves")
    assert resumed.resume is not None and resumed.resume.step == 2
    run_plan(resumed, progress=False)
    a = load_file(str(tmp_path / "straight" / "export" / "model.safetensors"))
    b = load_file(str(tmp_path / "halves" / "export" / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[name], b[name]) for name in a)
