"""Loading a saved drafter's weights exactly: a known checkpoint layout loads like the z-lab one,
and exports of an earlier dflash-recipes (shift_label false) still load, with one line saying
what they were trained for (issue 25)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from testkit.tiny import randomize, tiny_plan

from dflash_recipes.errors import CheckpointError
from dflash_recipes.executor.model.draft import DFlashDraftModel
from dflash_recipes.executor.model.export import export_drafter
from dflash_recipes.executor.model.weights import load_drafter_weights

pytestmark = pytest.mark.usefixtures("one_thread")


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


DOMINO = {"projector_type": "domino", "emb_dim": 16, "gru_hidden_dim": 8}
#: What this project's Domino exports said before issue 25.
EARLIER = {"shift_label": False, "pure_draft_prefix_len": 0}


def _old_export(tmp_path: Path) -> tuple[Path, DFlashDraftModel]:
    plan = tiny_plan(tmp_path / "old", **DOMINO, **EARLIER)
    drafter = DFlashDraftModel(plan.resolved_draft())
    randomize(drafter, seed=4)
    return export_drafter(drafter, plan, tmp_path / "old-export", dtype="float32"), drafter


def _notes(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage().startswith("note: ")]


def test_an_earlier_export_loads_into_todays_plan_with_a_one_line_note(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    export, old = _old_export(tmp_path)
    drafter = DFlashDraftModel(tiny_plan(tmp_path, **DOMINO).resolved_draft())
    with caplog.at_level(logging.INFO):
        count = load_drafter_weights(drafter, export)
    assert count == len(old.state_dict())
    for name, tensor in old.state_dict().items():
        assert torch.equal(drafter.state_dict()[name], tensor), name
    (note,) = _notes(caplog)
    message = note.getMessage()
    assert note.levelno == logging.WARNING and "\n" not in message
    assert "was trained for shift_label false (block position k predicts anchor + k" in message
    assert "pure_draft_prefix_len 0" in message and "earlier dflash-recipes" in message
    assert "set dflash_architecture_config.shift_label: false and pure_draft_prefix_len: 0" in (
        message
    )


def test_an_earlier_export_loaded_as_it_was_trained_gets_an_info_note(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    export, _ = _old_export(tmp_path)
    drafter = DFlashDraftModel(tiny_plan(tmp_path, **DOMINO, **EARLIER).resolved_draft())
    with caplog.at_level(logging.INFO):
        load_drafter_weights(drafter, export)
    (note,) = _notes(caplog)
    assert note.levelno == logging.INFO
    assert "the plan drafts it so" in note.getMessage()


def test_todays_export_loads_silently(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    plan = tiny_plan(tmp_path, **DOMINO)
    export = export_drafter(DFlashDraftModel(plan.resolved_draft()), plan, tmp_path / "export")
    drafter = DFlashDraftModel(plan.resolved_draft())
    with caplog.at_level(logging.INFO):
        load_drafter_weights(drafter, export)
    assert _notes(caplog) == []
