"""Loading a saved drafter's weights exactly: a known checkpoint layout loads like the z-lab one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from testkit.tiny import tiny_plan

from dflash_recipes.errors import CheckpointError
from dflash_recipes.executor.model.draft import DFlashDraftModel
from dflash_recipes.executor.model.export import export_drafter
from dflash_recipes.executor.model.weights import load_drafter_weights


def test_an_export_stored_in_the_museglimmer_layout_loads_exactly(tmp_path: Path) -> None:
    plan = tiny_plan(tmp_path)
    trained = DFlashDraftModel(plan.resolved_draft(), generator=torch.Generator().manual_seed(3))
    out = export_drafter(trained, plan, tmp_path / "export", dtype="float32")
    source = load_file(str(out / "model.safetensors"))
    renames = {
        "fc.weight": "encoder.fc.weight",
        "hidden_norm.weight": "encoder.output_norm_enc.weight",
    }
    save_file({renames.get(n, n): t for n, t in source.items()}, str(out / "model.safetensors"))
    drafter = DFlashDraftModel(plan.resolved_draft(), generator=torch.Generator().manual_seed(4))
    assert load_drafter_weights(drafter, out) == len(source)
    state = drafter.state_dict()
    assert all(torch.equal(state[n], source[n]) for n in source)
    # both names of one parameter: refused, never a silent pick
    save_file(
        {**source, "encoder.fc.weight": source["fc.weight"].clone()}, str(out / "model.safetensors")
    )
    with pytest.raises(CheckpointError, match="same drafter parameter"):
        load_drafter_weights(drafter, out)
