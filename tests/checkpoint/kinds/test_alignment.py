"""The shift_label rules a head kind shares: compile findings and the trained-for note."""

from __future__ import annotations

from dflash_recipes.checkpoint.kinds.alignment import (
    FIELD_DIFFERS,
    TRAINED_FOR,
    TrainedDetail,
    shift_label_findings,
    trained_for_note,
)
from dflash_recipes.recipe.sections import DFlashArchitectureConfig

SHIFTED = DFlashArchitectureConfig(projector_type="dspark", markov_rank=4)
UNSHIFTED = DFlashArchitectureConfig(projector_type="dspark", markov_rank=4, shift_label=False)


def test_a_checkpoint_that_states_no_boolean_shift_gives_nothing() -> None:
    for nested in ({}, {"shift_label": None}, {"shift_label": 1}, {"shift_label": "false"}):
        assert shift_label_findings("dspark", nested, SHIFTED) == []
        assert trained_for_note("ckpt", nested, SHIFTED, "dspark vanilla") is None


def test_an_earlier_export_is_said_and_the_other_alignment_warns() -> None:
    findings = shift_label_findings("dspark", {"shift_label": False}, SHIFTED)
    assert [(f.code, f.field) for f in findings] == [
        (TRAINED_FOR, "shift_label"),
        (FIELD_DIFFERS, "shift_label"),
    ]
    assert findings[0].message.startswith("the checkpoint's dspark head was trained with")
    assert "`dflash_config.shift_label: false`: the checkpoint's head predicts anchor + k at" in (
        findings[1].message
    )
    # the recipe that keeps the earlier alignment is only told what the checkpoint is
    kept = shift_label_findings("dspark", {"shift_label": False}, UNSHIFTED)
    assert [f.code for f in kept] == [TRAINED_FOR]
    newer = shift_label_findings("dspark", {"shift_label": True}, UNSHIFTED)
    assert [f.code for f in newer] == [FIELD_DIFFERS]


def test_the_trained_for_note_says_whether_the_plan_drafts_as_trained() -> None:
    note = trained_for_note("ckpt", {"shift_label": False}, UNSHIFTED, "dspark vanilla")
    assert note == (
        "note: ckpt was trained for shift_label false (block position k predicts anchor + k), "
        "as earlier dflash-recipes exports were; the plan drafts it so",
        False,
    )
    differs = trained_for_note("ckpt", {"shift_label": False}, SHIFTED, "dspark vanilla")
    assert differs is not None and differs[1]
    assert differs[0].endswith(
        "the plan drafts it as dspark vanilla, which it was not trained for: set "
        "dflash_architecture_config.shift_label: false to use it as trained"
    )
    assert trained_for_note("ckpt", {"shift_label": True}, SHIFTED, "dspark vanilla") is None


def test_a_kinds_own_field_makes_the_plan_differ() -> None:
    detail = TrainedDetail("pure_draft_prefix_len", 2, 1)
    note = trained_for_note("ckpt", {"shift_label": True}, SHIFTED, "domino", detail=detail)
    assert note is not None and note[1]
    assert "pure_draft_prefix_len 2)" in note[0]
